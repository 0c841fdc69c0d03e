"""Every transformers family whose layers ask for mamba_ssm / causal_conv1d kernels runs them on fastarch after
register(): tiny random configs of each family's own layer pattern (nothing is downloaded), logits and
gradients against transformers' PyTorch path, greedy tokens, and what report() says."""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastarch.compat as compat  # noqa: E402
from fastarch.integrations import transformers as fh  # noqa: E402

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def _configs() -> dict[str, tuple[str, dict]]:
    """family -> (model class name, config keywords): two layers, one of each kind where the family mixes."""
    attn = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
    return {
        "jamba": ("JambaForCausalLM", dict(SMALL, **attn, attn_layer_period=2, attn_layer_offset=1,
                                           expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                           num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
                                           mamba_expand=2, mamba_dt_rank=4)),
        "bamba": ("BambaForCausalLM", dict(SMALL, **attn, attn_layer_indices=[1], mamba_n_heads=4,
                                           mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                                           mamba_expand=2, mamba_chunk_size=8)),
        "falcon_h1": ("FalconH1ForCausalLM", dict(SMALL, **attn, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                                 mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                                                 mamba_expand=2, mamba_chunk_size=8)),
        "granitemoehybrid": ("GraniteMoeHybridForCausalLM",
                             dict(SMALL, **attn, layer_types=["mamba", "attention"], num_local_experts=2,
                                  num_experts_per_tok=1, shared_intermediate_size=48, mamba_n_heads=4,
                                  mamba_n_groups=1, mamba_d_state=8, mamba_d_head=16, mamba_d_conv=4,
                                  mamba_expand=2, mamba_chunk_size=8)),
        "lfm2": ("Lfm2ForCausalLM", dict(SMALL, **attn, layer_types=["conv", "full_attention"], conv_L_cache=3)),
        "falcon_mamba": ("FalconMambaForCausalLM", dict(SMALL, state_size=8, expand=2, conv_kernel=4,
                                                        time_step_rank=4)),
        # Zamba ties its shared transformer blocks across hybrid layers: two of them, so three layers.
        "zamba": ("ZambaForCausalLM", dict(SMALL, **attn, num_hidden_layers=3,
                                           layers_block_type=["hybrid", "mamba", "hybrid"], attention_head_dim=8,
                                           attention_hidden_size=64, n_mamba_heads=2, mamba_d_state=8,
                                           mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4)),
        "zamba2": ("Zamba2ForCausalLM", dict(SMALL, **attn, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
                                             mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
                                             chunk_size=8, num_mem_blocks=1, adapter_rank=4)),
        "nemotron_h": ("NemotronHForCausalLM", dict(SMALL, **attn, head_dim=8, layers_block_type=["mamba", "attention"],
                                                    ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16,
                                                    n_groups=1, conv_kernel=4, expand=2, chunk_size=8)),
        "lfm2_moe": ("Lfm2MoeForCausalLM", dict(SMALL, **attn, moe_intermediate_size=16, num_experts=2,
                                                num_experts_per_tok=1, num_dense_layers=1,
                                                layer_types=["conv", "full_attention"], conv_L_cache=3)),
    }


FAMILIES = _configs()
# Families whose Mamba-2 mixers take a CPU fp32 decode step as one fused mamba2_mixer_step.
FUSED_MAMBA2 = {"bamba", "zamba2", "nemotron_h", "granitemoehybrid"}


def _model(family: str):
    clsname, kw = FAMILIES[family]
    cls = getattr(transformers, clsname, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {clsname}")
    config = getattr(transformers, clsname.replace("ForCausalLM", "Config"))(**kw)
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # away from the near-uniform initialisation, so that every term shows
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias", "D")) and p.dim() >= 1:
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of fastarch's functions behind the patched kernel functions."""
    calls: dict[str, int] = {}
    fh.unregister()
    for name, fn in list(fh.kernels._KERNELS.items()):
        def counting(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        counting.__signature__ = __import__("inspect").signature(fn)
        monkeypatch.setitem(fh.kernels._KERNELS, name, counting)
    fused = fh.mamba._mamba2_step

    def fused_step(*args, **kwargs):
        calls["mamba2_mixer_step"] = calls.get("mamba2_mixer_step", 0) + 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(fh.mamba, "_mamba2_step", fused_step)
    fh.register()
    yield calls
    fh.unregister()


def _forward_backward(model, ids, mask):
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits * mask[..., None]).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runs_its_kernels_on_fastarch(family, training, kernel_calls):
    """Forward and backward, in eval (the prefill kernels) and in training (the fused training kernels where
    the family has them), against transformers' PyTorch path."""
    model = _model(family).train(training)
    ids = torch.randint(3, VOCAB, (2, 13))
    mask = torch.ones_like(ids)
    got = _forward_backward(model, ids, mask)
    assert kernel_calls, f"{family}: no kernel function reached fastarch"
    text = fh.report(model)
    left = [line for line in text.splitlines() if "transformers' resolution" in line]
    assert "fastarch (" in text and all("normalises dt" in line for line in left), text
    if family == "falcon_mamba" and training:
        # its fused training kernel is left to transformers, and the report says why (transformers 5.25 dropped
        # the fused path from FalconMamba: then there is nothing to leave)
        module = sys.modules[type(model).__module__]
        assert "mamba_inner_fn" not in kernel_calls and (bool(left) == hasattr(module, "mamba_inner_fn"))
    fh.unregister()
    want = _forward_backward(model, ids, mask)
    torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=2e-4)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, atol=2e-4, rtol=2e-3, msg=f"{family}: {name}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_generation_identical(family, kernel_calls):
    model = _model(family)
    ids = torch.randint(3, VOCAB, (2, 7))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        got = model.generate(ids, **gen)
        steps = dict(kernel_calls)
        fh.unregister()
        want = model.generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=2e-4, rtol=2e-4)
    # the decode steps ran on fastarch: one fused step per Mamba-2 mixer, else the conv update kernel
    decode = "mamba2_mixer_step" if family in FUSED_MAMBA2 else "causal_conv1d_update"
    assert steps.get(decode, 0) >= 5, steps


def test_register_before_or_after_importing_the_modeling_module():
    """A modeling module imported after register() gets the patches as it loads (the import hook); one
    imported before gets them from register()."""
    import importlib
    import sys

    name = "transformers.models.zamba.modeling_zamba"
    fh.unregister()
    sys.modules.pop(name, None)
    fh.register()
    try:
        module = importlib.import_module(name)
        assert hasattr(module.causal_conv1d_fn, "__fastarch_original__")
        fh.unregister()
        assert not hasattr(module.causal_conv1d_fn, "__fastarch_original__")
        fh.register()
        assert hasattr(module.causal_conv1d_fn, "__fastarch_original__")
    finally:
        fh.unregister()


def test_a_real_package_on_the_path_is_what_transformers_resolves(tmp_path, monkeypatch):
    """A stub causal_conv1d on the path (standing for the real package) is what transformers resolves, and
    fastarch's dispatcher keeps it for non-CPU tensors; compat.install() never shadows it."""
    import importlib
    import sys

    pkg = tmp_path / "causal_conv1d"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "CALLS = []\n"
        "def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,"
        " final_states_out=None, activation=None):\n"
        "    CALLS.append(x.device.type)\n    return x\n"
        "def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,"
        " conv_state_indices=None):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("causal_conv1d", "transformers.models.lfm2.modeling_lfm2"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    fh.unregister()
    compat.install()
    assert importlib.import_module("causal_conv1d").__file__.startswith(str(tmp_path))
    fh.register()
    try:
        module = importlib.import_module("transformers.models.lfm2.modeling_lfm2")
        stub = sys.modules["causal_conv1d"]
        fn = module.causal_conv1d_fn
        assert fn.__fastarch_original__ is not None
        x, w = torch.randn(1, 4, 6, device="meta"), torch.randn(4, 3, device="meta")
        # a non-CPU tensor goes where transformers' own function sends it (the real package, or from
        # transformers 5.25 on, the package only on the devices it runs on)
        fn.__fastarch_original__(x, w, None, activation="silu")
        routed = list(stub.CALLS)
        fn(x, w, None, activation="silu")
        assert stub.CALLS == routed + routed
        stub.CALLS.clear()
        x, w = torch.randn(1, 4, 6), torch.randn(4, 3)
        torch.testing.assert_close(fn(x, w, None, activation="silu"),
                                   compat.causal_conv1d.causal_conv1d_fn(x, w, None, activation="silu"))
        assert stub.CALLS == []  # a CPU tensor: fastarch
    finally:
        fh.unregister()
        sys.modules.pop("transformers.models.lfm2.modeling_lfm2", None)
