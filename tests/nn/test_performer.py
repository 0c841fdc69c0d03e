"""Performer (FAVOR+): guide keys, fixed features in eval, redraw schedule, kernel approximation, causal."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.nn import Performer
from fastarch.nn.performer import favor_plus_features, orthogonal_random_features
from fastarch.ops import linear_attention, linear_attention_ref


class GuidePerformer(nn.Module):
    """The seed guide's Performer (000_..., cluster 5.2), copied for key and constructor comparison."""

    def __init__(self, d_model, n_heads, nb_features=256, dropout=0.1):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.nb_features = nb_features
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)


def _softmax_attention(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_state_dict_keys_match_guide_and_load():
    guide = GuidePerformer(32, 4, nb_features=16)
    ours = Performer(32, 4, nb_features=16)
    assert list(ours.state_dict().keys()) == list(guide.state_dict().keys())
    ours.load_state_dict(guide.state_dict(), strict=True)
    for name, p in guide.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], p)
    keep = Performer(32, 4, nb_features=16, persistent_features=True)
    assert "projection_matrix" in keep.state_dict()


def test_eval_mode_is_deterministic_and_training_redraws_on_schedule():
    m = Performer(16, 2, nb_features=8, dropout=0.0, feature_redraw_interval=2)
    x = torch.randn(2, 10, 16)
    m.eval()
    outs = [m(x) for _ in range(5)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
    m.train()
    p0 = m.projection_matrix.clone()
    m(x)
    m(x)
    assert torch.equal(m.projection_matrix, p0), "redrawn before the interval"
    m(x)  # third call: the interval (2) has passed
    assert not torch.equal(m.projection_matrix, p0), "not redrawn after the interval"
    never = Performer(16, 2, nb_features=8, feature_redraw_interval=None)
    p1 = never.projection_matrix.clone()
    for _ in range(4):
        never(x)
    assert torch.equal(never.projection_matrix, p1)


def test_orthogonal_blocks():
    w = orthogonal_random_features(20, 8)
    assert w.shape == (20, 8)
    u = w / w.norm(dim=1, keepdim=True)
    for s in (0, 8):
        g = u[s:s + 8] @ u[s:s + 8].T
        torch.testing.assert_close(g, torch.eye(8), atol=1e-5, rtol=0)


def test_features_are_positive_and_estimate_the_softmax_kernel():
    torch.manual_seed(1)
    d = 8
    q = torch.randn(1, 1, 6, d) * 0.4
    k = torch.randn(1, 1, 6, d) * 0.4
    exact = torch.exp(q @ k.transpose(-1, -2) / d ** 0.5)
    # Without stabilisers, phi(q).phi(k) is an unbiased estimate of exp(q.k/sqrt(d)); many features -> close.
    m = 20000
    w = orthogonal_random_features(m, d)
    def phi(x):
        xs = x * d ** -0.25
        return torch.exp(xs @ w.T - 0.5 * (xs * xs).sum(-1, keepdim=True)) / m ** 0.5
    est = phi(q) @ phi(k).transpose(-1, -2)
    torch.testing.assert_close(est, exact, rtol=0.08, atol=0.0)
    f = favor_plus_features(q, orthogonal_random_features(16, d), is_query=True)
    assert (f > 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_error_against_softmax_shrinks_with_features(causal):
    torch.manual_seed(0)
    b, h, L, d = 2, 2, 48, 16
    errs = []
    for m in (16, 128, 1024):
        e = 0.0
        for seed in range(6):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(b, h, L, d, generator=g) * 0.5
            k = torch.randn(b, h, L, d, generator=g) * 0.5
            v = torch.randn(b, h, L, d, generator=g)
            w = orthogonal_random_features(m, d, generator=g)
            out = linear_attention(favor_plus_features(q, w, is_query=True, kernel_eps=0.0),
                                   favor_plus_features(k, w, is_query=False, kernel_eps=0.0, causal=causal),
                                   v, causal=causal)
            e += (out - _softmax_attention(q, k, v, causal)).pow(2).mean().sqrt().item() / 6
        errs.append(e)
    # Monte-Carlo error ~ m^-1/2 asymptotically: each 8x more features must cut it by well over 1.5x.
    assert errs[0] > 1.5 * errs[1] and errs[1] > 1.5 * errs[2], errs
    assert errs[2] < 0.03, errs


def test_causal_module_matches_dense_oracle_and_ignores_the_future():
    m = Performer(16, 2, nb_features=32, dropout=0.0, causal=True).eval()
    x = torch.randn(2, 25, 16)
    y = m(x)
    # The same computation with the dense causal oracle in place of the op.
    b, L, _ = x.shape
    q = m.w_q(x).view(b, L, 2, 8).transpose(1, 2)
    k = m.w_k(x).view(b, L, 2, 8).transpose(1, 2)
    v = m.w_v(x).view(b, L, 2, 8).transpose(1, 2)
    qf = m.kernel_feature_map(q, m.projection_matrix, True)
    kf = m.kernel_feature_map(k, m.projection_matrix, False)
    ref = m.w_o(linear_attention_ref(qf, kf, v, causal=True).transpose(1, 2).reshape(b, L, 16))
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    # Changing the future leaves the past alone (no sequence-wide key stabiliser in causal mode).
    x2 = x.clone()
    x2[:, 15:] = torch.randn(2, 10, 16) * 3
    torch.testing.assert_close(m(x2)[:, :15], y[:, :15], rtol=1e-4, atol=1e-5)


def test_module_approximates_softmax_attention_with_same_weights():
    torch.manual_seed(3)
    m = Performer(32, 2, nb_features=2048, dropout=0.0).eval()
    with torch.no_grad():
        for lin in (m.w_q, m.w_k):
            lin.weight.mul_(0.3)
    x = torch.randn(1, 20, 32)
    b, L, _ = x.shape
    heads = lambda t: t.view(b, L, 2, 16).transpose(1, 2)
    exact = _softmax_attention(heads(m.w_q(x)), heads(m.w_k(x)), heads(m.w_v(x)))
    exact = m.w_o(exact.transpose(1, 2).reshape(b, L, 32))
    err = (m(x) - exact).abs().max().item()
    assert err < 0.05 * exact.abs().max().item(), err


def test_padding_mask_removes_keys():
    m = Performer(16, 2, nb_features=16, dropout=0.0).eval()
    x = torch.randn(2, 12, 16)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 8:] = False
    y = m(x, mask)
    x2 = x.clone()
    x2[:, 8:] = torch.randn(2, 4, 16)
    y2 = m(x2, mask.int())
    # Rows of real tokens do not see the padded keys (padded rows' own outputs are don't-cares).
    torch.testing.assert_close(y[:, :8], y2[:, :8], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'mask' must be a key padding mask"):
        m(x, torch.ones(2, 11))


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        Performer(10, 3)
    with pytest.raises(ValueError, match="feature_redraw_interval"):
        Performer(8, 2, feature_redraw_interval=0)
    with pytest.raises(ValueError, match="argument 'x' must have shape"):
        Performer(8, 2)(torch.randn(2, 3, 7))


def test_backward_and_fp16_autocast_free():
    m = Performer(16, 2, nb_features=16, dropout=0.0, causal=True)
    x = torch.randn(2, 30, 16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in m.parameters())
