"""Positional encodings: one sinusoidal table, one learned table and one rotary embedding (on the fused
``fastarch.ops.rotary_embedding``), with the guides' class names and ``state_dict`` keys.

- ``SinusoidalPositionalEncoding(d_model, max_len)`` (guide 003) and ``PositionalEncoding(d_model, max_len,
  dropout)`` (guide 000, the same table followed by dropout): buffer ``pe`` ``(1, max_len, d_model)``;
- ``LearnedPositionalEncoding(d_model, max_len, dropout)`` (guide 000): ``pe`` is an ``nn.Embedding``;
  ``LearnedPositionalEncoding003(d_model, max_len)`` (guide 003): ``pe`` is a ``(1, max_len, d_model)``
  parameter;
- ``RotaryPositionalEncoding(d_model)`` (guide 003): RoPE on interleaved pairs.

Each adds its table to ``x`` ``(B, L, d_model)`` and returns the same shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import ops

__all__ = ["SinusoidalPositionalEncoding", "PositionalEncoding", "LearnedPositionalEncoding",
           "LearnedPositionalEncoding003", "RotaryPositionalEncoding", "sinusoidal_table"]


def sinusoidal_table(max_len: int, d_model: int) -> torch.Tensor:
    """``(max_len, d_model)``: sin on even features, cos on odd ones, frequencies ``10000^(-2i/d_model)``."""
    pe = torch.zeros(max_len, d_model)
    position = torch.arange(0, max_len).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    # An odd d_model has one fewer cos column than sin columns (the guide's code fails there).
    pe[:, 1::2] = torch.cos(position * div_term)[:, : d_model // 2]
    return pe


class _AddedTable(nn.Module):
    """``dropout(x + table[:L])`` for a position table ``(max_len, d_model)`` given by :meth:`table`."""

    def __init__(self, dropout: float | None) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout is not None else nn.Identity()

    def table(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(B, L, d_model)`` -> same shape."""
        table = self.table()
        L = x.size(1)
        if L > table.shape[0]:
            raise ValueError(f"{type(self).__name__}: sequence length {L} > max_len {table.shape[0]}")
        return self.dropout(x + table[:L].to(x.dtype))


class SinusoidalPositionalEncoding(_AddedTable):
    """Guide 003's fixed sinusoidal encoding; buffer ``pe`` ``(1, max_len, d_model)``."""

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float | None = None) -> None:
        super().__init__(dropout)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model).unsqueeze(0))

    def table(self) -> torch.Tensor:
        return self.pe[0]


class PositionalEncoding(SinusoidalPositionalEncoding):
    """Guide 000's sinusoidal encoding followed by dropout; buffer ``pe`` ``(1, max_len, d_model)``."""

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.1) -> None:
        super().__init__(d_model, max_len, dropout)


class LearnedPositionalEncoding(_AddedTable):
    """Guide 000's learned positions: ``dropout(x + pe(arange(L)))``, ``pe`` an ``nn.Embedding(max_len, d_model)``."""

    def __init__(self, d_model: int, max_len: int = 512, dropout: float = 0.1) -> None:
        super().__init__(dropout)
        self.pe = nn.Embedding(max_len, d_model)

    def table(self) -> torch.Tensor:
        return self.pe.weight


class LearnedPositionalEncoding003(_AddedTable):
    """Guide 003's ``LearnedPositionalEncoding``: ``x + pe[:, :L]``, ``pe`` a ``(1, max_len, d_model)`` parameter."""

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__(None)
        self.pe = nn.Parameter(torch.randn(1, max_len, d_model))

    def table(self) -> torch.Tensor:
        return self.pe[0]


class RotaryPositionalEncoding(nn.Module):
    """Guide-003 RoPE on the fused rotary op: ``forward(q, k, offset=0) -> (q_rot, k_rot)``.

    q, k: ``(B, L, H, d_head)``. As in the guide, features are rotated in interleaved pairs ``(2i, 2i+1)``
    with frequencies ``10000^(-2i/d_model)``; the guide requires ``d_model == d_head``, and here a smaller
    ``d_model`` rotates only the first ``d_model`` features of each head (partial rotary). ``offset`` shifts
    positions, for decoding with a KV cache. Buffer: ``inv_freq`` ``(d_model/2,)`` (in the ``state_dict``
    unless ``persistent=False``, for modules whose checkpoints do not hold it).
    """

    def __init__(self, d_model: int, max_len: int = 5000, *, persistent: bool = True) -> None:
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2).float() / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=persistent)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``(length, d_model/2)`` in fp32, cached."""
        c = self._cache
        if c is None or c[0].shape[0] < length or c[0].device != device:
            n = max(length, min(self.max_len, 2 * length))
            ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)[None, :]
            c = (ang.cos(), ang.sin())
            self._cache = c
        return c

    def forward(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(offset + q.shape[1], q.device)
        return (ops.rotary_embedding(q, cos, sin, interleaved=True, seqlen_offset=offset),
                ops.rotary_embedding(k, cos, sin, interleaved=True, seqlen_offset=offset))

    def apply_rotary(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        """The guide's helper: rotate ``x`` by broadcastable ``sin``/``cos`` of shape ``(1, L, 1, d/2)``."""
        return ops.rotary_embedding(x, cos.reshape(cos.shape[1], -1), sin.reshape(sin.shape[1], -1), interleaved=True)
