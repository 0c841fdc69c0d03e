"""fastarch.compat.mamba_ssm: mamba-ssm's signatures and module paths; its selective-scan test grid through
``selective_scan_fn`` and its mamba_inner grid (``mamba_inner_fn`` against ``mamba_inner_ref``, forward and
backward, with checkpoint levels and the B/C/dt RMS-norm weights), on every backend, subsampled
deterministically per backend."""

import inspect
import itertools
import random

import pytest
import torch

import fastarch.ops as ops
from fastarch.backend import use_backend
from fastarch.compat import mamba_ssm
from fastarch.compat.mamba_ssm.ops import selective_scan_interface as iface
from fastarch.compat.mamba_ssm.ops.triton import selective_state_update as ssu
from tests._backends import require_backend
from tests._inplace import assert_bits_equal, bits, nan_poisoned

BACKENDS = ["torch", "cpp", "triton"]
E = inspect.Parameter.empty


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signatures_and_paths():
    assert _params(iface.selective_scan_fn) == _params(iface.selective_scan_ref) == [
        ("u", E), ("delta", E), ("A", E), ("B", E), ("C", E), ("D", None), ("z", None), ("delta_bias", None),
        ("delta_softplus", False), ("return_last_state", False)]
    inner = [("xz", E), ("conv1d_weight", E), ("conv1d_bias", E), ("x_proj_weight", E), ("delta_proj_weight", E),
             ("out_proj_weight", E), ("out_proj_bias", E), ("A", E), ("B", None), ("C", None), ("D", None),
             ("delta_bias", None), ("B_proj_bias", None), ("C_proj_bias", None), ("delta_softplus", True)]
    rms = [("b_rms_weight", None), ("c_rms_weight", None), ("dt_rms_weight", None), ("b_c_dt_rms_eps", 1e-6)]
    assert _params(iface.mamba_inner_fn) == inner + [("checkpoint_lvl", 1)] + rms
    assert _params(iface.mamba_inner_ref) == inner + rms
    assert _params(ssu.selective_state_update)[:11] == [
        ("state", E), ("x", E), ("dt", E), ("A", E), ("B", E), ("C", E), ("D", None), ("z", None),
        ("dt_bias", None), ("dt_softplus", False), ("state_batch_indices", None)]
    assert mamba_ssm.selective_scan_fn is iface.selective_scan_fn is ops.selective_scan_fn
    assert mamba_ssm.mamba_inner_fn is iface.mamba_inner_fn
    assert ssu.selective_state_update is ops.selective_state_update


# -- mamba-ssm's selective-scan grid --------------------------------------------------------------------------
# Gradients are compared up to GRAD_MAX_LEN: beyond it the reference's backward (autograd through a Python loop
# over L) costs minutes; the chunked backends' chunk boundaries (every 64 steps) are all crossed by then.
GRAD_MAX_LEN = 1134
SCAN_SEQLENS = [1, 2, 8, 16, 32, 64, 128, 256, 372, 512, 784, 1024, 1134, 2048, 4096]
SCAN_REST = list(itertools.product(
    [torch.float32, torch.float16, torch.bfloat16],  # itype
    [False, True], [False, True], [False, True],  # return_last_state, has_delta_bias, delta_softplus
    [False, True], [False, True],  # has_z, has_D
    [1, 2], [False, True], [False, True]))  # varBC_groups, is_variable_B, is_variable_C
TOL = {torch.float32: (6e-4, 2e-3), torch.float16: (3e-3, 5e-3), torch.bfloat16: (3e-2, 5e-2)}


def _scan_grid(backend):
    per_len, max_len = {"cpp": 2, "torch": 1, "triton": 2}[backend], {"cpp": 4096, "torch": 256, "triton": 64}[backend]
    rng = random.Random(f"scan-{backend}")
    rest = [r for r in SCAN_REST if not (backend == "triton" and r[0] == torch.bfloat16)]  # interpreter: no bf16
    rest = [r for r in rest if not (r[6] == 2 and not (r[7] or r[8]))]  # groups only matter for variable B/C
    return [(L, *r) for L in SCAN_SEQLENS if L <= max_len for r in rng.sample(rest, per_len)]


@pytest.mark.parametrize("backend,seqlen,itype,return_last_state,has_delta_bias,delta_softplus,has_z,has_D,"
                         "groups,var_B,var_C", [(b, *c) for b in BACKENDS for c in _scan_grid(b)])
def test_selective_scan_grid(backend, seqlen, itype, return_last_state, has_delta_bias, delta_softplus, has_z,
                             has_D, groups, var_B, var_C):
    batch, dim, dstate = 2, 4, 8
    gen = torch.Generator().manual_seed(seqlen)
    r = lambda *s, dtype=itype: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731

    def bc():
        if not (var_B or var_C):
            return r(dim, dstate, dtype=torch.float32)
        return r(batch, dstate, seqlen) if groups == 1 else r(batch, groups, dstate, seqlen)

    A = -0.5 * torch.rand(dim, dstate, generator=gen)
    B = bc() if var_B else r(dim, dstate, dtype=torch.float32)
    C = bc() if var_C else r(dim, dstate, dtype=torch.float32)
    inputs = [r(batch, dim, seqlen), (0.5 * torch.rand(batch, dim, seqlen, generator=gen)).to(itype), A, B, C,
              r(dim, dtype=torch.float32) if has_D else None, r(batch, dim, seqlen) if has_z else None,
              0.5 * torch.rand(dim, generator=gen) if has_delta_bias else None]
    leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    ref_leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
    with use_backend(backend):
        res = iface.selective_scan_fn(*leaves, delta_softplus, return_last_state)
    with torch.set_grad_enabled(seqlen <= GRAD_MAX_LEN):
        ref = iface.selective_scan_ref(*ref_leaves, delta_softplus, return_last_state)
    out, rout = (res[0], ref[0]) if return_last_state else (res, ref)
    rtol, atol = TOL[itype]
    assert out.dtype == itype
    torch.testing.assert_close(out, rout, rtol=rtol, atol=atol)
    if return_last_state:
        torch.testing.assert_close(res[1], ref[1], rtol=rtol, atol=atol)
    if seqlen > GRAD_MAX_LEN:
        return
    g = torch.randn(out.shape, generator=gen).to(itype)
    used = [i for i, t in enumerate(leaves) if t is not None]
    grads = torch.autograd.grad(out, [leaves[i] for i in used], g)
    rgrads = torch.autograd.grad(rout, [ref_leaves[i] for i in used], g)
    for i, gr, rr in zip(used, grads, rgrads):
        scale = max(rr.abs().max().item(), 1.0)  # A, B, C, D, delta_bias: sums over batch x L
        torch.testing.assert_close(gr.float(), rr.float(), rtol=rtol * 5, atol=atol * 5 * scale,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


# -- mamba_inner ------------------------------------------------------------------------------------------
INNER = list(itertools.product([9, 37, 128], [False, True], [False, True], [0, 1], [False, True], [False, True]))


def _inner_grid(backend):
    rng = random.Random(f"inner-{backend}")
    return rng.sample(INNER, {"cpp": 16, "torch": 6, "triton": 4}[backend])


@pytest.mark.parametrize("backend,seqlen,var_B,var_C,checkpoint_lvl,rms,biases",
                         [(b, *c) for b in BACKENDS for c in _inner_grid(b)])
def test_mamba_inner(backend, seqlen, var_B, var_C, checkpoint_lvl, rms, biases):
    batch, d_model, d_inner, dstate, rank, width = 2, 6, 8, 4, 3, 4
    seqlen = min(seqlen, 37) if backend == "triton" else seqlen
    gen = torch.Generator().manual_seed(seqlen)

    def t(*shape, scale=0.5):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    args = dict(xz=t(batch, 2 * d_inner, seqlen, scale=1.0), conv1d_weight=t(d_inner, 1, width),
                conv1d_bias=t(d_inner) if biases else None, x_proj_weight=t(rank + 2 * dstate, d_inner),
                delta_proj_weight=t(d_inner, rank), out_proj_weight=t(d_model, d_inner),
                out_proj_bias=t(d_model) if biases else None,
                A=(-torch.rand(d_inner, dstate, generator=gen) - 0.5).requires_grad_(), D=t(d_inner),
                delta_bias=t(d_inner))
    args["B"] = None if var_B else t(d_inner, dstate)
    args["C"] = None if var_C else t(batch, dstate, seqlen)
    if biases:
        args["B_proj_bias"], args["C_proj_bias"] = t(dstate), t(dstate)
    if rms:
        args.update(b_rms_weight=t(dstate) + 1, c_rms_weight=t(dstate) + 1, dt_rms_weight=t(d_inner) + 1)
        args = {k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    names = [k for k, v in args.items() if isinstance(v, torch.Tensor)]
    ref = iface.mamba_inner_ref(**args)
    with use_backend(backend):
        out = iface.mamba_inner_fn(**args, checkpoint_lvl=checkpoint_lvl)
    assert out.shape == (batch, seqlen, d_model)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    rgrads = torch.autograd.grad(ref, [args[k] for k in names], g, allow_unused=True)
    with use_backend(backend):
        grads = torch.autograd.grad(out, [args[k] for k in names], g, allow_unused=True)
    for name, gr, rr in zip(names, grads, rgrads):
        assert (gr is None) == (rr is None), name
        if rr is not None:
            scale = max(rr.abs().max().item(), 1.0)
            torch.testing.assert_close(gr, rr, rtol=1e-3, atol=1e-4 * scale, msg=lambda m, n=name: f"d{n}: {m}")


def test_mamba_inner_rejects_bad_checkpoint_lvl():
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        iface.mamba_inner_fn(torch.randn(1, 4, 3), torch.randn(2, 1, 4), None, torch.randn(5, 2), torch.randn(2, 1),
                             torch.randn(3, 2), None, -torch.rand(2, 2), checkpoint_lvl=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["x_float64", "indices_repeat", "indices_range", "groups", "expanded_state"])
def test_selective_state_update_rejection_keeps_state_bits(backend, bad):
    """A refused mamba_ssm selective_state_update leaves the state bit-identical (NaN payloads included)."""
    require_backend("selective_state_update", backend)
    g = torch.Generator().manual_seed(12)
    B, H, P, N = 2, 4, 8, 16
    state = nan_poisoned(torch.randn(B, H, P, N, generator=g))
    kw = dict(x=torch.randn(B, H, P, generator=g), dt=torch.rand(B, H, P, generator=g),
              A=-torch.rand(H, P, N, generator=g), B=torch.randn(B, 1, N, generator=g),
              C=torch.randn(B, 1, N, generator=g), dt_softplus=True)
    target = state
    if bad == "x_float64":
        kw["x"] = kw["x"].double()
    elif bad == "indices_repeat":
        kw["state_batch_indices"] = torch.tensor([0, 0])
    elif bad == "indices_range":
        kw["state_batch_indices"] = torch.tensor([0, 2])
    elif bad == "groups":
        kw["B"] = torch.randn(B, 3, N)
    else:
        state = state[:1].expand(B, H, P, N)
    before = bits(target)
    with use_backend(backend), pytest.raises((ValueError, TypeError, IndexError)):
        ssu.selective_state_update(state, **kw)
    assert_bits_equal(before, target, "state")
