"""Triton kernels for S4D kernel generation: ``K[h, l] = 2 Re(sum_n w[h, n] exp(a[h, n] l))`` and the sums its
backward needs. Tiles of (positions x states) are evaluated with exp/sin/cos in registers and reduced at
once; the (H, N, L) Vandermonde matrix never exists in memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(ar_ptr, ai_ptr, wr_ptr, wi_ptr, k_ptr, N, L,
                BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    h = tl.program_id(0)
    pl = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    pos = pl.to(tl.float32)
    acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cn = n0 + tl.arange(0, BLOCK_N)
        mn = cn < N
        a_r = tl.load(ar_ptr + h * N + cn, mask=mn, other=0.0)
        a_i = tl.load(ai_ptr + h * N + cn, mask=mn, other=0.0)
        w_r = tl.load(wr_ptr + h * N + cn, mask=mn, other=0.0)
        w_i = tl.load(wi_ptr + h * N + cn, mask=mn, other=0.0)
        mag = tl.exp(pos[:, None] * a_r[None, :])
        ph = pos[:, None] * a_i[None, :]
        acc += tl.sum(mag * (w_r[None, :] * tl.cos(ph) - w_i[None, :] * tl.sin(ph)), axis=1)
    tl.store(k_ptr + h * L + pl, 2.0 * acc, mask=pl < L)


@triton.jit
def _bwd_kernel(g_ptr, ar_ptr, ai_ptr, s0r_ptr, s0i_ptr, s1r_ptr, s1i_ptr, N, L,
                BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr):
    h = tl.program_id(0)
    cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = cn < N
    a_r = tl.load(ar_ptr + h * N + cn, mask=mn, other=0.0)
    a_i = tl.load(ai_ptr + h * N + cn, mask=mn, other=0.0)
    s0r = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s0i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s1r = tl.zeros((BLOCK_N,), dtype=tl.float32)
    s1i = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        pl = l0 + tl.arange(0, BLOCK_L)
        g = tl.load(g_ptr + h * L + pl, mask=pl < L, other=0.0)
        pos = pl.to(tl.float32)
        mag = tl.exp(pos[:, None] * a_r[None, :])
        ph = pos[:, None] * a_i[None, :]
        zr = mag * tl.cos(ph)
        zi = mag * tl.sin(ph)
        gz = g[:, None]
        gl = (g * pos)[:, None]
        s0r += tl.sum(gz * zr, axis=0)
        s0i += tl.sum(gz * zi, axis=0)
        s1r += tl.sum(gl * zr, axis=0)
        s1i += tl.sum(gl * zi, axis=0)
    tl.store(s0r_ptr + h * N + cn, s0r, mask=mn)
    tl.store(s0i_ptr + h * N + cn, s0i, mask=mn)
    tl.store(s1r_ptr + h * N + cn, s1r, mask=mn)
    tl.store(s1i_ptr + h * N + cn, s1i, mask=mn)


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2:
            raise ValueError("s4_kernel (triton): inputs must be contiguous fp32 matrices")


def s4_kernel_fwd(ar: torch.Tensor, ai: torch.Tensor, wr: torch.Tensor, wi: torch.Tensor, L: int) -> torch.Tensor:
    """(H, N) fp32 parts of dtA and coef -> K (H, L) fp32."""
    _check(ar, ai, wr, wi)
    H, N = ar.shape
    k = torch.empty(H, L, dtype=torch.float32, device=ar.device)
    bl = 64 if L >= 64 else max(16, triton.next_power_of_2(L))
    bn = max(16, min(64, triton.next_power_of_2(N)))
    _fwd_kernel[(H, triton.cdiv(L, bl))](ar, ai, wr, wi, k, N, L, BLOCK_L=bl, BLOCK_N=bn)
    return k


def s4_kernel_bwd_sums(dk: torch.Tensor, ar: torch.Tensor, ai: torch.Tensor):
    """S0 = sum_l g_l z^l, S1 = sum_l g_l l z^l as (re, im) pairs, each (H, N) fp32."""
    _check(dk, ar, ai)
    H, N = ar.shape
    L = dk.shape[1]
    outs = [torch.empty(H, N, dtype=torch.float32, device=ar.device) for _ in range(4)]
    bl = 64 if L >= 64 else max(16, triton.next_power_of_2(L))
    bn = max(16, min(64, triton.next_power_of_2(N)))
    _bwd_kernel[(H, triton.cdiv(N, bn))](dk, ar, ai, *outs, N, L, BLOCK_L=bl, BLOCK_N=bn)
    return tuple(outs)


# Former names of the launchers.
kernel_fwd = s4_kernel_fwd
kernel_bwd_sums = s4_kernel_bwd_sums
