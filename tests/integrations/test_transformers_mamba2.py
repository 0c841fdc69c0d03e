"""HF ``Mamba2ForCausalLM`` on CPU with fastarch's kernels (after ``register()``) against its own PyTorch path,
from a small config with random weights (nothing downloaded): logits, gradients in training (the fused
split-conv1d scan), greedy generation, and what register()/unregister() patch."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.mamba2 import modeling_mamba2 as mm  # noqa: E402

from fastarch.integrations import transformers as fh  # noqa: E402
from tests.integrations import test_transformers as mamba1_tests  # noqa: E402

# The Mamba tests' fixture (counts the calls reaching fastarch's kernel functions) and training step.
kernel_calls = mamba1_tests.kernel_calls
_fwd_bwd = mamba1_tests._fwd_bwd

VOCAB = 101
KERNEL_ATTRS = ["causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan", "mamba2_selective_state_update",
                "mamba2_split_conv1d_scan_combined"]
# Mamba-2's gated norm class: MambaRMSNormGated up to transformers 5.24, Mamba2RMSNormGated from 5.25.
GATED_NORM = "Mamba2RMSNormGated" if hasattr(importlib.import_module("transformers.models.mamba2.modeling_mamba2"),
                                             "Mamba2RMSNormGated") else "MambaRMSNormGated"
NORM_CLASSES = [GATED_NORM, "Mamba2RMSNorm", "Mamba2Mixer"]  # classes whose forward register() swaps


@pytest.fixture(autouse=True)
def _registered():
    fh.register()
    yield
    fh.unregister()


def _mamba2(**kw):
    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=8, num_hidden_layers=2,
               n_groups=2, conv_kernel=4, expand=2, chunk_size=8)
    cfg.update(kw)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**cfg))
    with torch.no_grad():  # away from HF's near-uniform init, so that the comparisons see every term
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("kw", [{}, dict(time_step_limit=(0.01, 0.08)), dict(n_groups=1, chunk_size=256)],
                         ids=["default", "dt-limit", "one-group"])
def test_logits_match_pytorch_path(kw, kernel_calls):
    model = _mamba2(**kw).eval()
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert set(kernel_calls) == {"causal_conv1d_fn", "mamba_chunk_scan_combined"}
    fh.unregister()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_forward_backward_match_pytorch_path(training, kernel_calls):
    # Before transformers 5.24 the PyTorch path's gated norm ignores n_groups while its fused training kernel
    # (mamba-ssm's, and fastarch's) normalises per group: the two paths agree only with one group there.
    grouped = "group_size" in inspect.signature(getattr(mm, GATED_NORM)).parameters
    model = _mamba2() if grouped or not training else _mamba2(n_groups=1)
    ids = torch.randint(0, VOCAB, (2, 13))
    got = _fwd_bwd(model, ids, training)
    unfused = {"causal_conv1d_fn", "mamba_chunk_scan_combined"}
    # training without a cache takes the fused kernel; transformers 5.25 builds a cache in every forward with
    # use_cache set, so its training forward runs the unfused kernels (all on fastarch either way)
    assert set(kernel_calls) in (({"mamba_split_conv1d_scan_combined"}, unfused) if training else (unfused,))
    fh.unregister()
    want = _fwd_bwd(model, ids, training)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, atol=1e-4, rtol=1e-3, msg=name)


@pytest.fixture
def mamba2_steps(monkeypatch):
    """Counts the decode steps the patched ``Mamba2Mixer`` runs as one fused ``mamba2_mixer_step``."""
    calls = []
    real = fh.mamba._mamba2_step

    def counting(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(fh.mamba, "_mamba2_step", counting)
    return calls


@pytest.mark.parametrize("kw", [{}, dict(n_groups=1), dict(time_step_limit=(0.01, 0.08))],
                         ids=["two-groups", "one-group", "dt-limit"])
def test_greedy_generation_identical(kw, kernel_calls, mamba2_steps):
    """Prefill on fastarch's kernels, every decode step one fused mixer step: the same tokens and logits as
    transformers' own path (whose decode step applies no time_step_limit)."""
    model = _mamba2(**kw).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0,
               output_logits=True, return_dict_in_generate=True)
    got = model.generate(ids, **gen)
    assert "mamba_chunk_scan_combined" in kernel_calls  # the prefill
    assert mamba2_steps == [(2, 32)] * (9 * 2)  # 9 decode steps x 2 layers
    fh.unregister()
    want = model.generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)


def test_bf16_model_with_fp32_residual_stream():
    """A bf16 model feeds its fp32 residual stream into the bf16 final norm: that mixed-dtype call stays on
    transformers' forward; the logits match the unregistered model's within bf16 rounding, and generation runs
    (bf16 rounding may pick different tokens after a near-tie, so tokens are not compared)."""
    model = _mamba2(residual_in_fp32=True).eval().to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 11))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    tokens = model.generate(ids, **kw)
    fh.unregister()
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert tokens.shape == (2, 17) and torch.equal(tokens[:, :11], ids)


def test_register_patches_and_unregister_restores():
    patched = sorted(a for a, f in vars(mm).items() if hasattr(f, "__fastarch_original__"))
    assert patched == sorted(KERNEL_ATTRS)
    assert all(hasattr(vars(getattr(mm, c))["forward"], "__fastarch_original__") for c in NORM_CLASSES)
    fh.unregister()
    assert all(not hasattr(getattr(mm, a), "__fastarch_original__") for a in KERNEL_ATTRS)
    assert all(not hasattr(vars(getattr(mm, c))["forward"], "__fastarch_original__") for c in NORM_CLASSES)
    # transformers' own fused stub (no mamba_ssm here) sends the mixer down its unfused path again
    assert mm.mamba2_split_conv1d_scan_combined(torch.zeros(1, 1, 1), None, None, None, None, None, 1) is None


def test_projections_run_on_fastarch_linear(monkeypatch):
    """Inside the mixers (prefill, training), the nn.Linear projections reach fastarch.ops.linear, fp32 only
    (a CPU fp32 decode step is one fused mixer step); the head outside the mixers and every call after the forward are untouched."""
    seen = []
    real = fh.mamba._linear
    monkeypatch.setattr(fh.mamba, "_linear", lambda x, w, b=None: seen.append((tuple(w.shape), x.dtype)) or real(x, w, b))
    model = _mamba2().eval()
    mixer = model.backbone.layers[0].mixer
    projections = [(tuple(mixer.in_proj.weight.shape), torch.float32), (tuple(mixer.out_proj.weight.shape), torch.float32)]
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        model(input_ids=ids)
    assert seen == projections * 2  # two layers; the LM head is not in a mixer
    seen.clear()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen == projections * 2  # the prefill; the two decode steps are fused mixer steps
    seen.clear()
    torch.nn.functional.linear(torch.randn(2, 32), mixer.in_proj.weight)
    model.to(torch.bfloat16)(input_ids=ids)
    assert seen == []
    seen.clear()
    model.float().train()(input_ids=ids).logits.sum().backward()
    assert seen[0] == projections[0] and mixer.in_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 4])
def test_norms_run_on_fastarch_and_match(dtype, groups, monkeypatch):
    """The swapped norm forwards reach fastarch's norm ops and agree with transformers' own forwards."""
    calls = []
    for name, fn in (("_rms_norm", fh.norms._rms_norm), ("_rms_norm_gated", fh.norms._rms_norm_gated)):
        monkeypatch.setattr(fh.norms, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    torch.manual_seed(0)
    if "group_size" in inspect.signature(getattr(mm, GATED_NORM)).parameters:
        gated = getattr(mm, GATED_NORM)(64, group_size=64 // groups, eps=1e-5)
    elif groups == 1:  # before transformers 5.24 the gated norm is one group over the whole width
        gated = getattr(mm, GATED_NORM)(64, eps=1e-5)
    else:
        pytest.skip(f"transformers {transformers.__version__}'s gated norm has no groups")
    plain = mm.Mamba2RMSNorm(64, eps=1e-5)
    for norm in (gated, plain):
        norm.weight.data.add_(0.3 * torch.randn(64))
        norm.to(dtype)
    x, gate = torch.randn(2, 7, 64, dtype=dtype) * 3, torch.randn(2, 7, 64, dtype=dtype)
    with torch.no_grad():
        got = gated(x, gate), gated(x), plain(x)
    assert calls == ["_rms_norm_gated", "_rms_norm_gated", "_rms_norm"]
    fh.unregister()
    with torch.no_grad():
        want = gated(x, gate), gated(x), plain(x)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)


def test_accelerator_tensors_keep_the_real_kernel():
    """Where transformers found the real mamba_ssm, non-CPU tensors still reach it."""
    seen = []

    def real(zxbcdt, *args, **kwargs):
        seen.append(zxbcdt.device.type)
        return "real"

    run = fh.kernels._dispatcher(real, "mamba_split_conv1d_scan_combined", real_package=True)
    assert run(torch.empty(1, 2, 3, device="meta")) == "real" and seen == ["meta"]
