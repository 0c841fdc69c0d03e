"""Discovering suites and running them: every provider of every case, timed in one process on the same
inputs, with peak memory, GFLOP/s, percent of the measured matmul peak and speedups."""

from __future__ import annotations

import fnmatch
import gc
import importlib
import importlib.util
import inspect
import pkgutil
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .core import BenchConfig, Case, Skip, Suite
from .memory import cuda_peak_bytes, measure_cpu_in_subprocess
from .timing import TimingPolicy, TimingResult, measure_matmul_peak, time_callable

__all__ = ["SuiteEntry", "ProviderResult", "RatioResult", "RunOptions", "RunResult", "discover_suites",
           "case_set_entries", "run_benchmarks", "PEER_KINDS", "default_x"]

PEER_KINDS = ("peer", "torch")
_X_KEYS = ("L", "seq_len", "seqlen", "T", "N", "rows", "n", "length")


@dataclass
class SuiteEntry:
    """A discovered suite: ``suite`` is None when its module failed to import (``error`` says why).
    ``case_set``: run that named case set of the suite instead of its sweep (``name`` is then the set's)."""

    name: str
    module: str
    suite: Suite | None = None
    error: str | None = None
    case_set: str | None = None


@dataclass
class ProviderResult:
    suite: str
    case: str
    group: str
    params: dict[str, Any]
    x_name: str | None
    x: float | None
    provider: str
    kind: str
    reference: bool
    status: str  # "ok", "skipped", "error"
    note: str = ""
    timing: TimingResult | None = None
    mem_bytes: int | None = None
    mem_method: str | None = None
    flops: float | None = None
    bytes: float | None = None
    gflops: float | None = None
    gbps: float | None = None
    pct_peak: float | None = None
    speedup_vs_reference: float | None = None
    speedup_vs_best_peer: float | None = None
    best_peer: str | None = None


@dataclass
class RatioResult:
    """One :class:`fastarch.bench.core.Ratio` of a case as measured: ``value`` is None when either side
    did not run; ``met`` is None without a target. A :class:`fastarch.bench.core.MemoryBound` is reported
    the same way with ``metric="peak memory"``: ``faster`` the provider, ``value`` its peak in MB and
    ``target`` the bound."""

    suite: str
    case: str
    faster: str
    slower: str
    value: float | None
    target: float | None
    at_most: bool
    met: bool | None
    metric: str = "time"


@dataclass
class RunOptions:
    """``providers``/``cases``: glob patterns (a provider matches by name or kind; the case's reference
    provider is always kept so speedups stay defined); ``memory``: "auto" (every case in --full, only
    ``Case.measure_memory`` cases in --quick), "all" or "none"."""

    quick: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    toy: bool = False
    providers: Sequence[str] | None = None
    cases: Sequence[str] | None = None
    policy: TimingPolicy = field(default_factory=TimingPolicy)
    memory: str = "auto"
    measure_peak: bool = True
    time_limit_s: float | None = None  # soft target for the whole run: shrinks per-provider budgets


@dataclass
class RunResult:
    results: list[ProviderResult]
    suites: dict[str, dict[str, Any]]  # name -> {"description", "status", "note"[, "wall_s"]}
    matmul_peak_gflops: float | None
    wall_s: float
    ratios: list[RatioResult] = field(default_factory=list)


def discover_suites() -> dict[str, SuiteEntry]:
    """Every module in ``fastarch/bench/suites/`` (names not starting with ``_``), imported; a module
    that fails to import, or has no ``SUITE``, is an entry with an ``error`` instead of a crash."""
    from . import suites as pkg

    pkg.extend_path()
    out: dict[str, SuiteEntry] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        modname = f"{pkg.__name__}.{info.name}"
        entry = SuiteEntry(name=info.name, module=modname)
        try:
            mod = importlib.import_module(modname)
            suite = getattr(mod, "SUITE", None)
            if not isinstance(suite, Suite):
                entry.error = "module defines no SUITE (a fastarch.bench.core.Suite)"
            else:
                entry.suite = suite
        except Exception as exc:  # reported, never fatal
            entry.error = f"failed to import: {type(exc).__name__}: {_first_line(exc)}"
        out[info.name] = entry
    return out


def case_set_entries(entries: dict[str, SuiteEntry], names: Sequence[str]) -> list[SuiteEntry] | str:
    """One entry per case-set name (each run under the set's name), or an error message naming the
    unknown ones and the case sets that exist."""
    owners = {cs: e for e in entries.values() if e.suite is not None for cs in e.suite.case_sets}
    unknown = [n for n in names if n not in owners]
    if unknown:
        return f"unknown case set(s): {', '.join(unknown)} (available: {', '.join(sorted(owners)) or 'none'})"
    return [replace(owners[n], name=n, case_set=n) for n in names]


def _description(e: SuiteEntry) -> str:
    """The suite's description, or the first paragraph of its case set's docstring."""
    if e.suite is None:
        return ""
    fn = e.suite.case_sets.get(e.case_set) if e.case_set else None
    doc = inspect.getdoc(fn) if fn is not None else None
    return " ".join(doc.split("\n\n")[0].split()) if doc else e.suite.description


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def default_x(case: Case) -> str | None:
    if case.x is not None:
        return case.x
    for k in _X_KEYS:
        if isinstance(case.params.get(k), (int, float)):
            return k
    for k, v in case.params.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return k
    return None


def default_group(case: Case) -> str:
    """The case name up to its first ``key=value`` size, e.g. "fwd+bwd L=1024" -> "fwd+bwd"."""
    if case.group is not None:
        return case.group
    words = [w for w in case.name.replace(",", " ").split() if "=" not in w]
    return " ".join(words)


def _match(patterns: Sequence[str] | None, *names: str) -> bool:
    if not patterns:
        return True
    return any(fnmatch.fnmatch(n, p) or n == p for p in patterns for n in names if n)


def _want_memory(case: Case, opts: RunOptions) -> bool:
    if opts.memory == "none":
        return False
    if opts.memory == "all":
        return True
    return (not opts.quick) or case.measure_memory


def run_benchmarks(
    entries: Sequence[SuiteEntry],
    opts: RunOptions,
    progress: Callable[[int, int, str], None] | None = None,
) -> RunResult:
    """Run every selected provider of every case of ``entries``; nothing here raises for a missing peer,
    device or a broken suite: each is reported in the result."""
    t_start = time.perf_counter()
    cfg = BenchConfig(quick=opts.quick, device=opts.device, dtype=opts.dtype, toy=opts.toy)
    suites: dict[str, dict[str, Any]] = {}
    plan: list[tuple[SuiteEntry, list[Case]]] = []
    no_cuda = opts.device.type == "cuda" and not torch.cuda.is_available()
    for e in entries:
        desc = _description(e)
        if e.suite is None:
            suites[e.name] = {"description": desc, "status": "error", "note": e.error or "unavailable"}
            continue
        if no_cuda:
            suites[e.name] = {"description": desc, "status": "skipped", "note": "no CUDA device"}
            continue
        try:
            cases = [c for c in e.suite.cases_for(cfg, e.case_set) if _match(opts.cases, c.name)]
        except Skip as exc:
            suites[e.name] = {"description": desc, "status": "skipped", "note": str(exc) or "skipped"}
            continue
        except Exception as exc:
            suites[e.name] = {"description": desc, "status": "error",
                              "note": f"cases() failed: {type(exc).__name__}: {_first_line(exc)}"}
            continue
        for c in cases:
            keep = c.reference
            c.providers = [p for p in c.providers if p.name == keep or _match(opts.providers, p.name, p.kind)]
        suites[e.name] = {"description": desc, "status": "ok", "note": f"{len(cases)} cases"}
        plan.append((e, cases))

    total = sum(len(c.providers) for _, cases in plan for c in cases)
    peak = None
    if opts.measure_peak and plan:
        try:
            peak = measure_matmul_peak(opts.device, opts.dtype, quick=opts.quick, size=256 if opts.toy else None)
        except Exception:  # a peak we cannot measure leaves percent-of-peak blank
            peak = None

    results: list[ProviderResult] = []
    ratios: list[RatioResult] = []
    done = 0
    interrupted = False
    for entry, cases in plan:
        if interrupted:
            suites[entry.name].update(status="skipped", note="interrupted before this suite")
            continue
        suite_results: list[tuple[Case, ProviderResult]] = []
        t_suite = time.perf_counter()
        try:
            done = _run_cases(entry, cases, opts, progress, t_start, total, done, suite_results)
        except KeyboardInterrupt:  # Ctrl-C: keep and write what was measured so far
            interrupted = True
            suites[entry.name]["note"] += "; interrupted (partial)"
        if opts.device.type == "cpu" and not interrupted:
            _cpu_memory(entry, cases, suite_results, opts)
        for case in cases:
            ratios += _derive([r for c, r in suite_results if c is case], case, peak)
        results.extend(r for _, r in suite_results)
        suites[entry.name]["wall_s"] = round(time.perf_counter() - t_suite, 2)
    return RunResult(results=results, suites=suites, matmul_peak_gflops=peak,
                     wall_s=time.perf_counter() - t_start, ratios=ratios)


def _run_cases(entry: SuiteEntry, cases: list[Case], opts: RunOptions,
               progress: Callable[[int, int, str], None] | None, t_start: float, total: int, done: int,
               suite_results: list[tuple[Case, ProviderResult]]) -> int:
    """Run every provider of ``cases``, appending to ``suite_results``; returns the running count."""
    for case in cases:
        x_name = default_x(case)
        x_val = case.params.get(x_name) if x_name else None
        for prov in case.providers:
            done += 1
            r = ProviderResult(
                suite=entry.name, case=case.name, group=default_group(case), params=dict(case.params),
                x_name=x_name, x=float(x_val) if isinstance(x_val, (int, float)) else None,
                provider=prov.name, kind=prov.kind, reference=prov.name == case.reference,
                status="ok", flops=case.flops, bytes=case.bytes,
            )
            _run_one(prov, case, r, opts, _policy_now(opts, t_start, total - done + 1))
            if progress is not None:
                progress(done, total, _progress_line(r))
            suite_results.append((case, r))
    return done


def _policy_now(opts: RunOptions, t_start: float, remaining: int) -> TimingPolicy:
    """The timing policy for the next provider: under a run time limit, each remaining provider's budget
    of timed repetitions shrinks to its share of the time left (warm-up, setup and memory need the rest);
    once the time is spent, one timed call per provider."""
    p = opts.policy
    if opts.time_limit_s is None or p.repeat is not None:
        return p
    left = opts.time_limit_s - (time.perf_counter() - t_start)
    share = 0.4 * left / max(1, remaining)
    if share >= p.budget_s:
        return p
    if left <= 0:
        return replace(p, budget_s=0.0, min_reps=1)
    return replace(p, budget_s=max(0.01, share), min_reps=min(p.min_reps, 2))


def _run_one(prov: Any, case: Case, r: ProviderResult, opts: RunOptions, policy: TimingPolicy) -> None:
    if prov.peer_package and importlib.util.find_spec(prov.peer_package) is None:
        r.status, r.note = "skipped", f"not installed ({prov.peer_package})"
        return
    fn = None
    try:
        fn = prov.setup()
        r.timing = time_callable(fn, opts.device, policy)
        if prov.scale != 1.0:
            t = r.timing
            r.timing = replace(t, median_ms=t.median_ms * prov.scale, p20_ms=t.p20_ms * prov.scale,
                               p80_ms=t.p80_ms * prov.scale, method=f"{t.method}, extrapolated x{prov.scale:g}")
            r.note = f"extrapolated: timed 1/{prov.scale:g} of the work"
        if opts.device.type == "cuda" and _want_memory(case, opts):
            r.mem_bytes, r.mem_method = cuda_peak_bytes(fn, opts.device), "cuda-max-allocated"
    except Skip as exc:
        r.status, r.note = "skipped", str(exc) or "skipped"
    except torch.OutOfMemoryError:
        r.status, r.note = "error", "out of memory"
    except Exception as exc:  # recorded; the run goes on
        r.status, r.note = "error", f"{type(exc).__name__}: {_first_line(exc)}"
        if _debug():
            traceback.print_exc()
    finally:
        del fn
        gc.collect()
        if opts.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()


def _debug() -> bool:
    import os

    return os.environ.get("FASTARCH_BENCH_DEBUG", "") not in ("", "0")


def _progress_line(r: ProviderResult) -> str:
    what = f"{r.suite} | {r.case} | {r.provider}"
    if r.status == "ok" and r.timing is not None:
        return f"{what}: {r.timing.median_ms:.4g} ms"
    return f"{what}: {r.status} ({r.note})"


def _cpu_memory(entry: SuiteEntry, cases: list[Case], pairs: list[tuple[Case, ProviderResult]],
                opts: RunOptions) -> None:
    items = [(c.name, r.provider) for c, r in pairs if r.status == "ok" and _want_memory(c, opts)]
    if not items:
        return
    try:
        mem = measure_cpu_in_subprocess(entry.module, quick=opts.quick, dtype=opts.dtype, toy=opts.toy,
                                        items=items, case_set=entry.case_set)
    except Exception as exc:  # memory is a secondary metric; never fail the run for it
        for _, r in pairs:
            if (r.case, r.provider) in items:
                why = f"memory: {type(exc).__name__}: {_first_line(exc)}"
                r.note = (r.note + "; " if r.note else "") + why
        return
    for _, r in pairs:
        rec = mem.get((r.case, r.provider))
        if rec is None:
            continue
        if rec.get("status") == "ok":
            r.mem_bytes, r.mem_method = rec["bytes"], rec.get("method", "rss")
        else:
            r.note = (r.note + "; " if r.note else "") + f"memory {rec.get('status')}: {rec.get('note', '')}"


def _derive(rs: list[ProviderResult], case: Case, peak: float | None) -> list[RatioResult]:
    """Fill in the derived metrics of one case's results; returns the case's ratios."""
    ok = [r for r in rs if r.status == "ok" and r.timing is not None and r.timing.median_ms > 0]
    ref = next((r for r in ok if r.provider == case.reference), None)
    peers = [r for r in ok if r.kind in PEER_KINDS]
    best = min(peers, key=lambda r: r.timing.median_ms) if peers else None
    for r in ok:
        t_s = r.timing.median_ms * 1e-3
        if r.flops:
            r.gflops = r.flops / t_s / 1e9
            if peak:
                r.pct_peak = 100.0 * r.gflops / peak
        if r.bytes:
            r.gbps = r.bytes / t_s / 1e9
        if ref is not None:
            r.speedup_vs_reference = ref.timing.median_ms / r.timing.median_ms
        if best is not None:
            r.speedup_vs_best_peer = best.timing.median_ms / r.timing.median_ms
            r.best_peer = best.provider
    if not rs:
        return []
    times = {r.provider: r.timing.median_ms for r in ok}
    out = []
    for q in case.ratios:
        value = times[q.slower] / times[q.faster] if q.faster in times and q.slower in times else None
        out.append(RatioResult(suite=rs[0].suite, case=case.name, faster=q.faster, slower=q.slower,
                               value=value, target=q.target, at_most=q.at_most,
                               met=q.met(value) if value is not None else None))
    mems = {r.provider: r.mem_bytes / 2**20 for r in rs if r.status == "ok" and r.mem_bytes is not None}
    for m in case.memory_bounds:
        mb = mems.get(m.provider)
        out.append(RatioResult(suite=rs[0].suite, case=case.name, faster=m.provider, slower="", value=mb,
                               target=m.limit_mb, at_most=True, met=m.met(mb) if mb is not None else None,
                               metric="peak memory"))
    return out
