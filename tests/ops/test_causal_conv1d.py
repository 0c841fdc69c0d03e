"""causal_conv1d / causal_conv1d_update against the reference (F.conv1d), outputs and gradients."""

import pytest
import torch

from fastarch.ops.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update
from tests._tolerance import assert_fa_close


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("L", [1, 37])
def test_matches_reference(backend, width, activation, has_bias, L):
    x = torch.randn(2, 5, L, requires_grad=True)
    w = torch.randn(5, width, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if has_bias else None
    out = causal_conv1d(x, w, b, activation, backend=backend)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], go)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if has_bias else None
    ref = causal_conv1d_ref(x2, w2, b2, activation)
    rgrads = torch.autograd.grad(ref, [t for t in (x2, w2, b2) if t is not None], go)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, rgrads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_fp16(backend):
    x = torch.randn(2, 8, 33).half()
    w, b = torch.randn(8, 4), torch.randn(8)
    out = causal_conv1d(x, w, b, "silu", backend=backend)
    assert out.dtype == torch.float16
    ref32 = causal_conv1d_ref(x.float(), w, b, "silu")
    assert_fa_close(out, ref32, causal_conv1d_ref(x, w, b, "silu"))


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("state_len", [0, 1])  # extra slots beyond width - 1
def test_update_matches_full(width, state_len):
    x = torch.randn(2, 4, 9)
    w, b = torch.randn(4, width), torch.randn(4)
    full = causal_conv1d(x, w, b, "silu")
    state = torch.zeros(2, 4, width - 1 + state_len)
    steps = [causal_conv1d_update(x[:, :, t], state, w, b, "silu") for t in range(9)]
    torch.testing.assert_close(torch.stack(steps, -1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[..., -(width - 1):], x[..., -(width - 1):]) if width > 1 else None
    # Several steps at once give the same thing.
    state2 = torch.zeros(2, 4, width - 1 + state_len)
    multi = torch.cat([causal_conv1d_update(x[:, :, :4], state2, w, b, "silu"),
                       causal_conv1d_update(x[:, :, 4:], state2, w, b, "silu")], -1)
    torch.testing.assert_close(multi, full, rtol=1e-5, atol=1e-5)


def test_errors_and_no_mutation_on_error():
    x, w = torch.randn(2, 4, 5), torch.randn(4, 3)
    with pytest.raises(NotImplementedError, match="activation"):
        causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match="'weight'"):
        causal_conv1d(x, torch.randn(3, 3))
    with pytest.raises(ValueError, match="'bias'"):
        causal_conv1d(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="'x'"):
        causal_conv1d(x[0], w)
    state = torch.randn(2, 4, 2)
    before = state.clone()
    with pytest.raises(ValueError, match="'conv_state'"):
        causal_conv1d_update(torch.randn(2, 4), torch.randn(2, 4, 1), w)
    with pytest.raises(ValueError, match="'bias'"):
        causal_conv1d_update(torch.randn(2, 4), state, w, torch.randn(3))
    assert torch.equal(state, before)
