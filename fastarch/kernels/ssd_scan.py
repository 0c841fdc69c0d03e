"""Triton kernels for Mamba-2's SSD scan (forward and backward) and their launchers.

The core scan of :mod:`fastarch.ops.ssd_scan`, by chunks of ``Q`` steps. With ``cum`` the within-chunk
cumulative sum of ``dt * A`` (``_ssd_cumsum_kernel``), ``S_c`` the state entering chunk ``c`` and ``same``
the causal mask of steps in one sequence::

    y_t     = sum_{s <= t, same} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s  +  a_t S_c C_t
    S_{c+1} = D_c S_c + sum_s w_s x_s B_s^T

where ``a_t = exp(cum_t)`` when step ``t`` continues the entering state (else 0), ``w_s = exp(cum_end -
cum_s) dt_s`` when step ``s`` belongs to the sequence at the chunk's end (else 0) and ``D_c = exp(cum_end)``
when the entering state survives to the chunk's end (else 0). ``cum_end`` is ``cum`` at the chunk's last real
step (``L`` need not be a multiple of ``Q``).

Forward: cumsum, each chunk's own state term (``_ssd_outer_kernel``), the sequential pass over chunks
(``_ssd_pass_kernel``, in place: the own terms become the entering states), then the outputs
(``_ssd_output_kernel``). Backward: the same outer-product kernel gives each chunk's ``sum_t a_t dy_t C_t^T``,
the pass kernel run in reverse turns it into the gradient of each chunk's end state, then one program per
block of columns ``s`` (``_ssd_bwd_col_kernel``: dx, the direct part of ddt, dB per head) and one per block of
rows ``t`` (``_ssd_bwd_row_kernel``: dC per head and the gradient of ``cum``), and ``_ssd_dcum_kernel`` turns
the gradient of ``cum`` into those of ``dt`` and ``A``. Every reduction is owned by one program or summed in
PyTorch afterwards (per-head dB/dC over a group, per-chunk dA), so the backward is deterministic.

The gradient of ``cum`` needs no second pass over the ``(t, s)`` pairs: per head,
``dcum_t = C_t . dC_t - dt_t ddt_t`` (the direct ``ddt``, before the ``A`` term), plus at the chunk's last step
``D_c <S_c, dS_{c+1}> + sum_s dt_s ddt^state_s`` (``ddt^state`` the part of ``ddt`` from the end state).

Layouts: ``x``, ``dy`` ``(batch, L, H, P)``; ``dt``, ``cum`` ``(batch, L, H)``; ``B``, ``C`` ``(batch, L, G, N)``;
states ``(batch, n_chunks, H, P, N)``; all contiguous. ``x``, ``B``, ``C`` may be fp16/bf16/fp32 (upcast in
registers); the rest is fp32. Products run in tf32 (in fp32 for fp32 inputs unless PyTorch allows tf32 matmuls,
as the attention kernels do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import _INTERPRET, _prec


# -- shared pieces -----------------------------------------------------------------------------------------
@triton.jit
def _seq_ids(seq_ptr, b, pos, valid, L, HAS_SEQ: tl.constexpr):
    """Sequence number of each position (0 without seq_idx)."""
    sid = tl.zeros_like(pos)
    if HAS_SEQ:
        sid = tl.load(seq_ptr + b * L + pos, mask=valid, other=-1)
    return sid


@triton.jit
def _chunk_bounds(seq_ptr, cum_ptr, b, c, h, H, Q, L, HAS_SEQ: tl.constexpr):
    """Chunk ``c``'s first position, last real position, the sequence number before it (0 for chunk 0), the
    one at its end, and ``cum`` at its end."""
    start = c * Q
    end = tl.minimum(start + Q, L) - 1
    before = 0
    last = 0
    if HAS_SEQ:
        before = tl.load(seq_ptr + b * L + tl.maximum(start - 1, 0))
        before = tl.where(c > 0, before, 0)
        last = tl.load(seq_ptr + b * L + end)
    cum_end = tl.load(cum_ptr + (b * L + end).to(tl.int64) * H + h)
    return start, end, before, last, cum_end


@triton.jit
def _steps(seq_ptr, cum_ptr, dt_ptr, b, h, start, first, L, H, Q, HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr):
    """A block of ``BLOCK_T`` steps of a chunk from local step ``first``: local index, validity, row (for
    (batch, L, ...) arrays, int64), cum, dt (0 outside) and sequence number."""
    loc = first + tl.arange(0, BLOCK_T)
    pos = start + loc
    valid = (loc < Q) & (pos < L)
    row = (b * L + pos).to(tl.int64)
    cum = tl.load(cum_ptr + row * H + h, mask=valid, other=0.0)
    dt = tl.load(dt_ptr + row * H + h, mask=valid, other=0.0)
    sid = _seq_ids(seq_ptr, b, pos, valid, L, HAS_SEQ)
    return loc, valid, row, cum, dt, sid


@triton.jit
def _load_rows(ptr, row, heads, head, valid, offs, width):
    """``(BLOCK_T, BLOCK)`` fp32 tile of a ``(batch, L, heads, width)`` array at ``head``."""
    idx = (row * heads + head)[:, None] * width + offs[None, :]
    return tl.load(ptr + idx, mask=valid[:, None] & (offs < width)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _decay(loc_t, valid_t, cum_t, sid_t, loc_s, valid_s, cum_s, sid_s):
    """``exp(cum_t - cum_s)`` on the causal same-sequence pairs (t rows, s columns), 0 elsewhere."""
    keep = (valid_t[:, None] & valid_s[None, :] & (loc_t[:, None] >= loc_s[None, :])
            & (sid_t[:, None] == sid_s[None, :]))
    return tl.where(keep, tl.exp(tl.where(keep, cum_t[:, None] - cum_s[None, :], 0.0)), 0.0)


@triton.jit
def _program(seq_ptr, cum_ptr, nc, R, H, Q, L, HAS_SEQ: tl.constexpr):
    """Of a (batch * chunk, head, ...) program: its first index, batch, chunk, head, group and its chunk's
    bounds (:func:`_chunk_bounds`)."""
    pid = tl.program_id(0)
    b = pid // nc
    c = pid % nc
    h = tl.program_id(1)
    start, end, before, last, cum_end = _chunk_bounds(seq_ptr, cum_ptr, b, c, h, H, Q, L, HAS_SEQ)
    return pid, b, h, h // R, start, before, last, cum_end


@triton.jit
def _step_tiles(seq_ptr, cum_ptr, dt_ptr, U_ptr, V_ptr, b, h, g, start, first, L, H, G, Q, P, N, offs_p, offs_n,
                HAS_SEQ: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`_steps` and the rows of ``U`` ``(batch, L, H, P)`` and ``V`` ``(batch, L, G, N)`` there."""
    loc, valid, row, cum, dt, sid = _steps(seq_ptr, cum_ptr, dt_ptr, b, h, start, first, L, H, Q, HAS_SEQ, BLOCK_T)
    u = _load_rows(U_ptr, row, H, h, valid, offs_p, P)
    v = _load_rows(V_ptr, row, G, g, valid, offs_n, N)
    return loc, valid, row, cum, dt, sid, u, v


@triton.jit
def _state_tile(ptr, slot, offs_p, offs_n, P, N):
    """``(BLOCK_P, BLOCK_N)`` tile of the ``(P, N)`` state at ``slot`` (batch * chunk, head or batch, head)."""
    idx = slot.to(tl.int64) * P * N + offs_p[:, None] * N + offs_n[None, :]
    return tl.load(ptr + idx, mask=(offs_p < P)[:, None] & (offs_n < N)[None, :], other=0.0)


@triton.jit
def _carry(valid, sid, before, cum):
    """``exp(cum_t)`` on the steps that continue the state entering the chunk, 0 elsewhere."""
    keep = valid & (sid == before)
    return tl.where(keep, tl.exp(tl.where(keep, cum, 0.0)), 0.0)


# -- kernels -----------------------------------------------------------------------------------------------
@triton.jit
def _ssd_cumsum_kernel(dt_ptr, A_ptr, cum_ptr, L, H, Q, nc, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program (batch * chunk, block of heads): the whole chunk's cumulative dt * A.
    pid = tl.program_id(0)
    b = pid // nc
    c = pid % nc
    loc = tl.arange(0, BLOCK_Q)
    pos = c * Q + loc
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = ((loc < Q) & (pos < L))[:, None] & (hs < H)[None, :]
    idx = (b * L + pos).to(tl.int64)[:, None] * H + hs[None, :]
    dt = tl.load(dt_ptr + idx, mask=m, other=0.0)
    A = tl.load(A_ptr + hs, mask=hs < H, other=0.0)
    tl.store(cum_ptr + idx, tl.cumsum(dt * A[None, :], axis=0), mask=m)


@triton.jit
def _ssd_dcum_kernel(dt_ptr, A_ptr, dcum_ptr, v_ptr, endg_ptr, ddt_ptr, dA_ptr, L, H, Q, nc,
                     BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program (batch * chunk, block of heads): the gradient of cum (plus its chunk-end term) summed from the
    # end gives that of dt * A at each step.
    pid = tl.program_id(0)
    b = pid // nc
    c = pid % nc
    loc = tl.arange(0, BLOCK_Q)
    pos = c * Q + loc
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = hs < H
    m = ((loc < Q) & (pos < L))[:, None] & mh[None, :]
    idx = (b * L + pos).to(tl.int64)[:, None] * H + hs[None, :]
    dcum = tl.load(dcum_ptr + idx, mask=m, other=0.0)
    v = tl.load(v_ptr + idx, mask=m, other=0.0)
    endg = tl.load(endg_ptr + pid * H + hs, mask=mh, other=0.0)
    end_loc = tl.minimum(Q, L - c * Q) - 1
    dcum += tl.where(loc[:, None] == end_loc, (tl.sum(v, axis=0) + endg)[None, :], 0.0)
    rc = tl.sum(dcum, axis=0)[None, :] - tl.cumsum(dcum, axis=0) + dcum  # sum over steps >= t
    A = tl.load(A_ptr + hs, mask=mh, other=0.0)
    dt = tl.load(dt_ptr + idx, mask=m, other=0.0)
    ddt = tl.load(ddt_ptr + idx, mask=m, other=0.0)
    tl.store(ddt_ptr + idx, ddt + A[None, :] * rc, mask=m)
    tl.store(dA_ptr + pid * H + hs, tl.sum(dt * rc, axis=0), mask=mh)


@triton.jit
def _ssd_outer_kernel(U_ptr, V_ptr, cum_ptr, dt_ptr, seq_ptr, out_ptr, L, H, G, R, P, N, Q, nc, n_pb,
                      ENTERING: tl.constexpr, HAS_SEQ: tl.constexpr, PREC: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (batch * chunk, head, P block x N block): sum_t w_t U_t V_t^T over the chunk, with U (batch, L,
    # H, P) and V (batch, L, G, N). ENTERING=False: the chunk's own state term (U=x, V=B, w_t = exp(cum_end -
    # cum_t) dt_t on steps of the sequence at the end). ENTERING=True: the gradient it sends to the entering
    # state (U=dy, V=C, w_t = exp(cum_t) on steps that continue it).
    pid, b, h, g, start, before, last, cum_end = _program(seq_ptr, cum_ptr, nc, R, H, Q, L, HAS_SEQ)
    offs_p = (tl.program_id(2) % n_pb) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (tl.program_id(2) // n_pb) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for first in range(0, Q, BLOCK_T):
        loc, valid, row, cum, dt, sid, u, v = _step_tiles(seq_ptr, cum_ptr, dt_ptr, U_ptr, V_ptr, b, h, g, start,
                                                          first, L, H, G, Q, P, N, offs_p, offs_n, HAS_SEQ, BLOCK_T)
        if ENTERING:
            w = _carry(valid, sid, before, cum)
        else:
            keep = valid & (sid == last)
            w = tl.where(keep, tl.exp(tl.where(keep, cum_end - cum, 0.0)), 0.0) * dt
        acc += tl.dot(tl.trans(u * w[:, None]), v, input_precision=PREC)
    idx = ((pid * H + h).to(tl.int64) * P + offs_p[:, None]) * N + offs_n[None, :]
    tl.store(out_ptr + idx, acc, mask=(offs_p < P)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _ssd_pass_kernel(buf_ptr, cum_ptr, seq_ptr, init_ptr, out_ptr, states_ptr, part_ptr, L, H, PN, Q, nc,
                     HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK: tl.constexpr):
    # Program (batch, head, block of the P*N state): the sequential pass over chunks, in place in buf.
    # Forward: buf holds each chunk's own state term and becomes the states entering the chunks; out gets the
    # final state. REVERSE: buf holds each chunk's gradient to its entering state and becomes the gradient of
    # its end state; out gets the gradient of the initial states; part gets this block's D_c <S_c, dS_{c+1}>.
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    s = tl.zeros([BLOCK], tl.float32)
    if HAS_INIT:
        s = tl.load(init_ptr + (b * H + h).to(tl.int64) * PN + offs, mask=m, other=0.0)
    for i in range(0, nc):
        if REVERSE:
            c = nc - 1 - i
        else:
            c = i
        start, end, before, last, cum_end = _chunk_bounds(seq_ptr, cum_ptr, b, c, h, H, Q, L, HAS_SEQ)
        decay = tl.where(last == before, tl.exp(tl.where(last == before, cum_end, 0.0)), 0.0)
        slot = ((b * nc + c) * H + h).to(tl.int64) * PN + offs
        local = tl.load(buf_ptr + slot, mask=m, other=0.0)
        tl.store(buf_ptr + slot, s, mask=m)
        if REVERSE:
            s_in = tl.load(states_ptr + slot, mask=m, other=0.0)
            tl.store(part_ptr + ((b * nc + c) * H + h) * tl.num_programs(2) + blk, decay * tl.sum(s_in * s))
        s = decay * s + local
    tl.store(out_ptr + (b * H + h).to(tl.int64) * PN + offs, s, mask=m)


@triton.jit
def _ssd_output_kernel(x_ptr, dt_ptr, cum_ptr, seq_ptr, B_ptr, C_ptr, states_ptr, y_ptr, L, H, G, R, P, N, Q, nc,
                       nt, HAS_SEQ: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (batch * chunk, head, block of steps t x P block): y_t over the chunk's earlier steps and its
    # entering state.
    pid, b, h, g, start, before, last, cum_end = _program(seq_ptr, cum_ptr, nc, R, H, Q, L, HAS_SEQ)
    mt = tl.program_id(2) % nt
    offs_p = (tl.program_id(2) // nt) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    loc_t, valid_t, row_t, cum_t, dt_t, sid_t = _steps(seq_ptr, cum_ptr, dt_ptr, b, h, start, mt * BLOCK_T, L, H,
                                                       Q, HAS_SEQ, BLOCK_T)
    Ct = _load_rows(C_ptr, row_t, G, g, valid_t, offs_n, N)
    acc = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    for k in range(0, mt + 1):
        loc_s, valid_s, row_s, cum_s, dt_s, sid_s, xs, Bs = _step_tiles(
            seq_ptr, cum_ptr, dt_ptr, x_ptr, B_ptr, b, h, g, start, k * BLOCK_T, L, H, G, Q, P, N, offs_p, offs_n,
            HAS_SEQ, BLOCK_T)
        cb = tl.dot(Ct, tl.trans(Bs), input_precision=PREC)
        E = _decay(loc_t, valid_t, cum_t, sid_t, loc_s, valid_s, cum_s, sid_s)
        acc += tl.dot(cb * E * dt_s[None, :], xs, input_precision=PREC)
    s_in = _state_tile(states_ptr, pid * H + h, offs_p, offs_n, P, N)
    acc += _carry(valid_t, sid_t, before, cum_t)[:, None] * tl.dot(Ct, tl.trans(s_in), input_precision=PREC)
    tl.store(y_ptr + (row_t * H + h)[:, None] * P + offs_p[None, :], acc,
             mask=valid_t[:, None] & (offs_p < P)[None, :])


@triton.jit
def _ssd_bwd_col_kernel(x_ptr, dt_ptr, cum_ptr, seq_ptr, B_ptr, C_ptr, dy_ptr, dstates_ptr, dx_ptr, ddt_ptr,
                        dB_ptr, v_ptr, L, H, G, R, P, N, Q, nc, nt, HAS_SEQ: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (batch * chunk, head, block of steps s): dx_s, the direct ddt_s and dB_s (per head) over the
    # chunk's later steps t and its end state; v_s = dt_s ddt^state_s for the chunk-end term of dcum.
    pid, b, h, g, start, before, last, cum_end = _program(seq_ptr, cum_ptr, nc, R, H, Q, L, HAS_SEQ)
    ms = tl.program_id(2)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    loc_s, valid_s, row_s, cum_s, dt_s, sid_s, xs, Bs = _step_tiles(
        seq_ptr, cum_ptr, dt_ptr, x_ptr, B_ptr, b, h, g, start, ms * BLOCK_T, L, H, G, Q, P, N, offs_p, offs_n,
        HAS_SEQ, BLOCK_T)
    dx = tl.zeros([BLOCK_T, BLOCK_P], tl.float32)
    dB = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    ddt = tl.zeros([BLOCK_T], tl.float32)
    for k in range(ms, nt):
        loc_t, valid_t, row_t, cum_t, dt_t, sid_t, dyt, Ct = _step_tiles(
            seq_ptr, cum_ptr, dt_ptr, dy_ptr, C_ptr, b, h, g, start, k * BLOCK_T, L, H, G, Q, P, N, offs_p, offs_n,
            HAS_SEQ, BLOCK_T)
        cb = tl.dot(Bs, tl.trans(Ct), input_precision=PREC)  # (s, t)
        E = tl.trans(_decay(loc_t, valid_t, cum_t, sid_t, loc_s, valid_s, cum_s, sid_s))
        dm = tl.dot(xs, tl.trans(dyt), input_precision=PREC)  # (s, t): dy_t . x_s
        dx += tl.dot(cb * E * dt_s[:, None], dyt, input_precision=PREC)
        ddt += tl.sum(dm * cb * E, axis=1)
        dB += tl.dot(dm * E * dt_s[:, None], Ct, input_precision=PREC)
    ds_out = _state_tile(dstates_ptr, pid * H + h, offs_p, offs_n, P, N)
    to_end = valid_s & (sid_s == last)
    e = tl.where(to_end, tl.exp(tl.where(to_end, cum_end - cum_s, 0.0)), 0.0)
    q = tl.dot(Bs, tl.trans(ds_out), input_precision=PREC)  # (s, P)
    dx += (e * dt_s)[:, None] * q
    ddt_state = e * tl.sum(xs * q, axis=1)
    ddt += ddt_state
    dB += (e * dt_s)[:, None] * tl.dot(xs, ds_out, input_precision=PREC)
    mp = valid_s[:, None] & (offs_p < P)[None, :]
    tl.store(dx_ptr + (row_s * H + h)[:, None] * P + offs_p[None, :], dx, mask=mp)
    tl.store(dB_ptr + (row_s * H + h)[:, None] * N + offs_n[None, :], dB,
             mask=valid_s[:, None] & (offs_n < N)[None, :])
    tl.store(ddt_ptr + row_s * H + h, ddt, mask=valid_s)
    tl.store(v_ptr + row_s * H + h, dt_s * ddt_state, mask=valid_s)


@triton.jit
def _ssd_bwd_row_kernel(x_ptr, dt_ptr, cum_ptr, seq_ptr, B_ptr, C_ptr, dy_ptr, states_ptr, ddt_ptr, dC_ptr,
                        dcum_ptr, L, H, G, R, P, N, Q, nc, nt, HAS_SEQ: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (batch * chunk, head, block of steps t): dC_t (per head) over the chunk's earlier steps s and
    # its entering state, and dcum_t = C_t . dC_t - dt_t ddt_t (the chunk-end term comes later).
    pid, b, h, g, start, before, last, cum_end = _program(seq_ptr, cum_ptr, nc, R, H, Q, L, HAS_SEQ)
    mt = tl.program_id(2)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    loc_t, valid_t, row_t, cum_t, dt_t, sid_t, dyt, Ct = _step_tiles(
        seq_ptr, cum_ptr, dt_ptr, dy_ptr, C_ptr, b, h, g, start, mt * BLOCK_T, L, H, G, Q, P, N, offs_p, offs_n,
        HAS_SEQ, BLOCK_T)
    dC = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k in range(0, mt + 1):
        loc_s, valid_s, row_s, cum_s, dt_s, sid_s, xs, Bs = _step_tiles(
            seq_ptr, cum_ptr, dt_ptr, x_ptr, B_ptr, b, h, g, start, k * BLOCK_T, L, H, G, Q, P, N, offs_p, offs_n,
            HAS_SEQ, BLOCK_T)
        dm = tl.dot(dyt, tl.trans(xs), input_precision=PREC)  # (t, s)
        E = _decay(loc_t, valid_t, cum_t, sid_t, loc_s, valid_s, cum_s, sid_s)
        dC += tl.dot(dm * E * dt_s[None, :], Bs, input_precision=PREC)
    s_in = _state_tile(states_ptr, pid * H + h, offs_p, offs_n, P, N)
    dC += _carry(valid_t, sid_t, before, cum_t)[:, None] * tl.dot(dyt, s_in, input_precision=PREC)
    tl.store(dC_ptr + (row_t * H + h)[:, None] * N + offs_n[None, :], dC,
             mask=valid_t[:, None] & (offs_n < N)[None, :])
    ddt = tl.load(ddt_ptr + row_t * H + h, mask=valid_t, other=0.0)
    tl.store(dcum_ptr + row_t * H + h, tl.sum(Ct * dC, axis=1) - dt_t * ddt, mask=valid_t)


# -- launchers ---------------------------------------------------------------------------------------------
def _pow2(n: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(n))


def blocks(chunk_size: int, headdim: int, dstate: int) -> dict[str, int]:
    """Block sizes: ``T`` steps per tile of a chunk, full ``P``/``N`` for the kernels that reduce over them,
    ``P``/``N`` tiles of the outer products, ``Q``/``H`` of the per-chunk cumulative sums, and the state block
    of the pass; ``warps`` for the kernels holding whole ``(P, N)`` tiles."""
    full_p, full_n = _pow2(headdim), _pow2(dstate)
    # The interpreter pays per program and per operation, not per element: larger step tiles there (still
    # more than one per chunk for chunks over 128 steps, so the multi-tile paths run in tests).
    block_t = min(128 if _INTERPRET else 64 if full_p * full_n <= 64 * 64 else 32, _pow2(chunk_size))
    block_q = _pow2(chunk_size)
    return dict(T=block_t, P=full_p, N=full_n, outer_P=min(64, full_p), outer_N=min(64, full_n),
                out_P=min(64, full_p), Q=block_q, H=max(1, min(16, 4096 // block_q)), state=1024,
                warps=8 if full_p * full_n >= 64 * 128 else 4)


def _contiguous(*ts: torch.Tensor | None) -> tuple:
    """The kernels index dense row-major arrays (an upstream gradient may come expanded, with stride 0)."""
    return tuple(None if t is None else t.contiguous() for t in ts)


def _dims(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> tuple[int, int, int, int, int, int, int]:
    batch, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    return batch, L, H, P, G, N, triton.cdiv(L, chunk_size)


def _cumsum(dt: torch.Tensor, A: torch.Tensor, chunk_size: int, nc: int, bk: dict[str, int]) -> torch.Tensor:
    batch, L, H = dt.shape
    cum = torch.empty_like(dt)
    _ssd_cumsum_kernel[(batch * nc, triton.cdiv(H, bk["H"]))](dt, A, cum, L, H, chunk_size, nc,
                                                             BLOCK_Q=bk["Q"], BLOCK_H=bk["H"])
    return cum


def _outer(U, V, cum, dt, seq, has_seq, entering, chunk_size, nc, bk, prec) -> torch.Tensor:
    batch, L, H, P = U.shape
    G, N = V.shape[2], V.shape[3]
    out = torch.empty(batch, nc, H, P, N, device=U.device, dtype=torch.float32)
    n_pb = triton.cdiv(P, bk["outer_P"])
    grid = (batch * nc, H, n_pb * triton.cdiv(N, bk["outer_N"]))
    _ssd_outer_kernel[grid](U, V, cum, dt, seq, out, L, H, G, H // G, P, N, chunk_size, nc, n_pb,
                            ENTERING=entering, HAS_SEQ=has_seq, PREC=prec, BLOCK_T=bk["T"],
                            BLOCK_P=bk["outer_P"], BLOCK_N=bk["outer_N"])
    return out


def ssd_scan_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 initial_states: torch.Tensor | None, seq_idx: torch.Tensor | None, chunk_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core scan: x ``(batch, L, H, P)``, dt fp32 ``(batch, L, H)``, A fp32 ``(H,)``, B/C ``(batch, L, G,
    N)``, initial_states fp32 ``(batch, H, P, N)`` or None, seq_idx int32 ``(batch, L)`` or None; all
    contiguous. Returns fp32 (y ``(batch, L, H, P)``, final_states ``(batch, H, P, N)``, chunk_states
    ``(batch, n_chunks, H, P, N)``)."""
    x, dt, A, B, C, initial_states, seq_idx = _contiguous(x, dt, A, B, C, initial_states, seq_idx)
    batch, L, H, P, G, N, nc = _dims(x, B, chunk_size)
    bk, prec = blocks(chunk_size, P, N), _prec(x.dtype)
    has_seq = seq_idx is not None
    seq = seq_idx if has_seq else dt.new_empty(1, dtype=torch.int32)
    cum = _cumsum(dt, A, chunk_size, nc, bk)
    states = _outer(x, B, cum, dt, seq, has_seq, False, chunk_size, nc, bk, prec)
    final = torch.empty(batch, H, P, N, device=x.device, dtype=torch.float32)
    _ssd_pass_kernel[(batch, H, triton.cdiv(P * N, bk["state"]))](
        states, cum, seq, initial_states if initial_states is not None else final, final, states, final,
        L, H, P * N, chunk_size, nc, HAS_INIT=initial_states is not None, REVERSE=False, HAS_SEQ=has_seq,
        BLOCK=bk["state"])
    y = torch.empty(batch, L, H, P, device=x.device, dtype=torch.float32)
    nt = triton.cdiv(chunk_size, bk["T"])
    _ssd_output_kernel[(batch * nc, H, nt * triton.cdiv(P, bk["out_P"]))](
        x, dt, cum, seq, B, C, states, y, L, H, G, H // G, P, N, chunk_size, nc, nt, HAS_SEQ=has_seq, PREC=prec,
        BLOCK_T=bk["T"], BLOCK_P=bk["out_P"], BLOCK_N=bk["N"], num_warps=bk["warps"])
    return y, final, states


def ssd_scan_bwd(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, initial_states: torch.Tensor | None, seq_idx: torch.Tensor | None,
                 chunk_states: torch.Tensor, chunk_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`ssd_scan_fwd` from dy fp32 ``(batch, L, H, P)`` and dfinal fp32 ``(batch, H, P, N)``
    or None, given its chunk_states. Returns fp32 (dx, ddt, dA, dB, dC, dinitial_states or None) in the
    inputs' shapes."""
    dy, dfinal, x, dt, A, B, C, seq_idx, chunk_states = _contiguous(dy, dfinal, x, dt, A, B, C, seq_idx,
                                                                    chunk_states)
    batch, L, H, P, G, N, nc = _dims(x, B, chunk_size)
    bk, prec = blocks(chunk_size, P, N), _prec(x.dtype)
    has_seq = seq_idx is not None
    f32 = dict(device=x.device, dtype=torch.float32)
    seq = seq_idx if has_seq else dt.new_empty(1, dtype=torch.int32)
    cum = _cumsum(dt, A, chunk_size, nc, bk)
    dstates = _outer(dy, C, cum, dt, seq, has_seq, True, chunk_size, nc, bk, prec)
    nblk = triton.cdiv(P * N, bk["state"])
    dinit = torch.empty(batch, H, P, N, **f32)
    part = torch.empty(batch, nc, H, nblk, **f32)
    _ssd_pass_kernel[(batch, H, nblk)](
        dstates, cum, seq, dfinal if dfinal is not None else dinit, dinit, chunk_states, part,
        L, H, P * N, chunk_size, nc, HAS_INIT=dfinal is not None, REVERSE=True, HAS_SEQ=has_seq, BLOCK=bk["state"])
    nt = triton.cdiv(chunk_size, bk["T"])
    dx = torch.empty(batch, L, H, P, **f32)
    ddt = torch.empty(batch, L, H, **f32)
    v = torch.empty(batch, L, H, **f32)
    dB = torch.empty(batch, L, H, N, **f32)  # per head, summed over each group below
    common = dict(HAS_SEQ=has_seq, PREC=prec, BLOCK_T=bk["T"], BLOCK_P=bk["P"], BLOCK_N=bk["N"],
                  num_warps=bk["warps"])
    _ssd_bwd_col_kernel[(batch * nc, H, nt)](x, dt, cum, seq, B, C, dy, dstates, dx, ddt, dB, v,
                                             L, H, G, H // G, P, N, chunk_size, nc, nt, **common)
    dC = torch.empty(batch, L, H, N, **f32)
    dcum = torch.empty(batch, L, H, **f32)
    _ssd_bwd_row_kernel[(batch * nc, H, nt)](x, dt, cum, seq, B, C, dy, chunk_states, ddt, dC, dcum,
                                             L, H, G, H // G, P, N, chunk_size, nc, nt, **common)
    dA = torch.empty(batch, nc, H, **f32)
    _ssd_dcum_kernel[(batch * nc, triton.cdiv(H, bk["H"]))](dt, A, dcum, v, part.sum(-1).contiguous(), ddt, dA,
                                                           L, H, chunk_size, nc, BLOCK_Q=bk["Q"],
                                                           BLOCK_H=bk["H"])
    dB = dB.view(batch, L, G, H // G, N).sum(3)
    dC = dC.view(batch, L, G, H // G, N).sum(3)
    return dx, ddt, dA.sum((0, 1)), dB, dC, dinit if initial_states is not None else None
