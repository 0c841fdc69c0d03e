"""Triton kernels for layer norm and RMS norm, forward and backward.

One program normalises one row held entirely in registers (rows up to 65536 wide). Backward programs
each take a contiguous slice of rows and accumulate the weight/bias gradients of that slice, which are
summed afterwards: no atomics, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rotary import rotary_apply as rotary  # noqa: F401  (the rotary launcher's former home and name)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


@triton.jit
def _layer_norm_fwd_kernel(X, Y, W, B, Mean, Rstd, n, eps,
                           UNBIASED: tl.constexpr, EPS_OUTSIDE: tl.constexpr,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)
    ss = tl.sum(xc * xc, axis=0)
    if UNBIASED:
        var = ss / tl.maximum(n - 1, 1)
    else:
        var = ss / n
    if EPS_OUTSIDE:
        rstd = 1.0 / (tl.sqrt(var) + eps)
    else:
        rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(DY, X, W, Mean, DX, DWp, DBp, rows, n, rows_per_prog, eps,
                           UNBIASED: tl.constexpr, EPS_OUTSIDE: tl.constexpr, HAS_W: tl.constexpr,
                           BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    if UNBIASED:
        c = tl.maximum(n - 1, 1) * 1.0
    else:
        c = n * 1.0
    r0 = pid * rows_per_prog
    for i in range(0, rows_per_prog):
        row = r0 + i
        if row < rows:
            off = row.to(tl.int64) * n
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(Mean + row)
            xc = tl.where(mask, x - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / c
            if EPS_OUTSIDE:
                sd = tl.sqrt(var)
                rstd = 1.0 / (sd + eps)
                drstd = tl.where(sd > 0, -rstd * rstd / (2.0 * tl.maximum(sd, 1e-30)), 0.0)
            else:
                rstd = 1.0 / tl.sqrt(var + eps)
                drstd = -0.5 * rstd * rstd * rstd
            dw += g * xc * rstd
            db += g
            if HAS_W:
                g = g * w
            gmean = tl.sum(g, axis=0) / n
            k = tl.sum(g * xc, axis=0) * drstd * (2.0 / c)
            dx = rstd * (g - gmean) + xc * k
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DWp + pid * n + cols, dw, mask=mask)
    tl.store(DBp + pid * n + cols, db, mask=mask)


def _n_progs(rows: int, x: torch.Tensor) -> int:
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return max(1, min(rows, 4 * sms))
    return max(1, min(rows, 8))


def layer_norm_fwd(x: torch.Tensor, weight, bias, eps: float, mode: int):
    """x (rows, n) contiguous -> (y, mean, rstd); mode bit 0 unbiased, bit 1 eps outside the sqrt."""
    rows, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block = _block(n)
    _layer_norm_fwd_kernel[(rows,)](
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd, n, eps,
        UNBIASED=bool(mode & 1), EPS_OUTSIDE=bool(mode & 2), HAS_W=weight is not None,
        HAS_B=bias is not None, BLOCK=block, num_warps=_num_warps(block))
    return y, mean, rstd


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight, mean: torch.Tensor, eps: float, mode: int):
    """-> (dx, dweight fp32 (n,), dbias fp32 (n,))."""
    rows, n = x.shape
    dx = torch.empty_like(x)
    progs = _n_progs(rows, x)
    per = triton.cdiv(rows, progs)
    dwp = torch.empty(progs, n, device=x.device, dtype=torch.float32)
    dbp = torch.empty_like(dwp)
    block = _block(n)
    _layer_norm_bwd_kernel[(progs,)](
        dy, x, weight if weight is not None else x, mean, dx, dwp, dbp, rows, n, per, eps,
        UNBIASED=bool(mode & 1), EPS_OUTSIDE=bool(mode & 2), HAS_W=weight is not None, BLOCK=block,
        num_warps=_num_warps(block))
    return dx, dwp.sum(0), dbp.sum(0)


@triton.jit
def _rms_norm_fwd_kernel(X, Y, W, Rstd, n, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Rstd + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, Rstd, DX, DWp, rows, n, rows_per_prog, HAS_W: tl.constexpr,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    r0 = pid * rows_per_prog
    for i in range(0, rows_per_prog):
        row = r0 + i
        if row < rows:
            off = row.to(tl.int64) * n
            x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            dw += g * x * rstd
            if HAS_W:
                g = g * w
            k = rstd * rstd * rstd * tl.sum(g * x, axis=0) / n
            tl.store(DX + off + cols, (rstd * g - x * k).to(DX.dtype.element_ty), mask=mask)
    tl.store(DWp + pid * n + cols, dw, mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight, eps: float):
    rows, n = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    block = _block(n)
    _rms_norm_fwd_kernel[(rows,)](x, y, weight if weight is not None else x, rstd, n, eps,
                                  HAS_W=weight is not None, BLOCK=block, num_warps=_num_warps(block))
    return y, rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight, rstd: torch.Tensor):
    rows, n = x.shape
    dx = torch.empty_like(x)
    progs = _n_progs(rows, x)
    per = triton.cdiv(rows, progs)
    dwp = torch.empty(progs, n, device=x.device, dtype=torch.float32)
    block = _block(n)
    _rms_norm_bwd_kernel[(progs,)](dy, x, weight if weight is not None else x, rstd, dx, dwp, rows, n, per,
                                   HAS_W=weight is not None, BLOCK=block, num_warps=_num_warps(block))
    return dx, dwp.sum(0)
