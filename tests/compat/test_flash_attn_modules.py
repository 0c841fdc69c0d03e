"""flash_attn.modules (MHA, Mlp, GatedMlp, Block), flash_attn.utils and the refusal of missing names
(fastarch.compat.flash_attn) on CPU tensors: state_dicts with flash-attn's keys load and give the outputs of a
reference transcribed from flash-attn's dense attention modules; KV-cache decoding matches the full forward."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastarch.compat
from fastarch.compat.flash_attn.modules.block import Block
from fastarch.compat.flash_attn.modules.mha import MHA, get_alibi_slopes
from fastarch.compat.flash_attn.modules.mlp import GatedMlp, Mlp
from fastarch.compat.flash_attn.ops.triton.layer_norm import RMSNorm
from fastarch.compat.flash_attn.utils.distributed import all_gather_raw, all_reduce, get_dim_for_local_rank
from fastarch.compat.flash_attn.utils.generation import InferenceParams


def _rotate(x, pos, rotary_dim, base=10000.0, interleaved=False):
    """Rotary reference on x (B, L, H, D) at positions pos (L,) or (B, L)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ang = pos.float()[..., None] * inv_freq
    cos, sin = ang.cos(), ang.sin()
    if pos.ndim == 1:
        cos, sin = cos[None], sin[None]
    if interleaved:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        a, b = x[..., :rotary_dim:2], x[..., 1:rotary_dim:2]
        rot = torch.stack((-b, a), -1).flatten(-2)
    else:
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        a, b = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim]
        rot = torch.cat((-b, a), -1)
    c, s = c[:, :, None], s[:, :, None]
    return torch.cat([x[..., :rotary_dim] * c + rot * s, x[..., rotary_dim:]], -1)


def mha_reference(sd, x, num_heads, num_heads_kv, causal, rotary_dim=0, key_padding_mask=None, x_kv=None,
                  softmax_scale=None):
    """flash-attn's dense MHA path (SelfAttention / CrossAttention: einsum scores, -10000 masks) from a
    state_dict with flash-attn's keys."""
    B, Lq, E = x.shape
    D = E // num_heads
    if "Wqkv.weight" in sd:
        qkv = F.linear(x, sd["Wqkv.weight"], sd.get("Wqkv.bias"))
        q, kv = qkv[..., : num_heads * D], qkv[..., num_heads * D:]
    else:
        q = F.linear(x, sd["Wq.weight"], sd.get("Wq.bias"))
        kv = F.linear(x_kv if x_kv is not None else x, sd["Wkv.weight"], sd.get("Wkv.bias"))
    Lk = kv.shape[1]
    q = q.reshape(B, Lq, num_heads, D)
    k, v = kv.reshape(B, Lk, 2, num_heads_kv, D).unbind(2)
    if rotary_dim:
        q, k = _rotate(q, torch.arange(Lq), rotary_dim), _rotate(k, torch.arange(Lk), rotary_dim)
    k = k.repeat_interleave(num_heads // num_heads_kv, dim=2)
    v = v.repeat_interleave(num_heads // num_heads_kv, dim=2)
    scale = softmax_scale or 1.0 / math.sqrt(D)
    scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    if key_padding_mask is not None:
        scores = scores + torch.where(key_padding_mask, 0.0, -10000.0)[:, None, None, :]
    if causal:  # cross-attention aligns on each row's key count, as flash-attn's CrossAttention
        row = torch.arange(Lq)[:, None]
        col = torch.arange(Lk)[None, :]
        sk = Lk if key_padding_mask is None or Lq == Lk else key_padding_mask.sum(-1)[:, None, None, None]
        scores = scores.masked_fill(col > row + sk - Lq, -10000.0)
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v)
    return F.linear(out.reshape(B, Lq, E), sd["out_proj.weight"], sd.get("out_proj.bias"))


def _peer_state_dict(E, H, Hk, cross=False, qkv_bias=True, out_bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = E // H
    sd = {}
    if cross:
        sd["Wq.weight"] = torch.randn(E, E, generator=g) / math.sqrt(E)
        sd["Wkv.weight"] = torch.randn(2 * Hk * D, E, generator=g) / math.sqrt(E)
        if qkv_bias:
            sd["Wq.bias"], sd["Wkv.bias"] = torch.randn(E, generator=g), torch.randn(2 * Hk * D, generator=g)
    else:
        sd["Wqkv.weight"] = torch.randn((H + 2 * Hk) * D, E, generator=g) / math.sqrt(E)
        if qkv_bias:
            sd["Wqkv.bias"] = torch.randn((H + 2 * Hk) * D, generator=g)
    sd["out_proj.weight"] = torch.randn(E, E, generator=g) / math.sqrt(E)
    if out_bias:
        sd["out_proj.bias"] = torch.randn(E, generator=g)
    return sd


@pytest.mark.parametrize("use_flash_attn", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_heads_kv", [None, 2])
@pytest.mark.parametrize("rotary_emb_dim", [0, 8])
def test_mha_self_attention_loads_peer_state_dict(use_flash_attn, causal, num_heads_kv, rotary_emb_dim):
    E, H, B, L = 64, 4, 2, 9
    bias = num_heads_kv is None  # qkv_proj_bias and out_proj_bias, one on and one off
    Hk = num_heads_kv or H
    sd = _peer_state_dict(E, H, Hk, qkv_bias=bias, out_bias=not bias)
    mha = MHA(E, H, num_heads_kv=num_heads_kv, qkv_proj_bias=bias, out_proj_bias=not bias, causal=causal,
              rotary_emb_dim=rotary_emb_dim, use_flash_attn=use_flash_attn)
    assert sorted(mha.state_dict()) == sorted(sd)
    mha.load_state_dict(sd)
    x = torch.randn(B, L, E, requires_grad=True)
    out = mha(x)
    xr = x.detach().clone().requires_grad_()
    want = mha_reference(sd, xr, H, Hk, causal, rotary_emb_dim)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    assert mha.Wqkv.weight.grad is not None


@pytest.mark.parametrize("causal", [False, True])
def test_mha_cross_attention_and_padding(causal):
    E, H, Hk = 48, 4, 2
    sd = _peer_state_dict(E, H, Hk, cross=True)
    mha = MHA(E, H, num_heads_kv=Hk, cross_attn=True, causal=causal)
    assert sorted(mha.state_dict()) == sorted(sd)
    mha.load_state_dict(sd)
    x, x_kv = torch.randn(2, 3, E), torch.randn(2, 7, E)
    torch.testing.assert_close(mha(x, x_kv=x_kv), mha_reference(sd, x, H, Hk, causal, x_kv=x_kv),
                               rtol=1e-4, atol=1e-4)
    kv_mask = torch.arange(7)[None, :] < torch.tensor([7, 5])[:, None]  # right-padded keys
    torch.testing.assert_close(mha(x, x_kv=x_kv, key_padding_mask=kv_mask),
                               mha_reference(sd, x, H, Hk, causal, x_kv=x_kv, key_padding_mask=kv_mask),
                               rtol=1e-4, atol=1e-4)
    # self-attention with a key padding mask (the non-flash path); rows of padded queries are not compared
    sd2 = _peer_state_dict(E, H, H, seed=1)
    m2 = MHA(E, H, causal=causal)
    m2.load_state_dict(sd2)
    x = torch.randn(2, 6, E)
    kpm = torch.arange(6)[None, :] < torch.tensor([6, 4])[:, None]
    got, want = m2(x, key_padding_mask=kpm), mha_reference(sd2, x, H, H, causal, key_padding_mask=kpm)
    torch.testing.assert_close(got[kpm], want[kpm], rtol=1e-4, atol=1e-4)


def test_mha_varlen_window_alibi_dwconv():
    E, H = 32, 2
    mha = MHA(E, H, causal=True, use_flash_attn=True)
    sd = mha.state_dict()
    x = torch.randn(1, 8, E)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = mha(x[0], cu_seqlens=cu, max_seqlen=5)
    for s, e in [(0, 3), (3, 8)]:
        torch.testing.assert_close(packed[s:e], mha_reference(sd, x[:, s:e], H, H, True)[0], rtol=1e-4, atol=1e-4)
    # a window of 2 keys to the left: the same as masking the scores by hand
    win = MHA(E, H, causal=True, use_flash_attn=True, window_size=(2, 0))
    win.load_state_dict(sd)
    qkv = F.linear(x, sd["Wqkv.weight"], sd["Wqkv.bias"]).reshape(1, 8, 3, H, E // H)
    q, k, v = qkv.unbind(2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(E // H)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    scores = scores.masked_fill((j > i) | (j < i - 2), float("-inf"))
    ctx = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(1, 8, E)
    torch.testing.assert_close(win(x), F.linear(ctx, sd["out_proj.weight"], sd["out_proj.bias"]),
                               rtol=1e-4, atol=1e-4)
    alibi = MHA(48, 6, use_flash_attn=True, use_alibi=True, causal=True)
    assert "alibi_slopes" not in alibi.state_dict()  # a non-persistent buffer, as in flash-attn
    xa = torch.randn(1, 5, 48)
    qkv = F.linear(xa, alibi.Wqkv.weight, alibi.Wqkv.bias).reshape(1, 5, 3, 6, 8)
    q, k, v = qkv.unbind(2)
    slopes = torch.tensor(get_alibi_slopes(6))
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8) - slopes[:, None, None] * (i - j).abs()
    scores = scores.masked_fill(j > i, float("-inf"))
    ctx = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(1, 5, 48)
    torch.testing.assert_close(alibi(xa), alibi.out_proj(ctx), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(alibi.inner_attn.alibi_slopes, torch.tensor(get_alibi_slopes(6)))
    assert get_alibi_slopes(4) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    dw = MHA(E, H, dwconv=True)
    assert {"dwconv_qkv.weight", "dwconv_qkv.bias"} <= set(dw.state_dict())
    assert dw(x).shape == x.shape
    with pytest.raises(ValueError, match="window_size"):
        MHA(E, H, window_size=(4, 0))
    with pytest.raises(ValueError, match="cu_seqlens"):
        MHA(E, H)(x[0], cu_seqlens=cu, max_seqlen=5)


@pytest.mark.parametrize("use_flash_attn", [False, True])
@pytest.mark.parametrize("rotary_emb_dim", [0, 8, 16])
@pytest.mark.parametrize("num_heads_kv", [None, 2])
def test_mha_kv_cache_decoding_matches_full_forward(use_flash_attn, rotary_emb_dim, num_heads_kv):
    torch.manual_seed(0)
    E, H, B, L, prompt = 64, 4, 2, 7, 4
    mha = MHA(E, H, num_heads_kv=num_heads_kv, causal=True, layer_idx=0, rotary_emb_dim=rotary_emb_dim,
              use_flash_attn=use_flash_attn)
    x = torch.randn(B, L, E)
    with torch.no_grad():
        full = mha(x)
        params = InferenceParams(max_seqlen=L + 2, max_batch_size=B)
        steps = [mha(x[:, :prompt], inference_params=params)]
        params.seqlen_offset += prompt
        for t in range(prompt, L):
            steps.append(mha(x[:, t:t + 1], inference_params=params))
            params.seqlen_offset += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    cache = params.key_value_memory_dict[0]
    assert cache.shape == (B, L + 2, 2, num_heads_kv or H, E // H)
    assert mha.allocate_inference_cache(B, 5).shape == (B, 5, 2, num_heads_kv or H, E // H)


def test_mlp_gated_mlp_keys_and_outputs():
    torch.manual_seed(1)
    mlp = Mlp(16)
    assert sorted(mlp.state_dict()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    assert mlp.fc1.out_features == 64
    x = torch.randn(3, 16)
    torch.testing.assert_close(mlp(x), mlp.fc2(F.gelu(mlp.fc1(x))))
    gm = GatedMlp(48, activation=F.silu, bias1=False, bias2=False, multiple_of=32)
    assert sorted(gm.state_dict()) == ["fc1.weight", "fc2.weight"]
    assert gm.fc1.out_features == 2 * 128 and gm.fc2.in_features == 128  # int(8 * 48 / 3) = 128
    x = torch.randn(2, 48)
    y, gate = gm.fc1(x).chunk(2, -1)
    torch.testing.assert_close(gm(x), gm.fc2(y * F.silu(gate)))
    glu = GatedMlp(8, hidden_features=16, multiple_of=8, return_residual=True)
    out, res = glu(x[:, :8])
    assert res is not None and out.shape == (2, 8)
    torch.testing.assert_close(out, glu.fc2(F.glu(glu.fc1(x[:, :8]), dim=-1)))


@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_block_fused_matches_unfused(prenorm, norm):
    torch.manual_seed(2)
    E = 64
    norm_cls = nn.LayerNorm if norm == "layer" else partial_rms
    kw = dict(mixer_cls=lambda d: MHA(d, 2, causal=True), norm_cls=norm_cls, prenorm=prenorm)
    plain = Block(E, **kw)
    fused = Block(E, fused_dropout_add_ln=True, **kw)
    keys = sorted(plain.state_dict())
    assert keys == sorted(fused.state_dict())
    assert {"mixer.Wqkv.weight", "mixer.out_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight", "norm1.weight",
            "norm2.weight"} <= set(keys)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, E)
    if prenorm:
        h1, r1 = plain(x)
        h2, r2 = fused(x)
        torch.testing.assert_close(r1, r2, rtol=1e-5, atol=1e-5)
        h3, r3 = fused(h2, r2)  # the next block takes the residual stream
        assert h3.shape == x.shape and r3.shape == x.shape
    else:
        h1, h2 = plain(x), fused(x)
        ln1 = plain.norm1(x + plain.mixer(x))
        torch.testing.assert_close(h1, plain.norm2(ln1 + plain.mlp(ln1)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1, h2, rtol=1e-4, atol=1e-4)


def partial_rms(dim):
    return RMSNorm(dim, eps=1e-5)


def test_distributed_world_size_one():
    x = torch.randn(3, 4)
    out, handle = all_gather_raw(x, None)
    assert handle is None and torch.equal(out, x)
    assert all_reduce(x, None) is x
    assert [get_dim_for_local_rank(10, 3, r) for r in range(3)] == [4, 3, 3]
    assert [get_dim_for_local_rank(96, 4, r, multiple_of=16) for r in range(4)] == [32, 32, 16, 16]

    class Group:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="size 1"):
        all_reduce(x, Group())


def test_install_aliases_submodules_and_refuses_missing_names():
    if "flash_attn" not in fastarch.compat.install():
        pytest.skip("a real flash_attn is installed: the alias is not made")
    try:
        from flash_attn.bert_padding import pad_input, unpad_input  # noqa: F401
        from flash_attn.layers.rotary import RotaryEmbedding  # noqa: F401
        from flash_attn.modules.mha import MHA as AliasedMHA
        from flash_attn.ops.triton.layer_norm import layer_norm_fn  # noqa: F401

        assert AliasedMHA is MHA
        with pytest.raises(ImportError, match=r"flash_attn\.ops\.fused_dense"):  # a submodule it lacks
            from flash_attn.ops.fused_dense import FusedDense  # noqa: F401
        with pytest.raises(ImportError, match=r"does not provide flash_attn\.ops\.fused_dense; it provides .*"
                                              r"flash_attn\.modules\.mha"):
            from flash_attn.ops import fused_dense  # noqa: F401
        with pytest.raises(ImportError, match=r"flash_attn\.modules\.mha\.ParallelMHA"):
            from flash_attn.modules.mha import ParallelMHA  # noqa: F401
        with pytest.raises(ImportError, match=r"flash_attn\.layers\.patch_embed"):
            from flash_attn.layers import patch_embed  # noqa: F401
    finally:
        fastarch.compat.uninstall()
