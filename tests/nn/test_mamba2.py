"""Mamba2 (mamba-ssm's constructor, init and state_dict keys; step == forward, prefill + decode, packed
sequences), RMSNormGated, and Mamba2LM (step decoding == forward, generate, training)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.nn import InferenceParams, Mamba2, Mamba2LM, RMSNormGated

SMALL = dict(d_state=8, headdim=8, chunk_size=8)
TOL = dict(rtol=1e-4, atol=1e-5)


def _mamba2(d_model=16, seed=0, **kw) -> Mamba2:
    torch.manual_seed(seed)
    m = Mamba2(d_model, **{**SMALL, **kw}).eval()
    with torch.no_grad():  # a non-trivial norm weight and D, so that their placement matters
        if m.rmsnorm:
            m.norm.weight.copy_(1 + 0.2 * torch.randn_like(m.norm.weight))
        m.D.copy_(1 + 0.2 * torch.randn_like(m.D))
    return m


def test_constructor_signature_is_mamba_ssms():
    params = [(p.name, p.default) for p in inspect.signature(Mamba2).parameters.values()]
    assert params == [
        ("d_model", inspect.Parameter.empty), ("d_state", 128), ("d_conv", 4), ("conv_init", None), ("expand", 2),
        ("headdim", 64), ("d_ssm", None), ("ngroups", 1), ("A_init_range", (1, 16)), ("D_has_hdim", False),
        ("rmsnorm", True), ("norm_before_gate", False), ("dt_min", 0.001), ("dt_max", 0.1),
        ("dt_init_floor", 1e-4), ("dt_limit", (0.0, float("inf"))), ("bias", False), ("conv_bias", True),
        ("chunk_size", 256), ("use_mem_eff_path", True), ("layer_idx", None), ("process_group", None),
        ("sequence_parallel", True), ("device", None), ("dtype", None)]


def test_state_dict_keys_shapes_and_init():
    m = Mamba2(64, d_state=16, headdim=16, ngroups=2, dt_min=0.01, dt_max=0.05, A_init_range=(2, 4), conv_init=0.1)
    assert m.d_inner == 128 and m.nheads == 8 and m.d_ssm == 128
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    conv_dim = 128 + 2 * 2 * 16
    assert shapes == {"in_proj.weight": (2 * 128 + 2 * 2 * 16 + 8, 64), "conv1d.weight": (conv_dim, 1, 4),
                      "conv1d.bias": (conv_dim,), "dt_bias": (8,), "A_log": (8,), "D": (8,),
                      "norm.weight": (128,), "out_proj.weight": (64, 128)}
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 0.01 * 0.999 and dt.max() <= 0.05 * 1.001
    A = m.A_log.exp()
    assert A.min() >= 2 and A.max() <= 4
    assert torch.equal(m.D, torch.ones(8))
    assert m.conv1d.weight.abs().max() <= 0.1
    assert m.norm.group_size == 64 and m.norm.eps == 1e-5 and not m.norm.norm_before_gate
    assert m.dt_bias._no_weight_decay and m.A_log._no_weight_decay and m.D._no_weight_decay
    # the floor: a dt range far below it gives dt = floor
    low = Mamba2(16, dt_min=1e-6, dt_max=2e-6, dt_init_floor=1e-3, **SMALL)
    torch.testing.assert_close(F.softplus(low.dt_bias), torch.full((4,), 1e-3))


def test_optional_parts():
    m = Mamba2(16, d_ssm=16, rmsnorm=False, D_has_hdim=True, bias=True, conv_bias=False, **SMALL)
    sd = m.state_dict()
    assert "norm.weight" not in sd and "conv1d.bias" not in sd
    assert sd["D"].shape == (16,) and "in_proj.bias" in sd and "out_proj.bias" in sd
    assert sd["in_proj.weight"].shape[0] == 2 * 32 + 2 * 8 + 2  # the gated-MLP half keeps its z0/x0 columns


def test_bad_arguments():
    with pytest.raises(ValueError, match="headdim"):
        Mamba2(16, headdim=5)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2(16, headdim=8, ngroups=3)
    with pytest.raises(ValueError, match="A_init_range"):
        Mamba2(16, headdim=8, A_init_range=(0, 1))
    with pytest.raises(NotImplementedError, match="process_group"):
        Mamba2(16, headdim=8, process_group=object())
    m = _mamba2()
    conv, ssm = m.allocate_inference_cache(2, 4)
    with pytest.raises(ValueError, match="hidden_states"):
        m.step(torch.randn(2, 3, 16), conv, ssm)
    with pytest.raises(ValueError, match="layer_idx"):
        m(torch.randn(2, 3, 16), inference_params=InferenceParams(4, 2))


VARIANTS = {
    "default": {},
    "groups": dict(ngroups=2, d_model=32),
    "no-rmsnorm": dict(rmsnorm=False),
    "norm-before-gate": dict(norm_before_gate=True),
    "D-hdim": dict(D_has_hdim=True),
    "mlp": dict(d_ssm=16, d_model=16),
    "dt-limit": dict(dt_limit=(0.02, 0.05)),
    "bias": dict(bias=True, conv_bias=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_equals_forward(variant):
    m = _mamba2(**VARIANTS[variant])
    u = torch.randn(2, 13, m.d_model)
    with torch.no_grad():
        full = m(u)
        conv, ssm = m.allocate_inference_cache(2, 13)
        outs = [m.step(u[:, t:t + 1], conv, ssm)[0] for t in range(13)]
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_step_equals_forward_on_every_decode_backend(backend):
    from fastarch.backend import use_backend

    m = _mamba2(ngroups=2, d_model=32)
    u = torch.randn(2, 6, 32)
    with torch.no_grad():
        full = m(u)
        conv, ssm = m.allocate_inference_cache(2, 6)
        # the step is one mamba2_mixer_step: fused on cpp, else op by op on the decode backend under test
        step = "cpp" if backend == "cpp" else "torch"
        with use_backend(selective_state_update=backend, causal_conv1d_update=backend, causal_conv1d=backend,
                         mamba2_mixer_step=step):
            outs = [m.step(u[:, t:t + 1], conv, ssm)[0] for t in range(6)]
            again = m(u)
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    torch.testing.assert_close(again, full, **TOL)


@pytest.mark.parametrize("variant", ["default", "groups", "mlp"])
def test_prefill_then_decode_through_inference_params(variant):
    kw = dict(VARIANTS[variant])
    m = _mamba2(layer_idx=3, **kw)
    u = torch.randn(2, 17, m.d_model)
    with torch.no_grad():
        full = m(u)
        params = InferenceParams(max_seqlen=17, max_batch_size=2)
        pre = m(u[:, :10], inference_params=params)  # a prompt longer than chunk_size and than d_conv
        assert 3 in params.key_value_memory_dict
        params.seqlen_offset = 10
        steps = []
        for t in range(10, 17):
            steps.append(m(u[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    torch.testing.assert_close(pre, full[:, :10], **TOL)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 10:], **TOL)


def test_short_prompt_prefill():
    """A prompt shorter than d_conv: the conv state is zero-padded in front."""
    m = _mamba2(layer_idx=0)
    u = torch.randn(1, 6, 16)
    with torch.no_grad():
        full = m(u)
        params = InferenceParams(6, 1)
        m(u[:, :2], inference_params=params)
        params.seqlen_offset = 2
        rest = []
        for t in range(2, 6):
            rest.append(m(u[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    torch.testing.assert_close(torch.cat(rest, 1), full[:, 2:], **TOL)


def test_flattened_input_with_seqlen_and_mem_eff_flag():
    m = _mamba2()
    u = torch.randn(2, 9, 16)
    with torch.no_grad():
        full = m(u)
        flat = m(u.reshape(18, 16), seqlen=9)
        m.use_mem_eff_path = False
        other = m(u)
    assert flat.shape == (18, 16)
    torch.testing.assert_close(flat.view(2, 9, 16), full)
    torch.testing.assert_close(other, full)


def test_packed_sequences_seq_idx_and_cu_seqlens():
    m = _mamba2(layer_idx=0)
    a, b = torch.randn(1, 7, 16), torch.randn(1, 12, 16)
    packed = torch.cat([a, b], 1)
    seq_idx = torch.tensor([[0] * 7 + [1] * 12], dtype=torch.int32)
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    with torch.no_grad():
        want = torch.cat([m(a), m(b)], 1)
        torch.testing.assert_close(m(packed, seq_idx=seq_idx), want, **TOL)
        torch.testing.assert_close(m(packed, cu_seqlens=cu), want, **TOL)
        # with inference_params, the cache gets each sequence's own states: decoding continues each of them
        params = InferenceParams(19, 2)
        m(packed, cu_seqlens=cu, inference_params=params)
        params.seqlen_offset = 1
        nxt = torch.randn(2, 1, 16)
        got = m(nxt, inference_params=params)
        for i, seq in enumerate((a, b)):
            ref = m(torch.cat([seq, nxt[i:i + 1]], 1))[:, -1:]
            torch.testing.assert_close(got[i:i + 1], ref, **TOL)


def test_forward_is_differentiable():
    m = Mamba2(16, **SMALL)
    u = torch.randn(2, 11, 16, requires_grad=True)
    m(u).square().mean().backward()
    assert u.grad is not None and torch.isfinite(u.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_rms_norm_gated_module():
    norm = RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False)
    assert norm.bias is None and torch.equal(norm.weight, torch.ones(12))
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(3, 12), torch.randn(3, 12)
    g = (x * F.silu(z)).view(3, 3, 4)
    want = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)).view(3, 12) * norm.weight
    torch.testing.assert_close(norm(x, z), want)


# -- Mamba2LM -----------------------------------------------------------------------------------------------
def _lm(**kw) -> Mamba2LM:
    torch.manual_seed(0)
    return Mamba2LM(**{"vocab_size": 50, "d_model": 16, "n_layers": 2, **SMALL, **kw}).eval()


def test_lm_structure_is_mamba_lm_head_models():
    lm = _lm()
    assert lm.lm_head.weight is lm.embedding.weight
    assert {k.split(".")[0] for k in lm.state_dict()} == {"embedding", "layers", "norm_f", "lm_head"}
    assert [m.mixer.layer_idx for m in lm.layers] == [0, 1]
    assert _lm(tie_embeddings=False).lm_head.weight is not _lm().embedding.weight


@pytest.mark.parametrize("kw", [{}, dict(ngroups=2, d_model=32)], ids=["default", "groups"])
def test_lm_step_decode_equals_forward(kw):
    lm = _lm(**kw)
    ids = torch.randint(0, 50, (2, 10))
    full = lm(ids)
    assert full.shape == (2, 10, 50)
    cache = lm.allocate_inference_cache(2)
    steps = torch.stack([lm.step(ids[:, t], cache) for t in range(10)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    assert cache.seqlen_offset == 10
    # prefill half, then step
    cache = lm.allocate_inference_cache(2)
    with torch.no_grad():
        pre = lm(ids[:, :6], cache=cache)
    rest = torch.stack([lm.step(ids[:, t:t + 1], cache) for t in range(6, 10)], 1)
    torch.testing.assert_close(torch.cat([pre, rest], 1), full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one token at a time"):
        lm(ids[:, :2], cache=cache)


def test_lm_generate_greedy_and_sampling():
    lm = _lm()
    ids = torch.randint(0, 50, (2, 4))
    out = lm.generate(ids, max_new_tokens=5)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], ids)
    for t in range(4, 9):  # greedy: each token is the argmax of a full forward over its prefix
        assert torch.equal(out[:, t], lm(out[:, :t])[:, -1].argmax(-1))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    s1 = lm.generate(ids, 6, temperature=1.0, top_k=10, generator=g1)
    s2 = lm.generate(ids, 6, temperature=1.0, top_k=10, generator=g2)
    assert torch.equal(s1, s2) and s1.shape == (2, 10)


def test_lm_works_with_fastarch_generation():
    from fastarch.generation import generate

    lm = _lm()
    ids = torch.randint(0, 50, (1, 5))
    out = generate(lm, ids, max_new_tokens=4)
    assert torch.equal(out, lm.generate(ids, max_new_tokens=4))


def test_lm_trains():
    lm = Mamba2LM(vocab_size=20, d_model=16, n_layers=1, **SMALL)
    ids = torch.randint(0, 20, (2, 8))
    loss = F.cross_entropy(lm(ids)[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1))
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters())


def test_forward_compiles_without_graph_breaks():
    m = _mamba2()
    u = torch.randn(2, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, fullgraph=True)(u), m(u), **TOL)


def test_bf16_step_with_fp32_dt_bias_A_log_and_D():
    """mamba-ssm keeps dt_bias, A_log and D in fp32 in a low-precision module: its decode step takes them so."""
    m = _mamba2(ngroups=2, d_model=32).to(torch.bfloat16)
    for p in (m.dt_bias, m.A_log, m.D):
        p.data = p.data.float()
    u = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        full = m(u)
        conv, ssm = m.allocate_inference_cache(2, 4)
        ssm = ssm.float()
        outs = [m.step(u[:, t:t + 1], conv, ssm)[0] for t in range(4)]
    got = torch.cat(outs, 1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), full.float(), atol=3e-2, rtol=3e-2)
