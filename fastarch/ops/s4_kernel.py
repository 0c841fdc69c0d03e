"""S4D convolution-kernel generation: a fused Vandermonde product.

For a diagonal state space with (discretised) log-transition ``dtA`` (``(H, N)`` complex, ``dt * A``) and
coefficients ``coef = C * B_bar`` (``(H, N)`` complex), the length-L convolution kernel is

    K[h, l] = 2 * Re( sum_n coef[h, n] * exp(dtA[h, n] * l) ),   l = 0 .. L-1

(the factor 2 with ``Re`` accounts for the complex-conjugate half of the spectrum that S4D leaves out).
The naive form builds the ``(H, N, L)`` Vandermonde matrix; the kernels here never store it:

- ``cpp``: with ``l = 64 b + t``, ``z^l = z^(64 b) z^t``; double-precision tables of block starts
  (times ``coef``) and in-block powers turn the sum over states into one batched GEMM,
  ``(H, L/64, 2N) @ (H, 2N, 64)``;
- ``triton``: one program per (channel, block of positions) evaluates its tile with exp/sin/cos and
  reduces over the state in registers;
- ``torch``: the same in chunks of positions, (H, N, chunk) at a time.

Backward (same fusions): ``dcoef`` and ``d dtA`` are weighted sums over l of ``z^l`` and ``l z^l``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend import register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward

__all__ = ["s4_kernel", "s4_kernel_ref"]

OP = "s4_kernel"
COMPLEX = (torch.complex64, torch.complex128)


def vandermonde_kernel_f64(dtA: torch.Tensor, coef: torch.Tensor, L: int) -> torch.Tensor:
    """The explicit (H, N, L) Vandermonde matrix in complex128, reduced: (H, L) float64."""
    pos = torch.arange(L, device=dtA.device, dtype=torch.float64)
    vand = torch.exp(dtA.to(torch.complex128).unsqueeze(-1) * pos)           # (H, N, L)
    return 2 * torch.einsum("hn,hnl->hl", coef.to(torch.complex128), vand).real


def s4_kernel_ref(dtA: torch.Tensor, coef: torch.Tensor, L: int) -> torch.Tensor:
    """The oracle: the explicit (H, N, L) Vandermonde matrix in complex128; returns (H, L) float32."""
    return vandermonde_kernel_f64(dtA, coef, L).float()


def _validate(dtA: torch.Tensor, coef: torch.Tensor, L: int) -> None:
    check_tensor(OP, "dtA", dtA, ndim=2, dtypes=COMPLEX)
    check_tensor(OP, "coef", coef, ndim=2, dtypes=COMPLEX)
    check_same_device(OP, "dtA", dtA, coef=coef)
    if coef.shape != dtA.shape:
        fail(OP, f"argument 'coef' must have the shape of 'dtA' {tuple(dtA.shape)}, got {tuple(coef.shape)}")
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        fail(OP, f"argument 'L' must be a positive int, got {L!r}")


@torch.library.custom_op("fastarch::s4_kernel_fwd", mutates_args=())
def _s4_kernel_fwd(ar: torch.Tensor, ai: torch.Tensor, wr: torch.Tensor, wi: torch.Tensor, L: int,
                   backend: str) -> torch.Tensor:
    h, n = ar.shape
    args = [t.float().contiguous() for t in (ar, ai, wr, wi)]
    return run(OP, "forward", call_of(args[0], n=n, L=L), backend, *args, L)


@_s4_kernel_fwd.register_fake
def _(ar, ai, wr, wi, L, backend):
    return ar.new_empty(ar.shape[0], L, dtype=torch.float32)


@torch.library.custom_op("fastarch::s4_kernel_bwd", mutates_args=())
def _s4_kernel_bwd(dk: torch.Tensor, ar: torch.Tensor, ai: torch.Tensor, wr: torch.Tensor, wi: torch.Tensor,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h, n = ar.shape
    args = [t.float().contiguous() for t in (ar, ai, wr, wi)]
    grads = run_backward(OP, call_of(args[0], n=n, L=dk.shape[-1]), backend, dk.float().contiguous(), *args)
    return tuple(g.contiguous() for g in grads)


@_s4_kernel_bwd.register_fake
def _(dk, ar, ai, wr, wi, backend):
    return tuple(t.new_empty(t.shape, dtype=torch.float32) for t in (ar, ai, wr, wi))  # contiguous


def _setup_context(ctx, inputs, output) -> None:
    ar, ai, wr, wi, L, backend = inputs
    ctx.save_for_backward(ar, ai, wr, wi)
    ctx.backend = backend


def _backward(ctx, dk):
    ar, ai, wr, wi = ctx.saved_tensors
    dar, dai, dwr, dwi = _s4_kernel_bwd(dk, ar, ai, wr, wi, ctx.backend)
    return dar.to(ar.dtype), dai.to(ai.dtype), dwr.to(wr.dtype), dwi.to(wi.dtype), None, None


_s4_kernel_fwd.register_autograd(_backward, setup_context=_setup_context)


def s4_kernel(dtA: torch.Tensor, coef: torch.Tensor, L: int, backend: str | None = None) -> torch.Tensor:
    """The S4D convolution kernel ``K[h, l] = 2 Re(sum_n coef[h, n] exp(dtA[h, n] l))``.

    Args:
        dtA: ``(H, N)`` complex, ``dt * A`` (real part < 0 for a stable system).
        coef: ``(H, N)`` complex, ``C * B_bar`` (ZOH: ``B_bar = (exp(dtA) - 1) / A * B``).
        L: kernel length.
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The kernel in float32, differentiable in ``dtA`` and ``coef``.

    Shapes:
        dtA, coef: ``(H, N)``; output: ``(H, L)``.
    """
    _validate(dtA, coef, L)
    name = resolve(OP, lambda: call_of(dtA.real, n=dtA.shape[1], L=L), backend)
    return _s4_kernel_fwd(dtA.real, dtA.imag, coef.real, coef.imag, int(L), name)


# -- backends ---------------------------------------------------------------------------------------------
_TORCH_CHUNK = 256


class TorchS4Kernel(TorchImplementation):
    op = OP
    description = "PyTorch, (H, N, 256) Vandermonde tiles at a time, fp32"

    def forward(self, ar, ai, wr, wi, L):
        h = ar.shape[0]
        out = torch.empty(h, L, dtype=torch.float32, device=ar.device)
        for s in range(0, L, _TORCH_CHUNK):
            pos = torch.arange(s, min(s + _TORCH_CHUNK, L), device=ar.device, dtype=torch.float32)
            mag = torch.exp(ar.unsqueeze(-1) * pos)
            ph = ai.unsqueeze(-1) * pos
            out[:, s:s + pos.numel()] = 2 * (mag * (wr.unsqueeze(-1) * torch.cos(ph)
                                                    - wi.unsqueeze(-1) * torch.sin(ph))).sum(1)
        return out

    def backward(self, dk, ar, ai, wr, wi):
        s0r, s0i, s1r, s1i = (torch.zeros_like(ar) for _ in range(4))
        L = dk.shape[-1]
        for s in range(0, L, _TORCH_CHUNK):
            pos = torch.arange(s, min(s + _TORCH_CHUNK, L), device=ar.device, dtype=torch.float32)
            mag = torch.exp(ar.unsqueeze(-1) * pos)
            ph = ai.unsqueeze(-1) * pos
            zr, zi = mag * torch.cos(ph), mag * torch.sin(ph)
            g = dk[:, None, s:s + pos.numel()]
            s0r += (g * zr).sum(-1)
            s0i += (g * zi).sum(-1)
            s1r += (g * pos * zr).sum(-1)
            s1i += (g * pos * zi).sum(-1)
        return _grads_from_sums(s0r, s0i, s1r, s1i, wr, wi)


def _grads_from_sums(s0r, s0i, s1r, s1i, wr, wi):
    """(d ar, d ai, d wr, d wi) from S0 = sum_l g z^l and S1 = sum_l g l z^l (real and imaginary parts)."""
    return (2 * (wr * s1r - wi * s1i), -2 * (wr * s1i + wi * s1r), 2 * s0r, -2 * s0i)


class _CompiledS4Kernel:
    """Shared glue: the C++ extension and the Triton module expose ``s4_kernel_fwd``/``s4_kernel_bwd_sums``
    alike."""

    lib: Any

    def forward(self, ar, ai, wr, wi, L):
        return self.lib.s4_kernel_fwd(ar, ai, wr, wi, L)

    def backward(self, dk, ar, ai, wr, wi):
        s0r, s0i, s1r, s1i = self.lib.s4_kernel_bwd_sums(dk, ar, ai)
        return _grads_from_sums(s0r, s0i, s1r, s1i, wr, wi)


class CppS4Kernel(CppImplementation, _CompiledS4Kernel):
    op, extension = OP, "s4"
    description = "C++ blocked Vandermonde: double-precision power tables + one batched GEMM (H, L/64, 2N) x (2N, 64)"


class TritonS4Kernel(TritonImplementation, _CompiledS4Kernel):
    op, kernel_module = OP, "s4"
    description = "Triton fused Vandermonde tiles (exp/sin/cos in registers)"


for _impl in (TorchS4Kernel, CppS4Kernel, TritonS4Kernel):
    register(_impl)
