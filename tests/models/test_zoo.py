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
