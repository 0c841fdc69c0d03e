"""Additive (Bahdanau) attention of guide 000, drop-in.

score(q_i, k_j) = v^T tanh(W_q q_i + W_k k_j). The guide materialises the (B, Lq, Lk, hidden) tensor
``tanh(q + k)`` for all pairs at once; here the query axis is processed in chunks sized so that the
intermediate stays under ``chunk_elements`` values, and in training each chunk is recomputed in the
backward (activation checkpointing) instead of storing it, so long sequences fit in memory. Same math,
same parameters (``W_q``, ``W_k``, ``v``), same outputs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ._models_common import check_input
from .linear import Linear

__all__ = ["AdditiveAttention"]


def _scores(q: torch.Tensor, k: torch.Tensor, v_w: torch.Tensor) -> torch.Tensor:
    # q (B, c, 1, D), k (B, 1, Lk, D), v_w (1, D) -> (B, c, Lk)
    return torch.matmul(torch.tanh(q + k), v_w.t()).squeeze(-1)


class AdditiveAttention(nn.Module):
    """forward(query (B, Lq, D), keys (B, Lk, D), values (B, Lk, Dv), mask (B, Lq, Lk) or broadcastable,
    0 = masked) -> (context (B, Lq, Dv), attention (B, Lq, Lk))."""

    def __init__(self, hidden_dim: int, dropout: float = 0.1, chunk_elements: int = 1 << 22):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.chunk_elements = chunk_elements
        self.W_q = Linear(hidden_dim, hidden_dim, bias=False)
        self.W_k = Linear(hidden_dim, hidden_dim, bias=False)
        self.v = Linear(hidden_dim, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        for name, t in (("query", query), ("keys", keys)):
            check_input(name, t, ndim=3, last=self.hidden_dim, owner="AdditiveAttention")
        check_input("values", values, ndim=3, owner="AdditiveAttention")
        if keys.shape[:2] != values.shape[:2] or query.shape[0] != keys.shape[0]:
            raise ValueError("AdditiveAttention: 'keys' and 'values' must share (B, Lk) and 'query' must share B; "
                             f"got {tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
        q = self.W_q(query).unsqueeze(2)
        k = self.W_k(keys).unsqueeze(1)
        b, lq, lk, d = q.shape[0], q.shape[1], k.shape[2], q.shape[-1]
        chunk = max(1, self.chunk_elements // max(1, b * lk * d))
        parts = []
        for s in range(0, lq, chunk):
            qc = q[:, s:s + chunk]
            if torch.is_grad_enabled() and (qc.requires_grad or k.requires_grad) and lq > chunk:
                parts.append(checkpoint(_scores, qc, k, self.v.weight, use_reentrant=False))
            else:
                parts.append(_scores(qc, k, self.v.weight))
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(attention, values), attention
