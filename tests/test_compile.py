"""The ops are torch.library custom ops: torch.compile(fullgraph=True) traces them and opcheck passes."""

import pytest
import torch

import fastarch
from fastarch import backend as B
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


@pytest.mark.parametrize("backend", ["torch", "cpp", "aten"])
def test_opcheck(backend):
    x = torch.randn(3, 9, requires_grad=True)
    w = torch.randn(9, requires_grad=True)
    b = torch.randn(9, requires_grad=True)
    torch.library.opcheck(torch.ops.fastarch.layer_norm_fwd.default, (x, w, b, 1e-5, 0, backend))
    if backend != "aten":  # aten has the standard mode only
        torch.library.opcheck(torch.ops.fastarch.layer_norm_fwd.default, (x, w, None, 1e-5, 3, backend))
    torch.library.opcheck(torch.ops.fastarch.rms_norm_fwd.default, (x, w, 1e-6, backend))
    if backend != "aten":  # rotary has no native kernel
        cos, sin = ops.rotary_cos_sin(4, 4)
        xr = torch.randn(1, 4, 2, 8, requires_grad=True)
        torch.library.opcheck(torch.ops.fastarch.rotary.default, (xr, cos, sin, True, False, 0, backend))


# -- every CPU backend of the Mamba ops: opcheck and torch.compile(fullgraph=True) forward + backward -------
def _cpu_backends(op):
    call = B.Call(torch.device("cpu"), torch.float32, {})
    return [name for name, impl in B.implementations(op).items() if not impl.not_supported_reasons(call)]


def _scan_inputs():
    u = torch.randn(2, 4, 70, requires_grad=True)
    delta = (0.5 * torch.rand(2, 4, 70)).requires_grad_()
    A = (-torch.rand(4, 3)).requires_grad_()
    Bm, C = torch.randn(2, 3, 70, requires_grad=True), torch.randn(2, 1, 3, 70, requires_grad=True)
    D, z, db = torch.randn(4, requires_grad=True), torch.randn(2, 4, 70, requires_grad=True), torch.rand(4)
    return u, delta, A, Bm, C, D, z, db.requires_grad_()


def _grads_close(f_compiled, f_eager, inputs):
    out_c, out_e = f_compiled(*inputs), f_eager(*inputs)
    torch.testing.assert_close(out_c, out_e)
    g = torch.randn_like(out_e)
    want = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for a, b in zip(torch.autograd.grad(out_c, want, g), torch.autograd.grad(out_e, want, g)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", _cpu_backends("selective_scan"))
def test_selective_scan_opcheck_and_compile(backend):
    args = _scan_inputs()
    torch.library.opcheck(torch.ops.fastarch.selective_scan_fwd.default, (*args, True, True, backend))

    def f(*a):
        return ops.selective_scan(*a, delta_softplus=True, backend=backend)

    _grads_close(torch.compile(f, fullgraph=True, backend="aot_eager"), f, args)


@pytest.mark.parametrize("backend", _cpu_backends("causal_conv1d"))
def test_causal_conv1d_opcheck_and_compile(backend):
    x = torch.randn(2, 6, 37, requires_grad=True)
    w, b = torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.fastarch.causal_conv1d_fwd.default, (x, w, b, None, None, True, backend))
    torch.library.opcheck(torch.ops.fastarch.causal_conv1d_fwd.default, (x, w, None, None, None, False, backend))

    def f(x, w, b):
        return ops.causal_conv1d(x, w, b, "silu", backend=backend)

    _grads_close(torch.compile(f, fullgraph=True, backend="aot_eager"), f, (x, w, b))


@pytest.mark.parametrize("backend", _cpu_backends("selective_state_update"))
def test_selective_state_update_opcheck_and_compile(backend):
    def inputs():
        g = torch.Generator().manual_seed(1)
        state = torch.randn(2, 4, 8, 3, generator=g)
        x, dt, z = (torch.randn(2, 4, 8, generator=g) for _ in range(3))
        A = -torch.rand(4, 8, 3, generator=g)
        Bm, C = torch.randn(2, 2, 3, generator=g), torch.randn(2, 2, 3, generator=g)
        D, dt_bias = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        return state, x, dt, A, Bm, C, D, z, dt_bias

    torch.library.opcheck(torch.ops.fastarch.selective_state_update.default, (*inputs(), True, None, backend))

    def f(*a):
        return ops.selective_state_update(*a, dt_softplus=True, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a_c, a_e = inputs(), inputs()
    torch.testing.assert_close(compiled(*a_c), f(*a_e))
    torch.testing.assert_close(a_c[0], a_e[0])  # the state is updated in place under compile too


@pytest.mark.parametrize("causal", [False, True])
def test_aten_attention_opcheck_and_compile(causal):
    q = torch.randn(1, 4, 9, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 16, requires_grad=True) for _ in range(2))
    wr = 0 if causal else -1
    torch.library.opcheck(torch.ops.fastarch.attention_fwd.default,
                          (q, k, v, None, None, None, None, -1, wr, 0.0, 0, 0.25, 0.0, "aten"))

    def f(q, k, v):
        o, lse = ops.attention(q, k, v, causal=causal, return_lse=True, backend="aten")
        return o + lse[..., None]

    _grads_close(torch.compile(f, fullgraph=True, backend="aot_eager"), f, (q, k, v))
