import pytest
import torch

from fastarch.generation import KVCache
from tests._inplace import assert_bits_equal, bits, nan_poisoned

from ._models import ref_attention


def _kv(B, H, T, D, dtype=torch.float32):
    return torch.randn(B, H, T, D, dtype=dtype), torch.randn(B, H, T, D, dtype=dtype)


def _snapshot(cache):
    return ([t.clone() for t in cache._k], [t.clone() for t in cache._v], [list(x) for x in cache._lens],
            cache.seq_len, None if cache._valid is None else cache._valid.clone())


def _same(a, b):
    assert len(a[0]) == len(b[0])
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert a[2] == b[2] and a[3] == b[3]
    assert (a[4] is None) == (b[4] is None) and (a[4] is None or torch.equal(a[4], b[4]))


def test_guide_api_lazy_allocation_and_append():
    cache = KVCache(16, 2, 4, 3)  # guide constructor: no batch/dtype/device yet
    assert cache.get(0) == (None, None) and cache.seq_len == 0
    k1, v1 = _kv(2, 2, 5, 4)
    ka, va = cache.update(0, k1, v1)
    assert torch.equal(ka, k1) and torch.equal(va, v1)
    assert cache.seq_len == 5 and cache.batch_size == 2 and cache.dtype == torch.float32
    ptr = cache._k[0].data_ptr()
    k2, v2 = _kv(2, 2, 1, 4)
    ka, va = cache.update(0, k2, v2)
    assert torch.equal(ka, torch.cat([k1, k2], 2)) and torch.equal(va, torch.cat([v1, v2], 2))
    assert cache._k[0].data_ptr() == ptr  # in place, no reallocation
    assert cache.seq_len == 6
    g = cache.get(0)
    assert torch.equal(g[0], ka)
    assert cache.get(1) == (None, None)
    cache.reset()
    assert cache.seq_len == 0 and cache.get(0) == (None, None)


@pytest.mark.parametrize("bad", ["overflow", "shape_heads", "shape_dim", "batch", "dtype", "device", "kv_mismatch",
                                 "layer", "ndim", "lengths", "valid"])
def test_rejected_update_leaves_cache_unchanged(bad):
    cache = KVCache(6, 2, 4, 2, batch_size=2, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.update(layer, *_kv(2, 2, 4, 4))
    before = _snapshot(cache)
    k, v = _kv(2, 2, 1, 4)
    kwargs = {}
    layer = 1
    if bad == "overflow":
        k, v = _kv(2, 2, 3, 4)
    elif bad == "shape_heads":
        k, v = _kv(2, 3, 1, 4)
    elif bad == "shape_dim":
        k, v = _kv(2, 2, 1, 5)
    elif bad == "batch":
        k, v = _kv(3, 2, 1, 4)
    elif bad == "dtype":
        k, v = _kv(2, 2, 1, 4, torch.float64)
    elif bad == "device":
        k, v = k.to("meta"), v.to("meta")
    elif bad == "kv_mismatch":
        v = torch.randn(2, 2, 2, 4)
    elif bad == "layer":
        layer = 2
    elif bad == "ndim":
        k, v = k[0], v[0]
    elif bad == "lengths":
        kwargs = {"lengths": [1, 2]}
    elif bad == "valid":
        kwargs = {"valid": torch.ones(2, 2, dtype=torch.bool)}
    with pytest.raises((ValueError, TypeError, IndexError), match="KVCache"):
        cache.update(layer, k, v, **kwargs)
    _same(before, _snapshot(cache))
    # still usable: exactly 2 positions left
    cache.update(1, *_kv(2, 2, 2, 4))
    assert cache.lengths(1) == [6, 6]


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(0, 2, 4, 1)
    with pytest.raises(ValueError, match="window"):
        KVCache(8, 2, 4, 1, window=0)


def _chunks(total, sizes):
    out, s = [], 0
    for n in sizes:
        out.append((s, min(s + n, total)))
        s += n
        if s >= total:
            break
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sizes", [(1,) * 9, (4, 1, 1, 3), (2, 5, 2)])
def test_cached_attention_matches_full(window, sizes):
    """Chunked decoding through the cache (GQA: 4 query heads, 2 kv heads) equals full causal attention."""
    B, H, Hk, L, D = 2, 4, 2, 9, 8
    q = torch.randn(B, H, L, D)
    k = torch.randn(B, Hk, L, D)
    v = torch.randn(B, Hk, L, D)
    wnd = (window, 0) if window is not None else (-1, -1)
    ref = ref_attention(q, k, v, causal=True, window=wnd)
    cache = KVCache(L, Hk, D, 1, batch_size=B, dtype=torch.float32, device="cpu", window=window)
    outs = []
    for s, e in _chunks(L, sizes):
        ka, va = cache.update(0, k[:, :, s:e], v[:, :, s:e])
        if window is not None:
            assert ka.shape[2] <= window + (e - s)
        outs.append(ref_attention(q[:, :, s:e], ka, va, **cache.attention_kwargs(0)))
    torch.testing.assert_close(torch.cat(outs, 2), ref)
    assert cache.seq_len == L
    if window is not None:
        assert cache._k[0].shape[2] == window
        kg, _ = cache.get(0)
        torch.testing.assert_close(kg, k[:, :, L - window:])


def test_per_sequence_lengths_right_padding():
    """Prompts of lengths 3 and 5 right-padded into one batch then decoded: each row equals its own run."""
    Hk, D = 2, 4
    lens = [3, 5]
    steps = 3
    q = [torch.randn(1, Hk, n + steps, D) for n in lens]
    k = [torch.randn(1, Hk, n + steps, D) for n in lens]
    v = [torch.randn(1, Hk, n + steps, D) for n in lens]
    ref = [ref_attention(q[b], k[b], v[b], causal=True) for b in range(2)]
    cache = KVCache(12, Hk, D, 1, batch_size=2, dtype=torch.float32, device="cpu")
    P = max(lens)

    def pad(t, n):
        return torch.cat([t[:, :, :n], torch.zeros(1, Hk, P - n, D)], 2)

    kp = torch.cat([pad(k[b], lens[b]) for b in range(2)])
    vp = torch.cat([pad(v[b], lens[b]) for b in range(2)])
    qp = torch.cat([pad(q[b], lens[b]) for b in range(2)])
    ka, va = cache.update(0, kp, vp, lengths=lens)
    out = ref_attention(qp, ka, va, **cache.attention_kwargs(0))
    for b in range(2):
        torch.testing.assert_close(out[b:b + 1, :, :lens[b]], ref[b][:, :, :lens[b]])
    assert cache.lengths(0) == lens
    for t in range(steps):
        kn = torch.cat([k[b][:, :, lens[b] + t:lens[b] + t + 1] for b in range(2)])
        vn = torch.cat([v[b][:, :, lens[b] + t:lens[b] + t + 1] for b in range(2)])
        qn = torch.cat([q[b][:, :, lens[b] + t:lens[b] + t + 1] for b in range(2)])
        ka, va = cache.update(0, kn, vn)
        kw = cache.attention_kwargs(0)
        assert "attn_bias" in kw
        out = ref_attention(qn, ka, va, **kw)
        for b in range(2):
            torch.testing.assert_close(out[b:b + 1], ref[b][:, :, lens[b] + t:lens[b] + t + 1])


@pytest.mark.parametrize("window", [None, 4])
def test_left_padding_valid_mask(window):
    Hk, D, n, P, steps = 2, 4, 3, 5, 4
    q, k, v = torch.randn(1, Hk, n + steps, D), torch.randn(1, Hk, n + steps, D), torch.randn(1, Hk, n + steps, D)
    ref = ref_attention(q, k, v, causal=True, window=(window, 0) if window else (-1, -1))
    q2, k2, v2 = torch.randn(1, Hk, P + steps, D), torch.randn(1, Hk, P + steps, D), torch.randn(1, Hk, P + steps, D)
    ref2 = ref_attention(q2, k2, v2, causal=True, window=(window, 0) if window else (-1, -1))
    cache = KVCache(16, Hk, D, 1, batch_size=2, dtype=torch.float32, device="cpu", window=window)
    lp = torch.zeros(1, Hk, P - n, D)
    kp = torch.cat([torch.cat([lp, k[:, :, :n]], 2), k2[:, :, :P]])
    vp = torch.cat([torch.cat([lp, v[:, :, :n]], 2), v2[:, :, :P]])
    qp = torch.cat([torch.cat([lp, q[:, :, :n]], 2), q2[:, :, :P]])
    valid = torch.ones(2, P, dtype=torch.bool)
    valid[0, :P - n] = False
    ka, va = cache.update(0, kp, vp, valid=valid)
    kw = cache.attention_kwargs(0)
    assert kw["key_padding_mask"].shape == (2, P)
    out = ref_attention(qp, ka, va, **kw)
    if window is None:  # the window counts padded slots, so only the unwindowed prefill matches exactly
        torch.testing.assert_close(out[0:1, :, P - n:], ref[:, :, :n])
    torch.testing.assert_close(out[1:2], ref2[:, :, :P])
    for t in range(steps):
        kn = torch.cat([k[:, :, n + t:n + t + 1], k2[:, :, P + t:P + t + 1]])
        vn = torch.cat([v[:, :, n + t:n + t + 1], v2[:, :, P + t:P + t + 1]])
        qn = torch.cat([q[:, :, n + t:n + t + 1], q2[:, :, P + t:P + t + 1]])
        ka, va = cache.update(0, kn, vn)
        out = ref_attention(qn, ka, va, **cache.attention_kwargs(0))
        torch.testing.assert_close(out[1:2], ref2[:, :, P + t:P + t + 1])
        if window is None:
            torch.testing.assert_close(out[0:1], ref[:, :, n + t:n + t + 1])
    assert cache.key_padding_mask(0) is not None


def test_reorder_and_lengths():
    cache = KVCache(8, 1, 2, 2, batch_size=3, dtype=torch.float32, device="cpu")
    k, v = _kv(3, 1, 2, 2)
    for layer in range(2):
        cache.update(layer, k, v, lengths=[2, 1, 2])
    cache.reorder(torch.tensor([2, 2, 1]))
    assert cache.lengths(0) == [2, 2, 1]
    kg, vg = cache.get(0)
    torch.testing.assert_close(kg[:, :, :2], k[[2, 2, 1]])
    with pytest.raises(ValueError, match="index"):
        cache.reorder(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="ring-buffer"):
        KVCache(8, 1, 2, 1, window=2).update(0, *_kv(1, 1, 1, 2), lengths=[1])


def test_multihead_attention_with_kv_cache_dropin():
    import math

    import torch.nn.functional as F

    from fastarch.nn import MultiHeadAttentionWithKVCache

    torch.manual_seed(0)
    m = MultiHeadAttentionWithKVCache(16, 4).eval()
    assert sorted(m.state_dict()) == ["w_k.weight", "w_o.weight", "w_q.weight", "w_v.weight"]
    x = torch.randn(2, 7, 16)

    # The guide's uncached path: causal softmax attention with a triu mask.
    def guide(x):
        B, L, _ = x.shape
        q = m.w_q(x).view(B, L, 4, 4).transpose(1, 2)
        k = m.w_k(x).view(B, L, 4, 4).transpose(1, 2)
        v = m.w_v(x).view(B, L, 4, 4).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(4)
        s = s.masked_fill(torch.triu(torch.ones(L, L), diagonal=1).bool(), float("-inf"))
        return m.w_o((F.softmax(s, -1) @ v).transpose(1, 2).reshape(B, L, 16))

    with torch.no_grad():
        full = m(x)
        torch.testing.assert_close(full, guide(x), atol=1e-5, rtol=1e-5)
        cache = m.allocate_kv_cache(2, 8)
        parts = [m(x[:, :3], kv_cache=cache)] + [m(x[:, t:t + 1], kv_cache=cache) for t in range(3, 7)]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
        # GQA + sliding window with a ring cache
        mw = MultiHeadAttentionWithKVCache(16, 4, n_kv_heads=2, window=2).eval()
        fullw = mw(x)
        cache = mw.allocate_kv_cache(2, 8)
        assert cache.window == 2 and cache.n_heads == 2
        parts = [mw(x[:, :4], kv_cache=cache)] + [mw(x[:, t:t + 1], kv_cache=cache) for t in range(4, 7)]
        torch.testing.assert_close(torch.cat(parts, 1), fullw, atol=1e-5, rtol=1e-5)


def test_window_with_per_sequence_lengths():
    """A windowed model decoding sequences of different lengths: the window follows each row's offset."""
    Hk, D, w = 1, 4, 2
    lens, steps = [2, 4], 2
    q = [torch.randn(1, Hk, n + steps, D) for n in lens]
    k = [torch.randn(1, Hk, n + steps, D) for n in lens]
    ref = [ref_attention(q[b], k[b], k[b], causal=True, window=(w, 0)) for b in range(2)]
    cache = KVCache(8, Hk, D, 1, batch_size=2, dtype=torch.float32, device="cpu")
    P = max(lens)

    def pad(t, n):
        return torch.cat([t[:, :, :n], torch.zeros(1, Hk, P - n, D)], 2)

    kp = torch.cat([pad(k[b], lens[b]) for b in range(2)])
    ka, va = cache.update(0, kp, kp, lengths=lens)
    out = ref_attention(torch.cat([pad(q[b], lens[b]) for b in range(2)]), ka, va,
                        **cache.attention_kwargs(0, window=w))
    for b in range(2):
        torch.testing.assert_close(out[b:b + 1, :, :lens[b]], ref[b][:, :, :lens[b]])
    for t in range(steps):
        kn = torch.cat([k[b][:, :, lens[b] + t:lens[b] + t + 1] for b in range(2)])
        qn = torch.cat([q[b][:, :, lens[b] + t:lens[b] + t + 1] for b in range(2)])
        ka, va = cache.update(0, kn, kn)
        out = ref_attention(qn, ka, va, **cache.attention_kwargs(0, window=w))
        for b in range(2):
            torch.testing.assert_close(out[b:b + 1], ref[b][:, :, lens[b] + t:lens[b] + t + 1])
    with pytest.raises(ValueError, match="window"):
        cache.attention_kwargs(0, window=-2)
    ring = KVCache(8, Hk, D, 1, window=2)
    ring.update(0, *_kv(1, Hk, 1, D))
    with pytest.raises(ValueError, match="wider than the ring"):
        ring.attention_kwargs(0, window=3)


@pytest.mark.parametrize("bad", ["lengths_float", "lengths_bool", "lengths_float_tensor", "overflow", "dtype"])
def test_rejected_update_keeps_buffer_bits(bad):
    """A refused update leaves every buffer bit-identical (NaN payloads in unused slots included) and the
    lengths as they were."""
    cache = KVCache(6, 2, 4, 2, batch_size=2, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.update(layer, *_kv(2, 2, 2, 4))
    for t in cache._k + cache._v:
        t.copy_(nan_poisoned(t, 3))
    before = [bits(t) for t in cache._k + cache._v]
    lens = [list(x) for x in cache._lens]
    k, v = _kv(2, 2, 2, 4)
    kwargs: dict = {}
    exc: type[Exception] = TypeError
    if bad == "lengths_float":
        kwargs["lengths"] = [1.5, 2]  # int(1.5) would silently advance the sequence by 1
    elif bad == "lengths_bool":
        kwargs["lengths"] = [True, 2]
    elif bad == "lengths_float_tensor":
        kwargs["lengths"] = torch.tensor([1.0, 2.0])
    elif bad == "overflow":
        k, v, exc = *_kv(2, 2, 5, 4), ValueError
    else:
        k = k.double()
    with pytest.raises(exc, match="KVCache"):
        cache.update(1, k, v, **kwargs)
    for b, t in zip(before, cache._k + cache._v):
        assert_bits_equal(b, t, "KV buffer")
    assert cache._lens == lens
    cache.update(1, *_kv(2, 2, 2, 4), lengths=torch.tensor([1, 2]))  # integer lengths are still accepted
    assert cache.lengths(1) == [3, 4]


@pytest.mark.parametrize("index", [[0, 2], [-1, 0], [0, 1, 1]])
def test_rejected_reorder_keeps_buffer_bits(index):
    cache = KVCache(6, 2, 4, 2, batch_size=2, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.update(layer, *_kv(2, 2, 2, 4))
    for t in cache._k + cache._v:
        t.copy_(nan_poisoned(t, 3))
    before = [bits(t) for t in cache._k + cache._v]
    with pytest.raises((ValueError, IndexError), match="KVCache: argument 'index'"):
        cache.reorder(torch.tensor(index))
    for b, t in zip(before, cache._k + cache._v):
        assert_bits_equal(b, t, "KV buffer")
