"""FlashAttention-2 style Triton kernels for ``fastarch.ops.attention``: forward, backward, split-K decode.

Launchers (called by the ``triton`` Implementation in ``fastarch/ops/attention.py``):

- ``attention_fwd(q, k, v, ...) -> (o, lse)``
- ``attention_bwd(do, q, k, v, o, lse, ...) -> (dq, dk, dv, dbias_or_None)``

Shapes: q ``(B, H, Lq, D)``, k/v ``(B, Hk, Lk, D)`` with ``Hk | H`` (GQA: query head h reads kv head
``h // (H // Hk)``), o ``(B, H, Lq, D)`` in q's dtype, lse ``(B, H, Lq)`` fp32 natural-log log-sum-exp
(``-inf`` and ``o = 0`` for a row that sees no key).

Masking, all bottom-right aligned (query row i sits at key position ``i + Lk - Lq``): key j is visible from
row i when ``qpos - left <= j <= qpos + right`` (``-1`` = unlimited), ``key_padding_mask[b, j]`` is True and
``j < Lk``. Each query block loops only over the key blocks that intersect its band (and each key block in
the backward only over the query blocks that intersect it), so causal costs about half of full attention and
a window of width w costs O(L*w). Blocks wholly inside the band skip the per-element window mask.

Numerics: online softmax in the log2 domain (``exp2`` with ``scale * log2(e)`` folded into the scores),
fp32 accumulation, fp32 matmuls in IEEE precision unless ``torch.backends.cuda.matmul.allow_tf32``.

Dropout: the keep-mask is the hash of ``(seed, b, h, i, j)`` defined by
``fastarch.ops.attention.dropout_keep_mask``, computed in-kernel with wrapping uint32 arithmetic; the
backward regenerates it instead of storing it. ``drop_row0``/``drop_col0`` shift i and j, so a sequence of a
packed (variable-length) batch, launched on its own slice, draws the mask of its packed rows and keys.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["attention_fwd", "attention_bwd", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# Keys per split of the split-K decode path; a multiple of every BLOCK_N so splits align with key blocks.
_SPLIT_ALIGN = 256
_DECODE_MAX_LQ = 16


# -- autotuning -------------------------------------------------------------------------------------------
def _cfgs(rows: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in rows]


if _INTERPRET:
    # One small config per kernel (two for the forward: the decode tile): the interpreter runs every program
    # instance serially in numpy, so autotuning would only cost time. BLOCK_M != BLOCK_N on purpose so that
    # tests exercise the block-range arithmetic on both axes.
    _FWD_CONFIGS = _cfgs([(16, 16, 4, 1), (32, 16, 4, 1)])
    _BWD_KV_CONFIGS = _cfgs([(16, 32, 4, 1)])
    _BWD_Q_CONFIGS = _cfgs([(32, 16, 4, 1)])
else:
    _FWD_CONFIGS = _cfgs([
        (128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3),
        (64, 32, 4, 4), (64, 64, 4, 2), (32, 64, 4, 3),
        (16, 64, 4, 3), (16, 128, 4, 3), (16, 256, 8, 2), (16, 32, 2, 4),  # decode tiles (Lq <= 16)
    ])
    # dK/dV: BLOCK_N keys resident, BLOCK_M query rows streamed.  dQ: BLOCK_M rows resident, keys streamed.
    _BWD_KV_CONFIGS = _cfgs([
        (32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4), (32, 128, 4, 2),
        (16, 128, 4, 3),
    ])
    _BWD_Q_CONFIGS = _cfgs([
        (128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (64, 16, 4, 4), (128, 32, 4, 2),
        (16, 64, 4, 3), (16, 32, 4, 3),
    ])


def _fits(cfg: triton.Config, block_d: int) -> bool:
    # Keep the resident tiles within what registers/shared memory can hold for large head dims.
    m, n = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    return max(m, n) * block_d <= 128 * 128 and m * n * block_d <= 128 * 64 * 256


def _length_key(n: int) -> int:
    """The autotuning key of a sequence length: its power-of-two bucket (at least 16). Keying on the exact
    length would tune again, compiling every config, for each new length: every step of a decode loop."""
    return max(16, triton.next_power_of_2(int(n)))


def _prune(configs: list[triton.Config], nargs: dict, *, decode_rows: bool) -> list[triton.Config]:
    # Pruned once per key, so only the bucketed lengths may decide.
    lq, max_m, max_n, block_d = nargs["LQ_KEY"], nargs["LQ_KEY"], nargs["LK_KEY"], nargs["BLOCK_D"]
    out = [c for c in configs if c.kwargs["BLOCK_M"] <= max_m and c.kwargs["BLOCK_N"] <= max_n
           and _fits(c, block_d)]
    if decode_rows:
        # Decode (few query rows): only the 16-row tiles, so no 64-row tile is wasted on a single query.
        small = [c for c in out if c.kwargs["BLOCK_M"] == 16]
        big = [c for c in out if c.kwargs["BLOCK_M"] > 16]
        out = small if lq <= _DECODE_MAX_LQ else (big or small)
    if not out:
        out = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    if _INTERPRET:
        out = out[-1:]
    return out


def _prune_fwd(configs, nargs, **kwargs):
    return _prune(configs, {**nargs, **kwargs}, decode_rows=True)


def _prune_bwd(configs, nargs, **kwargs):
    return _prune(configs, {**nargs, **kwargs}, decode_rows=False)


# -- shared device helpers --------------------------------------------------------------------------------
@triton.jit
def _mix32(x):
    # x is uint32: multiplications wrap mod 2**32 exactly like the reference's "& 0xFFFFFFFF".
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _dropout_key(seed, b, h, H):
    bh = (b * H + h).to(tl.uint32)
    return _mix32(seed.to(tl.uint32) ^ _mix32(bh))


@triton.jit
def _keep_tile(key, offs_m, offs_n, thresh):
    """(BLOCK_M, BLOCK_N) bool keep-mask for query rows offs_m and key columns offs_n."""
    ij = offs_m.to(tl.uint32)[:, None] * 0x9E3779B1 + offs_n.to(tl.uint32)[None, :]
    r = _mix32(key ^ _mix32(ij))
    return (r >> 8) >= thresh.to(tl.uint32)


@triton.jit
def _load_rows(base, offs, stride, offs_d, L, D, CHECK_L: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (len(offs), BLOCK_D) tile of rows offs (masked past L when CHECK_L, past D unless EVEN_D)."""
    ptrs = base + offs[:, None] * stride + offs_d[None, :]
    if CHECK_L:
        if EVEN_D:
            t = tl.load(ptrs, mask=(offs < L)[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=(offs < L)[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        if EVEN_D:
            t = tl.load(ptrs)
        else:
            t = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return t


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1) saturates to +-1 for large |x| (no inf / inf).
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _scores(q, k, offs_m, offs_n, qk_scale, bias_base, stride_biasm, stride_biasn, kpm_base, stride_kpmn,
            Lq, Lk, off, left, right, softcap2, slope,
            MASK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
            HAS_ALIBI: tl.constexpr, PREC: tl.constexpr):
    """Scores in the log2 domain, (BLOCK_M, BLOCK_N) fp32, masked entries -inf; and the tanh of the
    soft-capping (the backward's derivative ``1 - t^2``; the scaled scores themselves without softcap).

    Soft-capping acts on the scaled scores (``softcap2 = softcap * log2(e)`` in this domain), before the bias
    and ALiBi (``slope`` is the head's slope times log2(e); distance ``|i + Lk - Lq - j|``).
    MASK: apply the band and the tile edges (blocks straddling the band or the sequence ends); blocks wholly
    inside both skip it (their keys are < Lk; rows past Lq only occur in a forward/dQ tail tile, where q is
    loaded as 0 and the row is never stored). Padding, bias and ALiBi are data, so they apply everywhere.
    """
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    tcap = s
    if HAS_SOFTCAP:
        tcap = _tanh(s / softcap2)
        s = tcap * softcap2
    if HAS_BIAS:
        # int64 row offsets: Lq * Lk elements per head can pass 2**31 for long sequences.
        bptrs = bias_base + offs_m.to(tl.int64)[:, None] * stride_biasm + offs_n[None, :] * stride_biasn
        if MASK:
            bias = tl.load(bptrs, mask=(offs_m < Lq)[:, None] & (offs_n < Lk)[None, :], other=0.0)
        else:
            # Unmasked blocks lie inside Lk, but a query tile may still run past Lq.
            bias = tl.load(bptrs, mask=(offs_m < Lq)[:, None], other=0.0)
        s += bias.to(tl.float32) * 1.4426950408889634
    if HAS_ALIBI:
        s -= slope * tl.abs((offs_m + off)[:, None] - offs_n[None, :]).to(tl.float32)
    if MASK:
        qpos = (offs_m + off)[:, None]
        j = offs_n[None, :]
        valid = (j >= qpos - left) & (j <= qpos + right) & (j < Lk) & (offs_m < Lq)[:, None]
        s = tl.where(valid, s, float("-inf"))
    if HAS_KPM:
        kp = tl.load(kpm_base + offs_n * stride_kpmn, mask=offs_n < Lk, other=0)
        s = tl.where((kp != 0)[None, :], s, float("-inf"))
    return s, tcap


@triton.jit
def _band(m0, rows_end, Lk, off, left, right, lo_limit, hi_limit, BLOCK_N: tl.constexpr):
    """Key-block ranges for query rows [m0, rows_end): returns (n_lo, full_lo, full_hi, hi).

    Keys [n_lo, hi) intersect the band; blocks starting in [full_lo, full_hi) are entirely visible to every
    row (no band/edge masking needed). The caller loops masked [n_lo, min(full_lo, hi)), unmasked
    [full_lo, full_hi), masked [max(full_lo, full_hi), hi). lo_limit/hi_limit clip to a split-K chunk.
    """
    q_first = m0 + off
    q_last = rows_end - 1 + off
    lo = tl.maximum(tl.maximum(q_first - left, 0), lo_limit)
    hi = tl.minimum(tl.minimum(q_last + right + 1, Lk), hi_limit)
    n_lo = (lo // BLOCK_N) * BLOCK_N
    full_a = tl.maximum(lo, q_last - left)
    full_b = tl.maximum(tl.minimum(hi, q_first + right + 1), 0)
    full_lo = ((full_a + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_hi = (full_b // BLOCK_N) * BLOCK_N
    return n_lo, full_lo, full_hi, hi


@triton.jit
def _alibi_slope(alibi, b, h, stride_ab, stride_ah, HAS_ALIBI: tl.constexpr):
    """Head (b, h)'s ALiBi slope in the log2 domain (0 without ALiBi)."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi + b * stride_ab + h.to(tl.int64) * stride_ah) * 1.4426950408889634
    return slope


# -- forward ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn,
               kpm_base, stride_kpmn, offs_m, offs_d, start, end, Lq, Lk, D, off, left, right, qk_scale,
               dkey, thresh, drop_row0, drop_col0, drop_scale, softcap2, slope,
               MASK: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               PREC: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, Lk, D, MASK, EVEN_D)
        s, tcap = _scores(q, k, offs_m, offs_n, qk_scale, bias_base, stride_biasm, stride_biasn, kpm_base,
                          stride_kpmn, Lq, Lk, off, left, right, softcap2, slope, MASK, HAS_BIAS, HAS_KPM,
                          HAS_SOFTCAP, HAS_ALIBI, PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key so far has m = -inf: subtract 0 instead so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            keep = _keep_tile(dkey, offs_m + drop_row0, offs_n + drop_col0, thresh)
            p = tl.where(keep, p * drop_scale, 0.0)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, Lk, D, MASK, EVEN_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD_CONFIGS,
                 key=["LQ_KEY", "LK_KEY", "D", "HAS_BIAS", "HAS_KPM", "HAS_DROPOUT", "HAS_SOFTCAP", "HAS_ALIBI", "SPLIT"],
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit(do_not_specialize=["seed", "thresh", "drop_row0", "drop_col0", "LQ_KEY", "LK_KEY"])
def _attn_fwd_kernel(
    Q, K, V, O, LSE, BIAS, KPM, ALIBI,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_os, stride_om, stride_lb, stride_ls,
    stride_biasb, stride_biash, stride_biasm, stride_biasn, stride_kpmb, stride_kpmn, stride_ab, stride_ah,
    H, G, Lq, Lk, D, left, right, qk_scale, seed, thresh, drop_row0, drop_col0,
    drop_scale, softcap2, split_len, LQ_KEY, LK_KEY,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M), B*H, n_splits). O is (B*H, n_splits, Lq, D) when SPLIT (fp32 partials,
    normalised per split, with per-split LSE) else (B, H, Lq, D) through its strides."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    sp = tl.program_id(2)
    b = bh // H
    h = bh % H
    hk = h // G
    off = Lk - Lq
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)

    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    bias_base = BIAS + b64 * stride_biasb + h.to(tl.int64) * stride_biash
    kpm_base = KPM + b64 * stride_kpmb
    dkey = 0
    if HAS_DROPOUT:
        dkey = _dropout_key(seed, b, h, H)
    slope = _alibi_slope(ALIBI, b64, h, stride_ab, stride_ah, HAS_ALIBI)

    q = _load_rows(q_base, offs_m, stride_qm, offs_d, Lq, D, True, EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    rows_end = tl.minimum(m0 + BLOCK_M, Lq)
    n_lo, full_lo, full_hi, hi = _band(m0, rows_end, Lk, off, left, right, sp * split_len,
                                       sp * split_len + split_len, BLOCK_N)
    # Band edges masked, interior unmasked, far edge masked.
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn, kpm_base,
        stride_kpmn, offs_m, offs_d, n_lo, tl.minimum(full_lo, hi), Lq, Lk, D, off, left, right, qk_scale, dkey,
        thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, True, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM, HAS_DROPOUT, HAS_SOFTCAP,
        HAS_ALIBI, PREC)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn, kpm_base,
        stride_kpmn, offs_m, offs_d, full_lo, full_hi, Lq, Lk, D, off, left, right, qk_scale, dkey,
        thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, False, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM, HAS_DROPOUT, HAS_SOFTCAP,
        HAS_ALIBI, PREC)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn, kpm_base,
        stride_kpmn, offs_m, offs_d, tl.maximum(full_lo, full_hi), hi, Lq, Lk, D, off, left, right, qk_scale,
        dkey, thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, True, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM, HAS_DROPOUT,
        HAS_SOFTCAP, HAS_ALIBI, PREC)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if SPLIT:
        o_base = O + bh.to(tl.int64) * stride_ob + sp.to(tl.int64) * stride_os
        l_base = LSE + bh.to(tl.int64) * stride_lb + sp * stride_ls
    else:
        o_base = O + b64 * stride_ob + h.to(tl.int64) * stride_oh
        l_base = LSE + bh.to(tl.int64) * stride_lb
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    if EVEN_D:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_m < Lq)[:, None])
    else:
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_m < Lq)[:, None] & (offs_d < D)[None, :])
    tl.store(l_base + offs_m, lse, mask=offs_m < Lq)


# -- backward ---------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                           H, Lq, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr):
    """delta[b, h, i] = sum_d dO * O  (fp32), DELTA contiguous (B, H, Lq)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + b * stride_ob + h * stride_oh, offs_m, stride_om, offs_d, Lq, D, True, EVEN_D)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dom, offs_d, Lq, D, True, EVEN_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _load_row_stats(lse_base, delta_base, offs_m, Lq, CHECK_L: tl.constexpr):
    """lse in the log2 domain (+inf for rows that saw no key, so their P is 0) and delta, for rows offs_m."""
    if CHECK_L:
        lse = tl.load(lse_base + offs_m, mask=offs_m < Lq, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=offs_m < Lq, other=0.0)
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse2, delta


@triton.jit
def _bwd_kv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
                  bias_base, stride_biasm, stride_biasn, kpm_base, stride_kpmn, offs_n, offs_d, start, end,
                  Lq, Lk, D, off, left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
                  drop_scale, softcap2, slope,
                  MASK: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, PREC: tl.constexpr):
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, offs_m, stride_qm, offs_d, Lq, D, MASK, EVEN_D)
        do = _load_rows(do_base, offs_m, stride_dom, offs_d, Lq, D, MASK, EVEN_D)
        lse2, delta = _load_row_stats(lse_base, delta_base, offs_m, Lq, MASK)
        s, tcap = _scores(q, k, offs_m, offs_n, qk_scale, bias_base, stride_biasm, stride_biasn, kpm_base,
                          stride_kpmn, Lq, Lk, off, left, right, softcap2, slope, MASK, HAS_BIAS, HAS_KPM,
                          HAS_SOFTCAP, HAS_ALIBI, PREC)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if HAS_DROPOUT:
            keep = _keep_tile(dkey, offs_m + drop_row0, offs_n + drop_col0, thresh)
            pz = tl.where(keep, p * drop_scale, 0.0)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        else:
            pz = p
        dv = tl.dot(tl.trans(pz.to(do.dtype)), do, dv, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tcap * tcap)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
    return dk, dv


@triton.autotune(configs=_BWD_KV_CONFIGS,
                 key=["LQ_KEY", "LK_KEY", "D", "HAS_BIAS", "HAS_KPM", "HAS_DROPOUT", "HAS_SOFTCAP", "HAS_ALIBI"],
                 prune_configs_by={"early_config_prune": _prune_bwd})
@triton.jit(do_not_specialize=["seed", "thresh", "drop_row0", "drop_col0", "LQ_KEY", "LK_KEY"])
def _attn_bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, BIAS, KPM, ALIBI,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_biasb, stride_biash, stride_biasm, stride_biasn, stride_kpmb, stride_kpmn, stride_ab, stride_ah,
    H, Hk, G, Lq, Lk, D, left, right, qk_scale, sm_scale, seed, thresh, drop_row0, drop_col0,
    drop_scale, softcap2, LQ_KEY, LK_KEY,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(Lk, BLOCK_N), B*Hk): dK, dV for one key block of one kv head, summed over its G query
    heads in registers (no GQA scratch buffer), looping only over the query blocks that meet the band."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    b64 = b.to(tl.int64)
    off = Lk - Lq
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_rows(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh, offs_n, stride_kn, offs_d, Lk, D, True,
                   EVEN_D)
    v = _load_rows(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh, offs_n, stride_vn, offs_d, Lk, D, True,
                   EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    kpm_base = KPM + b64 * stride_kpmb

    # Query rows i that see some key of [n0, n_last]: qpos = i + off in [n0 - right, n_last + left].
    n_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    i_lo = tl.maximum(n0 - right - off, 0)
    i_hi = tl.minimum(n_last + left - off + 1, Lq)
    m_lo = (i_lo // BLOCK_M) * BLOCK_M
    # Rows that see every key of the block (and the block lies inside Lk): no per-element masking.
    f_a = tl.maximum(i_lo, n0 + BLOCK_N - 1 - right - off)
    f_b = tl.maximum(tl.minimum(i_hi, n0 + left - off + 1), 0)
    f_b = tl.where(n0 + BLOCK_N > Lk, 0, f_b)
    full_lo = ((f_a + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_hi = (f_b // BLOCK_M) * BLOCK_M

    for g in range(0, G):
        h = hk * G + g
        bh = b * H + h
        q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b64 * stride_dob + h.to(tl.int64) * stride_doh
        lse_base = LSE + bh.to(tl.int64) * Lq
        delta_base = DELTA + bh.to(tl.int64) * Lq
        bias_base = BIAS + b64 * stride_biasb + h.to(tl.int64) * stride_biash
        dkey = 0
        if HAS_DROPOUT:
            dkey = _dropout_key(seed, b, h, H)
        slope = _alibi_slope(ALIBI, b64, h, stride_ab, stride_ah, HAS_ALIBI)
        dk, dv = _bwd_kv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, bias_base, stride_biasm,
            stride_biasn, kpm_base, stride_kpmn, offs_n, offs_d, m_lo, tl.minimum(full_lo, i_hi), Lq, Lk, D, off,
            left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
            drop_scale, softcap2, slope, True, BLOCK_M, EVEN_D, HAS_BIAS, HAS_KPM,
            HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, PREC)
        dk, dv = _bwd_kv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, bias_base, stride_biasm,
            stride_biasn, kpm_base, stride_kpmn, offs_n, offs_d, full_lo, full_hi, Lq, Lk, D, off,
            left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
            drop_scale, softcap2, slope, False, BLOCK_M, EVEN_D, HAS_BIAS, HAS_KPM,
            HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, PREC)
        dk, dv = _bwd_kv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom, bias_base, stride_biasm,
            stride_biasn, kpm_base, stride_kpmn, offs_n, offs_d, tl.maximum(full_lo, full_hi), i_hi, Lq, Lk, D,
            off, left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
            drop_scale, softcap2, slope, True, BLOCK_M, EVEN_D, HAS_BIAS,
            HAS_KPM, HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, PREC)

    dk *= sm_scale
    dmask = (offs_n < Lk)[:, None] & (offs_d < D)[None, :]
    hk64 = hk.to(tl.int64)
    dk_ptrs = DK + b64 * stride_dkb + hk64 * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b64 * stride_dvb + hk64 * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :]
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=dmask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=dmask)


@triton.jit
def _bwd_q_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm,
                 stride_biasn, kpm_base, stride_kpmn, dbias_base, stride_dbm, offs_m, offs_d, start, end,
                 Lq, Lk, D, off, left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
                 drop_scale, softcap2, slope,
                 MASK: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_KPM: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, NEED_DBIAS: tl.constexpr,
                 PREC: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, offs_n, stride_kn, offs_d, Lk, D, MASK, EVEN_D)
        v = _load_rows(v_base, offs_n, stride_vn, offs_d, Lk, D, MASK, EVEN_D)
        s, tcap = _scores(q, k, offs_m, offs_n, qk_scale, bias_base, stride_biasm, stride_biasn, kpm_base,
                          stride_kpmn, Lq, Lk, off, left, right, softcap2, slope, MASK, HAS_BIAS, HAS_KPM,
                          HAS_SOFTCAP, HAS_ALIBI, PREC)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if HAS_DROPOUT:
            keep = _keep_tile(dkey, offs_m + drop_row0, offs_n + drop_col0, thresh)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if NEED_DBIAS:
            db_ptrs = dbias_base + offs_m.to(tl.int64)[:, None] * stride_dbm + offs_n[None, :]
            if MASK:
                tl.store(db_ptrs, ds, mask=(offs_m < Lq)[:, None] & (offs_n < Lk)[None, :])
            else:
                tl.store(db_ptrs, ds, mask=(offs_m < Lq)[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tcap * tcap)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.autotune(configs=_BWD_Q_CONFIGS,
                 key=["LQ_KEY", "LK_KEY", "D", "HAS_BIAS", "HAS_KPM", "HAS_DROPOUT", "HAS_SOFTCAP", "HAS_ALIBI",
                      "NEED_DBIAS"],
                 prune_configs_by={"early_config_prune": _prune_bwd})
@triton.jit(do_not_specialize=["seed", "thresh", "drop_row0", "drop_col0", "LQ_KEY", "LK_KEY"])
def _attn_bwd_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, BIAS, KPM, DBIAS, ALIBI,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm,
    stride_biasb, stride_biash, stride_biasm, stride_biasn, stride_kpmb, stride_kpmn, stride_ab, stride_ah,
    H, G, Lq, Lk, D, left, right, qk_scale, sm_scale, seed, thresh, drop_row0, drop_col0,
    drop_scale, softcap2, LQ_KEY, LK_KEY,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, NEED_DBIAS: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M), B*H): dQ for one query block (and dS into DBIAS, contiguous (B,H,Lq,Lk)
    fp32 pre-zeroed, when NEED_DBIAS), looping only over the key blocks of the band."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    b64 = b.to(tl.int64)
    off = Lk - Lq
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_rows(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh, offs_m, stride_qm, offs_d, Lq, D, True,
                   EVEN_D)
    do = _load_rows(DO + b64 * stride_dob + h.to(tl.int64) * stride_doh, offs_m, stride_dom, offs_d, Lq, D,
                    True, EVEN_D)
    lse2, delta = _load_row_stats(LSE + bh.to(tl.int64) * Lq, DELTA + bh.to(tl.int64) * Lq, offs_m, Lq, True)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    bias_base = BIAS + b64 * stride_biasb + h.to(tl.int64) * stride_biash
    kpm_base = KPM + b64 * stride_kpmb
    dbias_base = DBIAS + bh.to(tl.int64) * Lq * Lk
    dkey = 0
    if HAS_DROPOUT:
        dkey = _dropout_key(seed, b, h, H)
    slope = _alibi_slope(ALIBI, b64, h, stride_ab, stride_ah, HAS_ALIBI)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    rows_end = tl.minimum(m0 + BLOCK_M, Lq)
    n_lo, full_lo, full_hi, hi = _band(m0, rows_end, Lk, off, left, right, 0, Lk, BLOCK_N)
    dq = _bwd_q_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn,
        kpm_base, stride_kpmn, dbias_base, Lk, offs_m, offs_d, n_lo, tl.minimum(full_lo, hi), Lq, Lk, D, off,
        left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, True, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM,
        HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, NEED_DBIAS, PREC)
    dq = _bwd_q_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn,
        kpm_base, stride_kpmn, dbias_base, Lk, offs_m, offs_d, full_lo, full_hi, Lq, Lk, D, off,
        left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, False, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM,
        HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, NEED_DBIAS, PREC)
    dq = _bwd_q_inner(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_vn, bias_base, stride_biasm, stride_biasn,
        kpm_base, stride_kpmn, dbias_base, Lk, offs_m, offs_d, tl.maximum(full_lo, full_hi), hi, Lq, Lk, D, off,
        left, right, qk_scale, dkey, thresh, drop_row0, drop_col0,
        drop_scale, softcap2, slope, True, BLOCK_N, EVEN_D, HAS_BIAS, HAS_KPM,
        HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, NEED_DBIAS, PREC)
    dq *= sm_scale
    h64 = h.to(tl.int64)
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(offs_m < Lq)[:, None] & (offs_d < D)[None, :])


# -- launchers --------------------------------------------------------------------------------------------
def _err(msg: str) -> ValueError:
    return ValueError(f"fastarch.kernels.attention: {msg}")


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_left: int, window_right: int,
              key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None,
              dropout_p: float, softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise _err(f"argument '{name}' must be a 4-d tensor (B, heads, L, D), got {got}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise _err(f"argument 'q' must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _err(f"argument '{name}' must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise _err(f"argument '{name}' must be on q's device {q.device}, got {t.device}")
    B, H, Lq, D = q.shape
    if k.shape != v.shape:
        raise _err(f"arguments 'k' and 'v' must have the same shape, got {tuple(k.shape)} and "
                   f"{tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise _err(f"argument 'k' must be (B={B}, Hk, Lk, D={D}), got {tuple(k.shape)}")
    Hk = k.shape[1]
    if Hk == 0 or H % Hk != 0:
        raise _err(f"q's heads ({H}) must be a multiple of k's heads ({Hk})")
    if D > MAX_HEAD_DIM or D < 1:
        raise _err(f"head dim D must be in [1, {MAX_HEAD_DIM}], got {D}")
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        if int(w) < -1:
            raise _err(f"argument '{name}' must be >= -1 (-1 = unlimited), got {w}")
    Lk = k.shape[2]
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, Lk):
            raise _err(f"argument 'key_padding_mask' must be a bool tensor of shape ({B}, {Lk}), got "
                       f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise _err(f"argument 'key_padding_mask' must be on {q.device}, got {key_padding_mask.device}")
    if attn_bias is not None:
        if tuple(attn_bias.shape) != (B, H, Lq, Lk):
            raise _err(f"argument 'attn_bias' must be expanded to ({B}, {H}, {Lq}, {Lk}), "
                       f"got {tuple(attn_bias.shape)}")
        if attn_bias.device != q.device or not attn_bias.is_floating_point():
            raise _err(f"argument 'attn_bias' must be a floating tensor on {q.device}, got {attn_bias.dtype} "
                       f"on {attn_bias.device}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise _err(f"argument 'dropout_p' must be in [0, 1), got {dropout_p}")
    if not (math.isfinite(float(softcap)) and float(softcap) >= 0.0):
        raise _err(f"argument 'softcap' must be a finite float >= 0 (0 = off), got {softcap}")
    if alibi_slopes is not None:
        if (alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) != (B, H)
                or alibi_slopes.device != q.device):
            raise _err(f"argument 'alibi_slopes' must be a float32 tensor of shape ({B}, {H}) on {q.device}, "
                       f"got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the last dim with stride 1; anything else is copied once."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _limit(w: int, total: int) -> int:
    # -1 (unlimited) becomes a reach longer than any row/column distance, so one formula covers all windows.
    return total if int(w) < 0 else min(int(w), total)


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not (torch.backends.cuda.matmul.allow_tf32 and not _INTERPRET):
        return "ieee"
    return "tf32"


def _dropout_args(dropout_p: float, seed: int) -> tuple[bool, int, int, float]:
    """(HAS_DROPOUT, seed as uint32 bits, integer threshold, 1/(1-p)). keep <=> (r >> 8) * 2**-24 >= p
    <=> (r >> 8) >= ceil(p * 2**24): exact, since p * 2**24 is exact in float64."""
    if dropout_p <= 0.0:
        return False, 0, 0, 1.0
    return True, int(seed) & 0xFFFFFFFF, math.ceil(float(dropout_p) * 2 ** 24), 1.0 / (1.0 - float(dropout_p))


def _side_args(q: torch.Tensor, key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None):
    """(bias tensor, 4 bias strides, kpm tensor, 2 kpm strides); unused ones point at q with zero strides."""
    if attn_bias is None:
        bias, bstr = q, (0, 0, 0, 0)
    else:
        bias, bstr = attn_bias, tuple(attn_bias.stride())
    if key_padding_mask is None:
        kpm, kstr = q, (0, 0)
    else:
        kpm = key_padding_mask.view(torch.uint8)
        kstr = tuple(kpm.stride())
    return bias, bstr, kpm, kstr


def _score_args(q: torch.Tensor, softcap: float, alibi_slopes: torch.Tensor | None):
    """(softcap in the log2 domain, ALiBi tensor, its 2 strides, HAS_SOFTCAP, HAS_ALIBI); without ALiBi the
    pointer is q's with zero strides (never read)."""
    cap = float(softcap)
    if alibi_slopes is None:
        alibi, astr = q, (0, 0)
    else:
        alibi, astr = alibi_slopes, tuple(alibi_slopes.stride())
    return cap * _LOG2E if cap > 0 else 1.0, alibi, astr, cap > 0, alibi_slopes is not None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _auto_splits(q: torch.Tensor, B: int, H: int, Lq: int, Lk: int) -> int:
    """Split-K (flash-decoding) factor: for few query rows and long keys, when B*H programs would leave
    most SMs idle, split the keys into chunks whose partial results are merged through their lse."""
    if Lq > _DECODE_MAX_LQ or Lk < 2 * _SPLIT_ALIGN or q.device.type != "cuda":
        return 1
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    programs = B * H
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(Lk, _SPLIT_ALIGN), triton.cdiv(2 * sms, programs), 64))


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window_left: int, window_right: int,
                  key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None, dropout_p: float,
                  seed: int, scale: float, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                  drop_row0: int = 0, drop_col0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. q (B,H,Lq,D), k/v (B,Hk,Lk,D) -> o (B,H,Lq,D) in q's dtype, lse (B,H,Lq) fp32.

    Windows are bottom-right aligned and already include causal (window_right=0); -1 = unlimited.
    key_padding_mask: (B,Lk) bool or None (True = real key); attn_bias: None or (B,H,Lq,Lk) (expanded views
    with zero strides are read in place). softcap > 0 caps the scaled scores as softcap * tanh(s / softcap)
    before the bias; alibi_slopes: None or fp32 (B,H) (any strides) adds -slope * |i + Lk - Lq - j|. Rows
    that see no key get o = 0 and lse = -inf. The dropout mask hashes rows ``drop_row0 + i`` and columns
    ``drop_col0 + j``: a sequence of a packed batch, run as ``B = 1``, passes its offsets in the packed batch.
    """
    return _attention_fwd(q, k, v, window_left=window_left, window_right=window_right,
                          key_padding_mask=key_padding_mask, attn_bias=attn_bias, dropout_p=dropout_p,
                          seed=seed, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes, num_splits=None,
                          drop_row0=drop_row0, drop_col0=drop_col0)


def _attention_fwd(q, k, v, *, window_left, window_right, key_padding_mask, attn_bias, dropout_p, seed, scale,
                   num_splits: int | None, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                   drop_row0: int = 0, drop_col0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_fwd with an explicit split-K factor (None = heuristic) so tests can force the decode path."""
    _validate(q, k, v, window_left, window_right, key_padding_mask, attn_bias, dropout_p, softcap, alibi_slopes)
    q, k, v = _rows(q), _rows(k), _rows(v)
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if B * H * Lq == 0 or Lk == 0:
        return (torch.zeros((B, H, Lq, D), dtype=q.dtype, device=q.device),
                torch.full((B, H, Lq), float("-inf"), dtype=torch.float32, device=q.device))
    # Every row of o and lse is stored by some program (also rows that see no key), so no memset.
    o = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    left, right = _limit(window_left, Lq + Lk), _limit(window_right, Lq + Lk)
    block_d = max(16, triton.next_power_of_2(D))
    has_drop, seed_u, thresh, drop_scale = _dropout_args(dropout_p, seed)
    bias, bstr, kpm, kstr = _side_args(q, key_padding_mask, attn_bias)
    softcap2, alibi, astr, has_cap, has_alibi = _score_args(q, softcap, alibi_slopes)
    splits = _auto_splits(q, B, H, Lq, Lk) if num_splits is None else max(1, int(num_splits))
    split_len = triton.cdiv(triton.cdiv(Lk, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN
    splits = triton.cdiv(Lk, split_len)
    if splits > 1:
        o_buf = torch.empty((B * H, splits, Lq, D), dtype=torch.float32, device=q.device)
        l_buf = torch.empty((B * H, splits, Lq), dtype=torch.float32, device=q.device)
        ostr = (o_buf.stride(0), 0, o_buf.stride(1), o_buf.stride(2))
        lstr = (l_buf.stride(0), l_buf.stride(1))
    else:
        o_buf, l_buf, split_len = o, lse, Lk
        ostr = (o.stride(0), o.stride(1), 0, o.stride(2))
        lstr = (Lq, 0)

    def grid(meta):
        return (triton.cdiv(Lq, meta["BLOCK_M"]), B * H, splits)

    _attn_fwd_kernel[grid](
        q, k, v, o_buf, l_buf, bias, kpm, alibi,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *ostr, *lstr, *bstr, *kstr, *astr,
        H, H // Hk, Lq, Lk, D, left, right, float(scale) * _LOG2E, seed_u, thresh, int(drop_row0), int(drop_col0),
        drop_scale, softcap2, split_len, _length_key(Lq), _length_key(Lk), BLOCK_D=block_d, EVEN_D=block_d == D,
        HAS_BIAS=attn_bias is not None,
        HAS_KPM=key_padding_mask is not None, HAS_DROPOUT=has_drop, HAS_SOFTCAP=has_cap, HAS_ALIBI=has_alibi,
        SPLIT=splits > 1, PREC=_prec(q.dtype),
    )
    if splits > 1:
        # Merge the per-chunk softmaxes: o = sum_s exp(lse_s - lse) o_s with lse = logsumexp_s lse_s.
        lse_all = torch.logsumexp(l_buf, dim=1)
        w = torch.where(l_buf == float("-inf"), 0.0, torch.exp(l_buf - lse_all[:, None]))
        o.copy_((w[..., None] * o_buf).sum(1).view(B, H, Lq, D))
        lse.copy_(lse_all.view(B, H, Lq))
    return o, lse


def attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, *, window_left: int, window_right: int,
                  key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None, dropout_p: float,
                  seed: int, scale: float, need_dbias: bool, softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, drop_row0: int = 0, drop_col0: int = 0,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward (FlashAttention-2). do/o (B,H,Lq,D), lse (B,H,Lq) from attention_fwd with the same arguments.

    Returns dq (B,H,Lq,D), dk/dv (B,Hk,Lk,D) (GQA: summed over each kv head's group), and dbias
    (B,H,Lq,Lk) fp32 = dS (dropout included; the gradient of the scores after soft-capping) when need_dbias,
    else None. The ALiBi slopes get no gradient; drop_row0/drop_col0 offset the dropout mask as in the forward.
    """
    _validate(q, k, v, window_left, window_right, key_padding_mask, attn_bias, dropout_p, softcap, alibi_slopes)
    if tuple(do.shape) != tuple(q.shape) or tuple(o.shape) != tuple(q.shape):
        raise _err(f"arguments 'do' and 'o' must have q's shape {tuple(q.shape)}, got {tuple(do.shape)} and "
                   f"{tuple(o.shape)}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise _err(f"argument 'lse' must have shape {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    q, k, v, do, o = _rows(q), _rows(k), _rows(v), _rows(do), _rows(o)
    lse = lse.to(torch.float32).contiguous()
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    # dbias entries outside the band are never visited: their gradient, 0, comes from the memset.
    dbias = torch.zeros((B, H, Lq, Lk), dtype=torch.float32, device=q.device) if need_dbias else None
    if B * H * Lq == 0 or Lk == 0:
        return (torch.zeros_like(q, memory_format=torch.contiguous_format),
                torch.zeros_like(k, memory_format=torch.contiguous_format),
                torch.zeros_like(v, memory_format=torch.contiguous_format), dbias)
    # dq (per query block), dk and dv (per key block, all rows of every kv head) are stored in full.
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    left, right = _limit(window_left, Lq + Lk), _limit(window_right, Lq + Lk)
    block_d = max(16, triton.next_power_of_2(D))
    even_d = block_d == D
    has_drop, seed_u, thresh, drop_scale = _dropout_args(dropout_p, seed)
    bias, bstr, kpm, kstr = _side_args(q, key_padding_mask, attn_bias)
    softcap2, alibi, astr, has_cap, has_alibi = _score_args(q, softcap, alibi_slopes)
    prec = _prec(q.dtype)
    G = H // Hk

    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    pre_m = 64 if block_d <= 128 else 32
    _bwd_preprocess_kernel[(triton.cdiv(Lq, pre_m), B * H)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        H, Lq, D, BLOCK_M=pre_m, BLOCK_D=block_d, EVEN_D=even_d)

    common = (left, right, float(scale) * _LOG2E, float(scale), seed_u, thresh, int(drop_row0), int(drop_col0),
              drop_scale, softcap2, _length_key(Lq), _length_key(Lk))
    flags = dict(BLOCK_D=block_d, EVEN_D=even_d, HAS_BIAS=attn_bias is not None,
                 HAS_KPM=key_padding_mask is not None, HAS_DROPOUT=has_drop, HAS_SOFTCAP=has_cap,
                 HAS_ALIBI=has_alibi, PREC=prec)
    _attn_bwd_kv_kernel[lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]), B * Hk)](
        q, k, v, do, lse, delta, dk, dv, bias, kpm, alibi,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), *bstr, *kstr, *astr,
        H, Hk, G, Lq, Lk, D, *common, **flags)
    _attn_bwd_q_kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, bias, kpm, dbias if dbias is not None else q, alibi,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), *bstr, *kstr, *astr,
        H, G, Lq, Lk, D, *common, NEED_DBIAS=dbias is not None, **flags)
    return dq, dk, dv, dbias
