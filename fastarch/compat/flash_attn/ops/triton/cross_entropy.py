"""flash-attn's ``flash_attn.ops.triton.cross_entropy.cross_entropy_loss`` in PyTorch (fastarch has no
cross-entropy op), on any device.

Per row: ``loss = lse - (1 - s) * z[label] - s * mean(z) + lse_square_scale * lse**2`` with
``z = logit_scale * logits``, ``lse = logsumexp(z)`` and ``s = label_smoothing``; rows whose label is
``ignore_index`` get 0. Returns ``(losses, z_losses)``, both ``(batch,)`` fp32; ``z_losses``
(``lse_square_scale * lse**2``, 0 on ignored rows) is for logging and carries no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._missing import missing_attribute

__all__ = ["cross_entropy_loss"]

__getattr__ = missing_attribute("flash_attn.ops.triton.cross_entropy")


def _fail(msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"flash_attn cross_entropy_loss: {msg}")


def cross_entropy_loss(
    logits: Tensor,
    labels: Tensor,
    precomputed_lse: Tensor | None = None,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    process_group=None,
) -> tuple[Tensor, Tensor]:
    """Cross-entropy per row with label smoothing, logit scaling and z-loss; see the module docstring.

    Args:
        logits: ``(batch, vocab_size)``.
        labels: ``(batch,)`` integer class indices, or ``ignore_index``.
        precomputed_lse: ``(batch,)`` the rows' ``logsumexp(logit_scale * logits)``, used instead of computing it.
        label_smoothing: in ``[0, 1]``.
        logit_scale: multiplies the logits first.
        lse_square_scale: weight of the z-loss ``lse**2``.
        ignore_index: the label of rows that contribute nothing.
        inplace_backward: accepted; the gradient is the same (fastarch does not reuse the logits' memory).
        process_group: None, or a group of size 1 (the vocabulary is not split across processes here).

    Returns:
        ``(losses, z_losses)``: ``(batch,)`` fp32 each; ``losses`` is differentiable in ``logits``.
    """
    if process_group is not None and process_group.size() != 1:
        _fail(f"'process_group' must be None or of size 1 (a vocabulary split across processes is not "
              f"supported), got a group of size {process_group.size()}")
    if not isinstance(logits, Tensor) or logits.ndim != 2:
        _fail(f"'logits' must be (batch, vocab_size), got {getattr(logits, 'shape', type(logits).__name__)}")
    if not isinstance(labels, Tensor) or tuple(labels.shape) != (logits.shape[0],) or labels.dtype.is_floating_point:
        _fail(f"'labels' must be an integer tensor ({logits.shape[0]},), got "
              f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
    if not 0.0 <= label_smoothing <= 1.0:
        _fail(f"'label_smoothing' must be in [0, 1], got {label_smoothing}")
    z = logits.float() * logit_scale
    lse = torch.logsumexp(z, dim=-1)
    if precomputed_lse is not None:  # its value, with the gradient of the true logsumexp
        lse = lse + (precomputed_lse.float() - lse).detach()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    picked = z.gather(1, safe[:, None]).squeeze(1)
    loss = lse - picked if label_smoothing == 0.0 else \
        lse - (1.0 - label_smoothing) * picked - label_smoothing * z.mean(dim=-1)
    z_loss = lse_square_scale * lse.square() if lse_square_scale != 0.0 else torch.zeros_like(lse)
    loss = torch.where(valid, loss + z_loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    z_loss = torch.where(valid, z_loss, torch.zeros((), dtype=loss.dtype, device=loss.device)).detach()
    return loss, z_loss
