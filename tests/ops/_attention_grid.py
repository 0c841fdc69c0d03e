"""FlashAttention's test grid, transcribed: sequence-length pairs, head dims, and the PyTorch same-dtype
baseline that its low-precision criterion measures against."""

from __future__ import annotations

import torch

SEQLEN_PAIRS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1023, 1024), (1024, 1023)]
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


def covering_grid(features: list[dict]) -> list[dict]:
    """One case per head dim, the seqlen pairs cycled so that every pair and every dim appears, and the
    feature dicts cycled over them (a deterministic covering subset of the full cross product)."""
    cases = []
    for i, d in enumerate(HEAD_DIMS):
        lq, lk = SEQLEN_PAIRS[i % len(SEQLEN_PAIRS)]
        cases.append(dict(Lq=lq, Lk=lk, D=d, **features[i % len(features)]))
    return cases


def visible(Lq: int, Lk: int, causal: bool = False, window=(-1, -1)) -> torch.Tensor:
    """(Lq, Lk) bool: query i sees key j (bottom-right aligned window, -1 unlimited)."""
    wl, wr = window
    if causal:
        wr = 0
    pos = torch.arange(Lq).view(-1, 1) + (Lk - Lq)
    j = torch.arange(Lk).view(1, -1)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if wl >= 0:
        ok &= j >= pos - wl
    if wr >= 0:
        ok &= j <= pos + wr
    return ok


def dense_same_dtype(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, scale=None):
    """PyTorch attention computed in q's dtype (FlashAttention's baseline), (B, H, L, D); rows that see no
    key give 0. Differentiable."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, k.transpose(-2, -1)) * (D ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        dist = (torch.arange(Lq).view(-1, 1) + Lk - Lq - torch.arange(Lk).view(1, -1)).abs()
        sl = alibi_slopes.view(-1, H, 1, 1) if alibi_slopes.dim() == 2 else alibi_slopes.view(1, H, 1, 1)
        s = s - (sl * dist).to(s.dtype)
    ok = visible(Lq, Lk, causal, window)
    empty = ~ok.any(-1).view(1, 1, Lq, 1)
    s = s.masked_fill(~ok, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    return torch.matmul(p, v)
