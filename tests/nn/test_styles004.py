"""Guide 004's ``GPTStyle`` / ``BERTStyle`` wrappers vs the guide's classes (copied below as the reference)."""

import pytest
import torch
import torch.nn as nn

import fastarch.nn as fnn
from fastarch.testing import guides as G
from fastarch.testing.dropin import assert_dropin, assert_trains

SIZES = dict(num_layers=2, d_model=32, n_heads=4, d_ff=64)


class _DecoderOnlyLayer(G.TransformerDecoderLayer):
    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, tgt_mask)  # FIX: .mha
        x = self.norm1(self.dropout(x) + residual)
        if encoder_output is not None:  # FIX: the guide's GPTStyle passes no encoder output (decoder only)
            residual = x
            x, _ = self.cross_attn(x, encoder_output, encoder_output, src_mask)
            x = self.norm2(self.dropout(x) + residual)
        residual = x
        return self.norm3(self.ffn(x) + residual)


# GPT-style architecture (decoder only)
class GPTStyle(nn.Module):
    def __init__(self, num_layers=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1):  # FIX: sizes
        super().__init__()
        self.decoder = G.TransformerDecoder(num_layers, d_model, n_heads, d_ff, dropout)  # FIX: args
        self.decoder.layers = nn.ModuleList(  # FIX: layers that run without an encoder output
            _DecoderOnlyLayer(d_model, n_heads, d_ff, dropout) for _ in range(num_layers))

    def forward(self, x, mask=None):
        causal = torch.tril(torch.ones(x.shape[1], x.shape[1]))  # FIX: the guide gives the decoder no mask
        if mask is not None:
            causal = causal * mask
        return self.decoder(x, None, causal)  # FIX: the guide calls self.decoder(x)


# BERT-style architecture (encoder only)
class BERTStyle(nn.Module):
    def __init__(self, num_layers=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1):  # FIX: sizes
        super().__init__()
        self.encoder = G.TransformerEncoder(num_layers, d_model, n_heads, d_ff, dropout)  # FIX: args

    def forward(self, x, mask=None):
        return self.encoder(x, mask)


X = torch.randn(2, 9, 32)
PAD = torch.ones(2, 1, 1, 9)
PAD[1, ..., 6:] = 0


@pytest.mark.parametrize("mask", [None, PAD])
def test_gptstyle_dropin(mask):
    args = (X,) if mask is None else (X, mask)
    assert_dropin(fnn.GPTStyle(**SIZES), GPTStyle(**SIZES), *args)


@pytest.mark.parametrize("mask", [None, PAD])
def test_bertstyle_dropin(mask):
    args = (X,) if mask is None else (X, mask)
    assert_dropin(fnn.BERTStyle(**SIZES), BERTStyle(**SIZES), *args)


def test_default_constructor_keys_match_guide_sizes():
    ours, ref = fnn.GPTStyle(), GPTStyle()
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    assert len(ours.decoder.layers) == 6 and ours.decoder.norm.normalized_shape == (512,)
    assert sum(p.numel() for p in fnn.BERTStyle().parameters()) == sum(p.numel() for p in BERTStyle().parameters())


def test_gptstyle_is_causal_and_bertstyle_is_not():
    gpt, bert = fnn.GPTStyle(**SIZES).eval(), fnn.BERTStyle(**SIZES).eval()
    x2 = X.clone()
    x2[:, -1] += 1.0
    with torch.no_grad():
        torch.testing.assert_close(gpt(X)[:, :-1], gpt(x2)[:, :-1])
        assert not torch.allclose(bert(X)[:, 0], bert(x2)[:, 0])


def test_gradients_and_training():
    for cls in (fnn.GPTStyle, fnn.BERTStyle):
        m = cls(**SIZES, dropout=0.0)
        target = torch.randn(2, 9, 32)
        assert_trains(m, lambda mod, t=target: ((mod(X) - t) ** 2).mean())


def test_bad_input():
    with pytest.raises(ValueError, match="'x'"):
        fnn.GPTStyle(**SIZES)(torch.randn(2, 9, 16))
    with pytest.raises(ValueError, match="'x'"):
        fnn.BERTStyle(**SIZES)(torch.randn(9, 32))
