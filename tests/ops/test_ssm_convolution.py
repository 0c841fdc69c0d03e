"""ssm_convolution (S4D convolution mode): outputs and gradients against the float64 oracle; bad inputs."""

import math
import sys

import pytest
import torch

from fastarch.ops import ssm_convolution, ssm_convolution_ref


def _system(h, n):
    dt = torch.exp(torch.rand(h, 1) * math.log(100) + math.log(1e-3))
    a = torch.complex(-0.5 - torch.rand(h, n), math.pi * torch.arange(n, dtype=torch.float32).expand(h, n))
    return (a * dt).contiguous(), torch.randn(h, n, dtype=torch.complex64)


@pytest.mark.op("s4_kernel")  # the convolution's kernel is s4_kernel's
@pytest.mark.parametrize("b,h,n,L", [(1, 1, 1, 1), (2, 3, 4, 63), (1, 4, 16, 1000), (2, 2, 8, 4100)])
def test_matches_oracle_with_gradients(backend, b, h, n, L):
    if backend == "triton" and L > 1000:
        L = 300  # kept small under the Triton interpreter
    torch.manual_seed(L)
    dta, coef = _system(h, n)
    u = torch.randn(b, h, L)
    g = torch.randn(b, h, L)
    outs = []
    for fn, dtype in ((lambda *a: ssm_convolution(*a, backend=backend), torch.float32),
                      (ssm_convolution_ref, torch.float64)):
        cdtype = torch.complex128 if dtype == torch.float64 else torch.complex64
        leaves = [x.detach().to(t).requires_grad_() for x, t in ((u, dtype), (dta, cdtype), (coef, cdtype))]
        y = fn(*leaves)
        y.backward(g.to(y.dtype))
        outs.append([y.detach()] + [x.grad for x in leaves])
    for name, x, r in zip(("y", "du", "d dtA", "d coef"), outs[0], outs[1]):
        r = r.to(x.dtype)
        torch.testing.assert_close(x, r, rtol=0, atol=1e-4 * r.abs().max().item() + 1e-6, msg=name)


@pytest.mark.parametrize("grad", [False, True])
def test_channel_groups_equal_one_pass(monkeypatch, grad):
    mod = sys.modules["fastarch.ops.ssm_convolution"]  # the package attribute is the function

    dta, coef = _system(7, 4)
    u = torch.randn(2, 7, 300)
    whole = ssm_convolution(u, dta, coef)
    monkeypatch.setattr(mod, "_CACHE_BYTES", 40 * 300 * 3)  # groups of 3 channels: 3 + 3 + 1
    with torch.set_grad_enabled(grad):
        grouped = ssm_convolution(u, dta, coef)
    torch.testing.assert_close(grouped.detach(), whole.detach())


def test_no_grad_path_equals_grad_path():
    dta, coef = _system(3, 8)
    u = torch.randn(2, 3, 500)
    with torch.no_grad():
        a = ssm_convolution(u, dta, coef)
    torch.testing.assert_close(a, ssm_convolution(u, dta, coef).detach())


def test_bad_inputs():
    dta, coef = _system(3, 4)
    with pytest.raises(ValueError, match="channels"):
        ssm_convolution(torch.randn(1, 2, 10), dta, coef)
    with pytest.raises(ValueError, match="shape"):
        ssm_convolution(torch.randn(1, 3, 10), dta, coef[:, :2])
    with pytest.raises(ValueError, match="u"):
        ssm_convolution(torch.randn(3, 10), dta, coef)
    with pytest.raises((TypeError, ValueError), match="dtA"):
        ssm_convolution(torch.randn(1, 3, 10), dta.real, coef)
