"""layer_norm and rms_norm: every backend against the fp32 reference, outputs and gradients."""

import pytest
import torch

import fastarch
from fastarch import ops
from fastarch.backend import BackendUnavailableError
from tests._tolerance import assert_fa_close

WIDTHS = [1, 7, 1000, 4097]
MODES = [(False, True), (True, False)]  # torch.nn.LayerNorm; the guide's unbiased std with eps outside


def _inputs(rows, n, dtype, affine=True):
    x = (torch.randn(rows, n) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(n) * 0.5 + 1).to(dtype).requires_grad_() if affine else None
    b = (torch.randn(n) * 0.1).to(dtype).requires_grad_() if affine else None
    return x, w, b


def _grads(y, tensors, dy):
    ts = [t for t in tensors if t is not None]
    return torch.autograd.grad(y, ts, dy)


# the unbiased std of one element is undefined (NaN in torch too): that pair is left out
@pytest.mark.op("layer_norm")
@pytest.mark.parametrize("n,mode", [(n, m) for n in WIDTHS for m in MODES if not (n == 1 and m[0])])
def test_layer_norm_fp32(backend, n, mode):
    rows = 3 if n > 1000 else 13
    x, w, b = _inputs(rows, n, torch.float32)
    kw = dict(unbiased=mode[0], eps_inside_sqrt=mode[1])
    if backend == "aten" and (mode[0] or not mode[1]):  # aten declares only torch.nn.LayerNorm's mode
        with pytest.raises(BackendUnavailableError, match="aten"):
            ops.layer_norm(x, w, b, 1e-5, backend=backend, **kw)
        return
    ref = ops.layer_norm_ref(x, w, b, 1e-5, **kw)
    dy = torch.randn_like(ref)
    gref = _grads(ref, (x, w, b), dy)
    y = ops.layer_norm(x, w, b, 1e-5, backend=backend, **kw)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)
    with torch.no_grad():  # no gradient recorded: the implementation's output-only path
        torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5, backend=backend, **kw), ref, atol=2e-5, rtol=1e-5)
    # n == 1: dx is exactly 0, but rstd = 1/sqrt(eps) ~ 316 amplifies the rounding of g - mean(g)
    atol = 5e-4 if n > 1000 else 2e-4 if n == 1 else 5e-5
    for g, r in zip(_grads(y, (x, w, b), dy), gref):
        torch.testing.assert_close(g, r, atol=atol, rtol=1e-4)


@pytest.mark.op("layer_norm")
@pytest.mark.parametrize("n", [7, 1000])
def test_layer_norm_fp16(backend, n):
    x, w, b = _inputs(16, n, torch.float16)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    ref32 = ops.layer_norm_ref(x32, w32, b32, 1e-5)
    dy = torch.randn_like(ref32)
    g32 = _grads(ref32, (x32, w32, b32), dy)
    # PyTorch's own fp16 computation is the yardstick.
    xt, wt, bt = (t.detach().clone().requires_grad_() for t in (x, w, b))
    yt = torch.nn.functional.layer_norm(xt, (n,), wt, bt, 1e-5)
    gt = _grads(yt, (xt, wt, bt), dy.half())
    y = ops.layer_norm(x, w, b, 1e-5, backend=backend)
    assert y.dtype == torch.float16
    assert_fa_close(y, ref32, yt, 2, 1e-3)
    for g, r, t, name in zip(_grads(y, (x, w, b), dy.half()), g32, gt, "xwb"):
        assert_fa_close(g, r, t, 3, 1e-3, what=f"d{name}")


@pytest.mark.op("layer_norm")
def test_layer_norm_no_affine_and_nd(backend):
    x = torch.randn(2, 3, 5, 33, requires_grad=True)
    y = ops.layer_norm(x, None, None, 1e-5, backend=backend)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (33,), eps=1e-5), atol=2e-5, rtol=1e-5)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x)
    (gr,) = torch.autograd.grad(torch.nn.functional.layer_norm(x, (33,), eps=1e-5).pow(2).sum(), x)
    torch.testing.assert_close(g, gr, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the output-only path keeps the N-d shape too
        y0 = ops.layer_norm(x, None, None, 1e-5, backend=backend)
    assert y0.shape == x.shape
    torch.testing.assert_close(y0, y.detach(), atol=2e-5, rtol=1e-5)


@pytest.mark.op("rms_norm")
@pytest.mark.parametrize("n", WIDTHS)
def test_rms_norm_fp32(backend, n):
    x, w, _ = _inputs(3 if n > 1000 else 11, n, torch.float32)
    ref = ops.rms_norm_ref(x, w, 1e-6)
    dy = torch.randn_like(ref)
    gref = _grads(ref, (x, w), dy)
    y = ops.rms_norm(x, w, 1e-6, backend=backend)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-5)
    for g, r in zip(_grads(y, (x, w), dy), gref):
        torch.testing.assert_close(g, r, atol=5e-4 if n > 1000 else 5e-5, rtol=1e-4)


@pytest.mark.op("rms_norm")
def test_rms_norm_fp16(backend):
    x, w, _ = _inputs(16, 257, torch.float16)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, w))
    ref32 = ops.rms_norm_ref(x32, w32)
    dy = torch.randn_like(ref32)
    g32 = _grads(ref32, (x32, w32), dy)
    xt, wt = (t.detach().clone().requires_grad_() for t in (x, w))
    yt = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-6) * wt  # composed fp16 PyTorch
    gt = _grads(yt, (xt, wt), dy.half())
    y = ops.rms_norm(x, w, backend=backend)
    assert_fa_close(y, ref32, yt, 2, 1e-3)
    for g, r, t in zip(_grads(y, (x, w), dy.half()), g32, gt):
        assert_fa_close(g, r, t, 3, 1e-3, what="grad")


def test_layer_norm_rejects_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="normalized shape"):
        ops.layer_norm(x, torch.ones(7), None)
    with pytest.raises(TypeError, match="'weight' must have dtype"):
        ops.layer_norm(x, torch.ones(8, dtype=torch.float64), None)
    with pytest.raises(TypeError, match="'weight' has dtype float16 but 'x' has float32"):
        ops.layer_norm(x, torch.ones(8, dtype=torch.float16), None)
    with pytest.raises(TypeError, match="dtype"):
        ops.layer_norm(torch.ones(4, 8, dtype=torch.int64), None, None)
    with pytest.raises(ValueError, match="'bias' is on meta"):
        ops.layer_norm(x, torch.ones(8), torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match="eps"):
        ops.layer_norm(x, None, None, eps=-1.0)
    with pytest.raises(ValueError, match="normalized shape"):
        ops.rms_norm(x, torch.ones(9))
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.rms_norm([1.0, 2.0])


def test_forced_backend_that_cannot_run_raises():
    with pytest.raises(BackendUnavailableError) as info:
        ops.layer_norm(torch.randn(2, 4), backend="cuda")
    msg = str(info.value)
    assert "layer_norm" in msg and "'cuda'" in msg
    for name in ("triton", "cuda", "cpp", "torch"):
        assert f"  {name}:" in msg
    # A forced backend named through the context manager is honoured too.
    with fastarch.use_backend(layer_norm="cuda"), pytest.raises(BackendUnavailableError):
        ops.layer_norm(torch.randn(2, 4))
