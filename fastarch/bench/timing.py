"""Timing one provider's callable: median, p20 and p80 of repeated runs. The only timer of the bench.

- CPU: ``torch.utils.benchmark.Timer`` (with the process's intra-op thread count). After the warm-up
  calls, ``blocked_autorange`` fills the per-provider budget (``budget_s``) with blocks of calls sized so
  that the timer's own overhead is negligible; a sample is one block's time per call (topped up with
  single calls to ``min_reps`` samples). A fixed ``repeat`` times that many single calls instead, on the
  same clock. A call slower than ``slow_s`` (quick mode) gets one timed repetition, and one slower than
  five times that is reported from its warm-up call alone.
- CUDA: ``triton.testing.do_bench`` (which flushes L2 between runs and uses CUDA events) when triton is
  importable, otherwise CUDA events around each call with a synchronise after it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from timeit import default_timer
from typing import Any

import torch
import torch.utils.benchmark as torch_benchmark

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
    def for_mode(cls, quick: bool, repeat: int | None = None, warmup: int | None = None,
                 case_set: bool = False) -> TimingPolicy:
        """The policy of a ``--quick`` or ``--full`` run; ``case_set``: of a headline case set, whose calls
        are always repeated (at least 3 timed calls after the warm-up), however long they take."""
        if case_set:
            p = cls(budget_s=1.0, warmup=1, min_reps=3) if quick else cls(budget_s=3.0, warmup=2, min_reps=5)
        elif quick:
            p = cls(budget_s=0.25, warmup=1, min_reps=3, slow_s=1.0)
        else:
            p = cls(budget_s=1.5, warmup=3, min_reps=10)
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


def _one_call_s(fn: Callable[[], Any]) -> float:
    """Seconds of one call, on the clock ``torch.utils.benchmark`` uses (whose ``timeit`` adds warm-up
    calls of its own: too many for multi-second ops)."""
    t0 = default_timer()
    fn()
    return default_timer() - t0


def _time_cpu(fn: Callable[[], Any], policy: TimingPolicy) -> TimingResult:
    warm = [_one_call_s(fn) for _ in range(max(1, policy.warmup))]
    # The last warm-up call is the best estimate of a steady-state call (the first may have compiled).
    est = max(warm[-1], 1e-7)
    if policy.repeat is None and policy.slow_s is not None and est > 5 * policy.slow_s:
        # Quick mode and a call of many seconds: the warm-up call is the only sample (it may include
        # one-time work, so it is an upper bound); the table's note says so via the method.
        return _summary([est * 1e3], "wall-warmup-only")
    if policy.repeat is not None:
        return _summary([_one_call_s(fn) * 1e3 for _ in range(max(1, policy.repeat))], "wall")
    if policy.slow_s is not None and est > policy.slow_s:
        return _summary([_one_call_s(fn) * 1e3], "wall")  # quick mode: one more call of a multi-second op
    min_reps = max(1, min(policy.min_reps, policy.max_reps))
    if policy.budget_s <= est * min_reps:  # no room for more than the minimum: single calls
        return _summary([_one_call_s(fn) * 1e3 for _ in range(min_reps)], "wall")
    timer = torch_benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    times = list(timer.blocked_autorange(min_run_time=policy.budget_s).times)
    while len(times) < min_reps:
        times.append(_one_call_s(fn))
    return _summary([t * 1e3 for t in times], "torch.utils.benchmark")


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
    throughput from its 20th-percentile time; percent-of-peak figures are relative to it. On CPU in fp32 the
    faster of ``torch.mm`` and ``fastarch.ops.linear``'s oneDNN GEMM counts.
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
    products = [lambda: torch.mm(a, b)]
    if device.type == "cpu" and dtype == torch.float32:
        from ..ops.linear import linear

        # oneDNN's GEMM where PyTorch has it, often faster than torch.mm's BLAS
        products.append(lambda: linear(a, b, backend="aten"))
    policy = TimingPolicy(budget_s=0.3, warmup=2, min_reps=3)
    # The peak is what the device can reach: the faster product, from the fast end (p20) of its samples.
    best_ms = min(time_callable(product, device, policy).p20_ms for product in products)
    gflops = 2.0 * n**3 / (best_ms * 1e-3) / 1e9
    _PEAK_CACHE[key] = gflops
    return gflops
