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
(kernels/attention.py; on CPU only under ``TRITON_INTERPRET=1``) and ``torch`` (dense masked attention in
fp32, chunked over query rows, for what no kernel takes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..backend import Call, register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward

__all__ = ["attention", "attention_ref", "dropout_keep_mask", "normalize_window"]

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
    row0: int = 0,
) -> torch.Tensor:
    """The keep mask ``(B, H, Lq, Lk)`` bool of the attention dropout, a pure function of
    ``(seed, b, h, i, j)`` (rows ``row0 .. row0 + Lq - 1``)."""
    dev = torch.device(device)
    bh = torch.arange(B * H, device=dev, dtype=torch.int64)
    key = _mix32((int(seed) & _M) ^ _mix32(bh)).view(B, H, 1, 1)
    i = torch.arange(row0, row0 + Lq, device=dev, dtype=torch.int64).view(Lq, 1)
    j = torch.arange(Lk, device=dev, dtype=torch.int64).view(1, Lk)
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
    wl: int, wr: int, scale: float, row0: int, Lq_total: int,
) -> torch.Tensor:
    """fp32 scores (B, H, lq, Lk) with -inf where masked; q is a row chunk starting at ``row0``."""
    B, H, lq, _ = q.shape
    Lk = k.shape[2]
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if attn_bias is not None:
        s = s + attn_bias.float()
    ok: torch.Tensor | None = None
    if wl >= 0 or wr >= 0:
        i = torch.arange(row0, row0 + lq, device=q.device).view(-1, 1) + (Lk - Lq_total)
        j = torch.arange(Lk, device=q.device).view(1, -1)
        ok = torch.ones(lq, Lk, dtype=torch.bool, device=q.device)
        if wl >= 0:
            ok = ok & (j >= i - wl)
        if wr >= 0:
            ok = ok & (j <= i + wr)
        ok = ok.view(1, 1, lq, Lk)
    if key_padding_mask is not None:
        kp = key_padding_mask.view(B, 1, 1, Lk)
        ok = kp if ok is None else ok & kp
    if ok is not None:
        s = s.masked_fill(~ok, float("-inf"))
    return s


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
    row0: int = 0, Lq_total: int | None = None, bias_row0: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (o, lse) for the query rows ``row0 .. row0 + lq - 1`` (q holds just those rows) of a problem
    with ``Lq_total`` rows; the bias rows are taken from ``bias_row0`` (default ``row0``). Differentiable."""
    B, H, lq, _ = q.shape
    Lq_total = lq if Lq_total is None else Lq_total
    kf, vf = _expand_kv(k.float(), H), _expand_kv(v.float(), H)
    bias = None
    if attn_bias is not None:
        b4 = _bias4(attn_bias)
        br = row0 if bias_row0 is None else bias_row0
        bias = b4[:, :, br:br + lq] if b4.shape[2] != 1 else b4
    s = _dense_scores_mask(q.float(), kf, key_padding_mask, bias, wl, wr, scale, row0, Lq_total)
    p, lse = _softmax_lse(s)
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, B, H, lq, k.shape[2], dropout_p, q.device, row0=row0)
        p = p * keep / (1.0 - dropout_p)
    return torch.matmul(p, vf), lse


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: dense masked attention in fp32 (materialises ``(B, H, Lq, Lk)``), output in q's dtype.

    Same arguments and semantics as :func:`attention`; differentiable through plain autograd. With
    ``dropout_p > 0`` a ``dropout_seed`` must be given (the mask is the shared hash mask).
    """
    wl, wr = normalize_window(window, causal)
    if dropout_p > 0 and dropout_seed is None:
        fail(OP, "attention_ref with dropout_p > 0 needs an explicit dropout_seed")
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, lse = _dense_forward(q, k, v, key_padding_mask, attn_bias, wl, wr, float(dropout_p),
                            int(dropout_seed or 0), sc)
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


# -- validation ------------------------------------------------------------------------------------------
def _validate(q, k, v, key_padding_mask, attn_bias, dropout_p, scale) -> None:
    check_tensor(OP, "q", q, ndim=4)
    check_tensor(OP, "k", k, ndim=4)
    check_tensor(OP, "v", v, ndim=4)
    check_same_device(OP, "q", q, k=k, v=v)
    check_same_dtype(OP, "q", q, k=k, v=v)
    B, H, Lq, D = q.shape
    if k.shape != v.shape:
        fail(OP, f"arguments 'k' and 'v' must have the same shape (B, Hk, Lk, D), got {tuple(k.shape)} "
                 f"and {tuple(v.shape)}")
    Bk, Hk, Lk, Dk = k.shape
    if Bk != B:
        fail(OP, f"argument 'k' has batch {Bk} but 'q' has batch {B} "
                 f"(q: {tuple(q.shape)}, k: {tuple(k.shape)})")
    if Dk != D:
        fail(OP, f"argument 'k' has head dim {Dk} but 'q' has head dim {D}")
    if D < 1:
        fail(OP, f"argument 'q' must have head dim >= 1, got shape {tuple(q.shape)}")
    if Hk < 1 or H % Hk != 0:
        fail(OP, f"the number of query heads H={H} must be a multiple of the key/value heads Hk={Hk} "
                 f"(q: {tuple(q.shape)}, k: {tuple(k.shape)})")
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
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        fail(OP, f"argument 'scale' must be a finite float or None, got {scale!r}")


# -- the custom ops --------------------------------------------------------------------------------------
def _call(q: torch.Tensor, k: torch.Tensor, kpm, bias, wl: int, wr: int, dropout_p: float,
          bias_grad: bool = False) -> Call:
    return call_of(
        q, head_dim=q.shape[-1], Lq=q.shape[2], Lk=k.shape[2], H=q.shape[1], Hk=k.shape[1], window=(wl, wr),
        has_mask=kpm is not None, has_bias=bias is not None, dropout=dropout_p > 0, bias_grad=bias_grad,
    )


@torch.library.custom_op("fastarch::attention_fwd", mutates_args=())
def _attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, window_left: int, window_right: int, dropout_p: float, seed: int,
    scale: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    call = _call(q, k, key_padding_mask, attn_bias, window_left, window_right, dropout_p)
    o, lse = run(OP, "forward", call, backend, q, k, v, key_padding_mask, attn_bias, window_left,
                 window_right, dropout_p, seed, scale)
    return o, lse


@_attention_fwd.register_fake
def _(q, k, v, key_padding_mask, attn_bias, window_left, window_right, dropout_p, seed, scale, backend):
    B, H, Lq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, Lq), dtype=torch.float32)


@torch.library.custom_op("fastarch::attention_bwd", mutates_args=())
def _attention_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None, attn_bias: torch.Tensor | None, window_left: int,
    window_right: int, dropout_p: float, seed: int, scale: float, need_dbias: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(q, k, key_padding_mask, attn_bias, window_left, window_right, dropout_p, need_dbias)
    dq, dk, dv, dbias = run_backward(OP, call, backend, do, q, k, v, o, lse, key_padding_mask, attn_bias,
                                     window_left, window_right, dropout_p, seed, scale, need_dbias)
    if dbias is None:
        dbias = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dbias


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, attn_bias, window_left, window_right, dropout_p, seed, scale,
      need_dbias, backend):
    B, H, Lq, _ = q.shape
    dbias_shape = (B, H, Lq, k.shape[2]) if need_dbias else (0,)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(dbias_shape, dtype=torch.float32))


_LSE_PAD = 8


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, kpm, bias, wl, wr, p, seed, scale, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, kpm, bias)
    ctx.args = (wl, wr, p, seed, scale, backend)
    ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero tensor


def _reduce_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a (B, H, Lq, Lk) gradient down to a rank-4 broadcast shape."""
    dims = [d for d in range(4) if shape[d] == 1 and g.shape[d] != 1]
    return g.sum(dim=dims, keepdim=True) if dims else g


def _backward(ctx, do, dlse):
    q, k, v, o, lse, kpm, bias = ctx.saved_tensors
    wl, wr, p, seed, scale, backend = ctx.args
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
    dq, dk, dv, dbias = _attention_bwd(do.contiguous(), q, k, v, o, lse, kpm, bias, wl, wr, p, seed, scale,
                                       need_dbias, backend)
    dq, dk, dv = dq[..., :D], dk[..., :D], dv[..., :D]
    gb = None
    if need_dbias:
        gb = _reduce_to(dbias, bias.shape).to(bias.dtype)
    return dq, dk, dv, None, gb, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled-dot-product attention with windows, padding, bias, GQA and dropout.

    Args:
        q: queries.
        k: keys; ``Hk`` divides ``H`` (grouped-query attention: query head ``h`` reads key head
            ``h // (H // Hk)``).
        v: values, shaped as ``k``.
        causal: query ``i`` sees no key after it (sets ``window``'s right side to 0).
        window: ``(left, right)`` inclusive, -1 unlimited, or one int for both; bottom-right aligned when
            ``Lq != Lk``.
        key_padding_mask: True marks a real key; False keys are never attended.
        attn_bias: additive bias on the scores, broadcastable to ``(B, H, Lq, Lk)``; differentiable.
        dropout_p: probability of dropping an attention weight (the shared hash mask of ``dropout_seed``).
        scale: score scale, ``D ** -0.5`` by default.
        return_lse: also return the log-sum-exp of each query row's scores.
        dropout_seed: seed of the dropout mask; drawn from torch's generator when None.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        ``o`` in q's dtype, or ``(o, lse)`` with ``lse`` fp32 when ``return_lse``. A query row that sees no
        key gives 0 and ``lse = -inf``. Differentiable in q, k, v and attn_bias.

    Shapes:
        q: ``(B, H, Lq, D)``; k, v: ``(B, Hk, Lk, D)``; key_padding_mask: ``(B, Lk)``;
        attn_bias: broadcastable to ``(B, H, Lq, Lk)``; o: ``(B, H, Lq, D)``; lse: ``(B, H, Lq)``.
    """
    wl, wr = normalize_window(window, causal)
    _validate(q, k, v, key_padding_mask, attn_bias, dropout_p, scale)
    dropout_p = float(dropout_p)
    if dropout_seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    else:
        if not isinstance(dropout_seed, int):
            fail(OP, f"argument 'dropout_seed' must be an int or None, got {type(dropout_seed).__name__}",
                 TypeError)
        seed = int(dropout_seed) & _M
    sc = q.shape[-1] ** -0.5 if scale is None else float(scale)
    bias4 = _bias4(attn_bias)
    B, H, Lq, _ = q.shape
    if Lq == 0 or k.shape[2] == 0 or B == 0 or H == 0:
        # Empty problems: nothing to launch; rows without keys are 0 by definition.
        o = q.new_zeros(q.shape) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        lse = q.new_full((B, H, Lq), float("-inf"), dtype=torch.float32)
        return (o, lse) if return_lse else o
    bias_grad = bias4 is not None and bias4.requires_grad and torch.is_grad_enabled()
    name = resolve(OP, lambda: _call(q, k, key_padding_mask, bias4, wl, wr, dropout_p, bias_grad), backend)
    o, lse = _attention_fwd(q, k, v, key_padding_mask, bias4, wl, wr, dropout_p, seed, sc, name)
    return (o, lse) if return_lse else o


# -- backends --------------------------------------------------------------------------------------------
def _query_chunk(B: int, H: int, Lk: int, budget: int = 1 << 26) -> int:
    # Rows per chunk so that one chunk's fp32 score matrix stays under ~256 MB.
    return max(1, budget // max(1, B * H * Lk))


class TorchAttention(TorchImplementation):
    op = OP
    supports_dropout = supports_bias_grad = True
    supports_varlen = False
    description = "dense masked attention in fp32, chunked over query rows"

    def forward(self, q, k, v, kpm, bias, wl, wr, p, seed, scale):
        B, H, Lq, _ = q.shape
        step = _query_chunk(B, H, k.shape[2])
        os, lses = [], []
        for r0 in range(0, Lq, step):
            o, lse = _dense_forward(q[:, :, r0:r0 + step], k, v, kpm, bias, wl, wr, p, seed, scale,
                                    row0=r0, Lq_total=Lq)
            os.append(o)
            lses.append(lse)
        return torch.cat(os, 2).to(q.dtype), torch.cat(lses, 2).contiguous()

    def backward(self, do, q, k, v, o, lse, kpm, bias, wl, wr, p, seed, scale, need_dbias):
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
            s = _dense_scores_mask(qc, kx, kpm, bc, wl, wr, scale, r0, Lq)
            pr, _ = _softmax_lse(s)
            dpd = torch.matmul(doc, vx.transpose(-2, -1))
            if p > 0:
                keep = dropout_keep_mask(seed, B, H, lq, Lk, p, q.device, row0=r0).float() / (1.0 - p)
                dvx += torch.matmul((pr * keep).transpose(-2, -1), doc)
                dp = dpd * keep
            else:
                dvx += torch.matmul(pr.transpose(-2, -1), doc)
                dp = dpd
            # Di = rowsum(dO * O), as every backend computes it (the lse gradient relies on this).
            di = (doc * o[:, :, r0:r0 + lq].float()).sum(-1, keepdim=True)
            ds = pr * (dp - di)
            dq_parts.append(torch.matmul(ds, kx) * scale)
            dkx += torch.matmul(ds.transpose(-2, -1), qc) * scale
            if need_dbias:
                dbias_parts.append(ds)
        dk, dv = _sum_groups(dkx, Hk), _sum_groups(dvx, Hk)
        dbias = torch.cat(dbias_parts, 2) if need_dbias else None
        return torch.cat(dq_parts, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


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
        return reasons

    def forward(self, q, k, v, kpm, bias, wl, wr, p, seed, scale):
        causal = wr == 0
        if q.device.type == "cpu":
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            # the kernel's outputs are (B, L, H, .) in memory; the op returns dense (B, H, L, .) tensors
            return o.contiguous(), lse.float().contiguous()
        o, lse = self._efficient(q, k, v, causal, scale)[:2]
        return o, lse[..., :q.shape[2]].float().contiguous()

    def backward(self, do, q, k, v, o, lse, kpm, bias, wl, wr, p, seed, scale, need_dbias):
        causal = wr == 0
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


class CppAttention(CppImplementation):
    op, extension = OP, "attention"
    supports_dropout = supports_bias_grad = True
    supports_varlen = False
    description = "banded tiled online-softmax C++ kernel (AVX2/FMA micro-GEMMs), fp32 accumulation"

    def forward(self, q, k, v, kpm, bias, wl, wr, p, seed, scale):
        kpm = kpm.contiguous() if kpm is not None else None
        bias = bias.float() if bias is not None else None
        o, lse = self.lib.attention_fwd(_f32(q), _f32(k), _f32(v), kpm, bias, wl, wr, p, seed, scale)
        return o.to(q.dtype), lse

    def backward(self, do, q, k, v, o, lse, kpm, bias, wl, wr, p, seed, scale, need_dbias):
        kpm = kpm.contiguous() if kpm is not None else None
        bias = bias.float() if bias is not None else None
        res = self.lib.attention_bwd(_f32(do), _f32(q), _f32(k), _f32(v), _f32(o), lse.contiguous(), kpm, bias,
                                     wl, wr, p, seed, scale, need_dbias)
        dq, dk, dv = res[0], res[1], res[2]
        dbias = res[3] if need_dbias else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The Triton launchers take any strides as long as the last dim is unit-stride.
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttention(TritonImplementation):
    op, kernel_module = OP, "attention"
    max_head_dim = MAX_TRITON_HEAD_DIM
    supports_dropout = supports_bias_grad = True
    supports_varlen = False
    description = "Triton FlashAttention-2 style kernels (kernels/attention.py), fp32 accumulation"

    @staticmethod
    def _bias_full(bias, q, k):
        if bias is None:
            return None
        B, H, Lq, _ = q.shape
        return bias.expand(B, H, Lq, k.shape[2])

    def forward(self, q, k, v, kpm, bias, wl, wr, p, seed, scale):
        q, k, v = (_unit_last_stride(t) for t in (q, k, v))
        o, lse = self.lib.attention_fwd(
            q, k, v, window_left=wl, window_right=wr, key_padding_mask=kpm,
            attn_bias=self._bias_full(bias, q, k), dropout_p=p, seed=seed, scale=scale,
        )
        return o, lse

    def backward(self, do, q, k, v, o, lse, kpm, bias, wl, wr, p, seed, scale, need_dbias):
        do, q, k, v, o = (_unit_last_stride(t) for t in (do, q, k, v, o))
        dq, dk, dv, dbias = self.lib.attention_bwd(
            do, q, k, v, o, lse, window_left=wl, window_right=wr, key_padding_mask=kpm,
            attn_bias=self._bias_full(bias, q, k), dropout_p=p, seed=seed, scale=scale, need_dbias=need_dbias,
        )
        return dq, dk, dv, dbias


for _impl in (TorchAttention, AtenAttention, CppAttention, TritonAttention):
    register(_impl)
