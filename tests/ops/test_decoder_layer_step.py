"""decoder_qkv_step and decoder_out_step: a decode loop of both halves (with the cache written between them) against
whole-sequence Llama and GPT-2 decoder layers in plain PyTorch, every backend against the references, gradients through the
torch backend, and bad input refused. (The hypothesis-drawn grid, opcheck and torch.compile are in
test_conformance.py; transformers' decoder layers on these ops are tested in tests/integrations.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastarch import ops

pytestmark = pytest.mark.op("decoder_qkv_step", "decoder_out_step")


def _layer(d=24, H=4, Hk=2, D=8, I=40, bias=True, qk_norm=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=None):
        return torch.randn(*shape, generator=g) * (shape[-1] ** -0.5 if s is None else s)

    return dict(norm=1 + r(d, s=0.1), q_w=r(H * D, d), k_w=r(Hk * D, d), v_w=r(Hk * D, d),
                q_b=r(H * D, s=0.1) if bias else None, k_b=r(Hk * D, s=0.1) if bias else None,
                v_b=r(Hk * D, s=0.1) if bias else None, q_norm=1 + r(D, s=0.1) if qk_norm else None,
                k_norm=1 + r(D, s=0.1) if qk_norm else None, o_w=r(d, H * D), norm2=1 + r(d, s=0.1),
                gate=r(I, d), up=r(I, d), down=r(d, I), H=H, Hk=Hk, D=D)


def _angles(T, R, base=100.0):
    inv = base ** (-torch.arange(R, dtype=torch.float64) / R)
    a = torch.arange(T, dtype=torch.float64)[:, None] * inv
    return a.cos().float(), a.sin().float()


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _whole_sequence(p, x, cos, sin, window, eps=1e-5):
    """The decoder layer over a whole sequence x (B, T, d), written out plainly: causal (optionally windowed)
    attention with grouped heads, rotate-half rotary over the first 2R channels."""
    B, T, d = x.shape
    H, Hk, D = p["H"], p["Hk"], p["D"]
    h = _rms(x, p["norm"], eps)
    q = F.linear(h, p["q_w"], p["q_b"]).view(B, T, H, D)
    k = F.linear(h, p["k_w"], p["k_b"]).view(B, T, Hk, D)
    v = F.linear(h, p["v_w"], p["v_b"]).view(B, T, Hk, D)
    if p["q_norm"] is not None:
        q, k = _rms(q, p["q_norm"], 1e-6), _rms(k, p["k_norm"], 1e-6)
    R = cos.shape[1]

    def rot(t):
        c, s = cos[None, :, None], sin[None, :, None]
        a, b, rest = t[..., :R], t[..., R:2 * R], t[..., 2 * R:]
        return torch.cat([a * c - b * s, b * c + a * s, rest], -1)

    q, k = rot(q).transpose(1, 2), rot(k).transpose(1, 2)
    v = v.transpose(1, 2)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & ((i - j) <= window if window >= 0 else True)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    hid = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), p["o_w"])
    m = _rms(hid, p["norm2"], eps)
    return hid + F.linear(F.silu(F.linear(m, p["gate"])) * F.linear(m, p["up"]), p["down"])


def _decode(p, x, cos, sin, window, backend, eps=1e-5):
    """The same layer one token at a time: first half, the cache written, second half."""
    B, T, d = x.shape
    keys = torch.zeros(B, p["Hk"], T + 2, p["D"])
    values = torch.zeros_like(keys)
    outs = []
    for t in range(T):
        q, k, v = ops.decoder_qkv_step(x[:, t], p["norm"], p["q_w"], p["k_w"], p["v_w"], p["q_b"], p["k_b"], p["v_b"],
                                     cos[t:t + 1], sin[t:t + 1], p["H"], p["Hk"], eps, p["q_norm"], p["k_norm"],
                                     backend=backend)
        keys[:, :, t], values[:, :, t] = k, v
        outs.append(ops.decoder_out_step(q, keys, values, x[:, t], p["o_w"], None, p["norm2"], p["gate"], p["up"],
                                       p["down"], t + 1, window, None, eps, backend=backend))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("window", [-1, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("R", [4, 2])
def test_decode_loop_matches_the_whole_sequence_layer(backend, window, qk_norm, R):
    p = _layer(qk_norm=qk_norm)
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1))
    cos, sin = _angles(7, R)
    want = _whole_sequence(p, x, cos, sin, window)
    got = _decode(p, x, cos, sin, window, backend)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_per_sequence_angles_and_the_attention_half_alone(backend):
    p = _layer(bias=False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 24, generator=g)
    cos, sin = torch.randn(3, 3, generator=g).cos(), torch.randn(3, 3, generator=g).sin()
    args = (x, p["norm"], p["q_w"], p["k_w"], p["v_w"], None, None, None, cos, sin, 4, 2, 1e-6)
    for got, want in zip(ops.decoder_qkv_step(*args, backend=backend), ops.decoder_qkv_step_ref(*args)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    q = torch.randn(3, 4, 8, generator=g)
    cache = torch.randn(3, 2, 10, 8, generator=g)
    o_b = torch.randn(24, generator=g)
    # a strided cache (a prefix of a longer buffer), the attention half without the MLP
    key, value = cache[:, :, :6], cache.flip(2)[:, :, :6]
    out = ops.decoder_out_step(q, key, value, x, p["o_w"], o_b, None, None, None, None, 5, -1, 0.3, backend=backend)
    ref = ops.decoder_out_step_ref(q, key, value, x, p["o_w"], o_b, None, None, None, None, 5, -1, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_gradients_through_the_torch_backend():
    p = _layer()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, generator=g)
    cos, sin = _angles(1, 4)
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items() if isinstance(v, torch.Tensor)}
    ref_leaves = {k: v.clone().requires_grad_(True) for k, v in p.items() if isinstance(v, torch.Tensor)}
    cache = torch.randn(2, 2, 5, 8, generator=g)

    def run(fn_qkv, fn_out, w, **kw):
        q, k, v = fn_qkv(x, w["norm"], w["q_w"], w["k_w"], w["v_w"], w["q_b"], w["k_b"], w["v_b"], cos, sin, 4, 2,
                         **kw)
        key = torch.cat([cache, k[:, :, None]], 2)
        value = torch.cat([cache.flip(2), v[:, :, None]], 2)
        return fn_out(q, key, value, x, w["o_w"], None, w["norm2"], w["gate"], w["up"], w["down"], 6, 3, **kw)

    out = run(ops.decoder_qkv_step, ops.decoder_out_step, leaves, backend="torch")
    ref = run(ops.decoder_qkv_step_ref, ops.decoder_out_step_ref, ref_leaves)
    go = torch.randn_like(ref)
    names = sorted(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], go)
    ref_grads = torch.autograd.grad(ref, [ref_leaves[n] for n in names], go)
    for n, a, b in zip(names, grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"d{n}: {m}")


def test_bad_input_is_refused_with_the_argument_named():
    p = _layer()
    x = torch.randn(1, 24)
    cos, sin = _angles(1, 4)
    base = dict(x=x, norm_weight=p["norm"], q_weight=p["q_w"], k_weight=p["k_w"], v_weight=p["v_w"], q_bias=None,
                k_bias=None, v_bias=None, cos=cos, sin=sin, num_heads=4, num_kv_heads=2)
    for change, word in ((dict(k_weight=p["k_w"][:-1]), "k_weight"), (dict(num_kv_heads=3), "num_kv_heads"),
                         (dict(cos=torch.ones(1, 5), sin=torch.ones(1, 5)), "cos"),
                         (dict(q_bias=torch.ones(4)), "q_bias"), (dict(x=x.double()), "q_weight"),
                         (dict(norm_eps=float("nan")), "norm_eps")):
        with pytest.raises((ValueError, TypeError), match=word):
            ops.decoder_qkv_step(**{**base, **change})
    q, cache = torch.randn(1, 4, 8), torch.randn(1, 2, 4, 8)
    out = dict(q=q, key=cache, value=cache, residual=x, o_weight=p["o_w"], o_bias=None, norm_weight=p["norm2"],
               gate_weight=p["gate"], up_weight=p["up"], down_weight=p["down"], key_length=4)
    for change, word in ((dict(key_length=5), "key_length"), (dict(key_length=0), "key_length"),
                         (dict(window_left=-2), "window_left"), (dict(up_weight=None), "up_weight"),
                         (dict(value=cache[:, :1]), "value"), (dict(scale=0.0), "scale"),
                         (dict(o_weight=p["o_w"].t()), "o_weight"), (dict(key=torch.randn(1, 3, 4, 8)), "key")):
        with pytest.raises((ValueError, TypeError), match=word):
            ops.decoder_out_step(**{**out, **change})


def _gpt2_layer(d=24, H=4, I=40, seed=4):
    """GPT-2's block: layer norms with biases, Conv1D weights kept (in, out), a GELU-tanh MLP, no rotary."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=None):
        return torch.randn(*shape, generator=g) * (shape[0] ** -0.5 if s is None else s)

    return dict(ln1=1 + r(d, s=0.1), ln1_b=r(d, s=0.1), c_attn=r(d, 3 * d), c_attn_b=r(3 * d, s=0.1),
                c_proj=r(d, d), c_proj_b=r(d, s=0.1), ln2=1 + r(d, s=0.1), ln2_b=r(d, s=0.1), c_fc=r(d, I),
                c_fc_b=r(I, s=0.1), mlp_proj=r(I, d), mlp_proj_b=r(d, s=0.1), H=H, D=d // H)


def test_gpt2_decode_loop_matches_the_whole_sequence_block(backend):
    p = _gpt2_layer()
    B, T, d, H, D = 2, 6, 24, p["H"], p["D"]
    x = torch.randn(B, T, d, generator=torch.Generator().manual_seed(5))
    # the whole sequence, as GPT-2 computes it
    h = F.layer_norm(x, (d,), p["ln1"], p["ln1_b"], 1e-5)
    q, k, v = (h @ p["c_attn"] + p["c_attn_b"]).split(d, dim=2)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
    hid = x + a @ p["c_proj"] + p["c_proj_b"]
    m = F.layer_norm(hid, (d,), p["ln2"], p["ln2_b"], 1e-5)
    want = hid + F.gelu(m @ p["c_fc"] + p["c_fc_b"], approximate="tanh") @ p["mlp_proj"] + p["mlp_proj_b"]
    # one token at a time, the Conv1D weights read transposed in place (column blocks of c_attn)
    w = p["c_attn"]
    keys = torch.zeros(B, H, T, D)
    values = torch.zeros_like(keys)
    outs = []
    for t in range(T):
        qt, kt, vt = ops.decoder_qkv_step(x[:, t], p["ln1"], w[:, :d].t(), w[:, d:2 * d].t(), w[:, 2 * d:].t(),
                                          *p["c_attn_b"].split(d), None, None, H, H, 1e-5, norm_bias=p["ln1_b"],
                                          backend=backend)
        keys[:, :, t], values[:, :, t] = kt, vt
        outs.append(ops.decoder_out_step(qt, keys, values, x[:, t], p["c_proj"].t(), p["c_proj_b"], p["ln2"], None,
                                         p["c_fc"].t(), p["mlp_proj"].t(), t + 1, -1, None, 1e-5,
                                         norm_bias=p["ln2_b"], up_bias=p["c_fc_b"], down_bias=p["mlp_proj_b"],
                                         backend=backend))
    torch.testing.assert_close(torch.stack(outs, 1), want, atol=2e-5, rtol=1e-4)


def test_bf16_steps_compute_in_fp32_and_round_once(backend):
    """bf16 in and out: every backend against the fp32 oracle on the same bf16 values, within a few bf16 roundings
    (the cpp backend rounds once, the torch backend after each op)."""
    p = _layer(qk_norm=True)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 24, generator=g)
    cos, sin = _angles(1, 4)
    cache = torch.randn(2, 2, 5, 8, generator=g)
    lo = {k: v.bfloat16() if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    args = (x.bfloat16(), lo["norm"], lo["q_w"], lo["k_w"], lo["v_w"], lo["q_b"], lo["k_b"], lo["v_b"],
            cos.bfloat16(), sin.bfloat16(), 4, 2, 1e-5, lo["q_norm"], lo["k_norm"])
    got = ops.decoder_qkv_step(*args, backend=backend)
    want = ops.decoder_qkv_step_ref(*args)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)
    out_args = (got[0], cache.bfloat16(), cache.flip(2).bfloat16(), x.bfloat16(), lo["o_w"], None, lo["norm2"],
                lo["gate"], lo["up"], lo["down"], 5, 2)
    out = ops.decoder_out_step(*out_args, backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ops.decoder_out_step_ref(*out_args), atol=3e-2, rtol=3e-2)
