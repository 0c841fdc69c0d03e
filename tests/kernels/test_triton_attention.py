"""The Triton attention launchers (kernels/attention.py) against a dense fp32 reference, under the interpreter.

The launchers are called directly (the op layer is tested in tests/ops). Shapes are small and odd so that
tiles straddle the sequence ends and the band edges; the cases are a representative subset of
(Lq, Lk) x D x masks x dtype, not the cross product, to keep the file fast under the interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._backends import import_triton
from tests._tolerance import assert_fa_close

triton = import_triton()

from fastarch.kernels import attention as A  # noqa: E402

M32 = 0xFFFFFFFF


# -- an independent dense reference -----------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    # int64 products wrap, but their low 32 bits are exact, which is all "& M32" keeps.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def keep_mask(seed: int, B: int, H: int, Lq: int, Lk: int, p: float) -> torch.Tensor:
    """(B, H, Lq, Lk) bool: fastarch's hash dropout rule, spelled out in int64 torch ops."""
    b = torch.arange(B, dtype=torch.int64).view(B, 1, 1, 1)
    h = torch.arange(H, dtype=torch.int64).view(1, H, 1, 1)
    i = torch.arange(Lq, dtype=torch.int64).view(1, 1, Lq, 1)
    j = torch.arange(Lk, dtype=torch.int64).view(1, 1, 1, Lk)
    key = _mix32(torch.tensor(seed & M32) ^ _mix32(b * H + h))
    r = _mix32(key ^ _mix32((i * 0x9E3779B1 + j) & M32))
    return (r >> 8).double() * 2.0 ** -24 >= p


def dense_ref(q, k, v, left=-1, right=-1, kpm=None, bias=None, p=0.0, seed=0, scale=None, dtype=torch.float32):
    """Materialised attention in `dtype`: o (B,H,Lq,D) and lse (B,H,Lq). Differentiable."""
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = k.repeat_interleave(H // Hk, 1)
    v = v.repeat_interleave(H // Hk, 1)
    scale = D ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(dtype)
    dev = q.device
    qpos = torch.arange(Lq, device=dev).view(-1, 1) + (Lk - Lq)
    j = torch.arange(Lk, device=dev).view(1, -1)
    vis = torch.ones(Lq, Lk, dtype=torch.bool, device=dev)
    if left >= 0:
        vis &= j >= qpos - left
    if right >= 0:
        vis &= j <= qpos + right
    vis = vis.view(1, 1, Lq, Lk)
    if kpm is not None:
        vis = vis & kpm.view(B, 1, 1, Lk)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    prob = torch.softmax(s, -1).nan_to_num(0.0)
    if p > 0:
        prob = prob * keep_mask(seed, B, H, Lq, Lk, p).to(dev, dtype) / (1 - p)
    return prob @ v, lse


def _inputs(B, H, Hk, Lq, Lk, D, dtype, *, kpm=False, bias=False, strided=False):
    if strided:
        # (B, L, H, D) storage viewed as (B, H, L, D): what attention modules hand over after a transpose.
        q = torch.randn(B, Lq, H, D).to(dtype).transpose(1, 2)
        k = torch.randn(B, Lk, Hk, D).to(dtype).transpose(1, 2)
        v = torch.randn(B, Lk, Hk, D).to(dtype).transpose(1, 2)
    else:
        q, k, v = (torch.randn(B, h, n, D).to(dtype) for h, n in ((H, Lq), (Hk, Lk), (Hk, Lk)))
    m = None
    if kpm:
        m = torch.rand(B, Lk) > 0.3
        m[0, -1] = True
        m[-1] = False  # a fully padded batch row: its queries see nothing
    b = torch.randn(1, H, Lq, Lk).expand(B, H, Lq, Lk) if bias else None  # zero batch stride
    return q, k, v, m, b


def _run(q, k, v, m, b, left, right, p=0.0, seed=7, need_dbias=False, splits=None):
    D = q.shape[-1]
    kw = dict(window_left=left, window_right=right, key_padding_mask=m, attn_bias=b, dropout_p=p, seed=seed,
              scale=D ** -0.5)
    o, lse = A._attention_fwd(q, k, v, num_splits=splits, **kw)
    do = torch.randn(o.shape).to(o.dtype)
    grads = A.attention_bwd(do, q, k, v, o, lse, need_dbias=need_dbias, **kw)
    return o, lse, do, grads


def _ref_grads(q, k, v, m, b, left, right, do, p=0.0, seed=7, dtype=torch.float32):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    bl = b.detach().clone().requires_grad_() if b is not None else None
    o, lse = dense_ref(*leaves, left, right, m, bl, p, seed, dtype=dtype)
    o.backward(do.to(dtype))
    return o.detach(), lse, [x.grad for x in leaves] + [bl.grad if bl is not None else None]


# (Lq, Lk, D, (left, right), H, Hk, kpm, bias, strided)
CASES_FP32 = [
    (17, 17, 16, (-1, -1), 2, 2, False, False, False),
    (1, 37, 40, (-1, -1), 4, 1, False, False, False),   # decode-sized query, MQA
    (33, 70, 40, (-1, 0), 4, 2, False, False, True),    # causal, Lq < Lk (bottom-right), GQA, strided
    (70, 33, 16, (-1, 0), 2, 2, False, False, False),   # causal with Lq > Lk: leading rows see nothing
    (65, 65, 64, (9, 3), 2, 1, False, False, False),    # asymmetric window, MQA
    (33, 70, 40, (3, 11), 2, 2, True, False, False),    # window + padding incl. a fully padded row
    (17, 33, 16, (-1, -1), 2, 2, False, True, False),   # bias (expanded, zero batch stride)
    (33, 33, 72, (4, 0), 4, 2, True, True, False),      # D=72 (BLOCK_D 128), causal window, padding, bias
    (65, 65, 16, (70, 70), 2, 2, False, False, False),  # window wider than L == full attention
]


@pytest.mark.parametrize("Lq,Lk,D,win,H,Hk,kpm,bias,strided", CASES_FP32)
def test_fwd_bwd_fp32(Lq, Lk, D, win, H, Hk, kpm, bias, strided):
    q, k, v, m, b = _inputs(2, H, Hk, Lq, Lk, D, torch.float32, kpm=kpm, bias=bias, strided=strided)
    o, lse, do, (dq, dk, dv, db) = _run(q, k, v, m, b, *win, need_dbias=bias)
    ro, rlse, (rdq, rdk, rdv, rdb) = _ref_grads(q, k, v, m, b, *win, do)
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(o, ro, **tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse)), "rows that see no key must have lse = -inf"
    seen = torch.isfinite(rlse)
    torch.testing.assert_close(lse[seen], rlse[seen], **tol)
    assert (o[~seen] == 0).all()
    torch.testing.assert_close(dq, rdq, **tol)
    torch.testing.assert_close(dk, rdk, **tol)
    torch.testing.assert_close(dv, rdv, **tol)
    assert dk.shape == k.shape and dv.shape == v.shape
    if bias:
        # dbias is per element of the expanded (B, H, Lq, Lk) bias; the op reduces broadcast dims itself.
        torch.testing.assert_close(db, rdb, **tol)
    else:
        assert db is None


CASES_FP16 = [
    (33, 70, 64, (-1, 0), 4, 2, False, False),
    (65, 65, 40, (7, 5), 2, 2, True, False),
    (1, 37, 16, (-1, -1), 2, 1, False, True),
]


@pytest.mark.parametrize("Lq,Lk,D,win,H,Hk,kpm,bias", CASES_FP16)
def test_fwd_bwd_fp16(Lq, Lk, D, win, H, Hk, kpm, bias):
    """FlashAttention's criterion: error vs fp32 at most 2x (3x for grads) torch's own fp16 error."""
    q, k, v, m, b = _inputs(2, H, Hk, Lq, Lk, D, torch.float16, kpm=kpm, bias=bias)
    o, lse, do, (dq, dk, dv, _) = _run(q, k, v, m, b, *win)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    assert dq.dtype == dk.dtype == dv.dtype == torch.float16
    r32 = _ref_grads(q, k, v, m, b, *win, do, dtype=torch.float32)
    r16 = _ref_grads(q, k, v, m, b, *win, do, dtype=torch.float16)
    assert_fa_close(o, r32[0], r16[0], 2.0, what="o")
    for name, got, g32, g16 in zip(("dq", "dk", "dv"), (dq, dk, dv), r32[2], r16[2]):
        assert_fa_close(got, g32, g16, 3.0, what=name)


def test_dropout_mask_is_the_hash_rule():
    """Read the kernel's keep-mask back: with q = 0 every visible key gets P = 1/Lk, and v = identity
    puts P[i, j] * keep / (1 - p) in column j of the output."""
    B, H, Lq, Lk, D, p, seed = 2, 3, 19, 37, 64, 0.3, 123456789
    q = torch.zeros(B, H, Lq, D)
    v = torch.eye(Lk, D).expand(B, H, Lk, D).contiguous()
    k = torch.randn(B, H, Lk, D)
    o, _ = A.attention_fwd(q, k, v, window_left=-1, window_right=-1, key_padding_mask=None, attn_bias=None,
                           dropout_p=p, seed=seed, scale=D ** -0.5)
    got = o[..., :Lk] * Lk * (1 - p) > 0.5
    want = keep_mask(seed, B, H, Lq, Lk, p)
    assert torch.equal(got, want)
    assert 0.6 < want.float().mean().item() < 0.8
    # Deterministic for a seed, different for another.
    o2, _ = A.attention_fwd(q, k, v, window_left=-1, window_right=-1, key_padding_mask=None, attn_bias=None,
                            dropout_p=p, seed=seed, scale=D ** -0.5)
    o3, _ = A.attention_fwd(q, k, v, window_left=-1, window_right=-1, key_padding_mask=None, attn_bias=None,
                            dropout_p=p, seed=seed + 1, scale=D ** -0.5)
    assert torch.equal(o, o2) and not torch.equal(o, o3)


@pytest.mark.parametrize("win,bias", [((-1, -1), False), ((6, 2), True)])
def test_dropout_backward_consistent(win, bias):
    q, k, v, m, b = _inputs(2, 4, 2, 33, 40, 16, torch.float32, bias=bias)
    o, lse, do, (dq, dk, dv, db) = _run(q, k, v, m, b, *win, p=0.25, seed=99, need_dbias=bias)
    ro, _, (rdq, rdk, rdv, rdb) = _ref_grads(q, k, v, m, b, *win, do, p=0.25, seed=99)
    tol = dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(o, ro, **tol)
    torch.testing.assert_close(dq, rdq, **tol)
    torch.testing.assert_close(dk, rdk, **tol)
    torch.testing.assert_close(dv, rdv, **tol)
    if bias:
        torch.testing.assert_close(db, rdb, **tol)


@pytest.mark.parametrize("win,kpm", [((-1, -1), False), ((300, 0), True)])
def test_split_k_decode(win, kpm):
    """Flash-decoding path (keys split into 256-aligned chunks merged by lse) equals the reference."""
    q, k, v, m, _ = _inputs(1, 2, 1, 3, 600, 16, torch.float32, kpm=False)
    if kpm:
        m = torch.rand(1, 600) > 0.5
    kw = dict(window_left=win[0], window_right=win[1], key_padding_mask=m, attn_bias=None, dropout_p=0.0,
              seed=0, scale=0.25)
    o, lse = A._attention_fwd(q, k, v, num_splits=3, **kw)
    ro, rlse = dense_ref(q, k, v, *win, m)
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)


def test_band_block_skipping():
    """A narrow window must not touch key blocks outside its band: NaN in far-away keys/values may not
    reach rows whose band ends long before them (it would, through 0 * NaN, if those blocks were visited).
    Valid for any BLOCK_M, BLOCK_N <= 128."""
    L, D = 320, 16
    q, k, v, _, _ = _inputs(1, 1, 1, L, L, D, torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 256:] = float("nan")
    v2[:, :, 256:] = float("nan")
    o, lse, do, (dq, dk, dv, _) = _run(q, k2, v2, None, None, 2, 0)
    ro, rlse, (rdq, rdk, rdv, _) = _ref_grads(q, k, v, None, None, 2, 0, do)
    torch.testing.assert_close(o[:, :, :128], ro[:, :, :128], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dq[:, :, :128], rdq[:, :, :128], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dk[:, :, :128], rdk[:, :, :128], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dv[:, :, :128], rdv[:, :, :128], atol=2e-5, rtol=2e-5)


def test_dropout_threshold_is_exact():
    # keep <=> (r >> 8) * 2**-24 >= p  <=>  (r >> 8) >= ceil(p * 2**24), including p on the 2**-24 grid.
    for p in (0.1, 0.5, 3 / 2 ** 24, 0.999):
        _, _, thresh, scale = A._dropout_args(p, 5)
        assert thresh == math.ceil(p * 2 ** 24)
        assert (thresh - 1) * 2.0 ** -24 < p <= thresh * 2.0 ** -24
        assert scale == pytest.approx(1 / (1 - p))


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(1, 3, 4, 16)), "multiple of k's heads"),
    (dict(q=torch.zeros(1, 2, 4, 300), k=torch.zeros(1, 2, 5, 300), v=torch.zeros(1, 2, 5, 300)), "head dim"),
    (dict(window_left=-2), "window_left"),
    (dict(key_padding_mask=torch.ones(1, 4, dtype=torch.bool)), "key_padding_mask"),
    (dict(attn_bias=torch.zeros(1, 2, 4, 4)), "attn_bias"),
    (dict(v=torch.zeros(1, 2, 5, 16, dtype=torch.float16)), "'v' must have q's dtype"),
    (dict(dropout_p=1.0), "dropout_p"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(alibi_slopes=torch.rand(2)), "alibi_slopes"),
    (dict(alibi_slopes=torch.rand(1, 2, dtype=torch.float64)), "alibi_slopes"),
])
def test_bad_inputs(bad, match):
    args = dict(q=torch.zeros(1, 2, 4, 16), k=torch.zeros(1, 2, 5, 16), v=torch.zeros(1, 2, 5, 16),
                window_left=-1, window_right=-1, key_padding_mask=None, attn_bias=None, dropout_p=0.0, seed=0,
                scale=0.25)
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        A.attention_fwd(q, k, v, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L,D,win", [(1023, 128, (-1, 0)), (2048, 64, (256, 256)), (777, 96, (-1, -1))])
def test_gpu_fwd_bwd(dtype, L, D, win):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(2, 8, L, D, device=dev, dtype=dtype)
    k = torch.randn(2, 2, L, D, device=dev, dtype=dtype)
    v = torch.randn(2, 2, L, D, device=dev, dtype=dtype)
    kw = dict(window_left=win[0], window_right=win[1], key_padding_mask=None, attn_bias=None, dropout_p=0.0,
              seed=0, scale=D ** -0.5)
    o, lse = A.attention_fwd(q, k, v, **kw)
    do = torch.randn_like(o)
    dq, dk, dv, _ = A.attention_bwd(do, q, k, v, o, lse, need_dbias=False, **kw)
    r32 = _ref_grads(q.float(), k.float(), v.float(), None, None, *win, do.float())
    r16 = _ref_grads(q, k, v, None, None, *win, do, dtype=dtype)
    assert_fa_close(o, r32[0], r16[0], 2.0, what="o")
    for name, got, g32, g16 in zip(("dq", "dk", "dv"), (dq, dk, dv), r32[2], r16[2]):
        assert_fa_close(got, g32, g16, 3.0, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("Lq,win", [(1, (-1, 0)), (7, (1000, 0))])
def test_gpu_decode_auto_split(Lq, win):
    """Few query rows, long cache, B*H far below the SM count: the heuristic picks the split-K path."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, Lq, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 5000, 128, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 1, 5000, 128, device="cuda", dtype=torch.float16)
    assert A._auto_splits(q, 1, 4, Lq, 5000) > 1
    o, lse = A.attention_fwd(q, k, v, window_left=win[0], window_right=win[1], key_padding_mask=None,
                             attn_bias=None, dropout_p=0.0, seed=0, scale=128 ** -0.5)
    r32, rl = dense_ref(q.float(), k.float(), v.float(), *win, scale=128 ** -0.5)
    r16, _ = dense_ref(q, k, v, *win, scale=128 ** -0.5, dtype=torch.float16)
    assert_fa_close(o, r32, r16, 2.0, what="o")
    torch.testing.assert_close(lse, rl, atol=1e-3, rtol=1e-3)


def test_empty_keys_and_queries():
    q, k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 1, 0, 16), torch.randn(2, 1, 0, 16)
    kw = dict(window_left=-1, window_right=-1, key_padding_mask=None, attn_bias=None, dropout_p=0.0, seed=0,
              scale=0.25)
    o, lse = A.attention_fwd(q, k, v, **kw)
    assert (o == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv, _ = A.attention_bwd(torch.randn_like(o), q, k, v, o, lse, need_dbias=False, **kw)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape
    o, lse = A.attention_fwd(q[:, :, :0], torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 16), **kw)
    assert o.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)


def test_decode_loop_tunes_once_per_length_bucket():
    """Each autotuning key compiles and times every config: a decode loop, whose key length grows by one per
    step, must reuse one key per power-of-two bucket of lengths rather than tune again at every step."""
    tuner = A._attn_fwd_kernel
    tuner.cache.clear()
    for lk in range(33, 65):
        q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, lk, 16), torch.randn(1, 2, lk, 16)
        o, _ = A.attention_fwd(q, k, v, window_left=-1, window_right=0, key_padding_mask=None, attn_bias=None,
                               dropout_p=0.0, seed=0, scale=0.25)
        ref, _ = dense_ref(q, k, v, -1, 0, scale=0.25)
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
    assert len(tuner.cache) == 1, list(tuner.cache)
