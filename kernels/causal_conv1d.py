"""Triton kernels for the depthwise causal conv1d (forward, backward) and its decode step, with launchers.

``out[b, d, t] = bias[d] + sum_k w[d, k] * x[b, d, t - W + 1 + k]`` (zeros before the start), optional SiLU.

- forward: a program per (batch, channel block, time block) computes its (BLOCK_D, BLOCK_L) tile with W
  shifted loads of ``x`` (W is a compile-time constant, so the tap loop unrolls);
- backward: the SiLU derivative is applied by a forward-shaped kernel that writes ``g = dout * silu'(pre)``;
  a second kernel computes ``dx[s] = sum_k w[k] g[s + W - 1 - k]`` for its tile and the tile's partial sums
  of ``dw[d, k] = sum_t g[t] x[t - W + 1 + k]`` and ``dbias``, which the launcher sums over (batch, time
  blocks) -- no atomics, deterministic;
- update: a program per (batch, channel block) reads the virtual sequence ``[conv_state (S), x (T)]``,
  writes T outputs and shifts the state in place (the new state is loaded whole before it is stored).

All arithmetic is fp32; inputs may be fp32/fp16 (bf16 is not supported by the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, dout_ptr, out_ptr, dim, L,
                     WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, GRAD: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    # GRAD: write dout * silu'(pre) (the backward's pre-activation gradient) instead of the output.
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    md = offs_d < dim
    m2 = md[:, None] & (offs_t < L)[None, :]
    rows = (b * dim + offs_d)[:, None] * L
    acc = tl.zeros([BLOCK_D, BLOCK_L], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        src = offs_t - (WIDTH - 1 - k)
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + rows + src[None, :], mask=m2 & (src >= 0)[None, :], other=0.0).to(tl.float32)
        acc += wk[:, None] * xv
    if GRAD:
        go = tl.load(dout_ptr + rows + offs_t[None, :], mask=m2, other=0.0).to(tl.float32)
        sg = 1.0 / (1.0 + tl.exp(-acc))
        acc = go * sg * (1.0 + acc * (1.0 - sg))
    elif SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows + offs_t[None, :], acc, mask=m2)


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, dw_part_ptr, db_part_ptr, dim, L,
                     WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    pid_t = tl.program_id(2)
    offs_t = pid_t * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_w = tl.arange(0, BLOCK_W)
    md = offs_d < dim
    mt = offs_t < L
    m2 = md[:, None] & mt[None, :]
    rows = (b * dim + offs_d)[:, None] * L
    g = tl.load(g_ptr + rows + offs_t[None, :], mask=m2, other=0.0).to(tl.float32)
    dx = tl.zeros([BLOCK_D, BLOCK_L], tl.float32)
    dw = tl.zeros([BLOCK_D, BLOCK_W], tl.float32)
    for k in tl.static_range(WIDTH):
        shift = WIDTH - 1 - k
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0).to(tl.float32)
        # dx[s] gets w[k] * g[s + shift]; dw[k] gets g[t] * x[t - shift] over this tile's t.
        gs = tl.load(g_ptr + rows + (offs_t + shift)[None, :], mask=m2 & ((offs_t + shift) < L)[None, :],
                     other=0.0).to(tl.float32)
        dx += wk[:, None] * gs
        src = offs_t - shift
        xv = tl.load(x_ptr + rows + src[None, :], mask=m2 & (src >= 0)[None, :], other=0.0).to(tl.float32)
        dw += tl.where(offs_w[None, :] == k, tl.sum(g * xv, axis=1)[:, None], 0.0)
    tl.store(dx_ptr + rows + offs_t[None, :], dx, mask=m2)
    part = b * tl.num_programs(2) + pid_t  # one partial row per (batch, time block)
    tl.store(dw_part_ptr + (part * dim + offs_d)[:, None] * WIDTH + offs_w[None, :], dw,
             mask=md[:, None] & (offs_w < WIDTH)[None, :])
    tl.store(db_part_ptr + part * dim + offs_d, tl.sum(g, axis=1), mask=md)


@triton.jit
def _conv_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, out_ptr, dim, T, S,
                        WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    offs_s = tl.arange(0, BLOCK_S)
    md = offs_d < dim
    xrow = (b * dim + offs_d)[:, None] * T
    srow = (b * dim + offs_d)[:, None] * S
    acc = tl.zeros([BLOCK_D, BLOCK_T], tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[:, None]
    mt = offs_t < T
    for k in tl.static_range(WIDTH):
        # Position of tap k of output t in [state (S), x (T)]; S >= WIDTH - 1 keeps it >= 0.
        pos = S + offs_t - (WIDTH - 1 - k)
        from_x = pos >= S
        vs = tl.load(state_ptr + srow + pos[None, :], mask=md[:, None] & (mt & ~from_x)[None, :], other=0.0)
        vx = tl.load(x_ptr + xrow + (pos - S)[None, :], mask=md[:, None] & (mt & from_x)[None, :], other=0.0)
        v = tl.where(from_x[None, :], vx.to(tl.float32), vs.to(tl.float32))
        wk = tl.load(w_ptr + offs_d * WIDTH + k, mask=md, other=0.0).to(tl.float32)
        acc += wk[:, None] * v
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + xrow + offs_t[None, :], acc, mask=md[:, None] & mt[None, :])
    # New state j = old sequence position T + j: from the state while T + j < S, else from x.
    ms = offs_s < S
    src = T + offs_s
    in_state = src < S
    ns = tl.load(state_ptr + srow + src[None, :], mask=md[:, None] & (ms & in_state)[None, :], other=0.0)
    nx = tl.load(x_ptr + xrow + (src - S)[None, :], mask=md[:, None] & (ms & ~in_state)[None, :], other=0.0)
    new = tl.where(in_state[None, :], ns, nx.to(ns.dtype))
    tl.debug_barrier()  # every lane has read the old state before any lane overwrites it
    tl.store(state_ptr + srow + offs_s[None, :], new, mask=md[:, None] & ms[None, :])


def _blocks(dim: int, L: int) -> tuple[int, int]:
    block_l = max(16, min(256, triton.next_power_of_2(L)))
    block_d = max(2, min(16, triton.next_power_of_2(dim)))
    return block_d, block_l


def conv_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """x (B, D, L) contiguous, w (D, W) -> out (B, D, L) fp32."""
    batch, dim, L = x.shape
    width = w.shape[1]
    out = torch.empty(batch, dim, L, device=x.device, dtype=torch.float32)
    block_d, block_l = _blocks(dim, L)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(L, block_l))
    _conv_fwd_kernel[grid](x, w, bias if bias is not None else w, x, out, dim, L, WIDTH=width,
                           HAS_BIAS=bias is not None, SILU=bool(silu), GRAD=False, BLOCK_D=block_d, BLOCK_L=block_l)
    return out


def conv_bwd(dout: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fp32 (dx (B, D, L), dw (D, W), dbias (D,))."""
    batch, dim, L = x.shape
    width = w.shape[1]
    block_d, block_l = _blocks(dim, L)
    grid = (batch, triton.cdiv(dim, block_d), triton.cdiv(L, block_l))
    f32 = dict(device=x.device, dtype=torch.float32)
    if silu:
        g = torch.empty(batch, dim, L, **f32)
        _conv_fwd_kernel[grid](x, w, bias if bias is not None else w, dout, g, dim, L, WIDTH=width,
                               HAS_BIAS=bias is not None, SILU=True, GRAD=True, BLOCK_D=block_d, BLOCK_L=block_l)
    else:
        g = dout
    dx = torch.empty(batch, dim, L, **f32)
    nparts = batch * grid[2]
    dw_part = torch.empty(nparts, dim, width, **f32)
    db_part = torch.empty(nparts, dim, **f32)
    _conv_bwd_kernel[grid](x, w, g, dx, dw_part, db_part, dim, L, WIDTH=width, BLOCK_D=block_d, BLOCK_L=block_l,
                           BLOCK_W=max(2, triton.next_power_of_2(width)))
    return dx, dw_part.sum(0), db_part.sum(0)


def conv_update(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                silu: bool) -> torch.Tensor:
    """x (B, D, T) contiguous; conv_state (B, D, S) contiguous, shifted in place. Returns out (B, D, T) fp32."""
    batch, dim, T = x.shape
    S = conv_state.shape[-1]
    width = w.shape[1]
    out = torch.empty(batch, dim, T, device=x.device, dtype=torch.float32)
    block_d = max(2, min(16, triton.next_power_of_2(dim)))
    grid = (batch, triton.cdiv(dim, block_d))
    _conv_update_kernel[grid](x, conv_state, w, bias if bias is not None else w, out, dim, T, S, WIDTH=width,
                              HAS_BIAS=bias is not None, SILU=bool(silu), BLOCK_D=block_d,
                              BLOCK_T=max(2, triton.next_power_of_2(T)), BLOCK_S=max(2, triton.next_power_of_2(S)))
    return out
