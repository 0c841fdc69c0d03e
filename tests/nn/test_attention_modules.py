"""Drop-in checks for fastarch.nn.attention: the guide-000 classes (copied verbatim below as the reference)
and fastarch's versions load the same state dict with strict=True and give the same eval outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fastarch.nn.attention as FA
from fastarch.testing import guides
from fastarch.testing.guides import (
    LongformerAttention,
    MultiHeadAttention,
    ScaledDotProductAttention,
)


def _same_weights(ref: nn.Module, ours: nn.Module) -> None:
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert set(ref.state_dict()) == set(ours.state_dict())
    ref.eval()
    ours.eval()


def test_sdpa_matches_guide_with_masks():
    ref, ours = ScaledDotProductAttention(), FA.ScaledDotProductAttention()
    _same_weights(ref, ours)
    q, k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 11, 16), torch.randn(2, 3, 11, 24)  # d_v != d_k
    for mask in (None,
                 (torch.rand(2, 1, 1, 11) > 0.3).float(),           # key padding form
                 (torch.rand(2, 1, 7, 11) > 0.5).int(),             # general form
                 torch.ones(2, 1, 7, 11).index_fill_(2, torch.tensor([3]), 0)):  # a fully masked row
        o_r, w_r = ref(q, k, v, mask)
        o_f, w_f = ours(q, k, v, mask)
        torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-5)


def test_sdpa_temperature_and_no_weights():
    ref, ours = ScaledDotProductAttention(temperature=3.0), FA.ScaledDotProductAttention(3.0, need_weights=False)
    _same_weights(ref, ours)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    o_f, w_f = ours(q, k, v)
    assert w_f is None
    torch.testing.assert_close(o_f, ref(q, k, v)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", ["MultiHeadAttention", "SelfAttention", "CrossAttention"])
def test_mha_family_matches_guide(cls):
    torch.manual_seed(1)
    ref = getattr(guides, cls)(32, 4, 0.1)
    ours = getattr(FA, cls)(32, 4, 0.1)
    _same_weights(ref, ours)
    x, y = torch.randn(2, 9, 32), torch.randn(2, 13, 32)
    mask = (torch.rand(2, 1, 1, 9 if cls == "SelfAttention" else 13) > 0.2).float()
    if cls == "MultiHeadAttention":
        args = (x, y, y, mask)
    elif cls == "SelfAttention":
        args = (x, mask)
    else:
        args = (x, y, mask)
    (o_r, w_r), (o_f, w_f) = ref(*args), ours(*args)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-5)


def test_mha_causal_mask_and_training_grad():
    ours = FA.MultiHeadAttention(16, 2, 0.0)
    x = torch.randn(2, 6, 16, requires_grad=True)
    causal = torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6)
    ref = MultiHeadAttention(16, 2, 0.0)
    ref.load_state_dict(ours.state_dict())
    o, _ = ours(x, x, x, causal)
    o_r, _ = ref(x, x, x, causal)
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(o.sum(), x)[0]
    g_r = torch.autograd.grad(o_r.sum(), x)[0]
    torch.testing.assert_close(g, g_r, rtol=1e-4, atol=1e-5)


def test_mha_bad_input():
    with pytest.raises(ValueError, match="d_model"):
        FA.MultiHeadAttention(30, 4)
    m = FA.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="'q'"):
        m(torch.randn(2, 5, 8), torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="mask"):
        m(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.ones(3, 1, 5, 5))


@pytest.mark.parametrize("gm_kind", ["none", "binary", "fractional"])
def test_longformer_matches_guide(gm_kind):
    torch.manual_seed(2)
    ref = LongformerAttention(32, 4, window_size=3, dropout=0.1)
    ours = FA.LongformerAttention(32, 4, window_size=3, dropout=0.1)
    _same_weights(ref, ours)
    x = torch.randn(2, 20, 32)
    gm = None
    if gm_kind == "binary":
        gm = torch.zeros(2, 20)
        gm[0, 0] = 1
        gm[1, [2, 7, 19]] = 1
    elif gm_kind == "fractional":
        gm = torch.rand(2, 20)
    torch.testing.assert_close(ours(x, gm), ref(x, gm), rtol=1e-5, atol=1e-5)


def test_longformer_hf_semantics_against_dense():
    torch.manual_seed(3)
    m = FA.LongformerAttention(16, 2, window_size=2, global_mode="hf").eval()
    B, L, w = 2, 12, 2
    x = torch.randn(B, L, 16, requires_grad=True)
    gm = torch.zeros(B, L)
    gm[0, 0] = 1
    gm[1, [1, 9]] = 1
    out = m(x, gm)
    # Dense reference: local rows see window ∪ globals; global rows see everything (global projections).
    H, d = 2, 8
    heads = lambda t: t.view(B, L, H, d).transpose(1, 2)  # noqa: E731
    q, k, v = heads(m.w_q(x)), heads(m.w_k(x)), heads(m.w_v(x))
    i = torch.arange(L)
    allowed = ((i[:, None] - i[None, :]).abs() <= w).view(1, 1, L, L) | (gm == 1).view(B, 1, 1, L)
    s = (q @ k.transpose(-1, -2)) / d**0.5
    loc = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v
    qg, kg, vg = heads(m.w_q_global(x)), heads(m.w_k_global(x)), heads(m.w_v_global(x))
    glob = torch.softmax((qg @ kg.transpose(-1, -2)) / d**0.5, -1) @ vg
    o = torch.where((gm == 1).view(B, 1, L, 1), glob, loc)
    ref = m.w_o(o.transpose(1, 2).reshape(B, L, 16))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().sum(), x)[0]
    g_r = torch.autograd.grad(ref.square().sum(), x)[0]
    torch.testing.assert_close(g, g_r, rtol=1e-4, atol=1e-5)


def test_longformer_global_tokens_constructor_arg():
    ref = LongformerAttention(16, 2, window_size=2)
    ours = FA.LongformerAttention(16, 2, window_size=2, global_tokens=[0, 5])
    _same_weights(ref, ours)
    x = torch.randn(1, 10, 16)
    gm = torch.zeros(1, 10)
    gm[0, [0, 5]] = 1
    torch.testing.assert_close(ours(x), ref(x, gm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_multihead_wrapper(batch_first):
    torch.manual_seed(4)
    ref = nn.MultiheadAttention(24, 3, batch_first=batch_first).eval()
    ours = FA.MultiheadAttention(24, 3, batch_first=batch_first).eval()
    _same_weights(ref, ours)
    q, kv = torch.randn(2, 5, 24), torch.randn(2, 8, 24)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1, -3:] = True
    am = torch.randn(5, 8)
    o_r, _ = ref(q, kv, kv, key_padding_mask=kpm, attn_mask=am > 1.0, need_weights=False)  # bool + bool
    o_f, w = ours(q, kv, kv, key_padding_mask=kpm, attn_mask=am > 1.0, need_weights=False)
    assert w is None
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    kpm_f = torch.zeros(2, 8).masked_fill(kpm, float("-inf"))  # float + float
    o_r, _ = ref(q, kv, kv, key_padding_mask=kpm_f, attn_mask=am, need_weights=False)
    o_f, _ = ours(q, kv, kv, key_padding_mask=kpm_f, attn_mask=am, need_weights=False)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    causal = torch.ones(5, 5).triu(1).bool()  # self-attention with torch's is_causal hint
    o_r, _ = ref(q, q, q, need_weights=False, attn_mask=causal, is_causal=True)
    o_f, _ = ours(q, q, q, need_weights=False, attn_mask=causal, is_causal=True)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    o_r, w_r = ref(q, kv, kv)  # weights requested: torch's own path
    o_f, w_f = ours(q, kv, kv)
    torch.testing.assert_close(o_f, o_r)
    torch.testing.assert_close(w_f, w_r)


@pytest.mark.parametrize("shape", [(1, 5), (3, 12)])  # a decode-sized call and a many-row one
def test_fused_qkv_projection_matches_reference_with_gradients(shape):
    """Attention over the fused QKV projection's strided q, k, v views gives softmax attention of the fused
    weight's q, k, v, and its gradients, with a causal mask and returned weights."""
    torch.manual_seed(0)
    B, L = shape
    E, H = 32, 4
    mod = FA.Attention(E, H, fused=True)
    x = torch.randn(B, L, E, requires_grad=True)
    out, w = mod(x, causal=True, need_weights=True)
    q, k, v = (t.view(B, L, H, E // H).transpose(1, 2) for t in mod.qkv(x).split(E, -1))
    s = (q @ k.transpose(-2, -1)) * (E // H) ** -0.5
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)
    ref = mod.out_proj((p @ v).transpose(1, 2).reshape(B, L, E))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, p, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, mod.qkv.weight, mod.qkv.bias], g)
    want = torch.autograd.grad(ref, [x, mod.qkv.weight, mod.qkv.bias], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # The projection runs as a module (its hooks see the fused output).
    seen = []
    mod.qkv.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    torch.testing.assert_close(mod(x, causal=True)[0], ref, rtol=1e-5, atol=1e-5)
    assert seen == [(B, L, 3 * E)]
