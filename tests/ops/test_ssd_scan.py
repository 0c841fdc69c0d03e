"""ssd_scan: every backend against the sequential fp32 oracle, with mamba_chunk_scan_combined's semantics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fastarch import backend as registry
from fastarch.compat.mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
from fastarch.ops import selective_state_update
from fastarch.ops.ssd_scan import MAX_CHUNK_SIZE, effective_chunk_size, ssd_scan, ssd_scan_ref

pytestmark = pytest.mark.op("ssd_scan")
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make(batch, L, H, P, G, N, *, d_per_head=False, dtype=torch.float32, seed=0):
    """Inputs as Mamba-2 passes them: x, dt, B, C, z in ``dtype``; A, D, dt_bias fp32 parameters."""
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    A = -torch.exp(torch.rand(H, generator=g) * math.log(16))  # mamba's A_init_range (1, 16)
    dt_bias = torch.log(torch.expm1(torch.exp(torch.rand(H, generator=g) * (math.log(0.1) - math.log(1e-3))
                                              + math.log(1e-3))))
    return dict(x=rn(batch, L, H, P), dt=rn(batch, L, H, scale=0.5), A=A, B=rn(batch, L, G, N),
                C=rn(batch, L, G, N), D=torch.randn(H, P, generator=g) if d_per_head else torch.randn(H, generator=g),
                z=rn(batch, L, H, P), dt_bias=dt_bias, initial_states=torch.randn(batch, H, P, N, generator=g))


def run(fn, inputs, chunk_size, seed=1, **kw):
    """Outputs (out, final_states) and the gradient of every tensor input, for a random upstream gradient."""
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out, final = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size, D=leaves["D"],
                    z=leaves["z"], dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"],
                    dt_softplus=True, return_final_states=True, **kw)
    g = torch.Generator().manual_seed(seed)
    ((out.float() * torch.randn(out.shape, generator=g)).sum()
     + (final * torch.randn(final.shape, generator=g)).sum()).backward()
    return out, final, {k: leaves[k].grad for k in GRAD_NAMES}


def oracle(inputs, **kw):
    return run(ssd_scan_ref, {k: v.float() for k, v in inputs.items()}, 0, **kw)


def assert_matches(got, want, rtol=1e-4, atol=1e-4):
    out, final, grads = got
    rout, rfinal, rgrads = want
    torch.testing.assert_close(out.float(), rout, rtol=rtol, atol=atol, msg=lambda m: f"out: {m}")
    torch.testing.assert_close(final, rfinal, rtol=rtol, atol=atol, msg=lambda m: f"final_states: {m}")
    for name in GRAD_NAMES:
        g, r = grads[name], rgrads[name]
        scale = max(r.abs().max().item(), 1.0)  # sums over L and P of products: relative to the magnitude
        torch.testing.assert_close(g.float(), r, rtol=rtol * 10, atol=atol * 10 * scale,
                                   msg=lambda m, name=name: f"grad {name}: {m}")


# The grid: L in (1, 63, 257, 1000) x chunk (64, 256) x G in (1, H) x P in (16, 64) x N in (16, 64,
# 128). Every (L, chunk) pair and every (G, P, N) combination appears; pairs are assigned round-robin.
H = 4
LC = list(itertools.product((1, 63, 257, 1000), (64, 256)))
GPN = list(itertools.product((1, H), (16, 64), (16, 64, 128)))
GRID = [(*LC[i % len(LC)], *GPN[i]) for i in range(len(GPN))]
_ORACLE: dict = {}


@pytest.mark.parametrize("L,chunk,G,P,N", GRID, ids=[f"L{c[0]}-cs{c[1]}-G{c[2]}-P{c[3]}-N{c[4]}" for c in GRID])
def test_grid_against_oracle(backend, L, chunk, G, P, N):
    inputs = make(2, L, H, P, G, N, d_per_head=P == 16)
    key = (L, G, P, N)
    if key not in _ORACLE:  # the oracle does not depend on the chunk size or the backend
        _ORACLE[key] = oracle(inputs)
    assert_matches(run(ssd_scan, inputs, chunk, backend=backend), _ORACLE[key])


def _sorted_ids(batch, L, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, n, (batch, L), generator=g), dim=1).values.to(torch.int32)


@pytest.mark.parametrize("L,chunk", [(100, 16), (257, 64), (300, 256)])
def test_seq_idx_restarts(backend, L, chunk):
    inputs = make(2, L, H, 16, 2, 16)
    seq_idx = _sorted_ids(2, L, 4, seed=3)
    seq_idx[1] += 1  # row 1 starts at sequence 1: its initial state is dropped, as in mamba-ssm
    assert_matches(run(ssd_scan, inputs, chunk, seq_idx=seq_idx, backend=backend),
                   oracle(inputs, seq_idx=seq_idx))


@pytest.mark.parametrize("lengths", [[0, 5, 1, 120, 0, 174], [300], [1, 1, 64, 63, 171]])
def test_cu_seqlens_varlen_states(backend, lengths):
    L = sum(lengths)
    inputs = make(1, L, H, 8, 1, 16)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    kw = dict(D=inputs["D"], initial_states=inputs["initial_states"], dt_softplus=True, cu_seqlens=cu,
              return_final_states=True, return_varlen_states=True)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    out, final, states = ssd_scan(*args, 64, backend=backend, **kw)
    rout, rfinal, rstates = ssd_scan_ref(*args, 64, **kw)
    assert states.shape == (len(lengths), H, 8, 16)
    torch.testing.assert_close(out, rout, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, rfinal, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, rstates, rtol=1e-4, atol=1e-4)
    # each packed sequence equals the same sequence run alone (the first one from the initial states)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:
            assert states[i].abs().max() == 0
            continue
        init = inputs["initial_states"] if i == 0 else None
        alone, last = ssd_scan(*[t if t.dim() == 1 else t[:, s:e] for t in args], 64, D=inputs["D"], initial_states=init,
                               dt_softplus=True, return_final_states=True, backend=backend)
        torch.testing.assert_close(out[:, s:e], alone, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(states[i], last[0], rtol=1e-4, atol=1e-4)


def test_dt_limit_clamps(backend):
    inputs = make(2, 97, H, 16, 1, 16)
    inputs["dt"] = inputs["dt"] * 8  # many steps beyond the limits on both sides
    assert_matches(run(ssd_scan, inputs, 32, dt_limit=(0.01, 0.05), backend=backend),
                   oracle(inputs, dt_limit=(0.01, 0.05)))


def test_chunk_size_changes_only_rounding(backend):
    inputs = make(1, 130, H, 16, 2, 16)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    outs = [ssd_scan(*args, cs, initial_states=inputs["initial_states"], dt_softplus=True,
                     return_final_states=True, backend=backend) for cs in (1, 7, 64, 256)]
    for out, final in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, outs[0][1], rtol=1e-4, atol=1e-4)


def test_half_precision_inputs(backend):
    inputs = make(2, 70, H, 16, 1, 16, dtype=torch.float16)
    got = run(ssd_scan, inputs, 32, backend=backend)
    ref = oracle(inputs)  # fp32 arithmetic on the same fp16 values
    assert got[0].dtype == torch.float16 and all(got[2][k].dtype == inputs[k].dtype for k in GRAD_NAMES)
    assert_matches(got, ref, rtol=2e-3, atol=2e-3)


def test_optional_arguments_absent(backend):
    inputs = make(2, 65, H, 16, 1, 16)
    inputs["dt"] = inputs["dt"].abs()  # without softplus, a negative step would grow the state
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    out = ssd_scan(*args, 64, backend=backend)
    torch.testing.assert_close(out, ssd_scan_ref(*args), rtol=1e-4, atol=1e-4)


def test_decode_steps_equal_the_scan(backend):
    """mamba-ssm's Mamba-2 decode: selective_state_update in its multi-head form, with A, dt_bias and D
    expanded by stride 0 and (batch, G, N) B/C, stepped over the sequence, equals the scan."""
    batch, L, P, G, N = 2, 20, 16, 2, 16
    inputs = make(batch, L, H, P, G, N)
    x, dt, A, B, C, D, z, dt_bias = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias"))
    out, final = ssd_scan(x, dt, A, B, C, 8, D=D, z=z, dt_bias=dt_bias, initial_states=inputs["initial_states"],
                          dt_softplus=True, return_final_states=True, backend=backend)
    state = inputs["initial_states"].clone()
    A_e = A[:, None, None].expand(H, P, N)
    for t in range(L):
        y = selective_state_update(state, x[:, t], dt[:, t, :, None].expand(batch, H, P), A_e, B[:, t], C[:, t],
                                   D=D[:, None].expand(H, P), z=z[:, t], dt_bias=dt_bias[:, None].expand(H, P),
                                   dt_softplus=True)
        torch.testing.assert_close(y, out[:, t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, final, rtol=1e-4, atol=1e-4)


def test_compat_signature_and_returns():
    inputs = make(1, 40, H, 8, 1, 8)
    inputs["dt"] = inputs["dt"].abs()
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    out = mamba_chunk_scan_combined(*args, 16)
    assert isinstance(out, torch.Tensor) and out.shape == inputs["x"].shape
    # positional order: chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, ...
    res = mamba_chunk_scan_combined(*args, 16, inputs["D"], inputs["z"], inputs["dt_bias"],
                                    inputs["initial_states"], None, cu, True, (0.0, math.inf), True, True)
    assert len(res) == 3 and res[1].shape == (1, H, 8, 8) and res[2].shape == (2, H, 8, 8)
    out2, states = mamba_chunk_scan_combined(*args, 16, cu_seqlens=cu, return_varlen_states=True)
    torch.testing.assert_close(out2, ssd_scan_ref(*args, cu_seqlens=cu), rtol=1e-4, atol=1e-4)
    assert states.shape == (2, H, 8, 8)


def test_compiles_without_graph_breaks():
    inputs = make(1, 33, H, 8, 1, 8)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C")]

    def f(x, dt, A, B, C, D, dt_bias):
        return ssd_scan(x, dt, A, B, C, 16, D=D, dt_bias=dt_bias, dt_softplus=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args, inputs["D"], inputs["dt_bias"]),
                               f(*args, inputs["D"], inputs["dt_bias"]))


@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_opcheck(impl):
    from fastarch.ops.ssd_scan import _ssd_scan_fwd

    inputs = make(1, 20, H, 8, 2, 8)
    x, dt, A, B, C, D = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D"))
    torch.library.opcheck(_ssd_scan_fwd, (x, dt, A, B, C, D, inputs["dt_bias"], True, 0.0, math.inf,
                                          inputs["initial_states"], None, 8, impl))
    torch.library.opcheck(_ssd_scan_fwd, (x, dt, A, B, C, D, None, True, 0.01, 0.5, None, None, 8, impl))
    torch.library.opcheck(_ssd_scan_fwd, (x, dt.abs(), A, B, C, None, None, False, 0.0, math.inf, None, None, 8,
                                          impl))


@pytest.mark.parametrize("chunk", [200, 256, 257, 384])
def test_cpp_forward_sub_chunks_keep_the_chunk_states(chunk):
    """The cpp forward runs long chunks as sub-chunks (256 as two of 128, 384 as three, 200 as two of 100; 257
    whole) and keeps the states entering the requested chunks: all three outputs as the torch backend's,
    across sequence restarts and with initial states."""
    from fastarch.ops.ssd_scan import _ssd_scan_fwd

    L = 700
    inputs = make(2, L, H, 16, 2, 16)
    seq_idx = _sorted_ids(2, L, 5, seed=4)
    args = [inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]
    outs = [_ssd_scan_fwd(*args, True, 0.0, math.inf, inputs["initial_states"], seq_idx, chunk, impl)
            for impl in ("torch", "cpp")]
    assert outs[1][2].shape == (2, -(-L // chunk), H, 16, 16)
    for name, got, want in zip(("y", "final_states", "chunk_states"), outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("d_per_head,dt_limit", [(False, (0.0, math.inf)), (True, (0.01, 0.5))],
                         ids=["D-per-head", "D-per-channel-dt-limit"])
def test_strided_views_of_one_tensor(backend, d_per_head, dt_limit):
    """Non-contiguous x, B, C (views of one convolution output) and dt (a view of a projection), as Mamba-2
    passes them (the cpp forward reads them through their strides, forms the steps and adds D x itself):
    outputs and every gradient as the oracle's."""
    inputs = make(2, 70, H, 8, 2, 16, d_per_head=d_per_head)
    dt_wide = torch.cat([inputs["dt"], torch.randn(2, 70, 3)], dim=-1).requires_grad_()
    dt = dt_wide[..., :H]
    flat = torch.cat([inputs[k].reshape(2, 70, -1) for k in ("x", "B", "C")], dim=-1)
    leaf = flat.transpose(1, 2).contiguous().requires_grad_()
    views = leaf.transpose(1, 2).split([H * 8, 2 * 16, 2 * 16], dim=-1)
    x, B, C = (v.view(inputs[k].shape) for v, k in zip(views, ("x", "B", "C")))
    assert not any(t.is_contiguous() for t in (x, B, C))
    params = {k: inputs[k].clone().requires_grad_() for k in ("A", "D", "dt_bias")}
    assert not dt.is_contiguous()
    out = ssd_scan(x, dt, params["A"], B, C, 32, D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True,
                   dt_limit=dt_limit, backend=backend)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * g).sum().backward()
    want_in = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    want = ssd_scan_ref(want_in["x"], want_in["dt"], want_in["A"], want_in["B"], want_in["C"], D=want_in["D"],
                        dt_bias=want_in["dt_bias"], dt_softplus=True, dt_limit=dt_limit)
    (want * g).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    dflat = torch.cat([want_in[k].grad.reshape(2, 70, -1) for k in ("x", "B", "C")], dim=-1)
    torch.testing.assert_close(leaf.grad.transpose(1, 2), dflat, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(dt_wide.grad[..., :H], want_in["dt"].grad, rtol=1e-3, atol=1e-3)
    for k in ("A", "D", "dt_bias"):
        torch.testing.assert_close(params[k].grad, want_in[k].grad, rtol=1e-3, atol=1e-3, msg=k)


def _args(**over):
    inputs = make(1, 10, H, 8, 2, 8)
    kw = {k: inputs[k] for k in ("x", "dt", "A", "B", "C")}
    kw["chunk_size"] = 4
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,match", [
    (dict(B=torch.randn(1, 10, 3, 8), C=torch.randn(1, 10, 3, 8)), "multiple of it"),
    (dict(x=torch.randn(1, 10, 4)), "'x' must have 4 dimensions"),
    (dict(dt=torch.randn(1, 10, 3)), r"'dt' must have shape \(1, 10, 4\)"),
    (dict(A=torch.randn(4, 8)), r"'A' must have shape \(4\)"),
    (dict(C=torch.randn(1, 10, 2, 7)), r"'C' must have shape \(1, 10, 2, 8\)"),
    (dict(chunk_size=0), "'chunk_size' must be a positive int"),
    (dict(chunk_size=2.0), "'chunk_size' must be a positive int"),
    (dict(D=torch.randn(5)), r"'D' must have shape \(4\)"),
    (dict(D=torch.randn(4, 3)), r"'D' must have shape \(4, 8\)"),
    (dict(z=torch.randn(1, 10, 4, 7)), "'z' must have shape"),
    (dict(initial_states=torch.randn(1, 4, 8, 7)), "'initial_states' must have shape"),
    (dict(seq_idx=torch.zeros(1, 10)), "'seq_idx' must have dtype"),
    (dict(seq_idx=torch.zeros(1, 9, dtype=torch.int32)), "'seq_idx' must have shape"),
    (dict(dt_limit=(1.0, 0.5)), "'dt_limit' must be a pair"),
    (dict(return_varlen_states=True), "needs argument 'cu_seqlens'"),
    (dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), "'cu_seqlens' must be non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])), "must have dtype"),
])
def test_bad_input_is_named(over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ssd_scan(**_args(**over))


def test_cu_seqlens_needs_batch_one():
    inputs = make(2, 10, H, 8, 1, 8)
    with pytest.raises(ValueError, match="batch 1"):
        ssd_scan(*[inputs[k] for k in ("x", "dt", "A", "B", "C")], 4,
                 cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))


@pytest.mark.parametrize("chunk", [13, 16384, 2**61 - 1])
def test_chunk_past_the_length_is_clamped_with_the_same_result(backend, chunk, monkeypatch):
    """A chunk longer than the sequence runs as one chunk of L steps: same result as chunk_size=L, and the
    backend never sees the caller's value (2**61 - 1 looped forever, 16384 allocated 4 GiB for L=12)."""
    seen: list[int] = []
    impl = registry.get_implementation("ssd_scan", backend)
    forward = impl.forward

    def spy(*args, **kwargs):
        seen.append(args[7])  # (x, dt, A, B, C, initial_states, seq_idx, chunk_size, ...)
        return forward(*args, **kwargs)

    monkeypatch.setattr(impl, "forward", spy)
    inputs = make(2, 12, H, 8, 2, 16, seed=5)
    got = run(ssd_scan, inputs, chunk, backend=backend)
    want = run(ssd_scan, inputs, 12, backend=backend)
    assert seen and set(seen) == {12}
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    for name in GRAD_NAMES:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=0, atol=0)


def test_chunk_is_bounded_by_max_chunk_size():
    assert effective_chunk_size(2**61 - 1, 12) == 12
    assert effective_chunk_size(64, 12) == 12
    assert effective_chunk_size(64, 1000) == 64
    assert effective_chunk_size(10**9, 10**6) == MAX_CHUNK_SIZE
    assert effective_chunk_size(5, 0) == 1
