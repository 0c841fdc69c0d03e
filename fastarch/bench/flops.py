"""FLOP (and byte) counts for benchmark cases, with FlashAttention's conventions.

Attention forward does two matmuls per visible (query, key) pair: ``S = Q K^T`` and ``O = P V``, each a
multiply-add over the head dim, so ``4 * D`` FLOPs per pair (softmax is not counted). FlashAttention's
benchmarks use ``4 * B * H * Lq * Lk * D`` for full attention and halve it for causal; here the visible
pairs are counted exactly, for any causal/window/length combination (bottom-right alignment, as in
:func:`fastarch.ops.attention`). Backward counts 2.5x the forward (five matmuls instead of two), so
forward+backward is 3.5x.
"""

from __future__ import annotations

__all__ = [
    "attention_pairs",
    "attention_flops",
    "matmul_flops",
    "linear_attention_flops",
    "selective_scan_flops",
    "BWD_FACTOR",
    "mode_factor",
]

BWD_FACTOR = 2.5


def mode_factor(mode: str) -> float:
    """FLOP multiplier of ``mode`` relative to the forward: 'fwd' 1, 'bwd' 2.5, 'fwd_bwd' 3.5."""
    factors = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwd_bwd": 1.0 + BWD_FACTOR}
    if mode not in factors:
        raise ValueError(f"argument 'mode' must be one of {sorted(factors)}, got {mode!r}")
    return factors[mode]


def attention_pairs(
    lq: int, lk: int, *, causal: bool = False, window: tuple[int, int] = (-1, -1)
) -> int:
    """Number of visible (query i, key j) pairs, counted exactly.

    Query ``i`` sits at key position ``p = i + lk - lq`` (bottom-right alignment) and sees key ``j`` when
    ``p - left <= j <= p + right`` and ``0 <= j < lk``; ``-1`` means unlimited and ``causal`` forces
    ``right = 0``. Computed in O(1) per distinct clipping regime (closed-form sums), so it is exact and
    cheap even for million-token lengths.
    """
    if lq < 0 or lk < 0:
        raise ValueError(f"lengths must be >= 0, got lq={lq}, lk={lk}")
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    off = lk - lq
    total = 0
    # Sum over i in [0, lq) of max(0, min(lk-1, p+right) - max(0, p-left) + 1), p = i + off.
    # Split i into ranges where each clip is active; count by arithmetic series over each range.
    cuts = {0, lq}
    if left >= 0:
        cuts.add(_clamp(left - off, 0, lq))  # p - left >= 0  <=>  i >= left - off
    if right >= 0:
        cuts.add(_clamp(lk - 1 - right - off + 1, 0, lq))  # p + right <= lk-1  <=>  i <= lk-1-right-off
    # Where the width crosses zero the max(0, .) switches; add those points too.
    pts = sorted(cuts)
    for a, b in zip(pts[:-1], pts[1:]):
        if a >= b:
            continue
        total += _range_sum(a, b, off, left, right, lk)
    return total


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def _width(i: int, off: int, left: int, right: int, lk: int) -> int:
    p = i + off
    lo = 0 if left < 0 else max(0, p - left)
    hi = lk - 1 if right < 0 else min(lk - 1, p + right)
    return hi - lo + 1


def _range_sum(a: int, b: int, off: int, left: int, right: int, lk: int) -> int:
    """Sum of max(0, width(i)) for i in [a, b) where width is affine in i (no clip switches inside)."""
    w0 = _width(a, off, left, right, lk)
    w1 = _width(b - 1, off, left, right, lk)
    n = b - a
    if n == 1:
        return max(0, w0)
    slope = (w1 - w0) // (n - 1)  # -1, 0 or +1 inside a regime
    if slope == 0:
        return n * max(0, w0)
    # widths w0, w0+slope, ..., w1: sum only the positive ones.
    if slope > 0:
        first_pos = a + max(0, (1 - w0 + slope - 1) // slope) if w0 <= 0 else a
        if first_pos >= b:
            return 0
        wa = _width(first_pos, off, left, right, lk)
        m = b - first_pos
        return m * wa + slope * m * (m - 1) // 2
    last_pos = a + (w0 - 1) // (-slope) if w0 > 0 else a - 1  # last i with width >= 1
    last_pos = min(last_pos, b - 1)
    if last_pos < a:
        return 0
    m = last_pos - a + 1
    return m * w0 + slope * m * (m - 1) // 2


def attention_flops(
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    head_dim: int,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    mode: str = "fwd",
    head_dim_v: int | None = None,
) -> float:
    """FLOPs of (sliding-window / causal) attention: ``2 * B * H * pairs * (D + Dv)`` forward
    (``4 * B * H * pairs * D`` when ``Dv == D``), times :func:`mode_factor`."""
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = attention_pairs(lq, lk, causal=causal, window=window)
    return 2.0 * batch * heads * pairs * (head_dim + dv) * mode_factor(mode)


def matmul_flops(m: int, n: int, k: int) -> float:
    """``2 * m * n * k``: one multiply and one add per term."""
    return 2.0 * m * n * k


def linear_attention_flops(
    batch: int, heads: int, length: int, dk: int, dv: int, *, causal: bool = False, mode: str = "fwd"
) -> float:
    """Kernelised linear attention ``phi(Q) (phi(K)^T V)`` with normaliser, forward.

    Non-causal: ``K^T V`` (2·L·Dk·Dv) + ``Q (K^T V)`` (2·L·Dk·Dv) + normaliser ``Q · sum(K)`` (2·L·Dk).
    Causal (chunked or recurrent): the same matmul volume per token (a running state update and a read),
    so the same count; feature maps are not counted. Times :func:`mode_factor`.
    """
    per_token = 4.0 * dk * dv + 2.0 * dk
    return batch * heads * length * per_token * mode_factor(mode)


def selective_scan_flops(batch: int, dim: int, length: int, d_state: int, *, mode: str = "fwd") -> float:
    """Mamba's selective scan ``h_t = exp(dt A) h_{t-1} + dt B_t x_t``, ``y_t = C_t h_t (+ D x_t)``.

    Per (b, d, t, n): ``dt*A`` (1), ``exp`` (1), ``* h`` (1), ``dt*B*x`` (2), ``+`` (1), ``C*h`` and its
    accumulation (2): 8 FLOPs; ``exp`` counted as one. Times :func:`mode_factor`.
    """
    return 8.0 * batch * dim * length * d_state * mode_factor(mode)
