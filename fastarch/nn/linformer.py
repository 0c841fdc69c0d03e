"""Linformer: self-attention over keys/values compressed along the sequence, ``softmax(Q (E K)^T / sqrt(d)) (F V)``.

Drop-in for the seed guide's ``Linformer(d_model, n_heads, seq_len, k=256, dropout=0.1)``: same
constructor, ``state_dict`` keys (``w_q``, ``w_k``, ``w_v``, ``E``, ``F``, ``w_o``) and, in eval mode,
the same outputs for the same weights. Attention runs through :func:`fastarch.ops.attention` (the
compressed length ``k`` plays the role of the key length).

Beyond the guide (see docs/efficient.md):

- inputs shorter than ``seq_len`` work: the first ``L`` columns of E/F are used, as fairseq's Linformer
  does (the guide would fail on the shape); a longer input raises a clear error;
- ``share_kv=True`` uses one projection for keys and values (no ``F`` parameters);
- ``headwise=True`` gives every head its own E (and F): ``E.weight`` becomes ``(n_heads, k, seq_len)``;
- ``mask`` is the guide's: broadcastable to ``(B, n_heads, L, k)`` over the *compressed* keys, 0 = masked.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import ops
from .attention import Attention
from .linear import Linear

__all__ = ["Linformer"]


class _HeadwiseProjection(nn.Module):
    """Per-head sequence projection; ``weight`` is ``(n_heads, k, seq_len)``."""

    def __init__(self, n_heads: int, seq_len: int, k: int) -> None:
        super().__init__()
        w = torch.empty(n_heads, k, seq_len)
        for h in range(n_heads):  # nn.Linear's default init, per head
            nn.init.kaiming_uniform_(w[h], a=5 ** 0.5)
        self.weight = nn.Parameter(w)


class Linformer(Attention):
    """Linformer self-attention.

    Args:
        d_model: model width; ``d_model % n_heads == 0``.
        n_heads: heads.
        seq_len: the longest sequence (E/F have this many columns).
        k: compressed length (``min(k, seq_len)``, as the guide).
        dropout: on attention probabilities (training only) and on the output, as the guide.
        share_kv: one projection for keys and values.
        headwise: separate projections per head.

    Shapes: ``forward(x (B, L, d_model), mask=None) -> (B, L, d_model)`` with ``L <= seq_len``.
    """

    def __init__(self, d_model: int, n_heads: int, seq_len: int, k: int = 256, dropout: float = 0.1, *,
                 share_kv: bool = False, headwise: bool = False) -> None:
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"))
        if seq_len < 1 or k < 1:
            raise ValueError(f"Linformer: seq_len and k must be >= 1, got seq_len={seq_len}, k={k}")
        self.seq_len = seq_len
        self.k = min(k, seq_len)
        self.share_kv = share_kv
        self.headwise = headwise

        def proj() -> nn.Module:
            if headwise:
                return _HeadwiseProjection(n_heads, seq_len, self.k)
            return Linear(seq_len, self.k, bias=False)

        self.E = proj()
        self.F = None if share_kv else proj()
        self._modules["w_o"] = self._modules.pop("w_o")  # the guide's key order: E, F before w_o
        self.dropout = nn.Dropout(dropout)

    def _compress(self, proj: nn.Module, t: torch.Tensor, L: int) -> torch.Tensor:
        # t (B, H, L, d) -> (B, H, k, d): E[:, :L] t, slicing the projection for shorter inputs (fairseq).
        w = proj.weight[..., :L]
        if self.headwise:
            return torch.einsum("hkl,bhld->bhkd", w.to(t.dtype), t)
        return torch.matmul(w.to(t.dtype), t)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"Linformer: argument 'x' must have shape (batch, seq_len, {self.d_model}), "
                             f"got {tuple(x.shape)}")
        b, L, _ = x.shape
        if L > self.seq_len:
            raise ValueError(f"Linformer: input length {L} exceeds seq_len={self.seq_len} that E/F were built "
                             f"for; build the module with seq_len >= {L}")
        q, k, v = (t.transpose(1, 2) for t in self.project(x, x, x))
        k = self._compress(self.E, k, L)
        v = self._compress(self.E if self.F is None else self.F, v, L)
        bias = None
        if mask is not None:
            kk = k.shape[2]
            try:
                keep = torch.broadcast_to(mask, (b, self.n_heads, L, kk))
            except RuntimeError:
                raise ValueError(f"Linformer: argument 'mask' must broadcast to (batch, n_heads, seq_len, k) = "
                                 f"({b}, {self.n_heads}, {L}, {kk}), got {tuple(mask.shape)}") from None
            # The guide fills masked scores with -1e9; an additive -1e9 gives the same probabilities.
            bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(keep == 0, -1e9)
        p = self.dropout.p if self.training else 0.0
        out = ops.attention(q, k, v, attn_bias=bias, dropout_p=p)
        out = out.transpose(1, 2).reshape(b, L, self.d_model)
        return self.dropout(self.w_o(out))
