"""selective_state_update: every backend against the reference on a transcription of mamba-ssm's test grids
(no-heads and heads forms, dstate 16/32/64, z, groups, tied head dims passed as stride-0 expansions,
state_batch_indices with padding rows), every argument form mamba-ssm accepts, agreement with the selective
scan step by step, and validation before the state is written."""

import itertools
import random

import pytest
import torch

from fastarch.ops.selective_scan import selective_scan_ref
from fastarch.ops.selective_state_update import selective_state_update, selective_state_update_ref

SSU_BACKENDS = ["torch", "cpp", "triton"]
TOL = {torch.float32: (3e-5, 3e-5), torch.float16: (5e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}


def _run_both(backend, state, dt_softplus=True, **args):
    """The backend's output and new state next to the reference's, from the same inputs."""
    ref_state = state.clone()
    ref = selective_state_update_ref(ref_state, **args, dt_softplus=dt_softplus)
    out = selective_state_update(state, **args, dt_softplus=dt_softplus, backend=backend)
    return out, state, ref, ref_state


# -- the no-heads grid: dim (and dim + 16) x dstate x z x dtype -----------------------------------------------
NOHEADS = list(itertools.product([32, 48], [16, 32, 64], [False, True], [torch.float32, torch.float16,
                                                                           torch.bfloat16]))


def _noheads_grid(backend):
    cases = [c for c in NOHEADS if not (backend == "triton" and c[3] == torch.bfloat16)]  # interpreter: no bf16
    return cases if backend == "cpp" else random.Random(f"ssu-{backend}").sample(cases, 6)


@pytest.mark.parametrize("backend,dim,dstate,has_z,itype", [(b, *c) for b in SSU_BACKENDS for c in _noheads_grid(b)])
def test_noheads_grid(backend, dim, dstate, has_z, itype):
    batch = 2
    gen = torch.Generator().manual_seed(dim * dstate)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    state = r(batch, dim, dstate).to(itype)
    args = dict(x=r(batch, dim).to(itype), dt=r(batch, dim).to(itype), A=-torch.rand(dim, dstate, generator=gen) - 1,
                B=r(batch, dstate).to(itype), C=r(batch, dstate).to(itype), D=r(dim), z=r(batch, dim).to(itype)
                if has_z else None, dt_bias=torch.rand(dim, generator=gen) - 4.0)
    out, st, ref, ref_st = _run_both(backend, state, **args)
    rtol, atol = TOL[itype]
    assert out.shape == (batch, dim) and out.dtype == itype
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(st, ref_st, rtol=rtol, atol=atol)


# -- the heads grid: headdim x ngroups x dstate x z x tied head dims ---------------------------------------
HEADS = list(itertools.product([8, 16], [1, 2, 4], [16, 64], [False, True], [False, True]))


def _heads_grid(backend):
    return HEADS if backend == "cpp" else random.Random(f"ssu-heads-{backend}").sample(HEADS, 8)


@pytest.mark.parametrize("backend,headdim,ngroups,dstate,has_z,tie_hdim",
                         [(b, *c) for b in SSU_BACKENDS for c in _heads_grid(b)])
def test_heads_grid(backend, headdim, ngroups, dstate, has_z, tie_hdim):
    batch, nheads = 2, 8
    gen = torch.Generator().manual_seed(headdim * ngroups + dstate)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    state = r(batch, nheads, headdim, dstate)
    if tie_hdim:  # Mamba-2: one A, dt, D and dt_bias per head, expanded with stride 0
        A = (-torch.rand(nheads, generator=gen) - 1)[:, None, None].expand(nheads, headdim, dstate)
        dt = r(batch, nheads)[:, :, None].expand(batch, nheads, headdim)
        D = r(nheads)[:, None].expand(nheads, headdim)
        dt_bias = (torch.rand(nheads, generator=gen) - 4.0)[:, None].expand(nheads, headdim)
        assert A.stride(-1) == 0 and dt.stride(-1) == 0
    else:
        A, dt = -torch.rand(nheads, headdim, dstate, generator=gen) - 1, r(batch, nheads, headdim)
        D, dt_bias = r(nheads, headdim), torch.rand(nheads, headdim, generator=gen) - 4.0
    args = dict(x=r(batch, nheads, headdim), dt=dt, A=A, B=r(batch, ngroups, dstate), C=r(batch, ngroups, dstate),
                D=D, z=r(batch, nheads, headdim) if has_z else None, dt_bias=dt_bias)
    out, st, ref, ref_st = _run_both(backend, state, **args)
    assert out.shape == (batch, nheads, headdim)
    torch.testing.assert_close(out, ref, rtol=3e-5, atol=3e-5)
    torch.testing.assert_close(st, ref_st, rtol=3e-5, atol=3e-5)


# -- every form mamba-ssm accepts -----------------------------------------------------------------------
def _forms():
    b, h, p, n = 3, 4, 2, 5
    r = torch.randn
    return {
        "3d": dict(state=r(b, p, n), x=r(b, p), dt=r(b, p), A=-torch.rand(p, n), B=r(b, n), C=r(b, n),
                   D=r(p), z=r(b, p), dt_bias=r(p)),
        "3d-state-bc-groups": dict(state=r(b, p, n), x=r(b, p), dt=r(b, p), A=-torch.rand(p, n), B=r(b, 1, n),
                                   C=r(b, 1, n)),
        "4d-state-2d-x": dict(state=r(b, 1, p, n), x=r(b, p), dt=r(b, p), A=-torch.rand(p, n), B=r(b, n),
                              C=r(b, n), D=r(p), z=r(b, p), dt_bias=r(p)),
        "4d-mixed": dict(state=r(b, 1, p, n), x=r(b, 1, p), dt=r(b, p), A=-torch.rand(1, p, n), B=r(b, n),
                         C=r(b, 1, n), D=r(p), dt_bias=r(1, p)),
        "heads-groups": dict(state=r(b, h, p, n), x=r(b, h, p), dt=r(b, h, p), A=-torch.rand(h, p, n),
                             B=r(b, 2, n), C=r(b, 2, n), D=r(h, p), z=r(b, h, p), dt_bias=r(h, p)),
    }


@pytest.mark.parametrize("backend", SSU_BACKENDS)
@pytest.mark.parametrize("form", list(_forms()))
@pytest.mark.parametrize("indices", [False, True])
def test_every_form(backend, form, indices):
    args = _forms()[form]
    state = args.pop("state")
    expect_shape = (args["x"].shape[0], *state.shape[1:-1])
    idx = None
    if indices:  # a bigger state; row 1 is padding
        state = torch.randn(7, *state.shape[1:])
        idx = torch.tensor([5, -1, 2])
    untouched = state[[0, 1, 3, 4, 6]].clone() if indices else None
    out, st, ref, ref_st = _run_both(backend, state, state_batch_indices=idx, **args)
    assert out.shape == ref.shape == expect_shape
    torch.testing.assert_close(out, ref, rtol=3e-5, atol=3e-5)
    torch.testing.assert_close(st, ref_st, rtol=3e-5, atol=3e-5)
    if indices:
        assert torch.equal(state[[0, 1, 3, 4, 6]], untouched)
        assert not out[1].any()  # the padding row's output is 0


@pytest.mark.parametrize("backend", SSU_BACKENDS)
def test_batch_indices_equal_gathered_call(backend):
    """Updating rows of a big state through state_batch_indices equals updating the gathered rows."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(9, 4, 3, 8, generator=gen)
    idx = torch.tensor([7, 0, 4, 2])
    args = dict(x=torch.randn(4, 4, 3, generator=gen), dt=torch.randn(4, 4, 3, generator=gen),
                A=-torch.rand(4, 3, 8, generator=gen), B=torch.randn(4, 2, 8, generator=gen),
                C=torch.randn(4, 2, 8, generator=gen), D=torch.randn(4, 3, generator=gen))
    gathered = big[idx].clone()
    expect = selective_state_update(gathered, **args, dt_softplus=True, backend=backend)
    out = selective_state_update(big, **args, dt_softplus=True, state_batch_indices=idx.int(), backend=backend)
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(big[idx], gathered)


@pytest.mark.parametrize("backend", SSU_BACKENDS)
def test_fp16_and_noncontiguous_state(backend):
    batch, nheads, dim, N = 2, 2, 6, 4
    x, dt = torch.randn(batch, nheads, dim).half(), (torch.randn(batch, nheads, dim) * 0.5).half()
    args = dict(x=x, dt=dt, A=-(torch.rand(nheads, dim, N) + 0.2), B=torch.randn(batch, 2, N).half(),
                C=torch.randn(batch, 2, N).half(), D=torch.randn(nheads, dim), z=torch.randn(batch, nheads, dim).half(),
                dt_bias=torch.randn(nheads, dim) * 0.2)
    base = torch.randn(batch, nheads, dim, N)
    # A non-contiguous fp32 state (a transposed view) and an fp16 one are both updated in place.
    for state in (base.transpose(0, 1).contiguous().transpose(0, 1), base.half()):
        ref_state = state.float().clone()
        ref = selective_state_update_ref(ref_state, **args, dt_softplus=True)
        out = selective_state_update(state, **args, dt_softplus=True, backend=backend)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state.float(), ref_state, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", SSU_BACKENDS)
@pytest.mark.parametrize("heads", [False, True])
def test_matches_scan_steps(backend, heads):
    """L decode steps from a zero state equal the selective scan over the L steps (an independent oracle)."""
    batch, dim, N, L = 2, 6, 4, 5
    u, delta, z = torch.randn(batch, dim, L), torch.randn(batch, dim, L) * 0.5, torch.randn(batch, dim, L)
    A, B, C = -(torch.rand(dim, N) + 0.2), torch.randn(batch, N, L), torch.randn(batch, N, L)
    D, bias = torch.randn(dim), torch.randn(dim) * 0.2
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


@pytest.mark.parametrize("backend", SSU_BACKENDS)
def test_validates_before_mutating(backend):
    state = torch.randn(2, 3, 4)
    before = state.clone()
    x, dt = torch.randn(2, 3), torch.rand(2, 3)
    A, B, C = -torch.rand(3, 4), torch.randn(2, 4), torch.randn(2, 4)
    bad = [
        (ValueError, "'C'", dict(C=torch.randn(2, 5))),
        (ValueError, "'dt_bias'", dict(dt_bias=torch.randn(4))),
        (ValueError, "'z'", dict(z=torch.randn(3, 3))),
        (NotImplementedError, "complex", dict(A=A.to(torch.complex64))),
        (TypeError, "'x'", dict(x=x.long())),
        (ValueError, "'state'", dict(x=torch.randn(3, 3), dt=torch.rand(3, 3), B=torch.randn(3, 4),
                                     C=torch.randn(3, 4))),
        (IndexError, "'state_batch_indices'", dict(state_batch_indices=torch.tensor([0, 2]))),
        (ValueError, "'state_batch_indices'", dict(state_batch_indices=torch.tensor([1, 1]))),
        (ValueError, "'state_batch_indices'", dict(state_batch_indices=torch.tensor([1]))),
        (TypeError, "'state_batch_indices'", dict(state_batch_indices=torch.tensor([0.0, 1.0]))),
    ]
    for exc, match, change in bad:
        args = dict(x=x, dt=dt, A=A, B=B, C=C)
        args.update(change)
        with pytest.raises(exc, match=match):
            selective_state_update(state, **args, backend=backend)
        assert torch.equal(state, before), match
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


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_opcheck(backend):
    """The custom op's fake function and schema agree with the kernels, batch indices included."""
    state = torch.randn(4, 2, 3, 8)
    args = (torch.randn(3, 2, 3), torch.rand(3, 2, 3), -torch.rand(2, 3, 8), torch.randn(3, 1, 8),
            torch.randn(3, 1, 8), torch.randn(2, 3), None, None, True, torch.tensor([3, -1, 0]), backend)
    torch.library.opcheck(torch.ops.fastarch.selective_state_update.default, (state, *args))
    # The 3-D state with 2-D arguments.
    torch.library.opcheck(torch.ops.fastarch.selective_state_update.default,
                          (torch.randn(3, 5, 4), torch.randn(3, 5), torch.rand(3, 5), -torch.rand(5, 4),
                           torch.randn(3, 4), torch.randn(3, 4), None, torch.randn(3, 5), None, False, None, backend))
