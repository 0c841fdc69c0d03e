"""mamba-ssm's Mamba-3 entry points on fastarch (``mamba3_siso_combined``, ``mamba3_siso_step``,
``mamba3_mimo``, ``Mamba3``): mamba-ssm's own kernel tests, transcribed at CPU sizes, against the transcribed
references."""

from __future__ import annotations

import copy

import pytest
import torch

from fastarch.compat.mamba_ssm.ops.tilelang.mamba3.mamba3_mimo import mamba3_mimo
from fastarch.compat.mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
from fastarch.compat.mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step
from tests.ops._mamba3_peer import peer_mimo_chunk_ref, peer_siso_fwd_ref, peer_siso_step_ref
from tests.ops.test_mamba3 import make

NAMES = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z")


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("nheads_qk", [1, 2])
def test_siso_combined_two_passes_with_state_passing_fwd_bwd(nheads_qk):
    """mamba-ssm's test_mamba3_siso_combined_batched: two calls passing the states equal one reference pass,
    forward, final states and every gradient (output and final states both carry a gradient)."""
    x, st, _ = make(batch=2, L=23, H=4, G=nheads_qk, N=16, P=8, dtype=torch.float32, seed=2)
    inputs = {**{k: x[k].clone().requires_grad_() for k in NAMES}, "states": tuple(s.clone().requires_grad_()
                                                                                  for s in st)}
    ref_in = copy.deepcopy(inputs)
    out_ref, fin_ref = peer_siso_fwd_ref(*(ref_in[k] for k in NAMES), states=ref_in["states"])
    half = 11

    def part(k, sl):
        t = inputs[k]
        return t[:, :, sl] if k in ("ADT", "DT", "Trap") else t if k in ("Q_bias", "K_bias", "D") else t[:, sl]

    first = mamba3_siso_combined(*(part(k, slice(0, half)) for k in NAMES), Input_States=inputs["states"],
                                 chunk_size=4, return_final_states=True)
    second = mamba3_siso_combined(*(part(k, slice(half, None)) for k in NAMES), Input_States=tuple(first[1:]),
                                  chunk_size=4, return_final_states=True)
    out = torch.cat([first[0], second[0]], 1)
    assert _rel(out, out_ref) < 1e-4
    for a, r in zip(second[2:], fin_ref[1:]):
        assert _rel(a, r) < 1e-4
    g = torch.Generator().manual_seed(0)
    douts = [torch.randn(t.shape, generator=g) for t in (out_ref, *fin_ref)]
    torch.autograd.backward([out_ref, *fin_ref], douts)
    torch.autograd.backward([out, *second[1:]], douts)
    for k in NAMES:
        assert _rel(inputs[k].grad, ref_in[k].grad) < 1e-3, k
    for a, r in zip(inputs["states"], ref_in["states"]):
        assert _rel(a.grad, r.grad) < 1e-3


def test_siso_step_matches_step_reference():
    """mamba-ssm's test_mamba3_siso_step: stepping token by token equals its recurrent reference."""
    x, st, _ = make(batch=3, L=9, H=4, G=4, N=16, P=8, dtype=torch.float32, seed=4)
    states, outs = st, []
    for t in range(9):
        one = {k: (x[k][:, :, t] if k in ("ADT", "DT", "Trap") else x[k] if k in ("Q_bias", "K_bias", "D")
                   else x[k][:, t]) for k in NAMES}
        o, states = mamba3_siso_step(*(one[k] for k in NAMES), Input_States=states)
        outs.append(o)
    ref, ref_states = peer_siso_step_ref(*(x[k] for k in NAMES), states=st)
    assert _rel(torch.stack(outs, 1), ref) < 1e-4
    for a, r in zip(states[1:], ref_states[1:]):
        assert _rel(a, r) < 1e-4
    o, fresh = mamba3_siso_step(*(x[k][:, 0] if k not in ("ADT", "DT", "Trap", "Q_bias", "K_bias", "D") else
                                  x[k][:, :, 0] if k in ("ADT", "DT", "Trap") else x[k] for k in NAMES))
    assert o.shape == (3, 4, 8) and fresh[1].shape == (3, 4, 8, 16)


def test_siso_combined_varlen_empty_sequences_keep_initial_states():
    """mamba-ssm's test_mamba3_siso_combined_varlen_empty_final_states_preserve_initial."""
    lengths = [0, 3, 0, 2, 0]
    cu = torch.tensor([0, 0, 3, 3, 5, 5], dtype=torch.int32)
    x, _, _ = make(batch=1, L=sum(lengths), H=4, G=2, N=16, P=8, has_D=False, has_Z=False, dtype=torch.float32)
    _, st, _ = make(batch=len(lengths), L=1, H=4, G=2, N=16, P=8, seed=9)
    _, angle, ssm, k, v = mamba3_siso_combined(*(x[k] for k in NAMES), Input_States=st, chunk_size=64,
                                               return_final_states=True, cu_seqlens=cu)
    empty = torch.tensor([0, 2, 4])
    for a, s in zip((angle, ssm, k, v), st):
        torch.testing.assert_close(a[empty], s[empty], rtol=0, atol=0)
    torch.testing.assert_close(v[1], x["V"][0, 2], rtol=0, atol=0)
    torch.testing.assert_close(v[3], x["V"][0, 4], rtol=0, atol=0)


@pytest.mark.parametrize("N,P,R,chunk_size,divisor", [(16, 8, 4, 8, 4), (32, 8, 2, 16, 4), (16, 8, 1, 16, 2)])
def test_mimo_matches_chunk_reference(N, P, R, chunk_size, divisor):
    """mamba-ssm's MIMO case grid (N, P, R, chunk) at CPU sizes against its chunked reference."""
    x, _, kw = make(batch=2, L=32, H=4, G=1, N=N, P=P, S_a=N // divisor, R=R, states=False, dtype=torch.float32)
    out, angle, ssm, k, v = mamba3_mimo(x["Q"], x["K"], x["V"], x["ADT"], x["DT"], x["Trap"], x["Q_bias"],
                                        x["K_bias"], kw["mimo_v"], kw["mimo_z"], kw["mimo_o"], x["Angles"], x["D"],
                                        x["Z"], chunk_size, divisor, torch.bfloat16, return_state=True)
    ref = peer_mimo_chunk_ref(*(x[k] for k in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles")),
                              kw["mimo_v"], kw["mimo_o"], x["D"], x["Z"], kw["mimo_z"], chunk_size, divisor)
    assert _rel(out, ref) < 1e-4
    assert ssm.shape == (2, 4, P, N) and k.shape == (2, R, 4, N) and v.shape == (2, 4, P)
    with pytest.raises(ValueError, match="'Angles'"):
        mamba3_mimo(x["Q"], x["K"], x["V"], x["ADT"], x["DT"], x["Trap"], x["Q_bias"], x["K_bias"], kw["mimo_v"],
                    kw["mimo_z"], kw["mimo_o"], x["Angles"], x["D"], x["Z"], chunk_size, 6 - divisor, torch.float32)


def test_install_exposes_mamba3_paths():
    import fastarch.compat as compat
    from fastarch.nn import Mamba3

    try:
        if "mamba_ssm" not in compat.install():
            pytest.skip("the real mamba_ssm is installed here; install() never shadows it")
        import mamba_ssm.modules.mamba3 as mod
        from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined as f

        assert mod.Mamba3 is Mamba3 and f is mamba3_siso_combined
    finally:
        compat.uninstall()
