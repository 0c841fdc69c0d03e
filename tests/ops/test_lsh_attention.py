"""lsh_attention: the reference against an independent per-query oracle of the rule, the dense limit,
and every backend (outputs and gradients) against the reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.ops.lsh_attention import (
    MAX_N_HASHES,
    lsh_attention,
    lsh_attention_ref,
    lsh_hash,
    lsh_n_buckets,
    lsh_rotations,
)
from tests._backends import require_backend
from tests._tolerance import assert_fa_close

pytestmark = pytest.mark.op("lsh_attention")

# -- an independent oracle: for each query, list the key occurrences the rule gives, in float64 -------------
def oracle(qk, v, rotations, bucket_size, causal=False, key_padding_mask=None):
    """Per-query loops straight from the rule in fastarch.ops.lsh_attention's docstring; O(L^2) and slow, for tiny L only."""
    B, H, L, D = qk.shape
    NH = rotations.shape[1]
    nb = max(2, math.ceil(L / bucket_size))
    nb += nb % 2
    Lp = math.ceil(L / bucket_size) * bucket_size
    n_chunks = NH * Lp // bucket_size
    out = torch.zeros(B, H, L, D, dtype=torch.float64)
    buckets = torch.zeros(B, H, NH, L, dtype=torch.long)
    R = rotations.double()
    for b in range(B):
        for h in range(H):
            x, vv = qk[b, h].double(), v[b, h].double()
            order: list[int] = []
            for r in range(NH):
                proj = x @ R[:, r, :]
                bk = [int(torch.argmax(torch.cat([proj[i], -proj[i]]))) for i in range(L)]
                buckets[b, h, r] = torch.tensor(bk)
                keyed = [((bk[i] if i < L else nb), i) for i in range(Lp)]
                order += [i for _, i in sorted(keyed)]
            for i in range(L):
                rounds = []
                for r in range(NH):
                    slot = r * Lp + order[r * Lp : (r + 1) * Lp].index(i)
                    c = slot // bucket_size
                    prev = (c - 1) % n_chunks
                    slots = list(range(c * bucket_size, (c + 1) * bucket_size))
                    slots += list(range(prev * bucket_size, (prev + 1) * bucket_size))
                    keys = []
                    for t in slots:
                        j = order[t]
                        if j >= L or j == i:
                            continue
                        if key_padding_mask is not None and not bool(key_padding_mask[b, j]):
                            continue
                        if causal and j > i:
                            continue
                        keys.append(j)
                    if keys:
                        s = torch.stack(
                            [x[i] @ (x[j] / x[j].norm().clamp_min(1e-12)) for j in keys]
                        ) / math.sqrt(D)
                        lse = torch.logsumexp(s, 0)
                        o = (torch.softmax(s, 0)[:, None] * vv[keys]).sum(0)
                        rounds.append((o, lse))
                if rounds:
                    w = torch.softmax(torch.stack([lse for _, lse in rounds]), 0)
                    out[b, h, i] = sum(wr * o for wr, (o, _) in zip(w, rounds))
                else:
                    out[b, h, i] = vv[i]
    return out, buckets


def _inputs(B, H, L, D, dtype=torch.float32, grad=False):
    qk = torch.randn(B, H, L, D, dtype=dtype)
    v = torch.randn(B, H, L, D, dtype=dtype)
    if grad:
        qk.requires_grad_(True)
        v.requires_grad_(True)
    return qk, v


@pytest.mark.parametrize(
    "L,bs,nh,causal,use_mask",
    [
        (5, 8, 1, False, False),  # a single chunk that wraps onto itself
        (5, 8, 2, True, False),
        (7, 4, 3, False, True),
        (13, 4, 2, True, True),
        (21, 32, 2, False, False),  # bucket_size >= L
        (37, 8, 3, True, False),
        (40, 8, 4, False, True),
    ],
)
def test_reference_matches_oracle(L, bs, nh, causal, use_mask):
    B, H, D = 2, 2, 6
    qk, v = _inputs(B, H, L, D)
    rot = lsh_rotations(D, nh, lsh_n_buckets(L, bs), seed=3)
    kpm = (torch.rand(B, L) > 0.3) if use_mask else None
    out, buckets = lsh_attention_ref(
        qk,
        v,
        n_hashes=nh,
        bucket_size=bs,
        causal=causal,
        key_padding_mask=kpm,
        rotations=rot,
        return_buckets=True,
    )
    want, want_b = oracle(qk, v, rot, bs, causal, kpm)
    assert torch.equal(buckets, want_b)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_self_only_fallback_is_own_value(backend):
    # L=1: the only key is the query itself in every round, so the output is its own v.
    qk, v = _inputs(1, 2, 1, 8)
    out = lsh_attention(qk, v, n_hashes=3, bucket_size=4, seed=0, backend=backend)
    torch.testing.assert_close(out, v)


@pytest.mark.parametrize("nh", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_bucket_size_at_least_L_is_dense(nh, causal, backend):
    # Every round's chunk pair holds every key (twice), so the rule is dense attention without self,
    # normalised keys, and the query's own v when it has no other key.
    B, H, L, D = 1, 2, 19, 8
    qk, v = _inputs(B, H, L, D)
    out = lsh_attention(qk, v, n_hashes=nh, bucket_size=32, causal=causal, seed=1, backend=backend)
    kn = F.normalize(qk, dim=-1)
    s = qk @ kn.transpose(-1, -2) / math.sqrt(D)
    allowed = ~torch.eye(L, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(L, L).tril().bool()
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    dense = p @ v
    dense[:, :, 0] = v[:, :, 0] if causal else dense[:, :, 0]
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=1e-4)


CASES = [
    # (B, H, L, D, bs, nh, causal)
    (1, 2, 1, 16, 8, 1, False),
    (2, 2, 63, 16, 8, 4, True),
    (1, 3, 200, 24, 16, 1, False),
    (1, 2, 200, 16, 32, 4, True),
    (1, 1, 1000, 32, 64, 4, False),
    (1, 1, 1000, 16, 32, 1, True),
]


@pytest.mark.parametrize("B,H,L,D,bs,nh,causal", CASES)
def test_backend_matches_reference(backend, B, H, L, D, bs, nh, causal):
    if backend == "triton" and L * nh > 2000:
        L = 200  # kept small under the Triton interpreter
    qk, v = _inputs(B, H, L, D, grad=True)
    kpm = torch.rand(B, L) > 0.2
    kw = dict(n_hashes=nh, bucket_size=bs, causal=causal, key_padding_mask=kpm, seed=7)
    ref = lsh_attention_ref(qk, v, **kw)
    g = torch.randn_like(ref)
    dq_ref, dv_ref = torch.autograd.grad(ref, (qk, v), g)
    out = lsh_attention(qk, v, backend=backend, **kw)
    dq, dv = torch.autograd.grad(out, (qk, v), g)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dv, dv_ref, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(dq, dq_ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_cpp_both_schedules(causal):
    # the C++ forward folds rounds per head when B*H >= threads, else writes per-slot outputs: same result
    qk, v = _inputs(1, 3, 150, 16)
    kpm = torch.rand(1, 150) > 0.2
    kw = dict(n_hashes=3, bucket_size=16, seed=2, causal=causal, key_padding_mask=kpm, backend="cpp")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        per_head = lsh_attention(qk, v, **kw)
        torch.set_num_threads(4)
        per_slot = lsh_attention(qk, v, **kw)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(per_head, per_slot, atol=1e-5, rtol=1e-5)
    ref = lsh_attention_ref(qk, v, n_hashes=3, bucket_size=16, seed=2, causal=causal, key_padding_mask=kpm)
    torch.testing.assert_close(per_head, ref, atol=2e-5, rtol=1e-4)


def _per_head(fn):
    """Run ``fn`` with one thread, so the C++ forward takes its per-head path whatever B*H is."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "norm_scale,D,bs,causal,L,use_kpm",
    [
        # D not a multiple of 8 or 16: scalar transpose and the panel GEMM's tail
        (1.0, 20, 8, False, 150, True),
        (1.0, 16, 5, True, 150, True),  # bucket_size not a multiple of 8: padded key columns
        # bucket_size % 16 == 0: own-chunk scores from the symmetric Gram matrix
        (1.0, 16, 32, False, 150, True),
        (1.0, 24, 64, True, 150, True),
        # |q| / sqrt(D) far above the shift limit: row max and online rescale
        (60.0, 16, 16, False, 150, True),
        (60.0, 32, 16, True, 150, True),
        (None, 16, 16, False, 150, True),  # some rows above the limit, the rest below, in the same chunks
        (None, 16, 16, True, 150, True),
        # no padding, key mask or causal mask: "plain" chunks mask only each query's own column
        (1.0, 16, 16, False, 160, False),
        (1.0, 24, 32, False, 192, False),
        (1.0, 16, 8, False, 96, False),  # plain without the Gram matrix (bucket_size % 16 != 0)
        (1.0, 16, 16, False, 150, False),  # plain chunks, and padded last chunks in each round
        (None, 16, 16, False, 160, False),
    ],
)
def test_cpp_per_head_shift_paths(norm_scale, D, bs, causal, L, use_kpm):
    # the per-head forward shifts every row by its score bound |q| / sqrt(D) while that is <= 40, else by
    # its row max with a rescale across rounds; both must equal the reference, outputs and lse-driven grads
    B, H = 1, 2
    qk, v = _inputs(B, H, L, D)
    if norm_scale is None:
        big = torch.rand(B, H, L, 1) < 0.3
        qk = torch.where(big, qk * 60.0, qk)
    else:
        qk = qk * norm_scale
    qk.requires_grad_(True)
    v.requires_grad_(True)
    kpm = torch.rand(B, L) > 0.2 if use_kpm else None
    kw = dict(n_hashes=3, bucket_size=bs, seed=4, causal=causal, key_padding_mask=kpm)
    ref = lsh_attention_ref(qk, v, **kw)
    g = torch.randn_like(ref)
    dq_ref, dv_ref = torch.autograd.grad(ref, (qk, v), g)
    out = _per_head(lambda: lsh_attention(qk, v, backend="cpp", **kw))
    dq, dv = torch.autograd.grad(out, (qk, v), g)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dv, dv_ref, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(dq, dq_ref, atol=5e-5 * (norm_scale or 60.0), rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_half_precision(backend):
    B, H, L, D = 1, 2, 70, 16
    qk32, v32 = _inputs(B, H, L, D)
    kw = dict(n_hashes=2, bucket_size=16, seed=5, causal=True)
    qk, v = qk32.half().requires_grad_(True), v32.half().requires_grad_(True)
    qkr, vr = qk.detach().float().requires_grad_(True), v.detach().float().requires_grad_(True)
    ref = lsh_attention_ref(qkr, vr, **kw)
    g = torch.randn_like(ref)
    ref.backward(g)
    qkt, vt = qk.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)
    tor = lsh_attention_ref(qkt, vt, upcast=False, **kw)  # PyTorch's own error in half
    tor.float().backward(g)
    out = lsh_attention(qk, v, backend=backend, **kw)
    assert out.dtype == torch.float16
    out.float().backward(g)
    assert_fa_close(out, ref, tor, 2.0)
    assert_fa_close(qk.grad, qkr.grad, qkt.grad, 3.0, atol=1e-3, what="dqk")
    assert_fa_close(v.grad, vr.grad, vt.grad, 3.0, atol=1e-3, what="dv")


def test_reference_upcast_false_computes_in_the_input_dtype():
    qk, v = _inputs(1, 2, 40, 16)
    kw = dict(n_hashes=2, bucket_size=8, seed=1)
    low = lsh_attention_ref(qk.half(), v.half(), upcast=False, **kw)
    up = lsh_attention_ref(qk.half(), v.half(), **kw)
    assert low.dtype == up.dtype == torch.float16
    err_low = (low.float() - lsh_attention_ref(qk.half().float(), v.half().float(), **kw)).abs().max()
    assert 0 < err_low < 2e-2


@pytest.mark.parametrize(
    "L,D,bs,blocks,causal,use_kpm",
    [
        (70, 24, 40, (16, 16), False, True),  # 3 query blocks per chunk, a key block across the halves
        (70, 24, 40, (16, 32), True, True),
        (45, 17, 24, (16, 16), True, False),  # odd head dim, padded last chunk
        (30, 16, 5, (16, 16), False, False),  # bucket smaller than a block
    ],
)
def test_triton_tiles(monkeypatch, L, D, bs, blocks, causal, use_kpm):
    # the kernels tile queries and keys: force small tiles so that a chunk spans several of them, then
    # compare the op's output and gradients on the triton backend with the reference
    require_backend("lsh_attention", "triton")
    from fastarch.kernels import lsh_attention as K

    monkeypatch.setattr(K, "_blocks", lambda bucket_size, head_dim, dtype: (*blocks, K._pow2(head_dim)))
    qk, v = _inputs(1, 1, L, D, grad=True)
    kpm = torch.rand(1, L) > 0.2 if use_kpm else None
    kw = dict(n_hashes=2, bucket_size=bs, causal=causal, key_padding_mask=kpm, seed=3)
    ref = lsh_attention_ref(qk, v, **kw)
    g = torch.randn_like(ref)
    dqk_ref, dv_ref = torch.autograd.grad(ref, (qk, v), g)
    out = lsh_attention(qk, v, backend="triton", **kw)
    dqk, dv = torch.autograd.grad(out, (qk, v), g)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dv, dv_ref, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(dqk, dqk_ref, atol=5e-5, rtol=1e-4)


def test_buckets_and_seed():
    qk, v = _inputs(2, 3, 50, 8)
    o1, b1 = lsh_attention(qk, v, n_hashes=2, bucket_size=8, seed=11, return_buckets=True)
    o2, b2 = lsh_attention(qk, v, n_hashes=2, bucket_size=8, seed=11, return_buckets=True)
    assert b1.shape == (2, 3, 2, 50) and b1.dtype == torch.long
    nb = lsh_n_buckets(50, 8)
    assert nb == 8 and int(b1.max()) < nb
    assert torch.equal(b1, b2) and torch.equal(o1, o2)
    rot = lsh_rotations(8, 2, nb, seed=11)
    o3, b3 = lsh_attention(qk, v, n_hashes=2, bucket_size=8, rotations=rot, return_buckets=True)
    assert torch.equal(b1, b3)
    torch.testing.assert_close(o1, o3)
    _, b4 = lsh_attention(qk, v, n_hashes=2, bucket_size=8, seed=12, return_buckets=True)
    assert not torch.equal(b1, b4)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_hash_ties_and_near_ties_match_fp64(backend):
    # exact ties (a duplicated column, a column and its negation), near ties below fp32 resolution, zero
    # rows and ordinary rows: every backend's buckets equal the fp64 reference, first maximum in concat order
    L, D, NH, bs = 96, 24, 3, 4
    nb = lsh_n_buckets(L, bs)
    assert nb // 2 == 12
    rot = lsh_rotations(D, NH, nb, seed=3)
    rot[:, 0, 7] = rot[:, 0, 3]  # exact duplicate
    rot[:, 1, 5] = -rot[:, 1, 2]  # column 5's positive side equals column 2's negative side
    rot[:, 2, 9] = rot[:, 2, 4] * (1 + 3e-7)  # a tie below fp32 resolution of the projections
    qk = torch.randn(1, 2, L, D)
    qk[0, 0, :8] = rot[:, 0, 3] * torch.arange(1, 9)[:, None]
    qk[0, 0, 8:16] = -rot[:, 1, 2] * torch.arange(1, 9)[:, None]
    qk[0, 0, 16:24] = rot[:, 2, 4] * torch.arange(1, 9)[:, None]
    qk[0, 1, :4] = 0.0
    v = torch.randn_like(qk)
    want = lsh_hash(qk, rot)
    assert int(want[0, 0, 0, 0]) == 3 and int(want[0, 0, 1, 8]) == 5
    _, got = lsh_attention(
        qk, v, n_hashes=NH, bucket_size=bs, rotations=rot, return_buckets=True, backend=backend
    )
    assert torch.equal(got, want)
    assert int(got[0, 1, 0, 0]) == 0  # all projections 0: the first index


@pytest.mark.parametrize("D,L,bs", [(64, 300, 16), (24, 200, 8), (17, 90, 7), (3, 40, 3)])
def test_cpp_hash_integer_projections(D, L, bs):
    # the C++ hash scales x per row and R per round to int16 and takes the argmax of exact integer dot
    # products, deciding close calls in fp32 and then fp64: the AVX2 tile (asm) and the portable one give
    # the same buckets, and both equal the fp64 reference on finite rows of any scale
    from fastarch.extensions import load_extension

    lib = load_extension("lsh_attention", "cpu")
    NH = 4
    nb = lsh_n_buckets(L, bs)
    rot = lsh_rotations(D, NH, nb, seed=7)
    qk = torch.randn(2, 3, L, D)
    qk[0, 0, :10] *= 1e-20  # tiny rows: large integer scales
    qk[0, 1, :10] *= 1e-41  # subnormal rows: the scale overflows, decided in fp64
    qk[0, 2, :10] *= 1e30
    qk[1, 0, :5] = 0.0
    qk[1, 0, 5:10] = rot[:, 0, 1] * 3.0  # projections that tie other columns of the round closely
    qk[1, 1, 3, 0] = float("nan")
    qk[1, 1, 4, 1] = float("inf")
    fast = lib.lsh_hash(qk, rot)
    generic = lib.lsh_hash(qk, rot, True)
    assert torch.equal(fast, generic)
    finite = qk.isfinite().all(-1)  # (B, H, L)
    want = lsh_hash(qk, rot)
    mask = finite[:, :, None, :].expand_as(want)
    assert torch.equal(fast[mask], want[mask])


def test_n_buckets_rule():
    assert lsh_n_buckets(1, 64) == 2
    assert lsh_n_buckets(100, 64) == 2
    assert lsh_n_buckets(129, 64) == 4
    assert lsh_n_buckets(200, 64) == 4
    assert lsh_n_buckets(16384, 64) == 256


def test_bad_inputs():
    qk, v = _inputs(1, 2, 10, 8)
    with pytest.raises(ValueError, match="bucket_size"):
        lsh_attention(qk, v, bucket_size=0)
    with pytest.raises(ValueError, match="n_hashes"):
        lsh_attention(qk, v, n_hashes=0)
    with pytest.raises(ValueError, match="'v'"):
        lsh_attention(qk, v[:, :, :9])
    with pytest.raises(ValueError, match="'qk'"):
        lsh_attention(qk[0], v[0])
    with pytest.raises(ValueError, match="rotations"):
        lsh_attention(qk, v, n_hashes=2, bucket_size=4, rotations=torch.randn(8, 2, 3))
    with pytest.raises(ValueError, match="key_padding_mask"):
        lsh_attention(qk, v, key_padding_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        lsh_attention(qk, v, key_padding_mask=torch.ones(1, 10))
    with pytest.raises(TypeError, match="'v'"):
        lsh_attention(qk, v.double())


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_torch_compile_fullgraph_and_opcheck(backend):
    # the op is made of custom ops (rotations, hash+sort, forward, backward): it traces without graph
    # breaks, forward and backward equal the eager reference, and opcheck passes on each
    from fastarch.ops.lsh_attention import _lsh_fwd, _lsh_prepare, _prepare

    qk, v = _inputs(1, 2, 50, 16, grad=True)
    kpm = torch.rand(1, 50) > 0.2
    kw = dict(n_hashes=2, bucket_size=8, seed=3, key_padding_mask=kpm)
    f = torch.compile(
        lambda a, b: lsh_attention(a, b, backend=backend, **kw), fullgraph=True, backend="aot_eager"
    )
    out = f(qk, v)
    grads = torch.autograd.grad(out.sum(), (qk, v))
    ref = lsh_attention_ref(qk, v, **kw)
    grads_ref = torch.autograd.grad(ref.sum(), (qk, v))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    _, _, perm, inv = _prepare(qk, 2, 8, 3, None)
    torch.library.opcheck(_lsh_fwd, (qk, v, perm, inv, kpm, True, 8, 2, backend))
    torch.library.opcheck(_lsh_prepare, (qk.detach(), lsh_rotations(16, 2, 8, seed=1), 8, backend))


def test_compiled_unseeded_calls_draw_their_own_rotations():
    qk, v = _inputs(1, 2, 64, 16)

    def two_calls(a, b):
        _, b1 = lsh_attention(a, b, n_hashes=2, bucket_size=8, return_buckets=True)
        _, b2 = lsh_attention(a, b, n_hashes=2, bucket_size=8, return_buckets=True)
        return b1, b2

    b1, b2 = torch.compile(two_calls, fullgraph=True, backend="aot_eager")(qk, v)
    assert not torch.equal(b1, b2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "L,D,bs,causal", [(4096, 64, 64, False), (1000, 128, 64, True), (777, 96, 128, False)]
)
def test_gpu_triton(dtype, L, D, bs, causal):
    # the Triton backend on a GPU (the auto choice there) against the fp32 reference, FlashAttention's
    # criterion for fp16/bf16 (judged against PyTorch's own error in that dtype)
    g32 = torch.Generator().manual_seed(0)
    qk32 = torch.randn(2, 4, L, D, generator=g32)
    v32 = torch.randn(2, 4, L, D, generator=g32)
    kpm = torch.rand(2, L, generator=g32) > 0.1
    kw = dict(n_hashes=4, bucket_size=bs, causal=causal, seed=1)
    qk, v = (t.cuda().to(dtype).requires_grad_(True) for t in (qk32, v32))
    kpm = kpm.cuda()
    out = lsh_attention(qk, v, key_padding_mask=kpm, **kw)
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=g32).cuda()
    dqk, dv = torch.autograd.grad(out, (qk, v), g.to(dtype))
    qkr, vr = (t.detach().float().requires_grad_(True) for t in (qk, v))
    ref = lsh_attention_ref(qkr, vr, key_padding_mask=kpm, **kw)
    dqk_r, dv_r = torch.autograd.grad(ref, (qkr, vr), g)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(dv, dv_r, atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(dqk, dqk_r, atol=5e-5, rtol=1e-4)
        return
    qkt, vt = (t.detach().clone().requires_grad_(True) for t in (qk, v))
    tor = lsh_attention_ref(qkt, vt, key_padding_mask=kpm, upcast=False, **kw)
    dqk_t, dv_t = torch.autograd.grad(tor, (qkt, vt), g.to(dtype))
    assert_fa_close(out, ref, tor, 2.0)
    assert_fa_close(dqk, dqk_r, dqk_t, 3.0, atol=1e-3, what="dqk")
    assert_fa_close(dv, dv_r, dv_t, 3.0, atol=1e-3, what="dv")


@pytest.mark.parametrize("causal", [False, True])
def test_bucket_size_past_the_length_is_clamped_with_the_same_result(causal, backend):
    """bucket_size=2**40 on L=12 padded L to 2**40 (terabytes); any bucket size >= L is the same rule, so it
    runs as bucket_size=L, with the same output and gradients."""
    qk, v = _inputs(2, 2, 12, 8)
    kpm = torch.ones(2, 12, dtype=torch.bool)
    kpm[1, 9:] = False

    def call(bs):
        a, b = qk.clone().requires_grad_(), v.clone().requires_grad_()
        out = lsh_attention(a, b, n_hashes=2, bucket_size=bs, causal=causal, key_padding_mask=kpm, seed=4,
                            backend=backend)
        out.backward(torch.ones_like(out))
        return out, a.grad, b.grad

    for got, want in zip(call(2**40), call(12)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = lsh_attention_ref(qk, v, n_hashes=2, bucket_size=2**40, causal=causal, key_padding_mask=kpm, seed=4)
    torch.testing.assert_close(ref, call(12)[0], rtol=1e-4, atol=2e-5)


def test_n_hashes_is_bounded():
    qk, v = _inputs(1, 1, 4, 8)
    with pytest.raises(ValueError, match=f"'n_hashes' must be an integer in \\[1, {MAX_N_HASHES}\\]"):
        lsh_attention(qk, v, n_hashes=MAX_N_HASHES + 1)
