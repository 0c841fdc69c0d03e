"""flash-attn's ``flash_attn.layers.rotary`` on :func:`fastarch.ops.rotary_embedding`.

``apply_rotary_emb`` (alias ``apply_rotary_emb_func``), ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
``apply_rotary_emb_torch`` and ``RotaryEmbedding`` with flash-attn's signatures, defaults, buffers
(``inv_freq`` and ``scale``, both non-persistent) and return values. ``seqlen_offsets`` is an int or a
``(batch,)`` tensor; ``cu_seqlens``/``max_seqlen`` take packed sequences; ``rotary_dim < headdim`` leaves the
remaining features untouched. The ``_`` functions rotate in place and return their argument, as flash-attn's do.
Gradients are the opposite rotation of the incoming gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ....ops.rotary import rotary_embedding_ref
from .._missing import missing_attribute
from ..ops.triton.rotary import apply_rotary

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
    "apply_rotary_emb_torch",
    "rotate_half",
]

__getattr__ = missing_attribute("flash_attn.layers.rotary")


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """``(-x2, x1)`` of the halves (or of the even/odd pairs when ``interleaved``); ``x`` ``(..., d)``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """The reference rotary (:func:`fastarch.ops.rotary.rotary_embedding_ref`, fp32 arithmetic): x
    ``(batch, seqlen, nheads, headdim)``, cos/sin ``(seqlen, rotary_dim / 2)`` or ``(batch, seqlen, rotary_dim / 2)``."""
    if cos.ndim == 3:  # per-sequence tables: one row per token of the flattened batch
        B, L = x.shape[:2]
        rows = x.reshape(1, B * L, *x.shape[2:])
        return rotary_embedding_ref(rows, cos.reshape(B * L, -1), sin.reshape(B * L, -1), interleaved).reshape(x.shape)
    return rotary_embedding_ref(x, cos[: x.shape[1]], sin[: x.shape[1]], interleaved)


class _ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen):
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                           interleaved=interleaved)
        ctx.args = (cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved)
        if inplace:
            _write(x, out)
            return x
        return out

    @staticmethod
    def backward(ctx, do):
        cos, sin, offsets, cu_seqlens, max_seqlen, interleaved = ctx.args
        dx = apply_rotary(do, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          interleaved=interleaved, conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inplace: bool = False,
    seqlen_offsets: int | Tensor = 0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> Tensor:
    """Rotary embedding of the first ``rotary_dim = 2 * cos.shape[1]`` features of ``x``.

    Args:
        x: ``(batch, seqlen, nheads, headdim)``, or ``(total_seqlen, nheads, headdim)`` with ``cu_seqlens``.
        cos, sin: ``(seqlen_rotary, rotary_dim / 2)``.
        interleaved: rotate pairs ``(2i, 2i+1)`` (GPT-J) instead of halves (GPT-NeoX).
        inplace: write into ``x`` (and return it).
        seqlen_offsets: an int or a ``(batch,)`` tensor: the position of each sequence's first token.
        cu_seqlens: ``(batch + 1,)`` or None.
        max_seqlen: the longest sequence, with ``cu_seqlens``.

    Returns:
        ``x``'s shape and dtype; differentiable in ``x``.
    """
    return _ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


apply_rotary_emb_func = apply_rotary_emb


def _qk_views(qkv: Tensor, num_heads_q: int | None) -> tuple[Tensor, Tensor]:
    if qkv.ndim == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"flash_attn apply_rotary_emb_qkv_: 'qkv' must be (batch, seqlen, 3, nheads, headdim), "
                             f"got shape {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.ndim != 4 or num_heads_q is None:
        raise ValueError("flash_attn apply_rotary_emb_qkv_: 'qkv' must be (batch, seqlen, 3, nheads, headdim), or "
                         "(batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with 'num_heads_q' given; got "
                         f"shape {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"flash_attn apply_rotary_emb_qkv_: {qkv.shape[2]} heads is not num_heads_q "
                         f"({num_heads_q}) + 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def _write(dst: Tensor, src: Tensor) -> None:
    """Overwrite ``dst``'s memory as flash-attn's in-place kernels do: unseen by autograd (no version bump), so
    views of the same buffer taken before (q of a qkv, say) stay usable; the Functions here supply the gradient."""
    dst.data.copy_(src)


def _rotate_qk(qkv, cos, sin, cos_k, sin_k, interleaved, offsets, num_heads_q, conjugate):
    q, k = _qk_views(qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    _write(q, apply_rotary(q, cos, sin, seqlen_offsets=offsets, interleaved=interleaved, conjugate=conjugate))
    _write(k, apply_rotary(k, cos_k, sin_k, seqlen_offsets=offsets, interleaved=interleaved, conjugate=conjugate))


class _ApplyRotaryEmbQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q):
        _rotate_qk(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, False)
        ctx.args = (cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        dqkv = dqkv.clone()
        _rotate_qk(dqkv, *ctx.args, True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cos_k: Tensor | None = None,
    sin_k: Tensor | None = None,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
    num_heads_q: int | None = None,
) -> Tensor:
    """Rotate Q and K of a packed ``qkv`` in place (K with ``cos_k``/``sin_k`` when given); returns ``qkv``.

    Shapes: qkv ``(batch, seqlen, 3, nheads, headdim)`` or ``(batch, seqlen, num_heads_q + 2 * num_heads_k,
    headdim)`` (MQA/GQA, ``num_heads_q`` required); cos/sin/cos_k/sin_k ``(seqlen, rotary_dim / 2)``.
    """
    return _ApplyRotaryEmbQKV.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


class _ApplyRotaryEmbKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved, seqlen_offsets):
        if kv.ndim != 5 or kv.shape[2] != 2:
            raise ValueError(f"flash_attn apply_rotary_emb_kv_: 'kv' must be (batch, seqlen, 2, nheads, headdim), "
                             f"got shape {tuple(kv.shape)}")
        _write(kv[:, :, 0], apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets=seqlen_offsets, interleaved=interleaved))
        ctx.args = (cos, sin, interleaved, seqlen_offsets)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        cos, sin, interleaved, offsets = ctx.args
        dkv = dkv.clone()
        apply_rotary(dkv[:, :, 0], cos, sin, seqlen_offsets=offsets, interleaved=interleaved, inplace=True,
                     conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(
    kv: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: int | Tensor = 0,
) -> Tensor:
    """Rotate K of a packed ``kv`` ``(batch, seqlen, 2, nheads, headdim)`` in place; returns ``kv``."""
    return _ApplyRotaryEmbKV.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer), with XPos scaling when ``scale_base`` is given; flash-attn's
    constructor, buffers (``inv_freq``, ``scale``; non-persistent) and cos/sin cache.

    ``forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None)`` rotates in place and returns
    ``qkv`` ``(batch, seqlen, 3, nheads, headdim)`` (or ``(batch, seqlen, num_heads_q + 2 * num_heads_k,
    headdim)``), or ``(q, kv)`` with q ``(batch, seqlen, nheads, headdim)`` and kv
    ``(batch, seqlen, 2, nheads_k, headdim)`` when ``kv`` is given.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 device=None) -> None:
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached: Tensor | None = None
        self._sin_cached: Tensor | None = None
        self._cos_k_cached: Tensor | None = None
        self._sin_k_cached: Tensor | None = None

    def _compute_inv_freq(self, device=None) -> Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _compute_scale(self, device=None) -> Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        stale = (seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.device != device
                 or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        # fp32 angles whatever the module's dtype: positions times frequencies lose too much in half precision.
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)
            return
        scale32 = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=scale32.device) - seqlen // 2) / self.scale_base
        scale = (scale32.to(power.device) ** power[:, None]).to(freqs.device)
        self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
        self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Tensor | None = None, seqlen_offset: int | Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """See the class docstring; ``seqlen_offset`` is an int or a ``(batch,)`` tensor (then pass
        ``max_seqlen`` to size the cos/sin cache)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved,
                                  inplace=True, seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv
