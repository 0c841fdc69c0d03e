"""s4_kernel: every backend against the (H, N, L) Vandermonde oracle, outputs and gradients; bad inputs."""

import math

import pytest
import torch

from fastarch.ops.s4_kernel import _s4_kernel_fwd, s4_kernel, s4_kernel_ref
from tests._backends import require_backend

pytestmark = pytest.mark.op("s4_kernel")


def _system(h, n, dt_min=1e-3, dt_max=1e-1):
    dt = torch.exp(torch.rand(h, 1) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    a = torch.complex(-0.5 - torch.rand(h, n), math.pi * torch.arange(n, dtype=torch.float32).expand(h, n))
    return (a * dt).contiguous(), torch.randn(h, n, dtype=torch.complex64)


def _grads(fn, dta, coef, g):
    a = dta.detach().clone().requires_grad_()
    c = coef.detach().clone().requires_grad_()
    k = fn(a, c)
    k.backward(g)
    return k.detach(), a.grad, c.grad


@pytest.mark.parametrize("h,n,L", [(1, 1, 1), (3, 5, 97), (4, 32, 1023), (2, 17, 4096)])
def test_matches_vandermonde_oracle(backend, h, n, L):
    if backend == "triton" and L > 1023:
        L = 300  # interpreter speed
    dta, coef = _system(h, n)
    g = torch.randn(h, L)
    k, da, dc = _grads(lambda a, c: s4_kernel(a, c, L, backend=backend), dta, coef, g)
    rk, rda, rdc = _grads(lambda a, c: s4_kernel_ref(a, c, L), dta.to(torch.complex128),
                          coef.to(torch.complex128), g)
    scale = rk.abs().max().item()
    torch.testing.assert_close(k, rk, rtol=0, atol=2e-5 * scale + 1e-6)
    for name, x, r in (("dtA", da, rda), ("coef", dc, rdc)):
        r = r.to(torch.complex64)
        tol = 2e-5 * r.abs().max().item() + 1e-6
        torch.testing.assert_close(x, r, rtol=0, atol=tol, msg=f"d{name} ({backend})")


def test_long_kernel_stays_accurate_in_cpp():
    # Block starts in double: no drift over 16k positions even for slowly decaying, fast rotating modes.
    require_backend("s4_kernel", "cpp")
    dta = torch.complex(torch.full((2, 4), -1e-4), torch.tensor([[0.3, 1.1, 2.9, 0.01]] * 2))
    coef = torch.randn(2, 4, dtype=torch.complex64)
    L = 16384
    k = s4_kernel(dta, coef, L, backend="cpp")
    torch.testing.assert_close(k, s4_kernel_ref(dta, coef, L), rtol=0, atol=5e-5 * coef.abs().sum().item())


def test_fast_decaying_modes_underflow_cleanly(backend):
    # Modes that decay below fp32's range within a block or two (the cpp tables flush them to zero).
    dta = torch.complex(-torch.logspace(-4, 2, 12).reshape(2, 6), torch.rand(2, 6) * 3).contiguous()
    coef = torch.randn(2, 6, dtype=torch.complex64)
    L, g = 700, torch.randn(2, 700)
    k, da, dc = _grads(lambda a, c: s4_kernel(a, c, L, backend=backend), dta, coef, g)
    rk, rda, rdc = _grads(lambda a, c: s4_kernel_ref(a, c, L), dta.to(torch.complex128),
                          coef.to(torch.complex128), g)
    torch.testing.assert_close(k, rk, rtol=0, atol=2e-5 * rk.abs().max().item())
    for x, r in ((da, rda), (dc, rdc)):
        r = r.to(torch.complex64)
        torch.testing.assert_close(x, r, rtol=0, atol=1e-4 * r.abs().max().item() + 1e-6)


def test_opcheck():
    dta, coef = _system(2, 3)
    args = (dta.real.contiguous().requires_grad_(), dta.imag.contiguous().requires_grad_(),
            coef.real.contiguous().requires_grad_(), coef.imag.contiguous().requires_grad_(), 20, "torch")
    torch.library.opcheck(_s4_kernel_fwd, args)


def test_bad_inputs():
    dta, coef = _system(2, 3)
    with pytest.raises(TypeError, match="'dtA' must have dtype in"):
        s4_kernel(dta.real, coef, 10)
    with pytest.raises(ValueError, match="'coef' must have the shape of 'dtA'"):
        s4_kernel(dta, coef[:, :2], 10)
    with pytest.raises(ValueError, match="'L' must be a positive int"):
        s4_kernel(dta, coef, 0)
    with pytest.raises(ValueError, match="'dtA' must have 2 dimensions"):
        s4_kernel(dta[0], coef[0], 10)
