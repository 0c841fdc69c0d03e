"""selective_scan / selective_state_update: every backend against the mamba-ssm-semantics reference."""

import pytest
import torch

from fastarch.ops.selective_scan import selective_scan, selective_scan_fn, selective_scan_ref
from fastarch.ops.selective_state_update import selective_state_update, selective_state_update_ref
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


# -- selective_state_update ---------------------------------------------------------------------------------
def make_ssu(batch, nheads, dim, N, groups, heads=True, dtype=torch.float32, flags=(True, True, True)):
    """State update inputs: heads form (nheads, dim) or, with heads=False, the 3-D form (dim channels)."""
    has_D, has_z, has_bias = flags
    hd = (nheads, dim) if heads else (dim,)
    bc = (batch, groups, N) if heads else (batch, N)
    return dict(state=torch.randn(batch, *hd, N), x=torch.randn(batch, *hd, dtype=dtype),
                dt=(torch.randn(batch, *hd) * 0.5).to(dtype), A=-(torch.rand(*hd, N) + 0.2),
                B=torch.randn(*bc, dtype=dtype), C=torch.randn(*bc, dtype=dtype),
                D=torch.randn(*hd) if has_D else None, z=torch.randn(batch, *hd, dtype=dtype) if has_z else None,
                dt_bias=torch.randn(*hd) * 0.2 if has_bias else None)


@pytest.mark.op("selective_state_update")
@pytest.mark.parametrize("form", ["no-heads", "heads-1group", "heads-2groups", "heads-4groups"])
@pytest.mark.parametrize("flags", [(True, True, True, True), (False, False, False, False), (True, False, True, False)],
                         ids=["D-z-bias-softplus", "bare", "D-bias"])
def test_state_update_matches_reference(backend, form, flags):
    groups = {"no-heads": 1, "heads-1group": 1, "heads-2groups": 2, "heads-4groups": 4}[form]
    ins = make_ssu(2, 4, 5, 3 if form != "heads-2groups" else 16, groups, heads=form != "no-heads",
                   flags=flags[:3])
    ref_state = ins["state"].clone()
    ref = selective_state_update_ref(ref_state, **{k: v for k, v in ins.items() if k != "state"},
                                     dt_softplus=flags[3])
    out = selective_state_update(**ins, dt_softplus=flags[3], backend=backend)
    assert out.shape == ins["x"].shape and out.dtype == ins["x"].dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ins["state"], ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.op("selective_state_update")
def test_state_update_fp16_and_noncontiguous_state(backend):
    ins = make_ssu(2, 2, 6, 4, 2, dtype=torch.float16)
    # A non-contiguous fp32 state (a transposed view) and an fp16 one are both updated in place.
    for state in (ins["state"].transpose(0, 1).contiguous().transpose(0, 1), ins["state"].half()):
        ref_state = state.float().clone()
        args = {k: v for k, v in ins.items() if k != "state"}
        ref = selective_state_update_ref(ref_state, **args, dt_softplus=True)
        out = selective_state_update(state, **args, dt_softplus=True, backend=backend)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state.float(), ref_state, rtol=2e-3, atol=2e-3)


@pytest.mark.op("selective_state_update")
@pytest.mark.parametrize("heads", [False, True])
def test_state_update_matches_scan_steps(backend, heads):
    batch, dim, N, L = 2, 6, 4, 5
    u, delta, A, B, C, D, z, bias = make(batch, dim, L, N, "var", "var")
    ref = selective_scan_ref(u, delta, A, B, C, D, z, bias, True)
    state = torch.zeros(batch, dim, N)
    outs = []
    for t in range(L):
        if heads:  # the same problem as 2 heads x 3 channels, one group
            st = state.view(batch, 2, 3, N)
            o = selective_state_update(st, u[:, :, t].view(batch, 2, 3), delta[:, :, t].view(batch, 2, 3),
                                       A.view(2, 3, N), B[:, None, :, t], C[:, None, :, t], D.view(2, 3),
                                       z[:, :, t].view(batch, 2, 3), bias.view(2, 3), True, backend=backend)
            outs.append(o.reshape(batch, dim))
        else:
            outs.append(selective_state_update(state, u[:, :, t], delta[:, :, t], A, B[:, :, t], C[:, :, t], D,
                                               z[:, :, t], bias, True, backend=backend))
    torch.testing.assert_close(torch.stack(outs, -1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.op("selective_state_update")
def test_state_update_validates_before_mutating(backend):
    state = torch.randn(2, 3, 4)
    before = state.clone()
    x, dt = torch.randn(2, 3), torch.rand(2, 3)
    A, B, C = -torch.rand(3, 4), torch.randn(2, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="'C'"):
        selective_state_update(state, x, dt, A, B, torch.randn(2, 5), backend=backend)
    with pytest.raises(ValueError, match="'dt_bias'"):
        selective_state_update(state, x, dt, A, B, C, dt_bias=torch.randn(4), backend=backend)
    with pytest.raises(ValueError, match="'z'"):
        selective_state_update(state, x, dt, A, B, C, z=torch.randn(3, 3), backend=backend)
    with pytest.raises(NotImplementedError, match="complex"):
        selective_state_update(state, x, dt, A.to(torch.complex64), B, C, backend=backend)
    with pytest.raises(TypeError, match="'x'"):
        selective_state_update(state, x.long(), dt, A, B, C, backend=backend)
    st4 = state.view(2, 1, 3, 4)
    with pytest.raises(ValueError, match="groups"):  # 2 groups do not divide 1 head
        selective_state_update(st4, x[:, None], dt[:, None], A[None], torch.randn(2, 2, 4), torch.randn(2, 1, 4),
                               backend=backend)
    assert torch.equal(state, before)
    out = selective_state_update(state, x, dt, A, B, C, backend=backend)
    ref_state = before.clone()
    ref = selective_state_update_ref(ref_state, x, dt, A, B, C)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(state, ref_state)
    assert not torch.equal(state, before)
