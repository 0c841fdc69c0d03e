"""The causal convolution of a diagonal state space (S4D's convolution mode): ``y = K * u``.

With ``dtA`` and ``coef`` ``(H, N)`` complex (``dt * A`` and ``C * B_bar``), the kernel is
``K[h, l] = 2 Re(sum_n coef[h, n] exp(dtA[h, n] l))`` (see :func:`fastarch.ops.s4_kernel`) and

    y[b, h, l] = sum_{m <= l} K[h, l - m] u[b, h, m].

This is the S4 papers' convolution mode: the length-L kernel from the fused Vandermonde op
:func:`fastarch.ops.s4_kernel`, then a zero-padded real FFT convolution, O(H L log L), differentiable in
``u``, ``dtA`` and ``coef``. The inverse transform's 1/n is folded into the kernel's transform, and the
spectrum product is taken in place when no graph is recorded, and wide inputs go in channel groups
that fit the last-level cache.

(A chunked, semiseparable evaluation, Toeplitz diagonal blocks plus a scan over chunk states, is slower
on CPU: its batched GEMMs alone take longer than the three transforms at long lengths.)
"""

from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor, fail
from .s4_kernel import COMPLEX, s4_kernel, vandermonde_kernel_f64

__all__ = ["ssm_convolution", "ssm_convolution_ref"]

OP = "ssm_convolution"


def ssm_convolution_ref(u: torch.Tensor, dtA: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The oracle: the explicit kernel (complex128 Vandermonde) and a float64 FFT convolution; (B, H, L) fp32."""
    L = u.shape[-1]
    k = vandermonde_kernel_f64(dtA, coef, L)
    n = 2 * L
    y = torch.fft.irfft(torch.fft.rfft(u.double(), n=n) * torch.fft.rfft(k, n=n), n=n)[..., :L]
    return y.float()


def _validate(u: torch.Tensor, dtA: torch.Tensor, coef: torch.Tensor) -> None:
    check_tensor(OP, "u", u, ndim=3, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    check_tensor(OP, "dtA", dtA, ndim=2, dtypes=COMPLEX)
    check_tensor(OP, "coef", coef, ndim=2, dtypes=COMPLEX)
    check_same_device(OP, "u", u, dtA=dtA, coef=coef)
    if coef.shape != dtA.shape:
        fail(OP, f"argument 'coef' must have the shape of 'dtA' {tuple(dtA.shape)}, got {tuple(coef.shape)}")
    if u.shape[1] != dtA.shape[0]:
        fail(OP, f"argument 'u' has {u.shape[1]} channels but 'dtA' has {dtA.shape[0]}")
    if u.shape[-1] < 1:
        fail(OP, "argument 'u' must have length >= 1")


def ssm_convolution(u: torch.Tensor, dtA: torch.Tensor, coef: torch.Tensor, *,
                    backend: str | None = None) -> torch.Tensor:
    """``y = K * u`` for the diagonal SSM ``K[h, l] = 2 Re(sum_n coef[h, n] exp(dtA[h, n] l))``.

    Args:
        u: ``(B, H, L)`` real input (computed in fp32).
        dtA: ``(H, N)`` complex, ``dt * A``.
        coef: ``(H, N)`` complex, ``C * B_bar``.
        backend: forwarded to :func:`fastarch.ops.s4_kernel`.

    Returns:
        ``y`` in float32, differentiable in ``u``, ``dtA`` and ``coef``.

    Shapes:
        u, y: ``(B, H, L)``; dtA, coef: ``(H, N)``.
    """
    _validate(u, dtA, coef)
    u = u.float().contiguous()                                  # rfft is faster on contiguous rows
    H, L = u.shape[1], u.shape[2]
    # Channel groups keep each group's signal, spectra and kernel (~ 40 * L * group bytes) in the
    # last-level cache, which is faster than one pass over all channels once they no longer fit.
    n_groups = -(-H // max(1, _CACHE_BYTES // (40 * L)))
    group = -(-H // n_groups)                                   # equal groups: both threads stay busy
    if group >= H:
        return _fft_conv(u, dtA, coef, backend)
    parts = [(slice(h, h + group)) for h in range(0, H, group)]
    if torch.is_grad_enabled():
        return torch.cat([_fft_conv(u[:, p], dtA[p], coef[p], backend) for p in parts], dim=1)
    out = torch.empty_like(u)
    for p in parts:
        out[:, p] = _fft_conv(u[:, p], dtA[p], coef[p], backend)
    return out


_CACHE_BYTES = 12 << 20  # a share of the L3 that neighbours on a shared host leave free


def _fft_conv(u: torch.Tensor, dtA: torch.Tensor, coef: torch.Tensor, backend: str | None) -> torch.Tensor:
    L = u.shape[-1]
    k = s4_kernel(dtA, coef, L, backend=backend)                # (H, L) fp32
    n = 2 * L                                                   # zero-pad: linear, not circular
    k_f = torch.fft.rfft(k, n=n, norm="forward")                # carries the inverse's 1/n
    u_f = torch.fft.rfft(u, n=n)
    u_f = u_f.mul_(k_f) if not torch.is_grad_enabled() else u_f * k_f
    return torch.fft.irfft(u_f, n=n, norm="forward")[..., :L]
