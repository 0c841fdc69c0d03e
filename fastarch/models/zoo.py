"""``LongformerEncoder``: a Longformer-style encoder (token + learned position embeddings, post-norm layers of
:class:`fastarch.nn.LongformerAttention` (sliding window through the fused attention op, optional global
tokens) + add & norm + GELU feed-forward + add & norm), ``(B, L)`` token ids -> ``(B, L, d_model)`` hidden
states, and its builders ``longformer_tiny`` and ``longformer_bench`` (the ``models`` bench suite's
``longformer`` case times its layer).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn._models_common import layer_norm
from ..nn.attention import LongformerAttention
from ..nn.linear import Linear
from .registry import register_configs

__all__ = ["LongformerEncoder", "LongformerEncoderLayer"]


class LongformerEncoderLayer(nn.Module):
    """x = norm1(x + attn(x, global_mask)); x = norm2(x + FFN(x)). (B, L, d_model) -> (B, L, d_model)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, window_size: int, dropout: float = 0.1):
        super().__init__()
        self.attn = LongformerAttention(d_model, n_heads, window_size=window_size, dropout=dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout), Linear(d_ff, d_model))
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, global_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = layer_norm(x + self.dropout(self.attn(x, global_mask)), self.norm1)
        return layer_norm(x + self.dropout(self.ffn(x)), self.norm2)


class LongformerEncoder(nn.Module):
    """Longformer-style encoder. Args: vocab_size, d_model, n_layers, n_heads, window_size (keys on each
    side of a query), d_ff (default 4 * d_model), max_len (learned positions), dropout.

    forward(input_ids (B, L) int, global_mask (B, L) 0/1 or None) -> (B, L, d_model).
    """

    def __init__(self, vocab_size: int, d_model: int = 256, n_layers: int = 2, n_heads: int = 4,
                 window_size: int = 256, d_ff: int | None = None, max_len: int = 8192, dropout: float = 0.1):
        super().__init__()
        for name, val in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                          ("n_heads", n_heads), ("max_len", max_len)):
            if int(val) < 1:
                raise ValueError(f"LongformerEncoder: {name} must be >= 1, got {val}")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(LongformerEncoderLayer(d_model, n_heads, d_ff or 4 * d_model, window_size, dropout)
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, global_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"LongformerEncoder: 'input_ids' must be integer (B, L), got {got}")
        L = input_ids.shape[1]
        if L > self.max_len:
            raise ValueError(f"LongformerEncoder: sequence length {L} exceeds max_len={self.max_len}")
        x = self.dropout(self.tok(input_ids) + self.pos.weight[:L])
        for layer in self.layers:
            x = layer(x, global_mask)
        return layer_norm(x, self.norm)


globals().update(register_configs({
    "longformer_tiny": (LongformerEncoder, "2 layers x 64, 4 heads, window 8 each side, byte vocabulary, up to 1024 tokens, dropout 0.",
                        dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, window_size=8, max_len=1024,
                             dropout=0.0)),
    "longformer_bench": (LongformerEncoder, "The headline size of the models bench: d_model 256, 4 heads, window 256, L up to 8192 (1 layer).",
                         dict(vocab_size=256, d_model=256, n_layers=1, n_heads=4, window_size=256, max_len=8192)),
}))
