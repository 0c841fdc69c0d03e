"""causal-conv1d's own test grids (a small part, CPU), through fastarch.compat.causal_conv1d: varlen conv states
against the package's reference (transcribed), packed sequences with padding (seq_idx -1), decode steps with
padded rows (conv_state_indices -1), the final states added in place to a channel-last output, and the
refusals for names the stand-in lacks. Every backend of the ops runs where it is built."""

import pytest
import torch
import torch.nn.functional as F

from fastarch.backend import use_backend
from fastarch.compat._missing import NotProvidedError
from fastarch.compat.causal_conv1d import causal_conv1d_varlen as varlen
from fastarch.compat.causal_conv1d.causal_conv1d_interface import (
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from tests._backends import require_backend


def _varlen_states_oracle(x, cu_seqlens, state_len):
    """The package's reference: per sequence, its last state_len rows right-aligned, zeros before."""
    batch, dim = cu_seqlens.shape[0] - 1, x.shape[1]
    states = torch.zeros(batch, state_len, dim, dtype=x.dtype).transpose(1, 2)
    for i in range(batch):
        end = cu_seqlens[i + 1]
        start = torch.maximum(cu_seqlens[i], end - state_len)
        if end > start:
            states[i, :, -(end - start):] = x[start:end].T
    return states


@pytest.mark.parametrize("itype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 48 + 16])
def test_varlen_states(dim, itype):
    torch.manual_seed(0)
    seqlens = torch.randint(1, 32, (20,))
    x = torch.randn(int(seqlens.sum()), dim, dtype=itype)
    cu_seqlens = F.pad(seqlens.cumsum(0), (1, 0))
    out = varlen.causal_conv1d_varlen_states(x, cu_seqlens, 20)
    want = _varlen_states_oracle(x, cu_seqlens, 20)
    assert torch.equal(out, want) and torch.equal(varlen.causal_conv1d_varlen_states_ref(x, cu_seqlens, 20), want)
    assert out.shape == (20, dim, 20) and out.stride(1) == 1  # channel-last, as the package's
    # empty sequences and state_len 0
    cu = torch.tensor([0, 0, 3, 3])
    assert torch.equal(varlen.causal_conv1d_varlen_states(x, cu, 4), _varlen_states_oracle(x, cu, 4))
    assert varlen.causal_conv1d_varlen_states(x, cu, 0).shape == (3, dim, 0)


def test_varlen_states_refusals():
    x = torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"'cu_seqlens' must be non-decreasing offsets in \[0, 10\]"):
        varlen.causal_conv1d_varlen_states(x, torch.tensor([0, 6, 4]), 3)
    with pytest.raises(ValueError, match=r"'cu_seqlens' must be non-decreasing offsets in \[0, 10\]"):
        varlen.causal_conv1d_varlen_states(x, torch.tensor([0, 11]), 3)
    with pytest.raises(ValueError, match=r"'state_len' must be an int >= 0, got -1"):
        varlen.causal_conv1d_varlen_states(x, torch.tensor([0, 10]), -1)
    with pytest.raises(ValueError, match=r"'x'"):
        varlen.causal_conv1d_varlen_states(x[None], torch.tensor([0, 10]), 3)


def _segments(total, nsplits):
    eos = torch.randperm(total - 1)[:nsplits].sort().values
    return torch.diff(torch.cat([torch.tensor([-1]), eos, torch.tensor([total - 1])])).tolist()


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("silu", [False, True])
def test_varlen_padding(backend, width, silu):
    """seq_idx -1 marks padding: its outputs are exactly 0; each packed sequence matches its own reference."""
    require_backend("causal_conv1d", backend)
    torch.manual_seed(width)
    batch, L, dim = 3, 40, 16
    true_lens = [torch.randint(L // 2, L, (1,)).item() for _ in range(batch)]
    seqlens = [_segments(t, 3) for t in true_lens]
    x = torch.randn(batch, L, dim + 8)[:, :, 4:4 + dim].transpose(1, 2).requires_grad_()
    weight = torch.randn(dim, width, requires_grad=True)
    bias = torch.randn(dim, requires_grad=True)
    rows, counter = [], 0
    for b in range(batch):
        ids = []
        for s in seqlens[b]:
            ids.append(torch.full((s,), counter, dtype=torch.int32))
            counter += 1
        ids.append(torch.full((L - true_lens[b],), -1, dtype=torch.int32))
        rows.append(torch.cat(ids))
    seq_idx = torch.stack(rows)
    act = "silu" if silu else None
    with use_backend(causal_conv1d=backend):
        out = causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation=act)
    want = torch.zeros(batch, dim, L)
    for b in range(batch):
        parts = torch.split(x.detach()[[b], :, :true_lens[b]], seqlens[b], dim=2)
        want[b, :, :true_lens[b]] = torch.cat([causal_conv1d_ref(p, weight, bias, activation=act) for p in parts], 2)
    torch.testing.assert_close(out, want, rtol=3e-4, atol=1e-3)
    assert bool((out.detach()[seq_idx[:, None, :].expand_as(out) < 0] == 0).all())
    out.sum().backward()  # padding passes no gradient to x
    pad_rows = seq_idx < 0
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # a padding column of x is read by no valid output, and its own outputs are 0: its gradient is 0
    assert bool((x.grad.transpose(1, 2)[pad_rows] == 0).all())


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("seqlen", [1, 4])
@pytest.mark.parametrize("circular", [False, True])
def test_update_with_padded_rows(backend, seqlen, circular):
    """conv_state_indices -1: the row's outputs are 0 and no state row changes; the others match the reference
    on their own state rows."""
    require_backend("causal_conv1d_update", backend)
    torch.manual_seed(seqlen)
    batch, dim, width = 8, 32, 4
    state_len = width + 3
    x = torch.randn(batch, seqlen, dim).transpose(-1, -2)
    conv_state = torch.randn(10 * batch, state_len, dim).transpose(-1, -2)
    idx = torch.cat([torch.randperm(10 * batch)[:batch // 2], torch.full((batch // 2,), -1)])
    idx = idx[torch.randperm(batch)].to(torch.int32)
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    cache = torch.randint(0, 64, (batch,), dtype=torch.int32) if circular else None
    before = conv_state.clone()
    with use_backend(causal_conv1d_update=backend):
        out = causal_conv1d_update(x, conv_state, weight, bias, "silu", cache, idx)
    keep = idx != -1
    expected_state = before.clone()
    rows = before[idx[keep].long()].clone()
    want = causal_conv1d_update_ref(x[keep], rows, weight, bias, "silu", None if cache is None else cache[keep])
    expected_state[idx[keep].long()] = rows
    assert bool((out[~keep] == 0).all())
    torch.testing.assert_close(out[keep], want, rtol=3e-4, atol=1e-3)
    assert torch.equal(conv_state, expected_state)


def test_update_index_refusals():
    x, weight = torch.randn(2, 8), torch.randn(8, 4)
    conv_state = torch.randn(4, 8, 3)
    with pytest.raises(IndexError, match=r"'conv_state_indices' must lie in \[0, 4\).*or be -1.*got values in \[-2, 1\]"):
        causal_conv1d_update(x, conv_state, weight, conv_state_indices=torch.tensor([-2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must not repeat a row"):
        causal_conv1d_update(x, conv_state, weight, conv_state_indices=torch.tensor([1, 1], dtype=torch.int32))
    out = causal_conv1d_update(x, conv_state, weight, conv_state_indices=torch.tensor([-1, -1], dtype=torch.int32))
    assert torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_final_states_added_in_place(backend):
    """The package's test adds sigmoid(final_states) to the output in place, channel-last x included."""
    require_backend("causal_conv1d", backend)
    torch.manual_seed(0)
    batch, dim, L, width = 2, 16, 9, 4
    x = torch.randn(batch, L, dim + 8)[:, :, 4:4 + dim].transpose(1, 2).requires_grad_()
    weight = torch.randn(dim, width, requires_grad=True)
    init = torch.randn(batch, width - 1, dim).transpose(1, 2).requires_grad_()
    x_ref, w_ref, init_ref = (t.detach().clone().requires_grad_() for t in (x, weight, init))
    with use_backend(causal_conv1d=backend):
        out, final = causal_conv1d_fn(x, weight, None, initial_states=init, return_final_states=True)
    out_ref, final_ref = causal_conv1d_ref(x_ref, w_ref, None, initial_states=init_ref, return_final_states=True)
    out += torch.sigmoid(final).sum(dim=-1, keepdim=True)
    out_ref += torch.sigmoid(final_ref).sum(dim=-1, keepdim=True)
    torch.testing.assert_close(out, out_ref, rtol=3e-4, atol=1e-3)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for got, want in ((x.grad, x_ref.grad), (weight.grad, w_ref.grad), (init.grad, init_ref.grad)):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_missing_names_refused():
    import fastarch.compat.causal_conv1d as pkg

    with pytest.raises(NotProvidedError, match=r"does not provide causal_conv1d\.causal_conv1d_fwd_function; "
                                               r"it provides .*causal_conv1d\.causal_conv1d_varlen"):
        pkg.causal_conv1d_fwd_function  # noqa: B018
    with pytest.raises(ImportError, match=r"causal_conv1d\.causal_conv1d_varlen\.nope"):
        from fastarch.compat.causal_conv1d.causal_conv1d_varlen import nope  # noqa: F401
