"""fastarch.compat.fla: fla's gated delta rule and KDA entry points (signatures, defaults, positional order,
returns), the ``fla`` alias of install(), ImportErrors for what it lacks, and transformers' Gated DeltaNet and
KDA families running them after register()."""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import fastarch.compat as compat
from fastarch.compat.fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fastarch.compat.fla.ops.kda import chunk_kda, fused_recurrent_kda
from fastarch.ops import gated_delta_rule_ref, kda_ref

EMPTY = inspect.Parameter.empty
# fla's signatures: (name, default) in positional order; "**" a var-keyword parameter
SIGNATURES = {
    chunk_gated_delta_rule: [("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", EMPTY), ("beta", EMPTY),
                             ("scale", None), ("initial_state", None), ("output_final_state", False),
                             ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("cp_context", None),
                             ("kwargs", "**")],
    fused_recurrent_gated_delta_rule: [("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", None), ("gk", None),
                                       ("gv", None), ("beta", None), ("scale", None), ("initial_state", None),
                                       ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
                                       ("cu_seqlens", None), ("kwargs", "**")],
    chunk_kda: [("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", EMPTY), ("beta", EMPTY), ("scale", None),
                ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
                ("use_gate_in_kernel", False), ("cu_seqlens", None), ("chunk_indices", None), ("kwargs", "**")],
    fused_recurrent_kda: [("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("g", EMPTY), ("beta", None), ("scale", None),
                          ("initial_state", None), ("output_final_state", False),
                          ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("kwargs", "**")],
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_signature_is_fla_s(fn):
    got = [(p.name, "**" if p.kind is p.VAR_KEYWORD else p.default) for p in inspect.signature(fn).parameters.values()]
    assert got == SIGNATURES[fn]


def _inputs(per_key: bool, B=2, T=37, hk=1, hv=2, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gshape = (B, T, hv, K) if per_key else (B, T, hv)
    return (torch.randn(B, T, hk, K, generator=gen), torch.randn(B, T, hk, K, generator=gen),
            torch.randn(B, T, hv, V, generator=gen), F.logsigmoid(torch.randn(*gshape, generator=gen)),
            torch.rand(B, T, hv, generator=gen), torch.randn(B, hv, K, V, generator=gen))


@pytest.mark.parametrize("fn,ref,per_key", [(chunk_gated_delta_rule, gated_delta_rule_ref, False),
                                            (fused_recurrent_gated_delta_rule, gated_delta_rule_ref, False),
                                            (chunk_kda, kda_ref, True), (fused_recurrent_kda, kda_ref, True)],
                         ids=["chunk_gdn", "recurrent_gdn", "chunk_kda", "recurrent_kda"])
def test_positional_call_matches_the_recurrence(fn, ref, per_key):
    q, k, v, g, beta, h0 = _inputs(per_key)
    if fn is fused_recurrent_gated_delta_rule:  # g, gk, gv, beta: beta is the 7th positional argument
        o, S = fn(q, k, v, g, None, None, beta, 0.3, h0, True, True)
    else:
        o, S = fn(q, k, v, g, beta, 0.3, h0, True, True)
    ro, rS = ref(q, k, v, g, beta, 0.3, h0, True, True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, rS, rtol=1e-4, atol=1e-4)
    assert fn(q, k, v, g, beta=beta)[1] is None  # no final state unless asked


def test_fused_recurrent_gates_and_beta_defaults():
    q, k, v, g, beta, h0 = _inputs(False)
    gk = F.logsigmoid(torch.randn(2, 37, 2, 16))
    ones = torch.ones_like(beta)
    zero = torch.zeros_like(g)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g=g)  # beta defaults to ones
    torch.testing.assert_close(o, gated_delta_rule_ref(q, k, v, g, ones)[0], rtol=1e-4, atol=1e-4)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, beta=beta)  # no gate: no decay
    torch.testing.assert_close(o, gated_delta_rule_ref(q, k, v, zero, beta)[0], rtol=1e-4, atol=1e-4)
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta)  # both: their sum per channel
    torch.testing.assert_close(o, kda_ref(q, k, v, gk + g[..., None], beta)[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match="'gv'"):
        fused_recurrent_gated_delta_rule(q, k, v, g=g, gv=torch.zeros(2, 37, 2, 8), beta=beta)


def test_head_first_is_deprecated_and_honoured():
    q, k, v, g, beta, h0 = _inputs(False)
    want, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    with pytest.warns(DeprecationWarning, match="head_first"):
        got, _ = chunk_gated_delta_rule(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), head_first=True)
    torch.testing.assert_close(got, want.transpose(1, 2))
    with pytest.warns(DeprecationWarning, match="head_first"):
        got, _ = fused_recurrent_gated_delta_rule(*(t.transpose(1, 2) for t in (q, k, v)), g=g.transpose(1, 2),
                                                  beta=beta.transpose(1, 2), head_first=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-4, atol=1e-4)


def test_chunk_kda_keywords():
    q, k, v, g, beta, h0 = _inputs(True)
    A_log, dt_bias = torch.randn(2), torch.randn(32)
    raw = torch.randn_like(g)
    o, _ = chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, safe_gate=True,
                     chunk_indices=None, use_qk_l2norm_in_kernel=True)
    ro, _ = kda_ref(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                    use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    o, _ = chunk_kda(q, k, v, g, beta * 4 - 2, use_beta_sigmoid_in_kernel=True)
    torch.testing.assert_close(o, kda_ref(q, k, v, g, torch.sigmoid(beta * 4 - 2))[0], rtol=1e-4, atol=1e-4)
    o, _ = fused_recurrent_kda(q, k, v, raw, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                               use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda(q, k, v, raw, beta, use_gate_in_kernel=True)
    with pytest.raises(NotImplementedError, match="transpose_state_layout"):
        chunk_kda(q, k, v, g, beta, transpose_state_layout=True)
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_gated_delta_rule(q, k, v, g[..., 0], beta, cp_context=object())


def test_fla_errors_for_packed_sequences():
    """fla's own checks: batch 1 with cu_seqlens, one initial state per sequence (ValueError, as fla)."""
    q, k, v, g, beta, h0 = _inputs(False)
    cu = torch.tensor([0, 10, 37], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0[:1], cu_seqlens=cu)
    o, S = chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0, cu_seqlens=cu,
                                  output_final_state=True)
    ro, rS = gated_delta_rule_ref(q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=h0, cu_seqlens=cu,
                                  output_final_state=True)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, rS, rtol=1e-4, atol=1e-4)


def test_what_fastarch_lacks_raises_import_error_naming_it():
    import fastarch.compat.fla as fla

    with pytest.raises(ImportError, match=r"fla\.ops\.chunk_gla"):
        from fastarch.compat.fla.ops import chunk_gla  # noqa: F401
    with pytest.raises(ImportError, match=r"fla\.ops\.kda\.naive"):
        from fastarch.compat.fla.ops.kda import naive  # noqa: F401
    with pytest.raises(ImportError, match=r"fla\.FusedRMSNormGated"):
        fla.FusedRMSNormGated  # noqa: B018
    assert fla.chunk_kda is chunk_kda  # transformers looks a function up at the top level first


@pytest.fixture
def aliased():
    compat.uninstall()
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("the real fla is installed here; install() never shadows it")
    yield compat.install()
    compat.uninstall()


def test_install_aliases_fla(aliased):
    assert "fla" in aliased
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as aliased_chunk
    from fla.ops.kda import fused_recurrent_kda as aliased_recurrent

    assert aliased_chunk is chunk_gated_delta_rule and aliased_recurrent is fused_recurrent_kda
    with pytest.raises(ModuleNotFoundError, match=r"fla\.layers"):
        import fla.layers  # noqa: F401
    assert importlib.util.find_spec("fla.layers") is None  # a probe for an optional part still answers None
    with pytest.raises(ImportError, match=r"fla\.modules"):
        from fla.modules import FusedRMSNormGated  # noqa: F401
    with pytest.raises(ImportError, match=r"fla\.ops\.chunk_gla"):
        from fla.ops import chunk_gla  # noqa: F401
    compat.uninstall()
    assert "fla" not in sys.modules


def test_a_real_fla_is_never_shadowed(tmp_path, monkeypatch):
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    compat.uninstall()
    sys.modules.pop("fla", None)
    try:
        assert "fla" not in compat.install()
        import fla

        assert getattr(fla, "REAL", False)
    finally:
        compat.uninstall()
        sys.modules.pop("fla", None)


# -- transformers' Gated DeltaNet and KDA families -------------------------------------------------------------
def _hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, pad_token_id=0)
    if family == "qwen3_next":
        cls, config = "Qwen3NextForCausalLM", dict(
            small, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, head_dim=8,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    else:
        cls, config = "KimiLinearForCausalLM", dict(
            small, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48, bos_token_id=1,
            eos_token_id=2, linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2], num_heads=2, head_dim=8,
                                                    short_conv_kernel_size=4))
    model_cls = getattr(transformers, cls, None)
    if model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    torch.manual_seed(0)
    model = model_cls(getattr(transformers, cls.replace("ForCausalLM", "Config"))(**config)).eval()
    with torch.no_grad():  # away from the near-uniform initialisation
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")) and p.dim() >= 1:
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture
def delta_calls(monkeypatch):
    """Counts the calls that reach fastarch's fla functions through transformers' kernel functions."""
    pytest.importorskip("transformers")  # optional; fastarch's integration itself must import
    from fastarch.integrations import transformers as fh
    calls: dict[str, int] = {}
    fh.unregister()
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda"):
        fn = fh.kernels._KERNELS[name]

        def counting(*args, _fn=fn, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        counting.__signature__ = inspect.signature(fn)
        monkeypatch.setitem(fh.kernels._KERNELS, name, counting)
    fh.register()
    yield fh, calls
    fh.unregister()


@pytest.mark.parametrize("family,chunk,step", [("qwen3_next", "chunk_gated_delta_rule",
                                                "fused_recurrent_gated_delta_rule"),
                                               ("kimi_linear", "chunk_kda", "fused_recurrent_kda")])
def test_transformers_family_runs_the_delta_rule_on_fastarch(family, chunk, step, delta_calls):
    """Logits and gradients against transformers' PyTorch path, greedy tokens identical, prefill on the chunked
    function and each decode step on the recurrent one; report() says so."""
    fh, calls = delta_calls
    model = _hf_model(family)
    ids = torch.randint(3, 64, (2, 13))

    def forward_backward():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got = forward_backward()
    assert calls.get(chunk, 0) >= 1, calls
    text = fh.report(model)
    assert f"fastarch ({chunk})" in text and f"fastarch ({step})" in text, text
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert calls.get(step, 0) >= 4, calls  # the decode steps
    fh.unregister()
    want = forward_backward()
    with torch.no_grad():
        want_tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    for name, grad in want[1].items():
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(got[1][name], grad, rtol=1e-3, atol=1e-5 * scale, msg=f"{family}: {name}")
    assert torch.equal(tokens, want_tokens)
    assert not math.isnan(got[0].sum().item())
