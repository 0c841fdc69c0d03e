"""mamba3_scan and mamba3_step: every backend against the step-by-step oracle and against transcriptions of
mamba-ssm's own Mamba-3 reference functions (the SISO chunked and step references, the MIMO step and chunked
references), gradients (gradcheck in float64), chunked prefill followed by decode steps, and bad inputs.
opcheck and torch.compile run in tests/ops/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.ops import mamba3_scan, mamba3_scan_ref, mamba3_step, mamba3_step_ref
from tests.ops._mamba3_peer import (
    peer_mimo_chunk_ref,
    peer_mimo_step_ref,
    peer_siso_fwd_ref,
    peer_siso_step_ref,
)

pytestmark = pytest.mark.op("mamba3_scan")
TWO_PI = 2 * math.pi


# -- inputs ---------------------------------------------------------------------------------------------------
def make(batch=2, L=9, H=4, G=2, N=16, P=8, S_a=None, R=None, *, dtype=torch.float32, has_D=True, has_Z=True,
         states=True, seed=0):
    """Inputs as mamba-ssm's tests draw them (RMS-normed Q, K; ADT = -A DT with A in (1, 16) and DT log-uniform
    in (1e-3, 0.1); Trap uniform; angles standard normal, N/4 of them); fp32 ADT, DT, angles and states."""
    g = torch.Generator().manual_seed(seed)
    S_a = N // 4 if S_a is None else S_a

    def rn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    qshape = (batch, L, G, N) if R is None else (batch, L, R, G, N)
    bshape = (H, N) if R is None else (H, R, N)
    dt = torch.exp(torch.rand(batch, H, L, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    a = -(1 + 15 * torch.rand(batch, H, L, generator=g))
    x = dict(Q=F.rms_norm(rn(*qshape), (N,)).to(dtype), K=F.rms_norm(rn(*qshape), (N,)).to(dtype),
             V=rn(batch, L, H, P).to(dtype), ADT=a * dt, DT=dt, Trap=torch.rand(batch, H, L, generator=g).to(dtype),
             Q_bias=rn(*bshape).to(dtype), K_bias=rn(*bshape).to(dtype), Angles=rn(batch, L, H, S_a),
             D=rn(H) if has_D else None, Z=rn(batch, L, H, P).to(dtype) if has_Z else None)
    kshape = (batch, H, N) if R is None else (batch, R, H, N)
    st = (rn(batch, H, S_a), rn(batch, H, P, N), rn(*kshape), rn(batch, H, P)) if states else None
    kw = {}
    if R is not None:
        kw = dict(mimo_v=rn(H, R, P) / R, mimo_z=rn(H, R, P) if has_Z else None, mimo_o=rn(H, R, P) / R)
    if dtype == torch.float64:  # every input in float64
        x, kw = ({k: None if v is None else v.double() for k, v in d.items()} for d in (x, kw))
        st = None if st is None else tuple(s.double() for s in st)
    return x, st, kw


# float64 where the backend takes it (exact to rounding), else float32
DTYPE = {"torch": torch.float64, "cpp": torch.float32}
TOL = {"torch": 1e-9, "cpp": 3e-4}


def close(a, b, tol, what=""):
    scale = max(1.0, b.abs().max().item())
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def close_angle(a, b, tol):
    d = torch.remainder(a.double() - b.double() + math.pi, TWO_PI) - math.pi
    assert d.abs().max().item() < tol


# -- forward against the peer's references --------------------------------------------------------------------
@pytest.mark.parametrize("nheads_qk", [1, 2])
@pytest.mark.parametrize("has_Z,has_D", [(True, True), (False, False)])
@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("L,chunk_size", [(1, 64), (13, 4), (40, 16)])
def test_siso_forward_matches_peer_refs(backend, nheads_qk, has_Z, has_D, states, L, chunk_size):
    x, st, _ = make(L=L, G=nheads_qk, has_D=has_D, has_Z=has_Z, states=states, dtype=DTYPE[backend])
    out, *fin = mamba3_scan(**x, input_states=st, chunk_size=chunk_size, return_final_states=True, backend=backend)
    ref_out, ref_fin = peer_siso_fwd_ref(**x, states=st)
    step_out, step_fin = peer_siso_step_ref(**x, states=st if st is not None else None)
    close(out, ref_out, TOL[backend], "out vs fwd_ref")
    close(out, step_out, TOL[backend], "out vs step_ref")
    close_angle(fin[0], ref_fin[0], TOL[backend])
    for a, r, name in zip(fin[1:], ref_fin[1:], ("ssm", "k", "v")):
        close(a, r, TOL[backend], name)
    for a, r, name in zip(fin[1:], step_fin[1:], ("ssm", "k", "v")):
        close(a, r, TOL[backend], name)


@pytest.mark.parametrize("R,G", [(1, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("states", [False, True])
def test_mimo_forward_matches_peer_step_ref(backend, R, G, states):
    x, st, kw = make(L=11, G=G, R=R, states=states, dtype=DTYPE[backend])
    out, ang, ssm, k, v = mamba3_scan(**x, input_states=st, chunk_size=4, return_final_states=True,
                                      rotate_pairwise=True, **kw, backend=backend)
    peer_states = None
    if st is not None:  # the peer's K state is (batch, H, R, N) and its V state V * mimo_v per rank
        peer_states = (st[0], st[1], st[2].transpose(1, 2), torch.einsum("bhp,hrp->bhrp", st[3], kw["mimo_v"]))
    ref, (r_ang, r_ssm, r_k, r_v) = peer_mimo_step_ref(**{n: x[n] for n in ("Q", "K", "V", "ADT", "DT", "Trap",
                                                                           "Q_bias", "K_bias", "Angles", "D", "Z")},
                                                       mimo_v=kw["mimo_v"], mimo_o=kw["mimo_o"], mimo_z=kw["mimo_z"],
                                                       states=peer_states)
    close(out, ref, TOL[backend], "out")
    close_angle(ang, r_ang, TOL[backend])
    close(ssm, r_ssm, TOL[backend], "ssm")
    close(k, r_k.transpose(1, 2), TOL[backend], "k")
    close(torch.einsum("bhp,hrp->bhrp", v, kw["mimo_v"]), r_v, TOL[backend], "v")


@pytest.mark.parametrize("N,divisor,R,chunk_size,L", [(16, 4, 4, 8, 20), (32, 4, 2, 16, 16), (16, 2, 4, 4, 10),
                                                      (16, 4, 1, 8, 8)])
def test_mimo_forward_matches_peer_chunk_ref(backend, N, divisor, R, chunk_size, L):
    x, _, kw = make(L=L, H=4, G=1, N=N, P=8, S_a=N // divisor, R=R, states=False, dtype=DTYPE[backend])
    out = mamba3_scan(**x, chunk_size=chunk_size, **kw, backend=backend)
    ref = peer_mimo_chunk_ref(**x, **kw, chunk_size=chunk_size, rotary_dim_divisor=divisor)
    close(out, ref, TOL[backend])


def test_mimo_without_mimo_o_keeps_ranks(backend):
    x, st, kw = make(L=6, R=3, dtype=DTYPE[backend])
    full = mamba3_scan(**x, input_states=st, **kw, backend=backend)
    ranks = mamba3_scan(**x, input_states=st, **{**kw, "mimo_o": None}, backend=backend)
    assert ranks.shape == (2, 6, 3, 4, 8)
    close(torch.einsum("blrhp,hrp->blhp", ranks, kw["mimo_o"]), full, TOL[backend])


# -- every backend against the oracle, forward and backward -------------------------------------------------------
GRADS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z")


def _run_with_grads(fn, x, st, kw, chunk_size, seed=1, **extra):
    xl = {k: (None if v is None else v.detach().clone().requires_grad_()) for k, v in x.items()}
    stl = None if st is None else tuple(s.detach().clone().requires_grad_() for s in st)
    kwl = {k: (None if v is None else v.detach().clone().requires_grad_()) for k, v in kw.items()}
    outs = fn(**xl, input_states=stl, chunk_size=chunk_size, return_final_states=True, **kwl, **extra)
    g = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
    leaves = [t for t in (*xl.values(), *(stl or ()), *kwl.values()) if t is not None]
    names = [k for k, t in xl.items() if t is not None] + (["angle", "ssm", "k", "v"] if stl else []) + [
        k for k, t in kwl.items() if t is not None]
    grads = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
    return outs, dict(zip(names, grads))


@pytest.mark.parametrize("R,keep_ranks", [(None, False), (2, False), (2, True)])
@pytest.mark.parametrize("L,chunk_size", [(10, 3), (10, 64), (70, 16)])  # 70: several of cpp's 32-step blocks
def test_backend_matches_oracle_fwd_bwd(backend, R, keep_ranks, L, chunk_size):
    x, st, kw = make(L=L, R=R, dtype=torch.float32)
    if keep_ranks:
        kw["mimo_o"] = None
    outs, grads = _run_with_grads(mamba3_scan, x, st, kw, chunk_size, backend=backend)
    routs, rgrads = _run_with_grads(mamba3_scan_ref, x, st, kw, chunk_size)
    for a, r in zip(outs, routs):
        assert a.dtype == r.dtype and a.shape == r.shape
        close(a, r, 1e-4)
    assert grads.keys() == rgrads.keys()
    for name in grads:
        assert grads[name] is not None, name
        close(grads[name], rgrads[name], 2e-4, f"d{name}")


def test_bf16_inputs_keep_dtypes(backend):
    x, st, _ = make(L=7, dtype=torch.bfloat16)
    out, ang, ssm, k, v = mamba3_scan(**x, input_states=st, return_final_states=True, backend=backend)
    assert (out.dtype, ang.dtype, ssm.dtype, k.dtype, v.dtype) == (torch.bfloat16, torch.float32, torch.float32,
                                                                   torch.bfloat16, torch.bfloat16)
    ref = mamba3_scan_ref(**x, input_states=st)
    close(out, ref, 2e-2)


@pytest.mark.op("mamba3_scan", exclude=("cpp",))  # float64 only: cpp declares fp32/fp16/bf16
@pytest.mark.parametrize("R", [None, 2])
def test_gradcheck_float64(backend, R):
    x, st, kw = make(batch=1, L=5, H=2, G=1, N=4, P=2, S_a=1, R=R, dtype=torch.float64, seed=3)
    names = [k for k, v in x.items() if v is not None]
    kw_names = [k for k, v in kw.items() if v is not None]
    tensors = [x[k] for k in names] + list(st) + [kw[k] for k in kw_names]
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    n1, n2 = len(names), len(names) + 4

    def f(*ts):
        args = dict(zip(names, ts[:n1]))
        return mamba3_scan(**args, input_states=tuple(ts[n1:n2]), chunk_size=2, return_final_states=True,
                           **dict(zip(kw_names, ts[n2:])), backend=backend)

    assert torch.autograd.gradcheck(f, tensors, atol=1e-6, rtol=1e-5)


# -- chunk size, state passing and decode -----------------------------------------------------------------------
def test_chunk_size_does_not_change_result(backend):
    x, st, kw = make(L=23, R=2, dtype=DTYPE[backend])
    outs = [mamba3_scan(**x, input_states=st, chunk_size=c, return_final_states=True, **kw, backend=backend)
            for c in (1, 5, 8, 23, 1000)]
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            close(a, b, TOL[backend])


@pytest.mark.parametrize("R", [None, 4])
def test_two_calls_with_states_equal_one(backend, R):
    x, st, kw = make(L=17, R=R, dtype=DTYPE[backend])
    full = mamba3_scan(**x, input_states=st, chunk_size=4, return_final_states=True, **kw, backend=backend)

    def part(sl):
        return {k: None if v is None else (v[:, :, sl] if k in ("ADT", "DT", "Trap") else
                                           v if k in ("Q_bias", "K_bias", "D") else v[:, sl])
                for k, v in x.items()}

    first = mamba3_scan(**part(slice(0, 7)), input_states=st, chunk_size=4, return_final_states=True, **kw,
                        backend=backend)
    second = mamba3_scan(**part(slice(7, None)), input_states=first[1:], chunk_size=4, return_final_states=True,
                         **kw, backend=backend)
    close(torch.cat([first[0], second[0]], 1), full[0], TOL[backend])
    for a, b in zip(second[1:], full[1:]):
        close(a, b, TOL[backend])


@pytest.mark.parametrize("R", [None, 2])
def test_prefill_then_decode_steps_match_one_scan(backend, R):
    x, st, kw = make(L=12, R=R, dtype=DTYPE[backend])
    full = mamba3_scan(**x, input_states=st, chunk_size=4, return_final_states=True, **kw, backend=backend)
    pre = 5
    prefix = {k: None if v is None else (v[:, :, :pre] if k in ("ADT", "DT", "Trap") else
                                         v if k in ("Q_bias", "K_bias", "D") else v[:, :pre]) for k, v in x.items()}
    out0, *states = mamba3_scan(**prefix, input_states=st, chunk_size=4, return_final_states=True, **kw,
                                backend=backend)
    outs = [out0]
    for t in range(pre, 12):
        args = {k: None if v is None else (v[:, :, t] if k in ("ADT", "DT", "Trap") else
                                           v if k in ("Q_bias", "K_bias", "D") else v[:, t]) for k, v in x.items()}
        o, *states = mamba3_step(**{k: args[k] for k in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias",
                                                         "Angles")}, angle_state=states[0], ssm_state=states[1],
                                 k_state=states[2], v_state=states[3], D=args["D"], Z=args["Z"], **kw,
                                 backend=backend)
        outs.append(o[:, None])
    close(torch.cat(outs, 1), full[0], TOL[backend])
    for a, b in zip(states, full[1:]):
        close(a, b, TOL[backend])


@pytest.mark.parametrize("R", [None, 2])
def test_step_matches_its_oracle_and_gradcheck(R):
    x, st, kw = make(batch=2, L=1, H=2, G=1, N=4, P=2, S_a=2, R=R, dtype=torch.float64, seed=5)
    one = {k: None if v is None else (v[:, :, 0] if k in ("ADT", "DT", "Trap") else
                                      v if k in ("Q_bias", "K_bias", "D") else v[:, 0]) for k, v in x.items()}
    got = mamba3_step(**one, angle_state=st[0], ssm_state=st[1], k_state=st[2], v_state=st[3], **kw)
    ref = mamba3_step_ref(**one, angle_state=st[0], ssm_state=st[1], k_state=st[2], v_state=st[3], **kw)
    for a, b in zip(got, ref):
        close(a, b, 1e-12)
    names = [k for k, v in one.items() if v is not None]
    kw_names = [k for k, v in kw.items() if v is not None]
    tensors = [t.detach().clone().requires_grad_() for t in [one[k] for k in names] + list(st) +
               [kw[k] for k in kw_names]]
    n1, n2 = len(names), len(names) + 4

    def f(*ts):
        return mamba3_step(**dict(zip(names, ts[:n1])), angle_state=ts[n1], ssm_state=ts[n1 + 1],
                           k_state=ts[n1 + 2], v_state=ts[n1 + 3], **dict(zip(kw_names, ts[n2:])))

    assert torch.autograd.gradcheck(f, tensors, atol=1e-6, rtol=1e-5)


# -- bad inputs ------------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    x, st, kw = make(L=5)
    with pytest.raises(ValueError, match="'K'"):
        mamba3_scan(**{**x, "K": x["K"][:, :4]})
    with pytest.raises(ValueError, match="'ADT'"):
        mamba3_scan(**{**x, "ADT": x["ADT"].transpose(1, 2)})
    with pytest.raises(ValueError, match="groups"):
        mamba3_scan(**{**x, "Q": x["Q"][:, :, :1].expand(-1, -1, 3, -1), "K": x["K"][:, :, :1].expand(-1, -1, 3, -1)})
    with pytest.raises(ValueError, match="'Angles'"):
        mamba3_scan(**{**x, "Angles": torch.randn(2, 5, 4, 9)})
    with pytest.raises(ValueError, match="'chunk_size'"):
        mamba3_scan(**x, chunk_size=0)
    with pytest.raises(ValueError, match="'ssm_state'"):
        mamba3_scan(**x, input_states=(st[0], st[1][..., :3], st[2], st[3]))
    with pytest.raises(TypeError, match="input states"):
        mamba3_scan(**x, input_states=st[:3])
    with pytest.raises(ValueError, match="'mimo_v'"):
        mamba3_scan(**x, mimo_v=torch.ones(4, 1, 8))
    xm, _, kwm = make(L=5, R=2)
    with pytest.raises(ValueError, match="'mimo_v'"):
        mamba3_scan(**xm)
    with pytest.raises(ValueError, match="'mimo_z'"):
        mamba3_scan(**xm, mimo_v=kwm["mimo_v"])
    with pytest.raises(TypeError, match="'V'"):
        mamba3_scan(**{**x, "V": x["V"].to(torch.int32)})
    with pytest.raises(ValueError, match="L >= 1"):
        mamba3_scan(**{k: None if v is None else (v[:, :, :0] if k in ("ADT", "DT", "Trap") else
                                                  v if k in ("Q_bias", "K_bias", "D") else v[:, :0])
                       for k, v in x.items()})
    with pytest.raises(ValueError, match="'v_state'"):
        mamba3_step(x["Q"][:, 0], x["K"][:, 0], x["V"][:, 0], x["ADT"][:, :, 0], x["DT"][:, :, 0],
                    x["Trap"][:, :, 0], x["Q_bias"], x["K_bias"], x["Angles"][:, 0], st[0], st[1], st[2],
                    st[3][:, :1])


# -- packed sequences ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R", [None, 2])
def test_varlen_matches_separate_sequences(backend, R):
    lengths = [0, 3, 0, 6, 2, 0]  # mamba-ssm's empty-sequence case, and non-empty ones
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    x, _, kw = make(batch=1, L=sum(lengths), R=R, dtype=DTYPE[backend])
    _, st, _ = make(batch=len(lengths), L=1, R=R, dtype=DTYPE[backend], seed=7)
    out, *fin = mamba3_scan(**x, input_states=st, chunk_size=4, return_final_states=True, cu_seqlens=cu, **kw,
                            backend=backend)
    ref_out, *ref_fin = mamba3_scan_ref(**x, input_states=st, return_final_states=True, cu_seqlens=cu, **kw)
    close(out, ref_out, TOL[backend])
    for a, r in zip(fin, ref_fin):
        close(a, r, TOL[backend])
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sti = tuple(t[i:i + 1] for t in st)
        if e == s:  # empty: the input states come back unchanged
            for a, t in zip(fin, sti):
                assert torch.equal(a[i:i + 1], t)
            continue
        part = {k: None if v is None else (v[:, :, s:e] if k in ("ADT", "DT", "Trap") else
                                           v if k in ("Q_bias", "K_bias", "D") else v[:, s:e]) for k, v in x.items()}
        o, *f = mamba3_scan(**part, input_states=sti, chunk_size=4, return_final_states=True, **kw, backend=backend)
        close(out[:, s:e], o, TOL[backend])
        for a, b in zip(fin, f):
            close(a[i:i + 1], b, TOL[backend])


def test_varlen_bad_offsets():
    x, _, _ = make(batch=1, L=5)
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        mamba3_scan(**x, cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    x2, _, _ = make(batch=2, L=5)
    with pytest.raises(ValueError, match="batch 1"):
        mamba3_scan(**x2, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
