"""Helpers shared by the model families: layer norm through the op, and argument validation."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.layer_norm import layer_norm as _layer_norm_op


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """Apply an ``nn.LayerNorm`` module's parameters (last dimension) through ``fastarch.ops.layer_norm``."""
    return _layer_norm_op(x, norm.weight, norm.bias, norm.eps)


def keep_logits(x: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """The last ``logits_to_keep`` positions of x (B, L, ...) (0 = all), for language models' ``logits_to_keep``."""
    if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
        raise ValueError(f"argument 'logits_to_keep' must be an int >= 0 (0 = every position), got {logits_to_keep!r}")
    return x[:, -logits_to_keep:] if logits_to_keep else x


_GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh"}  # activation name -> nn.GELU's ``approximate``


class GELU(nn.GELU):
    """``nn.GELU`` with ``inplace`` (as ``nn.ReLU``'s): when set, the activation overwrites its input whenever
    autograd does not need that input, which saves a temporary as large as the input (a feed-forward's
    ``4E``-wide hidden state). Only for inputs nothing else reads, such as a projection's fresh output.
    ``forward(x (...)) -> (...)``."""

    def __init__(self, approximate: str = "none", inplace: bool = False) -> None:
        super().__init__(approximate=approximate)
        self.inplace = inplace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace and not (torch.is_grad_enabled() and input.requires_grad):
            return torch.ops.aten.gelu_(input, approximate=self.approximate)
        return super().forward(input)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", inplace=True" if self.inplace else "")


def gelu_module(activation: str, *, inplace: bool = False) -> GELU:
    """:class:`GELU` (an ``nn.GELU``) for ``"gelu"`` (exact) or ``"gelu_new"`` (the tanh approximation of
    GPT-2 checkpoints); ``inplace`` as :class:`GELU`'s."""
    if activation not in _GELU_APPROXIMATE:
        raise ValueError(f"argument 'activation' must be one of {sorted(_GELU_APPROXIMATE)}, got {activation!r}")
    return GELU(approximate=_GELU_APPROXIMATE[activation], inplace=inplace)


def check_input(name: str, t: object, *, ndim: int | tuple[int, ...] | None = None, last: int | None = None,
                integer: bool = False, owner: str = "") -> torch.Tensor:
    """Clear errors for bad module inputs: the argument, what was expected and what came."""
    where = f"{owner}: " if owner else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{where}argument '{name}' must have {want} dimensions, got shape {tuple(t.shape)}")
    if last is not None and t.shape[-1] != last:
        raise ValueError(f"{where}argument '{name}' must have last dimension {last}, got shape {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{where}argument '{name}' must hold integer token ids, got dtype {t.dtype}")
    return t


def key_padding_mask(mask: object, batch: int, length: int, owner: str) -> torch.Tensor | None:
    """A key mask, ``(B, L)`` or ``(B, 1, 1, L)`` with non-zero = real key, as ``(B, L)`` bool (or None)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{owner}: argument 'mask' must be a tensor or None, got {type(mask).__name__}")
    m = mask[:, 0, 0] if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1 else mask
    if m.dim() != 2 or m.shape[0] not in (1, batch) or m.shape[1] != length:
        raise ValueError(f"{owner}: argument 'mask' must be a key padding mask of shape ({batch}, {length}) or "
                         f"({batch}, 1, 1, {length}) (non-zero = keep), got {tuple(mask.shape)}")
    return (m != 0).expand(batch, length)
