"""Registry behaviour and the published parameter counts of the standard configurations."""

import pytest
import torch

from fastarch.models import create_model, list_models

PUBLISHED = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "densenet121": 7_978_856,
    "mobilenet_v2": 3_504_872,
    "efficientnet_b0": 5_288_548,
    "efficientnet_b1": 7_794_184,
    "efficientnet_b7": 66_347_960,
    "vit_b_16": 86_567_656,
    "swin_t": 28_288_354,
    "bert_base": 109_482_240,
    "gpt2_small": 124_439_808,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts(name):
    with torch.device("meta"):  # counts only: no memory, no init time
        m = create_model(name)
    assert sum(p.numel() for p in m.parameters()) == PUBLISHED[name]


def test_registry_lists_and_suggests():
    names = list_models()
    for n in ["gpt_tiny", "bert_tiny", "vit_tiny", "swin_tiny_test", "gcn_small", "gat_small", "lstm_tiny",
              "transformer_tiny", "clip_tiny", "efficientnet_b3"]:
        assert n in names
    assert list_models("efficientnet_b*") == [f"efficientnet_b{i}" for i in range(8)]
    with pytest.raises(KeyError, match="resnet50"):
        create_model("resnet5O")


TINY_INPUTS = {
    "gpt_tiny": lambda: (torch.randint(0, 256, (2, 8)),),
    "gpt_transformer_tiny": lambda: (torch.randint(0, 256, (2, 8)),),
    "bert_tiny": lambda: (torch.randint(0, 128, (2, 8)),),
    "vit_tiny": lambda: (torch.randn(2, 3, 32, 32),),
    "swin_tiny_test": lambda: (torch.randn(1, 3, 32, 32),),
    "transformer003_tiny": lambda: (torch.randint(0, 64, (2, 8)),),
    "lstm_tiny": lambda: (torch.randn(2, 5, 8),),
    "mlp_tiny": lambda: (torch.randn(3, 16),),
    "lenet": lambda: (torch.randn(2, 1, 28, 28),),
}


@pytest.mark.parametrize("name", sorted(TINY_INPUTS))
def test_tiny_configs_run(name):
    m = create_model(name).eval()
    with torch.no_grad():
        out = m(*TINY_INPUTS[name]())
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()


def test_gpt_tiny_is_deterministic_in_train_mode():
    m = create_model("gpt_tiny").train()
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(m(x), m(x))
    assert hasattr(m, "allocate_kv_cache")


# ------------------------------------------------------------------------------------------------------
# Every registered builder builds; the small ones also run a forward on a tiny input chosen by family.
# ------------------------------------------------------------------------------------------------------
BIG_PARAMS = 6_000_000  # above this (the standard sizes, gpt_bench, mamba_small, ...) only build on meta
EFFICIENT_FAMILIES = ["mamba_tiny", "mamba2_tiny", "reformer_tiny", "performer_lm_tiny", "linformer_encoder_tiny",
                      "s4_lm_tiny", "longformer_tiny"]


def _ids(m, b=2, n=16):
    """Token ids valid for every embedding table of ``m``."""
    vocab = min(e.num_embeddings for e in m.modules() if isinstance(e, torch.nn.Embedding))
    return torch.randint(0, vocab, (b, n))


def _in_features(m) -> int:
    """Width of the first layer (the first submodule with an ``in_features`` attribute)."""
    return next(mod.in_features for mod in m.modules() if isinstance(getattr(mod, "in_features", None), int))


def _tiny_input(m) -> tuple:
    kind = type(m).__name__
    if kind in ("BERT", "BERTTransformer", "GPTModel", "GPTTransformer", "EfficientLM", "MambaLM", "Mamba2LM",
                "ReformerLM", "TransformerLM", "LongformerEncoder"):
        return (_ids(m),)
    if kind == "BERTModel":
        return (_ids(m), torch.zeros(2, 16, dtype=torch.long))
    if kind == "Transformer":
        return (_ids(m), _ids(m, n=12))
    if kind == "CLIP":
        return (torch.randn(2, 3, 32, 32), _ids(m))
    if kind == "MultiModalTransformer":
        return (torch.randn(2, 5, m.vision_proj.in_features), _ids(m))
    if kind == "LeNet":
        return (torch.randn(2, 1, 28, 28),)
    if kind in ("ResNet", "DenseNet", "MobileNetV2", "EfficientNet", "CNN", "VisionTransformer", "ViT",
                "SwinTransformer"):
        return (torch.randn(2, 3, 32, 32),)
    if kind in ("LSTM", "GRU", "VanillaRNN"):
        return (torch.randn(2, 6, m.input_size),)
    if kind == "MLP":
        return (torch.randn(3, _in_features(m)),)
    if kind in ("GCN", "GAT"):
        n = 7
        adj = (torch.rand(n, n) < 0.4).float()
        adj = ((adj + adj.T + torch.eye(n)) > 0).float()
        return (torch.randn(n, _in_features(m)), adj)
    raise AssertionError(f"no tiny input rule for {kind}: add one to tests/models/test_zoo.py")


def test_efficient_and_ssm_families_are_registered():
    names = set(list_models())
    assert set(EFFICIENT_FAMILIES) <= names, set(EFFICIENT_FAMILIES) - names


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_builds_and_runs(name):
    with torch.device("meta"):
        size = sum(p.numel() for p in create_model(name).parameters())
    assert size > 0
    if size > BIG_PARAMS or name in PUBLISHED:
        return  # built (on meta) and counted; the published counts are checked above
    m = create_model(name).eval()
    inputs = _tiny_input(m)
    with torch.no_grad():
        out = m(*inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    assert outs and all(torch.isfinite(o).all() for o in outs)
    assert outs[0].shape[0] == inputs[0].shape[0]


def test_longformer_encoder_is_local_and_has_global_tokens():
    m = create_model("longformer_tiny").eval()  # 2 layers, window 8: receptive field 16 each side
    x = torch.randint(0, 256, (1, 64))
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 256
    g = torch.zeros(1, 64)
    g[0, 0] = 1
    with torch.no_grad():
        a, b = m(x), m(x2)
        torch.testing.assert_close(a[:, :40], b[:, :40])
        assert not torch.allclose(a[:, -1], b[:, -1])
        ag, bg = m(x, g), m(x2, g)  # a global token at 0 sees (and is seen by) everything
        assert not torch.allclose(ag[:, 0], bg[:, 0])
    with pytest.raises(ValueError, match="max_len"):
        m(torch.zeros(1, 2048, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        m(torch.randn(1, 8))
