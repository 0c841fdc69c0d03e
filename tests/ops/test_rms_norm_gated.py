"""rms_norm_gated: every backend against the reference and an fp64 formula, outputs and every gradient, on
strided inputs; the selector's choice; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastarch
from fastarch import backend as registry
from fastarch.backend import BackendUnavailableError
from fastarch.ops import rms_norm_gated, rms_norm_gated_ref
from fastarch.ops.rms_norm_gated import OP, _call
from tests._backends import require_backend

BACKENDS = sorted(registry.implementations(OP))
EPS = 1e-5


def _formula64(x, w, b, z, eps, group, before):
    """The formula written out in fp64: groups of ``group`` channels, gate before or after the norm."""
    x, w = x.double(), w.double()
    gate = None if z is None else F.silu(z.double())
    if gate is not None and not before:
        x = x * gate
    xg = x.unflatten(-1, (-1, group))
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * w
    if b is not None:
        y = y + b.double()
    if gate is not None and before:
        y = y * gate
    return y


def _strided(t: torch.Tensor, layout: str, pad: int = 7) -> torch.Tensor:
    """``t``'s values as a slice of a wider tensor (last dim contiguous, row stride > N) or contiguous."""
    if layout == "contiguous":
        return t
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 2 * pad, dtype=t.dtype)
    wide[..., pad:pad + t.shape[-1]] = t
    return wide[..., pad:pad + t.shape[-1]]


def _inputs(rows, n, gated, bias, dtype, layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 2 + 0.3).to(dtype)
    z = torch.randn(rows, n, generator=g).mul(2).to(dtype) if gated else None
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(dtype) if bias else None
    dy = torch.randn(rows, n, generator=g).to(dtype)
    return _strided(x, layout), None if z is None else _strided(z, layout), w, b, dy


def _leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def _check(backend, rows, n, group, before, gated, bias, dtype, layout, tol):
    x, z, w, b, dy = _inputs(rows, n, gated, bias, dtype, layout)
    xl, zl, wl, bl = _leaves(x, z, w, b)
    if layout == "strided":  # the leaves keep the row stride: the op sees a strided view
        xl = _strided(x, layout).detach().requires_grad_()
        zl = None if z is None else _strided(z, layout).detach().requires_grad_()
        assert xl.stride(0) > n and xl.stride(1) == 1
    out = rms_norm_gated(xl, wl, bl, zl, EPS, group, before, backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    ref = rms_norm_gated_ref(x, w, b, z, EPS, group, before)
    x64, z64, w64, b64 = _leaves(*(None if t is None else t.double() for t in (x, z, w, b)))
    want = _formula64(x64, w64, b64, z64, EPS, group, before)
    rtol, atol = tol
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    ts = [t for t in (xl, zl, wl, bl) if t is not None]
    ts64 = [t for t in (x64, z64, w64, b64) if t is not None]
    got = torch.autograd.grad(out, ts, dy)
    exp = torch.autograd.grad(want, ts64, dy.double())
    for name, a, e, t in zip("xzwb" if gated else "xwb", got, exp, ts):
        assert a.dtype == t.dtype and a.shape == t.shape, f"d{name}: {a.dtype}{tuple(a.shape)}"
        scale = e.abs().max().item() + 1e-6
        torch.testing.assert_close(a.double(), e, rtol=rtol, atol=atol * scale, msg=lambda m, s=name: f"d{s}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows,n", [(1, 40), (37, 36)])
@pytest.mark.parametrize("quarter", [False, True], ids=["one-group", "groups-of-n/4"])
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("gated", [True, False], ids=["z", "no-z"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", ["strided", "contiguous"])
def test_fp32_outputs_and_gradients(backend, rows, n, quarter, before, gated, bias, layout):
    require_backend(OP, backend)
    _check(backend, rows, n, n // 4 if quarter else n, before, gated, bias, torch.float32, layout, (1e-4, 1e-5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("gated", [True, False], ids=["z", "no-z"])
def test_low_precision_outputs_and_gradients(backend, dtype, before, gated):
    require_backend(OP, backend)
    tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (4e-3, 4e-3)
    _check(backend, 37, 40, 10, before, gated, True, dtype, "strided", tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("wtype", ["fp32", "same"])
@pytest.mark.parametrize("group", [2048, 256], ids=["one-group", "groups-of-256"])
@pytest.mark.parametrize("gated", [True, False], ids=["z", "no-z"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
def test_mamba_ssm_grid(backend, dtype, wtype, group, gated, bias, before):
    """mamba-ssm's gated-norm grid (d=2048, groups of 256 or one group, x in fp32/fp16/bf16 with the weight
    in fp32 or x's dtype, with and without z and bias, gate before or after the norm), on 2 x 48 rows instead of
    its 16 x 1024: outputs and every gradient against the fp64 formula."""
    require_backend(OP, backend)
    g = torch.Generator().manual_seed(0)
    n, wdt = 2048, torch.float32 if wtype == "fp32" else dtype
    x = torch.randn(2, 48, n, generator=g).to(dtype).requires_grad_()
    z = torch.randn(2, 48, n, generator=g).to(dtype).requires_grad_() if gated else None
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(wdt).requires_grad_()
    b = (0.1 * torch.randn(n, generator=g)).to(wdt).requires_grad_() if bias else None
    dy = torch.randn(2, 48, n, generator=g).to(dtype)
    out = rms_norm_gated(x, w, b, z, EPS, group, before, backend=backend)
    assert out.dtype == dtype and out.shape == x.shape
    leaves = [t for t in (x, z, w, b) if t is not None]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, rest = leaves64[0], leaves64[1:]
    z64 = rest.pop(0) if gated else None
    w64 = rest.pop(0)
    b64 = rest.pop(0) if bias else None
    want = _formula64(x64, w64, b64, z64, EPS, group, before)
    rtol, atol = {torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)
    got = torch.autograd.grad(out, leaves, dy)
    exp = torch.autograd.grad(want, leaves64, dy.double())
    for a, e, t in zip(got, exp, leaves):
        assert a.dtype == t.dtype and a.shape == t.shape
        torch.testing.assert_close(a.double(), e, rtol=rtol, atol=atol * (e.abs().max().item() + 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nd_input_and_no_autograd(backend):
    """(B, L, N) with z a slice of a wider projection, as Mamba-2 calls it; without autograd the result
    carries no graph."""
    require_backend(OP, backend)
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(2, 5, 3 * 24, generator=g)
    x, z = torch.randn(2, 5, 24, generator=g), proj[..., 24:48]
    w = torch.rand(24, generator=g) + 0.5
    with torch.no_grad():
        out = rms_norm_gated(x, w, None, z, EPS, 6, False, backend=backend)
    assert out.grad_fn is None and out.shape == x.shape
    torch.testing.assert_close(out.double(), _formula64(x, w, None, z, EPS, 6, False), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("before", [True, False], ids=["norm-then-gate", "gate-then-norm"])
def test_backends_agree_under_rms_norm_override(before):
    """The torch backend runs its RMS norm, forward and backward, on rms_norm's backends, which use_backend
    chooses."""
    x, z, w, b, dy = _inputs(9, 32, True, True, torch.float32, "strided")
    leaves = [t.detach().requires_grad_() for t in (x, z, w, b)]
    out = rms_norm_gated(leaves[0], leaves[2], leaves[3], leaves[1], EPS, 8, before, backend="cpp")
    want = (out, *torch.autograd.grad(out, leaves, dy))
    for inner in ("aten", "torch", "cpp"):
        with fastarch.use_backend(rms_norm=inner):
            out = rms_norm_gated(leaves[0], leaves[2], leaves[3], leaves[1], EPS, 8, before, backend="torch")
            got = (out, *torch.autograd.grad(out, leaves, dy))
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_selector_picks_cpp_on_cpu():
    x, z, w, _, _ = _inputs(4, 16, True, False, torch.float32, "strided")
    assert registry.select(OP, _call(x, z, 16), None).backend == "cpp"
    assert registry.select(OP, _call(x.bfloat16(), z.bfloat16(), 4), None).backend == "cpp"
    # a gate in another dtype than x: the C++ kernel refuses it, the composition takes it
    mixed = _call(x, z.double(), 16)
    assert registry.select(OP, mixed, None).backend == "torch"
    out = rms_norm_gated(x, w, None, z.bfloat16(), EPS)
    torch.testing.assert_close(out, rms_norm_gated_ref(x, w, None, z.bfloat16(), EPS))


def test_rejected_calls_raise_and_name_the_argument():
    x, z, w = torch.randn(3, 12), torch.randn(3, 12), torch.ones(12)
    with pytest.raises(ValueError, match="'group_size'"):
        rms_norm_gated(x, w, group_size=5)
    with pytest.raises(ValueError, match="'z'"):
        rms_norm_gated(x, w, z=torch.randn(3, 6))
    with pytest.raises(ValueError, match="'weight'"):
        rms_norm_gated(x, torch.ones(11))
    with pytest.raises(ValueError, match="'bias'"):
        rms_norm_gated(x, w, torch.ones(3))
    with pytest.raises(ValueError, match="'eps'"):
        rms_norm_gated(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="'x'"):
        rms_norm_gated(x.long(), w)
    with pytest.raises(BackendUnavailableError, match="z dtype bfloat16 differs"):
        rms_norm_gated(x, w, z=z.bfloat16(), backend="cpp")
    with pytest.raises(BackendUnavailableError, match="triton: no implementation of rms_norm_gated"):
        rms_norm_gated(x, w, backend="triton")


def test_cpp_kernel_rejects_bad_input_with_a_message():
    """The kernels check what the op's wrapper guarantees, and say what is wrong instead of crashing."""
    lib = require_backend(OP, "cpp").lib
    x, z, w = torch.randn(3, 12), torch.randn(3, 12), torch.ones(12)
    bad = {
        "x must have a contiguous last dimension": lambda: lib.rms_norm_gated_fwd(x.t(), None, w[:3], None, EPS, 3,
                                                                                 True),
        "z must have x's shape": lambda: lib.rms_norm_gated_fwd(x, z[:, :6], w, None, EPS, 12, True),
        "z must have x's dtype": lambda: lib.rms_norm_gated_fwd(x, z.double(), w, None, EPS, 12, True),
        "group_size must be a positive divisor": lambda: lib.rms_norm_gated_fwd(x, None, w, None, EPS, 5, True),
        "weight must have shape": lambda: lib.rms_norm_gated_fwd(x, None, w[:4], None, EPS, 12, True),
        "x must be 2-D": lambda: lib.rms_norm_gated_fwd(x[0], None, w, None, EPS, 12, True),
        "x must be float32, bfloat16 or float16": lambda: lib.rms_norm_gated_fwd(x.double(), None, w, None, EPS,
                                                                                12, True),
        "rstd must be a CPU float32 tensor of shape": lambda: lib.rms_norm_gated_bwd(
            x, x, None, w, None, torch.ones(3, 2), 12, True),
        "dy must have x's shape": lambda: lib.rms_norm_gated_bwd(x[:2], x, None, w, None, torch.ones(3, 1), 12,
                                                                 True),
    }
    for msg, fn in bad.items():
        with pytest.raises(RuntimeError, match=msg):
            fn()
