"""selective_scan: every backend against the mamba-ssm-semantics reference."""

import pytest
import torch

from fastarch.ops.selective_scan import selective_scan, selective_scan_fn, selective_scan_ref
from tests._tolerance import assert_fa_close

pytestmark = pytest.mark.op("selective_scan")
NAMES = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]


def make(batch, dim, L, N, bform, cform, groups=1, has_D=True, has_z=True, has_bias=True, dtype=torch.float32):
    """u/delta/z/variable B,C in ``dtype``; A, D, delta_bias and constant B/C in fp32 (mamba's weights)."""
    def bc(form):
        if form == "const":
            return torch.randn(dim, N)
        if form == "var":
            return torch.randn(batch, N, L, dtype=dtype)
        return torch.randn(batch, groups, N, L, dtype=dtype)

    u = torch.randn(batch, dim, L, dtype=dtype)
    delta = (torch.randn(batch, dim, L) * 0.5).to(dtype)
    A = -(torch.rand(dim, N) + 0.2)
    return [u, delta, A, bc(bform), bc(cform), torch.randn(dim) if has_D else None,
            torch.randn(batch, dim, L, dtype=dtype) if has_z else None,
            torch.randn(dim) * 0.2 if has_bias else None]


def run(inputs, backend, softplus, need_grad=True, seed=1):
    xs = [None if t is None else t.clone().requires_grad_(need_grad) for t in inputs]
    if backend == "ref":
        xs32 = [None if t is None else t.float() for t in xs]
        out, last = selective_scan_ref(*xs32, delta_softplus=softplus, return_last_state=True)
    else:
        out, last = selective_scan(*xs, delta_softplus=softplus, return_last_state=True, backend=backend)
    if not need_grad:
        return out, last, []
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g)
    gl = torch.randn(last.shape, generator=g)
    ((out.float() * go).sum() + (last * gl).sum()).backward()
    return out, last, [None if t is None else t.grad for t in xs]


_REF_CACHE: dict = {}


def run_ref(inputs, softplus):
    """The reference's outputs and gradients, computed once per distinct problem: the backends of one
    parametrised test see identical inputs (tests/conftest.py seeds every test the same way)."""
    key = (tuple(None if t is None else (tuple(t.shape), t.dtype, tuple(t.flatten()[:4].tolist())) for t in inputs),
           softplus)
    hit = _REF_CACHE.get(key)
    if hit is None or not all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                              for a, b in zip(hit[0], inputs)):
        hit = _REF_CACHE[key] = ([None if t is None else t.clone() for t in inputs], run(inputs, "ref", softplus))
    return hit[1]


def check_close(inputs, backend, softplus, rtol=2e-5, atol=2e-5):
    out, last, grads = run(inputs, backend, softplus)
    rout, rlast, rgrads = run_ref(inputs, softplus)
    torch.testing.assert_close(out.float(), rout, rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    torch.testing.assert_close(last, rlast, rtol=rtol, atol=atol, msg=lambda m: f"last_state: {m}")
    for name, g, r in zip(NAMES, grads, rgrads):
        if r is None:
            assert g is None
            continue
        scale = max(r.abs().max().item(), 1.0)  # sums over L of products: compare relative to the magnitude
        torch.testing.assert_close(g.float(), r.float(), rtol=rtol * 10, atol=atol * 10 * scale,
                                   msg=lambda m, name=name: f"grad {name}: {m}")


FORMS = [("const", "const"), ("var", "var"), ("grouped", "grouped"), ("const", "var"), ("var", "grouped"),
         ("grouped", "const")]
FULL, BARE = (True, True, True, True), (False, False, False, False)  # D, z, delta_bias, softplus
# cpp: every B/C form with and without D/z/delta_bias/softplus. torch (a slow Python loop): every form with
# all features, two bare. triton (the interpreter is slow): each form of B and of C at least once, both flag
# sets, on a shorter L.
MATRIX = ([("cpp", f, fl) for f in FORMS for fl in (FULL, BARE)]
          + [("torch", f, FULL) for f in FORMS] + [("torch", f, BARE) for f in (FORMS[0], FORMS[4])]
          + [("triton", FORMS[0], FULL), ("triton", FORMS[4], BARE), ("triton", FORMS[5], FULL)])


@pytest.mark.parametrize("backend,forms,flags", MATRIX,
                         ids=[f"{b}-{f[0]}-{f[1]}-{'full' if fl[0] else 'bare'}" for b, f, fl in MATRIX])
def test_matches_reference(backend, forms, flags):
    has_D, has_z, has_bias, softplus = flags
    inputs = make(2, 6, 37 if backend != "triton" else 11, 3, *forms, groups=3, has_D=has_D, has_z=has_z,
                  has_bias=has_bias)
    check_close(inputs, backend, softplus)


# Odd shapes (batch, D, L, N): L in {1, 7, 37, 257, 2049}, N in {1, 3, 16}, D in {1, 5, 64}; the longest
# only on cpp (the reference loop is the slow side); L=66 crosses a checkpoint (CHUNK=64) on triton.
ODD = [("cpp", (1, 1, 1, 1)), ("cpp", (2, 5, 7, 3)), ("cpp", (1, 64, 37, 16)), ("cpp", (2, 5, 257, 16)),
       ("cpp", (1, 1, 2049, 3)), ("torch", (1, 1, 1, 1)), ("torch", (1, 64, 37, 16)), ("torch", (2, 5, 257, 16)),
       ("triton", (1, 1, 1, 1)), ("triton", (1, 64, 7, 16)), ("triton", (1, 1, 66, 1))]


@pytest.mark.parametrize("backend,shape", ODD, ids=[f"{b}-{'x'.join(map(str, s))}" for b, s in ODD])
def test_odd_shapes(backend, shape):
    batch, dim, L, N = shape
    forms = ("grouped", "var") if backend == "triton" else ("var", "const")
    inputs = make(batch, dim, L, N, *forms, groups=1, has_bias=True)
    check_close(inputs, backend, True, rtol=5e-5, atol=5e-5)


def test_fp16_inputs_fp32_weights(backend):
    inputs = make(2, 8, 33 if backend != "triton" else 11, 4, "var", "var", dtype=torch.float16)
    out, last, grads = run(inputs, backend, True)
    ref16, rlast16, rgrads16 = run(inputs, "torch", True) if backend != "torch" else (out, last, grads)
    up = [None if t is None else t.float() for t in inputs]
    ref32, rlast32, rgrads32 = run(up, "ref", True)
    assert out.dtype == torch.float16
    if backend == "torch":  # PyTorch's own fp16 baseline is itself: check it against fp32 directly
        torch.testing.assert_close(out.float(), ref32, rtol=2e-3, atol=2e-3)
    assert_fa_close(out, ref32, ref16, 2.0, what="out")
    assert_fa_close(last, rlast32, rlast16, 2.0, atol=1e-4, what="last_state")
    for name, g, g16, g32 in zip(NAMES, grads, rgrads16, rgrads32):
        if g32 is not None:
            assert g.dtype == inputs[NAMES.index(name)].dtype
            if backend == "torch":
                scale = max(g32.abs().max().item(), 1.0)
                torch.testing.assert_close(g.float(), g32, rtol=2e-3, atol=2e-3 * scale)
            assert_fa_close(g, g32, g16, 3.0, atol=1e-3 * max(g32.abs().max().item(), 1), what=f"grad {name}")


def test_return_values_and_alias():
    u, delta, A, B, C, D, z, bias = make(1, 4, 10, 2, "var", "var")
    out = selective_scan(u, delta, A, B, C, D, z, bias, True, backend="cpp")
    assert isinstance(out, torch.Tensor) and out.shape == u.shape
    out2, last = selective_scan_fn(u, delta, A, B, C, D, z, bias, True, True)
    torch.testing.assert_close(out2, out)
    assert last.shape == (1, 4, 2) and last.dtype == torch.float32


def test_backends_agree_on_checkpoints():
    # The checkpoint format is shared: a cpp forward's checkpoints drive the torch/triton forward's shapes.
    from fastarch.ops.selective_scan import CppSelectiveScan, TorchSelectiveScan

    inputs = make(1, 3, 150, 4, "var", "var")
    _, _, ck1 = TorchSelectiveScan().forward(*inputs, True, True)
    _, _, ck2 = CppSelectiveScan().forward(*inputs, True, True)
    assert ck1.shape == ck2.shape == (1, 3, 3, 4)
    torch.testing.assert_close(ck1, ck2, rtol=1e-5, atol=1e-5)


def test_errors():
    u, delta, A, B, C, D, z, bias = make(2, 4, 5, 3, "var", "var")
    with pytest.raises(NotImplementedError, match="complex"):
        selective_scan(u, delta, A.to(torch.complex64), B, C)
    with pytest.raises(ValueError, match="'delta'"):
        selective_scan(u, delta[:, :, :4], A, B, C)
    with pytest.raises(ValueError, match="'A'"):
        selective_scan(u, delta, A[:3], B, C)
    with pytest.raises(ValueError, match="'B'"):
        selective_scan(u, delta, A, B[:, :2], C)
    with pytest.raises(ValueError, match="groups"):
        selective_scan(u, delta, A, torch.randn(2, 3, 3, 5), C)
    with pytest.raises(ValueError, match="'C'"):
        selective_scan(u, delta, A, B, torch.randn(4, 2))
    with pytest.raises(ValueError, match="'D'"):
        selective_scan(u, delta, A, B, C, D=torch.randn(5))
    with pytest.raises(ValueError, match="'z'"):
        selective_scan(u, delta, A, B, C, z=z[:1])
    with pytest.raises(TypeError, match="'u'"):
        selective_scan(u.long(), delta, A, B, C)
    with pytest.raises(ValueError, match="'u'"):
        selective_scan(u[0], delta, A, B, C)


def test_bench_guide_loop_computes_the_same_scan():
    """The bench's ``guide`` provider (the guide's MambaBlock.selective_scan loop with its softplus, D skip and
    gate) does the work of the op it is compared with."""
    from fastarch.bench.suites.selective_scan import guide_scan

    inputs = make(2, 5, 19, 4, "var", "var")
    want = selective_scan_ref(*inputs, delta_softplus=True)
    torch.testing.assert_close(guide_scan(*inputs), want, rtol=1e-5, atol=1e-5)
