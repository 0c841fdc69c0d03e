"""Timing one provider's callable: median, p20 and p80 of repeated runs.

- CPU: wall time (``time.perf_counter``) of each call after warm-up. The number of repetitions is scaled
  to a per-provider time budget (``budget_s``) from the warm-up's measured duration, bounded by
  ``min_reps``/``max_reps``, so fast ops get many samples and slow ones a few.
- CUDA: ``triton.testing.do_bench`` (which flushes L2 between runs and uses CUDA events) when triton is
  importable, otherwise CUDA events around each call with a synchronise after it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TimingResult", "TimingPolicy", "time_callable", "quantile", "measure_matmul_peak"]


@dataclass
class TimingResult:
    """Times in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    method: str


@dataclass
class TimingPolicy:
    """``budget_s``: target seconds spent in timed repetitions per provider; ``warmup``: warm-up calls
    (at least one, which also absorbs compilation and lazy builds); ``repeat``: fixed repetitions
    (overrides the budget when set)."""

    budget_s: float = 0.3
    warmup: int = 1
    min_reps: int = 3
    max_reps: int = 2000
    repeat: int | None = None
    slow_s: float | None = None  # a warm call slower than this gets a single timed repetition

    @classmethod
    def for_mode(cls, quick: bool, repeat: int | None = None, warmup: int | None = None) -> TimingPolicy:
        p = cls(budget_s=0.25, warmup=1, min_reps=3, slow_s=1.0) if quick else cls(budget_s=1.5, warmup=3, min_reps=10)
        if repeat is not None:
            p.repeat = repeat
        if warmup is not None:
            p.warmup = max(1, warmup)
        return p


def quantile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (same as numpy's default)."""
    if not sorted_vals:
        raise ValueError("quantile of an empty list")
    pos = (len(sorted_vals) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _summary(times_ms: list[float], method: str) -> TimingResult:
    s = sorted(times_ms)
    return TimingResult(statistics.median(s), quantile(s, 0.2), quantile(s, 0.8), len(s), method)


def _time_cpu(fn: Callable[[], Any], policy: TimingPolicy) -> TimingResult:
    warm = []
    for _ in range(max(1, policy.warmup)):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    # The last warm-up call is the best estimate of a steady-state call (the first may have compiled).
    est = max(warm[-1], 1e-7)
    if policy.repeat is None and policy.slow_s is not None and est > 5 * policy.slow_s:
        # Quick mode and a call of many seconds: the warm-up call is the only sample (it may include
        # one-time work, so it is an upper bound); the table's note says so via the method.
        return _summary([est * 1e3], "wall-warmup-only")
    if policy.repeat is not None:
        reps = max(1, policy.repeat)
    elif policy.slow_s is not None and est > policy.slow_s:
        reps = 1  # quick mode: one more call of a multi-second op says enough
    else:
        reps = int(min(policy.max_reps, max(policy.min_reps, policy.budget_s / est)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return _summary(times, "wall")


def _time_cuda(fn: Callable[[], Any], policy: TimingPolicy, device: torch.device) -> TimingResult:
    with torch.cuda.device(device):
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None and policy.repeat is None:
            fn()  # compile / lazy init outside do_bench's own estimate
            torch.cuda.synchronize()
            budget_ms = max(25.0, policy.budget_s * 1e3)
            med, p20, p80 = do_bench(fn, warmup=max(5.0, budget_ms / 4), rep=budget_ms,
                                     quantiles=[0.5, 0.2, 0.8])
            return TimingResult(float(med), float(p20), float(p80), -1, "triton.do_bench")
        for _ in range(max(1, policy.warmup)):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        est_s = max(start.elapsed_time(end) / 1e3, 1e-6)
        reps = policy.repeat or int(min(policy.max_reps, max(policy.min_reps, policy.budget_s / est_s)))
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return _summary(times, "cuda-events")


def time_callable(fn: Callable[[], Any], device: torch.device | str, policy: TimingPolicy) -> TimingResult:
    """Time ``fn`` (one iteration per call) on ``device`` under ``policy``."""
    device = torch.device(device)
    if device.type == "cuda":
        return _time_cuda(fn, policy, device)
    return _time_cpu(fn, policy)


_PEAK_CACHE: dict[tuple[str, str, int | None], float] = {}


def measure_matmul_peak(
    device: torch.device | str, dtype: torch.dtype, *, quick: bool = True, size: int | None = None
) -> float:
    """The device's achievable matmul throughput in GFLOP/s for ``dtype``, measured once per process.

    A square matmul (1024 on CPU in quick mode, 2048 otherwise; 8192 on CUDA) timed like any provider,
    throughput from its 20th-percentile time; percent-of-peak figures are relative to it.
    """
    device = torch.device(device)
    key = (str(device), str(dtype), size)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    if device.type == "cuda":
        n = 8192
    else:
        n = 1024 if quick else 2048
    # Low-precision CPU matmuls can be orders of magnitude slower; keep them short.
    if device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        n = 512
    n = size or n
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    res = time_callable(lambda: torch.mm(a, b), device, TimingPolicy(budget_s=0.3, warmup=2, min_reps=3))
    # The peak is what the device can reach: use the fast end (p20) of the samples, not the median.
    gflops = 2.0 * n**3 / (res.p20_ms * 1e-3) / 1e9
    _PEAK_CACHE[key] = gflops
    return gflops
