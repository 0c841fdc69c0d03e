"""Drop-in norms and positional encodings against the seed guides' own classes (copied below as the reference)."""


import pytest
import torch
import torch.nn as nn

import fastarch.nn as fnn
from fastarch.testing.guides import LayerNorm003 as GuideLayerNorm
from fastarch.testing.guides import LearnedPositionalEncoding as GuideLearned000
from fastarch.testing.guides import SinusoidalPositionalEncoding003 as GuideSinusoidal


# ---- the guides' definitions not in fastarch.testing.guides (guide 003) --------------------------------
class GuideBatchNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.register_buffer("running_mean", torch.zeros(d_model))
        self.register_buffer("running_var", torch.ones(d_model))
        self.training = True

    def forward(self, x):
        if self.training:
            batch_mean = x.mean(dim=(0, 1))
            batch_var = x.var(dim=(0, 1), unbiased=False)
            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * batch_mean
            self.running_var = (1 - self.momentum) * self.running_var + self.momentum * batch_var
            x_norm = (x - batch_mean) / torch.sqrt(batch_var + self.eps)
        else:
            x_norm = (x - self.running_mean) / torch.sqrt(self.running_var + self.eps)
        return self.gamma * x_norm + self.beta


class GuideRotary(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        self.d_model = d_model
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2).float() / d_model))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q, k):
        batch_size, seq_len, n_heads, d_head = q.shape
        pos = torch.arange(seq_len, device=q.device).float()
        sincos = torch.einsum("i,j->ij", pos, self.inv_freq)
        sin = sincos.sin()[None, :, None, :]
        cos = sincos.cos()[None, :, None, :]
        return self.apply_rotary(q, sin, cos), self.apply_rotary(k, sin, cos)

    def apply_rotary(self, x, sin, cos):
        x1 = x[..., 0::2]
        x2 = x[..., 1::2]
        y1 = x1 * cos - x2 * sin
        y2 = x1 * sin + x2 * cos
        return torch.stack([y1, y2], dim=-1).flatten(-2)


def _same_weights(ours, theirs):
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_layer_norm_matches_guide(backend):
    import fastarch

    ours, theirs = fnn.LayerNorm(48), GuideLayerNorm(48)
    with torch.no_grad():
        ours.gamma.normal_()
        ours.beta.normal_()
    _same_weights(ours, theirs)
    x = torch.randn(3, 5, 48, requires_grad=True)
    with fastarch.use_backend(layer_norm=backend):
        y = ours(x)
        g = torch.autograd.grad(y.square().sum(), (x, ours.gamma, ours.beta))
    yr = theirs(x)
    gr = torch.autograd.grad(yr.square().sum(), (x, theirs.gamma, theirs.beta))
    torch.testing.assert_close(y, yr, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_batch_norm_matches_guide_train_and_eval():
    ours, theirs = fnn.BatchNorm(16), GuideBatchNorm(16)
    with torch.no_grad():
        ours.gamma.normal_()
        ours.beta.normal_()
    _same_weights(ours, theirs)
    for _ in range(3):
        x = torch.randn(4, 7, 16) * 3 + 1
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean.detach())
    torch.testing.assert_close(ours.running_var, theirs.running_var.detach())
    assert not ours.running_mean.requires_grad
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_sinusoidal_matches_guide():
    ours, theirs = fnn.SinusoidalPositionalEncoding(32, 100), GuideSinusoidal(32, 100)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 17, 32)
    torch.testing.assert_close(ours(x), theirs(x))
    assert fnn.SinusoidalPositionalEncoding(7, 10)(torch.zeros(1, 3, 7)).shape == (1, 3, 7)  # odd width works


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_rotary_matches_guide(backend):
    import fastarch

    ours, theirs = fnn.RotaryPositionalEncoding(16), GuideRotary(16)
    _same_weights(ours, theirs)
    q, k = torch.randn(2, 9, 3, 16), torch.randn(2, 9, 3, 16)
    with fastarch.use_backend(rotary=backend):
        qo, ko = ours(q, k)
    qr, kr = theirs(q, k)
    torch.testing.assert_close(qo, qr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ko, kr, atol=1e-5, rtol=1e-5)
    # Decoding one token at position 8 equals the last row of the full pass.
    q8, _ = ours(q[:, 8:9], k[:, 8:9], offset=8)
    torch.testing.assert_close(q8, qr[:, 8:9], atol=1e-5, rtol=1e-5)


def test_learned_matches_guide_000():
    ours, theirs = fnn.LearnedPositionalEncoding(24, 50, dropout=0.0), GuideLearned000(24, 50, dropout=0.0)
    _same_weights(ours, theirs)
    x = torch.randn(3, 11, 24)
    torch.testing.assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match="max_len"):
        ours(torch.randn(1, 51, 24))


def test_fused_layer_norm_matches_torch():
    ref = nn.LayerNorm((4, 6))
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = fnn.FusedLayerNorm((4, 6))
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 4, 6, requires_grad=True)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="normalized_shape"):
        ours(torch.randn(3, 6, 4))


def test_rms_norm_module_trains():
    m = nn.Sequential(nn.Linear(8, 8), fnn.RMSNorm(8), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    first = None
    for _ in range(30):
        loss = (m(x) - y).pow(2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first
