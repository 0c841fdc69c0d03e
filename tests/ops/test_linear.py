"""linear: every backend against the fp32 reference, outputs and gradients; the selection of the C++
kernel for a few rows; the inference path without the custom op; argument errors."""

import importlib

import pytest
import torch

from fastarch import backend as registry
from fastarch import ops
from fastarch.backend import BackendUnavailableError
from fastarch.nn import Linear
from fastarch.ops.linear import CPP_MAX_ROWS, uses_onednn
from fastarch.ops.linear import _call as call

linear_module = importlib.import_module("fastarch.ops.linear")  # the module (fastarch.ops.linear is the function)

# (leading dims of x, in_features, out_features): a decode row, odd widths that leave a tail after the
# vector loop and a partial tile of output rows, the row limit of the C++ kernel, a batch over it.
SHAPES = [((1,), 768, 2304), ((2, 1), 13, 7), ((3,), 1, 5), ((CPP_MAX_ROWS,), 33, 17), ((4, 5), 40, 9),
          ((1,), 4096, 3)]


@pytest.mark.op("linear")
@pytest.mark.parametrize("lead,K,N", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(backend, lead, K, N, bias):
    g = torch.Generator().manual_seed(K * 31 + N)
    x = torch.randn(*lead, K, generator=g).requires_grad_()
    w = (torch.randn(N, K, generator=g) * K**-0.5).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_() if bias else None
    rows = x.numel() // K
    if backend == "cpp" and rows > CPP_MAX_ROWS:
        with pytest.raises(BackendUnavailableError, match="rows"):
            ops.linear(x, w, b, backend=backend)
        return
    leaves = [t for t in (x, w, b) if t is not None]
    ref = ops.linear_ref(x, w, b)
    dy = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, leaves, dy)
    out = ops.linear(x, w, b, backend=backend)
    assert out.shape == (*lead, N)
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out, leaves, dy), gref):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # the inference path (no custom op) gives the same values
        torch.testing.assert_close(ops.linear(x, w, b, backend=backend), out.detach())


def test_linear_selection_cpp_for_few_rows_aten_beyond():
    w = torch.randn(8, 6)
    assert registry.select("linear", call(torch.randn(1, 6), w)).backend == "cpp"
    assert registry.select("linear", call(torch.randn(CPP_MAX_ROWS, 6), w)).backend == "cpp"
    assert registry.select("linear", call(torch.randn(CPP_MAX_ROWS + 1, 6), w)).backend == "aten"
    assert registry.select("linear", call(torch.randn(1, 6), torch.randn(6, 8).t())).backend == "aten"
    assert registry.select("linear", call(torch.randn(1, 6, dtype=torch.float64), w.double())).backend == "aten"


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch.backends.mkldnn.flags
def test_linear_aten_runs_onednn_for_fp32_cpu(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(3, 37, 96, generator=g), torch.randn(40, 96, generator=g) * 0.1, torch.randn(40, generator=g)
    if not torch.backends.mkldnn.is_available():  # a PyTorch build without oneDNN: the aten backend is F.linear
        assert linear_module._ONEDNN_LINEAR is None and not uses_onednn(x.reshape(-1, 96), w)
        torch.testing.assert_close(ops.linear(x, w, b, backend="aten"), torch.nn.functional.linear(x, w, b),
                                   rtol=0, atol=0)
        return
    assert linear_module._ONEDNN_LINEAR is not None, "PyTorch has oneDNN but fastarch did not find its linear op"
    calls = []
    real = linear_module._ONEDNN_LINEAR
    monkeypatch.setattr(linear_module, "_ONEDNN_LINEAR", lambda *a: calls.append(a[0].shape) or real(*a))
    out = ops.linear(x, w, b, backend="aten")
    assert calls == [(3 * 37, 96)]
    torch.testing.assert_close(out, ops.linear_ref(x, w, b))
    rows = x.reshape(-1, 96)
    assert uses_onednn(rows, w)
    assert not uses_onednn(rows.double(), w.double())
    assert not uses_onednn(rows.bfloat16(), w.bfloat16())
    assert not uses_onednn(rows, w.t().contiguous().t())
    with torch.backends.mkldnn.flags(enabled=False):  # the user's switch is honoured: F.linear, bit for bit
        assert not uses_onednn(rows, w)
        torch.testing.assert_close(ops.linear(x, w, b, backend="aten"), torch.nn.functional.linear(x, w, b),
                                   rtol=0, atol=0)
    assert len(calls) == 1
    # The backward's two products run on oneDNN too; the expanded gradient of a sum() gives the same result.
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    dy = torch.randn(3, 37, 40, generator=g)
    got = torch.autograd.grad(ops.linear(xg, wg, bg, backend="aten"), (xg, wg, bg), dy)
    assert calls == [(3 * 37, 96)] * 2 + [(3 * 37, 40), (40, 3 * 37)]
    want = torch.autograd.grad(ops.linear_ref(xg, wg, bg), (xg, wg, bg), dy)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    got = torch.autograd.grad(ops.linear(xg, wg, bg, backend="aten").sum(), (xg, wg, bg))
    want = torch.autograd.grad(ops.linear_ref(xg, wg, bg).sum(), (xg, wg, bg))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_linear_float64_as_nn_linear():
    x, w, b = torch.randn(2, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64), torch.randn(3).double()
    torch.testing.assert_close(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_linear_cpp_refuses_a_strided_weight():
    w = torch.randn(6, 8).t()
    x = torch.randn(1, 6)
    with pytest.raises(BackendUnavailableError, match="contiguous"):
        ops.linear(x, w, backend="cpp")
    torch.testing.assert_close(ops.linear(x, w), ops.linear_ref(x, w))


def test_linear_empty():
    assert ops.linear(torch.randn(0, 4), torch.randn(3, 4)).shape == (0, 3)
    assert ops.linear(torch.randn(2, 4), torch.randn(0, 4)).shape == (2, 0)


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 4), torch.randn(3, 5)), "argument 'weight' must be \\(out_features, 4\\)"),
    ((torch.randn(2, 4), torch.randn(3)), "argument 'weight'"),
    ((torch.randn(2, 4), torch.randn(3, 4), torch.randn(2)), "argument 'bias' must be \\(3,\\)"),
    ((torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64)), "dtype"),
    (([1.0, 2.0], torch.randn(3, 2)), "argument 'x' must be a torch.Tensor"),
])
def test_linear_bad_arguments(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.linear(*args)


def test_linear_module_is_nn_linear_on_the_op():
    torch.manual_seed(0)
    ref = torch.nn.Linear(10, 6)
    mod = Linear(10, 6)
    mod.load_state_dict(ref.state_dict())
    assert isinstance(mod, torch.nn.Linear) and list(mod.state_dict()) == ["weight", "bias"]
    x = torch.randn(1, 1, 10)
    with torch.no_grad():
        torch.testing.assert_close(mod(x), ref(x))
    x = torch.randn(20, 10, requires_grad=True)
    mod(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(mod.weight.grad, ref.weight.grad)


@pytest.mark.op("linear")
@pytest.mark.parametrize("grad", [False, True])
def test_linear_strided_bias(backend, grad):
    """A strided bias (every other element of a buffer) is valid input: the cpp kernel refused it and oneDNN
    read it as contiguous memory (wrong values)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 16, generator=g).requires_grad_(grad)
    w = torch.randn(5, 16, generator=g).requires_grad_(grad)
    buf = torch.randn(10, generator=g).requires_grad_(grad)
    b = buf[::2]
    assert not b.is_contiguous()
    ref = ops.linear_ref(x, w, b.contiguous())
    out = ops.linear(x, w, b, backend=backend)
    torch.testing.assert_close(out, ref)
    if grad:
        dy = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (x, w, buf), dy)
        want = torch.autograd.grad(ref, (x, w, buf), dy)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e)
