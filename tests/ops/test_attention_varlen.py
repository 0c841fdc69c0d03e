"""Variable-length (packed) batches and per-batch / paged key-value caches of fastarch.ops.attention,
against the per-sequence dense reference, on every backend (Triton under the interpreter, small)."""

from __future__ import annotations

import pytest
import torch

from fastarch.ops.attention import attention, attention_ref
from tests._backends import require_backend
from tests._tolerance import assert_fa_close
from tests.ops._attention_grid import dense_same_dtype

TOL = {"rtol": 1e-4, "atol": 5e-5}
BACKENDS = ["torch", "cpp", "triton"]

@pytest.fixture(autouse=True)
def _backend_available(request):
    """A parametrised backend runs unless it is unavailable for a reason outside the code."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "backend" in callspec.params:
        require_backend("attention", callspec.params["backend"])



def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _random_lengths(n: int, longest: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, longest + 1, (n,), generator=g).tolist()
    lens[1] = 1
    lens[-2] = 0  # an empty sequence
    return lens


CASES = [
    dict(causal=True),
    dict(window=(6, 2), Hk=1),
    dict(causal=True, softcap=4.0, alibi=True, Hk=2),
    dict(cross=True, causal=True, Hk=1),
    dict(cross=True, window=(3, 0), alibi=True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_varlen_matches_per_sequence(backend, case):
    case = dict(case)
    small = backend == "triton"
    n, longest = (4, 19) if small else (7, 90)
    lq = _random_lengths(n, longest, 1)
    lk = _random_lengths(n, longest, 2) if case.pop("cross", False) else lq
    H, Hk, D = 4, case.pop("Hk", 4), 16 if small else 40
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), H, D, generator=g, requires_grad=True)
    k = torch.randn(sum(lk), Hk, D, generator=g, requires_grad=True)
    v = torch.randn(sum(lk), Hk, D, generator=g, requires_grad=True)
    if case.pop("alibi", False):
        case["alibi_slopes"] = torch.rand(n, H, generator=g)
    cq, ck = _cu(lq), _cu(lk)
    o, lse = attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                       return_lse=True, backend=backend, **case)
    assert o.shape == q.shape and lse.shape == (H, sum(lq))
    r, lr = attention_ref(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, **case)
    torch.testing.assert_close(o, r, **TOL)
    torch.testing.assert_close(lse, lr, **TOL)
    # each sequence alone, as a plain (1, L, H, D) call
    for b in range(n):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if qe > qs and ke > ks:
            kw = dict(case)
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = kw["alibi_slopes"][b]
            one = attention_ref(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], layout="blhd", **kw)[0]
            torch.testing.assert_close(o[qs:qe], one, **TOL)
    gr = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, (q, k, v), gr), torch.autograd.grad(r, (q, k, v), gr)):
        torch.testing.assert_close(a, b, **TOL)


def test_varlen_fp16_criterion_cpp():
    require_backend("attention", "cpp")
    lens = _random_lengths(6, 300, 4)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(sum(lens), 4 if i == 0 else 2, 64, generator=g).half().requires_grad_(True)
               for i in range(3))
    cu = _cu(lens)
    o = attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend="cpp")
    r32 = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = attention_ref(*r32, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    gr = torch.randn_like(ref)
    got = torch.autograd.grad(o, (q, k, v), gr.half())
    want = torch.autograd.grad(ref, r32, gr)
    pts, base = [], [torch.zeros_like(t) for t in (q, k, v)]
    out_pt = torch.zeros_like(q)
    for b in range(len(lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        if e == s:
            continue
        ins = [t.detach()[s:e].transpose(0, 1)[None].clone().requires_grad_(True) for t in (q, k, v)]
        ob = dense_same_dtype(*ins, causal=True)
        gb = torch.autograd.grad(ob, ins, gr[s:e].transpose(0, 1)[None].half())
        out_pt[s:e] = ob[0].transpose(0, 1).detach()
        for acc, gt in zip(base, gb):
            acc[s:e] = gt[0].transpose(0, 1)
        pts.append(ob)
    assert_fa_close(o, ref, out_pt, 2.0)
    for name, a, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert_fa_close(a, w, b, 3.0, what=name)


DROPOUT_CASES = [
    dict(causal=True),
    dict(),
    dict(window=(4, 1), Hk=2),
    dict(cross=True, causal=True, Hk=1),
]


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=str)
def test_varlen_dropout_same_mask_as_torch(backend, case):
    """The keep mask of a packed element is the hash of its packed row and key indices on every backend, so
    outputs and gradients match the torch backend's for the same seed (empty and length-1 sequences
    included)."""
    case = dict(case)
    lq = _random_lengths(4, 19, 5)
    lk = _random_lengths(4, 19, 6) if case.pop("cross", False) else lq
    H, Hk, D = 4, case.pop("Hk", 4), 16
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lq), H, D, generator=g)
    k = torch.randn(sum(lk), Hk, D, generator=g)
    v = torch.randn(sum(lk), Hk, D, generator=g)
    do = torch.randn(sum(lq), H, D, generator=g)
    kw = dict(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), dropout_p=0.3, dropout_seed=11, **case)

    def run(name):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = attention(*ins, backend=name, **kw)
        return (o.detach(), *torch.autograd.grad(o, ins, do))

    got, want = run(backend), run("torch")
    no_drop = attention(q, k, v, backend="torch", **{**kw, "dropout_p": 0.0})
    assert not torch.allclose(want[0], no_drop, **TOL)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_varlen_bad_arguments():
    q = torch.randn(10, 2, 8)
    good = _cu([4, 6])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attention(q, q, q, cu_seqlens_q=_cu([4, 5]), cu_seqlens_k=good)
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        attention(q, q, q, cu_seqlens_q=good, cu_seqlens_k=good.long())
    with pytest.raises(ValueError, match="max_seqlen_q"):
        attention(q, q, q, cu_seqlens_q=good, cu_seqlens_k=good, max_seqlen_q=5)
    with pytest.raises(ValueError, match="both"):
        attention(q, q, q, cu_seqlens_q=good)
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, q, q, cu_seqlens_q=good, cu_seqlens_k=good, key_padding_mask=torch.ones(2, 10, dtype=bool))


def _poison(t: torch.Tensor, lengths: torch.Tensor) -> None:
    # Cache slots past each batch's length: uninitialised memory, NaN, Inf, huge values.
    for b, n in enumerate(lengths.tolist()):
        t[b, n:] = float("nan")
        if n + 1 < t.shape[1]:
            t[b, n + 1] = float("inf")
            t[b, n + 1:n + 2, :, 0] = 3e38


def _paged(k: torch.Tensor, v: torch.Tensor, page: int, spare: int, g: torch.Generator):
    """Caches (B, cap, Hk, D) -> NaN-filled pages (B * n + spare, page, Hk, D) in random order and the int32
    block table (B, n)."""
    B, cap, Hk, D = k.shape
    n = (cap + page - 1) // page
    kp = torch.full((B * n + spare, page, Hk, D), float("nan"))
    vp = torch.full((B * n + spare, page, Hk, D), float("nan"))
    perm = torch.randperm(B * n + spare, generator=g)[:B * n].view(B, n)
    for b in range(B):
        for i in range(n):
            rows = slice(i * page, min(cap, (i + 1) * page))
            kp[perm[b, i], :rows.stop - rows.start] = k[b, rows]
            vp[perm[b, i], :rows.stop - rows.start] = v[b, rows]
    return kp, vp, perm.to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [None, 16, 5])
def test_cache_lengths_and_pages(backend, page):
    g = torch.Generator().manual_seed(2)
    B, Lq, H, Hk, D, cap = 3, 2, 4, 2, 16, 40
    seqlens = torch.tensor([17, 2, 40], dtype=torch.int32)
    leftpad = torch.tensor([3, 0, 0], dtype=torch.int32) if page is None else None
    q = torch.randn(B, Lq, H, D, generator=g)
    k = torch.randn(B, cap, Hk, D, generator=g)
    v = torch.randn(B, cap, Hk, D, generator=g)
    slopes = torch.rand(H, generator=g)
    want = []
    for b in range(B):
        lo, hi = (int(leftpad[b]) if leftpad is not None else 0), int(seqlens[b])
        want.append(attention_ref(q[b:b + 1], k[b:b + 1, lo:hi], v[b:b + 1, lo:hi], layout="blhd", causal=True,
                                  alibi_slopes=slopes))
    want = torch.cat(want)
    _poison(k, seqlens)
    _poison(v, seqlens)
    kw = dict(causal=True, layout="blhd", seqlens_k=seqlens, key_leftpad=leftpad, alibi_slopes=slopes,
              backend=backend)
    if page is None:
        o = attention(q, k, v, **kw)
    else:
        kp, vp, table = _paged(k, v, page, 3, g)
        o = attention(q, kp, vp, block_table=table, **kw)
    torch.testing.assert_close(o, want, **TOL)


def test_cache_bad_arguments():
    q = torch.randn(2, 1, 2, 8)
    k = torch.randn(2, 10, 2, 8)
    with pytest.raises(ValueError, match="seqlens_k"):
        attention(q, k, k, layout="blhd", seqlens_k=torch.tensor([3, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table"):
        attention(q, k, k, layout="blhd", seqlens_k=torch.tensor([3, 4], dtype=torch.int32),
                  block_table=torch.tensor([[0], [2]], dtype=torch.int32))


@pytest.mark.parametrize("page", [None, 16, 7])
@pytest.mark.parametrize("Lq", [1, 3])
def test_cache_kernel_splits_and_nonfinite(page, Lq):
    """Inference calls on a cache take the cpp cache kernel: keys split across tasks (one kv head, a long
    cache), grouped query heads, a window, soft-capping, left padding, pages of any size read in place, the
    (B, H, L, D) layout, and a NaN value row that only the last query row of batch 0 sees."""
    require_backend("attention", "cpp")
    g = torch.Generator().manual_seed(4)
    B, H, Hk, D, cap = 2, 4, 1, 24, 3000
    seqlens = torch.tensor([2999, 1500], dtype=torch.int32)
    leftpad = torch.tensor([5, 0], dtype=torch.int32)
    q = torch.randn(B, Lq, H, D, generator=g)
    k = torch.randn(B, cap, Hk, D, generator=g)
    v = torch.randn(B, cap, Hk, D, generator=g)
    kw = dict(window=(2000, 0), softcap=6.0)
    want, want_lse = [], []
    for b in range(B):
        lo, hi = int(leftpad[b]), int(seqlens[b])
        o, lse = attention_ref(q[b:b + 1], k[b:b + 1, lo:hi], v[b:b + 1, lo:hi], layout="blhd", return_lse=True,
                               **kw)
        want.append(o)
        want_lse.append(lse)
    want, want_lse = torch.cat(want), torch.cat(want_lse)
    k[0, :5], v[0, 2999:] = float("inf"), float("nan")  # left padding and past the length: never seen
    v[0, 2998, 0, 3] = float("nan")  # seen by the last query row of batch 0 only
    want[0, -1], want_lse[0, :, -1] = float("nan"), float("nan")
    cache = dict(seqlens_k=seqlens, key_leftpad=leftpad, return_lse=True, backend="cpp", **kw)
    if page is None:
        o, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **cache)
        o = o.transpose(1, 2)
    else:
        kp, vp, table = _paged(k, v, page, 2, g)
        o, lse = attention(q, kp, vp, layout="blhd", block_table=table, **cache)
    torch.testing.assert_close(o, want, equal_nan=True, **TOL)
    torch.testing.assert_close(lse, want_lse, equal_nan=True, **TOL)
