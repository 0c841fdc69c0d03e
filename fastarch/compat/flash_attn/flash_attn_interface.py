"""flash-attn 2's ``flash_attn_interface`` on :func:`fastarch.ops.attention`.

Every function keeps flash-attn's signature, defaults and positional order:

- ``flash_attn_func(q, k, v, ...)``: q ``(B, Lq, H, D)``, k/v ``(B, Lk, Hk, D)`` -> out ``(B, Lq, H, D)``;
- ``flash_attn_qkvpacked_func(qkv, ...)``: qkv ``(B, L, 3, H, D)``;
- ``flash_attn_kvpacked_func(q, kv, ...)``: kv ``(B, Lk, 2, Hk, D)``;
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: packed
  q ``(total_q, H, D)``, k/v ``(total_k, Hk, D)``; ``block_table`` reads k/v from pages
  ``(num_pages, page, Hk, D)`` of any page size;
- ``flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)``: qkv ``(total, 3, H, D)``;
- ``flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``:
  kv ``(total_k, 2, Hk, D)``;
- ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ...)``: appends k/v into the cache in place
  and attends over it (inference: no gradient).

With ``return_attn_probs=True`` the training functions return ``(out, softmax_lse, S_dmask)``:
``softmax_lse`` is ``(B, H, Lq)`` fp32 (``(H, total_q)`` for varlen) and ``S_dmask`` is the attention
probability matrix ``(B, H, Lq, Lk)`` fp32 (``(num_sequences, H, max_seqlen_q, max_seqlen_k)`` for varlen,
zero-padded) computed densely, with the entries dropout dropped negated (flash-attn's sign encoding) and
masked entries 0. flash-attn returns it for testing only; here it is the exact matrix on every device
(including the CPU), at the cost of materialising it. ``deterministic`` is accepted: every fastarch
backward is deterministic.
"""

from __future__ import annotations

import math

import torch

from ...ops._checks import FLOAT_DTYPES, check_writable
from ...ops.attention import attention, attention_probs, dropout_keep_mask
from ...ops.rotary import rotary_embedding

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

NAME = "flash_attn"


def _fail(msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"{NAME}: {msg}")


def _window(window_size) -> tuple[int, int]:
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        _fail(f"argument 'window_size' must be a pair of ints (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _finite_real(name: str, value: object, *, minimum: float | None = None) -> float:
    """A finite int or float (a bool is refused: ``True`` is not a scale), at least ``minimum``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        _fail(f"argument '{name}' must be a finite float{bound}, got {value!r}")
    return float(value)


def _seed(dropout_p: float) -> int:
    # Drawn from torch's generator, as flash-attn draws its dropout from the CUDA generator.
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    """(B, L, H, D) tensors."""
    seed = _seed(dropout_p)
    out, lse = attention(q, k, v, layout="blhd", causal=causal, window=_window(window_size), dropout_p=dropout_p,
                         scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, dropout_seed=seed,
                         return_lse=True)
    if not return_attn_probs:
        return out
    s_dmask = attention_probs(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                              window=_window(window_size), dropout_p=dropout_p, scale=softmax_scale,
                              dropout_seed=seed, softcap=softcap, alibi_slopes=alibi_slopes)
    return out, lse, s_dmask


def _gather_varlen_pages(cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Paged k or v ``(num_pages, page, Hk, D)`` -> packed ``(total_k, Hk, D)`` along ``cu_seqlens_k``."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail(f"argument 'block_table' must be an int32 (B, max_pages) tensor, got {block_table.dtype} "
              f"{tuple(block_table.shape)}")
    cu = cu_seqlens_k.to("cpu", torch.int64).tolist()
    if block_table.shape[0] != len(cu) - 1:
        _fail(f"argument 'block_table' must have one row per sequence ({len(cu) - 1}), got "
              f"{block_table.shape[0]}")
    page = cache.shape[1]
    parts = []
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        pages = (n + page - 1) // page
        if pages > block_table.shape[1]:
            _fail(f"sequence {b} has {n} keys, more than block_table's {block_table.shape[1]} pages of {page}")
        idx = block_table[b, :pages].long()
        if pages and (int(idx.min()) < 0 or int(idx.max()) >= cache.shape[0]):
            _fail(f"argument 'block_table' row {b} holds page indices outside [0, {cache.shape[0]})")
        parts.append(cache[idx].reshape(pages * page, *cache.shape[2:])[:n])
    return torch.cat(parts, 0) if parts else cache.new_empty((0, *cache.shape[2:]))


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    if block_table is not None:
        k = _gather_varlen_pages(k, block_table, cu_seqlens_k)
        v = _gather_varlen_pages(v, block_table, cu_seqlens_k)
    seed = _seed(dropout_p)
    out, lse = attention(q, k, v, causal=causal, window=_window(window_size), dropout_p=dropout_p,
                         scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, dropout_seed=seed,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, return_lse=True)
    if not return_attn_probs:
        return out
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    H = q.shape[1]
    s_dmask = torch.zeros(len(cq) - 1, H, max_seqlen_q, max_seqlen_k, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs or ke == ks:
            continue
        sl = None
        if alibi_slopes is not None:
            sl = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        s_dmask[b, :, :qe - qs, :ke - ks] = _sequence_probs(q[qs:qe], k[ks:ke], v[ks:ke], qs, ks, dropout_p,
                                                            softmax_scale, causal, window_size, softcap, sl, seed)
    return out, lse, s_dmask


def _sequence_probs(q, k, v, qs, ks, dropout_p, softmax_scale, causal, window_size, softcap, slopes, seed):
    """One varlen sequence's probabilities, with the dropout mask of its packed rows/columns."""
    p = attention_probs(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2), causal=causal,
                        window=_window(window_size), scale=softmax_scale, softcap=softcap,
                        alibi_slopes=None if slopes is None else slopes.view(1, -1))[0]
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, 1, q.shape[1], q.shape[0], k.shape[0], dropout_p, q.device, row0=qs,
                                 col0=ks)[0]
        p = torch.where(keep, p, -p)
    return p


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv ``(B, L, 3, H, D)`` -> out ``(B, L, H, D)`` (or ``(out, softmax_lse, S_dmask)``)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        _fail(f"argument 'qkv' must be a (batch, seqlen, 3, nheads, headdim) tensor, got "
              f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    q, k, v = qkv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(B, Lq, H, D)``, kv ``(B, Lk, 2, Hk, D)`` -> out ``(B, Lq, H, D)``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        _fail(f"argument 'kv' must be a (batch, seqlen_k, 2, nheads_k, headdim) tensor, got "
              f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    k, v = kv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(B, Lq, H, D)``, k/v ``(B, Lk, Hk, D)`` -> out ``(B, Lq, H, D)`` (or
    ``(out, softmax_lse (B, H, Lq), S_dmask (B, H, Lq, Lk))`` with ``return_attn_probs``)."""
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv ``(total, 3, H, D)`` -> out ``(total, H, D)``."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        _fail(f"argument 'qkv' must be a (total, 3, nheads, headdim) tensor, got "
              f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q ``(total_q, H, D)``, kv ``(total_k, 2, Hk, D)`` -> out ``(total_q, H, D)``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        _fail(f"argument 'kv' must be a (total_k, 2, nheads_k, headdim) tensor, got "
              f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q ``(total_q, H, D)``, k/v ``(total_k, Hk, D)`` (or pages ``(num_pages, page, Hk, D)`` with
    ``block_table (B, max_pages)`` int32) -> out ``(total_q, H, D)`` (or
    ``(out, softmax_lse (H, total_q), S_dmask)``)."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table)


def _int32_vector(name: str, t, B: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (B,):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(f"argument '{name}' must be an int32 tensor of shape ({B},), got {got}")
    if t.device != device:
        _fail(f"argument '{name}' is on {t.device} but 'q' is on {device}")
    return t.to("cpu", torch.int64)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, start: torch.Tensor,
            same_position: bool) -> torch.Tensor:
    """Rotary embedding of x ``(B, L, H, D)``; batch b's token l sits at position ``start[b] + l`` (or at
    ``start[b]`` for every l when ``same_position``)."""
    out = []
    L = x.shape[1]
    for b in range(x.shape[0]):
        p = int(start[b])
        if same_position:
            c, s = cos[p:p + 1].expand(L, -1), sin[p:p + 1].expand(L, -1)
            out.append(rotary_embedding(x[b:b + 1], c, s, interleaved=interleaved))
        else:
            out.append(rotary_embedding(x[b:b + 1], cos, sin, interleaved=interleaved, seqlen_offset=p))
    return torch.cat(out, 0)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Decode/prefill step over a KV cache (no gradient).

    q ``(B, Lq, H, D)``; k_cache/v_cache ``(B_cache, L_cache, Hk, D)``, or pages ``(num_pages, page, Hk, D)``
    with ``block_table (B, max_pages)`` int32 (any page size); new k/v ``(B, L_new, Hk, D)`` are written into
    the cache in place at positions ``cache_seqlens[b] ..`` of cache row ``cache_batch_idx[b]`` (default
    b), after the rotary embedding (``rotary_cos``/``rotary_sin`` ``(L_ro, R)``, ``2R <= D``, pairs
    interleaved when ``rotary_interleaved``) is applied to them and to q (q at positions
    ``cache_seqlens - cache_leftpad + i`` when causal or windowed, else all at ``cache_seqlens -
    cache_leftpad``). Then q attends to keys ``cache_leftpad[b] .. cache_seqlens[b] + L_new - 1``
    (bottom-right aligned); cache entries past them may hold anything. ``num_splits`` is accepted and has
    no effect. Every argument is checked before the cache is written: a rejected call leaves it as it was.

    Returns out ``(B, Lq, H, D)``, or ``(out, softmax_lse (B, H, Lq) fp32)`` with ``return_softmax_lse``.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            _fail(f"argument '{name}' must be a 4-d tensor, got {got}")
    if k_cache.shape != v_cache.shape:
        _fail(f"arguments 'k_cache' and 'v_cache' must have the same shape, got {tuple(k_cache.shape)} and "
              f"{tuple(v_cache.shape)}")
    dev = q.device
    if q.dtype not in FLOAT_DTYPES:
        _fail(f"argument 'q' must be float32, float16 or bfloat16, got {q.dtype}", TypeError)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != dev or t.dtype != q.dtype:
            _fail(f"argument '{name}' must be {q.dtype} on {dev} like 'q', got {t.dtype} on {t.device}")
    B, Lq, H, D = q.shape
    Hk = k_cache.shape[2]
    if k_cache.shape[3] != D:
        _fail(f"argument 'k_cache' has head dim {k_cache.shape[3]} but 'q' has {D}")
    if Hk < 1 or H % Hk:
        _fail(f"the number of query heads {H} must be a multiple of the cache's heads {Hk}")
    wl, wr = _window(window_size)
    if wl < -1 or wr < -1:
        _fail(f"argument 'window_size' values must be >= -1 (-1 = unlimited), got {(wl, wr)}")
    scale = None if softmax_scale is None else _finite_real("softmax_scale", softmax_scale)
    cap = _finite_real("softcap", softcap, minimum=0.0)
    if not isinstance(num_splits, int):
        _fail(f"argument 'num_splits' must be an int, got {type(num_splits).__name__}")
    paged = block_table is not None
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
                or block_table.dim() != 2 or block_table.shape[0] != B:
            got = (f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor)
                   else type(block_table).__name__)
            _fail(f"argument 'block_table' must be an int32 ({B}, max_pages) tensor, got {got}")
        if block_table.device != dev:
            _fail(f"argument 'block_table' is on {block_table.device} but 'q' is on {dev}")
        if cache_batch_idx is not None:
            _fail("argument 'cache_batch_idx' cannot be combined with a paged cache (block_table)")
        if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= k_cache.shape[0]):
            _fail(f"argument 'block_table' entries must be page indices in [0, {k_cache.shape[0]}), got "
                  f"{int(block_table.min())} .. {int(block_table.max())}")
        capacity = block_table.shape[1] * k_cache.shape[1]
        rows = torch.arange(B, dtype=torch.int64)
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            rows = _int32_vector("cache_batch_idx", cache_batch_idx, B, dev)
            if bool(((rows < 0) | (rows >= k_cache.shape[0])).any()):
                _fail(f"argument 'cache_batch_idx' entries must lie in [0, {k_cache.shape[0]}), got "
                      f"{rows.tolist()}")
        else:
            if k_cache.shape[0] < B:
                _fail(f"the cache holds {k_cache.shape[0]} sequences but 'q' has batch {B}")
            rows = torch.arange(B, dtype=torch.int64)
    if cache_seqlens is None:
        seqlens = torch.full((B,), 0 if k is not None else capacity, dtype=torch.int64)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity:
            _fail(f"argument 'cache_seqlens' must lie in [0, {capacity}] (the cache capacity), got {cache_seqlens}")
        seqlens = torch.full((B,), cache_seqlens, dtype=torch.int64)
    else:
        seqlens = _int32_vector("cache_seqlens", cache_seqlens, B, dev)
    leftpad = torch.zeros(B, dtype=torch.int64)
    if cache_leftpad is not None:
        if paged:
            _fail("argument 'cache_leftpad' cannot be combined with a paged cache (block_table)")
        leftpad = _int32_vector("cache_leftpad", cache_leftpad, B, dev)
    L_new = 0
    if (k is None) != (v is None):
        _fail("arguments 'k' and 'v' must be given together")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B or t.shape[2:] != (Hk, D):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                _fail(f"argument '{name}' must have shape ({B}, seqlen_new, {Hk}, {D}), got {got}")
            if t.device != dev or t.dtype != q.dtype:
                _fail(f"argument '{name}' must be {q.dtype} on {dev}, got {t.dtype} on {t.device}")
        if k.shape != v.shape:
            _fail(f"arguments 'k' and 'v' must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        L_new = k.shape[1]
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_writable(NAME, name, t)
        if k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr():
            _fail("arguments 'k_cache' and 'v_cache' are the same memory: the new values would overwrite the new "
                  "keys")
    total = seqlens + L_new
    if bool(((seqlens < 0) | (total > capacity)).any()):
        _fail(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache capacity), got "
              f"cache_seqlens={seqlens.tolist()} with seqlen_new={L_new}")
    if bool(((leftpad < 0) | (leftpad > seqlens)).any()):
        _fail(f"argument 'cache_leftpad' must lie in [0, cache_seqlens], got {leftpad.tolist()}")
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("arguments 'rotary_cos' and 'rotary_sin' must be given together")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.device != dev:
                _fail(f"argument '{name}' must be a 2-d (seqlen_ro, rotary_dim / 2) tensor on {dev}")
        if rotary_cos.shape != rotary_sin.shape:
            _fail(f"arguments 'rotary_cos' and 'rotary_sin' must have the same shape, got "
                  f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        R = rotary_cos.shape[1]
        if R < 1 or 2 * R > D:
            _fail(f"rotary_dim = 2 * {R} must lie in [2, head dim {D}]")
        start = seqlens - leftpad
        need = int((start + max(L_new, Lq)).max()) if B else 0
        if rotary_cos.shape[0] < need:
            _fail(f"argument 'rotary_cos' has {rotary_cos.shape[0]} positions, the call needs {need}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32 \
                or tuple(alibi_slopes.shape) not in ((H,), (B, H)):
            _fail(f"argument 'alibi_slopes' must be fp32 of shape ({H},) or ({B}, {H})")
        if alibi_slopes.device != dev:
            _fail(f"argument 'alibi_slopes' is on {alibi_slopes.device} but 'q' is on {dev}")

    with torch.no_grad():
        start = seqlens - leftpad
        local = wl >= 0 or wr >= 0
        if rotary_cos is not None and k is not None:
            q = _rotate(q, rotary_cos, rotary_sin, rotary_interleaved, start, same_position=not (causal or local))
            if k is not None:
                k = _rotate(k, rotary_cos, rotary_sin, rotary_interleaved, start, same_position=False)
        idx = saved = None
        if k is not None and L_new:
            pos = (seqlens.view(B, 1) + torch.arange(L_new).view(1, L_new)).reshape(-1)  # (B * L_new,)
            if paged:
                page = k_cache.shape[1]
                bt = block_table.to("cpu", torch.int64)
                pages = bt[torch.arange(B).repeat_interleave(L_new), pos // page]
                idx = (pages.to(dev), (pos % page).to(dev))
            else:
                idx = (rows.repeat_interleave(L_new).to(dev), pos.to(dev))
            # The slots about to be overwritten, so that a failure past this point (one the checks above
            # cannot foresee, such as a cache whose elements share memory) still leaves the cache as it was.
            saved = (k_cache[idx].clone(), v_cache[idx].clone())
        try:
            if saved is not None:
                k_cache.index_put_(idx, k.reshape(B * L_new, Hk, D))
                v_cache.index_put_(idx, v.reshape(B * L_new, Hk, D))
            if paged:
                kc, vc, bt = k_cache, v_cache, block_table
            else:
                sel = rows.to(dev)
                same = bool((rows == torch.arange(B)).all())
                kc = k_cache[:B] if same else k_cache.index_select(0, sel)
                vc = v_cache[:B] if same else v_cache.index_select(0, sel)
                bt = None
            out, lse = attention(q, kc, vc, layout="blhd", causal=causal, window=(wl, wr), scale=scale,
                                 softcap=cap, alibi_slopes=alibi_slopes, seqlens_k=total.to(torch.int32).to(dev),
                                 key_leftpad=None if cache_leftpad is None else cache_leftpad, block_table=bt,
                                 return_lse=True)
        except BaseException:
            if saved is not None:
                k_cache.index_put_(idx, saved[0])
                v_cache.index_put_(idx, saved[1])
            raise
    return (out, lse) if return_softmax_lse else out
