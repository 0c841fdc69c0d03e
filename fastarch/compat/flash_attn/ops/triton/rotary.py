"""flash-attn's ``flash_attn.ops.triton.rotary.apply_rotary`` on :func:`fastarch.ops.rotary_embedding`.

``apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False, inplace=False,
conjugate=False)``: x ``(batch, seqlen, nheads, headdim)``, or packed ``(total_seqlen, nheads, headdim)`` with
``cu_seqlens``; cos/sin ``(seqlen_ro, rotary_dim / 2)``. ``seqlen_offsets`` is an int or a ``(batch,)`` integer
tensor. As in flash-attn, a position past the end of the tables (possible only with tensor offsets) is left
unrotated. Runs on any device; not differentiable by itself (the autograd wrappers live in
:mod:`fastarch.compat.flash_attn.layers.rotary`).
"""

from __future__ import annotations

import torch

from .....ops.rotary import rotary_embedding
from ..._missing import missing_attribute

__all__ = ["apply_rotary"]

__getattr__ = missing_attribute("flash_attn.ops.triton.rotary")


def _fail(msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"flash_attn apply_rotary: {msg}")


def _gathered_tables(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``pos`` of the tables (any shape of positions, flattened); identity rows past their end."""
    pos = pos.reshape(-1).long()
    inside = (pos >= 0) & (pos < cos.shape[0])
    idx = pos.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside[:, None], cos[idx], torch.ones((), dtype=cos.dtype, device=cos.device))
    s = torch.where(inside[:, None], sin[idx], torch.zeros((), dtype=sin.dtype, device=sin.device))
    return c, s


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    seqlen_offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    conjugate: bool = False,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of each head by its position's angle.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with ``cu_seqlens``.
        cos, sin: ``(seqlen_ro, rotary_dim / 2)``, ``rotary_dim <= headdim``.
        seqlen_offsets: the position of each sequence's first token: an int, or a ``(batch,)`` int tensor.
        cu_seqlens: ``(batch + 1,)`` cumulative lengths of the packed sequences, or None.
        max_seqlen: the longest packed sequence (required with ``cu_seqlens``).
        interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of halves (GPT-NeoX).
        inplace: write the result into ``x`` and return ``x``.
        conjugate: rotate by the opposite angle (the adjoint).

    Returns:
        The rotated tensor, ``x``'s shape and dtype (``x`` itself when ``inplace``).
    """
    if not isinstance(x, torch.Tensor):
        _fail(f"'x' must be a tensor, got {type(x).__name__}", TypeError)
    varlen = cu_seqlens is not None
    if varlen:
        if x.ndim != 3:
            _fail(f"with 'cu_seqlens', 'x' must be (total_seqlen, nheads, headdim), got shape {tuple(x.shape)}")
        if max_seqlen is None:
            _fail("'max_seqlen' must be given with 'cu_seqlens'")
        batch = cu_seqlens.shape[0] - 1
        seqlen = int(max_seqlen)
    else:
        if x.ndim != 4:
            _fail(f"'x' must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
        batch, seqlen = x.shape[0], x.shape[1]
    if cos.ndim != 2 or cos.shape != sin.shape:
        _fail(f"'cos' and 'sin' must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and "
              f"{tuple(sin.shape)}")
    seqlen_ro, rotary_dim = cos.shape[0], 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        _fail(f"rotary_dim ({rotary_dim}) must be <= headdim ({x.shape[-1]})")
    tensor_offsets = isinstance(seqlen_offsets, torch.Tensor)
    if tensor_offsets:
        if tuple(seqlen_offsets.shape) != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            _fail(f"tensor 'seqlen_offsets' must be int32/int64 of shape ({batch},), got {seqlen_offsets.dtype} "
                  f"of shape {tuple(seqlen_offsets.shape)}")
    else:
        if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, int):
            _fail(f"'seqlen_offsets' must be an int or a (batch,) tensor, got {type(seqlen_offsets).__name__}",
                  TypeError)
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > seqlen_ro:
            _fail(f"seqlen_offsets ({seqlen_offsets}) + seqlen ({seqlen}) must lie within the {seqlen_ro} rows "
                  f"of 'cos'/'sin'")
    sin_used = -sin if conjugate else sin
    if not varlen and not tensor_offsets:
        out = rotary_embedding(x, cos, sin_used, interleaved, seqlen_offset=int(seqlen_offsets))
    else:
        device = x.device
        if varlen:
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            tok = torch.arange(x.shape[0], device=device)
            seq = torch.searchsorted(cu[1:], tok, right=True).clamp(max=max(batch - 1, 0))
            offs = seqlen_offsets.to(device).long()[seq] if tensor_offsets else int(seqlen_offsets)
            pos = tok - cu[seq] + offs
            pos = torch.where(tok < cu[-1], pos, torch.full_like(pos, -1))  # rows past the packed ones: untouched
            rows = x.unsqueeze(0)
        else:
            pos = seqlen_offsets.to(device).long()[:, None] + torch.arange(seqlen, device=device)[None, :]
            rows = x.reshape(1, batch * seqlen, *x.shape[2:])
        c, s = _gathered_tables(cos, sin_used, pos)
        out = rotary_embedding(rows, c, s, interleaved).reshape(x.shape)
    if inplace:
        x.copy_(out)
        return x
    return out
