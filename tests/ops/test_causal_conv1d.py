"""causal_conv1d / causal_conv1d_update against the reference (F.conv1d), outputs and gradients."""

import pytest
import torch

from fastarch.ops.causal_conv1d import causal_conv1d, causal_conv1d_ref, causal_conv1d_update
from tests._tolerance import assert_fa_close

# (width, activation, has_bias, L): widths 2..4 each with and without SiLU/bias, L=1 (shorter than the
# filter), odd L, and an L spanning several Triton time blocks.
CASES = [(2, None, True, 1), (2, "silu", False, 37), (3, "silu", True, 37), (3, None, False, 1),
         (4, "silu", True, 300), (4, None, True, 37), (4, "silu", False, 1)]


@pytest.mark.op("causal_conv1d")
@pytest.mark.parametrize("width,activation,has_bias,L", CASES)
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


@pytest.mark.op("causal_conv1d")
def test_fp16(backend):
    x = torch.randn(2, 8, 33).half()
    w, b = torch.randn(8, 4), torch.randn(8)
    out = causal_conv1d(x, w, b, "silu", backend=backend)
    assert out.dtype == torch.float16
    ref32 = causal_conv1d_ref(x.float(), w, b, "silu")
    assert_fa_close(out, ref32, causal_conv1d_ref(x, w, b, "silu"))


@pytest.mark.op("causal_conv1d_update")
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


@pytest.mark.op("causal_conv1d_update")
def test_update_fp16_noncontiguous_state(backend):
    x, w, b = torch.randn(2, 6, 5).half(), torch.randn(6, 4), torch.randn(6)
    full = causal_conv1d_ref(x.float(), w, b, "silu")
    # An fp16 state and a non-contiguous fp32 state (a transposed view) are both shifted in place.
    for state in (torch.zeros(2, 6, 3).half(), torch.zeros(3, 6, 2).transpose(0, 2)):
        outs = [causal_conv1d_update(x[:, :, t], state, w, b, "silu", backend=backend) for t in range(5)]
        assert outs[0].dtype == torch.float16
        torch.testing.assert_close(torch.stack(outs, -1).float(), full, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(state.float(), x[..., -3:].float())


@pytest.mark.op("causal_conv1d_update")
def test_errors_and_no_mutation_on_error(backend):
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
        causal_conv1d_update(torch.randn(2, 4), torch.randn(2, 4, 1), w, backend=backend)
    with pytest.raises(ValueError, match="'bias'"):
        causal_conv1d_update(torch.randn(2, 4), state, w, torch.randn(3), backend=backend)
    with pytest.raises(ValueError, match="'weight'"):
        causal_conv1d_update(torch.randn(2, 4), state, torch.randn(3, 3), backend=backend)
    with pytest.raises(NotImplementedError, match="activation"):
        causal_conv1d_update(torch.randn(2, 4), state, w, activation="gelu", backend=backend)
    with pytest.raises(TypeError, match="'x'"):
        causal_conv1d_update(torch.randn(2, 4).long(), state, w, backend=backend)
    assert torch.equal(state, before)
