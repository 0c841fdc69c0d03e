"""mamba-ssm's own test grids (a small part, CPU) through fastarch.compat.mamba_ssm: the gated layer and RMS
norms of ``ops.triton.layernorm_gated`` against its references (transcribed), the SSD pieces of
``ops.triton.ssd_chunk_state`` / ``ssd_state_passing`` / ``ssd_chunk_scan`` / ``ssd_combined`` against each other
and the fused scan, varlen chunk states from a per-sequence recomputation, and the refusals for what is not
provided (the kernels' private helpers, ``ssd_bmm``)."""

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import fastarch.compat as compat
from fastarch.compat._missing import ModuleNotProvidedError, NotProvidedError
from fastarch.compat.mamba_ssm.ops.triton import layernorm_gated as lng
from fastarch.compat.mamba_ssm.ops.triton import (
    ssd_chunk_scan,
    ssd_chunk_state,
    ssd_combined,
    ssd_state_passing,
)


def _groups_layer_norm(x, group_size, eps):
    g = x.unflatten(-1, (-1, group_size))
    return F.layer_norm(g, (group_size,), eps=eps).flatten(-2)


# The package's grid less what it skips: without z both orders are one, and its layer-norm reference has no
# gate-first form.
LN_GRID = [(bias, z, rms, group, before) for bias in (False, True) for z in (False, True) for rms in (False, True)
           for group in (False, True) for before in (True, False) if (z or before) and (before or rms)]


@pytest.mark.parametrize("has_bias,has_z,is_rms_norm,has_group,norm_before_gate", LN_GRID)
def test_layer_norm_gated(has_bias, has_z, is_rms_norm, has_group, norm_before_gate):
    """The package's grid at d=256, batch 2 x 16 steps, fp16 inputs and fp32 weights: the error of layernorm_fn
    to the fp32 reference at most twice the error of the reference run in the inputs' precision, plus atol."""
    d, dtype, atol = 256, torch.float16, 8e-3
    group_size = 64 if has_group else None
    torch.manual_seed(0)
    x = torch.randn(2, 16, d, dtype=dtype, requires_grad=True)
    z = torch.randn(2, 16, d, dtype=dtype, requires_grad=True) if has_z else None
    weight = torch.randn(d, requires_grad=True)
    bias = torch.randn(d, requires_grad=True) if has_bias else None
    copies = [[t.detach().clone().requires_grad_() if t is not None else None for t in (x, z, weight, bias)]
              for _ in range(2)]
    (x_r, z_r, w_r, b_r), (x_p, z_p, w_p, b_p) = copies
    out = lng.layernorm_fn(x, weight, bias, z=z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate,
                           is_rms_norm=is_rms_norm)
    if is_rms_norm:
        out_ref = lng.rms_norm_ref(x_r, w_r, b_r, z=z_r, eps=1e-5, group_size=group_size,
                                   norm_before_gate=norm_before_gate)
        out_pt = lng.rms_norm_ref(x_p, w_p, b_p, z=z_p, eps=1e-5, group_size=group_size,
                                  norm_before_gate=norm_before_gate, upcast=False)
    else:
        gs = group_size or d
        out_ref = _groups_layer_norm(x_r.float(), gs, 1e-5) * w_r + (b_r if has_bias else 0)
        out_pt = _groups_layer_norm(x_p, gs, 1e-5) * w_p + (b_p if has_bias else 0)
        if has_z:
            out_ref = out_ref * F.silu(z_r.float())
            out_pt = out_pt * F.silu(z_p)
    assert out.dtype == dtype and out.shape == x.shape
    assert (out - out_ref).abs().max() <= 2 * (out_pt - out_ref).abs().max() + atol
    g = torch.randn_like(out)
    for o in (out, out_ref, out_pt):
        o.backward(g)
    pairs = [(x, x_r, x_p), (weight, w_r, w_p)] + ([(z, z_r, z_p)] if has_z else []) + \
        ([(bias, b_r, b_p)] if has_bias else [])
    for got, ref, pt in pairs:
        assert (got.grad - ref.grad).abs().max() <= 2 * (pt.grad - ref.grad).abs().max() + atol


def test_layer_norm_modules_and_refusals():
    ln, rms = lng.LayerNorm(128, group_size=32), lng.RMSNorm(128, group_size=32)
    assert sorted(ln.state_dict()) == ["bias", "weight"] and sorted(rms.state_dict()) == ["weight"]
    assert torch.equal(ln.weight, torch.ones(128)) and torch.equal(ln.bias, torch.zeros(128))
    x, z = torch.randn(3, 128), torch.randn(3, 128)
    torch.testing.assert_close(ln(x, z), _groups_layer_norm(x, 32, 1e-5) * F.silu(z))
    torch.testing.assert_close(rms(x, z), lng.rms_norm_ref(x, rms.weight, None, z, eps=1e-5, group_size=32))
    with pytest.raises(ValueError, match=r"layer_norm_gated: argument 'group_size' must be a positive int dividing "
                                         r"the last dimension 128, got 48"):
        lng.layernorm_fn(x, ln.weight, ln.bias, group_size=48)
    with pytest.raises(NotProvidedError, match=r"layernorm_gated\.nope"):
        lng.nope  # noqa: B018


def _inputs(seed, batch=2, L=37, H=4, P=8, G=2, N=16):
    torch.manual_seed(seed)
    return (torch.randn(batch, L, H, P), torch.randn(batch, L, H), -torch.rand(H), torch.randn(batch, L, G, N) / 3,
            torch.randn(batch, L, G, N) / 3, torch.randn(H), torch.randn(batch, L, H, P), torch.rand(H) - 2)


def _steps(dt, A, chunk_size, dt_bias=None, softplus=False):
    """The package's chunk cumsum: processed steps and in-chunk running sums, (batch, H, n_chunks, chunk)."""
    steps = dt.float() + (dt_bias if dt_bias is not None else 0)
    steps = F.softplus(steps) if softplus else steps
    L = steps.shape[1]
    nc = -(-L // chunk_size)
    steps = F.pad(steps, (0, 0, 0, nc * chunk_size - L)).unflatten(1, (nc, chunk_size)).permute(0, 3, 1, 2)
    return steps, torch.cumsum(steps * A[:, None, None], dim=-1)


@pytest.mark.parametrize("chunk_size", [8, 16])
@pytest.mark.parametrize("ngroups", [1, 4])
def test_ssd_pieces(chunk_size, ngroups):
    x, dt, A, B, C, D, z, dt_bias = _inputs(chunk_size, G=ngroups)
    out = ssd_combined.ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D, z, dt_bias, True)
    for other in (ssd_combined.mamba_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, True),
                  ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus=True),
                  ssd_combined.ssd_selective_scan(x, dt, A, B, C, D, z, dt_bias, True)):
        torch.testing.assert_close(other, out, rtol=1e-4, atol=1e-4)
    steps, dA_cumsum = _steps(dt, A, chunk_size, dt_bias, True)
    states = ssd_chunk_state.chunk_state(B, x, steps, dA_cumsum)
    assert states.dtype == torch.float32 and states.shape == (2, steps.shape[2], 4, 8, 16)
    torch.testing.assert_close(states, ssd_chunk_state.chunk_state_ref(B, x, steps, dA_cumsum), rtol=1e-4, atol=1e-5)
    flat = states.flatten(-2)
    init = torch.randn(2, 4, 8 * 16)
    entering, final = ssd_state_passing.state_passing(flat, dA_cumsum[..., -1], init)
    entering_ref, final_ref = ssd_state_passing.state_passing_ref(flat, dA_cumsum[..., -1], init)
    torch.testing.assert_close(entering, entering_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=1e-4, atol=1e-5)
    _, fused_final = ssd_combined.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, None, None, dt_bias,
                                                            init.unflatten(-1, (8, 16)), dt_softplus=True,
                                                            return_final_states=True)
    torch.testing.assert_close(final.unflatten(-1, (8, 16)), fused_final, rtol=1e-4, atol=1e-4)
    prev = entering.unflatten(-1, (8, 16))
    y = ssd_chunk_scan.chunk_scan(B, C, x, steps, dA_cumsum, prev, D, z)
    torch.testing.assert_close(y, ssd_chunk_scan.chunk_scan_ref(B, C, x, steps, dA_cumsum, prev, D, z),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunk_state_varlen(chunk_size):
    """The package's test at small sizes: the states entering each chunk with the sequences' restarts, then
    chunk_state_varlen, against each sequence scanned alone."""
    torch.manual_seed(chunk_size)
    seqlens = torch.randint(1, 20, (6,))
    cu = F.pad(seqlens.cumsum(0), (1, 0))
    T, H, P, G, N = int(seqlens.sum()), 4, 8, 2, 16
    x, B = torch.randn(T, H, P), torch.randn(T, G, N) / 5
    A, dt = -0.1 * torch.rand(H), F.softplus(torch.randn(T, H) - 4)
    steps, dA_cumsum = _steps(dt[None], A, chunk_size)
    entering = []  # the state entering chunk c: the scan of its sequence up to c * chunk_size - 1
    for c in range(steps.shape[2]):
        t = c * chunk_size - 1
        if t < 0:
            entering.append(torch.zeros(H, P, N))
            continue
        s = int(torch.searchsorted(cu, t, right=True)) - 1
        lo = int(cu[s])
        _, fs = ssd_combined.mamba_chunk_scan_combined(x[None, lo:t + 1], dt[None, lo:t + 1], A, B[None, lo:t + 1],
                                                       B[None, lo:t + 1], chunk_size, return_final_states=True)
        entering.append(fs[0])
    out = ssd_chunk_state.chunk_state_varlen(B, x, steps[0], dA_cumsum[0], cu, torch.stack(entering))
    want = torch.stack([ssd_combined.mamba_chunk_scan_combined(
        x[None, a:b], dt[None, a:b], A, B[None, a:b], B[None, a:b], chunk_size, return_final_states=True)[1][0]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, want, rtol=1e-2, atol=3e-3)


def test_piece_refusals():
    x, dt, A, B, C, D, z, dt_bias = _inputs(0)
    steps, dA_cumsum = _steps(dt, A, 16)
    with pytest.raises(ValueError, match=r"chunk_state: argument 'dA_cumsum' must have shape"):
        ssd_chunk_state.chunk_state(B, x, steps, dA_cumsum[..., :8])
    with pytest.raises(ValueError, match=r"chunk_state: argument 'B' must have shape \(2, 37, G, N\) with G dividing 4"):
        ssd_chunk_state.chunk_state(B[:, :, :1].expand(2, 37, 3, 16), x, steps, dA_cumsum)
    with pytest.raises(ValueError, match=r"state_passing: argument 'dA_chunk_cumsum'"):
        ssd_state_passing.state_passing(torch.zeros(2, 3, 4, 5), torch.zeros(2, 4, 2))
    with pytest.raises(NotProvidedError, match=r"ssd_chunk_state\._chunk_cumsum_fwd, an internal helper"):
        from fastarch.compat.mamba_ssm.ops.triton.ssd_chunk_state import _chunk_cumsum_fwd  # noqa: F401
    with pytest.raises(NotProvidedError, match=r"ssd_state_passing\._state_passing_fwd"):
        from fastarch.compat.mamba_ssm.ops.triton.ssd_state_passing import _state_passing_fwd  # noqa: F401


@pytest.fixture
def aliased():
    if "mamba_ssm" not in compat.install():
        compat.uninstall()
        pytest.skip("the real mamba_ssm is installed here")
    yield
    compat.uninstall()


def test_install_refuses_missing_submodules(aliased):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan  # noqa: F401
    from mamba_ssm.ops.triton.ssd_state_passing import state_passing  # noqa: F401

    with pytest.raises(ModuleNotProvidedError, match=r"No module named 'mamba_ssm\.ops\.triton\.ssd_bmm': fastarch's "
                                                     r"stand-in for 'mamba_ssm'.*it provides .*"
                                                     r"mamba_ssm\.ops\.triton\.ssd_chunk_state"):
        import mamba_ssm.ops.triton.ssd_bmm  # noqa: F401
    assert importlib.util.find_spec("mamba_ssm.ops.triton.ssd_bmm") is None  # a probe still answers None
    with pytest.raises(ModuleNotFoundError, match=r"No module named 'causal_conv1d\.cpp_functions'.*"
                                                  r"causal_conv1d\.causal_conv1d_varlen"):
        importlib.import_module("causal_conv1d.cpp_functions")
    import causal_conv1d.causal_conv1d_varlen as varlen

    assert varlen.causal_conv1d_varlen_states.__module__ == "fastarch.ops.causal_conv1d"
