"""Guide-003 ``MultiHeadAttentionWithKVCache`` and ``KVCache`` (drop-ins), on ``fastarch.ops.attention``.

Same constructor, parameter names (``w_q``, ``w_k``, ``w_v``, ``w_o``, no biases) and outputs as the guide
when no cache is passed or the cache is empty (causal self-attention). Deviations, where the guide is wrong:

- the guide's cached path masks with a top-left ``triu`` mask, so a decoded token only sees the first
  cached key; here new queries are aligned bottom-right (query ``t`` of a chunk sits at position
  ``cached + t``), which is what makes cached decoding equal uncached decoding;
- the guide's cache concatenates ``(B, T, H, D)`` tensors along dim -2 (heads); the cache here is
  preallocated ``(B, Hk, S, D)`` (see :class:`fastarch.generation.KVCache`);
- optional ``n_kv_heads`` (GQA/MQA: ``w_k``/``w_v`` project to ``n_kv_heads * head_dim``) and ``window``
  (sliding-window attention, pair with a ring-buffer cache) keyword arguments.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..generation.kv_cache import KVCache

__all__ = ["KVCache", "MultiHeadAttentionWithKVCache"]


class MultiHeadAttentionWithKVCache(nn.Module):
    """Causal multi-head attention that can decode incrementally with a :class:`KVCache`.

    Args:
        d_model: model width; ``n_heads`` must divide it.
        n_heads: query heads.
        n_kv_heads: key/value heads (divides ``n_heads``); default ``n_heads``.
        window: if given, each query sees itself and the ``window`` previous positions.

    Shapes: ``x`` ``(B, T, d_model)`` -> ``(B, T, d_model)``. With ``kv_cache``, the new keys/values of
    this chunk are appended to layer ``layer_idx`` of the cache and the queries attend to all of them.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 window: int | None = None) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"MultiHeadAttentionWithKVCache: 'd_model' ({d_model}) must be divisible by "
                             f"'n_heads' ({n_heads})")
        n_kv = n_heads if n_kv_heads is None else n_kv_heads
        if n_kv < 1 or n_heads % n_kv != 0:
            raise ValueError(f"MultiHeadAttentionWithKVCache: 'n_kv_heads' must divide n_heads={n_heads}, "
                             f"got {n_kv_heads}")
        if window is not None and window < 0:
            raise ValueError(f"MultiHeadAttentionWithKVCache: 'window' must be >= 0 or None, got {window}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv
        self.head_dim = d_model // n_heads
        self.window = window
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, n_kv * self.head_dim, bias=False)
        self.w_v = nn.Linear(d_model, n_kv * self.head_dim, bias=False)
        self.w_o = nn.Linear(d_model, d_model, bias=False)

    def allocate_kv_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                          device: torch.device | str | None = None, n_layers: int = 1) -> KVCache:
        """A cache sized for this layer (``n_layers`` copies when the caller stacks several)."""
        p = self.w_q.weight
        return KVCache(max_seq_len, self.n_kv_heads, self.head_dim, n_layers, batch_size=batch_size,
                       dtype=dtype or p.dtype, device=device or p.device, window=self.window)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer_idx: int = 0) -> torch.Tensor:
        from ..ops.attention import attention

        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"MultiHeadAttentionWithKVCache: argument 'x' must be (B, T, {self.d_model}), "
                             f"got {tuple(x.shape)}")
        B, T, _ = x.shape
        q = self.w_q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.w_k(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.w_v(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)
            kw = kv_cache.attention_kwargs(layer_idx, window=self.window)
        else:
            kw = {"causal": True}
            if self.window is not None:
                kw["window"] = (self.window, 0)
        o = attention(q, k, v, **kw)
        return self.w_o(o.transpose(1, 2).reshape(B, T, self.d_model))
