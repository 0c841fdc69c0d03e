"""fastarch.compat.flash_attn: flash-attn 2's signatures, layouts, return values and KV-cache semantics."""

from __future__ import annotations

import inspect

import pytest
import torch

from fastarch.backend import use_backend
from fastarch.compat import flash_attn as fa
from fastarch.compat.flash_attn import flash_attn_interface as fai
from fastarch.ops.attention import attention_ref
from fastarch.ops.rotary import rotary_embedding
from tests._backends import require_backend
from tests._inplace import assert_bits_equal, bits, nan_poisoned

TOL = {"rtol": 1e-4, "atol": 5e-5}
_TRAIN = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
          "return_attn_probs"]
_DEFAULTS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1), "softcap": 0.0,
             "alibi_slopes": None, "deterministic": False, "return_attn_probs": False}
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", *_TRAIN],
    "flash_attn_qkvpacked_func": ["qkv", *_TRAIN],
    "flash_attn_kvpacked_func": ["q", "kv", *_TRAIN],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                               *_TRAIN, "block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", *_TRAIN],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                        "max_seqlen_k", *_TRAIN],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}
KVCACHE_DEFAULTS = {"k": None, "v": None, "rotary_cos": None, "rotary_sin": None, "cache_seqlens": None,
                    "cache_batch_idx": None, "cache_leftpad": None, "block_table": None, "softmax_scale": None,
                    "causal": False, "window_size": (-1, -1), "softcap": 0.0, "rotary_interleaved": True,
                    "alibi_slopes": None, "num_splits": 0, "return_softmax_lse": False}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures(name):
    params = inspect.signature(getattr(fa, name)).parameters
    assert list(params) == SIGNATURES[name]
    defaults = KVCACHE_DEFAULTS if name == "flash_attn_with_kvcache" else {**_DEFAULTS, "block_table": None}
    for p in params.values():
        if p.name in defaults:
            assert p.default == defaults[p.name], p.name
        else:
            assert p.default is inspect.Parameter.empty, p.name
    from fastarch.compat.flash_attn import flash_attn_interface
    assert getattr(flash_attn_interface, name) is getattr(fa, name)


def _qkv(B=2, Lq=13, Lk=17, H=4, Hk=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Lq, H, D, generator=g, requires_grad=True),
            torch.randn(B, Lk, Hk, D, generator=g, requires_grad=True),
            torch.randn(B, Lk, Hk, D, generator=g, requires_grad=True))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(4, 1)), dict(softcap=3.0),
                                dict(alibi_slopes=torch.rand(4)), dict(softmax_scale=0.3, causal=True)], ids=str)
def test_flash_attn_func(kw):
    q, k, v = _qkv()
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, 0.0, return_attn_probs=True, **kw)
    ref_kw = dict(kw)
    if "window_size" in ref_kw:
        ref_kw["window"] = ref_kw.pop("window_size")
    if "softmax_scale" in ref_kw:
        ref_kw["scale"] = ref_kw.pop("softmax_scale")
    r, lr = attention_ref(q, k, v, layout="blhd", return_lse=True, **ref_kw)
    torch.testing.assert_close(out, r, **TOL)
    assert out.shape == q.shape and lse.shape == (2, 4, 13) and s_dmask.shape == (2, 4, 13, 17)
    torch.testing.assert_close(lse, lr, **TOL)
    # S_dmask: the probabilities; out = P V.
    vv = v.detach().repeat_interleave(2, 2).transpose(1, 2)
    torch.testing.assert_close(torch.matmul(s_dmask, vv).transpose(1, 2), out.detach(), **TOL)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(r, (q, k, v), g)):
        torch.testing.assert_close(a, b, **TOL)


def test_dropout_s_dmask_sign_encoding():
    q, k, v = _qkv(B=1, Lq=20, Lk=20, H=2, Hk=2)
    torch.manual_seed(4)
    out, _, s = fa.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, return_attn_probs=True)
    dropped = (s < 0).float().sum() / (s != 0).float().sum()
    assert 0.1 < dropped.item() < 0.4
    kept = s.clamp(min=0) / 0.75
    torch.testing.assert_close(torch.matmul(kept, v.detach().transpose(1, 2)).transpose(1, 2), out.detach(), **TOL)
    torch.testing.assert_close(s.abs().sum(-1), torch.ones(1, 2, 20), **TOL)


def test_packed_variants():
    q, k, v = _qkv(Lk=13, Hk=4)
    qkv = torch.stack([q, k, v], 2).detach().requires_grad_(True)
    a = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    b = fa.flash_attn_func(*qkv.unbind(2), causal=True)
    torch.testing.assert_close(a, b)
    a.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    kv = torch.stack([k, v], 2)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, window_size=(3, 3)),
                               fa.flash_attn_func(q, k, v, window_size=(3, 3)))


def test_varlen_functions():
    lens_k = [7, 3, 4, 9]
    cq = torch.tensor([0, 5, 6, 6, 15], dtype=torch.int32)
    ck = torch.tensor([0, 7, 10, 14, 23], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(15, 4, 16, generator=g)
    k = torch.randn(23, 2, 16, generator=g)
    v = torch.randn(23, 2, 16, generator=g)
    out, lse, s = fa.flash_attn_varlen_func(q, k, v, cq, ck, 9, 9, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, 15) and s.shape == (4, 4, 9, 9)
    for b in range(4):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe > qs:
            one, lse1 = fa.flash_attn_func(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], causal=True,
                                           return_attn_probs=True)[:2]
            torch.testing.assert_close(out[qs:qe], one[0], **TOL)
            torch.testing.assert_close(lse[:, qs:qe], lse1[0], **TOL)
    kv = torch.stack([k, v], 1)
    torch.testing.assert_close(fa.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 9, 9, causal=True), out)
    qkv = torch.stack([q, q, q], 1)
    torch.testing.assert_close(fa.flash_attn_varlen_qkvpacked_func(qkv, cq, 9),
                               fa.flash_attn_varlen_func(q, q, q, cq, cq, 9, 9))
    # paged k/v (pages of 4) through block_table
    pages_k = torch.randn(12, 4, 2, 16, generator=g)
    pages_v = torch.randn(12, 4, 2, 16, generator=g)
    bt = torch.tensor([[3, 7, 0], [0, 0, 0], [11, 0, 0], [1, 2, 5]], dtype=torch.int32)
    kk = torch.cat([pages_k[bt[b].long()].reshape(-1, 2, 16)[:lens_k[b]] for b in range(4)])
    vv = torch.cat([pages_v[bt[b].long()].reshape(-1, 2, 16)[:lens_k[b]] for b in range(4)])
    torch.testing.assert_close(fa.flash_attn_varlen_func(q, pages_k, pages_v, cq, ck, 9, 9, causal=True,
                                                         block_table=bt),
                               fa.flash_attn_varlen_func(q, kk, vv, cq, ck, 9, 9, causal=True))


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_varlen_dropout(backend):
    """dropout_p > 0 through flash_attn_varlen_func: each sequence's output is its kept S_dmask entries times
    V over (1 - p), and every backend draws the same mask from the same generator state (outputs and
    gradients equal the torch backend's)."""
    require_backend("attention", backend)
    p = 0.3
    cq = torch.tensor([0, 5, 6, 6, 15], dtype=torch.int32)
    ck = torch.tensor([0, 7, 10, 14, 23], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(15, 4, 16, generator=g)
    k = torch.randn(23, 2, 16, generator=g)
    v = torch.randn(23, 2, 16, generator=g)
    do = torch.randn(15, 4, 16, generator=g)

    def run(name):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(9)
        with use_backend(attention=name):
            out, _, s = fa.flash_attn_varlen_func(*ins, cq, ck, 9, 9, dropout_p=p, causal=True,
                                                  return_attn_probs=True)
            grads = torch.autograd.grad(out, ins, do)
        return out.detach(), s, grads

    out, s, grads = run(backend)
    assert (s < 0).any()
    vv = v.repeat_interleave(2, 1)
    for b in range(4):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        kept = s[b, :, :qe - qs, :ke - ks].clamp(min=0) / (1 - p)
        want = torch.matmul(kept, vv[ks:ke].transpose(0, 1)).transpose(0, 1)
        torch.testing.assert_close(out[qs:qe], want, **TOL)
    ref_out, _, ref_grads = run("torch")
    torch.testing.assert_close(out, ref_out, **TOL)
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _cache(Bc=3, Lc=24, Hk=2, D=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(Bc, Lc, Hk, D, generator=g), torch.randn(Bc, Lc, Hk, D, generator=g)


@pytest.mark.parametrize("rotary", [None, True, False])
@pytest.mark.parametrize("mode", ["contiguous", "batch_idx", "leftpad", "paged16", "paged3"])
def test_with_kvcache(mode, rotary):
    g = torch.Generator().manual_seed(6)
    B, Lq, H, Hk, D, Lnew = 2, 3, 4, 2, 16, 3
    q = torch.randn(B, Lq, H, D, generator=g)
    kn, vn = torch.randn(B, Lnew, Hk, D, generator=g), torch.randn(B, Lnew, Hk, D, generator=g)
    seqlens = torch.tensor([5, 12], dtype=torch.int32)
    k_cache, v_cache = _cache()
    kw: dict = dict(causal=True, return_softmax_lse=True)
    rows = [0, 1]
    leftpad = [0, 0]
    if mode == "batch_idx":
        rows = [2, 0]
        kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
    if mode == "leftpad":
        leftpad = [2, 4]
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32)
    if rotary is not None:
        cos = torch.rand(32, 4, generator=g)
        sin = torch.rand(32, 4, generator=g)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary)
    logical_k, logical_v = k_cache.clone(), v_cache.clone()
    if mode.startswith("paged"):
        page = int(mode[5:])
        n = (24 + page - 1) // page
        perm = torch.randperm(B * n + 2, generator=g)[:B * n].view(B, n)
        k_cache = torch.randn(B * n + 2, page, Hk, D, generator=g)
        v_cache = torch.randn(B * n + 2, page, Hk, D, generator=g)
        for b in range(B):
            flat = k_cache[perm[b]].reshape(-1, Hk, D)[:24]
            logical_k[b] = flat
            logical_v[b] = v_cache[perm[b]].reshape(-1, Hk, D)[:24]
        kw["block_table"] = perm.to(torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=seqlens, **kw)
    assert out.shape == q.shape and lse.shape == (B, H, Lq)
    for b in range(B):
        r, s0, lp = rows[b], int(seqlens[b]), leftpad[b]
        kb, qb = kn[b:b + 1], q[b:b + 1]
        if rotary is not None:
            kb = rotary_embedding(kb, cos, sin, interleaved=rotary, seqlen_offset=s0 - lp)
            qb = rotary_embedding(qb, cos, sin, interleaved=rotary, seqlen_offset=s0 - lp)
        keys = torch.cat([logical_k[r, lp:s0], kb[0]])
        vals = torch.cat([logical_v[r, lp:s0], vn[b]])
        want, wl = attention_ref(qb, keys[None], vals[None], layout="blhd", causal=True, return_lse=True)
        torch.testing.assert_close(out[b:b + 1], want, **TOL)
        torch.testing.assert_close(lse[b:b + 1], wl, **TOL)
        # the new keys were written in place
        if mode.startswith("paged"):
            written = k_cache[perm[b]].reshape(-1, Hk, D)[s0:s0 + Lnew]
        else:
            written = k_cache[r, s0:s0 + Lnew]
        torch.testing.assert_close(written, kb[0])


def test_kvcache_uninitialised_slots_and_decode():
    k_cache, v_cache = _cache()
    k_cache[:, 10:] = float("nan")
    v_cache[:, 10:] = float("inf")
    q = torch.randn(3, 1, 4, 16)
    seqlens = torch.tensor([10, 3, 7], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    for b in range(3):
        n = int(seqlens[b])
        want = attention_ref(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], layout="blhd")
        torch.testing.assert_close(out[b:b + 1], want, **TOL)


@pytest.mark.parametrize("bad", ["overflow", "page_index", "rotary_short", "k_without_v", "dtype", "leftpad",
                                 "batch_idx", "alibi"])
def test_kvcache_rejected_call_leaves_cache_untouched(bad):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 4, 16, generator=g)
    kn, vn = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    k_cache, v_cache = _cache()
    kw: dict = dict(cache_seqlens=torch.tensor([4, 6], dtype=torch.int32))
    if bad == "overflow":
        kw["cache_seqlens"] = torch.tensor([4, 24], dtype=torch.int32)
    elif bad == "page_index":
        k_cache, v_cache = torch.randn(4, 16, 2, 16), torch.randn(4, 16, 2, 16)
        kw["block_table"] = torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)
    elif bad == "rotary_short":
        kw.update(rotary_cos=torch.rand(5, 4), rotary_sin=torch.rand(5, 4))
    elif bad == "k_without_v":
        vn = None
    elif bad == "dtype":
        vn = vn.double()
    elif bad == "leftpad":
        kw["cache_leftpad"] = torch.tensor([5, 0], dtype=torch.int32)
    elif bad == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([0, 3], dtype=torch.int32)
    else:
        kw["alibi_slopes"] = torch.rand(3)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, **kw)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


_BAD_KVCACHE = {
    "softcap_nan": (dict(softcap=float("nan")), ValueError, "softcap"),
    "softcap_inf": (dict(softcap=float("inf")), ValueError, "softcap"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "softcap_bool": (dict(softcap=True), ValueError, "softcap"),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "scale_inf": (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    "scale_str": (dict(softmax_scale="0.3"), ValueError, "softmax_scale"),
    "scale_bool": (dict(softmax_scale=True), ValueError, "softmax_scale"),
    "window": (dict(window_size=(-2, 0)), ValueError, "window_size"),
    "int64": ("int64", TypeError, "'q'"),
    "float64": ("float64", TypeError, "'q'"),
    "seqlens_int64": (dict(cache_seqlens=torch.tensor([4, 6])), ValueError, "cache_seqlens"),
    "seqlens_negative": (dict(cache_seqlens=torch.tensor([-1, 6], dtype=torch.int32)), ValueError,
                         "cache_seqlens"),
    "seqlens_int_overflow": (dict(cache_seqlens=2**70), ValueError, "cache_seqlens"),
    "alibi_shape": (dict(alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes"),
    "expanded_cache": ("expanded", ValueError, "'v_cache'.*expanded"),
    "same_cache": ("same", ValueError, "'k_cache' and 'v_cache' are the same memory"),
}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("bad", sorted(_BAD_KVCACHE))
def test_kvcache_rejected_values_leave_cache_bit_identical(bad, paged):
    """Each bad value is refused, naming its argument, before a single cache byte (NaN payloads included)
    changes."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 4, 16, generator=g)
    kn, vn = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    if paged:
        k_cache, v_cache = torch.randn(4, 8, 2, 16, generator=g), torch.randn(4, 8, 2, 16, generator=g)
        kw: dict = dict(block_table=torch.tensor([[0, 1], [3, 2]], dtype=torch.int32))
    else:
        k_cache, v_cache = _cache()
        kw = {}
    k_cache, v_cache = nan_poisoned(k_cache), nan_poisoned(v_cache, 7)
    kw["cache_seqlens"] = torch.tensor([4, 6], dtype=torch.int32)
    change, exc, name = _BAD_KVCACHE[bad]
    if change == "expanded":  # rows sharing memory: one row's new keys would land in every row
        v_cache = v_cache[:1].expand_as(v_cache)
    elif change == "same":
        v_cache = k_cache
    elif isinstance(change, str):
        dt = getattr(torch, change)
        q, kn, vn = q.to(dt), kn.to(dt), vn.to(dt)
        k_cache, v_cache = k_cache.nan_to_num().to(dt), v_cache.nan_to_num().to(dt)
    else:
        kw.update(change)
    before_k, before_v = bits(k_cache), bits(v_cache)
    with pytest.raises(exc, match=name):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, **kw)
    assert_bits_equal(before_k, k_cache, "k_cache")
    assert_bits_equal(before_v, v_cache, "v_cache")


def test_kvcache_failure_after_the_write_restores_the_cache(monkeypatch):
    """Whatever fails once the new keys are written (here the attention itself), the cache comes back as it
    was, bit for bit."""
    def broken(*args, **kwargs):
        raise RuntimeError("attention failed")

    monkeypatch.setattr(fai, "attention", broken)
    k_cache, v_cache = (nan_poisoned(t) for t in _cache())
    before_k, before_v = bits(k_cache), bits(v_cache)
    kn = vn = torch.randn(2, 3, 2, 16)
    with pytest.raises(RuntimeError, match="attention failed"):
        fa.flash_attn_with_kvcache(torch.randn(2, 3, 4, 16), k_cache, v_cache, kn, vn,
                                   cache_seqlens=torch.tensor([4, 20], dtype=torch.int32))
    assert_bits_equal(before_k, k_cache, "k_cache")
    assert_bits_equal(before_v, v_cache, "v_cache")


def test_kvcache_many_heads_single_token():
    """A decode step with more than 256 query heads in flash-attn's (B, L, H, D) layout is a valid call, not
    a mistaken layout."""
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 1, 300, 8, generator=g)
    k_cache, v_cache = torch.randn(1, 16, 300, 8, generator=g), torch.randn(1, 16, 300, 8, generator=g)
    kn, vn = torch.randn(1, 1, 300, 8, generator=g), torch.randn(1, 1, 300, 8, generator=g)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn, cache_seqlens=3)
    torch.testing.assert_close(k_cache[0, 3], kn[0, 0])
    want = attention_ref(q, k_cache[:, :4], v_cache[:, :4], layout="blhd")
    torch.testing.assert_close(out, want, **TOL)
