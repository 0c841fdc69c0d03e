"""flash-attn's ``flash_attn.modules.mha`` on :mod:`fastarch.compat.flash_attn.flash_attn_interface` and
:func:`fastarch.ops.attention`, on any device (CPU included).

``MHA`` has flash-attn's constructor arguments, defaults, ``state_dict`` keys (``Wqkv.*`` for self-attention,
``Wq.*`` and ``Wkv.*`` for cross-attention, ``out_proj.*``, ``dwconv_*`` with ``dwconv``; the rotary and ALiBi
buffers are non-persistent), forward arguments and KV-cache protocol (``inference_params.key_value_memory_dict
[layer_idx]``, ``seqlen_offset``, ``lengths_per_sample``). ``use_flash_attn=True`` runs the flash-attn functions
(varlen ``cu_seqlens``, ``window_size``, ALiBi); ``False`` runs :func:`fastarch.ops.attention` with a
``key_padding_mask``. The inner modules ``FlashSelfAttention``, ``FlashCrossAttention``, ``SelfAttention`` and
``CrossAttention`` are provided with flash-attn's signatures.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
from torch import Tensor

from ....ops.attention import attention
from .._missing import missing_attribute
from ..flash_attn_interface import (
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from ..layers.rotary import RotaryEmbedding
from ..utils.distributed import get_dim_for_local_rank  # noqa: F401  (flash-attn's module exposes it)

__all__ = ["MHA", "CrossAttention", "FlashCrossAttention", "FlashSelfAttention", "LinearResidual", "SelfAttention",
           "get_alibi_slopes"]

__getattr__ = missing_attribute("flash_attn.modules.mha")


def _fail(msg: str) -> None:
    raise ValueError(f"flash_attn MHA: {msg}")


def get_alibi_slopes(nheads: int) -> list[float]:
    """ALiBi's head slopes: a geometric sequence from ``2^(-8/n)`` for a power of two ``n``; otherwise those of
    the nearest lower power of two followed by every other slope of twice that."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(nheads).is_integer():
        return powers(nheads)
    low = 2 ** math.floor(math.log2(nheads))
    return powers(low) + get_alibi_slopes(2 * low)[0::2][: nheads - low]


class FlashSelfAttention(nn.Module):
    """Softmax attention of a packed ``qkv`` through ``flash_attn_qkvpacked_func`` (varlen with ``cu_seqlens``).
    ``forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None)``: qkv ``(B, S, 3, H, D)`` or
    ``(total, 3, H, D)`` -> ``(B, S, H, D)`` or ``(total, H, D)``."""

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0,
                 window_size: tuple[int, int] = (-1, -1), alibi_slopes: Tensor | None = None,
                 deterministic: bool = False) -> None:
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.window_size = window_size
        self.deterministic = deterministic

    def forward(self, qkv: Tensor, causal: bool | None = None, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None) -> Tensor:
        causal = self.causal if causal is None else causal
        p = self.drop.p if self.training else 0.0
        kw = dict(softmax_scale=self.softmax_scale, causal=causal, alibi_slopes=self.alibi_slopes,
                  window_size=self.window_size, deterministic=self.deterministic)
        if cu_seqlens is not None:
            if max_seqlen is None:
                _fail("'max_seqlen' must be given with 'cu_seqlens'")
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, p, **kw)
        return flash_attn_qkvpacked_func(qkv, p, **kw)


class FlashCrossAttention(FlashSelfAttention):
    """Softmax attention of ``q`` over a packed ``kv`` through ``flash_attn_kvpacked_func`` (varlen with
    ``cu_seqlens``/``cu_seqlens_k``). ``forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None,
    cu_seqlens_k=None, max_seqlen_k=None)``: q ``(B, Sq, H, D)``, kv ``(B, Sk, 2, H_k, D)`` -> ``(B, Sq, H, D)``."""

    def forward(self, q: Tensor, kv: Tensor, causal: bool | None = None, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None, cu_seqlens_k: Tensor | None = None,
                max_seqlen_k: int | None = None) -> Tensor:
        causal = self.causal if causal is None else causal
        p = self.drop.p if self.training else 0.0
        kw = dict(softmax_scale=self.softmax_scale, causal=causal, alibi_slopes=self.alibi_slopes,
                  window_size=self.window_size, deterministic=self.deterministic)
        if cu_seqlens is not None:
            if max_seqlen is None or cu_seqlens_k is None or max_seqlen_k is None:
                _fail("varlen cross-attention needs 'max_seqlen', 'cu_seqlens_k' and 'max_seqlen_k'")
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, p,
                                                   **kw)
        if kv.shape[0] != q.shape[0] or kv.shape[4] != q.shape[3]:
            _fail(f"'kv' {tuple(kv.shape)} does not match 'q' {tuple(q.shape)} in batch or head dim")
        return flash_attn_kvpacked_func(q, kv, p, **kw)


class SelfAttention(nn.Module):
    """Softmax attention of a packed ``qkv`` ``(B, S, 3, H, D)`` through :func:`fastarch.ops.attention`, with an
    optional ``key_padding_mask`` ``(B, S)`` (True keeps). ``forward(qkv, causal=None, key_padding_mask=None)``
    -> ``(B, S, H, D)``."""

    def __init__(self, causal: bool = False, softmax_scale: float | None = None, attention_dropout: float = 0.0
                 ) -> None:
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def _attend(self, q, k, v, causal, key_padding_mask):
        causal = self.causal if causal is None else causal
        kpm = key_padding_mask.bool() if key_padding_mask is not None else None
        lengths = None
        if causal and kpm is not None and q.shape[1] != k.shape[1]:
            # flash-attn aligns the causal mask on each row's key count; for right-padded keys that is the
            # op's per-row key length (with holes in the mask the alignment stays on the padded length)
            counts = kpm.sum(-1)
            if torch.equal(kpm, torch.arange(kpm.shape[1], device=kpm.device)[None, :] < counts[:, None]):
                kpm, lengths = None, counts.to(torch.int32)
        return attention(q, k, v, layout="blhd", causal=causal, key_padding_mask=kpm, seqlens_k=lengths,
                         dropout_p=self.drop.p if self.training else 0.0, scale=self.softmax_scale)

    def forward(self, qkv: Tensor, causal: bool | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        q, k, v = qkv.unbind(dim=2)
        return self._attend(q, k, v, causal, key_padding_mask)


class CrossAttention(SelfAttention):
    """Softmax attention of ``q`` ``(B, Sq, H, D)`` over ``kv`` ``(B, Sk, 2, H_k, D)`` (grouped-query when
    ``H_k < H``) through :func:`fastarch.ops.attention`; causal masks align the last query with the last key.
    ``forward(q, kv, causal=None, key_padding_mask=None)`` -> ``(B, Sq, H, D)``."""

    def forward(self, q: Tensor, kv: Tensor, causal: bool | None = None, key_padding_mask: Tensor | None = None
                ) -> Tensor:
        if kv.shape[0] != q.shape[0] or kv.shape[4] != q.shape[3]:
            _fail(f"'kv' {tuple(kv.shape)} does not match 'q' {tuple(q.shape)} in batch or head dim")
        k, v = kv.unbind(dim=2)
        return self._attend(q, k, v, causal, key_padding_mask)


class LinearResidual(nn.Linear):
    """``nn.Linear`` that returns ``(linear(x), x)``."""

    def forward(self, input: Tensor) -> tuple[Tensor, Tensor]:
        return super().forward(input), input


def _update_kv_cache(kv: Tensor, inference_params, layer_idx: int) -> Tensor:
    """Write ``kv`` ``(B, S, 2, H_k, D)`` into the layer's cache at ``inference_params``' batch and sequence
    offsets (allocating ``(max_batch_size, max_seqlen, 2, H_k, D)`` on first use); return the cache rows so far
    ``(B, seqlen_offset + S, 2, H_k, D)``."""
    cache = inference_params.key_value_memory_dict.get(layer_idx)
    if cache is None:
        cache = torch.empty(inference_params.max_batch_size, inference_params.max_seqlen, 2, *kv.shape[-2:],
                            dtype=kv.dtype, device=kv.device)
        inference_params.key_value_memory_dict[layer_idx] = cache
    b0 = inference_params.batch_size_offset
    b1 = b0 + kv.shape[0]
    s0 = inference_params.seqlen_offset
    s1 = s0 + kv.shape[1]
    if b1 > cache.shape[0] or s1 > cache.shape[1]:
        _fail(f"the KV cache holds {cache.shape[0]} sequences of {cache.shape[1]} tokens, but batch rows {b0}..{b1} "
              f"and positions {s0}..{s1} were asked for")
    cache[b0:b1, s0:s1] = kv
    return cache[b0:b1, :s1]


class MHA(nn.Module):
    """Multi-head self- and cross-attention (flash-attn's ``MHA``).

    ``forward(x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
    inference_params=None, **kwargs)``: x ``(batch, seqlen, embed_dim)`` (``(total, embed_dim)`` with
    ``cu_seqlens``) -> the same shape (and ``x`` too with ``return_residual``). With ``inference_params`` the
    keys/values are appended to the layer's cache and attention runs over it (one call per prefill or decode
    step; the caller advances ``seqlen_offset``).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: int | None = None, cross_attn: bool = False,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, dropout: float = 0.0,
                 softmax_scale: float | None = None, causal: bool = False, layer_idx: int | None = None,
                 dwconv: bool = False, rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_scale_base: float | None = None, rotary_emb_interleaved: bool = False,
                 use_alibi: bool = False, window_size: tuple[int, int] = (-1, -1), fused_bias_fc: bool = False,
                 use_flash_attn: bool = False, return_residual: bool = False, checkpointing: bool = False,
                 device=None, dtype=None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        if use_alibi and not use_flash_attn:
            _fail("use_alibi=True needs use_flash_attn=True (as in flash-attn)")
        alibi_slopes = torch.tensor(get_alibi_slopes(num_heads), device=device) if use_alibi else None
        if tuple(window_size) != (-1, -1) and not use_flash_attn:
            _fail("a window_size other than (-1, -1) needs use_flash_attn=True (as in flash-attn)")
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if self.num_heads % self.num_heads_kv:
            _fail(f"num_heads ({num_heads}) must be divisible by num_heads_kv ({self.num_heads_kv})")
        if embed_dim % num_heads:
            _fail(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.head_dim = embed_dim // num_heads
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        if self.rotary_emb_dim > 0:
            if cross_attn:
                _fail("rotary embedding is not supported with cross_attn=True (as in flash-attn)")
            self.rotary_emb = RotaryEmbedding(self.rotary_emb_dim, base=rotary_emb_base,
                                              scale_base=rotary_emb_scale_base, interleaved=rotary_emb_interleaved,
                                              device=device)
        if use_flash_attn:
            inner_attn_cls = partial(FlashSelfAttention, alibi_slopes=alibi_slopes, window_size=window_size)
            inner_cross_attn_cls = partial(FlashCrossAttention, alibi_slopes=alibi_slopes, window_size=window_size)
        else:
            inner_attn_cls, inner_cross_attn_cls = SelfAttention, CrossAttention
        linear_cls = LinearResidual if return_residual else nn.Linear
        if not self.cross_attn:
            self.Wqkv = linear_cls(embed_dim, qkv_dim, bias=qkv_proj_bias, **factory_kwargs)
        else:
            self.Wq = linear_cls(embed_dim, embed_dim, bias=qkv_proj_bias, **factory_kwargs)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory_kwargs)
        if self.dwconv:
            if self.num_heads_kv == self.num_heads:
                self.dwconv_qkv = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=3, padding=2, groups=qkv_dim)
            else:
                self.dwconv_q = nn.Conv1d(embed_dim, embed_dim, kernel_size=3, padding=2, groups=embed_dim)
                self.dwconv_kv = nn.Conv1d(kv_dim, kv_dim, kernel_size=3, padding=2, groups=kv_dim)
        self.inner_attn = inner_attn_cls(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.inner_cross_attn = inner_cross_attn_cls(causal=causal, softmax_scale=softmax_scale,
                                                     attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory_kwargs)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None) -> Tensor:
        """An empty KV cache ``(batch_size, max_seqlen, 2, num_heads_kv, head_dim)``."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype,
                           device=self.out_proj.weight.device)

    def _update_kv_cache(self, kv: Tensor, inference_params) -> Tensor:
        if self.dwconv:
            _fail("generation with dwconv=True is not supported (as in flash-attn)")
        if self.layer_idx is None:
            _fail("generation needs 'layer_idx' in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _cache_and_lengths(self, q: Tensor, inference_params) -> tuple[Tensor, int | Tensor]:
        batch = q.shape[0]
        kv_cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        lengths = inference_params.lengths_per_sample
        return kv_cache, (lengths[:batch] if lengths is not None else inference_params.seqlen_offset)

    def _apply_rotary_update_kvcache_attention(self, q: Tensor, kv: Tensor, inference_params) -> Tensor:
        """Rotary on q and k, cache append and attention in one ``flash_attn_with_kvcache`` call (decode steps)."""
        if self.rotary_emb_dim > 0:
            if self.rotary_emb.scale is not None:
                _fail("this decoding path does not support XPos (rotary_emb_scale_base)")
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            rotary_cos, rotary_sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        else:
            rotary_cos, rotary_sin = None, None
        kv_cache, cache_seqlens = self._cache_and_lengths(q, inference_params)
        return flash_attn_with_kvcache(
            q, kv_cache[:, :, 0], kv_cache[:, :, 1], kv[:, :, 0], kv[:, :, 1], rotary_cos=rotary_cos,
            rotary_sin=rotary_sin, cache_seqlens=cache_seqlens, softmax_scale=self.inner_cross_attn.softmax_scale,
            causal=self.inner_cross_attn.causal,
            rotary_interleaved=self.rotary_emb.interleaved if self.rotary_emb_dim > 0 else False,
            alibi_slopes=getattr(self.inner_cross_attn, "alibi_slopes", None))

    def _update_kvcache_attention(self, q: Tensor, kv: Tensor, inference_params) -> Tensor:
        """Write ``kv`` into the cache, then attend over it."""
        if inference_params.seqlen_offset == 0 or not self.use_flash_attn:
            return self.inner_cross_attn(q, self._update_kv_cache(kv, inference_params))
        kv_cache, cache_seqlens = self._cache_and_lengths(q, inference_params)
        return flash_attn_with_kvcache(
            q, kv_cache[:, :, 0], kv_cache[:, :, 1], kv[:, :, 0], kv[:, :, 1], cache_seqlens=cache_seqlens,
            softmax_scale=self.inner_cross_attn.softmax_scale, causal=self.inner_cross_attn.causal,
            alibi_slopes=getattr(self.inner_cross_attn, "alibi_slopes", None))

    @staticmethod
    def _dwconv(conv: nn.Conv1d, t: Tensor) -> Tensor:
        return conv(t.transpose(-1, -2))[..., :-2].transpose(-1, -2).contiguous()

    def _attend(self, q, kv, qkv, inference_params, seqlen_offset, rotary_max_seqlen, kwargs):
        """Self-attention of packed ``qkv`` (``q``/``kv`` None) or attention of ``q`` over ``kv``."""
        fused_decode = (inference_params is not None and inference_params.seqlen_offset > 0 and self.use_flash_attn
                        and self.rotary_emb_dim > 0 and self.rotary_emb_dim % 16 == 0)
        if fused_decode:
            if qkv is not None:
                q, kv = qkv[:, :, 0], qkv[:, :, 1:]
            return self._apply_rotary_update_kvcache_attention(q, kv, inference_params)
        if qkv is not None:
            if self.rotary_emb_dim > 0:
                qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
            if inference_params is not None:
                return self._update_kvcache_attention(qkv[:, :, 0], qkv[:, :, 1:], inference_params)
            if self.checkpointing:
                return torch.utils.checkpoint.checkpoint(self.inner_attn, qkv, use_reentrant=False, **kwargs)
            return self.inner_attn(qkv, **kwargs)
        if self.rotary_emb_dim > 0:
            q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
        if inference_params is not None:
            return self._update_kvcache_attention(q, kv, inference_params)
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(self.inner_cross_attn, q, kv, use_reentrant=False, **kwargs)
        return self.inner_cross_attn(q, kv, **kwargs)

    def forward(self, x: Tensor, x_kv: Tensor | None = None, key_padding_mask: Tensor | None = None,
                cu_seqlens: Tensor | None = None, max_seqlen: int | None = None, mixer_subset=None,
                inference_params=None, **kwargs):
        if cu_seqlens is not None:
            if max_seqlen is None or key_padding_mask is not None or not self.use_flash_attn or self.dwconv \
                    or self.rotary_emb_dim != 0:
                _fail("'cu_seqlens' needs 'max_seqlen', use_flash_attn=True, no key_padding_mask, no dwconv and "
                      "no rotary embedding (as in flash-attn)")
        if key_padding_mask is not None and (cu_seqlens is not None or max_seqlen is not None
                                             or self.use_flash_attn):
            _fail("'key_padding_mask' is for use_flash_attn=False without cu_seqlens/max_seqlen (as in flash-attn)")
        if inference_params is not None and (key_padding_mask is not None or cu_seqlens is not None
                                             or max_seqlen is not None or self.dwconv):
            _fail("'inference_params' excludes key_padding_mask, cu_seqlens, max_seqlen and dwconv")
        kwargs = ({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs} if self.use_flash_attn
                  else {"key_padding_mask": key_padding_mask, **kwargs})
        if inference_params is None:
            seqlen_offset = 0
        elif inference_params.lengths_per_sample is not None:
            seqlen_offset = inference_params.lengths_per_sample
        else:
            seqlen_offset = inference_params.seqlen_offset
        rotary_max_seqlen = inference_params.max_seqlen if inference_params is not None else None
        if not self.cross_attn and self.num_heads_kv == self.num_heads:
            if x_kv is not None or mixer_subset is not None:
                _fail("'x_kv' and 'mixer_subset' are for cross_attn=True")
            qkv = self.Wqkv(x)
            if self.return_residual:
                qkv, x = qkv
            if self.dwconv:
                qkv = self._dwconv(self.dwconv_qkv, qkv)
            qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim))
            context = self._attend(None, None, qkv, inference_params, seqlen_offset, rotary_max_seqlen, kwargs)
        else:
            if self.cross_attn:
                q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
                if self.return_residual:
                    q, x = q
                kv = self.Wkv(x_kv if x_kv is not None else x)
            else:
                qkv = self.Wqkv(x)
                if self.return_residual:
                    qkv, x = qkv
                q = qkv[..., : self.num_heads * self.head_dim]
                kv = qkv[..., self.num_heads * self.head_dim:]
            if self.dwconv:
                q, kv = self._dwconv(self.dwconv_q, q), self._dwconv(self.dwconv_kv, kv)
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
            kv = kv.unflatten(-1, (2, self.num_heads_kv, self.head_dim))
            context = self._attend(q, kv, None, inference_params, seqlen_offset, rotary_max_seqlen, kwargs)
        out = self.out_proj(context.flatten(-2))
        return out if not self.return_residual else (out, x)
