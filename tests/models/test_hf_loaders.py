"""``fastarch.models.from_hf`` / ``to_hf`` against small Hugging Face models built from configs (random
weights, nothing downloaded): logits, greedy generation with padding, round trips and refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import safetensors.torch  # noqa: E402

import fastarch.models.hf as hf_module  # noqa: E402
from fastarch.models import bert_from_hf, from_hf, to_hf  # noqa: E402
from fastarch.models._hf_files import MAX_CONFIG_BYTES  # noqa: E402
from fastarch.nn import BERT, GPTModel, MambaLM, PreNormViT  # noqa: E402

ATOL = 1e-5


def _init(model, seed=0):
    """Random weights large enough that greedy decoding varies with the input (HF's 0.02 init is near-uniform)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.copy_(torch.log(torch.rand_like(p) * 4 + 1))
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            elif name.endswith("D") or "norm" in name.lower() or "ln_" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return model.eval()


def _gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0, **kw)
    return _init(transformers.GPT2LMHeadModel(cfg))


def _bert(**kw):
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=40, **kw)
    return _init(transformers.BertModel(cfg))


def _mamba(**kw):
    cfg = transformers.MambaConfig(vocab_size=97, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   layer_norm_epsilon=1e-3, **kw)
    return _init(transformers.MambaForCausalLM(cfg))


def _ids(b=2, n=11, vocab=97, seed=1):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def _left_pad_mask(b, n, pads):
    mask = torch.ones(b, n, dtype=torch.long)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
    return mask


# ------------------------------------------------------------------------------------------- GPT-2
def test_gpt2_logits_match_hf():
    hf = _gpt2()
    model = from_hf(hf)
    assert isinstance(model, GPTModel) and model.activation == "gelu_new"
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(model(ids, logits_to_keep=3), out[:, -3:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gpt2_padded_logits_match_hf(side):
    hf, ids = _gpt2(), _ids(3, 9)
    model = from_hf(hf)
    mask = _left_pad_mask(3, 9, [0, 3, 5]) if side == "left" else _left_pad_mask(3, 9, [0, 3, 5]).flip(1)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = model(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_gpt2_greedy_generation_matches_hf(padded):
    hf, ids = _gpt2(), _ids(3, 7)
    model = from_hf(hf)
    mask = _left_pad_mask(3, 7, [0, 2, 4] if padded else [0, 0, 0])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    kw = {"attention_mask": mask} if padded else {}
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **kw)
    assert torch.equal(out, ref)
    assert len(set(out[:, 7:].flatten().tolist())) > 4  # the weights do not collapse to one token
    if padded:  # the mask changes what is generated
        assert not torch.equal(out, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_gpt2_cached_steps_with_mask_match_full_forward():
    model = from_hf(_gpt2())
    ids, mask = _ids(2, 10), _left_pad_mask(2, 10, [0, 4])
    full = model(ids, mask)
    cache = model.allocate_kv_cache(2, 10)
    first = model(ids[:, :6], mask[:, :6], kv_cache=cache)
    rest = model(ids[:, 6:], kv_cache=cache)
    real = mask.bool()
    torch.testing.assert_close(torch.cat([first, rest], 1)[real], full[real], atol=ATOL, rtol=0)
    # Hugging Face's convention: the mask covers every token so far.
    cache = model.allocate_kv_cache(2, 10)
    first = model(ids[:, :6], mask[:, :6], kv_cache=cache)
    rest = model(ids[:, 6:], mask, kv_cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], 1)[real], full[real], atol=ATOL, rtol=0)


def test_gpt2_pytorch_model_bin(tmp_path):
    hf = _gpt2()
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path)(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_gpt2_exact_gelu_activation():
    hf = _gpt2(activation_function="gelu")
    model = from_hf(hf)
    assert model.activation == "gelu"
    ids = _ids()
    with torch.no_grad():
        # the C++ scan's polynomial exp and linear kernel's summation order round differently from PyTorch
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("kw, match", [
    (dict(activation_function="relu"), "activation_function='relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
])
def test_gpt2_config_refusals(kw, match):
    with pytest.raises(ValueError, match=match):
        from_hf(_gpt2(**kw))


def test_gpt2_extra_key_refused(tmp_path):
    hf = _gpt2()
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    sd["transformer.h.0.attn.extra.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"h\.0\.attn\.extra\.weight"):
        from_hf(tmp_path)


def test_gpt2_missing_layer_refused(tmp_path):
    hf = _gpt2()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_layer"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_layer=3 but the weights hold 2 layers"):
        from_hf(tmp_path)


# ------------------------------------------------------------------------------------------- BERT
@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_bert_hidden_states_match_hf(tmp_path, act):
    hf = _bert(hidden_act=act)
    ids = _ids(3, 9)
    mask = _left_pad_mask(3, 9, [0, 0, 0])
    mask[1, 6:] = 0
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert isinstance(model, BERT)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask)
        out = model(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref.last_hidden_state[real], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.pooled(out), ref.pooler_output, atol=ATOL, rtol=0)


def test_roberta_refused(tmp_path):
    cfg = transformers.RobertaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40)
    hf = transformers.RobertaModel(cfg)
    with pytest.raises(ValueError, match="'roberta'"):
        from_hf(hf)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'roberta'"):
        from_hf(tmp_path)
    with pytest.raises(ValueError, match="'roberta'"):
        bert_from_hf(tmp_path)


def test_distilbert_refused(tmp_path):
    cfg = transformers.DistilBertConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                        max_position_embeddings=40)
    hf = transformers.DistilBertModel(cfg)
    with pytest.raises(ValueError, match="'distilbert'"):
        from_hf(hf)
    hf.save_pretrained(tmp_path)
    with pytest.raises((ValueError, KeyError), match="distilbert"):
        bert_from_hf(tmp_path)
    # Without a config, the keys alone give it away.
    with pytest.raises(KeyError, match="map to no BERT parameter"):
        bert_from_hf(hf.state_dict())


def test_bert_unsupported_activation_refused():
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        from_hf(_bert(hidden_act="relu"))


# ------------------------------------------------------------------------------------------- Mamba
def test_mamba_logits_match_hf():
    hf = _mamba()
    model = from_hf(hf)
    assert isinstance(model, MambaLM) and model.norm_f.eps == 1e-3
    ids = _ids()
    with torch.no_grad():
        # the C++ scan's polynomial exp and the matrix products' summation order round differently from HF's loop
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=1e-4)


def test_mamba_config_refusals():
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        from_hf(_mamba(hidden_act="gelu"))


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("build, cls, kw", [
    (_gpt2, "GPT2LMHeadModel", {}), (_bert, "BertModel", {}), (_bert, "BertModel", {"hidden_act": "gelu_new"}),
    (_mamba, "MambaForCausalLM", {}), (_mamba, "MambaForCausalLM", {"tie_word_embeddings": False}),
], ids=["gpt2", "bert", "bert-gelu_new", "mamba", "mamba-untied"])
def test_round_trip_exact(tmp_path, build, cls, kw):
    hf = build(**kw)
    model = from_hf(hf)
    to_hf(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    back = from_hf(tmp_path)
    assert type(back) is type(model)
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    reloaded = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids)[0], hf(ids)[0])


# ------------------------------------------------------------------------------------------- ViT
def _vit(**kw):
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5, **kw)
    return _init(transformers.ViTForImageClassification(cfg))


@pytest.mark.parametrize("eps", [1e-12, 1e-3])
def test_vit_logits_match_hf(tmp_path, eps):
    hf = _vit(layer_norm_eps=eps)
    hf.save_pretrained(tmp_path)
    model = from_hf(tmp_path)
    assert isinstance(model, PreNormViT) and model.norm.eps == eps
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=0)
        big = torch.randn(2, 3, 24, 20, generator=torch.Generator().manual_seed(1))
        ref = hf(big, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(model(big, interpolate_pos_encoding=True), ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        model(big)
    in_memory = from_hf(hf)  # transformers' module names, not the checkpoint's
    for (k, a), (_, b) in zip(model.state_dict().items(), in_memory.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("headless", [False, True], ids=["classifier", "ViTModel"])
def test_vit_round_trip_exact(tmp_path, headless):
    hf = _vit(layer_norm_eps=1e-6, hidden_act="gelu_new", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    if headless:
        hf = _init(transformers.ViTModel(hf.config, add_pooling_layer=False))
    model = from_hf(hf)
    assert model.num_classes == (0 if headless else 5)
    to_hf(model, tmp_path)
    back = from_hf(tmp_path)
    assert isinstance(back, PreNormViT) and back.norm.eps == 1e-6 and back.dropout.p == 0.1
    assert list(back.state_dict()) == list(model.state_dict())
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    cls = transformers.ViTModel if headless else transformers.ViTForImageClassification
    kw = {"add_pooling_layer": False} if headless else {}
    reloaded = cls.from_pretrained(tmp_path, **kw).eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(x)
        got = reloaded(x)
        if headless:
            assert torch.equal(got.last_hidden_state, want.last_hidden_state)
            torch.testing.assert_close(model(x), want.last_hidden_state[:, 0], atol=ATOL, rtol=0)
        else:
            assert torch.equal(got.logits, want.logits)
            torch.testing.assert_close(model(x), want.logits, atol=ATOL, rtol=0)


def test_vit_refusals():
    with pytest.raises(ValueError, match="qkv_bias=False"):
        from_hf(_vit(qkv_bias=False))
    hf = transformers.ViTModel(transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                                      num_attention_heads=4, intermediate_size=64))
    with pytest.raises(KeyError, match="pooler.dense.weight"):
        from_hf(hf)


# ------------------------------------------------------------------------------------------- inputs
def test_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match="path_or_model"):
        from_hf(3)
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(tmp_path)
    with pytest.raises(TypeError, match="argument 'model'"):
        to_hf(torch.nn.Linear(2, 2), tmp_path)


def test_gpt_padding_reaches_the_op_as_key_padding_mask(monkeypatch):
    import fastarch.nn.attention as attention_module

    seen = []
    real = attention_module.attention

    def spy(q, k, v, **kw):
        seen.append((kw.get("key_padding_mask"), kw.get("attn_bias")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention_module, "attention", spy)
    model = from_hf(_gpt2())
    ids, mask = _ids(2, 6), _left_pad_mask(2, 6, [0, 2])
    model.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=mask)
    assert seen and all(bias is None for _, bias in seen)
    assert all(kpm is not None and kpm.dim() == 2 and kpm.shape[0] == 2 for kpm, _ in seen)
    seen.clear()
    model(ids, torch.ones_like(ids))  # nothing padded: the unmasked path
    assert all(kpm is None and bias is None for kpm, bias in seen)


def test_gpt_argument_errors():
    model = from_hf(_gpt2())
    ids = _ids(2, 6)
    with pytest.raises(ValueError, match="'attention_mask' must have shape"):
        model(ids, torch.ones(2, 5))
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(ValueError, match="'attention_mask' must have the shape of 'input_ids'"):
        model.generate(ids, max_new_tokens=2, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="'activation'"):
        GPTModel(97, 32, 4, 1, 64, activation="relu")
    cache = model.allocate_kv_cache(2, 8)
    with pytest.raises(ValueError, match="'attention_mask' must have shape"):
        model(ids, torch.ones(2, 3), kv_cache=cache)
    assert cache.seq_len == 0  # a rejected call leaves the cache untouched


# ------------------------------------------------------------------------------------------- all or nothing
def _leftovers(folder):
    """Entries next to an export that are not the export itself (temporaries of to_hf)."""
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def test_to_hf_replaces_a_directory_whole_and_keeps_other_files(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "pytorch_model.bin").write_bytes(b"stale weights")
    (out / "tokenizer.json").write_text('{"kept": true}')
    model = from_hf(_gpt2())
    to_hf(model, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"kept": true}'
    assert _leftovers(tmp_path) == []
    back = from_hf(out)
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def test_to_hf_failure_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "export"
    to_hf(from_hf(_gpt2()), out)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        to_hf(from_hf(_mamba()), out)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert _leftovers(tmp_path) == []
    with pytest.raises(OSError, match="disk full"):
        to_hf(from_hf(_mamba()), tmp_path / "new")
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []


def test_to_hf_refuses_to_replace_a_file(tmp_path):
    (tmp_path / "export").write_text("not a directory")
    with pytest.raises(FileExistsError, match="not a directory"):
        to_hf(from_hf(_gpt2()), tmp_path / "export")
    assert (tmp_path / "export").read_text() == "not a directory"


@pytest.mark.parametrize("field, value", [("n_embd", 10**9), ("vocab_size", 10**12), ("n_layer", 10**6),
                                          ("n_positions", 65), ("n_embd", "32")])
def test_from_hf_refuses_a_config_that_does_not_fit_the_weights(tmp_path, field, value, monkeypatch):
    """Config sizes are checked against the safetensors header before any model is built."""
    _gpt2().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def never(**kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(hf_module, "GPTModel", never)
    with pytest.raises(ValueError, match=f"config {field}="):
        from_hf(tmp_path)


def test_from_hf_checks_every_shape_on_meta_before_building(tmp_path, monkeypatch):
    """A size the header check does not cover (the MLP width) is caught on the meta device: the real model
    is never built."""
    _gpt2().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_inner"] = 10**7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    built = []
    real = hf_module.GPTModel

    def spy(**kw):
        built.append(torch.empty(0).device.type)  # the default device the model is built on
        return real(**kw)

    monkeypatch.setattr(hf_module, "GPTModel", spy)
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.0\..* the config gives \(10000000"):
        from_hf(tmp_path)
    assert built == ["meta"]


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "too_big", "not_json", "not_object"])
def test_from_hf_config_must_be_a_bounded_regular_file(tmp_path, kind):
    _gpt2().save_pretrained(tmp_path)
    cfg = tmp_path / "config.json"
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)  # nobody writes: reading it would block forever
        match = "regular file, got a FIFO"
    elif kind == "dev_zero":
        os.symlink("/dev/zero", cfg)  # endless zeros
        match = "regular file, got a character device"
    elif kind == "too_big":
        cfg.write_text(" " * (MAX_CONFIG_BYTES + 1) + "{}")
        match = "limit"
    elif kind == "not_json":
        cfg.write_text("{not json")
        match = "not valid JSON"
    else:
        cfg.write_text("[1, 2]")
        match = "JSON object"
    with pytest.raises(ValueError, match=match):
        from_hf(tmp_path)
    with pytest.raises(ValueError, match=match):
        bert_from_hf(tmp_path)


def test_to_hf_refuses_to_replace_the_working_directory(tmp_path, monkeypatch):
    """Replacing the directory this process runs in would leave it in a deleted directory."""
    out = tmp_path / "export"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("kept")
    for cwd in (out, out / "sub"):
        monkeypatch.chdir(cwd)
        with pytest.raises(ValueError, match="current working directory"):
            to_hf(from_hf(_gpt2()), out)
        assert sorted(os.listdir(out)) == ["keep.txt", "sub"] and _leftovers(tmp_path) == []
