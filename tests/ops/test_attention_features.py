"""fastarch.ops.attention's features on every backend: FlashAttention's seqlen/head-dim grid under its
low-precision criterion (causal, windows, MQA/GQA, softcap, ALiBi), the grouped-query backward's accuracy,
the (B, L, H, D) layout, and keys that the mask excludes never contributing whatever their values."""

from __future__ import annotations

import pytest
import torch

from fastarch.ops.attention import attention, attention_ref
from tests._backends import require_backend
from tests._tolerance import assert_fa_close
from tests.ops._attention_grid import covering_grid, dense_same_dtype

BACKENDS = ["torch", "cpp"]

@pytest.fixture(autouse=True)
def _backend_available(request):
    """A parametrised backend runs unless it is unavailable for a reason outside the code."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "backend" in callspec.params:
        require_backend("attention", callspec.params["backend"])

TOL = {"rtol": 1e-4, "atol": 5e-5}

FEATURES = [
    dict(causal=True, Hk=1),
    dict(window=(50, 20), Hk=2),
    dict(softcap=5.0, Hk=4),
    dict(causal=True, alibi=True, Hk=2),
    dict(Hk=4),
    dict(causal=True, softcap=8.0, alibi=True, Hk=1),
    dict(window=(100, 0), Hk=2),
]
GRID = covering_grid(FEATURES)


def _case_inputs(case, dtype, H=4, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, case["Lq"], case["D"], generator=g)
    k = torch.randn(B, case["Hk"], case["Lk"], case["D"], generator=g)
    v = torch.randn(B, case["Hk"], case["Lk"], case["D"], generator=g)
    kw = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0))
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.rand(H, generator=g) * 0.3
    return [t.to(dtype) for t in (q, k, v)], kw


def _check_fp16_criterion(backend, case):
    """Output and dq, dk, dv in fp16 against the fp32 reference, FlashAttention's criterion."""
    (q, k, v), kw = _case_inputs(case, torch.float16)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, backend=backend, **kw)
    r32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    o_ref = attention_ref(*r32, **kw)
    pt = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o_pt = dense_same_dtype(*pt, **kw)
    assert_fa_close(o, o_ref, o_pt, 2.0)
    g = torch.randn_like(o_ref)
    got = torch.autograd.grad(o, (q, k, v), g.half())
    ref = torch.autograd.grad(o_ref, r32, g)
    base = torch.autograd.grad(o_pt, pt, g.half())
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert_fa_close(a, r, b, 3.0, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_grid_fp16_criterion(backend, case):
    _check_fp16_criterion(backend, case)


# The grid's features at shapes the interpreter runs quickly (tails on both axes, Lq < Lk and Lq > Lk).
@pytest.mark.parametrize("case", [dict(Lq=13, Lk=21, D=40, Hk=1, causal=True),
                                  dict(Lq=21, Lk=13, D=59, Hk=2, window=(5, 2)),
                                  dict(Lq=17, Lk=17, D=32, Hk=4),
                                  dict(Lq=19, Lk=27, D=24, Hk=4, softcap=5.0),
                                  dict(Lq=23, Lk=14, D=33, Hk=2, causal=True, alibi=True),
                                  dict(Lq=18, Lk=29, D=16, Hk=1, window=(7, 3), softcap=2.0, alibi=True)], ids=str)
def test_grid_triton_interpreter(case):
    require_backend("attention", "triton")
    _check_fp16_criterion("triton", case)


def test_gqa_backward_matches_fp32_pytorch_error():
    require_backend("attention", "cpp")
    # 4 query heads on 1 key/value head, 1024 x 1024, D 256, causal: the group's dK/dV must be as accurate
    # as PyTorch's fp32 (FlashAttention's gradient criterion against an fp64 reference).
    g = torch.Generator().manual_seed(1)
    q64 = torch.randn(1, 4, 1024, 256, generator=g, dtype=torch.float64)
    k64, v64 = (torch.randn(1, 1, 1024, 256, generator=g, dtype=torch.float64) for _ in range(2))
    do64 = torch.randn(1, 4, 1024, 256, generator=g, dtype=torch.float64)

    def grads(fn, dtype):
        ins = [t.to(dtype).requires_grad_(True) for t in (q64, k64, v64)]
        return torch.autograd.grad(fn(*ins), ins, do64.to(dtype))

    ref = grads(lambda *a: dense_same_dtype(*a, causal=True), torch.float64)
    pt = grads(lambda *a: dense_same_dtype(*a, causal=True), torch.float32)
    got = grads(lambda *a: attention(*a, causal=True, backend="cpp"), torch.float32)
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, pt):
        assert_fa_close(a, r, b, 3.0, atol=0.0, what=name)


@pytest.mark.parametrize("backend", BACKENDS + ["triton"])
@pytest.mark.parametrize("feature", ["causal", "window", "padding"])
def test_nonfinite_excluded_keys_never_contribute(backend, feature):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 12, 16, generator=g)
    k = torch.randn(2, 1, 12, 16, generator=g)
    v = torch.randn(2, 1, 12, 16, generator=g)
    kw: dict = {}
    if feature == "causal":
        kw["causal"] = True
        bad = [11]  # only the last row sees key 11
    elif feature == "window":
        kw["window"] = (2, 1)
        bad = [0]  # rows 0 and 1 see key 0
    else:
        kpm = torch.ones(2, 12, dtype=torch.bool)
        kpm[:, 7] = False
        kw["key_padding_mask"] = kpm
        bad = [7]  # padded: nobody sees it
    kc, vc = k.clone(), v.clone()
    k[:, :, bad[0], 3] = float("inf")
    v[:, :, bad[0], :] = float("nan")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, backend=backend, **kw)
    r = attention_ref(q, k, v, **kw)
    clean = attention_ref(q, kc, vc, **kw)
    rows_bad = torch.isnan(r).any(-1)
    assert torch.equal(torch.isnan(o).any(-1), rows_bad)
    assert rows_bad.sum() < rows_bad.numel() // 2
    torch.testing.assert_close(o[~rows_bad], clean[~rows_bad], **TOL)
    # Gradients of the rows that do not see the bad key are finite everywhere and match the clean problem.
    loss = o.masked_fill(rows_bad[..., None], 0.0).sum()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    assert all(torch.isfinite(t).all() for t in (gq, gk, gv))
    qc = q.detach().requires_grad_(True)
    kcc, vcc = kc.requires_grad_(True), vc.requires_grad_(True)
    lc = attention_ref(qc, kcc, vcc, **kw).masked_fill(rows_bad[..., None], 0.0).sum()
    rq, rk, rv = torch.autograd.grad(lc, (qc, kcc, vcc))
    torch.testing.assert_close(gq, rq, **TOL)
    keep = torch.ones(12, dtype=torch.bool)
    keep[bad] = False
    torch.testing.assert_close(gk[:, :, keep], rk[:, :, keep], **TOL)
    torch.testing.assert_close(gv[:, :, keep], rv[:, :, keep], **TOL)


def test_nonfinite_excluded_keys_aten():
    q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    v2 = v.clone()
    v2[:, :, 8] = float("nan")
    o = attention(q, k, v2, causal=True, backend="aten")
    assert torch.isnan(o[:, :, 8]).all() and torch.isfinite(o[:, :, :8]).all()
    torch.testing.assert_close(o[:, :, :8], attention_ref(q, k, v, causal=True)[:, :, :8], **TOL)


@pytest.mark.parametrize("backend", BACKENDS + ["aten", "triton"])
def test_blhd_layout_in_place(backend):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 19, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(2, 19, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(2, 19, 2, 32, generator=g, requires_grad=True)
    o = attention(q, k, v, layout="blhd", causal=True, backend=backend)
    assert o.shape == q.shape and o.is_contiguous()
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    r = attention_ref(qt, kt, vt, causal=True).transpose(1, 2)
    torch.testing.assert_close(o, r, **TOL)
    gr = torch.randn_like(o)
    a = torch.autograd.grad(o, (q, k, v), gr)
    b = torch.autograd.grad(r, (qt, kt, vt), gr)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y.transpose(1, 2), **TOL)


def test_flash_layout_without_layout_is_refused():
    q = torch.randn(1, 300, 8, 64)
    with pytest.raises(ValueError, match="layout='blhd'"):
        attention(q, q, q)
    with pytest.raises(ValueError, match="layout"):
        attention(q, q, q, layout="bshd")


@pytest.mark.parametrize("backend", BACKENDS + ["triton"])
@pytest.mark.parametrize("kw", [dict(softcap=2.0), dict(softcap=0.5, causal=True),
                                dict(alibi=(4,), window=(9, 3)), dict(alibi=(2, 4), softcap=3.0, padded=True),
                                dict(alibi=(4,), softcap=1.0, bias=True)], ids=str)
def test_softcap_alibi_fp32(backend, kw):
    kw = dict(kw)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 37, 24, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 45, 24, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 45, 24, generator=g, requires_grad=True)
    ins = [q, k, v]
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(kw.pop("alibi"), generator=g)
    if kw.pop("padded", False):
        kw["key_padding_mask"] = torch.rand(2, 45, generator=g) > 0.3
    if kw.pop("bias", False):
        kw["attn_bias"] = torch.randn(1, 4, 37, 45, generator=g, requires_grad=True)
        ins.append(kw["attn_bias"])
    o, lse = attention(q, k, v, backend=backend, return_lse=True, **kw)
    r, lr = attention_ref(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(o, r, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    gr = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, ins, gr), torch.autograd.grad(r, ins, gr)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("softcap", [0.7, 5.0, 60.0], ids=str)
def test_softcap_cpp_both_sides_of_the_max_bound(softcap):
    """Up to softcap * log2(e) = 60 the cpp kernels subtract the cap's bound instead of each row's maximum
    (capping fused with the exp2); above it they take row maxima. Both match the oracle on scores large
    enough to be capped, for the tiled forward (causal rows whose visible lengths are no multiple of the
    vector width), its backward, and the cache kernel (decode and 3-row steps, split keys, pages)."""
    require_backend("attention", "cpp")
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 4, 70, 24, generator=g) * 6).requires_grad_()
    k = torch.randn(1, 2, 70, 24, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 70, 24, generator=g, requires_grad=True)
    o, lse = attention(q, k, v, causal=True, softcap=softcap, backend="cpp", return_lse=True)
    r, lr = attention_ref(q, k, v, causal=True, softcap=softcap, return_lse=True)
    torch.testing.assert_close(o, r, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    gr = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), gr), torch.autograd.grad(r, (q, k, v), gr)):
        torch.testing.assert_close(a, b, **TOL)
    page, Lc = 16, 1600
    for Lq in (1, 3):
        qd = torch.randn(2, Lq, 4, 24, generator=g) * 6
        pages_k, pages_v = (torch.randn(2 * Lc // page, page, 2, 24, generator=g) for _ in range(2))
        table = torch.randperm(2 * Lc // page, generator=g).view(2, -1).to(torch.int32)
        seqlens = torch.tensor([Lc - 5, 777], dtype=torch.int32)
        with torch.no_grad():
            o, lse = attention(qd, pages_k, pages_v, layout="blhd", causal=True, softcap=softcap,
                               seqlens_k=seqlens, block_table=table, backend="cpp", return_lse=True)
        for b in range(2):
            n = int(seqlens[b])
            rows = table[b].long()
            kb, vb = (t[rows].reshape(Lc, 2, 24)[:n].transpose(0, 1)[None] for t in (pages_k, pages_v))
            r, lr = attention_ref(qd[b:b + 1].transpose(1, 2), kb, vb, causal=True, softcap=softcap,
                                  return_lse=True)
            torch.testing.assert_close(o[b:b + 1], r.transpose(1, 2), **TOL)
            torch.testing.assert_close(lse[b:b + 1], lr, **TOL)


def test_bad_feature_arguments():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention(q, q, q, alibi_slopes=torch.rand(3))
    with pytest.raises(TypeError, match="alibi_slopes"):
        attention(q, q, q, alibi_slopes=torch.rand(2, dtype=torch.float64))


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("Lq", [1, 4])
@pytest.mark.parametrize("D", [32, 36, 100])
def test_decode_inference_cpp(layout, Lq, D):
    """Short inference calls on cpp take the cache kernel (keys split across tasks for one batch row): same
    results as the oracle, in the input's layout, with a window, GQA, soft-capping and ALiBi; a head dim
    that is not a multiple of 8 takes the kernel's scalar tails, one over 64 its widest P.V blocks."""
    require_backend("attention", "cpp")
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, Lq, D, generator=g)
    k = torch.randn(1, 2, 2500, D, generator=g)
    v = torch.randn(1, 2, 2500, D, generator=g)
    kw = dict(window=(1800, 0), softcap=7.0, alibi_slopes=torch.rand(4, generator=g) * 0.01, return_lse=True)
    want, want_lse = attention_ref(q, k, v, **kw)
    k[:, 1, 100] = float("nan")  # outside every row's window
    if layout == "blhd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        want = want.transpose(1, 2)
    with torch.no_grad():
        o, lse = attention(q, k, v, layout=layout, backend="cpp", **kw)
    assert o.shape == q.shape and o.is_contiguous()
    torch.testing.assert_close(o, want, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)
