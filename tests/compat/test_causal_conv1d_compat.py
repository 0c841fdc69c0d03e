"""fastarch.compat.causal_conv1d: the package's signatures, positional order, defaults and return values,
run through the compat names on every backend."""

import inspect

import pytest
import torch

from fastarch.backend import use_backend
from fastarch.compat import causal_conv1d as pkg
from fastarch.compat.causal_conv1d import causal_conv1d_interface as iface
from tests._backends import require_backend
from tests._inplace import assert_bits_equal, bits, nan_poisoned

BACKENDS = ["torch", "cpp", "triton"]

SIGNATURES = {
    "causal_conv1d_fn": [("x", inspect.Parameter.empty), ("weight", inspect.Parameter.empty), ("bias", None),
                         ("seq_idx", None), ("initial_states", None), ("return_final_states", False),
                         ("final_states_out", None), ("activation", None)],
    "causal_conv1d_ref": [("x", inspect.Parameter.empty), ("weight", inspect.Parameter.empty), ("bias", None),
                          ("initial_states", None), ("return_final_states", False), ("final_states_out", None),
                          ("activation", None)],
    "causal_conv1d_update": [("x", inspect.Parameter.empty), ("conv_state", inspect.Parameter.empty),
                             ("weight", inspect.Parameter.empty), ("bias", None), ("activation", None),
                             ("cache_seqlens", None), ("conv_state_indices", None)],
    "causal_conv1d_update_ref": [("x", inspect.Parameter.empty), ("conv_state", inspect.Parameter.empty),
                                 ("weight", inspect.Parameter.empty), ("bias", None), ("activation", None),
                                 ("cache_seqlens", None)],
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures(name):
    params = inspect.signature(getattr(iface, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == SIGNATURES[name]
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


def test_package_exports():
    assert pkg.causal_conv1d_fn is iface.causal_conv1d_fn
    assert pkg.causal_conv1d_update is iface.causal_conv1d_update


@pytest.mark.parametrize("backend", BACKENDS)
def test_positional_calls(backend):
    dim, width, L = 8, 4, 21
    x = torch.randn(2, L, dim).transpose(1, 2).requires_grad_()  # channel-last, as Mamba-2 passes it
    w, b = torch.randn(dim, width, requires_grad=True), torch.randn(dim, requires_grad=True)
    init = torch.randn(2, dim, width - 1, requires_grad=True)
    with use_backend(backend):
        out, fin = iface.causal_conv1d_fn(x, w, b, None, init, True, None, "silu")
    rout, rfin = iface.causal_conv1d_ref(x, w, b, init, True, None, "silu")
    torch.testing.assert_close(out, rout, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin, rfin)
    grads = torch.autograd.grad((out.sum() + fin.sum()), (x, w, b, init))
    rgrads = torch.autograd.grad((rout.sum() + rfin.sum()), (x, w, b, init))
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    # seq_idx is the fourth positional argument; a plain call returns a tensor, not a tuple.
    seq = torch.zeros(2, L, dtype=torch.int32)
    seq[:, 10:] = 1
    with use_backend(backend):
        packed = iface.causal_conv1d_fn(x, w, b, seq, None, False, None, "swish")
        second = iface.causal_conv1d_fn(x[..., 10:], w, b, activation="silu")
    assert isinstance(packed, torch.Tensor)
    torch.testing.assert_close(packed[..., 10:], second, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_positional_and_circular(backend):
    dim, width, S = 6, 4, 5
    x, w, b = torch.randn(3, dim), torch.randn(dim, width), torch.randn(dim)
    state = torch.randn(3, dim, S)
    seqlens = torch.tensor([0, 4, 11], dtype=torch.int32)
    ref_state = state.clone()
    ref = iface.causal_conv1d_update_ref(x, ref_state, w, b, "silu", seqlens)
    with use_backend(backend):
        out = iface.causal_conv1d_update(x, state, w, b, "silu", seqlens, None)
    assert out.shape == (3, dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state)
    # The new input landed at cache_seqlens % S of each row.
    for row, c in enumerate(seqlens.tolist()):
        torch.testing.assert_close(state[row, :, c % S], x[row])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["seqlens_negative", "seqlens_past_int32", "indices_repeat", "expanded_state",
                                 "activation"])
def test_update_rejection_keeps_conv_state_bits(backend, bad):
    """A refused causal_conv1d_update leaves conv_state bit-identical (NaN payloads included)."""
    require_backend("causal_conv1d_update", backend)
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(2, 6, generator=g), torch.randn(6, 4, generator=g)
    state = nan_poisoned(torch.randn(2, 6, 5, generator=g))
    target = state
    args: list = [x, state, w, None, None, None, None]
    if bad == "seqlens_negative":
        args[5] = torch.tensor([-1, 0], dtype=torch.int32)
    elif bad == "seqlens_past_int32":
        args[5] = torch.tensor([2**40, 0])
    elif bad == "indices_repeat":
        args[6] = torch.tensor([1, 1], dtype=torch.int32)
    elif bad == "expanded_state":
        args[1] = state[:1].expand(2, 6, 5)
    else:
        args[4] = "gelu"
    before = bits(target)
    with use_backend(backend), pytest.raises((ValueError, NotImplementedError, IndexError)):
        pkg.causal_conv1d_update(*args)
    assert_bits_equal(before, target, "conv_state")
