"""Linformer: guide keys and outputs for the same weights, shorter inputs (fairseq slicing), options, errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.nn import Linformer


class GuideLinformer(nn.Module):
    """The seed guide's Linformer (000_..., cluster 5.1), copied for comparison."""

    def __init__(self, d_model, n_heads, seq_len, k=256, dropout=0.1):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.k = min(k, seq_len)
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.E = nn.Linear(seq_len, self.k, bias=False)
        self.F = nn.Linear(seq_len, self.k, bias=False)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        batch_size, seq_len, _ = x.size()
        Q = self.w_q(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        K = self.w_k(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        V = self.w_v(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        K = K.transpose(2, 3)
        V = V.transpose(2, 3)
        K = self.E(K)
        V = self.F(V)
        K = K.transpose(2, 3)
        V = V.transpose(2, 3)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / (self.d_k ** 0.5)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = F.softmax(scores, dim=-1)
        attention = self.dropout(attention)
        output = torch.matmul(attention, V)
        output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, self.d_model)
        output = self.w_o(output)
        output = self.dropout(output)
        return output


def _pair(**kw):
    guide = GuideLinformer(32, 4, 40, k=12).eval()
    ours = Linformer(32, 4, 40, k=12, **kw).eval()
    return guide, ours


def test_keys_and_outputs_match_guide():
    guide, ours = _pair()
    assert list(ours.state_dict()) == list(guide.state_dict())
    ours.load_state_dict(guide.state_dict(), strict=True)
    x = torch.randn(2, 40, 32)
    torch.testing.assert_close(ours(x), guide(x), rtol=1e-4, atol=1e-5)
    mask = (torch.rand(2, 1, 40, 12) > 0.3).int()
    torch.testing.assert_close(ours(x, mask), guide(x, mask), rtol=1e-4, atol=1e-5)


def test_gradients_match_guide():
    guide, ours = _pair()
    ours.load_state_dict(guide.state_dict())
    x = torch.randn(2, 40, 32)
    ours(x).square().sum().backward()
    guide(x).square().sum().backward()
    for (n, p), (_, q) in zip(ours.named_parameters(), guide.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_shorter_input_slices_projections():
    guide, ours = _pair()
    ours.load_state_dict(guide.state_dict())
    x = torch.randn(2, 25, 32)
    # Reference: a guide built for length 25 whose E/F are the first 25 columns (fairseq's slicing).
    short = GuideLinformer(32, 4, 25, k=12).eval()
    sd = {n: (t[:, :25] if n in ("E.weight", "F.weight") else t) for n, t in guide.state_dict().items()}
    short.load_state_dict(sd)
    torch.testing.assert_close(ours(x), short(x), rtol=1e-4, atol=1e-5)


def test_longer_input_is_a_clear_error():
    _, ours = _pair()
    with pytest.raises(ValueError, match="input length 41 exceeds seq_len=40"):
        ours(torch.randn(1, 41, 32))


def test_share_kv_and_headwise():
    shared = Linformer(32, 4, 40, k=12, share_kv=True).eval()
    assert "F.weight" not in shared.state_dict()
    x = torch.randn(2, 30, 32)
    b, L = 2, 30
    heads = lambda t: t.view(b, L, 4, 8).transpose(1, 2)
    q, k, v = heads(shared.w_q(x)), heads(shared.w_k(x)), heads(shared.w_v(x))
    e = shared.E.weight[:, :L]
    ref = F.scaled_dot_product_attention(q, e @ k, e @ v)
    ref = shared.w_o(ref.transpose(1, 2).reshape(b, L, 32))
    torch.testing.assert_close(shared(x), ref, rtol=1e-4, atol=1e-5)

    hw = Linformer(32, 4, 40, k=12, headwise=True).eval()
    assert hw.E.weight.shape == (4, 12, 40) and hw.F.weight.shape == (4, 12, 40)
    q, k, v = heads(hw.w_q(x)), heads(hw.w_k(x)), heads(hw.w_v(x))
    ek = torch.stack([hw.E.weight[h, :, :L] @ k[:, h] for h in range(4)], 1)
    fv = torch.stack([hw.F.weight[h, :, :L] @ v[:, h] for h in range(4)], 1)
    ref = hw.w_o(F.scaled_dot_product_attention(q, ek, fv).transpose(1, 2).reshape(b, L, 32))
    torch.testing.assert_close(hw(x), ref, rtol=1e-4, atol=1e-5)


def test_k_capped_at_seq_len_and_bad_arguments():
    assert Linformer(16, 2, 10, k=256).k == 10
    with pytest.raises(ValueError, match="divisible"):
        Linformer(10, 3, 8)
    m = Linformer(16, 2, 10, k=4)
    with pytest.raises(ValueError, match="argument 'x' must have shape"):
        m(torch.randn(1, 5, 8))
    with pytest.raises(ValueError, match="argument 'mask' must broadcast"):
        m(torch.randn(1, 5, 16), torch.ones(1, 1, 5, 3))
