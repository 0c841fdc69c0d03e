"""Triton kernels for chunked causal linear attention: ``y = tril(q k^T) va`` and its backward.

Tensors are fp32 contiguous ``(N, L, m)``/``(N, L, Da)``. A program owns one row ``n`` and one
``(BLOCK_M, BLOCK_D)`` tile of the running state and walks the sequence in chunks of ``CHUNK`` rows.
Every output is linear in the tiles of the feature and value dimensions, so the programs for different
tiles write partial results that the launcher sums; no program ever holds more than one state tile, and
nothing of size (L, m, Da) exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load(ptr, n, rows, cols, L, W, mask_cols):
    offs = n * L * W + rows[:, None] * W + cols[None, :]
    return tl.load(ptr + offs, mask=(rows[:, None] < L) & mask_cols[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, val, n, rows, cols, L, W, mask_cols):
    offs = n * L * W + rows[:, None] * W + cols[None, :]
    tl.store(ptr + offs, val, mask=(rows[:, None] < L) & mask_cols[None, :])


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, y_ptr, N, L, M, DA,
                CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    mb = tl.program_id(1)
    db = tl.program_id(2)
    cm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cd = db * BLOCK_D + tl.arange(0, BLOCK_D)
    mm = cm < M
    md = cd < DA
    ar = tl.arange(0, CHUNK)
    tri = ar[:, None] >= ar[None, :]
    state = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    out_base = mb * N  # partial outputs: (n_mb, N, L, DA)
    for s in range(0, L, CHUNK):
        rows = s + ar
        qc = _load(q_ptr, n, rows, cm, L, M, mm)
        kc = _load(k_ptr, n, rows, cm, L, M, mm)
        vc = _load(v_ptr, n, rows, cd, L, DA, md)
        a = tl.dot(qc, tl.trans(kc))
        a = tl.where(tri, a, 0.0)
        y = tl.dot(a, vc) + tl.dot(qc, state)
        _store(y_ptr, y, out_base + n, rows, cd, L, DA, md)
        state += tl.dot(tl.trans(kc), vc)


@triton.jit
def _bwd_dq_kernel(k_ptr, v_ptr, g_ptr, dq_ptr, N, L, M, DA,
                   CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    mb = tl.program_id(1)
    db = tl.program_id(2)
    cm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cd = db * BLOCK_D + tl.arange(0, BLOCK_D)
    mm = cm < M
    md = cd < DA
    ar = tl.arange(0, CHUNK)
    tri = ar[:, None] >= ar[None, :]
    state = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    out_base = db * N  # partial dq: (n_db, N, L, M)
    for s in range(0, L, CHUNK):
        rows = s + ar
        kc = _load(k_ptr, n, rows, cm, L, M, mm)
        vc = _load(v_ptr, n, rows, cd, L, DA, md)
        gc = _load(g_ptr, n, rows, cd, L, DA, md)
        p = tl.where(tri, tl.dot(gc, tl.trans(vc)), 0.0)
        dq = tl.dot(p, kc) + tl.dot(gc, tl.trans(state))
        _store(dq_ptr, dq, out_base + n, rows, cm, L, M, mm)
        state += tl.dot(tl.trans(kc), vc)


@triton.jit
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, g_ptr, dk_ptr, dv_ptr, N, L, M, DA, N_CHUNKS,
                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    mb = tl.program_id(1)
    db = tl.program_id(2)
    cm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cd = db * BLOCK_D + tl.arange(0, BLOCK_D)
    mm = cm < M
    md = cd < DA
    ar = tl.arange(0, CHUNK)
    tri = ar[:, None] >= ar[None, :]
    rstate = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for i in range(0, N_CHUNKS):
        s = (N_CHUNKS - 1 - i) * CHUNK
        rows = s + ar
        qc = _load(q_ptr, n, rows, cm, L, M, mm)
        kc = _load(k_ptr, n, rows, cm, L, M, mm)
        vc = _load(v_ptr, n, rows, cd, L, DA, md)
        gc = _load(g_ptr, n, rows, cd, L, DA, md)
        p = tl.where(tri, tl.dot(gc, tl.trans(vc)), 0.0)
        a = tl.where(tri, tl.dot(qc, tl.trans(kc)), 0.0)
        dk = tl.dot(tl.trans(p), qc) + tl.dot(vc, tl.trans(rstate))
        dv = tl.dot(tl.trans(a), gc) + tl.dot(kc, rstate)
        _store(dk_ptr, dk, db * N + n, rows, cm, L, M, mm)   # partial over D-tiles
        _store(dv_ptr, dv, mb * N + n, rows, cd, L, DA, md)  # partial over m-tiles
        rstate += tl.dot(tl.trans(qc), gc)


def _blocks(m: int, da: int, L: int) -> tuple[int, int, int]:
    bm = max(16, min(64, triton.next_power_of_2(m)))
    bd = max(16, min(64, triton.next_power_of_2(da)))
    chunk = 16 if L <= 16 else 32 if L <= 256 else 64
    return chunk, bm, bd


def _check(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 3:
            raise ValueError("linear_attention (triton): inputs must be contiguous fp32 (N, L, W) tensors")


def linear_attention_causal_fwd(q: torch.Tensor, k: torch.Tensor, va: torch.Tensor) -> torch.Tensor:
    """``tril(q k^T) va``: q, k (N, L, m), va (N, L, Da) -> (N, L, Da) fp32."""
    _check(q, k, va)
    n, L, m = q.shape
    da = va.shape[-1]
    chunk, bm, bd = _blocks(m, da, L)
    nmb, ndb = triton.cdiv(m, bm), triton.cdiv(da, bd)
    y = torch.empty(nmb, n, L, da, dtype=torch.float32, device=q.device)
    _fwd_kernel[(n, nmb, ndb)](q, k, va, y, n, L, m, da, CHUNK=chunk, BLOCK_M=bm, BLOCK_D=bd)
    return y.sum(0) if nmb > 1 else y[0]


def linear_attention_causal_bwd(q: torch.Tensor, k: torch.Tensor, va: torch.Tensor, ga: torch.Tensor):
    """Gradients of ``tril(q k^T) va`` for the upstream ``ga`` -> (dq, dk, dva), fp32."""
    _check(q, k, va, ga)
    n, L, m = q.shape
    da = va.shape[-1]
    chunk, bm, bd = _blocks(m, da, L)
    nmb, ndb = triton.cdiv(m, bm), triton.cdiv(da, bd)
    dq = torch.empty(ndb, n, L, m, dtype=torch.float32, device=q.device)
    dk = torch.empty(ndb, n, L, m, dtype=torch.float32, device=q.device)
    dv = torch.empty(nmb, n, L, da, dtype=torch.float32, device=q.device)
    grid = (n, nmb, ndb)
    _bwd_dq_kernel[grid](k, va, ga, dq, n, L, m, da, CHUNK=chunk, BLOCK_M=bm, BLOCK_D=bd)
    _bwd_dkdv_kernel[grid](q, k, va, ga, dk, dv, n, L, m, da, triton.cdiv(L, chunk),
                           CHUNK=chunk, BLOCK_M=bm, BLOCK_D=bd)
    return dq.sum(0), dk.sum(0), dv.sum(0)


# Former names of the launchers.
causal_fwd = linear_attention_causal_fwd
causal_bwd = linear_attention_causal_bwd
