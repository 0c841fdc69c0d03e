"""Triton kernels for Reformer LSH attention: chunked attention with look-one-back over the sorted rounds.

The hashing and sorting happen before (fastarch/ops/lsh_attention.py). ``perm`` ``(B, H, S)`` gives the
original position in every slot of the concatenated sorted rounds (``>= L`` is padding); chunk ``c`` is slots
``[c bs, (c+1) bs)`` and its queries attend the ``2 bs`` keys of chunk ``c-1`` (chunk 0 wraps to the last)
and of chunk ``c``. Every tile is read straight through ``perm``: nothing is gathered in memory, and the keys
are normalised to unit length as they are loaded (no normalised copy of ``qk``).

The kernels are tiled like flash attention, so any bucket size fits in shared memory:

- forward: one program per (query block of a chunk, batch*head), an online softmax over key blocks of the
  chunk's ``2 bs`` keys; writes the round's output and log-sum-exp per slot (the op combines rounds);
- backward, with the combined ``LSE`` (``P = exp(s - LSE)``, ``dS = P (G V^T - delta)``): one kernel for dQ
  per slot, one for dK/dV per (half, key block) where half 0 is a chunk's look-back keys (slots of chunk
  ``c-1``) and half 1 its own keys. A key slot gets one contribution of each half, written to separate
  buffers, so every buffer slot has exactly one writer (no atomics, deterministic).

fp16/bf16 tiles go to the tensor cores (operands in the input dtype, fp32 accumulation, as flash attention);
fp32 tiles use exact fp32 products (``input_precision="ieee"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NORM_EPS = 1e-12  # as F.normalize


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _blocks(bucket_size: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): query rows, key rows and padded head dim per tile.

    Chosen so that the q/k/v tiles and the score tile stay well inside the shared memory of an A100
    (164 KiB) in fp32 as well; ``tests/kernels/compile_triton_lsh.py`` compiles them for sm_80/sm_90 and
    prints the shared memory each uses.
    """
    bd = _pow2(head_dim)
    budget = 64 * 64 if dtype == torch.float32 else 128 * 64  # rows x head-dim elements per tile
    rows = max(16, min(64, budget // bd))
    bm = min(rows, _pow2(bucket_size))
    bn = min(rows, _pow2(2 * bucket_size))
    return bm, bn, bd


@triton.jit
def _chunk_query_rows(bs, BLOCK_M: tl.constexpr):
    # program_id(0) enumerates (chunk, query block): the chunk c and the rows i of its block
    n_mb = tl.cdiv(bs, BLOCK_M)
    return tl.program_id(0) // n_mb, (tl.program_id(0) % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)


@triton.jit
def _program(PERM, KPM, c, S, C, H, L, D, BLOCK_D: tl.constexpr):
    # this program's (batch*head) bh, chunk c's look-back chunk, the head-dim columns, and bh's rows of the
    # permutation, the key mask and qk/v
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    return bh, (c + C - 1) % C, cols, cols < D, PERM + bh * S, KPM + (bh // H) * L, bh * L * D


@triton.jit
def _rows(ptr, pos, L, D, cols, dmask):
    # rows of a (L, D) matrix at positions pos; out-of-range (padding) rows read as 0
    return tl.load(
        ptr + pos[:, None] * D + cols[None, :], mask=(pos < L)[:, None] & dmask[None, :], other=0.0
    )


@triton.jit
def _unit_rows(ptr, pos, L, D, cols, dmask, eps):
    # keys: the rows normalised to unit length, as F.normalize (x / max(|x|, eps)), in the input dtype
    x = _rows(ptr, pos, L, D, cols, dmask)
    xf = x.to(tl.float32)
    n = tl.sqrt(tl.sum(xf * xf, axis=1))
    return (xf / tl.maximum(n, eps)[:, None]).to(x.dtype)


@triton.jit
def _key_positions(PERM_bh, c, cprev, j, bs, L):
    # key j of chunk c's look-one-back list: j < bs is slot j of chunk c-1, else slot j-bs of chunk c
    slot = tl.where(j < bs, cprev * bs + j, c * bs + j - bs)
    return tl.load(PERM_bh + slot, mask=j < 2 * bs, other=L)


@triton.jit
def _valid(qpos, kpos, KPM_b, L, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr):
    # (query, key) pairs that may attend: real key, not the query itself, unmasked, causal
    ok = (kpos < L)[None, :] & (kpos[None, :] != qpos[:, None])
    if HAS_KPM:
        kv = tl.load(KPM_b + kpos, mask=kpos < L, other=0).to(tl.int1)
        ok = ok & kv[None, :]
    if CAUSAL:
        ok = ok & (kpos[None, :] <= qpos[:, None])
    return ok


@triton.jit
def _query_block(PERM_bh, Q, G, LSE_bh, DELTA_bh, base, c, i, bs, L, D, cols, dmask):
    # backward: rows i of chunk c's queries, their output gradient, combined LSE and delta = g . out
    qpos = tl.load(PERM_bh + c * bs + i, mask=i < bs, other=L)
    q = _rows(Q + base, qpos, L, D, cols, dmask)
    g = _rows(G + base, qpos, L, D, cols, dmask)
    real = qpos < L
    lse = tl.load(LSE_bh + qpos, mask=real, other=float("-inf"))
    delta = tl.load(DELTA_bh + qpos, mask=real, other=0.0)
    return qpos, q, g, lse, delta


@triton.jit
def _probs(
    q, k, qpos, kpos, lse, KPM_b, L, scale, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr
):
    # backward: P = exp(s - LSE) on valid pairs, 0 elsewhere and on rows that attended nothing (LSE = -inf)
    live = lse > float("-inf")
    ok = _valid(qpos, kpos, KPM_b, L, HAS_KPM, CAUSAL) & live[:, None]
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    return tl.where(ok, tl.exp(tl.minimum(s - tl.where(live, lse, 0.0)[:, None], 0.0)), 0.0)  # s <= LSE


@triton.jit
def _lsh_fwd_kernel(
    Q, V, PERM, KPM, O_S, LSE_S,
    L, D, S, C, bs, H, scale, eps,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c, i = _chunk_query_rows(bs, BLOCK_M)
    bh, cprev, cols, dmask, PERM_bh, KPM_b, base = _program(PERM, KPM, c, S, C, H, L, D, BLOCK_D)
    imask = i < bs
    qpos = tl.load(PERM_bh + c * bs + i, mask=imask, other=L)
    q = _rows(Q + base, qpos, L, D, cols, dmask)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, 2 * bs, BLOCK_N):
        kpos = _key_positions(PERM_bh, c, cprev, n0 + tl.arange(0, BLOCK_N), bs, L)
        k = _unit_rows(Q + base, kpos, L, D, cols, dmask, eps)
        v = _rows(V + base, kpos, L, D, cols, dmask)
        ok = _valid(qpos, kpos, KPM_b, L, HAS_KPM, CAUSAL)
        s = tl.where(ok, tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp(-inf) = 0
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    has = (l_i > 0.0) & (qpos < L)
    ls = tl.where(has, l_i, 1.0)
    o = tl.where(has[:, None], acc / ls[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(ls), float("-inf"))
    slot = bh * S + c * bs + i
    tl.store(O_S + slot[:, None] * D + cols[None, :], o, mask=imask[:, None] & dmask[None, :])
    tl.store(LSE_S + slot, lse, mask=imask)


@triton.jit
def _lsh_bwd_dq_kernel(
    G, Q, V, LSE, DELTA, PERM, KPM, DQ_S,
    L, D, S, C, bs, H, scale, eps,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    c, i = _chunk_query_rows(bs, BLOCK_M)
    bh, cprev, cols, dmask, PERM_bh, KPM_b, base = _program(PERM, KPM, c, S, C, H, L, D, BLOCK_D)
    imask = i < bs
    qpos, q, g, lse, delta = _query_block(
        PERM_bh, Q, G, LSE + bh * L, DELTA + bh * L, base, c, i, bs, L, D, cols, dmask
    )
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, 2 * bs, BLOCK_N):
        kpos = _key_positions(PERM_bh, c, cprev, n0 + tl.arange(0, BLOCK_N), bs, L)
        k = _unit_rows(Q + base, kpos, L, D, cols, dmask, eps)
        v = _rows(V + base, kpos, L, D, cols, dmask)
        p = _probs(q, k, qpos, kpos, lse, KPM_b, L, scale, HAS_KPM, CAUSAL, PREC)
        dp = tl.dot(g, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    slot = bh * S + c * bs + i
    tl.store(DQ_S + slot[:, None] * D + cols[None, :], dq, mask=imask[:, None] & dmask[None, :])


@triton.jit
def _lsh_bwd_dkv_kernel(
    G, Q, V, LSE, DELTA, PERM, KPM, DK_S, DV_S,
    L, D, S, C, bs, H, scale, eps,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # program (c, half, key block): half 0 = chunk c's look-back keys (slots of chunk c-1), 1 = its own keys
    n_nb = tl.cdiv(bs, BLOCK_N)
    c = tl.program_id(0) // (2 * n_nb)
    half = ((tl.program_id(0) // n_nb) % 2).to(tl.int64)
    j = (tl.program_id(0) % n_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    bh, cprev, cols, dmask, PERM_bh, KPM_b, base = _program(PERM, KPM, c, S, C, H, L, D, BLOCK_D)
    jmask = j < bs
    kslot = tl.where(half == 0, cprev, c) * bs + j
    kpos = tl.load(PERM_bh + kslot, mask=jmask, other=L)
    k = _unit_rows(Q + base, kpos, L, D, cols, dmask, eps)
    v = _rows(V + base, kpos, L, D, cols, dmask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for m0 in range(0, bs, BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        qpos, q, g, lse, delta = _query_block(
            PERM_bh, Q, G, LSE + bh * L, DELTA + bh * L, base, c, i, bs, L, D, cols, dmask
        )
        p = _probs(q, k, qpos, kpos, lse, KPM_b, L, scale, HAS_KPM, CAUSAL, PREC)  # (BLOCK_M, BLOCK_N)
        dv = tl.dot(tl.trans(p.to(g.dtype)), g, dv, input_precision=PREC)
        dp = tl.dot(g, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * scale
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
    # dK/dV buffers are (2, B*H, S, D): one plane per half
    out = (half * tl.num_programs(1) * S + bh * S + kslot)[:, None] * D + cols[None, :]
    m2 = jmask[:, None] & dmask[None, :]
    tl.store(DK_S + out, dk, mask=m2)
    tl.store(DV_S + out, dv, mask=m2)


def _kpm_arg(kpm: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if kpm is None:
        return torch.ones(1, dtype=torch.int8, device=like.device), False
    return kpm.to(torch.int8).contiguous(), True


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for fp16/bf16 operands


def lsh_attention_chunk_fwd(
    qk: torch.Tensor,
    v: torch.Tensor,
    perm: torch.Tensor,
    kpm: torch.Tensor | None,
    causal: bool,
    bucket_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-round chunk attention. qk, v ``(B, H, L, D)`` contiguous, same dtype (fp32/fp16/bf16); perm
    ``(B, H, S)`` int64; kpm ``(B, L)`` bool or None.

    Returns the per-slot output ``(B, H, S, D)`` fp32 and log-sum-exp ``(B, H, S)`` fp32 (``-inf``: no valid
    key but the query itself)."""
    B, H, L, D = qk.shape
    S = perm.shape[-1]
    C = S // bucket_size
    bm, bn, bd = _blocks(bucket_size, D, qk.dtype)
    o_s = torch.empty(B, H, S, D, dtype=torch.float32, device=qk.device)
    lse_s = torch.empty(B, H, S, dtype=torch.float32, device=qk.device)
    km, has_kpm = _kpm_arg(kpm, qk)
    grid = (C * triton.cdiv(bucket_size, bm), B * H)
    _lsh_fwd_kernel[grid](
        qk, v, perm.contiguous(), km, o_s, lse_s,
        L, D, S, C, bucket_size, H, D**-0.5, _NORM_EPS,
        HAS_KPM=has_kpm, CAUSAL=bool(causal), PREC=_prec(qk.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
    )  # fmt: skip
    return o_s, lse_s


def lsh_attention_chunk_bwd(
    g: torch.Tensor,
    qk: torch.Tensor,
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

    g, qk, v ``(B, H, L, D)`` contiguous in one dtype; lse/delta ``(B, H, L)`` fp32, the combined log-sum-exp
    and ``dout . out``; inv ``(B, H, NH, L)``. (The all-rounds-empty fallback ``out = v`` is the caller's.)
    """
    B, H, L, D = qk.shape
    S = perm.shape[-1]
    C = S // bucket_size
    NH = inv.shape[2]
    bm, bn, bd = _blocks(bucket_size, D, qk.dtype)
    dq_s = torch.empty(B, H, S, D, dtype=torch.float32, device=qk.device)
    dk_s = torch.empty(2, B, H, S, D, dtype=torch.float32, device=qk.device)  # [look-back, own] halves
    dv_s = torch.empty_like(dk_s)
    km, has_kpm = _kpm_arg(kpm, qk)
    perm = perm.contiguous()
    args = (L, D, S, C, bucket_size, H, D**-0.5, _NORM_EPS)
    meta = dict(
        HAS_KPM=has_kpm, CAUSAL=bool(causal), PREC=_prec(qk.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd
    )
    _lsh_bwd_dq_kernel[(C * triton.cdiv(bucket_size, bm), B * H)](
        g, qk, v, lse, delta, perm, km, dq_s, *args, **meta
    )
    bn_own = min(bn, _pow2(bucket_size))  # key blocks of one half (bucket_size keys)
    _lsh_bwd_dkv_kernel[(C * 2 * triton.cdiv(bucket_size, bn_own), B * H)](
        g, qk, v, lse, delta, perm, km, dk_s, dv_s, *args, **dict(meta, BLOCK_N=bn_own)
    )
    idx = inv.reshape(B, H, NH * L, 1).expand(B, H, NH * L, D)

    def unsort(x: torch.Tensor) -> torch.Tensor:
        return x.gather(2, idx).view(B, H, NH, L, D).sum(2)

    return unsort(dq_s), unsort(dk_s[0] + dk_s[1]), unsort(dv_s[0] + dv_s[1])


# Former names of the launchers.
lsh_chunk_fwd = lsh_attention_chunk_fwd
lsh_chunk_bwd = lsh_attention_chunk_bwd
