"""causal_conv1d / causal_conv1d_update: every backend against the reference, outputs and gradients, on a
transcription of the causal-conv1d package's test grids (seqlens 1..4096, widths 2-4, bias, SiLU,
channel-last x, seq_idx, initial and final states; the update with cache_seqlens and conv_state_indices),
subsampled deterministically per backend; plus checks of the reference's semantics against independent
constructions (packed sequences = separate calls, chunked calls with carried states = one call)."""

import importlib
import itertools
import random

import pytest
import torch

from fastarch.ops.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from tests._tolerance import assert_fa_close

BACKENDS = ["torch", "cpp", "triton"]

# -- the forward/backward grid ------------------------------------------------------------------------------
SEQLENS = [1, 2, 8, 16, 32, 64, 128, 129, 130, 151, 256, 372, 512, 784, 1024, 1025, 2048, 4096]
MODES = ["plain", "seq_idx", "initial_states", "final_states", "initial+final"]
REST = list(itertools.product([2, 3, 4], [False, True], [None, "silu"], [False, True], MODES))


def _grid(backend: str) -> list[tuple]:
    """(L, width, has_bias, activation, channel_last, mode): every seqlen, a fixed random subset of the other
    parameters per seqlen (the C++ backend gets the most; the interpreter only short rows)."""
    per_len, max_len = {"cpp": 6, "torch": 2, "triton": 3}[backend], {"cpp": 4096, "torch": 1025, "triton": 151}[backend]
    rng = random.Random(f"conv-{backend}")
    return [(L, *rest) for L in SEQLENS if L <= max_len for rest in rng.sample(REST, per_len)]


def _packed_seq_idx(batch: int, L: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, L) int32: each row cut at random points into consecutive sequences 0, 1, 2, ..."""
    rows = []
    for _ in range(batch):
        cuts = torch.zeros(L, dtype=torch.int32)
        if L > 1:
            cuts[torch.randint(1, L, (min(4, L - 1),), generator=gen)] = 1
        rows.append(cuts.cumsum(0, dtype=torch.int32))
    return torch.stack(rows)


def _inputs(L, width, has_bias, channel_last, mode, dim, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, last_dim_first=False):
        if last_dim_first and channel_last:  # (batch, dim, n) stored as (batch, n, dim)
            return torch.randn(shape[0], shape[2], shape[1], generator=gen).transpose(1, 2)
        return torch.randn(*shape, generator=gen)

    x = t(batch, dim, L, last_dim_first=True)
    w = torch.randn(dim, width, generator=gen) * 0.5
    b = torch.randn(dim, generator=gen) if has_bias else None
    seq = _packed_seq_idx(batch, L, gen) if mode == "seq_idx" else None
    init = t(batch, dim, width - 1, last_dim_first=True) if mode in ("initial_states", "initial+final") else None
    return x, w, b, seq, init, mode in ("final_states", "initial+final")


def _run(fn, x, w, b, seq, init, final, activation, dgen_seed=1, **kw):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b, init)]
    xl, wl, bl, il = leaves
    res = fn(xl, wl, bl, activation, seq_idx=seq, initial_states=il, return_final_states=final, **kw)
    out, fin = res if final else (res, None)
    gen = torch.Generator().manual_seed(dgen_seed)
    loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
    if fin is not None:
        loss = loss + (fin.float() * torch.randn(fin.shape, generator=gen)).sum()
    loss.backward()
    return out, fin, [None if t is None else t.grad for t in leaves]


def _check(backend, L, width, has_bias, activation, channel_last, mode, dim):
    x, w, b, seq, init, final = _inputs(L, width, has_bias, channel_last, mode, dim)
    out, fin, grads = _run(causal_conv1d, x, w, b, seq, init, final, activation, backend=backend)
    rout, rfin, rgrads = _run(causal_conv1d_ref, x, w, b, seq, init, final, activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-5)
    if final:
        assert fin.shape == (x.shape[0], dim, width - 1)
        torch.testing.assert_close(fin, rfin, rtol=0, atol=0)
    for name, g, r in zip(("dx", "dweight", "dbias", "dinitial_states"), grads, rgrads):
        if r is None:
            assert g is None, name
            continue
        scale = max(r.abs().max().item() if r.numel() else 0.0, 1.0)  # dweight/dbias sum over batch x L
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend,L,width,has_bias,activation,channel_last,mode",
                         [(bk, *c) for bk in BACKENDS for c in _grid(bk)])
def test_grid_matches_reference(backend, L, width, has_bias, activation, channel_last, mode):
    _check(backend, L, width, has_bias, activation, channel_last, mode, dim=16 if backend == "triton" else 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 5])
def test_other_widths(backend, width):
    # Beyond the package's 2..4: width 1 (no state at all) and 5.
    for mode in ("seq_idx", "initial+final"):
        _check(backend, 19, width, True, "silu", False, mode, dim=6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seq_idx_is_separate_sequences(backend):
    """Packed rows give what each sequence gives on its own (an oracle independent of the reference)."""
    dim, width, L = 6, 4, 40
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, dim, L, generator=gen), torch.randn(dim, width, generator=gen), torch.randn(dim)
    seq = _packed_seq_idx(2, L, gen)
    out = causal_conv1d(x, w, b, "silu", seq_idx=seq, backend=backend)
    for row in range(2):
        for s in seq[row].unique():
            cols = (seq[row] == s).nonzero().flatten()
            alone = causal_conv1d(x[row:row + 1, :, cols], w, b, "silu", backend=backend)
            torch.testing.assert_close(out[row:row + 1, :, cols], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("activation", [None, "silu"])
def test_channel_last_slice_matches_contiguous(backend, mode, activation):
    """x as a transposed slice of a wider (B, L, D') projection (strides (L*D', 1, D')): the output keeps the
    channel-last layout, and outputs, final states and every gradient equal the contiguous input's and the
    reference's."""
    dim, width, L, wide = 24, 4, 300, 40
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, L, wide, generator=gen)[..., 3:3 + dim].transpose(1, 2)
    assert x.stride() == (L * wide, 1, wide)
    _, w, b, seq, init, final = _inputs(L, width, True, False, mode, dim, seed=6)
    out, fin, grads = _run(causal_conv1d, x, w, b, seq, init, final, activation, backend=backend)
    cout, cfin, cgrads = _run(causal_conv1d, x.contiguous(), w, b, seq, init, final, activation, backend=backend)
    rout, _, rgrads = _run(causal_conv1d_ref, x, w, b, seq, init, final, activation)
    assert out.stride() == (L * dim, 1, dim)
    torch.testing.assert_close(out, cout, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-5)
    if final:
        torch.testing.assert_close(fin, cfin, rtol=0, atol=0)
    for name, g, c, r in zip(("dx", "dweight", "dbias", "dinitial_states"), grads, cgrads, rgrads):
        if r is None:
            assert g is None, name
            continue
        scale = max(r.abs().max().item(), 1.0)
        torch.testing.assert_close(g, c, rtol=1e-6, atol=1e-6 * scale, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_channel_last_rejects_other_strides():
    # The C++ kernels read contiguous or unit-stride-over-dim inputs; the glue hands them nothing else.
    mod = importlib.import_module("fastarch.ops.causal_conv1d")
    x = torch.randn(2, 8, 30)[:, ::2]  # stride 2 over dim
    assert not mod._channel_last(x)
    lib = mod.CppCausalConv1d().lib
    with pytest.raises(RuntimeError, match="contiguous or channel-last"):
        lib.causal_conv1d_fwd(x, torch.randn(4, 3), None, None, None, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [1, 2, 17])  # the first chunk shorter than, equal to, longer than width - 1
def test_chunks_with_carried_states_equal_one_call(backend, split):
    dim, width, L = 5, 4, 30
    x, w, b = torch.randn(2, dim, L), torch.randn(dim, width), torch.randn(dim)
    whole = causal_conv1d(x, w, b, "silu", backend=backend)
    first, state = causal_conv1d(x[..., :split], w, b, "silu", return_final_states=True, backend=backend)
    # The package writes final states into a caller's (batch, width - 1, dim) channel-last buffer.
    buf = torch.empty(2, width - 1, dim).transpose(1, 2)
    second, fin = causal_conv1d(x[..., split:], w, b, "silu", initial_states=state, return_final_states=True,
                                final_states_out=buf, backend=backend)
    assert fin is buf
    torch.testing.assert_close(torch.cat([first, second], -1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf, x[..., -(width - 1):])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16(backend):
    x = torch.randn(2, 8, 33).half()
    w, b = torch.randn(8, 4), torch.randn(8)
    init = torch.randn(2, 8, 3).half()
    out, fin = causal_conv1d(x, w, b, "silu", initial_states=init, return_final_states=True, backend=backend)
    assert out.dtype == torch.float16 and fin.dtype == torch.float16
    ref32 = causal_conv1d_ref(x.float(), w, b, "silu", initial_states=init.float())
    assert_fa_close(out, ref32, causal_conv1d_ref(x, w, b, "silu", initial_states=init))
    torch.testing.assert_close(fin, x[..., -3:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors(backend):
    x, w = torch.randn(2, 4, 5), torch.randn(4, 3)
    with pytest.raises(NotImplementedError, match="activation"):
        causal_conv1d(x, w, activation="relu", backend=backend)
    with pytest.raises(ValueError, match="'weight'"):
        causal_conv1d(x, torch.randn(3, 3), backend=backend)
    with pytest.raises(ValueError, match="'bias'"):
        causal_conv1d(x, w, torch.randn(5), backend=backend)
    with pytest.raises(ValueError, match="'x'"):
        causal_conv1d(x[0], w, backend=backend)
    with pytest.raises(ValueError, match="'seq_idx'"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 4, dtype=torch.int32), backend=backend)
    with pytest.raises(TypeError, match="'seq_idx'"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 5), backend=backend)
    with pytest.raises(ValueError, match="'initial_states'"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 5, dtype=torch.int32), initial_states=torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match="'return_final_states'"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 5, dtype=torch.int32), return_final_states=True)
    with pytest.raises(ValueError, match="'initial_states'"):
        causal_conv1d(x, w, initial_states=torch.randn(2, 4, 3), backend=backend)
    buf = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="'final_states_out'"):
        causal_conv1d(x, w, return_final_states=True, final_states_out=buf, backend=backend)
    assert not buf.any()


# -- the decode step --------------------------------------------------------------------------------------
UPDATE_REST = list(itertools.product([2, 3, 4], [False, True], [None, "silu"], [0, 1, 4], [False, True],
                                     [False, True]))  # width, bias, activation, extra state, circular, indices


def _update_grid(backend: str) -> list[tuple]:
    per_len = {"cpp": 12, "torch": 4, "triton": 4}[backend]
    rng = random.Random(f"update-{backend}")
    return [(T, *rest) for T in (1, 2, 3, 4, 8) for rest in rng.sample(UPDATE_REST, per_len)]


def _update_inputs(T, width, has_bias, extra, circular, indices, dim=16, batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = width - 1 + extra
    rows = batch + 2 if indices else batch
    state = torch.randn(rows, dim, S, generator=gen)
    x = torch.randn(batch, dim, T, generator=gen)
    w = torch.randn(dim, width, generator=gen)
    b = torch.randn(dim, generator=gen) if has_bias else None
    seqlens = torch.randint(0, 50, (batch,), generator=gen, dtype=torch.int32) if circular else None
    idx = torch.randperm(rows, generator=gen)[:batch].to(torch.int32) if indices else None
    return x, state, w, b, seqlens, idx


@pytest.mark.parametrize("backend,T,width,has_bias,activation,extra,circular,indices",
                         [(bk, *c) for bk in BACKENDS for c in _update_grid(bk)])
def test_update_grid_matches_reference(backend, T, width, has_bias, activation, extra, circular, indices):
    x, state, w, b, seqlens, idx = _update_inputs(T, width, has_bias, extra, circular, indices)
    ref_state = state.clone()
    ref = causal_conv1d_update_ref(x, ref_state, w, b, activation, seqlens, idx)
    out = causal_conv1d_update(x, state, w, b, activation, seqlens, idx, backend=backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)
    if T == 1:  # the (batch, dim) form
        state2 = state.clone()
        out1 = causal_conv1d_update(x[..., 0], state2, w, b, activation, seqlens, idx, backend=backend)
        assert out1.shape == x.shape[:2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width,state_len,activation", [(2, 0, "silu"), (3, 1, None), (4, 0, "silu"),
                                                         (4, 2, None)])  # state_len: slots beyond width - 1
def test_update_matches_full(backend, width, state_len, activation):
    x = torch.randn(2, 4, 9)
    w, b = torch.randn(4, width), torch.randn(4)
    full = causal_conv1d_ref(x, w, b, activation)
    state = torch.zeros(2, 4, width - 1 + state_len)
    steps = [causal_conv1d_update(x[:, :, t], state, w, b, activation, backend=backend) for t in range(9)]
    torch.testing.assert_close(torch.stack(steps, -1), full, rtol=1e-5, atol=1e-5)
    keep = width - 1 + state_len
    torch.testing.assert_close(state, x[..., -keep:])
    # Several steps at once (T=4 then T=5, more than the state holds) give the same thing.
    state2 = torch.zeros(2, 4, width - 1 + state_len)
    multi = torch.cat([causal_conv1d_update(x[:, :, :4], state2, w, b, activation, backend=backend),
                       causal_conv1d_update(x[:, :, 4:], state2, w, b, activation, backend=backend)], -1)
    torch.testing.assert_close(multi, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state2, state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_len", [3, 5, 8])
def test_circular_update_streams_like_full(backend, state_len):
    """Chunks through a circular state (input i at i % S) continue the full convolution; rows of a bigger
    state picked by conv_state_indices, the others untouched."""
    dim, width, L = 4, 4, 23
    x, w, b = torch.randn(2, dim, L), torch.randn(dim, width), torch.randn(dim)
    full = causal_conv1d_ref(x, w, b, "silu")
    state = torch.randn(5, dim, state_len)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    state[idx] = 0.0
    untouched = state[[1, 2, 4]].clone()
    outs, pos = [], 0
    for T in (1, 2, 7, 1, 3, 9):
        seqlens = torch.full((2,), pos, dtype=torch.int32)
        outs.append(causal_conv1d_update(x[..., pos:pos + T], state, w, b, "silu", seqlens, idx, backend=backend))
        pos += T
    torch.testing.assert_close(torch.cat(outs, -1), full, rtol=1e-5, atol=1e-5)
    for i in range(L - state_len, L):
        torch.testing.assert_close(state[idx][..., i % state_len], x[..., i])
    assert torch.equal(state[[1, 2, 4]], untouched)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_fp16_noncontiguous_state(backend):
    x, w, b = torch.randn(2, 6, 5).half(), torch.randn(6, 4), torch.randn(6)
    full = causal_conv1d_ref(x.float(), w, b, "silu")
    # An fp16 state and a non-contiguous fp32 state (a transposed view) are both shifted in place.
    for state in (torch.zeros(2, 6, 3).half(), torch.zeros(3, 6, 2).transpose(0, 2)):
        outs = [causal_conv1d_update(x[:, :, t], state, w, b, "silu", backend=backend) for t in range(5)]
        assert outs[0].dtype == torch.float16
        torch.testing.assert_close(torch.stack(outs, -1).float(), full, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state.float(), x[..., -3:].float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_errors_leave_state_untouched(backend):
    w = torch.randn(4, 3)
    state = torch.randn(2, 4, 2)
    before = state.clone()
    x = torch.randn(2, 4)
    i32 = dict(dtype=torch.int32)
    bad = [
        (ValueError, "'conv_state'", dict(conv_state=torch.randn(2, 4, 1))),
        (ValueError, "'bias'", dict(bias=torch.randn(3))),
        (ValueError, "'weight'", dict(weight=torch.randn(3, 3))),
        (NotImplementedError, "activation", dict(activation="gelu")),
        (TypeError, "'x'", dict(x=x.long())),
        (ValueError, "'cache_seqlens'", dict(cache_seqlens=torch.tensor([3, -1], **i32))),
        (ValueError, "'cache_seqlens'", dict(cache_seqlens=torch.tensor([3], **i32))),
        (TypeError, "'cache_seqlens'", dict(cache_seqlens=torch.tensor([3.0, 1.0]))),
        (IndexError, "'conv_state_indices'", dict(conv_state_indices=torch.tensor([0, 2], **i32))),
        (IndexError, "'conv_state_indices'", dict(conv_state_indices=torch.tensor([-2, 0], **i32))),
        (ValueError, "'conv_state_indices'", dict(conv_state_indices=torch.tensor([1, 1], **i32))),
    ]
    for exc, match, change in bad:
        args = dict(x=x, conv_state=state, weight=w, bias=None, activation=None, cache_seqlens=None,
                    conv_state_indices=None)
        args.update(change)
        with pytest.raises(exc, match=match):
            causal_conv1d_update(**args, backend=backend)
        assert torch.equal(state, before), match


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_opcheck(backend):
    """The custom ops' fake (meta) functions, autograd registration and schemas agree with the kernels."""
    x, w, b = torch.randn(2, 4, 9, requires_grad=True), torch.randn(4, 3, requires_grad=True), torch.randn(4)
    init = torch.randn(2, 4, 2, requires_grad=True)
    seq = torch.tensor([[0] * 4 + [1] * 5, [0] * 9], dtype=torch.int32)
    fwd = torch.ops.fastarch.causal_conv1d_fwd.default
    torch.library.opcheck(fwd, (x, w, b, None, init, True, backend))
    torch.library.opcheck(fwd, (x, w, None, seq, None, False, backend))
    state = torch.randn(3, 4, 5)
    torch.library.opcheck(torch.ops.fastarch.causal_conv1d_update.default,
                          (torch.randn(2, 4, 3), state, w.detach(), b, True, torch.tensor([1, 7], dtype=torch.int32),
                           torch.tensor([2, 0], dtype=torch.int32), backend))
