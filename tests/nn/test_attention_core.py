"""The attention core of fastarch.nn (``Attention``) and what rests on it: weights only when asked, the QKV
projections, grouped key/value heads with a KV cache, rotary decoding, the guide mask convention, and the
layering (nn never imports fastarch.generation)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fastarch.nn as fnn
from fastarch.nn.attention import Attention, scaled_dot_product_attention


def _dense(q, k, v, allowed=None, scale=None):
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1)
    return w @ v, w


def test_weights_only_when_asked():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    o, w = scaled_dot_product_attention(q, k, v)
    assert w is None
    o2, w2 = scaled_dot_product_attention(q, k, v, need_weights=True)
    o_r, w_r = _dense(q, k, v)
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2, w_r, rtol=1e-5, atol=1e-5)
    # causal weights are masked bottom-right, as the op
    o3, w3 = scaled_dot_product_attention(q, k, v, causal=True, need_weights=True)
    o_c, w_c = _dense(q, k, v, torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(w3, w_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o3, o_c, rtol=1e-5, atol=1e-5)


def test_guide_mha_need_weights_per_call_and_constructor():
    m = fnn.MultiHeadAttention(16, 2, 0.0).eval()
    x = torch.randn(2, 5, 16)
    out, w = m(x, x, x)
    assert w is not None and w.shape == (2, 2, 5, 5)
    out2, w2 = m(x, x, x, need_weights=False)
    assert w2 is None
    torch.testing.assert_close(out2, out)
    quiet = fnn.MultiHeadAttention(16, 2, 0.0, need_weights=False).eval()
    quiet.load_state_dict(m.state_dict())
    assert quiet(x, x, x)[1] is None
    # the layers built on it never ask
    layer = fnn.TransformerEncoderLayer(16, 2, 32, 0.0)
    assert layer.self_attn.attention.need_weights is False


def test_fully_masked_row_is_the_uniform_average():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4)
    mask[..., 2, :] = 0
    o, w = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    torch.testing.assert_close(o[:, :, 2], v.mean(-2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w[:, :, 2], torch.full((1, 2, 4), 0.25))


@pytest.mark.parametrize("average", [True, False])
def test_torch_multihead_weights_match_torch(average):
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    ours = fnn.MultiheadAttention(16, 4, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, -2:] = True
    o_r, w_r = ref(q, kv, kv, key_padding_mask=kpm, average_attn_weights=average)
    o_f, w_f = ours(q, kv, kv, key_padding_mask=kpm, average_attn_weights=average)
    torch.testing.assert_close(o_f, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_f, w_r, rtol=1e-5, atol=1e-5)


def test_separate_projections_follow_in_place_weight_writes():
    torch.manual_seed(2)
    m = Attention(24, 4, names=("wq", "wk", "wv", "wo")).eval()
    x = torch.randn(2, 6, 24)
    with torch.no_grad():
        a, _ = m(x)
        m.wk.weight.data.add_(1.0)  # not seen by the version counter: nothing may be cached
        b, _ = m(x)
    q, k, v = (lin(x).view(2, 6, 4, 6).transpose(1, 2) for lin in (m.wq, m.wk, m.wv))
    o, _ = _dense(q, k, v)
    torch.testing.assert_close(b, m.wo(o.transpose(1, 2).reshape(2, 6, 24)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, b)


def test_grouped_kv_heads_with_cache_match_full():
    torch.manual_seed(3)
    m = fnn.MultiHeadAttentionWithKVCache(32, 8, n_kv_heads=2).eval()
    x = torch.randn(2, 9, 32)
    full = m(x)
    cache = m.allocate_kv_cache(2, 16)
    steps = [m(x[:, :5], cache)] + [m(x[:, t:t + 1], cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_rotary_attention_decodes_with_cache():
    torch.manual_seed(4)
    m = Attention(32, 4, rotary=True).eval()
    x = torch.randn(1, 7, 32)
    full, _ = m(x, causal=True)
    cache = fnn.KVCache(16, 4, 8, 1, batch_size=1, dtype=torch.float32, device="cpu")
    outs = [m(x[:, :3], causal=True, kv_cache=cache)[0]]
    outs += [m(x[:, t:t + 1], causal=True, kv_cache=cache)[0] for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert "rope.inv_freq" not in m.state_dict()


def test_core_rejects_bad_configurations():
    with pytest.raises(ValueError, match="divisible"):
        Attention(30, 4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        Attention(32, 4, kv_heads=3)
    with pytest.raises(ValueError, match="names"):
        Attention(32, 4, names=("a", "b"))
    with pytest.raises(ValueError, match="self-attention"):
        fused = Attention(32, 4, fused=True)
        fused(torch.randn(1, 3, 32), torch.randn(1, 4, 32))


def test_block003_norm_type_is_honoured_or_rejected():
    layer = fnn.TransformerBlock003(16, 2, 32, norm_type="layer")
    assert {"ln1.weight", "ln1.bias"} <= set(layer.state_dict())
    batch = fnn.TransformerBlock003(16, 2, 32, norm_type="batch")
    assert {"ln1.gamma", "ln1.running_mean"} <= set(batch.state_dict())
    assert batch(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    with pytest.raises(ValueError, match="norm_type"):
        fnn.TransformerBlock003(16, 2, 32, norm_type="rms")


def test_guide_names_are_aliases():
    assert fnn.Transformer003 is fnn.TransformerLM
    assert fnn.TransformerBlock003 is fnn.PostNormRotaryBlock
    assert fnn.Transformer004 is fnn.SinusoidalEncoderLM
    assert fnn.TransformerBlock004 is fnn.PostNormBlock
    assert fnn.TransformerEncoder001 is fnn.TextTransformerEncoder
    assert fnn.VisionTransformer001 is fnn.ViT and fnn.PatchEmbedding001 is fnn.ViTPatchEmbedding
    assert fnn.MultiHeadAttention001 is fnn.FusedQKVAttention
    assert fnn.MultiHeadAttention003 is fnn.RotarySelfAttention


def test_layers_do_not_import_upwards():
    code = ("import sys, fastarch.nn, fastarch.models; "
            "bad = [m for m in sys.modules if m.startswith(('fastarch.generation', 'fastarch.bench'))]; "
            "assert not bad, bad; "
            "from fastarch.generation import KVCache; from fastarch.nn import KVCache as K; assert KVCache is K")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_models_registry_alone_sees_every_builder():
    code = "from fastarch.models.registry import list_models; assert 'gpt_tiny' in list_models(), list_models()"
    subprocess.run([sys.executable, "-c", code], check=True)
