"""fastarch.integrations.transformers against transformers' own sdpa/eager attention and its PyTorch Mamba path,
on small models built from configs with random weights (nothing is downloaded)."""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import fastarch.ops as ops  # noqa: E402
from fastarch.integrations import transformers as fh  # noqa: E402
from fastarch.nn.mamba import mixer_step  # noqa: E402

ATOL = 1e-5  # fp32 logits against sdpa and eager
VOCAB = 101


@pytest.fixture(autouse=True)
def _registered():
    fh.register()
    yield
    fh.unregister()


# -- models -------------------------------------------------------------------------------------------------
def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


def _mistral(window: int = 6, **kw):
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                     max_position_embeddings=128, **kw)
    return transformers.MistralForCausalLM(cfg).eval()


def _gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _bert(**kw):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, **kw)
    return transformers.BertForMaskedLM(cfg).eval()


def _vit(**kw):
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_labels=5, **kw)
    return transformers.ViTForImageClassification(cfg).eval()


TEXT_MODELS = {"llama": _llama, "mistral": _mistral, "gpt2": _gpt2, "bert": _bert}
CAUSAL = ("llama", "mistral", "gpt2")


def _batch(padding: str, B: int = 3, L: int = 11):
    ids = torch.randint(1, VOCAB, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    if padding == "left":
        mask[0, :4] = 0
        mask[1, :1] = 0
    elif padding == "right":
        mask[0, -4:] = 0
        mask[2, -2:] = 0
    return ids, mask


def _logits(model, impl: str, **inputs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


def _rows(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """The query rows whose outputs are defined: a causal model's padded rows see no real key (left padding)
    and are not compared; a bidirectional model's padded rows still attend to the real tokens."""
    return mask.bool() if causal else torch.ones_like(mask, dtype=torch.bool)


# -- attention: logits, generation, gradients -------------------------------------------------------------
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("kind", list(TEXT_MODELS))
def test_logits_match_sdpa_and_eager(kind, padding):
    model = TEXT_MODELS[kind]()
    ids, mask = _batch(padding)
    inputs = {"input_ids": ids, "attention_mask": mask}
    rows = _rows(mask, kind in CAUSAL)
    got = _logits(model, "fastarch", **inputs)
    for impl in ("sdpa", "eager"):
        want = _logits(model, impl, **inputs)
        torch.testing.assert_close(got[rows], want[rows], atol=ATOL, rtol=0)


def test_vit_logits_match_sdpa_and_eager():
    model = _vit()
    pixels = torch.randn(2, 3, 32, 32)
    got = _logits(model, "fastarch", pixel_values=pixels)
    for impl in ("sdpa", "eager"):
        torch.testing.assert_close(got, _logits(model, impl, pixel_values=pixels), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", CAUSAL)
def test_greedy_generation_identical(kind):
    model = TEXT_MODELS[kind]()
    ids, mask = _batch("left", B=2, L=7)
    out = {}
    for impl in ("sdpa", "fastarch"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)
    # The Mistral model's window (6) is shorter than prompt + new tokens: its sliding cache layers drop keys.
    assert torch.equal(out["fastarch"], out["sdpa"])


def test_generation_with_static_cache_identical():
    model = _llama()
    ids, mask = _batch("left", B=2, L=7)
    out = {}
    for impl in ("sdpa", "fastarch"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   cache_implementation="static")
    assert torch.equal(out["fastarch"], out["sdpa"])


@pytest.mark.parametrize("kind", ["llama", "mistral", "bert"])
def test_gradients_match_sdpa(kind):
    model = TEXT_MODELS[kind]()
    ids, mask = _batch("left" if kind != "bert" else "right")
    rows = _rows(mask, kind in CAUSAL)
    grads = {}
    for impl in ("sdpa", "fastarch"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits[rows].square().mean()).backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["fastarch"].keys() == grads["sdpa"].keys()
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["fastarch"][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("length", [5, 6, 7, 13])
def test_mistral_window_edge(length):
    # window 6: at L=6 the last query sees every key, at L=7 the first key just falls out.
    model = _mistral(window=6)
    ids = torch.randint(1, VOCAB, (2, length))
    got = _logits(model, "fastarch", input_ids=ids)
    torch.testing.assert_close(got, _logits(model, "eager", input_ids=ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window_mapping_at_the_edge(window):
    """HF's sliding_window=w: query i sees keys i-w+1 .. i (window=(w-1, 0)); key i-w is outside."""
    assert fh.hf_window(window, causal=True) == (window - 1, 0)
    B, H, L, D = 1, 2, 10, 8
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    fn = masking_utils.sliding_window_causal_mask_function(window)
    mask = fh.attention_mask(B, L, L, mask_function=fn, local_size=window)
    assert isinstance(mask, fh.CompactMask) and mask.window == (window - 1, 0)
    dense = masking_utils.sdpa_mask(B, L, L, mask_function=fn, allow_is_causal_skip=False)
    module = torch.nn.Module()
    out = fh.attention_forward(module, q, k, v, mask)[0]
    want = sdpa_attention_forward(module, q, k, v, dense)[0]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    i = L - 1
    for j, visible in ((i - window + 1, True), (i - window, False)):
        v2 = v.clone()
        v2[:, :, j] += 10.0
        changed = fh.attention_forward(module, q, k, v2, mask)[0][:, i]
        assert bool((changed - out[:, i]).abs().max() > 1e-3) == visible, (j, visible)


def test_bidirectional_sliding_window_mapping():
    assert fh.hf_window(4, causal=False) == (4, 4)
    B, H, L, D = 2, 2, 9, 8
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    fn = masking_utils.sliding_window_bidirectional_mask_function(4)
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, -3:] = False
    mask = fh.attention_mask(B, L, L, mask_function=fn, attention_mask=pad, local_size=4)
    assert isinstance(mask, fh.CompactMask) and mask.window == (4, 4)
    dense = masking_utils.sdpa_mask(B, L, L, mask_function=fn, attention_mask=pad, allow_is_causal_skip=False)
    module = torch.nn.Module()
    torch.testing.assert_close(fh.attention_forward(module, q, k, v, mask)[0],
                               sdpa_attention_forward(module, q, k, v, dense)[0], atol=1e-6, rtol=0)


# -- masks --------------------------------------------------------------------------------------------------
def test_padding_is_a_key_padding_mask_and_no_dense_mask_is_built(monkeypatch):
    model = _mistral()
    ids, mask = _batch("left")
    seen = []
    real = fh.attention_mask

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    def no_dense(*args, **kwargs):
        raise AssertionError("a dense L x L mask was built")

    monkeypatch.setitem(masking_utils.AttentionMaskInterface._global_mapping, "fastarch", spy)
    monkeypatch.setattr(masking_utils, "sdpa_mask", no_dense)
    _logits(model, "fastarch", input_ids=ids, attention_mask=mask)
    assert seen and all(isinstance(m, fh.CompactMask) for m in seen)
    assert all(m.key_padding_mask is not None and m.key_padding_mask.shape == mask.shape for m in seen)
    assert torch.equal(seen[0].key_padding_mask, mask.bool())
    seen.clear()
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert all(isinstance(m, fh.CompactMask) and m.window == (5, 0) for m in seen)
    assert seen[0].key_padding_mask is not None  # the prompt's padded keys
    # the sliding cache (window 6) keeps 5 keys plus the new one; once the padded keys have left it, the
    # step takes the unmasked path
    assert seen[-1].key_length == 6 and seen[-1].key_padding_mask is None


def test_no_padded_key_takes_the_unmasked_path(monkeypatch):
    calls = []
    real = fh.attention._attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(fh.attention, "_attention", spy)
    model = _llama()
    ids, _ = _batch("none")
    _logits(model, "fastarch", input_ids=ids, attention_mask=torch.ones_like(ids))
    assert calls and all(c["key_padding_mask"] is None and c["attn_bias"] is None for c in calls)
    assert all(c["window"] == (-1, 0) for c in calls)


def test_gqa_runs_on_the_key_value_heads(monkeypatch):
    heads = []
    real = fh.attention._attention

    def spy(q, k, v, **kw):
        heads.append((q.shape[1], k.shape[1], v.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fh.attention, "_attention", spy)
    _logits(_llama(), "fastarch", input_ids=torch.randint(1, VOCAB, (1, 5)))
    assert heads and all(h == (4, 2, 2) for h in heads)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_custom_4d_mask(kind):
    model = _llama()
    L = 9
    ids = torch.randint(1, VOCAB, (2, L))
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    allowed[5:, 1:3] = False  # an arbitrary pattern no window or padding mask expresses
    allowed = allowed.expand(2, 1, L, L)
    mask4 = allowed if kind == "bool" else torch.zeros(2, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    got = _logits(model, "fastarch", input_ids=ids, attention_mask=mask4)
    torch.testing.assert_close(got, _logits(model, "sdpa", input_ids=ids, attention_mask=mask4), atol=ATOL, rtol=0)
    if kind == "float":  # eager adds the mask to the scores, so only an additive mask means the same there
        torch.testing.assert_close(got, _logits(model, "eager", input_ids=ids, attention_mask=mask4),
                                   atol=ATOL, rtol=0)


def _sliding(window: int):
    return masking_utils.and_masks(masking_utils.sliding_window_overlay(window),
                                   masking_utils.causal_mask_function)


@pytest.mark.parametrize("pattern", ["sink", "chunked", "per_batch", "causal_or_first"])
def test_unrecognised_mask_pattern_gets_the_dense_mask(pattern):
    """Patterns that are not one band per query (a sink key beside a sliding window, chunks, a pattern that
    differs between batch rows) get transformers' dense mask; a pattern equal to a band is that band."""
    B, L = 2, 6
    fn = {"sink": masking_utils.or_masks(_sliding(3), lambda b, h, q, kv: kv == 0),
          "chunked": masking_utils.and_masks(masking_utils.causal_mask_function,
                                             lambda b, h, q, kv: q // 4096 == kv // 4096),
          "per_batch": masking_utils.and_masks(masking_utils.causal_mask_function,
                                               lambda b, h, q, kv: (b == 0) | (q - kv < 2)),
          "causal_or_first": masking_utils.or_masks(masking_utils.causal_mask_function,
                                                    lambda b, h, q, kv: kv == 0)}[pattern]
    dense = fh.attention_mask(B, L, L, mask_function=fn)
    if pattern == "causal_or_first":  # the first key is in every causal row already: this is causal
        assert isinstance(dense, fh.CompactMask) and dense.window == (-1, 0)
        return
    assert isinstance(dense, torch.Tensor) and dense.shape == (B, 1, L, L) and dense.dtype == torch.bool
    q, k, v = (torch.randn(B, 4, L, 8) for _ in range(3))
    module = torch.nn.Module()
    torch.testing.assert_close(fh.attention_forward(module, q, k, v, dense)[0],
                               sdpa_attention_forward(module, q, k, v, dense)[0], atol=1e-6, rtol=0)


# -- arguments ----------------------------------------------------------------------------------------------
def test_scaling_and_position_bias_match_sdpa():
    B, H, L, D = 2, 4, 7, 16
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    bias = torch.randn(1, H, L, L)
    module = torch.nn.Module()
    module.is_causal = True
    mask = fh.attention_mask(B, L, L)
    got = fh.attention_forward(module, q, k, v, mask, scaling=0.3, position_bias=bias)[0]
    want = sdpa_attention_forward(module, q, k, v, None, scaling=0.3, position_bias=bias)[0]
    assert got.shape == (B, L, H, D)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_dropout_in_training():
    B, H, L, D = 1, 2, 8, 8
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    module = torch.nn.Module()
    mask = fh.attention_mask(B, L, L, mask_function=masking_utils.bidirectional_mask_function)
    torch.manual_seed(7)
    got = fh.attention_forward(module, q, k, v, mask, dropout=0.5)[0]
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # the op draws its seed the same way
    want = ops.attention_ref(q, k, v, dropout_p=0.5, dropout_seed=seed).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.allclose(got, fh.attention_forward(module, q, k, v, mask)[0])


def test_softcap():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = torch.nn.Module()
    mask = fh.attention_mask(1, 5, 5)
    if "softcap" not in fh.attention._OP_PARAMS:
        with pytest.raises(NotImplementedError, match="softcap"):
            fh.attention_forward(module, q, k, v, mask, softcap=30.0)
        return
    s = 30.0 * torch.tanh((q @ k.transpose(-1, -2)) * 8**-0.5 / 30.0)
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    want = (s.softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(fh.attention_forward(module, q, k, v, mask, softcap=30.0)[0], want,
                               atol=1e-5, rtol=0)


def test_unsupported_arguments_raise():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="attention_mask"):
        fh.attention_forward(module, q, k, v, torch.ones(1, 5, 5, dtype=torch.bool))


# -- attention sinks (gpt-oss) ------------------------------------------------------------------------------
def _gpt_oss(layers: int = 2):
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=4, max_position_embeddings=128,
                                    layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # sinks away from zero, so that they matter
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 2)
    return model


@pytest.mark.parametrize("padding", [False, True], ids=["full", "left_padded"])
def test_gpt_oss_sinks_match_eager(padding):
    """gpt-oss's sinks (s_aux) and alternating sliding windows: logits, gradients and greedy tokens as
    transformers' eager attention gives them."""
    model = _gpt_oss()
    ids = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    if padding:
        mask[1, :3] = 0
    model.set_attn_implementation("eager")
    want = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("fastarch")
    got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()[..., None]
    torch.testing.assert_close(got * real, want * real, atol=ATOL, rtol=1e-4)
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    (gs,) = torch.autograd.grad((got * real).square().mean(), sinks[:1])
    (ws,) = torch.autograd.grad((want * real).square().mean(), sinks[:1])
    torch.testing.assert_close(gs, ws, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.set_attn_implementation("eager")
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


# -- registration -------------------------------------------------------------------------------------------
def test_from_pretrained_and_set_attn_implementation(tmp_path):
    model = _llama()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="fastarch").eval()
    assert loaded.config._attn_implementation == "fastarch"
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, _logits(model, "sdpa", input_ids=ids), atol=ATOL, rtol=0)


def test_unregister_restores():
    from transformers.models.mamba import modeling_mamba as mm

    fh.unregister()
    originals = {a: getattr(mm, a) for a in ("causal_conv1d_fn", "causal_conv1d_update", "mamba_selective_scan",
                                             "mamba_selective_state_update", "mamba_inner_fn")}
    assert all(not hasattr(f, "__fastarch_original__") for f in originals.values())
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    sdpa_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    classes = (mm.MambaMixer, mm.MambaRMSNorm)
    forwards = [c.forward for c in classes]

    fh.register()
    assert all(c.forward.__fastarch_original__ is f for c, f in zip(classes, forwards))
    fh.register(name="sdpa", mamba=False)  # shadowing an existing name is undone too
    assert fh.registered() == ["fastarch", "sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is fh.attention_forward
    assert all(getattr(mm, a) is not f for a, f in originals.items())
    fh.unregister()
    assert fh.registered() == []
    assert "fastarch" not in ALL_ATTENTION_FUNCTIONS
    assert "fastarch" not in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask
    assert all(getattr(mm, a) is f for a, f in originals.items())
    assert all(not hasattr(c.forward, "__fastarch_original__") for c in classes)
    assert [c.forward for c in classes] == forwards
    with pytest.raises(ValueError, match="not supported"):
        _llama().set_attn_implementation("fastarch")


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import fastarch.integrations.transformers\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "pip install 'fastarch[hf]'" in out.stdout, out.stdout + out.stderr


# -- Mamba --------------------------------------------------------------------------------------------------
def _mamba():
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                   conv_kernel=4, expand=2)
    return transformers.MambaForCausalLM(cfg)


def _fwd_bwd(model, ids, training: bool):
    model.train(training)
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of fastarch's functions behind the patched Mamba kernel functions."""
    calls: dict[str, int] = {}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        run.__signature__ = __import__("inspect").signature(fn)
        return run

    fh.unregister()
    for name, fn in list(fh.kernels._KERNELS.items()):
        monkeypatch.setitem(fh.kernels._KERNELS, name, counting(name, fn))
    fh.register()
    return calls


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_mamba_forward_backward_match_pytorch_path(training, kernel_calls):
    model = _mamba()
    ids = torch.randint(0, VOCAB, (2, 19))
    got = _fwd_bwd(model, ids, training)
    expected_kernels = {"mamba_inner_fn"} if training else {"causal_conv1d_fn", "selective_scan_fn"}
    assert set(kernel_calls) == expected_kernels
    fh.unregister()
    want = _fwd_bwd(model, ids, training)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.fixture
def mixer_steps(monkeypatch):
    """Counts the decode steps the patched ``MambaMixer`` runs on fastarch's fused mixer step."""
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return mixer_step(*args)

    monkeypatch.setattr(fh.mamba, "_mixer_step", counting)
    return calls


def test_mamba_generate_identical(kernel_calls, mixer_steps):
    model = _mamba().eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert {"causal_conv1d_fn", "selective_scan_fn"} <= set(kernel_calls)  # the prefill
    assert len(mixer_steps) == 9 * 2 and set(mixer_steps) == {(2, 32)}  # 9 decode steps x 2 layers
    fh.unregister()
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)


def _cache_keyword() -> str:
    """The name of the Mamba models' cache argument and output field: ``cache`` from transformers 5.24,
    ``cache_params`` before."""
    params = inspect.signature(transformers.MambaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "cache_params"


def _prefilled(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    return getattr(out, _cache_keyword())


def test_mamba_decode_step_matches_pytorch_step(mixer_steps):
    """One decode step of the patched mixer (fused, on the module's weights) equals transformers' own step:
    the same logits and the same conv and SSM states afterwards."""
    model = _mamba().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, transformers.models.mamba.modeling_mamba.MambaMixer):
                m.conv1d.bias.normal_()
                m.D.normal_()
    ids = torch.randint(0, VOCAB, (3, 7))
    nxt = torch.randint(0, VOCAB, (3, 1))
    fh.unregister()
    want_cache = _prefilled(model, ids)
    fh.register()
    got_cache = _prefilled(model, ids)
    with torch.no_grad():
        got = model(input_ids=nxt, **{_cache_keyword(): got_cache}, use_cache=True).logits
        assert len(mixer_steps) == 2
        fh.unregister()
        want = model(input_ids=nxt, **{_cache_keyword(): want_cache}, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i in range(2):
        for get in ("get_conv_state", "get_recurrent_state"):
            torch.testing.assert_close(getattr(got_cache, get)(i), getattr(want_cache, get)(i), atol=1e-5,
                                       rtol=1e-5)


def test_mamba_decode_step_goes_to_transformers_where_fastarch_does_not_apply(mixer_steps, monkeypatch):
    """A padding mask, autograd, another dtype or a non-CPU tensor: transformers' own step runs."""
    from transformers.models.mamba import modeling_mamba as mm

    model = _mamba().eval()
    ids = torch.randint(0, VOCAB, (2, 5))
    nxt = torch.randint(0, VOCAB, (2, 1))
    cache = _prefilled(model, ids)
    with torch.no_grad():
        model(input_ids=nxt, **{_cache_keyword(): cache}, use_cache=True, attention_mask=torch.ones(2, 6, dtype=torch.long))
    model(input_ids=nxt, **{_cache_keyword(): cache}, use_cache=True)  # autograd on
    assert mixer_steps == []
    norms = []
    monkeypatch.setattr(fh.norms, "_rms_norm", lambda *args: norms.append(args) or args[0])
    norm = mm.MambaRMSNorm(32).to("meta")
    assert norm(torch.randn(2, 3, 32, device="meta")).device.type == "meta" and norms == []
    norm = mm.MambaRMSNorm(32).to(torch.bfloat16)
    x = torch.randn(2, 3, 32)  # an fp32 residual stream into a bf16 norm (residual_in_fp32)
    assert torch.equal(norm(x), mm.MambaRMSNorm.forward.__fastarch_original__(norm, x)) and norms == []
    norm = mm.MambaRMSNorm(32)
    norm(torch.randn(2, 3, 32))
    assert len(norms) == 1  # fp32 on CPU: fastarch's op
    with torch.no_grad():
        model.to(torch.bfloat16)
        cache = _prefilled(model, ids)
        model(input_ids=nxt, **{_cache_keyword(): cache}, use_cache=True)
    assert mixer_steps == []


def test_mamba_prefill_projections_run_on_fastarch_linear(mixer_steps, monkeypatch):
    """A prefill's nn.Linear projections (in_proj, x_proj, out_proj; transformers applies dt_proj's weight as a
    matmul) reach fastarch.ops.linear in fp32; the LM head and other dtypes are untouched."""
    seen = []
    real = fh.mamba._linear
    monkeypatch.setattr(fh.mamba, "_linear", lambda x, w, b=None: seen.append(tuple(w.shape)) or real(x, w, b))
    model = _mamba().eval()
    mixer = model.backbone.layers[0].mixer
    projections = [tuple(getattr(mixer, name).weight.shape) for name in ("in_proj", "x_proj", "out_proj")]
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert seen == projections * 2  # two layers; the LM head is not in a mixer
    seen.clear()
    with torch.no_grad():
        copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids)
    assert seen == []
    fh.unregister()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mamba_norm_matches_pytorch_path():
    from transformers.models.mamba import modeling_mamba as mm

    norm = mm.MambaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 5, 32)
    got = norm(x)
    torch.testing.assert_close(got, mm.MambaRMSNorm.forward.__fastarch_original__(norm, x), atol=1e-6, rtol=1e-5)


def test_mamba_accelerator_tensors_keep_the_real_kernels():
    """Where transformers resolved a kernel function to the real package, non-CPU tensors still reach it."""
    seen = []

    def real_kernel(x, weight, bias=None, activation=None):
        seen.append(x.device.type)
        return "real"

    assert not fh.kernels._real_package("fastarch_no_such_package")
    assert fh.kernels._real_package("torch")  # an importable package that is not fastarch's alias
    run = fh.kernels._dispatcher(real_kernel, "causal_conv1d_fn", real_package=True)
    w = torch.randn(4, 3, device="meta")
    assert run(torch.empty(1, 4, 5, device="meta"), w, None, activation="silu") == "real"
    x, w = torch.randn(1, 4, 5), torch.randn(4, 3)
    torch.testing.assert_close(run(x, w, None, activation="silu"),
                               ops.causal_conv1d(x, w, None, "silu"))
    assert seen == ["meta"]


def test_mamba_dispatcher_without_the_real_package_runs_fastarch_everywhere():
    seen = []
    run = fh.kernels._dispatcher(lambda *a, **k: seen.append(1), "causal_conv1d_fn", real_package=False)
    x, w = torch.randn(1, 4, 5), torch.randn(4, 3)
    torch.testing.assert_close(run(x, w, None, activation="silu", use_torch_path_only=True),
                               ops.causal_conv1d(x, w, None, "silu"))
    assert seen == []


def test_mamba_patches_every_kernel_function():
    from transformers.models.mamba import modeling_mamba as mm

    patched = [a for a, f in vars(mm).items() if hasattr(f, "__fastarch_original__")]
    assert sorted(patched) == ["causal_conv1d_fn", "causal_conv1d_update", "mamba_inner_fn",
                               "mamba_selective_scan", "mamba_selective_state_update"]
