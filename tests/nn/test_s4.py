"""S4 (S4D): HiPPO init, ZOH, conv mode == recurrent mode, gradients vs a reference, a long-range delay task."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn

from fastarch.nn import S4Block, S4Layer
from fastarch.nn.s4 import hippo_legs_diagonal


@contextlib.contextmanager
def _one_thread():
    # Step-by-step loops are thousands of tiny ops; on a shared 2-core box the intra-op thread pool
    # only adds contention.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _reference_forward(layer: S4Layer, x: torch.Tensor) -> torch.Tensor:
    """Independent reference: ZOH by matrix exponential on the explicit diagonal system, the full
    (H, N, L) Vandermonde kernel in complex128, a direct O(L^2) causal convolution."""
    h = layer.d_model
    dt = torch.exp(layer.log_dt.double())
    a = torch.complex(-torch.exp(layer.log_A_real.double()), layer.A_imag.double())
    b = torch.view_as_complex(layer.B.double())
    c = torch.view_as_complex(layer.C.double())
    a_bar = torch.linalg.matrix_exp(torch.diag_embed(a * dt[:, None])).diagonal(dim1=-2, dim2=-1)
    b_bar = (a_bar - 1) / a * b
    L = x.shape[1]
    pos = torch.arange(L, dtype=torch.float64)
    k = 2 * (c[..., None] * b_bar[..., None] * a_bar[..., None] ** pos).sum(1).real     # (H, L)
    u = x.double().transpose(1, 2)                                                     # (B, H, L)
    toeplitz = torch.zeros(h, L, L, dtype=torch.float64)
    idx = torch.arange(L)
    diff = idx[:, None] - idx[None, :]
    toeplitz = torch.where(diff >= 0, k[:, diff.clamp_min(0)], toeplitz)
    y = torch.einsum("hij,bhj->bhi", toeplitz, u) + layer.D.double()[:, None] * u
    return layer._post(y.transpose(1, 2).float())


def test_hippo_legs_diagonal():
    a, b = hippo_legs_diagonal(16)
    assert a.shape == (8,) and b.shape == (8,)
    torch.testing.assert_close(a.real, torch.full((8,), -0.5))
    assert (a.imag > 0).all() and (a.imag.diff() > 0).all()
    # Eigenvalues of the full normal part come in conjugate pairs: check against a dense eigensolve.
    n = torch.arange(16, dtype=torch.float64)
    r = torch.sqrt(2 * n + 1)
    legs = -torch.tril(torch.outer(r, r), -1) - torch.diag(n + 1)
    p = torch.sqrt(n + 0.5)
    ev = torch.linalg.eigvals(legs + torch.outer(p, p))
    pos = torch.sort(ev[ev.imag > 0].imag).values
    torch.testing.assert_close(a.imag.double(), pos, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("init", ["lin", "legs"])
def test_init_and_parameters(init):
    m = S4Layer(6, 8, init=init, dt_min=1e-3, dt_max=1e-1)
    dt = m.log_dt.exp()
    assert (dt >= 1e-3 - 1e-9).all() and (dt <= 1e-1 + 1e-9).all()
    _, a_bar, _, _ = m.discretize()
    assert (a_bar.abs() < 1).all(), "ZOH of a stable A must be a contraction"
    if init == "lin":
        torch.testing.assert_close(m.A_imag[0], math.pi * torch.arange(4, dtype=torch.float32))
        torch.testing.assert_close(m.log_A_real.exp(), torch.full((6, 4), 0.5))


@pytest.mark.parametrize("init", ["lin", "legs"])
@pytest.mark.parametrize("L", [1, 97, 4096])
def test_conv_mode_equals_recurrent_mode(init, L):
    torch.manual_seed(1)
    m = S4Layer(3, 8, dropout=0.0, init=init).eval()
    x = torch.randn(2, L, 3)
    with torch.no_grad(), _one_thread():
        conv = m(x)
        rec = m.forward_recurrent(x)
    torch.testing.assert_close(conv, rec, rtol=1e-4, atol=1e-4 * conv.abs().max().item())


def test_block_step_matches_forward():
    blk = S4Block(8, 8, dropout=0.0).eval()
    x = torch.randn(2, 50, 8)
    with torch.no_grad(), _one_thread():
        state = blk.allocate_state(2)
        ys = []
        for t in range(50):
            y, state = blk.step(x[:, t], state)
            ys.append(y)
        torch.testing.assert_close(torch.stack(ys, 1), blk(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_forward_and_gradients_against_reference(backend):
    torch.manual_seed(2)
    m = S4Layer(4, 8, dropout=0.0, init="legs", backend=backend)
    x = torch.randn(2, 60, 4, requires_grad=True)
    out = m(x)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *m.parameters()], g)
    x2 = x.detach().clone().requires_grad_()
    ref = _reference_forward(m, x2)
    rgrads = torch.autograd.grad(ref, [x2, *m.parameters()], g)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, a, r in zip(names, grads, rgrads):
        torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-4 * max(1.0, r.abs().max().item()),
                                   msg=f"grad of {name}")


def test_low_precision_input():
    m = S4Layer(4, 8, dropout=0.0).eval()
    x = torch.randn(1, 33, 4)
    y16 = copy.deepcopy(m).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), m(x), rtol=0.05, atol=0.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="d_state must be an even number"):
        S4Layer(4, 7)
    with pytest.raises(ValueError, match="init must be"):
        S4Layer(4, 8, init="random")
    m = S4Layer(4, 8)
    with pytest.raises(ValueError, match="argument 'x' must have shape"):
        m(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="argument 'x_t' must have shape"):
        m.step(torch.randn(2, 3), m.allocate_state(2))
    with pytest.raises(ValueError, match="argument 'state' must be a complex tensor"):
        m.step(torch.randn(2, 4), torch.zeros(2, 4, 4))


def test_guide_constructors():
    blk = S4Block(16)
    assert blk.ff[0].out_features == 64
    assert set(dict(blk.named_children())) == {"s4", "ff", "norm1", "norm2"}
    assert blk.s4.d_state == 64
    y = blk(torch.randn(2, 10, 16))
    assert y.shape == (2, 10, 16)


class _DelayNet(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.inp = nn.Linear(1, h)
        self.s4 = S4Layer(h, 32, dropout=0.0, dt_min=1e-2, dt_max=1e-1)
        self.out = nn.Linear(h, 1)

    def forward(self, x):
        return self.out(self.s4(self.inp(x)))


def test_long_range_delay_task():
    """y_t = u_{t-100} on white noise, L = 256: only a 100-step memory solves it. Trained S4 does; the
    same network untrained does not (MSE ~ var(u) = 1)."""
    torch.manual_seed(0)
    L, delay = 256, 100

    def batch(n):
        u = torch.randn(n, L, 1)
        y = torch.zeros_like(u)
        y[:, delay:] = u[:, :-delay]
        return u, y

    def mse(net, u, y):
        return ((net(u) - y)[:, delay:] ** 2).mean()

    net = _DelayNet()
    u_val, y_val = batch(64)
    with torch.no_grad():
        untrained = mse(net, u_val, y_val).item()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    with _one_thread():
        for _ in range(300):
            u, y = batch(16)
            loss = mse(net, u, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        trained = mse(net, u_val, y_val).item()
    assert untrained > 0.8, untrained
    assert trained < 0.3, (trained, untrained)


def test_registered_efficient_models():
    from fastarch.models.registry import create_model

    ids = torch.randint(0, 50, (2, 24))
    for name in ("s4_lm_tiny", "performer_lm_tiny", "linformer_encoder_tiny"):
        m = create_model(name, vocab_size=50, d_model=32, dropout=0.0).eval()
        assert m(ids).shape == (2, 24, 50), name
    lm = create_model("s4_lm_tiny", vocab_size=50, d_model=32, d_state=8, dropout=0.0).eval()
    with torch.no_grad(), _one_thread():
        state = lm.allocate_state(2)
        steps = []
        for t in range(24):
            logits, state = lm.step(ids[:, t], state)
            steps.append(logits)
        torch.testing.assert_close(torch.stack(steps, 1), lm(ids), rtol=1e-4, atol=1e-4)
    # Causal Performer LM: the prefix's logits do not depend on later tokens.
    p = create_model("performer_lm_tiny", vocab_size=50, d_model=32, dropout=0.0).eval()
    ids2 = ids.clone()
    ids2[:, 12:] = (ids2[:, 12:] + 1) % 50
    torch.testing.assert_close(p(ids2)[:, :12], p(ids)[:, :12], rtol=1e-4, atol=1e-4)
