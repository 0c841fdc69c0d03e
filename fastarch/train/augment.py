"""Mixup and CutMix (guide 000 APIs: ``forward(x, y) -> (mixed_x, mixed_y)`` with one-hot ``y``).

Both accept an optional ``generator`` for reproducibility and record the last mixing weight in
``self.last_lam`` (for CutMix, the weight after adjusting to the pasted box's true area).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RandomMixup", "RandomCutmix"]


def _beta(alpha: float, generator: torch.Generator | None) -> float:
    if alpha <= 0:
        return 1.0
    # Beta(a, a) from two gammas, so that a torch.Generator can drive it.
    g1 = torch._standard_gamma(torch.tensor([alpha]), generator=generator)
    g2 = torch._standard_gamma(torch.tensor([alpha]), generator=generator)
    return float(g1 / (g1 + g2))


def _check(x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    if y.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: y must be one-hot/soft labels (batch, num_classes) matching x's batch "
                         f"{x.shape[0]}, got {tuple(y.shape)}")


class _BatchMixer(nn.Module):
    """Mixes each sample with a random partner from the same batch, with a weight drawn from Beta(alpha, alpha)."""

    def __init__(self, alpha: float, generator: torch.Generator | None) -> None:
        super().__init__()
        self.alpha, self.generator = alpha, generator
        self.last_lam: float | None = None

    def _draw(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Check the labels; draw the weight and each sample's partner index ``(B,)``."""
        _check(x, y, type(self).__name__)
        lam = _beta(self.alpha, self.generator)
        return lam, torch.randperm(x.size(0), generator=self.generator).to(x.device)


class RandomMixup(_BatchMixer):
    """``x~ = lam x + (1-lam) x[perm]``, ``y~ = lam y + (1-lam) y[perm]`` with ``lam ~ Beta(alpha, alpha)``."""

    def __init__(self, alpha: float = 0.2, generator: torch.Generator | None = None) -> None:
        super().__init__(alpha, generator)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lam, index = self._draw(x, y)
        self.last_lam = lam
        return lam * x + (1 - lam) * x[index], lam * y + (1 - lam) * y[index]


class RandomCutmix(_BatchMixer):
    """Paste a random box from ``x[perm]`` into ``x`` ``(B, C, H, W)``; labels mix by the box's area."""

    def __init__(self, alpha: float = 1.0, generator: torch.Generator | None = None) -> None:
        super().__init__(alpha, generator)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 4:
            raise ValueError(f"RandomCutmix: x must be (batch, C, H, W), got {tuple(x.shape)}")
        lam, index = self._draw(x, y)
        _, _, H, W = x.shape
        cut = (1 - lam) ** 0.5
        cut_w, cut_h = int(W * cut), int(H * cut)
        cx = int(torch.randint(W, (1,), generator=self.generator))
        cy = int(torch.randint(H, (1,), generator=self.generator))
        x1, x2 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, W)
        y1, y2 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, H)
        out = x.clone()
        out[:, :, y1:y2, x1:x2] = x[index, :, y1:y2, x1:x2]
        lam = 1 - (x2 - x1) * (y2 - y1) / (W * H)
        self.last_lam = lam
        return out, lam * y + (1 - lam) * y[index]
