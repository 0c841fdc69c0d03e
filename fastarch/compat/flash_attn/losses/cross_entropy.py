"""flash-attn's ``flash_attn.losses.cross_entropy.CrossEntropyLoss`` on any device (see
:func:`fastarch.compat.flash_attn.ops.triton.cross_entropy.cross_entropy_loss`)."""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

from .._missing import missing_attribute
from ..ops.triton.cross_entropy import cross_entropy_loss

__all__ = ["CrossEntropyLoss"]

__getattr__ = missing_attribute("flash_attn.losses.cross_entropy")


class CrossEntropyLoss(nn.Module):
    """Cross-entropy with label smoothing, ``logit_scale`` and z-loss (``lse_square_scale * lse**2`` added to each
    row's loss). ``forward(input, target, precomputed_lse=None)``: input ``(batch, vocab_size)``, target
    ``(batch,)``; returns the loss (``(batch,)`` with ``reduction='none'``, else a scalar: the mean over the
    non-ignored rows, or the sum), and ``(loss, z_loss)`` with ``return_z_loss`` (``z_loss`` reduced alike, no
    gradient)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_scale: float = 1.0, lse_square_scale: float = 0.0, inplace_backward: bool = False,
                 process_group=None, return_z_loss: bool = False) -> None:
        super().__init__()
        if reduction not in ("mean", "none", "sum"):
            raise NotImplementedError(f"flash_attn CrossEntropyLoss: 'reduction' must be 'mean', 'none' or 'sum', "
                                      f"got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def _reduce(self, t: Tensor, target: Tensor) -> Tensor:
        if self.reduction == "mean":
            return t.sum() / (target != self.ignore_index).sum()
        return t.sum() if self.reduction == "sum" else t

    def forward(self, input: Tensor, target: Tensor, precomputed_lse: Tensor | None = None):
        loss, z_loss = cross_entropy_loss(input, target, precomputed_lse=precomputed_lse,
                                          label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
                                          lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
                                          inplace_backward=self.inplace_backward, process_group=self.process_group)
        loss = self._reduce(loss, target)
        return (loss, self._reduce(z_loss, target)) if self.return_z_loss else loss
