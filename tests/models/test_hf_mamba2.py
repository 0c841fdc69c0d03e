"""``from_hf`` / ``to_hf`` for ``mamba2`` against small Hugging Face ``Mamba2ForCausalLM`` models built from
configs (random weights, nothing downloaded): logits, greedy decoding, exact round trips and refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fastarch.models import from_hf, to_hf  # noqa: E402
from fastarch.nn import Mamba2LM  # noqa: E402

ATOL = 1e-5
VOCAB = 97


def _mamba2(seed: int = 0, **kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=8, num_hidden_layers=2,
               n_groups=2, chunk_size=8, layer_norm_epsilon=1e-3)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**cfg))
    with torch.no_grad():  # weights large enough that decoding varies with the input
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand_like(p) * 4 + 1))
            elif name.endswith("D") or "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif not name.endswith("dt_bias"):
                p.normal_(0, 0.3)
    return model.eval()


def _ids(b=2, n=19, seed=1):
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw", [{}, dict(tie_word_embeddings=True), dict(use_bias=True, use_conv_bias=False),
                                dict(time_step_limit=(0.01, 0.05)), dict(n_groups=1, chunk_size=256)],
                         ids=["default", "tied", "bias", "dt-limit", "one-group"])
def test_logits_match_hf(kw):
    hf = _mamba2(**kw)
    model = from_hf(hf)
    assert isinstance(model, Mamba2LM) and model.norm_f.eps == 1e-3
    mixer = model.layers[0].mixer
    assert mixer.norm.eps == 1e-3 and mixer.ngroups == hf.config.n_groups and mixer.nheads == 8
    assert mixer.dt_limit == tuple(hf.config.time_step_limit)
    assert (model.lm_head.weight is model.embedding.weight) == bool(kw.get("tie_word_embeddings"))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_greedy_decoding_matches_hf():
    hf = _mamba2()
    model = from_hf(hf)
    ids = _ids(n=7)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                       pad_token_id=0)
    assert torch.equal(model.generate(ids, max_new_tokens=8), want)


@pytest.mark.parametrize("kw", [{}, dict(tie_word_embeddings=True), dict(use_bias=True)],
                         ids=["untied", "tied", "bias"])
def test_round_trip_exact(tmp_path, kw):
    hf = _mamba2(**kw)
    model = from_hf(hf)
    to_hf(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    back = from_hf(tmp_path)
    assert type(back) is Mamba2LM
    assert list(back.state_dict()) == list(model.state_dict())
    for (k, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k
    reloaded = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path).eval()
    for key in ("num_heads", "head_dim", "state_size", "n_groups", "chunk_size", "layer_norm_epsilon", "use_bias",
                "use_conv_bias", "tie_word_embeddings", "conv_kernel", "expand"):
        assert getattr(reloaded.config, key) == getattr(hf.config, key), key
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_fresh_model_round_trip(tmp_path):
    """A Mamba2LM built in fastarch (not loaded) writes a checkpoint transformers runs with the same logits."""
    torch.manual_seed(0)
    model = Mamba2LM(VOCAB, 32, 2, d_state=8, headdim=8, ngroups=2, chunk_size=8, dt_limit=(0.0, 0.2)).eval()
    to_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "mamba2" and cfg["time_step_limit"] == [0.0, 0.2]
    reloaded = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids), atol=ATOL, rtol=0)


def test_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        from_hf(_mamba2(hidden_act="gelu"))
    hf = _mamba2()
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_heads \\* head_dim"):
        from_hf(tmp_path)


def test_unmapped_and_missing_keys_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _mamba2()
    hf.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(path)
    save_file({**sd, "backbone.layers.0.mixer.extra": torch.zeros(1)}, path)
    with pytest.raises(KeyError, match="mixer.extra"):
        from_hf(tmp_path)
    save_file({k: v for k, v in sd.items() if "layers.1.mixer.dt_bias" not in k}, path)
    with pytest.raises(KeyError, match="layers.1.mixer.dt_bias"):
        from_hf(tmp_path)


@pytest.mark.parametrize("kw, match", [
    (dict(rmsnorm=False), "no Hugging Face Mamba2 form"), (dict(norm_before_gate=True), "no Hugging Face"),
    (dict(d_ssm=16), "no Hugging Face"), (dict(D_has_hdim=True), "no Hugging Face"),
    (dict(norm_eps=1e-3), "one layer_norm_epsilon"),
])
def test_to_hf_refuses_what_hf_cannot_express(tmp_path, kw, match):
    model = Mamba2LM(VOCAB, 32, 1, d_state=8, headdim=8, **kw)
    with pytest.raises(ValueError, match=match):
        to_hf(model, tmp_path)
    assert not os.path.exists(tmp_path / "config.json")
