"""Fused attention: full, causal, sliding-window, padded, biased and grouped-query attention in one op.

``attention(q, k, v, ...)`` computes ``softmax(q k^T * scale + bias, masked) v`` per head:

- ``q`` is ``(B, H, Lq, D)``; ``k`` and ``v`` are ``(B, Hk, Lk, D)`` with ``Hk`` dividing ``H`` (GQA/MQA:
  query head ``h`` reads key/value head ``h // (H // Hk)``);
- ``window=(left, right)`` is inclusive, FlashAttention-style: query ``i`` sees key ``j`` when
  ``i + off - left <= j <= i + off + right`` with ``off = Lk - Lq`` (bottom-right alignment, so decoding
  with a KV cache works); ``-1`` means unlimited; ``causal=True`` sets ``right = 0``;
- ``key_padding_mask`` ``(B, Lk)`` bool, True = a real token;
- ``attn_bias`` additive, broadcastable to ``(B, H, Lq, Lk)``, differentiable (its gradient is reduced to
  its own shape);
- a query row that sees no key gives 0 (and ``lse = -inf``);
- dropout on the probabilities uses a counter-based hash of ``(seed, b, h, i, j)`` (see
  :func:`dropout_keep_mask`), so every backend draws the same mask and backward reproduces it.

Backends: ``aten`` (PyTorch's fused SDPA kernels, for full and causal attention with or without GQA),
``cpp`` (banded tiled online-softmax C++ kernel, forward and backward, every feature), ``triton``
(fastarch/kernels/attention.py; on CPU only under ``TRITON_INTERPRET=1``) and ``torch`` (dense masked attention in
fp32, chunked over query rows, for what no kernel takes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backend import Call, get_implementation, register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, dispatch, in_layout_of, resolve, run, run_backward

__all__ = ["attention", "attention_probs", "attention_ref", "dropout_keep_mask", "normalize_window"]

OP = "attention"
_M = 0xFFFFFFFF
MAX_TRITON_HEAD_DIM = 256


# -- semantics shared by every backend -------------------------------------------------------------------
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values in [0, 2^32); the C++
    and Triton kernels compute the same function."""
    # int64 products may wrap; the low 32 bits kept by ``& _M`` are still exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M
    x = x ^ (x >> 16)
    return x


def dropout_keep_mask(
    seed: int, B: int, H: int, Lq: int, Lk: int, dropout_p: float, device: torch.device | str = "cpu",
    row0: int = 0, col0: int = 0,
) -> torch.Tensor:
    """The keep mask ``(B, H, Lq, Lk)`` bool of the attention dropout, a pure function of
    ``(seed, b, h, i, j)`` (rows ``row0 .. row0 + Lq - 1``, columns ``col0 .. col0 + Lk - 1``; a
    variable-length batch hashes its packed row and key indices with ``b = 0``)."""
    dev = torch.device(device)
    bh = torch.arange(B * H, device=dev, dtype=torch.int64)
    key = _mix32((int(seed) & _M) ^ _mix32(bh)).view(B, H, 1, 1)
    i = torch.arange(row0, row0 + Lq, device=dev, dtype=torch.int64).view(Lq, 1)
    j = torch.arange(col0, col0 + Lk, device=dev, dtype=torch.int64).view(1, Lk)
    ij = _mix32((i * 0x9E3779B1 + j) & _M)  # (Lq, Lk)
    r = _mix32(key ^ ij)
    return (r >> 8).to(torch.float64) * (2.0**-24) >= dropout_p


def normalize_window(window: int | Sequence[int] | None, causal: bool = False) -> tuple[int, int]:
    """``(left, right)`` with -1 = unlimited, causal folded in (``right = 0``); validates the values."""
    if window is None:
        w = (-1, -1)
    elif isinstance(window, int) and not isinstance(window, bool):
        w = (window, window)
    elif isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in window
    ):
        w = (int(window[0]), int(window[1]))
    else:
        fail(OP, f"argument 'window' must be a pair of ints (left, right), got {window!r}")
    if w[0] < -1 or w[1] < -1:
        fail(OP, f"argument 'window' values must be >= -1 (-1 = unlimited), got {w}")
    left, right = w
    if causal:
        right = 0
    return left, right


def _dense_scores_mask(
    q: torch.Tensor, k: torch.Tensor, key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None,
    wl: int, wr: int, scale: float, row0: int, Lq_total: int, softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 scores (B, H, lq, Lk) with -inf where masked (q is a row chunk starting at ``row0``), and the
    soft-capping derivative ``1 - tanh^2`` (None without softcap).

    Order, as FlashAttention: scale, soft-cap, then the additive bias and ALiBi, then the masks."""
    B, H, lq, _ = q.shape
    Lk = k.shape[2]
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    dcap = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = t * softcap
        dcap = 1.0 - t.detach() * t.detach()
    if attn_bias is not None:
        s = s + attn_bias.float()
    pos = torch.arange(row0, row0 + lq, device=q.device).view(-1, 1) + (Lk - Lq_total)
    j = torch.arange(Lk, device=q.device).view(1, -1)
    if alibi is not None:
        s = s - alibi.float().view(B, H, 1, 1) * (pos - j).abs().float().view(1, 1, lq, Lk)
    ok: torch.Tensor | None = None
    if wl >= 0 or wr >= 0:
        ok = torch.ones(lq, Lk, dtype=torch.bool, device=q.device)
        if wl >= 0:
            ok = ok & (j >= pos - wl)
        if wr >= 0:
            ok = ok & (j <= pos + wr)
        ok = ok.view(1, 1, lq, Lk)
    if key_padding_mask is not None:
        kp = key_padding_mask.view(B, 1, 1, Lk)
        ok = kp if ok is None else ok & kp
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    return s, dcap


def _softmax_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and log-sum-exp of masked scores; rows with no finite score give p = 0, lse = -inf.
    Written so that autograd through it never meets NaN."""
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    zs = torch.where(z > 0, z, torch.ones_like(z))
    p = e / zs
    # d lse / d s = p through log(z) (m is a detached shift); empty rows get -inf and no gradient.
    lse = torch.where(z > 0, m + torch.log(zs), torch.full_like(z, float("-inf"))).squeeze(-1)
    return p, lse


def _expand_kv(t: torch.Tensor, H: int) -> torch.Tensor:
    Hk = t.shape[1]
    return t if Hk == H else t.repeat_interleave(H // Hk, dim=1)


def _sum_groups(t: torch.Tensor, Hk: int) -> torch.Tensor:
    """(B, H, L, D) gradient of expanded keys or values -> (B, Hk, L, D), summing each group's heads."""
    B, H, L, D = t.shape
    return t if H == Hk else t.view(B, Hk, H // Hk, L, D).sum(2)


def _bias4(attn_bias: torch.Tensor | None) -> torch.Tensor | None:
    """View a bias of rank <= 4 as rank 4 (leading singleton dims), without expanding."""
    if attn_bias is None:
        return None
    return attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


def _dense_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, wl: int, wr: int, dropout_p: float, seed: int, scale: float,
    row0: int = 0, Lq_total: int | None = None, bias_row0: int | None = None, softcap: float = 0.0,
    alibi: torch.Tensor | None = None, drop_row0: int | None = None, drop_col0: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (o, lse) for the query rows ``row0 .. row0 + lq - 1`` (q holds just those rows) of a problem
    with ``Lq_total`` rows; the bias rows are taken from ``bias_row0`` (default ``row0``), the dropout
    mask's rows and columns from ``drop_row0`` (default ``row0``) and ``drop_col0``. Differentiable."""
    B, H, lq, _ = q.shape
    Lq_total = lq if Lq_total is None else Lq_total
    kf, vf = _expand_kv(k.float(), H), _expand_kv(v.float(), H)
    bias = None
    if attn_bias is not None:
        b4 = _bias4(attn_bias)
        br = row0 if bias_row0 is None else bias_row0
        bias = b4[:, :, br:br + lq] if b4.shape[2] != 1 else b4
    s, _ = _dense_scores_mask(q.float(), kf, key_padding_mask, bias, wl, wr, scale, row0, Lq_total, softcap,
                              alibi)
    p, lse = _softmax_lse(s)
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, B, H, lq, k.shape[2], dropout_p, q.device,
                                 row0=row0 if drop_row0 is None else drop_row0, col0=drop_col0)
        p = p * keep / (1.0 - dropout_p)
    return torch.matmul(p, vf), lse


# -- layouts, variable-length batches and paged caches ---------------------------------------------------
LAYOUTS = ("bhld", "blhd")
# A query-head count above this is taken for a sequence length: (B, L, H, D) passed as (B, H, L, D).
MAX_PLAUSIBLE_HEADS = 256


def _as_bhld(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The logical (B, H, L, D) view of a tensor in ``layout`` (a strided view, never a copy)."""
    return t if layout == "bhld" else t.transpose(1, 2)


def _segments_of(cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """(nseq, 4) int64 rows ``(q_start, q_end, k_start, k_end)`` on the CPU from cumulative lengths."""
    cq, ck = cu_q.to("cpu", torch.int64), cu_k.to("cpu", torch.int64)
    return torch.stack([cq[:-1], cq[1:], ck[:-1], ck[1:]], 1).contiguous()


def _row_bounds(Lq: int, Lk: int, wl: int, wr: int, segments: torch.Tensor | None,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row ``(lo, hi, pos, seg)`` int64 (Lq,): the visible keys ``lo..hi`` (inclusive; empty when
    ``hi < lo``), the row's bottom-right aligned key position (ALiBi's origin) and its sequence index.

    Both bounds are nondecreasing in the row, so the rows that see a key form one contiguous range."""
    if segments is None:
        pos = torch.arange(Lq, dtype=torch.int64) + (Lk - Lq)
        ks = torch.zeros(Lq, dtype=torch.int64)
        ke = torch.full((Lq,), Lk, dtype=torch.int64)
        seg = torch.zeros(Lq, dtype=torch.int64)
    else:
        # Each sequence's values are constant over its rows [q_start, q_end): added at q_start and taken off at
        # q_end, then summed along the rows. One 1-d vector per value: no per-row gathers and no 2-d scans, which
        # run as parallel regions (costly on a loaded CPU). Rows outside every sequence get zeros and see nothing
        # (lo = 0 > hi = -1).
        qs, qe, kss, kes = segments.unbind(1)
        at = torch.cat([qs, qe]).clamp(0, Lq)

        def per_row(value: torch.Tensor) -> torch.Tensor:
            steps = torch.zeros(Lq + 1, dtype=torch.int64)
            steps.index_add_(0, at, torch.cat([value, -value]))
            return steps.cumsum(0)[:Lq]

        ks, ke, seg, inside = (per_row(x) for x in (kss, kes, torch.arange(len(qs)), torch.ones_like(qs)))
        pos = (torch.arange(Lq, dtype=torch.int64) + per_row(kes - qe)) * inside  # q_end - 1 <-> k_end - 1
    lo = torch.maximum(ks, pos - wl) if wl >= 0 else ks
    hi = torch.minimum(ke - 1, pos + wr) if wr >= 0 else ke - 1
    dev = torch.device(device)
    return lo.to(dev), hi.to(dev), pos.to(dev), seg.to(dev)


def _has_exclusions(wl: int, wr: int, kpm, bias, segments) -> bool:
    return wl >= 0 or wr >= 0 or kpm is not None or bias is not None or segments is not None


def _nonfinite_key_rows(t: torch.Tensor) -> torch.Tensor:
    """(B, Hk, L) bool: the rows of t (B, Hk, L, D) holding a NaN or Inf. A row sum in memory order finds the
    candidates in one pass (NaN or Inf in a row makes its sum non-finite); candidates are checked exactly,
    since a sum of large finite values can overflow."""
    tt = t.transpose(1, 2)
    if tt.is_contiguous():  # (B, L, Hk, D) memory
        cand = (~torch.isfinite(tt.sum(-1))).transpose(1, 2)
    else:
        cand = ~torch.isfinite(t.sum(-1))
    if bool(cand.any()):
        idx = cand.nonzero(as_tuple=True)
        cand[idx] = ~torch.isfinite(t[idx]).all(-1)
    return cand


def _nonfinite_rows(k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None, H: int, wl: int, wr: int,
                    segments: torch.Tensor | None, Lq: int) -> torch.Tensor | None:
    """(B, H, Lq) bool: the query rows that see a key whose k or v row holds a NaN or Inf; None when no key
    holds one. Keys the mask, window, causality or sequence bounds exclude do not count."""
    if torch.compiler.is_compiling():
        # No data-dependent branch: always clean and mark (no row is marked when all is finite).
        bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    else:
        # The usual case first, with one reduction per tensor: a NaN or Inf anywhere makes the sum non-finite
        # (a sum that only overflows sends the call to the exact check below).
        if math.isfinite(float(k.sum(dtype=torch.float32))) and math.isfinite(float(v.sum(dtype=torch.float32))):
            return None
        bad = _nonfinite_key_rows(k) | _nonfinite_key_rows(v)
        if not bool(bad.any()):
            return None
    B, Hk, Lk = bad.shape
    if kpm is not None:
        bad = bad & kpm.view(B, 1, Lk)
    cnt = F.pad(bad.to(torch.int64).cumsum(-1), (1, 0))  # (B, Hk, Lk + 1)
    lo, hi, _, _ = _row_bounds(Lq, Lk, wl, wr, segments, k.device)
    lo_c = lo.clamp(0, Lk)
    hi_c = torch.maximum(hi + 1, lo_c).clamp(0, Lk)
    seen = (cnt[..., hi_c] - cnt[..., lo_c]) > 0  # (B, Hk, Lq)
    return _expand_kv(seen.unsqueeze(-1), H).squeeze(-1)


CACHE_KERNEL_MAX_ROWS = 16  # query rows per batch up to which a cache call takes the C++ cache kernel


def _cache_kernel_serves(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, make_call, dropout_p: float,
                         backend: str | None) -> bool:
    """Whether a call with queries q4 (B, H, Lq, D) runs its implementation's cache kernel: the selector's
    choice for the call (``make_call`` gives it as the general path makes it) declares one
    (``cache_rows``, the most query rows it serves), and the call is a short inference-only forward (no
    dropout, no gradient, not traced) on plain tensors."""
    if dropout_p > 0 or 0 in q4.shape or q4.shape[2] > CACHE_KERNEL_MAX_ROWS:
        return False
    try:
        impl, _ = dispatch(OP, make_call, backend, q4, k, v)
    except Exception:  # noqa: BLE001 - the general path reports the selection error with its own context
        return False
    return impl is not None and q4.shape[2] <= impl.cache_rows


def _cache_kernel(q4: torch.Tensor, pages_k: torch.Tensor, pages_v: torch.Tensor, block_table: torch.Tensor | None,
                  seqlens_k: torch.Tensor | None, key_leftpad: torch.Tensor | None, alibi, wl: int, wr: int, scale,
                  softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cpp cache kernel on q4 (B, H, Lq, D) and pages (num_pages, page, Hk, D) -> o (B, Lq, H, D), lse.
    Without a block table the pages are the (B, L, Hk, D) cache rows; without seqlens_k every row is full."""
    sc = q4.shape[-1] ** -0.5 if scale is None else float(scale)
    return get_implementation(OP, "cpp").cache_forward(q4, pages_k, pages_v, block_table, seqlens_k, key_leftpad,
                                                       alibi, wl, wr, sc, softcap)


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(num_pages, page, Hk, D) pages and a (B, n) block table -> the (B, n * page, Hk, D) caches."""
    B, n = block_table.shape
    page = cache.shape[1]
    return cache[block_table.long().reshape(-1)].view(B, n * page, *cache.shape[2:])


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | Sequence[int] = (-1, -1),
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    return_lse: bool = False,
    dropout_seed: int | None = None,
    layout: str = "bhld",
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: dense masked attention in fp32 (materialises ``(B, H, Lq, Lk)`` per sequence), output in
    q's dtype.

    Same arguments and semantics as :func:`attention` (variable-length batches loop over the sequences;
    paged caches are not taken); differentiable through plain autograd. With ``dropout_p > 0`` a
    ``dropout_seed`` must be given (the mask is the shared hash mask). A query row that sees a key whose k or
    v row holds a NaN or Inf gives NaN (and lse NaN); keys it does not see never matter.
    """
    wl, wr = normalize_window(window, causal)
    if dropout_p > 0 and dropout_seed is None:
        fail(OP, "attention_ref with dropout_p > 0 needs an explicit dropout_seed")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    seed = int(dropout_seed or 0)
    if cu_seqlens_q is not None:
        segs = _segments_of(cu_seqlens_q, cu_seqlens_k)
        H = q.shape[1]
        lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        os, lses = [], []
        for s_i, (qs, qe, ks, ke) in enumerate(segs.tolist()):
            if qe == qs or ke == ks:  # no rows, or rows that see no key (0, lse = -inf)
                continue
            al = None
            if alibi_slopes is not None:
                al = alibi_slopes.view(-1, H)[s_i if alibi_slopes.dim() == 2 else 0].view(1, H)
            oi, li = _ref_dense(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                                v[ks:ke].transpose(0, 1)[None], None, None, wl, wr, float(dropout_p), seed, sc,
                                softcap, al, qs, ks)
            os.append((qs, qe, oi[0].transpose(0, 1)))
            lses.append((qs, qe, li[0]))
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for qs, qe, oi in os:
            o = o.index_copy(0, torch.arange(qs, qe, device=q.device), oi)
        for qs, qe, li in lses:
            lse = lse.index_copy(1, torch.arange(qs, qe, device=q.device), li)
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o
    q4, k4, v4 = (_as_bhld(t, layout) for t in (q, k, v))
    al = None
    if alibi_slopes is not None:
        al = alibi_slopes.float().expand(q4.shape[0], q4.shape[1]) if alibi_slopes.dim() == 1 else alibi_slopes
    o, lse = _ref_dense(q4, k4, v4, key_padding_mask, attn_bias, wl, wr, float(dropout_p), seed, sc, softcap, al,
                        0, 0)
    o = _as_bhld(o.to(q.dtype), layout)
    return (o, lse) if return_lse else o


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    window: int | Sequence[int] = (-1, -1), dropout_p: float = 0.0, scale: float | None = None,
    dropout_seed: int = 0, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention probabilities ``(B, H, Lq, Lk)`` fp32 of a dense problem (q ``(B, H, Lq, D)``, k/v
    ``(B, Hk, Lk, D)``), with the entries that dropout drops negated (FlashAttention's sign encoding of its
    ``S_dmask``); masked entries are 0. Materialises the whole matrix: for inspection and tests."""
    wl, wr = normalize_window(window, causal)
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    B, H, Lq, _ = q.shape
    alibi = None
    if alibi_slopes is not None:
        alibi = alibi_slopes.float().expand(B, H) if alibi_slopes.dim() == 1 else alibi_slopes.float()
    s, _ = _dense_scores_mask(q.detach().float(), _expand_kv(k.detach().float(), H), None, None, wl, wr, sc, 0,
                              Lq, float(softcap), alibi)
    p, _ = _softmax_lse(s)
    if dropout_p > 0:
        keep = dropout_keep_mask(dropout_seed, B, H, Lq, k.shape[2], dropout_p, q.device)
        p = torch.where(keep, p, -p)
    return p


def _ref_dense(q, k, v, kpm, bias, wl, wr, p, seed, scale, softcap, alibi, drop_row0, drop_col0):
    """One dense problem of the oracle, with the NaN/Inf rule: rows that see a non-finite key or value
    row are NaN."""
    H = q.shape[1]
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, Hk, Lk)
    kc = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
    vc = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    o, lse = _dense_forward(q, kc, vc, kpm, bias, wl, wr, p, seed, scale, softcap=softcap, alibi=alibi,
                            drop_row0=drop_row0, drop_col0=drop_col0)
    if bool(bad.any()):
        s, _ = _dense_scores_mask(q.detach().float(), _expand_kv(kc.detach().float(), H), kpm,
                                  None if bias is None else _bias4(bias).detach(), wl, wr, scale, 0, q.shape[2])
        seen = ((s != float("-inf")) & _expand_kv(bad.unsqueeze(-1), H).transpose(-2, -1)).any(-1)
        o = torch.where(seen[..., None], torch.full_like(o, float("nan")), o)
        lse = torch.where(seen, torch.full_like(lse, float("nan")), lse)
    return o, lse


# -- validation ------------------------------------------------------------------------------------------
def _plainly_valid(q, k, v, key_padding_mask, attn_bias, dropout_p, scale, layout: str, guess_layout: bool) -> bool:
    """The usual call (three 4-D float tensors of one dtype and device, k and v alike, heads and head dims
    that fit, no mask or bias, no dropout, a default or finite float scale), accepted in a few attribute
    reads; anything else goes through the checks of :func:`_validate` that name what is wrong."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and key_padding_mask is None and attn_bias is None and type(dropout_p) is float and dropout_p == 0.0
            and (scale is None or (type(scale) is float and math.isfinite(scale)))):
        return False
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.dtype not in FLOAT_DTYPES:
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        return False
    hq, hk = (q.shape[1], k.shape[1]) if layout == "bhld" else (q.shape[2], k.shape[2])
    lq = q.shape[2] if layout == "bhld" else q.shape[1]
    return (q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and q.shape[3] >= 1 and hk >= 1
            and hq % hk == 0
            and not (guess_layout and layout == "bhld" and hq > MAX_PLAUSIBLE_HEADS and lq <= MAX_PLAUSIBLE_HEADS))


def _validate(q, k, v, key_padding_mask, attn_bias, dropout_p, scale, layout: str = "bhld",
              guess_layout: bool = True) -> None:
    """``guess_layout``: refuse a 'bhld' q that looks like a 'blhd' one; off for views this module made."""
    if _plainly_valid(q, k, v, key_padding_mask, attn_bias, dropout_p, scale, layout, guess_layout):
        return
    check_tensor(OP, "q", q, ndim=4)
    check_tensor(OP, "k", k, ndim=4)
    check_tensor(OP, "v", v, ndim=4)
    check_same_device(OP, "q", q, k=k, v=v)
    check_same_dtype(OP, "q", q, k=k, v=v)
    names = "(B, H, Lq, D)" if layout == "bhld" else "(B, Lq, H, D)"
    knames = "(B, Hk, Lk, D)" if layout == "bhld" else "(B, Lk, Hk, D)"
    if k.shape != v.shape:
        fail(OP, f"arguments 'k' and 'v' must have the same shape {knames}, got {tuple(k.shape)} "
                 f"and {tuple(v.shape)}")
    q, k = _as_bhld(q, layout), _as_bhld(k, layout)
    B, H, Lq, D = q.shape
    Bk, Hk, Lk, Dk = k.shape
    if Bk != B:
        fail(OP, f"argument 'k' has batch {Bk} but 'q' has batch {B} "
                 f"(q: {tuple(q.shape)}, k: {tuple(k.shape)})")
    if Dk != D:
        fail(OP, f"argument 'k' has head dim {Dk} but 'q' has head dim {D}")
    if D < 1:
        fail(OP, f"argument 'q' must have head dim >= 1, got shape {names} = {tuple(q.shape)}")
    if guess_layout and layout == "bhld" and H > MAX_PLAUSIBLE_HEADS and Lq <= MAX_PLAUSIBLE_HEADS:
        fail(OP, f"argument 'q' of shape {tuple(q.shape)} read as (B, H, Lq, D) has H={H} heads and Lq={Lq}: "
                 "this looks like a (B, L, H, D) FlashAttention-layout tensor; pass layout='blhd'")
    if Hk < 1 or H % Hk != 0:
        fail(OP, f"the number of query heads H={H} must be a multiple of the key/value heads Hk={Hk} "
                 f"(q: {names} = {tuple(_as_bhld(q, layout).shape)}, k: {knames}; check 'layout')")
    if key_padding_mask is not None:
        check_tensor(OP, "key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,), shape=(B, Lk))
        check_same_device(OP, "q", q, key_padding_mask=key_padding_mask)
    if attn_bias is not None:
        check_tensor(OP, "attn_bias", attn_bias, dtypes=FLOAT_DTYPES)
        check_same_device(OP, "q", q, attn_bias=attn_bias)
        full = (B, H, Lq, Lk)
        shp = tuple(attn_bias.shape)
        if len(shp) > 4 or any(s not in (1, f) for s, f in zip(shp[::-1], full[::-1])):
            fail(OP, f"argument 'attn_bias' must be broadcastable to (B, H, Lq, Lk) = {full}, got {shp}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        fail(OP, f"argument 'dropout_p' must be a float in [0, 1), got {dropout_p!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        fail(OP, f"argument 'scale' must be a finite float or None, got {scale!r}")


def _validate_softcap(softcap) -> float:
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not (
            math.isfinite(softcap) and softcap >= 0):
        fail(OP, f"argument 'softcap' must be a finite float >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _validate_alibi(alibi_slopes, nb: int, H: int, q: torch.Tensor, what: str) -> torch.Tensor | None:
    """ALiBi slopes (H,) or (nb, H) fp32 -> (nb, H) fp32 (an expanded view for (H,))."""
    if alibi_slopes is None:
        return None
    check_tensor(OP, "alibi_slopes", alibi_slopes, ndim=(1, 2), dtypes=(torch.float32,))
    check_same_device(OP, "q", q, alibi_slopes=alibi_slopes)
    shp = tuple(alibi_slopes.shape)
    if shp not in ((H,), (nb, H)):
        fail(OP, f"argument 'alibi_slopes' must have shape (H,) = ({H},) or ({what}, H) = ({nb}, {H}), got {shp}")
    return alibi_slopes.expand(nb, H) if alibi_slopes.dim() == 1 else alibi_slopes


def _validate_cu(name: str, cu, total: int, max_name: str, max_len) -> None:
    check_tensor(OP, name, cu, ndim=1, dtypes=(torch.int32,))
    if cu.numel() < 1:
        fail(OP, f"argument '{name}' must have B + 1 >= 1 entries, got 0")
    c = cu.to("cpu", torch.int64)
    if int(c[0]) != 0 or int(c[-1]) != total:
        fail(OP, f"argument '{name}' must start at 0 and end at the packed length {total}, got "
                 f"{int(c[0])} .. {int(c[-1])}")
    lens = c[1:] - c[:-1]
    if bool((lens < 0).any()):
        fail(OP, f"argument '{name}' must be nondecreasing, got {c.tolist()}")
    if max_len is not None:
        if not isinstance(max_len, int) or isinstance(max_len, bool):
            fail(OP, f"argument '{max_name}' must be an int, got {type(max_len).__name__}", TypeError)
        longest = int(lens.max()) if lens.numel() else 0
        if max_len < longest:
            fail(OP, f"argument '{max_name}' = {max_len} is shorter than the longest sequence in '{name}' "
                     f"({longest})")


# -- the custom ops --------------------------------------------------------------------------------------
def _call(q: torch.Tensor, k: torch.Tensor, kpm, bias, wl: int, wr: int, dropout_p: float,
          bias_grad: bool = False, softcap: float = 0.0, alibi=None, segments=None) -> Call:
    return call_of(
        q, head_dim=q.shape[-1], Lq=q.shape[2], Lk=k.shape[2], H=q.shape[1], Hk=k.shape[1], window=(wl, wr),
        has_mask=kpm is not None, has_bias=bias is not None, dropout=dropout_p > 0, bias_grad=bias_grad,
        softcap=softcap > 0, alibi=alibi is not None, varlen=segments is not None,
    )


@torch.library.custom_op("fastarch::attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, alibi_slopes: torch.Tensor | None, segments: torch.Tensor | None,
    window_left: int, window_right: int, dropout_p: float, seed: int, scale: float, softcap: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    call = _call(q, k, key_padding_mask, attn_bias, window_left, window_right, dropout_p, False, softcap,
                 alibi_slopes, segments)
    o, lse = run(OP, "forward", call, backend, q, k, v, key_padding_mask, attn_bias, alibi_slopes, segments,
                 window_left, window_right, dropout_p, seed, scale, softcap)
    # Every backend's output takes q's memory layout (a (B, L, H, D) view in, one out), as the fake declares.
    return in_layout_of(q, o), lse


@_attention_fwd.register_fake
def _(q, k, v, key_padding_mask, attn_bias, alibi_slopes, segments, window_left, window_right, dropout_p, seed,
      scale, softcap, backend):
    B, H, Lq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, Lq), dtype=torch.float32)


@torch.library.custom_op("fastarch::attention_bwd", mutates_args=())
def _attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
    segments: torch.Tensor | None, window_left: int, window_right: int, dropout_p: float, seed: int,
    scale: float, softcap: float, need_dbias: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(q, k, key_padding_mask, attn_bias, window_left, window_right, dropout_p, need_dbias, softcap,
                 alibi_slopes, segments)
    dq, dk, dv, dbias = run_backward(OP, call, backend, do, q, k, v, o, lse, key_padding_mask, attn_bias,
                            alibi_slopes, segments, window_left, window_right, dropout_p, seed, scale, softcap,
                            need_dbias)
    if dbias is None:
        dbias = q.new_empty((0,), dtype=torch.float32)
    # each gradient in its input's memory layout, as the fake declares
    return in_layout_of(q, dq), in_layout_of(k, dk), in_layout_of(v, dv), dbias


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, attn_bias, alibi_slopes, segments, window_left, window_right,
      dropout_p, seed, scale, softcap, need_dbias, backend):
    B, H, Lq, _ = q.shape
    dbias_shape = (B, H, Lq, k.shape[2]) if need_dbias else (0,)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(dbias_shape, dtype=torch.float32))


_LSE_PAD = 8


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, kpm, bias, alibi, segs)
    ctx.args = (wl, wr, p, seed, scale, softcap, backend)
    ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero tensor


def _reduce_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a (B, H, Lq, Lk) gradient down to a rank-4 broadcast shape."""
    dims = [d for d in range(4) if shape[d] == 1 and g.shape[d] != 1]
    return g.sum(dim=dims, keepdim=True) if dims else g


def _backward(ctx, do, dlse):
    q, k, v, o, lse, kpm, bias, alibi, segs = ctx.saved_tensors
    wl, wr, p, seed, scale, softcap, backend = ctx.args
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    if do is None:
        do = torch.zeros_like(o)
    D = q.shape[-1]
    if dlse is not None:  # None unless the caller's loss used the lse (grads are not materialised)
        # The lse gradient adds P * dlse to dS, i.e. it lowers Di = rowsum(dO * O) by dlse. Every backend
        # computes Di from (dO, O), so append head-dim columns: O' = [O, 1, 0..], dO' = [dO, -dlse, 0..], with
        # zero columns on q, k, v (scores and dP unchanged); the extra output columns are dropped. Eight
        # columns keep the head dim's alignment for the native kernels.
        pad = (0, _LSE_PAD)
        q, k, v = (F.pad(t, pad) for t in (q, k, v))
        o = F.pad(torch.cat([o, torch.ones_like(o[..., :1])], -1), (0, _LSE_PAD - 1))
        do = F.pad(torch.cat([do, (-dlse).unsqueeze(-1).to(do.dtype)], -1), (0, _LSE_PAD - 1))
    dq, dk, dv, dbias = _attention_bwd(do, q, k, v, o, lse, kpm, bias, alibi, segs, wl, wr, p, seed, scale,
                                       softcap, need_dbias, backend)
    dq, dk, dv = dq[..., :D], dk[..., :D], dv[..., :D]
    gb = None
    if need_dbias:
        gb = _reduce_to(dbias, bias.shape).to(bias.dtype)
    return dq, dk, dv, None, gb, None, None, None, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _seed_of(dropout_p: float, dropout_seed) -> int:
    if dropout_seed is None:
        return int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    if not isinstance(dropout_seed, int):
        fail(OP, f"argument 'dropout_seed' must be an int or None, got {type(dropout_seed).__name__}", TypeError)
    return int(dropout_seed) & _M


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | Sequence[int] = (-1, -1),
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    return_lse: bool = False,
    dropout_seed: int | None = None,
    backend: str | None = None,
    layout: str = "bhld",
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqlens_k: torch.Tensor | None = None,
    key_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled-dot-product attention with windows, padding, bias, ALiBi, soft-capping, GQA, dropout,
    variable-length batches and paged key/value caches.

    Args:
        q: queries.
        k: keys; ``Hk`` divides ``H`` (grouped-query attention: query head ``h`` reads key head
            ``h // (H // Hk)``).
        v: values, shaped as ``k``.
        causal: query ``i`` sees no key after it (sets ``window``'s right side to 0).
        window: ``(left, right)`` inclusive, -1 unlimited, or one int for both; bottom-right aligned when
            ``Lq != Lk`` (per sequence for variable-length batches and caches).
        key_padding_mask: True marks a real key; False keys are never attended.
        attn_bias: additive bias on the scores, broadcastable to ``(B, H, Lq, Lk)``; differentiable.
        dropout_p: probability of dropping an attention weight (the shared hash mask of ``dropout_seed``).
        scale: score scale, ``D ** -0.5`` by default.
        return_lse: also return the log-sum-exp of each query row's scores.
        dropout_seed: seed of the dropout mask; drawn from torch's generator when None.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).
        layout: 'bhld' for ``(B, H, L, D)`` tensors or 'blhd' for FlashAttention's ``(B, L, H, D)``; either
            is read in place through its strides and the output comes in the same layout. A 'bhld' call
            whose head count exceeds 256 while its length does not is refused as a likely 'blhd' tensor.
        softcap: when > 0, scores are soft-capped as ``softcap * tanh(s / softcap)`` (after scaling, before
            the bias and ALiBi), as in FlashAttention; differentiated through.
        alibi_slopes: fp32 ``(H,)`` or ``(B, H)`` (``(num_sequences, H)`` for variable-length batches):
            adds ``-slope * |i + Lk - Lq - j|`` to the scores (bottom-right aligned, per sequence), computed
            in the kernel; not differentiated.
        cu_seqlens_q, cu_seqlens_k: int32 ``(nseq + 1)`` cumulative lengths of a packed variable-length
            batch: q is ``(total_q, H, D)`` and k, v are ``(total_k, Hk, D)``; each sequence is its own
            problem (no key padding mask or bias). The output is ``(total_q, H, D)`` and lse ``(H, total_q)``.
        max_seqlen_q, max_seqlen_k: the longest sequences (validated when given).
        seqlens_k: int32 ``(B,)``: batch ``b`` sees the keys ``key_leftpad[b] .. seqlens_k[b] - 1`` of its
            cache row (keys past it may be uninitialised memory), bottom-right aligned on that length.
        key_leftpad: int32 ``(B,)`` first valid key of each cache row (default 0); needs ``seqlens_k``.
        block_table: int32 ``(B, n)``: k and v are pages ``(num_pages, page, Hk, D)`` (any page size) and
            row ``b`` of the cache is pages ``block_table[b]`` in order; needs ``seqlens_k`` and
            ``layout='blhd'`` for q.
        sinks: ``(H,)`` attention sinks (gpt-oss's ``s_aux``): one logit per query head that joins every
            row's softmax denominator and attends to nothing, so ``o`` becomes ``o * sigmoid(lse - sink)``
            and ``lse`` becomes ``logaddexp(lse, sink)``; differentiable, on every backend and path.

    Returns:
        ``o`` in q's dtype, or ``(o, lse)`` with ``lse`` fp32 when ``return_lse``. A query row that sees no
        key gives 0 and ``lse = -inf``. A row that sees a key whose k or v row holds a NaN or Inf gives NaN;
        keys it does not see (masked, windowed, causal, padded, past the cache length) never contribute,
        whatever their values. Differentiable in q, k, v and attn_bias (the paged path too, through the
        gather of its pages).

    Shapes:
        q: ``(B, H, Lq, D)`` ('bhld') or ``(B, Lq, H, D)`` ('blhd'); k, v: ``(B, Hk, Lk, D)`` or
        ``(B, Lk, Hk, D)``; key_padding_mask: ``(B, Lk)``; attn_bias: broadcastable to ``(B, H, Lq, Lk)``;
        o: q's shape; lse: ``(B, H, Lq)``.
    """
    if layout not in LAYOUTS:
        fail(OP, f"argument 'layout' must be one of {LAYOUTS}, got {layout!r}")
    if sinks is not None:
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        _validate_sinks(sinks, q, layout, varlen)
        o, lse = attention(q, k, v, causal=causal, window=window, key_padding_mask=key_padding_mask,
                           attn_bias=attn_bias, dropout_p=dropout_p, scale=scale, return_lse=True,
                           dropout_seed=dropout_seed, backend=backend, layout=layout, softcap=softcap,
                           alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqlens_k=seqlens_k,
                           key_leftpad=key_leftpad, block_table=block_table)
        o, lse = _with_sinks(o, lse, sinks, "varlen" if varlen else layout)
        return (o, lse) if return_lse else o
    wl, wr = normalize_window(window, causal)
    softcap = _validate_softcap(softcap)
    dropout_p = float(dropout_p) if isinstance(dropout_p, (int, float)) else dropout_p
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _varlen(q, k, v, wl, wr, dropout_p, scale, return_lse, dropout_seed, backend, softcap,
                       alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_padding_mask,
                       attn_bias, seqlens_k, block_table)
    if seqlens_k is not None or block_table is not None or key_leftpad is not None:
        return _cached(q, k, v, wl, wr, dropout_p, scale, return_lse, dropout_seed, backend, softcap,
                       alibi_slopes, seqlens_k, key_leftpad, block_table, layout, key_padding_mask, attn_bias)
    _validate(q, k, v, key_padding_mask, attn_bias, dropout_p, scale, layout)
    q4, k4, v4 = (_as_bhld(t, layout) for t in (q, k, v))
    alibi = _validate_alibi(alibi_slopes, q4.shape[0], q4.shape[1], q, "B")
    if key_padding_mask is None and attn_bias is None and k4.shape[2] > 0 and _cache_kernel_serves(
            q4, k, v, lambda: _call(q4, k4, None, None, wl, wr, dropout_p, False, softcap, alibi), dropout_p,
            backend):
        # A decode step: the cache kernel with the whole of k, v as one page per batch row.
        o, lse = _cache_kernel(q4, k4.transpose(1, 2), v4.transpose(1, 2), None, None, None, alibi, wl, wr, scale,
                               softcap)
        o = o if layout == "blhd" else o.transpose(1, 2).contiguous()
        return (o, lse) if return_lse else o
    o, lse = _run(q4, k4, v4, key_padding_mask, _bias4(attn_bias), alibi, None, wl, wr, dropout_p, scale,
                  dropout_seed, backend, softcap)
    o = _as_bhld(o, layout)
    return (o, lse) if return_lse else o


def _validate_sinks(sinks, q: torch.Tensor, layout: str, varlen: bool) -> None:
    check_tensor(OP, "sinks", sinks, ndim=1)
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        return  # the attention call itself reports a bad q
    heads = q.shape[1] if varlen or layout == "bhld" else q.shape[2]
    if sinks.shape[0] != heads:
        fail(OP, f"argument 'sinks' must have one logit per query head, shape ({heads},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        fail(OP, f"argument 'sinks' is on {sinks.device} but 'q' is on {q.device}")


def _with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, layout: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """o, lse of attention without sinks -> with them: each row's softmax gains the sink's logit in its
    denominator. lse is (B, H, Lq) ((H, total) for varlen); o is laid out as ``layout`` says."""
    s = sinks.float()
    s = s[:, None] if layout == "varlen" else s[None, :, None]
    keep = torch.sigmoid(lse - s)  # exp(lse) / (exp(lse) + exp(sink)); 0 for a row that sees no key
    if layout == "bhld":
        factor = keep[..., None]
    elif layout == "blhd":
        factor = keep.transpose(1, 2)[..., None]
    else:
        factor = keep.t()[..., None]
    return (o.float() * factor).to(o.dtype), torch.logaddexp(lse, s.expand_as(lse))


def _run(q, k, v, kpm, bias4, alibi, segments, wl, wr, dropout_p, scale, dropout_seed, backend, softcap):
    """Resolve the backend and run the custom op on logical (B, H, L, D) views; applies the rule that
    non-finite keys only matter to the rows that see them."""
    seed = _seed_of(dropout_p, dropout_seed)
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    B, H, Lq, _ = q.shape
    if Lq == 0 or k.shape[2] == 0 or B == 0 or H == 0:
        # Empty problems: nothing to launch; rows without keys are 0 by definition.
        o = torch.zeros_like(q) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        lse = q.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
        return o, lse
    seen = None
    if _has_exclusions(wl, wr, kpm, bias4, segments):
        # Excluded keys could still reach the output through 0 * NaN in P @ V (or dS @ K): clean them, and
        # mark the rows that do see a non-finite key.
        seen = _nonfinite_rows(k.detach(), v.detach(), kpm, H, wl, wr, segments, Lq)
        if seen is not None:
            k = torch.where(torch.isfinite(k), k, torch.zeros_like(k))
            v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    bias_grad = bias4 is not None and bias4.requires_grad and torch.is_grad_enabled()
    name = resolve(OP, lambda: _call(q, k, kpm, bias4, wl, wr, dropout_p, bias_grad, softcap, alibi, segments),
                   backend)
    o, lse = _attention_fwd(q, k, v, kpm, bias4, alibi, segments, wl, wr, dropout_p, seed, sc, softcap, name)
    if seen is not None:
        o = torch.where(seen[..., None], torch.full_like(o, float("nan")), o)
        lse = torch.where(seen, torch.full_like(lse, float("nan")), lse)
    return o, lse


def _varlen(q, k, v, wl, wr, dropout_p, scale, return_lse, dropout_seed, backend, softcap, alibi_slopes,
            cu_q, cu_k, max_q, max_k, kpm, bias, seqlens_k, block_table):
    if cu_q is None or cu_k is None:
        fail(OP, "variable-length attention needs both 'cu_seqlens_q' and 'cu_seqlens_k'")
    for name, t in (("key_padding_mask", kpm), ("attn_bias", bias), ("seqlens_k", seqlens_k),
                    ("block_table", block_table)):
        if t is not None:
            fail(OP, f"argument '{name}' cannot be combined with a variable-length batch (cu_seqlens_q/k)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, ndim=3)
    check_same_device(OP, "q", q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    check_same_dtype(OP, "q", q, k=k, v=v)
    if k.shape != v.shape:
        fail(OP, f"arguments 'k' and 'v' must have the same shape (total_k, Hk, D), got {tuple(k.shape)} and "
                 f"{tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        fail(OP, f"argument 'k' has head dim {k.shape[2]} but 'q' has head dim {q.shape[2]}")
    H, Hk = q.shape[1], k.shape[1]
    if Hk < 1 or H % Hk != 0:
        fail(OP, f"the number of query heads H={H} must be a multiple of the key/value heads Hk={Hk}")
    _validate_cu("cu_seqlens_q", cu_q, q.shape[0], "max_seqlen_q", max_q)
    _validate_cu("cu_seqlens_k", cu_k, k.shape[0], "max_seqlen_k", max_k)
    if cu_q.numel() != cu_k.numel():
        fail(OP, f"arguments 'cu_seqlens_q' and 'cu_seqlens_k' must have the same length (B + 1), got "
                 f"{cu_q.numel()} and {cu_k.numel()}")
    if not isinstance(dropout_p, float) or not 0.0 <= dropout_p < 1.0:
        fail(OP, f"argument 'dropout_p' must be a float in [0, 1), got {dropout_p!r}")
    segs = _segments_of(cu_q, cu_k)
    alibi = _validate_alibi(alibi_slopes, segs.shape[0], H, q, "num_sequences")
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    o, lse = _run(q4, k4, v4, None, None, alibi, segs, wl, wr, dropout_p, scale, dropout_seed, backend, softcap)
    o = o[0].transpose(0, 1)
    return (o, lse[0]) if return_lse else o


def _cached(q, k, v, wl, wr, dropout_p, scale, return_lse, dropout_seed, backend, softcap, alibi_slopes,
            seqlens_k, key_leftpad, block_table, layout, kpm, bias):
    if seqlens_k is None:
        fail(OP, "arguments 'key_leftpad' and 'block_table' need 'seqlens_k' (the cache lengths)")
    for name, t in (("key_padding_mask", kpm), ("attn_bias", bias)):
        if t is not None:
            fail(OP, f"argument '{name}' cannot be combined with 'seqlens_k' (the lengths are the mask)")
    check_tensor(OP, "q", q, ndim=4)
    q4 = _as_bhld(q, layout)
    B, H, Lq, D = q4.shape
    if block_table is not None:
        check_tensor(OP, "block_table", block_table, ndim=2, dtypes=(torch.int32,))
        check_same_device(OP, "q", q, block_table=block_table)
        for name, t in (("k", k), ("v", v)):
            check_tensor(OP, name, t, ndim=4)
        if k.shape != v.shape:
            fail(OP, f"arguments 'k' and 'v' must have the same shape (num_pages, page, Hk, D), got "
                     f"{tuple(k.shape)} and {tuple(v.shape)}")
        if block_table.shape[0] != B:
            fail(OP, f"argument 'block_table' must have B={B} rows, got shape {tuple(block_table.shape)}")
        if block_table.numel():
            lo, hi = (int(x) for x in torch.aminmax(block_table))  # one pass, one sync
            if lo < 0 or hi >= k.shape[0]:
                fail(OP, f"argument 'block_table' entries must be page indices in [0, {k.shape[0]}), got "
                         f"{lo} .. {hi}")
        # Validated against the shape of the gathered cache, which is only built if the cache kernel is not used.
        Hk, D = k.shape[2], k.shape[3]
        k4 = v4 = torch.empty((), dtype=k.dtype, device=k.device).expand(B, Hk, block_table.shape[1] * k.shape[1], D)
        _validate(q4, k4, v4, None, None, dropout_p, scale, "bhld", guess_layout=layout == "bhld")
    else:
        _validate(q4, _as_bhld(k, layout), _as_bhld(v, layout), None, None, dropout_p, scale, "bhld",
                  guess_layout=layout == "bhld")
        k4, v4 = _as_bhld(k, layout), _as_bhld(v, layout)
    Lc = k4.shape[2]
    check_tensor(OP, "seqlens_k", seqlens_k, ndim=1, dtypes=(torch.int32,), shape=(B,))
    sk = seqlens_k.to("cpu", torch.int64)
    lp = torch.zeros(B, dtype=torch.int64)
    if key_leftpad is not None:
        check_tensor(OP, "key_leftpad", key_leftpad, ndim=1, dtypes=(torch.int32,), shape=(B,))
        lp = key_leftpad.to("cpu", torch.int64)
    if bool(((lp < 0) | (lp > sk) | (sk > Lc)).any()):
        fail(OP, f"argument 'seqlens_k' must lie in [key_leftpad, cache length {Lc}] per batch, got "
                 f"seqlens_k={sk.tolist()}, key_leftpad={lp.tolist()}")
    alibi = _validate_alibi(alibi_slopes, B, H, q, "B")
    b = torch.arange(B, dtype=torch.int64)
    segs = torch.stack([b * Lq, (b + 1) * Lq, b * Lc + lp, b * Lc + sk], 1)
    packed_q = q4.new_empty(()).expand(1, H, B * Lq, D)
    packed_k = q4.new_empty(()).expand(1, k4.shape[1], B * Lc, D)
    if _cache_kernel_serves(q4, k, v, lambda: _call(packed_q, packed_k, None, None, wl, wr, dropout_p, False,
                                                    softcap, alibi, segs), dropout_p, backend):
        # Pages (or the contiguous cache as one page per batch row) are read in place.
        if block_table is None:
            pages_k, pages_v = k4.transpose(1, 2), v4.transpose(1, 2)
        else:
            pages_k, pages_v = k, v
        o, lse = _cache_kernel(q4, pages_k, pages_v, block_table, seqlens_k, key_leftpad, alibi, wl, wr, scale,
                               softcap)
        o = o if layout == "blhd" else o.transpose(1, 2)
        return (o, lse) if return_lse else o
    if block_table is not None:
        k4, v4 = (_gather_pages(t, block_table).transpose(1, 2) for t in (k, v))
    # One packed problem: rows b*Lq.., keys b*Lc.. (reshape is a view for contiguous caches).
    qf = q4.transpose(1, 2).reshape(1, B * Lq, H, D).transpose(1, 2)
    kf = k4.transpose(1, 2).reshape(1, B * Lc, -1, D).transpose(1, 2)
    vf = v4.transpose(1, 2).reshape(1, B * Lc, -1, D).transpose(1, 2)
    o, lse = _run(qf, kf, vf, None, None, alibi, segs, wl, wr, dropout_p, scale, dropout_seed, backend, softcap)
    o = o.transpose(1, 2).reshape(B, Lq, H, D)
    o = o if layout == "blhd" else o.transpose(1, 2)
    lse = lse.view(H, B, Lq).transpose(0, 1)
    return (o, lse) if return_lse else o
# -- backends --------------------------------------------------------------------------------------------
def _query_chunk(B: int, H: int, Lk: int, budget: int = 1 << 26) -> int:
    # Rows per chunk so that one chunk's fp32 score matrix stays under ~256 MB.
    return max(1, budget // max(1, B * H * Lk))


def _segment_list(segments: torch.Tensor | None, Lq: int, Lk: int) -> list[tuple[int, int, int, int, int]]:
    """``(index, q_start, q_end, k_start, k_end)`` of each sequence; one whole-problem entry when plain."""
    if segments is None:
        return [(0, 0, Lq, 0, Lk)]
    return [(i, *row) for i, row in enumerate(segments.tolist())]


def _segment_slopes(alibi: torch.Tensor | None, segments: torch.Tensor | None, index: int
                    ) -> torch.Tensor | None:
    """The ALiBi slopes of sequence ``index``: all ``(B, H)`` when plain, ``(1, H)`` of a packed batch (whose
    sequences are computed as batches of one)."""
    if alibi is None or segments is None:
        return alibi
    return alibi[index:index + 1]


class TorchAttention(TorchImplementation):
    op = OP
    supports_dropout = supports_bias_grad = supports_varlen = True
    description = "dense masked attention in fp32, chunked over query rows (and looped over sequences)"

    def forward(self, q, k, v, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap):
        B, H, Lq, _ = q.shape
        o = torch.zeros_like(q)
        lse = torch.full((B, H, Lq), float("-inf"), dtype=torch.float32, device=q.device)
        for s_i, qs, qe, ks, ke in _segment_list(segs, Lq, k.shape[2]):
            if qe == qs:
                continue
            al = _segment_slopes(alibi, segs, s_i)
            oi, li = self._forward_one(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], kpm, bias, al, wl, wr, p,
                                       seed, scale, softcap, qs, ks)
            o[:, :, qs:qe] = oi
            lse[:, :, qs:qe] = li
        return o, lse

    @staticmethod
    def _forward_one(q, k, v, kpm, bias, alibi, wl, wr, p, seed, scale, softcap, drow0, dcol0):
        B, H, Lq, _ = q.shape
        step = _query_chunk(B, H, k.shape[2])
        os, lses = [], []
        for r0 in range(0, Lq, step):
            o, lse = _dense_forward(q[:, :, r0:r0 + step], k, v, kpm, bias, wl, wr, p, seed, scale, row0=r0,
                                    Lq_total=Lq, softcap=softcap, alibi=alibi, drop_row0=drow0 + r0,
                                    drop_col0=dcol0)
            os.append(o)
            lses.append(lse)
        return torch.cat(os, 2).to(q.dtype), torch.cat(lses, 2)

    def backward(self, do, q, k, v, o, lse, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap,
                 need_dbias):
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        dbias = torch.zeros(B, H, Lq, Lk, dtype=torch.float32, device=q.device) if need_dbias else None
        for s_i, qs, qe, ks, ke in _segment_list(segs, Lq, Lk):
            if qe == qs or ke == ks:
                continue
            al = _segment_slopes(alibi, segs, s_i)
            dqi, dki, dvi, dbi = self._backward_one(
                do[:, :, qs:qe], q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], o[:, :, qs:qe], kpm, bias, al,
                wl, wr, p, seed, scale, softcap, need_dbias, qs, ks)
            dq[:, :, qs:qe] = dqi
            dk[:, :, ks:ke] += dki
            dv[:, :, ks:ke] += dvi
            if need_dbias:
                dbias[:, :, qs:qe, ks:ke] = dbi
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias

    @staticmethod
    def _backward_one(do, q, k, v, o, kpm, bias, alibi, wl, wr, p, seed, scale, softcap, need_dbias, drow0,
                      dcol0):
        # Explicit formulas (custom-op bodies run below autograd, so no autograd.grad here).
        B, H, Lq, D = q.shape
        Hk, Lk = k.shape[1], k.shape[2]
        step = _query_chunk(B, H, Lk)
        kx, vx = _expand_kv(k.float(), H), _expand_kv(v.float(), H)
        dkx = torch.zeros(B, H, Lk, D, dtype=torch.float32, device=q.device)
        dvx = torch.zeros_like(dkx)
        b4 = _bias4(bias)
        dq_parts, dbias_parts = [], []
        for r0 in range(0, Lq, step):
            qc = q[:, :, r0:r0 + step].float()
            doc = do[:, :, r0:r0 + step].float()
            lq = qc.shape[2]
            bc = None
            if b4 is not None:
                bc = b4[:, :, r0:r0 + lq] if b4.shape[2] != 1 else b4
            s, dcap = _dense_scores_mask(qc, kx, kpm, bc, wl, wr, scale, r0, Lq, softcap, alibi)
            pr, _ = _softmax_lse(s)
            dpd = torch.matmul(doc, vx.transpose(-2, -1))
            if p > 0:
                keep = dropout_keep_mask(seed, B, H, lq, Lk, p, q.device, row0=drow0 + r0,
                                         col0=dcol0).float() / (1.0 - p)
                dvx += torch.matmul((pr * keep).transpose(-2, -1), doc)
                dp = dpd * keep
            else:
                dvx += torch.matmul(pr.transpose(-2, -1), doc)
                dp = dpd
            # Di = rowsum(dO * O), as every backend computes it (the lse gradient relies on this).
            di = (doc * o[:, :, r0:r0 + lq].float()).sum(-1, keepdim=True)
            ds = pr * (dp - di)
            if need_dbias:
                dbias_parts.append(ds)
            if dcap is not None:
                ds = ds * dcap
            dq_parts.append(torch.matmul(ds, kx) * scale)
            dkx += torch.matmul(ds.transpose(-2, -1), qc) * scale
        dk, dv = _sum_groups(dkx, Hk), _sum_groups(dvx, Hk)
        dbias = torch.cat(dbias_parts, 2) if need_dbias else None
        return torch.cat(dq_parts, 2), dk, dv, dbias


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


class AtenAttention(AtenImplementation):
    op = OP
    supports_dropout = supports_bias_grad = supports_varlen = False
    description = ("PyTorch's fused SDPA kernels (flash on CPU, memory-efficient on CUDA) for full and causal "
                   "attention, GQA included")

    def check(self, call):
        reasons = []
        wl, wr = call.get("window", (-1, -1))
        if wl != -1 or wr not in (-1, 0):
            reasons.append("sliding window (the native kernels would need a dense (Lq, Lk) mask)")
        elif wr == 0 and call.get("Lq") != call.get("Lk"):
            reasons.append("causal with Lq != Lk (the native kernels align causal masks top-left)")
        if call.get("has_mask"):
            reasons.append("key padding mask (the native kernels would need a dense (Lq, Lk) mask)")
        if call.get("has_bias"):
            reasons.append("additive bias")
        align = 4 if call.dtype == torch.float32 else 8  # 16 bytes
        if call.device.type == "cuda" and call.get("head_dim", 0) % align:
            reasons.append(f"head dim {call['head_dim']} not a multiple of {align} (the memory-efficient "
                           "kernel's alignment)")
        if call.get("softcap"):
            reasons.append("softcap (not in the native kernels)")
        if call.get("alibi"):
            reasons.append("ALiBi (the native kernels would need a dense (Lq, Lk) bias)")
        return reasons

    def forward(self, q, k, v, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap):
        causal = wr == 0
        q, k, v = (_unit_last_stride(t) for t in (q, k, v))  # the native kernels read rows with unit stride
        if q.device.type == "cpu":
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            # the kernel's outputs are (B, L, H, .) in memory; the op returns dense (B, H, L, .) tensors
            return o.contiguous(), lse.float().contiguous()
        o, lse = self._efficient(q, k, v, causal, scale)[:2]
        return o, lse[..., :q.shape[2]].float().contiguous()

    def backward(self, do, q, k, v, o, lse, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap,
                 need_dbias):
        causal = wr == 0
        do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                do, q, k, v, o, lse, 0.0, causal, scale=scale)
            return dq, dk, dv, None
        # The memory-efficient kernel wants its own (padded) lse and RNG state: recompute them.
        Hk = k.shape[1]
        ke, ve = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
        _, lse_n, rng_seed, rng_offset = self._efficient(q, ke, ve, causal, scale)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, ke, ve, None, o, lse_n, rng_seed, rng_offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, _sum_groups(dk, Hk), _sum_groups(dv, Hk), None

    @staticmethod
    def _efficient(q, k, v, causal, scale):
        H = q.shape[1]
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, H), _expand_kv(v, H), None, True, 0.0, causal, scale=scale)


def _rows32(t: torch.Tensor) -> torch.Tensor:
    """fp32 with unit-stride rows: the C++ kernel reads any (B, H, L, D) strides, so a (B, L, H, D) tensor
    is passed as it is."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous int32 (a no-op, without a dispatcher call, for the usual int32 index tensors)."""
    if t is None or (t.dtype == torch.int32 and t.is_contiguous()):
        return t
    return t.to(torch.int32).contiguous()


def _packed_rows(segs: torch.Tensor | None, Lq: int, Lk: int, wl: int, wr: int) -> torch.Tensor | None:
    """(4, Lq) int64 (lo, hi, pos, seq) per query row of a packed batch, for the C++ kernel (None if plain).
    An empty row's hi is lo - 1, which keeps both bounds nondecreasing across sequences."""
    if segs is None:
        return None
    lo, hi, pos, seg = _row_bounds(Lq, Lk, wl, wr, segs)
    return torch.stack([lo, torch.maximum(hi, lo - 1), pos, seg]).contiguous()


class CppAttention(CppImplementation):
    op, extension = OP, "attention"
    supports_dropout = supports_bias_grad = supports_varlen = True
    cache_rows = CACHE_KERNEL_MAX_ROWS
    description = ("banded tiled online-softmax C++ kernel (AVX2/FMA micro-GEMMs), fp32 accumulation; reads "
                   "any layout through strides and packed variable-length batches natively")

    def forward(self, q, k, v, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap):
        kpm = kpm.contiguous() if kpm is not None else None
        bias = bias.float() if bias is not None else None
        alibi = _f32(alibi) if alibi is not None else None
        rows = _packed_rows(segs, q.shape[2], k.shape[2], wl, wr)
        o, lse = self.lib.attention_fwd(_rows32(q), _rows32(k), _rows32(v), kpm, bias, alibi, rows, wl, wr, p,
                                        seed, scale, softcap)
        return o.to(q.dtype), lse

    def backward(self, do, q, k, v, o, lse, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap,
                 need_dbias):
        kpm = kpm.contiguous() if kpm is not None else None
        bias = bias.float() if bias is not None else None
        alibi = _f32(alibi) if alibi is not None else None
        rows = _packed_rows(segs, q.shape[2], k.shape[2], wl, wr)
        res = self.lib.attention_bwd(_f32(do), _rows32(q), _rows32(k), _rows32(v), o.float(), lse.contiguous(),
                                     kpm, bias, alibi, rows, wl, wr, p, seed, scale, softcap, need_dbias)
        dq, dk, dv = res[0], res[1], res[2]
        dbias = res[3] if need_dbias else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias

    def cache_forward(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      block_table: torch.Tensor | None, seqlens_k: torch.Tensor | None,
                      key_leftpad: torch.Tensor | None, alibi: torch.Tensor | None, wl: int, wr: int, scale: float,
                      softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward over a KV cache read in place through its block table: q ``(B, H, Lq, D)``, pages
        ``(num_pages, page, Hk, D)`` (any strides with unit-stride rows), block_table int32 ``(B, n)`` (None:
        the pages are the ``(B, L, Hk, D)`` cache rows), seqlens_k / key_leftpad int32 ``(B,)`` (None: full
        rows, no left padding), alibi ``(B, H)`` fp32 or None -> o ``(B, Lq, H, D)`` in q's dtype and lse
        ``(B, H, Lq)`` fp32."""
        o, lse = self.lib.attention_cache_fwd(
            _rows32(q), _rows32(k_pages), _rows32(v_pages), _int32(block_table), _int32(seqlens_k),
            _int32(key_leftpad), _f32(alibi) if alibi is not None else None, wl, wr, scale, softcap)
        return (o if o.dtype == q.dtype else o.to(q.dtype)), lse


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The Triton launchers and the native kernels take any strides as long as rows are unit-stride.
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttention(TritonImplementation):
    op, kernel_module = OP, "attention"
    max_head_dim = MAX_TRITON_HEAD_DIM
    supports_dropout = supports_bias_grad = supports_varlen = True
    description = ("Triton FlashAttention-2 style kernels (fastarch/kernels/attention.py), fp32 accumulation; "
                   "variable-length batches launch per sequence on strided views (dropout hashes the packed "
                   "row and key indices, as the other backends do)")

    @staticmethod
    def _bias_full(bias, q, k):
        if bias is None:
            return None
        B, H, Lq, _ = q.shape
        return bias.expand(B, H, Lq, k.shape[2])

    def forward(self, q, k, v, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap):
        q, k, v = (_unit_last_stride(t) for t in (q, k, v))
        if segs is None:
            o, lse = self.lib.attention_fwd(
                q, k, v, window_left=wl, window_right=wr, key_padding_mask=kpm,
                attn_bias=self._bias_full(bias, q, k), dropout_p=p, seed=seed, scale=scale, softcap=softcap,
                alibi_slopes=alibi,
            )
            return o, lse
        B, H, Lq, _ = q.shape
        o = torch.zeros_like(q)
        lse = torch.full((B, H, Lq), float("-inf"), dtype=torch.float32, device=q.device)
        for s_i, qs, qe, ks, ke in _segment_list(segs, Lq, k.shape[2]):
            if qe == qs:
                continue
            oi, li = self.lib.attention_fwd(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], window_left=wl,
                                            window_right=wr, key_padding_mask=None, attn_bias=None,
                                            dropout_p=p, seed=seed, scale=scale, softcap=softcap,
                                            alibi_slopes=_segment_slopes(alibi, segs, s_i), drop_row0=qs,
                                            drop_col0=ks)
            o[:, :, qs:qe] = oi
            lse[:, :, qs:qe] = li
        return o, lse

    def backward(self, do, q, k, v, o, lse, kpm, bias, alibi, segs, wl, wr, p, seed, scale, softcap,
                 need_dbias):
        do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
        if segs is None:
            return self.lib.attention_bwd(
                do, q, k, v, o, lse, window_left=wl, window_right=wr, key_padding_mask=kpm,
                attn_bias=self._bias_full(bias, q, k), dropout_p=p, seed=seed, scale=scale,
                need_dbias=need_dbias, softcap=softcap, alibi_slopes=alibi,
            )
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s_i, qs, qe, ks, ke in _segment_list(segs, q.shape[2], k.shape[2]):
            if qe == qs or ke == ks:
                continue
            dqi, dki, dvi, _ = self.lib.attention_bwd(
                do[:, :, qs:qe], q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], o[:, :, qs:qe],
                lse[:, :, qs:qe].contiguous(), window_left=wl, window_right=wr, key_padding_mask=None,
                attn_bias=None, dropout_p=p, seed=seed, scale=scale, need_dbias=False, softcap=softcap,
                alibi_slopes=_segment_slopes(alibi, segs, s_i), drop_row0=qs, drop_col0=ks)
            dq[:, :, qs:qe] = dqi
            dk[:, :, ks:ke] += dki
            dv[:, :, ks:ke] += dvi
        return dq, dk, dv, None


for _impl in (TorchAttention, AtenAttention, CppAttention, TritonAttention):
    register(_impl)
