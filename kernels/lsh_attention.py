"""Triton kernels for Reformer LSH attention: chunked attention with look-one-back over the sorted rounds.

The hashing and sorting happen in torch (fastarch/ops/lsh_attention.py). ``perm`` ``(B, H, S)`` gives the
original position in every slot of the concatenated sorted rounds (``>= L`` is padding). One program
handles one chunk of one (batch, head): it loads its queries and the keys/values of its chunk and of the
chunk before it (chunk 0 wraps to the last) straight through ``perm``, so nothing is gathered in memory.

Forward writes, per slot, the round's output and log-sum-exp; the op combines rounds (cheap, O(L·D)).
Backward uses the combined LSE: ``P = exp(s - LSE)``, ``dS = P (G V^T - delta)``, and writes dQ per slot,
and dK/dV of the chunk's own keys and of the previous chunk's keys into two separate buffers, so every
buffer slot has exactly one writer (no atomics, deterministic). The op sums each position's slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _load_rows(ptr, pos, L, D, cols, dmask):
    # rows of a (L, D) matrix at positions pos; out-of-range (padding) rows read as 0
    return tl.load(
        ptr + pos[:, None] * D + cols[None, :], mask=(pos < L)[:, None] & dmask[None, :], other=0.0
    )


@triton.jit
def _valid(qpos, kpos, KPM_b, L, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr):
    ok = (kpos < L)[None, :] & (kpos[None, :] != qpos[:, None])
    if HAS_KPM:
        kv = tl.load(KPM_b + kpos, mask=kpos < L, other=0).to(tl.int1)
        ok = ok & kv[None, :]
    if CAUSAL:
        ok = ok & (kpos[None, :] <= qpos[:, None])
    return ok


@triton.jit
def _lsh_fwd_kernel(
    Q,
    KN,
    V,
    PERM,
    KPM,
    O_S,
    LSE_S,
    L,
    D,
    S,
    C,
    bs,
    H,
    scale,
    HAS_KPM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    cprev = (c + C - 1) % C
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < bs
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < D
    qpos = tl.load(PERM + bh * S + c * bs + rows, mask=rmask, other=L)
    ppos = tl.load(PERM + bh * S + cprev * bs + rows, mask=rmask, other=L)
    base = bh * L * D
    q = _load_rows(Q + base, qpos, L, D, cols, dmask).to(tl.float32)
    k_own = _load_rows(KN + base, qpos, L, D, cols, dmask).to(tl.float32)
    k_prev = _load_rows(KN + base, ppos, L, D, cols, dmask).to(tl.float32)
    v_own = _load_rows(V + base, qpos, L, D, cols, dmask).to(tl.float32)
    v_prev = _load_rows(V + base, ppos, L, D, cols, dmask).to(tl.float32)
    KPM_b = KPM + b * L
    ok1 = _valid(qpos, ppos, KPM_b, L, HAS_KPM, CAUSAL)
    ok2 = _valid(qpos, qpos, KPM_b, L, HAS_KPM, CAUSAL)
    s1 = tl.where(ok1, tl.dot(q, tl.trans(k_prev), input_precision="ieee") * scale, float("-inf"))
    s2 = tl.where(ok2, tl.dot(q, tl.trans(k_own), input_precision="ieee") * scale, float("-inf"))
    m = tl.maximum(tl.max(s1, axis=1), tl.max(s2, axis=1))
    has = (m > float("-inf")) & (qpos < L)
    ms = tl.where(has, m, 0.0)
    p1 = tl.where(ok1, tl.exp(s1 - ms[:, None]), 0.0)
    p2 = tl.where(ok2, tl.exp(s2 - ms[:, None]), 0.0)
    z = tl.sum(p1, axis=1) + tl.sum(p2, axis=1)
    zs = tl.where(has, z, 1.0)
    o = tl.dot(p1, v_prev, input_precision="ieee") + tl.dot(p2, v_own, input_precision="ieee")
    o = tl.where(has[:, None], o / zs[:, None], 0.0)
    lse = tl.where(has, ms + tl.log(zs), float("-inf"))
    slot = bh * S + c * bs + rows
    tl.store(O_S + slot[:, None] * D + cols[None, :], o, mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE_S + slot, lse, mask=rmask)


@triton.jit
def _lsh_bwd_kernel(
    G,
    Q,
    KN,
    V,
    LSE,
    DELTA,
    PERM,
    KPM,
    DQ_S,
    DK_OWN,
    DK_PREV,
    DV_OWN,
    DV_PREV,
    L,
    D,
    S,
    C,
    bs,
    H,
    scale,
    HAS_KPM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    cprev = (c + C - 1) % C
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < bs
    cols = tl.arange(0, BLOCK_D)
    dmask = cols < D
    qpos = tl.load(PERM + bh * S + c * bs + rows, mask=rmask, other=L)
    ppos = tl.load(PERM + bh * S + cprev * bs + rows, mask=rmask, other=L)
    base = bh * L * D
    q = _load_rows(Q + base, qpos, L, D, cols, dmask).to(tl.float32)
    g = _load_rows(G + base, qpos, L, D, cols, dmask).to(tl.float32)
    k_own = _load_rows(KN + base, qpos, L, D, cols, dmask).to(tl.float32)
    k_prev = _load_rows(KN + base, ppos, L, D, cols, dmask).to(tl.float32)
    v_own = _load_rows(V + base, qpos, L, D, cols, dmask).to(tl.float32)
    v_prev = _load_rows(V + base, ppos, L, D, cols, dmask).to(tl.float32)
    real = qpos < L
    lse = tl.load(LSE + bh * L + qpos, mask=real, other=float("-inf"))
    delta = tl.load(DELTA + bh * L + qpos, mask=real, other=0.0)
    live = lse > float("-inf")
    lses = tl.where(live, lse, 0.0)
    KPM_b = KPM + b * L
    ok1 = _valid(qpos, ppos, KPM_b, L, HAS_KPM, CAUSAL) & live[:, None]
    ok2 = _valid(qpos, qpos, KPM_b, L, HAS_KPM, CAUSAL) & live[:, None]
    s1 = tl.dot(q, tl.trans(k_prev), input_precision="ieee") * scale
    s2 = tl.dot(q, tl.trans(k_own), input_precision="ieee") * scale
    # s - LSE <= 0 up to rounding
    p1 = tl.where(ok1, tl.exp(tl.minimum(s1 - lses[:, None], 0.0)), 0.0)
    p2 = tl.where(ok2, tl.exp(tl.minimum(s2 - lses[:, None], 0.0)), 0.0)
    dp1 = tl.dot(g, tl.trans(v_prev), input_precision="ieee")
    dp2 = tl.dot(g, tl.trans(v_own), input_precision="ieee")
    ds1 = p1 * (dp1 - delta[:, None]) * scale
    ds2 = p2 * (dp2 - delta[:, None]) * scale
    dq = tl.dot(ds1, k_prev, input_precision="ieee") + tl.dot(ds2, k_own, input_precision="ieee")
    dk_prev = tl.dot(tl.trans(ds1), q, input_precision="ieee")
    dk_own = tl.dot(tl.trans(ds2), q, input_precision="ieee")
    dv_prev = tl.dot(tl.trans(p1), g, input_precision="ieee")
    dv_own = tl.dot(tl.trans(p2), g, input_precision="ieee")
    m2 = rmask[:, None] & dmask[None, :]
    own = (bh * S + c * bs + rows)[:, None] * D + cols[None, :]
    prev = (bh * S + cprev * bs + rows)[:, None] * D + cols[None, :]
    tl.store(DQ_S + own, dq, mask=m2)
    tl.store(DK_OWN + own, dk_own, mask=m2)
    tl.store(DV_OWN + own, dv_own, mask=m2)
    tl.store(DK_PREV + prev, dk_prev, mask=m2)
    tl.store(DV_PREV + prev, dv_prev, mask=m2)


def _kpm_arg(kpm: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if kpm is None:
        return torch.ones(1, dtype=torch.int8, device=like.device), False
    return kpm.to(torch.int8).contiguous(), True


def lsh_chunk_fwd(
    q: torch.Tensor,
    kn: torch.Tensor,
    v: torch.Tensor,
    perm: torch.Tensor,
    kpm: torch.Tensor | None,
    causal: bool,
    bucket_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, kn, v ``(B, H, L, D)`` contiguous; perm ``(B, H, S)`` int64. Returns the per-slot output
    ``(B, H, S, D)`` fp32 and log-sum-exp ``(B, H, S)`` fp32 (``-inf``: no valid key but the query)."""
    B, H, L, D = q.shape
    S = perm.shape[-1]
    C = S // bucket_size
    o_s = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    lse_s = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    km, has_kpm = _kpm_arg(kpm, q)
    _lsh_fwd_kernel[(C, B * H)](
        q,
        kn,
        v,
        perm.contiguous(),
        km,
        o_s,
        lse_s,
        L,
        D,
        S,
        C,
        bucket_size,
        H,
        D**-0.5,
        HAS_KPM=has_kpm,
        CAUSAL=bool(causal),
        BLOCK_M=_block(bucket_size),
        BLOCK_D=_block(D),
    )
    return o_s, lse_s


def lsh_chunk_bwd(
    g: torch.Tensor,
    q: torch.Tensor,
    kn: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    perm: torch.Tensor,
    inv: torch.Tensor,
    kpm: torch.Tensor | None,
    causal: bool,
    bucket_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. the raw queries, the normalised keys and the values, ``(B, H, L, D)`` fp32 each.

    lse/delta ``(B, H, L)`` are the combined log-sum-exp and ``dout . out``; inv ``(B, H, NH, L)``.
    (The all-rounds-empty fallback ``out = v`` is the caller's.)
    """
    B, H, L, D = q.shape
    S = perm.shape[-1]
    C = S // bucket_size
    NH = inv.shape[2]
    bufs = [torch.empty(B, H, S, D, dtype=torch.float32, device=q.device) for _ in range(5)]
    dq_s, dk_own, dk_prev, dv_own, dv_prev = bufs
    km, has_kpm = _kpm_arg(kpm, q)
    _lsh_bwd_kernel[(C, B * H)](
        g,
        q,
        kn,
        v,
        lse,
        delta,
        perm.contiguous(),
        km,
        dq_s,
        dk_own,
        dk_prev,
        dv_own,
        dv_prev,
        L,
        D,
        S,
        C,
        bucket_size,
        H,
        D**-0.5,
        HAS_KPM=has_kpm,
        CAUSAL=bool(causal),
        BLOCK_M=_block(bucket_size),
        BLOCK_D=_block(D),
    )
    idx = inv.reshape(B, H, NH * L, 1).expand(B, H, NH * L, D)

    def unsort(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, idx).view(B, H, NH, L, D).sum(2)

    return unsort(dq_s), unsort(dk_own + dk_prev), unsort(dv_own + dv_prev)
