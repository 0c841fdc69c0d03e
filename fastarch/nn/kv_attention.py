"""Guide-003 ``MultiHeadAttentionWithKVCache`` (drop-in) on the attention core of :mod:`fastarch.nn.attention`,
decoding with :class:`fastarch.nn.kv_cache.KVCache`."""

from __future__ import annotations

import torch

from ._models_common import check_input
from .attention import Attention
from .kv_cache import KVCache

__all__ = ["MultiHeadAttentionWithKVCache"]


class MultiHeadAttentionWithKVCache(Attention):
    """Guide 003's causal multi-head attention that decodes incrementally with a :class:`KVCache`.

    Same constructor, parameter names (``w_q``, ``w_k``, ``w_v``, ``w_o``, no biases) and outputs as the guide
    when no cache is passed or the cache is empty. Deviations, where the guide is wrong: its cached path masks
    with a top-left ``triu`` mask, so a decoded token only sees the first cached key; here new queries are
    aligned bottom-right (query ``t`` of a chunk sits at position ``cached + t``), which makes cached decoding
    equal uncached decoding. Its cache concatenates ``(B, T, H, D)`` tensors along the heads; the cache here
    is preallocated ``(B, Hk, S, D)``. Extensions: ``n_kv_heads`` (GQA/MQA: ``w_k``/``w_v`` project to
    ``n_kv_heads * head_dim``) and ``window`` (each query sees itself and the ``window`` previous positions;
    pair it with a ring-buffer cache).

    Shapes: ``x`` ``(B, T, d_model)`` -> ``(B, T, d_model)``.
    """

    def __init__(self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
                 window: int | None = None) -> None:
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"), kv_heads=n_kv_heads, bias=False,
                         window=window)
        self.n_kv_heads = self.kv_heads

    def allocate_kv_cache(self, batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                          device: torch.device | str | None = None, n_layers: int = 1) -> KVCache:
        """A cache sized for this layer (``n_layers`` copies when the caller stacks several)."""
        p = self.w_q.weight
        return KVCache(max_seq_len, self.n_kv_heads, self.head_dim, n_layers, batch_size=batch_size,
                       dtype=dtype or p.dtype, device=device or p.device, window=self.window)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,  # type: ignore[override]
                layer_idx: int = 0) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.d_model, owner="MultiHeadAttentionWithKVCache")
        return self.w_o(self.attend(x, causal=True, kv_cache=kv_cache, layer_idx=layer_idx)[0])
