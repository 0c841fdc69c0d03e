"""Triton kernels for the depthwise causal conv1d (forward, backward) and its decode step, with launchers.

Each row (b, d) is convolved over ``v = [initial_states (W - 1; zeros when absent), x (L)]``:
``out[b, d, t] = bias[d] + sum_k w[d, k] * v[t + k]``, optional SiLU. With ``seq_idx`` a tap only reads
positions of the same sequence as ``t`` (and never the padding before the row).

- forward: a program per (batch, channel block, time block) computes its (BLOCK_D, BLOCK_L) tile with W
  shifted loads (W is a compile-time constant, so the tap loop unrolls);
- backward: the SiLU derivative is applied by a forward-shaped kernel that writes ``g = dout * silu'(pre)``;
  a second kernel computes ``dx[s] = sum_k w[k] g[s + W - 1 - k]`` for its tile and the tile's partial sums
  of ``dw`` and ``dbias``, which the launcher sums over (batch, time blocks) -- no atomics, deterministic.
  The launcher adds the W - 1 initial states' gradient (a (B, D, W - 1) product with the first outputs);
- update: a program per (batch, channel block) reads the window ``[W - 1 inputs before x, x (T)]`` from the
  state row (linear or circular, see ``causal_conv1d_update``), writes T outputs and updates the state in
  place (every read is done before any write).

Inputs are fp32 contiguous (the Python glue converts); arithmetic is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tap(x_ptr, init_ptr, seq_ptr, offs_d, src, m2, seq_t, L, WIDTH: tl.constexpr,
         HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr):
    """v at x position ``src`` (negative reads the initial states) for channels ``offs_d`` of one batch row
    (the pointers are that row's), zero where the tap is excluded."""
    rows = offs_d[:, None]
    xv = tl.load(x_ptr + rows * L + src[None, :], mask=m2 & (src >= 0)[None, :], other=0.0)
    if HAS_INIT:
        xv += tl.load(init_ptr + rows * (WIDTH - 1) + (src + WIDTH - 1)[None, :], mask=m2 & (src < 0)[None, :],
                      other=0.0)
    if HAS_SEQ:
        same = (src >= 0) & (tl.load(seq_ptr + src, mask=(src >= 0) & (src < L), other=0) == seq_t)
        xv = tl.where(same[None, :], xv, 0.0)
    return xv


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, init_ptr, dout_ptr, out_ptr, dim, L,
                     WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
                     SILU: tl.constexpr, GRAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    # GRAD: write dout * silu'(pre) (the backward's pre-activation gradient) instead of the output.
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    md = offs_d < dim
    mt = offs_t < L
    m2 = md[:, None] & mt[None, :]
    x_b = x_ptr + b * dim * L
    init_b = init_ptr + b * dim * (WIDTH - 1)
    seq_b = seq_ptr + b * L
    seq_t = tl.load(seq_b + offs_t, mask=mt, other=0) if HAS_SEQ else offs_t
    acc = tl.zeros([BLOCK_D, BLOCK_L], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0)[:, None]
    for k in tl.static_range(WIDTH):
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0)
        acc += wk[:, None] * _tap(x_b, init_b, seq_b, offs_d, offs_t - (WIDTH - 1 - k), m2, seq_t, L, WIDTH,
                                  HAS_INIT, HAS_SEQ)
    rows = (b * dim + offs_d)[:, None] * L
    if GRAD:
        go = tl.load(dout_ptr + rows + offs_t[None, :], mask=m2, other=0.0)
        sg = 1.0 / (1.0 + tl.exp(-acc))
        acc = go * sg * (1.0 + acc * (1.0 - sg))
    elif SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows + offs_t[None, :], acc, mask=m2)


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, g_ptr, seq_ptr, init_ptr, dx_ptr, dw_part_ptr, db_part_ptr, dim, L,
                     WIDTH: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_w = tl.arange(0, BLOCK_W)
    md = offs_d < dim
    mt = offs_t < L
    m2 = md[:, None] & mt[None, :]
    x_b = x_ptr + b * dim * L
    init_b = init_ptr + b * dim * (WIDTH - 1)
    seq_b = seq_ptr + b * L
    rows = (b * dim + offs_d)[:, None] * L
    seq_t = tl.load(seq_b + offs_t, mask=mt, other=0) if HAS_SEQ else offs_t
    g = tl.load(g_ptr + rows + offs_t[None, :], mask=m2, other=0.0)
    dx = tl.zeros([BLOCK_D, BLOCK_L], tl.float32)
    dw = tl.zeros([BLOCK_D, BLOCK_W], tl.float32)
    for k in tl.static_range(WIDTH):
        shift = WIDTH - 1 - k
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0)
        # dx[s] gets w[k] * g[s + shift] when s and s + shift are in one sequence.
        dst = offs_t + shift
        gs = tl.load(g_ptr + rows + dst[None, :], mask=m2 & (dst < L)[None, :], other=0.0)
        if HAS_SEQ:
            same = tl.load(seq_b + dst, mask=mt & (dst < L), other=0) == seq_t
            gs = tl.where(same[None, :], gs, 0.0)
        dx += wk[:, None] * gs
        # dw[k] gets g[t] * v[t + k] (the tap of output t) over this tile's t.
        xv = _tap(x_b, init_b, seq_b, offs_d, offs_t - shift, m2, seq_t, L, WIDTH, HAS_INIT, HAS_SEQ)
        dw += tl.where(offs_w[None, :] == k, tl.sum(g * xv, axis=1)[:, None], 0.0)
    tl.store(dx_ptr + rows + offs_t[None, :], dx, mask=m2)
    part = b * tl.num_programs(2) + pid_t  # one partial row per (batch, time block)
    tl.store(dw_part_ptr + (part * dim + offs_d)[:, None] * WIDTH + offs_w[None, :], dw,
             mask=md[:, None] & (offs_w < WIDTH)[None, :])
    tl.store(db_part_ptr + part * dim + offs_d, tl.sum(g, axis=1), mask=md)


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, seqlens_ptr, idx_ptr, out_ptr, dim, T, S,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        CIRCULAR: tl.constexpr, HAS_IDX: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    md = offs_d < dim
    mt = offs_t < T
    sb = tl.load(idx_ptr + b) if HAS_IDX else b
    xrow = (b * dim + offs_d)[:, None] * T
    srow = (sb * dim + offs_d)[:, None] * S
    # `nxt`: the state position of the first new input (linear state: S, so the window is the last W - 1).
    nxt = tl.load(seqlens_ptr + b) if CIRCULAR else S
    acc = tl.zeros([BLOCK_D, BLOCK_T], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0)[:, None]
    for k in tl.static_range(WIDTH):
        i = offs_t + k  # index into the window [W - 1 inputs before x, x]
        from_x = i >= WIDTH - 1
        spos = ((nxt - (WIDTH - 1) + i) % S + S) % S
        vs = tl.load(state_ptr + srow + spos[None, :], mask=md[:, None] & (mt & ~from_x)[None, :], other=0.0)
        vx = tl.load(x_ptr + xrow + (i - (WIDTH - 1))[None, :], mask=md[:, None] & (mt & from_x)[None, :],
                     other=0.0)
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0)
        acc += wk[:, None] * tl.where(from_x[None, :], vx, vs)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + xrow + offs_t[None, :], acc, mask=md[:, None] & mt[None, :])
    if CIRCULAR:
        # Only the last S new inputs survive, each at a distinct position.
        keep = mt & (offs_t >= T - S)
        xv = tl.load(x_ptr + xrow + offs_t[None, :], mask=md[:, None] & keep[None, :], other=0.0)
        tl.debug_barrier()  # every lane has read the window before any lane overwrites it
        tl.store(state_ptr + srow + ((nxt + offs_t) % S)[None, :], xv, mask=md[:, None] & keep[None, :])
    else:
        # New state j = old sequence position T + j of [state (S), x (T)].
        offs_s = tl.arange(0, BLOCK_S)
        ms = offs_s < S
        src = T + offs_s
        in_state = src < S
        ns = tl.load(state_ptr + srow + src[None, :], mask=md[:, None] & (ms & in_state)[None, :], other=0.0)
        nx = tl.load(x_ptr + xrow + (src - S)[None, :], mask=md[:, None] & (ms & ~in_state)[None, :], other=0.0)
        new = tl.where(in_state[None, :], ns, nx)
        tl.debug_barrier()  # every lane has read the old state before any lane overwrites it
        tl.store(state_ptr + srow + offs_s[None, :], new, mask=md[:, None] & ms[None, :])


def _blocks(dim: int, L: int) -> tuple[int, int]:
    block_l = max(16, min(256, triton.next_power_of_2(L)))
    block_d = max(2, min(16, triton.next_power_of_2(dim)))
    return block_d, block_l


def _opt(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if t is None else t


def causal_conv1d_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None,
                      initial_states: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """x (B, D, L), w (D, W), bias (D,), seq_idx (B, L) int32, initial_states (B, D, W - 1) -> out fp32."""
    batch, dim, L = x.shape
    out = torch.empty(batch, dim, L, device=x.device, dtype=torch.float32)
    block_d, block_l = _blocks(dim, L)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(L, block_l))
    _conv_fwd_kernel[grid](x, w, _opt(bias, w), _opt(seq_idx, x), _opt(initial_states, x), x, out, dim, L,
                           WIDTH=w.shape[1], HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None,
                           HAS_INIT=initial_states is not None, SILU=bool(silu), GRAD=False,
                           BLOCK_D=block_d, BLOCK_L=block_l)
    return out


def causal_conv1d_bwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dout: torch.Tensor,
                      seq_idx: torch.Tensor | None, initial_states: torch.Tensor | None, silu: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fp32 (dx (B, D, L), dw (D, W), dbias (D,), dinitial_states (B, D, W - 1))."""
    batch, dim, L = x.shape
    width = w.shape[1]
    block_d, block_l = _blocks(dim, L)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(L, block_l))
    f32 = dict(device=x.device, dtype=torch.float32)
    flags = dict(WIDTH=width, HAS_SEQ=seq_idx is not None, HAS_INIT=initial_states is not None,
                 BLOCK_D=block_d, BLOCK_L=block_l)
    seq, init = _opt(seq_idx, x), _opt(initial_states, x)
    if silu:
        g = torch.empty(batch, dim, L, **f32)
        _conv_fwd_kernel[grid](x, w, _opt(bias, w), seq, init, dout, g, dim, L, HAS_BIAS=bias is not None,
                               SILU=True, GRAD=True, **flags)
    else:
        g = dout
    dx = torch.empty(batch, dim, L, **f32)
    nparts = batch * grid[2]
    dw_part = torch.empty(nparts, dim, width, **f32)
    db_part = torch.empty(nparts, dim, **f32)
    _conv_bwd_kernel[grid](x, w, g, seq, init, dx, dw_part, db_part, dim, L,
                           BLOCK_W=max(2, triton.next_power_of_2(width)), **flags)
    # dinit[j] = sum_{k <= j} w[k] g[j - k]: the first W - 1 outputs are the only ones that read the states.
    dinit = torch.zeros(batch, dim, width - 1, **f32)
    for k in range(width - 1):
        n = min(width - 1 - k, L)
        dinit[..., k:k + n] += w[:, k, None] * g[..., :n]
    return dx, dw_part.sum(0), db_part.sum(0), dinit


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                         silu: bool, cache_seqlens: torch.Tensor | None,
                         conv_state_indices: torch.Tensor | None) -> torch.Tensor:
    """x (B, D, T); conv_state (B_state, D, S) fp32, updated in place; cache_seqlens / conv_state_indices
    (B,) int32 (validated by the caller). Returns out (B, D, T) fp32."""
    batch, dim, T = x.shape
    S = conv_state.shape[-1]
    if S == 0:  # width 1: nothing to remember; the kernel writes a scratch state instead
        conv_state = x.new_zeros(conv_state.shape[0], dim, 1)
    out = torch.empty(batch, dim, T, device=x.device, dtype=torch.float32)
    block_d = max(2, min(16, triton.next_power_of_2(dim)))
    grid = (batch, triton.cdiv(dim, block_d))
    _conv_update_kernel[grid](x, conv_state, w, _opt(bias, w), _opt(cache_seqlens, x), _opt(conv_state_indices, x),
                              out, dim, T, conv_state.shape[-1], WIDTH=w.shape[1], HAS_BIAS=bias is not None,
                              SILU=bool(silu), CIRCULAR=cache_seqlens is not None,
                              HAS_IDX=conv_state_indices is not None, BLOCK_D=block_d,
                              BLOCK_T=max(2, triton.next_power_of_2(T)), BLOCK_S=max(2, triton.next_power_of_2(S)))
    return out
