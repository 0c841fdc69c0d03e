"""The ops are torch.library custom ops: torch.compile(fullgraph=True) traces them and opcheck passes."""

import pytest
import torch

import fastarch
from fastarch import ops


def _fn(x, w, b, cos, sin):
    y = ops.layer_norm(x, w, b, 1e-5)
    y = ops.rms_norm(y, w, 1e-6)
    r = ops.rotary_embedding(y.view(2, 5, 2, 8), cos, sin)
    return r.sum()


def test_compile_fullgraph_forward_and_backward():
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    cos, sin = ops.rotary_cos_sin(5, 8)
    compiled = torch.compile(_fn, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, b, cos, sin)
    gc = torch.autograd.grad(out, (x, w, b))
    ref = _fn(x, w, b, cos, sin)
    gr = torch.autograd.grad(ref, (x, w, b))
    torch.testing.assert_close(out, ref)
    for a, c in zip(gc, gr):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_compile_fullgraph_inductor_with_module():
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), fastarch.nn.FusedLayerNorm(16))
    x = torch.randn(4, 16)
    compiled = torch.compile(m, fullgraph=True)
    torch.testing.assert_close(compiled(x), m(x))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_opcheck(backend):
    x = torch.randn(3, 9, requires_grad=True)
    w = torch.randn(9, requires_grad=True)
    b = torch.randn(9, requires_grad=True)
    torch.library.opcheck(torch.ops.fastarch.layer_norm_fwd.default, (x, w, b, 1e-5, 0, backend))
    torch.library.opcheck(torch.ops.fastarch.layer_norm_fwd.default, (x, w, None, 1e-5, 3, backend))
    torch.library.opcheck(torch.ops.fastarch.rms_norm_fwd.default, (x, w, 1e-6, backend))
    cos, sin = ops.rotary_cos_sin(4, 4)
    xr = torch.randn(1, 4, 2, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.fastarch.rotary.default, (xr, cos, sin, True, False, 0, backend))
