"""GPT and BERT families vs the guides, KV cache, generate, and bert_from_hf with a self-built HF state dict."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.models import bert_from_hf, create_model
from fastarch.testing import guides as G
from fastarch.testing.dropin import assert_dropin, assert_trains

IDS = torch.randint(0, 50, (2, 12))


def test_gpt_transformer_dropin_and_causal():
    ours, ref = fnn.GPTTransformer(50, 32, 4, 2, 64, 32), G.GPTTransformer(50, 32, 4, 2, 64, 32)
    assert_dropin(ours, ref, IDS)
    assert ours.lm_head.weight is ours.token_embedding.weight
    ids2 = IDS.clone()
    ids2[:, -1] = (IDS[:, -1] + 1) % 50
    torch.testing.assert_close(ours(IDS)[:, :-1], ours(ids2)[:, :-1])


def test_gpt_model_dropin():
    assert_dropin(fnn.GPTModel(50, 32, 4, 2, 64, 32), G.GPTModel001(50, 32, 4, 2, 64, 32), IDS)


@pytest.mark.parametrize("build", [lambda: fnn.GPTModel(50, 32, 4, 2, 64, 32, dropout=0.0),
                                   lambda: fnn.GPTTransformer(50, 32, 4, 2, 64, 32, dropout=0.0)])
def test_kv_cache_matches_full_forward(build):
    m = build().eval()
    full = m(IDS)
    cache = m.allocate_kv_cache(2, 20)
    parts = [m(IDS[:, :5], kv_cache=cache), m(IDS[:, 5:6], kv_cache=cache), m(IDS[:, 6:], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)
    assert cache.seq_len == 12
    # without the cache the same chunk would see no past: the cache is really used
    assert not torch.allclose(m(IDS[:, 6:]), full[:, 6:], atol=1e-3)


def test_generate_uses_cache_and_matches_greedy_recompute():
    m = fnn.GPTTransformer(50, 32, 4, 2, 64, 32, dropout=0.0).eval()
    prompt = IDS[:1, :4]
    torch.manual_seed(3)
    out = m.generate(prompt, max_new_tokens=6, top_k=1)  # top-1 sampling is greedy
    seq = prompt
    for _ in range(6):
        nxt = m(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    out_p = m.generate(prompt, max_new_tokens=3, temperature=0.7, top_p=0.9)
    assert out_p.shape == (1, 7)
    with pytest.raises(ValueError, match="max_len"):
        m.generate(prompt, max_new_tokens=40)


def test_bert_transformer_and_bert_model_dropin():
    mask = torch.ones(2, 12)
    mask[1, 9:] = 0
    seg = torch.cat([torch.zeros(2, 6), torch.ones(2, 6)], 1).long()
    assert_dropin(fnn.BERTTransformer(50, 32, 4, 2, 64, 16), G.BERTTransformer(50, 32, 4, 2, 64, 16), IDS, seg, mask)
    assert_dropin(fnn.BERTModel(50, 32, 4, 2, 64, 16), G.BERTModel001(50, 32, 4, 2, 64, 16), IDS, seg, mask)


def test_bert_heads_and_training():
    m = fnn.BERTTransformer(40, 32, 4, 1, 64, 16, dropout=0.0)
    ids = torch.randint(0, 40, (4, 10))
    seg = torch.zeros_like(ids)
    nsp = torch.tensor([0, 1, 0, 1])

    def loss(mod):
        s, p = mod(ids, seg)
        return F.cross_entropy(mod.get_mlm_logits(s).flatten(0, 1), ids.flatten()) + F.cross_entropy(
            mod.get_nsp_logits(p), nsp)

    assert_trains(m, loss, steps=8)


def test_gpt_training():
    m = create_model("gpt_tiny")
    seq = torch.arange(17).repeat(4, 1) % 256
    assert_trains(m, lambda mod: F.cross_entropy(mod(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten()), steps=8)


# ---- Hugging Face BERT loading --------------------------------------------------------------------------
class RefHFBert(nn.Module):
    """An independent implementation of Hugging Face's BertModel forward on HF key names (no transformers)."""

    def __init__(self, sd, heads, eps=1e-12):
        super().__init__()
        self.sd, self.heads, self.eps = sd, heads, eps

    def forward(self, ids, attention_mask=None, token_type_ids=None):
        sd, eps = self.sd, self.eps
        n = ids.shape[1]
        tt = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
        h = (sd["embeddings.word_embeddings.weight"][ids] + sd["embeddings.position_embeddings.weight"][:n]
             + sd["embeddings.token_type_embeddings.weight"][tt])
        h = F.layer_norm(h, h.shape[-1:], sd["embeddings.LayerNorm.weight"], sd["embeddings.LayerNorm.bias"], eps)
        ext = 0.0
        if attention_mask is not None:
            ext = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        i = 0
        while f"encoder.layer.{i}.attention.self.query.weight" in sd:
            p = f"encoder.layer.{i}."

            def lin(x, name, p=p):
                return F.linear(x, sd[p + name + ".weight"], sd[p + name + ".bias"])

            b, _, d = h.shape
            dh = d // self.heads

            def heads(t, b=b, dh=dh):
                return t.view(b, n, self.heads, dh).transpose(1, 2)

            q, k, v = heads(lin(h, "attention.self.query")), heads(lin(h, "attention.self.key")), heads(
                lin(h, "attention.self.value"))
            s = q @ k.transpose(-1, -2) / math.sqrt(dh) + ext
            ctx = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
            a = F.layer_norm(lin(ctx, "attention.output.dense") + h, (d,), sd[p + "attention.output.LayerNorm.weight"],
                             sd[p + "attention.output.LayerNorm.bias"], eps)
            inter = F.gelu(lin(a, "intermediate.dense"))
            h = F.layer_norm(lin(inter, "output.dense") + a, (d,), sd[p + "output.LayerNorm.weight"],
                             sd[p + "output.LayerNorm.bias"], eps)
            i += 1
        return h


def _hf_state_dict(vocab=60, d=32, layers=2, inter=64, pos=40, prefix=""):
    g = torch.Generator().manual_seed(7)

    def r(*s):
        return torch.randn(*s, generator=g) * 0.2

    sd = {"embeddings.word_embeddings.weight": r(vocab, d), "embeddings.position_embeddings.weight": r(pos, d),
          "embeddings.token_type_embeddings.weight": r(2, d), "embeddings.LayerNorm.weight": 1 + r(d),
          "embeddings.LayerNorm.bias": r(d), "embeddings.position_ids": torch.arange(pos)[None],
          "pooler.dense.weight": r(d, d), "pooler.dense.bias": r(d)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for n in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            sd[p + n + ".weight"], sd[p + n + ".bias"] = r(d, d), r(d)
        sd[p + "intermediate.dense.weight"], sd[p + "intermediate.dense.bias"] = r(inter, d), r(inter)
        sd[p + "output.dense.weight"], sd[p + "output.dense.bias"] = r(d, inter), r(d)
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            sd[p + n + ".weight"], sd[p + n + ".bias"] = 1 + r(d), r(d)
    return {prefix + k: v for k, v in sd.items()}


def test_bert_from_hf_state_dict_matches_reference():
    sd = _hf_state_dict()
    m = bert_from_hf(sd, config={"num_attention_heads": 4})
    ref = RefHFBert(sd, heads=4)
    ids = torch.randint(0, 60, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    tt = torch.zeros_like(ids)
    tt[:, 5:] = 1
    out = m(ids, attention_mask=mask, token_type_ids=tt)
    assert out.shape == (2, 11, 32)
    torch.testing.assert_close(out, ref(ids, mask, tt), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(m(ids), ref(ids), atol=1e-5, rtol=1e-4)


def test_bert_from_hf_safetensors_directory_and_prefix(tmp_path):
    from safetensors.torch import save_file

    sd = _hf_state_dict(prefix="bert.")
    sd["cls.predictions.bias"] = torch.zeros(60)  # a pretraining head: ignored
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 2, "hidden_size": 32,
                                                      "num_hidden_layers": 2, "layer_norm_eps": 1e-12}))
    m = bert_from_hf(tmp_path)
    ref = RefHFBert({k[5:]: v for k, v in sd.items() if k.startswith("bert.")}, heads=2)
    ids = torch.randint(0, 60, (1, 9))
    torch.testing.assert_close(m(ids), ref(ids), atol=1e-5, rtol=1e-4)
    m2 = bert_from_hf(tmp_path / "model.safetensors")
    torch.testing.assert_close(m2(ids), m(ids))


def test_bert_from_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        bert_from_hf(tmp_path)
    with pytest.raises(KeyError, match="word_embeddings"):
        bert_from_hf({"foo": torch.zeros(1)})
    with pytest.raises(TypeError):
        bert_from_hf(3)


@pytest.mark.parametrize("activation,approximate", [("gelu", "none"), ("gelu_new", "tanh")])
def test_bert_block_inplace_gelu_matches_out_of_place(activation, approximate):
    from fastarch.nn._models_common import gelu_module

    act = gelu_module(activation, inplace=True)
    assert isinstance(act, nn.GELU) and act.approximate == approximate
    x = torch.randn(4, 16)
    ref = F.gelu(x, approximate=approximate)
    # Without autograd the input is overwritten and returned.
    buf = x.clone()
    with torch.no_grad():
        out = act(buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, ref)
    # An input autograd needs is left alone, and the gradient is GELU's.
    leaf = x.clone().requires_grad_()
    out = act(leaf)
    assert out.data_ptr() != leaf.data_ptr() and torch.equal(leaf.detach(), x) and torch.equal(out.detach(), ref)
    out.sum().backward()
    leaf_ref = x.clone().requires_grad_()
    F.gelu(leaf_ref, approximate=approximate).sum().backward()
    torch.testing.assert_close(leaf.grad, leaf_ref.grad, rtol=0, atol=0)
    # The block (whose activation is in place) gives the same output with and without autograd, and trains.
    torch.manual_seed(0)
    block = fnn.TransformerBlock(32, 4, 64, 0.0, activation=activation).eval()
    h = torch.randn(2, 6, 32, requires_grad=True)
    y = block(h)
    y.square().sum().backward()
    assert h.grad is not None and all(p.grad is not None for p in block.ffn.parameters())
    with torch.no_grad():
        torch.testing.assert_close(block(h), y.detach(), rtol=1e-5, atol=1e-5)
