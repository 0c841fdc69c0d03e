"""register(llama=True): the Llama-family RMSNorm forwards and ``apply_rotary_pos_emb`` on fastarch's rms_norm and
rotary_embedding, against transformers' own forwards, on small models built from configs with random weights
(nothing is downloaded)."""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastarch.integrations import transformers as fh  # noqa: E402

from .test_transformers import ATOL, VOCAB, _batch  # noqa: E402

LAYERS = 2


@pytest.fixture(autouse=True)
def _unregistered():
    fh.unregister()
    yield
    fh.unregister()


@pytest.fixture
def calls(monkeypatch):
    """Counts of the fastarch ops the patched functions reach."""
    counts = {"rms_norm": 0, "rotary": 0}

    def counting(key, fn):
        def run(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(fh.norms, "_rms_norm", counting("rms_norm", fh.norms._rms_norm))
    monkeypatch.setattr(fh.llama, "_rotary_embedding", counting("rotary", fh.llama._rotary_embedding))
    return counts


def _config(name: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "mistral":
        return transformers.MistralConfig(sliding_window=6, **common)
    return transformers.Qwen2Config(**common)


MODELS = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
          "qwen2": transformers.Qwen2ForCausalLM}


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name](_config(name)).eval()
    with torch.no_grad():  # non-trivial norm weights
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    return model


def _module(name: str):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _originals():
    out = {}
    for modname, clsname in fh.LLAMA_MODULES:
        module = importlib.import_module(modname)
        out[modname] = (module.apply_rotary_pos_emb, vars(getattr(module, clsname))["forward"])
    return out


def _mlp_forwards():
    return {(m, c): vars(getattr(importlib.import_module(m), c))["forward"] for m, c in fh.LLAMA_MLPS}


@pytest.mark.parametrize("listed", fh.LLAMA_MLPS, ids=[c for _, c in fh.LLAMA_MLPS])
def test_listed_mlps_compute_llamas_mlp(listed):
    """Each listed MLP class computes ``down(silu(gate(x)) * up(x))``, checked numerically on the patched
    forward (no autograd, so the in-place path runs) against the formula and the class's own forward."""
    modname, clsname = listed
    assert modname in {m for m, _ in fh.LLAMA_MODULES}
    cls = getattr(importlib.import_module(modname), clsname)
    torch.manual_seed(0)
    mlp = cls(transformers.LlamaConfig(hidden_size=16, intermediate_size=24, num_attention_heads=2,
                                       num_key_value_heads=2, hidden_act="silu"))
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)
        fh.register()
        torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-6)
        assert vars(cls)["forward"].__fastarch_original__ is not None


def test_mlp_patch_and_unregister_restores():
    before = _mlp_forwards()
    fh.register()
    during = _mlp_forwards()
    assert all(during[k] is not f and during[k].__fastarch_original__ is f for k, f in before.items())
    fh.unregister()
    assert _mlp_forwards() == before
    fh.register(llama=False)
    assert _mlp_forwards() == before


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_mlp_matches_original(act, grad):
    module = _module("llama")
    cfg = _config("llama")
    cfg.hidden_act = act
    torch.manual_seed(0)
    mlp = module.LlamaMLP(cfg)
    x = torch.randn(2, 5, cfg.hidden_size, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        want = mlp(x)
        fh.register()
        got = mlp(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got.requires_grad == grad
    if grad:
        (gx,) = torch.autograd.grad(got.sum(), x)
        fh.unregister()
        (wx,) = torch.autograd.grad(mlp(x).sum(), x)
        torch.testing.assert_close(gx, wx)


def test_unregister_restores_originals():
    before = _originals()
    fh.register()
    during = _originals()
    for modname, (rotary, forward) in before.items():
        assert during[modname][0] is not rotary and during[modname][0].__fastarch_original__ is rotary
        assert during[modname][1] is not forward and during[modname][1].__fastarch_original__ is forward
    fh.register(name="other")  # a second name patches nothing twice
    fh.unregister(name="other")
    assert _originals() == during
    fh.unregister()
    assert _originals() == before


def test_register_llama_false_patches_nothing():
    before = _originals()
    fh.register(llama=False)
    assert _originals() == before


# -- models ---------------------------------------------------------------------------------------------------
def _logits(model, impl: str, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_unpatched(name, padding, calls):
    model = _model(name)
    ids, mask = _batch(padding)
    refs = {impl: _logits(model, impl, ids, mask) for impl in ("sdpa", "eager")}
    assert calls == {"rms_norm": 0, "rotary": 0}
    fh.register()
    # fastarch attention: the rows of real tokens (a left-padded row sees no real key, so its output is undefined)
    rows = mask.bool()
    out = _logits(model, "fastarch", ids, mask)
    for ref in refs.values():
        torch.testing.assert_close(out[rows], ref[rows], atol=ATOL, rtol=0)
    # sdpa with the norms and rotary patched: every row
    torch.testing.assert_close(_logits(model, "sdpa", ids, mask), refs["sdpa"], atol=ATOL, rtol=0)
    # per forward: two norms per layer and the final norm; q and k in each layer (one table for the batch)
    assert calls == {"rms_norm": 2 * (2 * LAYERS + 1), "rotary": 2 * (2 * LAYERS)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_greedy_identical(name, calls):
    model = _model(name)
    ids, mask = _batch("left")
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, **kw)
    fh.register()
    model.set_attn_implementation("fastarch")
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    assert calls["rms_norm"] > 0 and calls["rotary"] > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_match(name, calls):
    ids, mask = _batch("right")

    def grads(impl: str):
        model = _model(name).train()
        model.set_attn_implementation(impl)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref = grads("sdpa")
    fh.register()
    loss, got = grads("fastarch")
    assert calls["rms_norm"] > 0 and calls["rotary"] > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


# -- the functions on their own -------------------------------------------------------------------------------
def _qkcs(B=2, H=4, Hk=2, L=7, D=16, tables=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, L, H, D, generator=g).transpose(1, 2)  # transformers' layout: a transposed projection
    k = torch.randn(B, L, Hk, D, generator=g).transpose(1, 2)
    pos = torch.arange(L)[None] + torch.arange(tables)[:, None] * 3  # per-sequence offsets when tables == B
    ang = pos[..., None].float() * (10000.0 ** (-torch.arange(0, D, 2) / D))
    emb = torch.cat([ang, ang], -1)
    return [t.to(device=device, dtype=dtype) for t in (q, k, emb.cos(), emb.sin())]


@pytest.mark.parametrize("tables", [1, 2])
def test_rotary_matches_original(tables, calls):
    fh.register()
    module = _module("llama")
    q, k, cos, sin = _qkcs(tables=tables)
    q.requires_grad_(True)
    k.requires_grad_(True)
    out = module.apply_rotary_pos_emb(q, k, cos, sin)
    assert calls["rotary"] == 2 * tables
    ref = module.apply_rotary_pos_emb.__fastarch_original__(q, k, cos, sin)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    dq = torch.randn_like(q)
    dk = torch.randn_like(k)
    got = torch.autograd.grad(out, (q, k), (dq, dk))
    want = torch.autograd.grad(ref, (q, k), (dq, dk))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rotary_low_precision_on_fastarch(dtype, calls):
    """bf16/fp16 q, k, cos, sin reach fastarch's rotary (fp32 arithmetic, one rounding): no further from the
    fp32 result than transformers' own low-precision arithmetic (FlashAttention's criterion)."""
    fh.register()
    module = _module("llama")
    q, k, cos, sin = _qkcs()
    low = [t.to(dtype) for t in (q, k, cos, sin)]
    got = module.apply_rotary_pos_emb(*low)
    assert calls["rotary"] == 2
    original = module.apply_rotary_pos_emb.__fastarch_original__
    theirs = original(*low)
    exact = original(*(t.float() for t in low))
    for g, t, e in zip(got, theirs, exact):
        assert g.dtype == dtype
        assert (g.float() - e).abs().max() <= 2 * (t.float() - e).abs().max() + 1e-5


def _fallback_cases():
    q, k, cos, sin = _qkcs()
    yield "float64", _qkcs(dtype=torch.float64), {}
    yield "meta", _qkcs(device="meta"), {}
    yield "halves differ", (q, k, cos, torch.randn_like(sin)), {}
    yield "unsqueeze_dim=2", (q.transpose(1, 2), k.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2}
    yield "cos with a gradient", (q, k, cos.requires_grad_(True), sin), {}


@pytest.mark.parametrize("case", list(_fallback_cases()), ids=lambda c: c[0])
def test_rotary_fallback_runs_original(case, calls):
    _, args, kw = case
    fh.register()
    module = _module("mistral")
    out = module.apply_rotary_pos_emb(*args, **kw)
    ref = module.apply_rotary_pos_emb.__fastarch_original__(*args, **kw)
    assert calls["rotary"] == 0
    if out[0].device.type != "meta":
        for a, b in zip(out, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,device", [(torch.float32, "cpu"), (torch.float64, "cpu"), (torch.bfloat16, "cpu"),
                                          (torch.float16, "cpu"), (torch.float32, "meta")])
def test_norm_fast_path_for_cpu_native_dtypes(dtype, device, calls):
    fh.register()
    module = _module("qwen2")
    torch.manual_seed(3)
    norm = module.Qwen2RMSNorm(32, eps=1e-5).to(device=device, dtype=dtype)
    if device != "meta":
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32).to(device=device, dtype=dtype)
    out = norm(x)
    native = device == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert calls["rms_norm"] == (1 if native else 0)
    assert out.dtype == dtype and out.device.type == device
    if device != "meta":
        ref = vars(module.Qwen2RMSNorm)["forward"].__fastarch_original__(norm, x)
        if dtype in (torch.bfloat16, torch.float16):
            # FlashAttention's criterion: no further from the fp32 result than transformers' own rounding
            exact = vars(module.Qwen2RMSNorm)["forward"].__fastarch_original__(norm.float(), x.float())
            assert (out.float() - exact).abs().max() <= 2 * (ref.float() - exact).abs().max() + 1e-5
        else:
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_norm_mixed_dtypes_run_original(calls):
    """An fp32 residual stream into a bf16 norm keeps transformers' promotion."""
    fh.register()
    module = _module("llama")
    norm = module.LlamaRMSNorm(32).to(torch.bfloat16)
    x = torch.randn(2, 5, 32)
    out = norm(x)
    assert calls["rms_norm"] == 0
    assert torch.equal(out, vars(module.LlamaRMSNorm)["forward"].__fastarch_original__(norm, x))


def test_rotary_tables_made_once_per_cos_sin_pair(monkeypatch):
    """Every layer of a forward gets the same cos/sin: their tables are made once; a cos/sin changed in place
    or a new pair gets new tables, and what comes out always matches transformers' rotation."""
    made = []
    real = fh.llama._tables_of
    monkeypatch.setattr(fh.llama, "_tables_of", lambda c, s: made.append(1) or real(c, s))
    fh.register()
    module = _module("llama")
    original = module.apply_rotary_pos_emb.__fastarch_original__
    q, k, cos, sin = _qkcs(tables=1)
    with torch.no_grad():
        for _ in range(3):  # three layers
            out = module.apply_rotary_pos_emb(q, k, cos, sin)
        assert len(made) == 1
        cos.mul_(0.5)  # in place: the cached tables are stale
        out = module.apply_rotary_pos_emb(q, k, cos, sin)
        assert len(made) == 2
        for a, b in zip(out, original(q, k, cos, sin)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        q2, k2, cos2, sin2 = _qkcs(tables=1)
        module.apply_rotary_pos_emb(q2, k2, cos2.clone(), sin2.clone())
        assert len(made) == 3


# -- the fused decode step ------------------------------------------------------------------------------------
def _step_model(name: str, seed: int = 0):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = {"llama": lambda: transformers.LlamaConfig(attention_bias=True, **common),
              "mistral": lambda: transformers.MistralConfig(sliding_window=6, **common),
              "qwen2": lambda: transformers.Qwen2Config(**common),
              "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **common),
              "phi3": lambda: transformers.Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **common)}[name]()
    torch.manual_seed(seed)
    cls = getattr(transformers, {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                                 "phi3": "Phi3"}[name] + "ForCausalLM")
    model = cls(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_fused_decode_step_generates_what_transformers_does(name, padding, monkeypatch):
    steps = []
    real = fh.decoder.decoder_out_step

    def counting(*args, **kwargs):
        steps.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fh.decoder, "decoder_out_step", counting)
    model = _step_model(name)
    ids, mask = _batch(padding)
    # 12 new tokens: past Mistral's 6-token window
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, **kw)
    fh.register()
    model.set_attn_implementation("fastarch")
    out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # every decode step of every layer is fused without padding; a padded batch takes the original forward
    # while a padded key is in view (Mistral's window leaves the padding behind after a few steps)
    if padding == "none":
        assert len(steps) == 11 * LAYERS
    elif name != "mistral":
        assert not steps
    assert "decode step" in fh.report(model)


def test_fused_decode_step_is_not_taken_under_autograd_or_other_attention(monkeypatch):
    taken = []
    monkeypatch.setattr(fh.decoder, "decoder_qkv_step", lambda *a, **k: taken.append(1))
    model = _step_model("llama")
    ids, mask = _batch("none")
    fh.register()
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("fastarch")
    with torch.enable_grad():
        cache = transformers.DynamicCache(config=model.config)
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert taken == []


@pytest.mark.parametrize("padding", ["none", "left"])
def test_fused_gpt2_decode_step_generates_what_transformers_does(padding, monkeypatch):
    steps = []
    real = fh.decoder.decoder_out_step
    monkeypatch.setattr(fh.decoder, "decoder_out_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=128,
                                     pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial layer norm biases
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.bias.uniform_(-0.2, 0.2)
    ids, mask = _batch(padding)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, **kw)
    fh.register()
    model.set_attn_implementation("fastarch")
    out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.scores, ref.scores):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert len(steps) == (7 * LAYERS if padding == "none" else 0)
    assert "GPT2Block" in fh.report(model)


def test_fused_decode_step_follows_replaced_and_reloaded_weights():
    model = _step_model("llama")
    ids, mask = _batch("none")
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    fh.register()

    def scores(impl):
        model.set_attn_implementation(impl)
        return torch.stack(model.generate(ids, **kw).scores)

    scores("fastarch")  # the layers keep their weights
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a replaced parameter and module, and an in-place reload
        layer.mlp.up_proj.weight = torch.nn.Parameter(torch.randn(layer.mlp.up_proj.weight.shape, generator=g))
        layer.self_attn.o_proj = torch.nn.Linear(64, 64, bias=True)
        model.model.layers[1].load_state_dict({k: v + 0.1 for k, v in model.model.layers[1].state_dict().items()})
    torch.testing.assert_close(scores("fastarch"), scores("sdpa"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_fused_decode_step_in_bf16(name, monkeypatch):
    """bf16 models: the fused step computes in fp32 (rounding once), transformers rounds after each op; the
    decode logits agree within bf16 noise, against an fp32 run of the same bf16 weights."""
    steps = []
    real = fh.decoder.decoder_out_step
    monkeypatch.setattr(fh.decoder, "decoder_out_step", lambda *a, **k: steps.append(1) or real(*a, **k))
    model = _step_model(name).to(torch.bfloat16)
    exact = _step_model(name).to(torch.bfloat16).float()  # the same bf16 values, computed in fp32
    ids, mask = _batch("none")

    def decode_logits(m, impl):
        m.set_attn_implementation(impl)
        with torch.no_grad():
            cache = transformers.DynamicCache(config=m.config)
            m(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            nxt = ids[:, :1]  # the same next token for every run
            mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
            return m(nxt, attention_mask=mask2, past_key_values=cache, use_cache=True).logits[:, -1].float()

    want = decode_logits(exact, "sdpa")
    plain = decode_logits(model, "sdpa")
    fh.register()
    got = decode_logits(model, "fastarch")
    assert len(steps) == LAYERS
    # at least as close to the fp32 computation as transformers' own bf16 path, up to bf16 noise
    assert (got - want).abs().max() <= 2 * (plain - want).abs().max() + 2e-2
