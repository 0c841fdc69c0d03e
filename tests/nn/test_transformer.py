"""Transformer family (guides 000/001/003/004) and additive attention vs the guides' code."""

import pytest
import torch
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.testing import guides as G
from fastarch.testing.dropin import assert_dropin, assert_trains

X = torch.randn(2, 9, 32)


def test_encoder_layer_and_encoder_dropin_with_masks():
    assert_dropin(fnn.TransformerEncoderLayer(32, 4, 64), G.TransformerEncoderLayer(32, 4, 64), X)
    pad = torch.ones(2, 1, 1, 9)
    pad[1, ..., 6:] = 0
    assert_dropin(fnn.TransformerEncoder(2, 32, 4, 64), G.TransformerEncoder(2, 32, 4, 64), X, pad)
    causal = torch.tril(torch.ones(9, 9))  # a general (Lq, Lk) mask goes through attn_bias
    assert_dropin(fnn.TransformerEncoder(2, 32, 4, 64), G.TransformerEncoder(2, 32, 4, 64), X, causal)


def test_decoder_and_full_transformer_dropin():
    mem = torch.randn(2, 5, 32)
    assert_dropin(fnn.TransformerDecoder(2, 32, 4, 64), G.TransformerDecoder(2, 32, 4, 64), X, mem,
                  torch.tril(torch.ones(9, 9)))
    src, tgt = torch.randint(0, 50, (2, 7)), torch.randint(0, 40, (2, 6))
    assert_dropin(fnn.Transformer(50, 40, 32, 4, 2, 2, 64, 100), G.Transformer(50, 40, 32, 4, 2, 2, 64, 100), src, tgt)


def test_transformer_decoder_is_causal():
    m = fnn.Transformer(50, 40, 32, 4, 1, 1, 64, 100).eval()
    src, tgt = torch.randint(0, 50, (1, 7)), torch.randint(0, 40, (1, 6))
    a = m(src, tgt)
    tgt2 = tgt.clone()
    tgt2[0, -1] = (tgt[0, -1] + 1) % 40
    b = m(src, tgt2)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])  # the future does not leak into the past


def test_positionwise_ffn_and_guide001_block():
    assert_dropin(fnn.PositionwiseFeedForward(32, 64), G.PositionwiseFeedForward(32, 64), X)
    pad = torch.ones(2, 1, 1, 9)
    pad[0, ..., 7:] = 0
    assert_dropin(fnn.TransformerBlock(32, 4, 64), G.TransformerBlock001(32, 4, 64), X, pad)


@pytest.mark.parametrize("pe", ["sinusoidal", "learned", "rotary"])
@pytest.mark.parametrize("mode", ["encoder", "decoder"])
def test_transformer003_dropin(pe, mode):
    x = torch.randint(0, 30, (2, 8))
    mask = torch.ones(2, 8)
    mask[1, 6:] = 0
    ours = fnn.Transformer003(30, 32, 4, 2, 64, max_len=16, mode=mode, pos_encoding=pe)
    ref = G.Transformer003(30, 32, 4, 2, 64, max_len=16, mode=mode, pos_encoding=pe)
    assert_dropin(ours, ref, x)
    assert_dropin(ours, ref, x, mask, pick=lambda o: o[0])  # row 1 has padded keys; compare a full row


def test_transformer004_shapes_and_grad():
    m = fnn.Transformer004(30, 32, 4, 2, 64)
    out = m(torch.randint(0, 30, (2, 7)))
    assert out.shape == (2, 7, 30)
    out.sum().backward()
    assert m.transformer_blocks[0].attention.W_q.weight.grad is not None


def test_additive_attention_dropin_and_chunking():
    class RefAdditive(torch.nn.Module):
        def __init__(self, hidden_dim, dropout=0.1):
            super().__init__()
            self.W_q = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
            self.W_k = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
            self.v = torch.nn.Linear(hidden_dim, 1, bias=False)
            self.dropout = torch.nn.Dropout(dropout)

        def forward(self, query, keys, values, mask=None):
            q, k = self.W_q(query).unsqueeze(2), self.W_k(keys).unsqueeze(1)
            scores = self.v(torch.tanh(q + k)).squeeze(-1)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, -1e9)
            attention = self.dropout(F.softmax(scores, dim=-1))
            return torch.matmul(attention, values), attention

    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 11, 16), torch.randn(2, 11, 16)
    mask = (torch.rand(2, 5, 11) > 0.3).float()
    ours = fnn.AdditiveAttention(16, chunk_elements=100)  # forces several query chunks
    assert_dropin(ours, RefAdditive(16), q, k, v, mask)
    # gradients through the checkpointed chunks equal the unchunked ones
    ours.train()
    ours.dropout.p = 0.0
    big = fnn.AdditiveAttention(16)
    big.load_state_dict(ours.state_dict())
    big.dropout.p = 0.0
    qq = q.clone().requires_grad_(True)
    g1 = torch.autograd.grad(ours(qq, k, v)[0].sum(), [qq, ours.W_q.weight])
    g2 = torch.autograd.grad(big(qq, k, v)[0].sum(), [qq, big.W_q.weight])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_bad_inputs():
    with pytest.raises(ValueError, match="pos_encoding"):
        fnn.Transformer003(10, 32, 4, 1, 64, pos_encoding="alibi")
    with pytest.raises(ValueError, match="'x'"):
        fnn.TransformerEncoderLayer(32, 4, 64)(torch.randn(2, 3, 31))
    with pytest.raises(TypeError, match="integer"):
        fnn.Transformer(10, 10, 32, 4, 1, 1, 64)(torch.randn(1, 3), torch.randint(0, 10, (1, 3)))
    with pytest.raises(ValueError, match="mask"):
        fnn.TransformerEncoder(1, 32, 4, 64)(X, torch.ones(2, 1, 1, 5))


def test_training_lowers_loss():
    # Copy task with the encoder-decoder model (teacher forcing).
    m = fnn.Transformer(12, 12, 32, 4, 1, 1, 64, 32, dropout=0.0)
    src = torch.randint(1, 12, (8, 6))
    tgt_in = torch.cat([torch.zeros(8, 1, dtype=torch.long), src[:, :-1]], 1)
    assert_trains(m, lambda mod: F.cross_entropy(mod(src, tgt_in).flatten(0, 1), src.flatten()), steps=10)
    lm = fnn.Transformer003(16, 32, 4, 1, 64, mode="decoder", pos_encoding="rotary", dropout=0.0)
    seq = torch.arange(9).repeat(4, 1) % 16
    assert_trains(lm, lambda mod: F.cross_entropy(mod(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten()), steps=10)
