"""mamba_split_conv1d_scan_combined against its oracle (the same composition on the ops' fp32 references, the
scan a sequential recurrence), outputs and every gradient; rms_norm_gated against an explicit formula; bad
inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.ops import (
    mamba_split_conv1d_scan_combined,
    mamba_split_conv1d_scan_ref,
    rms_norm_gated,
    ssd_scan,
)

TOL = dict(rtol=2e-4, atol=2e-4)


def _inputs(batch=2, L=23, nheads=4, headdim=8, ngroups=2, dstate=6, width=4, d_mlp=0, D_hdim=False,
            rmsnorm=True, outproj=True, outproj_bias=True, initial=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    dim = nheads * headdim
    conv_dim = dim + 2 * ngroups * dstate
    args = dict(
        zxbcdt=r(batch, L, 2 * d_mlp + 2 * dim + 2 * ngroups * dstate + nheads),
        conv1d_weight=r(conv_dim, width, scale=0.5), conv1d_bias=r(conv_dim, scale=0.1),
        dt_bias=r(nheads, scale=0.5),
        A=(-torch.rand(nheads, generator=g) * 2 - 0.1).requires_grad_(),
        D=r(nheads, headdim) if D_hdim else r(nheads),
    )
    kw = dict(chunk_size=8, headdim=None if D_hdim else headdim, ngroups=ngroups)
    if rmsnorm:
        kw["rmsnorm_weight"] = (1 + 0.1 * torch.randn(dim, generator=g)).requires_grad_()
    if outproj:
        kw["outproj_weight"] = r(5, d_mlp + dim, scale=0.2)
        if outproj_bias:
            kw["outproj_bias"] = r(5, scale=0.1)
    if initial:
        kw["initial_states"] = r(batch, nheads, headdim, dstate, scale=0.3)
    return args, kw


def _run(fn, args, kw, **extra):
    a = list(args.values())
    return fn(*a[:6], kw["chunk_size"], **{k: v for k, v in kw.items() if k != "chunk_size"}, **extra)


def _grads(out, tensors):
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def _ref(args, kw, **extra):
    """The oracle takes initial_states, seq_idx and return_final_states by keyword."""
    a = list(args.values())
    rest = {k: v for k, v in kw.items() if k != "chunk_size"}
    return mamba_split_conv1d_scan_ref(*a[:6], kw["chunk_size"], **rest, **extra)


CASES = {
    "default": {},
    "no-rmsnorm": dict(rmsnorm=False),
    "norm-after-gate": dict(norm_before_gate=False),
    "D-hdim": dict(D_hdim=True),
    "one-group": dict(ngroups=1),
    "groups-eq-heads": dict(ngroups=4),
    "mlp": dict(d_mlp=6),
    "no-outproj": dict(outproj=False),
    "outproj-no-bias": dict(outproj_bias=False),
    "initial-final": dict(initial=True, return_final_states=True),
    "dt-limit": dict(dt_limit=(0.05, 0.4)),
    "no-activation": dict(activation=None),
    "L1": dict(L=1, initial=True, return_final_states=True),
    "odd-chunks": dict(L=41),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_ref_outputs_and_gradients(case):
    spec = dict(CASES[case])
    call = {k: spec.pop(k) for k in ("norm_before_gate", "return_final_states", "dt_limit", "activation")
            if k in spec}
    args, kw = _inputs(**spec)
    tensors = [t for t in list(args.values()) + list(kw.values()) if isinstance(t, torch.Tensor)]
    out = _run(mamba_split_conv1d_scan_combined, args, kw, **call)
    ref = _ref(args, kw, **call)
    if call.get("return_final_states"):
        assert isinstance(out, tuple) and len(out) == 2
        torch.testing.assert_close(out[1], ref[1], **TOL)
    else:
        assert isinstance(out, torch.Tensor)
    o, r = (out[0], ref[0]) if isinstance(out, tuple) else (out, ref)
    batch, L = args["zxbcdt"].shape[:2]
    assert o.shape == r.shape and o.shape[:2] == (batch, L)
    torch.testing.assert_close(o, r, **TOL)
    for i, (g, h) in enumerate(zip(_grads(out, tensors), _grads(ref, tensors))):
        assert (g is None) == (h is None)
        if g is not None:
            torch.testing.assert_close(g, h, **TOL, msg=f"gradient of input {i} (shape {tuple(g.shape)})")


def test_output_width_and_mlp_branch():
    args, kw = _inputs(d_mlp=6, outproj=False)
    out = _run(mamba_split_conv1d_scan_combined, args, kw)
    assert out.shape == (2, 23, 6 + 32)
    z0, x0 = args["zxbcdt"][..., :6], args["zxbcdt"][..., 6:12]
    torch.testing.assert_close(out[..., :6], F.silu(z0) * x0)


def test_without_rmsnorm_the_scan_gates_with_z():
    """rmsnorm_weight=None: out = ssd_scan(..., z) (no norm), then the projection."""
    args, kw = _inputs(rmsnorm=False, outproj=False, ngroups=1)
    out = _run(mamba_split_conv1d_scan_combined, args, kw)
    zxbcdt = args["zxbcdt"]
    z, xBC, dt = zxbcdt[..., :32], zxbcdt[..., 32:32 + 32 + 12], zxbcdt[..., -4:]
    xBC = F.silu(F.conv1d(F.pad(xBC.transpose(1, 2), (3, 0)), args["conv1d_weight"][:, None],
                          args["conv1d_bias"], groups=xBC.shape[-1])).transpose(1, 2)
    x, B, C = xBC[..., :32], xBC[..., 32:38], xBC[..., 38:]
    want = ssd_scan(x.reshape(2, 23, 4, 8), dt, args["A"], B.reshape(2, 23, 1, 6), C.reshape(2, 23, 1, 6), 8,
                    D=args["D"], z=z.reshape(2, 23, 4, 8), dt_bias=args["dt_bias"], dt_softplus=True)
    torch.testing.assert_close(out, want.reshape(2, 23, 32), **TOL)


def test_seq_idx_keeps_packed_sequences_apart():
    args, kw = _inputs(batch=1, L=20)
    seq_idx = torch.tensor([[0] * 7 + [1] * 13], dtype=torch.int32)
    packed = _run(mamba_split_conv1d_scan_combined, args, kw, seq_idx=seq_idx)
    torch.testing.assert_close(packed, _ref(args, kw, seq_idx=seq_idx), **TOL)
    for lo, hi in ((0, 7), (7, 20)):
        part = dict(args, zxbcdt=args["zxbcdt"][:, lo:hi])
        torch.testing.assert_close(packed[:, lo:hi], _run(mamba_split_conv1d_scan_combined, part, kw), **TOL)


def test_cu_seqlens_varlen_states():
    args, kw = _inputs(batch=1, L=20)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    out, states = _run(mamba_split_conv1d_scan_combined, args, kw, cu_seqlens=cu, return_varlen_states=True)
    assert states.shape == (3, 4, 8, 6)
    torch.testing.assert_close(states[1], torch.zeros_like(states[1]))
    for i, (lo, hi) in enumerate(((0, 7), (7, 20))):
        part = dict(args, zxbcdt=args["zxbcdt"][:, lo:hi])
        y, final = _run(mamba_split_conv1d_scan_combined, part, kw, return_final_states=True)
        torch.testing.assert_close(out[:, lo:hi], y, **TOL)
        torch.testing.assert_close(states[2 * i], final[0], **TOL)


def test_chunk_size_does_not_matter():
    args, kw = _inputs(L=37)
    a = _run(mamba_split_conv1d_scan_combined, args, kw)
    b = _run(mamba_split_conv1d_scan_combined, args, dict(kw, chunk_size=64))
    torch.testing.assert_close(a, b, **TOL)


# -- rms_norm_gated ---------------------------------------------------------------------------------------
def _gated_formula(x, w, z, eps, group, before):
    """mamba-ssm's RMSNormGated, written out."""
    if z is not None and not before:
        x = x * F.silu(z)
    xg = x.unflatten(-1, (-1, group))
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * w
    if z is not None and before:
        y = y * F.silu(z)
    return y


@pytest.mark.parametrize("group", [None, 4, 12])
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_rms_norm_gated_matches_formula(group, before, gated):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 12, generator=g, requires_grad=True)
    z = torch.randn(3, 5, 12, generator=g, requires_grad=True) if gated else None
    w = (1 + 0.1 * torch.randn(12, generator=g)).requires_grad_()
    out = rms_norm_gated(x, w, None, z, 1e-5, group, before)
    want = _gated_formula(x, w, z, 1e-5, group or 12, before)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    ts = [t for t in (x, z, w) if t is not None]
    for a, b in zip(torch.autograd.grad(out.square().sum(), ts), torch.autograd.grad(want.square().sum(), ts)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group", [None, 4])
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("gated", [True, False])
def test_rms_norm_gated_without_autograd(group, before, gated):
    """Under no_grad the products reuse the op's own buffers: the formula's result, the inputs untouched."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 12, generator=g)
    z = torch.randn(3, 5, 12, generator=g) if gated else None
    w, b = 1 + 0.1 * torch.randn(12, generator=g), 0.1 * torch.randn(12, generator=g)
    before_call = [t.clone() for t in (x, z, w, b) if t is not None]
    with torch.no_grad():
        out = rms_norm_gated(x, w, b, z, 1e-5, group, before)
    want = _gated_formula(x, w, None if before else z, 1e-5, group or 12, False) + b
    if gated and before:
        want = want * F.silu(z)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for t, t0 in zip([t for t in (x, z, w, b) if t is not None], before_call):
        assert torch.equal(t, t0)


def test_rms_norm_gated_bias_and_dtype():
    x = torch.randn(4, 8, dtype=torch.float16)
    w, b = torch.ones(8, dtype=torch.float16), torch.full((8,), 0.5, dtype=torch.float16)
    out = rms_norm_gated(x, w, b)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), _gated_formula(x.float(), w.float(), None, 1e-6, 8, True) + 0.5,
                               rtol=2e-3, atol=2e-3)


# -- bad input ----------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    args, kw = _inputs()
    a = list(args.values())
    with pytest.raises(ValueError, match="'headdim'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, ngroups=2)
    with pytest.raises(ValueError, match="'ngroups'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=3)
    with pytest.raises(ValueError, match="'zxbcdt'"):
        mamba_split_conv1d_scan_combined(a[0][..., 1:], *a[1:6], 8, headdim=8, ngroups=2)
    with pytest.raises(ValueError, match="'conv1d_weight'"):
        mamba_split_conv1d_scan_combined(a[0], a[1][:31], *a[2:6], 8, headdim=8, ngroups=2)
    with pytest.raises(ValueError, match="'dt_bias'"):
        mamba_split_conv1d_scan_combined(*a[:3], a[3][:3], *a[4:6], 8, headdim=8, ngroups=2)
    with pytest.raises(ValueError, match="'rmsnorm_weight'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=2, rmsnorm_weight=torch.ones(5))
    with pytest.raises(ValueError, match="'outproj_weight'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=2, outproj_weight=torch.ones(5, 7))
    with pytest.raises(ValueError, match="'outproj_bias' needs"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=2, outproj_bias=torch.ones(5))
    with pytest.raises(ValueError, match="'chunk_size'"):
        mamba_split_conv1d_scan_combined(*a[:6], 0, headdim=8, ngroups=2)
    with pytest.raises(NotImplementedError, match="'activation'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=2, activation="relu")
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        mamba_split_conv1d_scan_combined(*a[:6], 8, headdim=8, ngroups=2, cu_seqlens=torch.tensor([0, 23]))
    with pytest.raises(ValueError, match="'group_size'"):
        rms_norm_gated(torch.randn(2, 12), torch.ones(12), group_size=5)
    with pytest.raises(ValueError, match="'z'"):
        rms_norm_gated(torch.randn(2, 12), torch.ones(12), z=torch.randn(2, 6))


def test_default_dt_limit_is_unbounded():
    import inspect

    assert inspect.signature(mamba_split_conv1d_scan_combined).parameters["dt_limit"].default == (0.0, math.inf)
