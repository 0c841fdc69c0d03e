"""Results out: the run's metadata, long-format rows (one per suite, case, provider, metric), CSV, JSON,
the aligned stdout table and the cases' ratios. Every results file is written atomically (a reader never
sees half a file, an interrupted run never leaves one)."""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ..info import cpu_name
from ..tokenizers.io import atomic_write_text
from .runner import ProviderResult, RatioResult, RunResult

__all__ = ["METRICS", "CSV_COLUMNS", "machine_info", "result_rows", "csv_text", "json_text", "write_results",
           "format_table", "format_ratios", "format_summary"]

# metric name -> (unit, getter)
METRICS: dict[str, tuple[str, Any]] = {
    "time_median_ms": ("ms", lambda r: r.timing.median_ms if r.timing else None),
    "time_p20_ms": ("ms", lambda r: r.timing.p20_ms if r.timing else None),
    "time_p80_ms": ("ms", lambda r: r.timing.p80_ms if r.timing else None),
    "repetitions": ("count", lambda r: r.timing.reps if r.timing and r.timing.reps >= 0 else None),
    "peak_memory_mb": ("MB", lambda r: r.mem_bytes / 2**20 if r.mem_bytes is not None else None),
    "gflops": ("GFLOP/s", lambda r: r.gflops),
    "pct_matmul_peak": ("%", lambda r: r.pct_peak),
    "gbps": ("GB/s", lambda r: r.gbps),
    "speedup_vs_reference": ("x", lambda r: r.speedup_vs_reference),
    "speedup_vs_best_peer": ("x", lambda r: r.speedup_vs_best_peer),
}

META_COLUMNS = ["timestamp", "machine", "cpu", "device", "device_name", "dtype", "mode",
                "torch", "triton", "fastarch", "python"]
CSV_COLUMNS = META_COLUMNS + ["suite", "case", "group", "params", "x_name", "x", "provider", "kind",
                              "is_reference", "metric", "value", "unit", "status", "note"]


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(device: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, Any]:
    """Where and with what the run happened."""
    import fastarch

    if device.type == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{cpu_name()} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": device_name,
        "dtype": str(dtype).replace("torch.", ""),
        "mode": "quick" if quick else "full",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "triton": _version("triton"),
        "fastarch": getattr(fastarch, "__version__", "?"),
        "fastarch_commit": _git_commit(),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        # Other processes on a shared machine slow every provider; the 1/5/15-minute load says how much.
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }


def result_rows(run: RunResult, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Long format: one row per (suite, case, provider, metric). A provider that did not run has one row,
    metric ``time_median_ms`` with an empty value, its status ("skipped"/"error") and the reason."""
    base = {k: meta.get(k, "") for k in META_COLUMNS}
    rows: list[dict[str, Any]] = []
    for r in run.results:
        common = dict(base, suite=r.suite, case=r.case, group=r.group, params=r.params, x_name=r.x_name or "",
                      x=r.x, provider=r.provider, kind=r.kind, is_reference=r.reference, status=r.status,
                      note=r.note)
        if r.status != "ok":
            rows.append(dict(common, metric="time_median_ms", value=None, unit="ms"))
            continue
        for metric, (unit, get) in METRICS.items():
            v = get(r)
            if v is None:
                continue
            note = r.note
            if metric == "peak_memory_mb":
                note = r.mem_method or ""
            elif metric == "speedup_vs_best_peer":
                note = f"best peer: {r.best_peer}"
            elif metric.startswith("time_"):
                note = r.timing.method if r.timing else ""
            rows.append(dict(common, metric=metric, value=float(v), unit=unit, note=note))
    return rows


def csv_text(rows: list[dict[str, Any]]) -> str:
    """``rows`` as CSV with the columns ``CSV_COLUMNS``."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS)
    w.writeheader()
    for row in rows:
        out = dict(row)
        out["params"] = json.dumps(row["params"], sort_keys=True)
        out["value"] = "" if row["value"] is None else repr(float(row["value"]))
        out["x"] = "" if row["x"] is None else row["x"]
        w.writerow({k: out.get(k, "") for k in CSV_COLUMNS})
    return buf.getvalue()


def json_text(run: RunResult, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The whole run as JSON: metadata, suite statuses, the rows and the ratios."""
    doc = {
        "meta": dict(meta, matmul_peak_gflops=run.matmul_peak_gflops, wall_time_s=round(run.wall_s, 2)),
        "suites": run.suites,
        "columns": CSV_COLUMNS,
        "rows": rows,
        "ratios": [vars(q) for q in run.ratios],
    }
    return json.dumps(doc, indent=1, default=str) + "\n"


def write_results(out: str | os.PathLike, run: RunResult, meta: dict[str, Any], rows: list[dict[str, Any]],
                  table: str, summary: str) -> None:
    """``results.csv``, ``results.json``, ``table.txt`` and ``summary.md`` in the folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.csv", csv_text(rows)), ("results.json", json_text(run, meta, rows)),
                       ("table.txt", table + "\n"), ("summary.md", summary)):
        atomic_write_text(out / name, text)


def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01:
        return f"{v:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{v:.2f}"
    return f"{v:.2e}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_table(run: RunResult) -> str:
    """The aligned table: one block per suite, one line per (case, provider)."""
    head = ["case", "provider", "kind", "median ms", "p20", "p80", "mem MB", "GFLOP/s", "%peak", "GB/s",
            "vs ref", "vs best peer", "note"]
    lines: list[str] = []
    by_suite: dict[str, list[ProviderResult]] = {}
    for r in run.results:
        by_suite.setdefault(r.suite, []).append(r)
    for name, info in run.suites.items():
        title = f"== {name}: {info.get('description', '')}".rstrip(": ")
        if "wall_s" in info:
            title += f"  [{info['wall_s']:.1f} s]"
        if info["status"] != "ok":
            lines.append(f"{title}\n   {info['status']}: {info['note']}\n")
            continue
        body = []
        prev_case = None
        for r in by_suite.get(name, []):
            t = r.timing
            note = r.note if r.status != "ok" else ("reference" if r.reference else r.note)
            if t is not None and t.method == "wall-warmup-only":
                note = (note + "; " if note else "") + "one call (>5 s), incl. warm-up"
            if r.status != "ok":
                note = f"{r.status}: {r.note}"
            body.append([
                r.case if r.case != prev_case else "", r.provider, r.kind,
                _fmt(t.median_ms) if t else "-", _fmt(t.p20_ms) if t else "-", _fmt(t.p80_ms) if t else "-",
                _fmt(r.mem_bytes / 2**20) if r.mem_bytes is not None else "-",
                _fmt(r.gflops), _fmt(r.pct_peak, 1), _fmt(r.gbps),
                _x(r.speedup_vs_reference), _x(r.speedup_vs_best_peer), note,
            ])
            prev_case = r.case
        widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
        numeric = set(range(3, 12))

        def line(cells: list[str], widths: list[int] = widths, numeric: set[int] = numeric) -> str:
            out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(out).rstrip()

        lines.append(title)
        lines.append(line(head))
        lines.append(line(["-" * w for w in widths]))
        lines.extend(line(row) for row in body)
        lines.append("")
    if run.matmul_peak_gflops:
        lines.append(f"matmul peak (measured): {run.matmul_peak_gflops:.1f} GFLOP/s; "
                     f"wall time {run.wall_s:.1f} s")
    return "\n".join(lines)


def _ratio_line(q: RatioResult) -> str:
    if q.metric == "peak memory":
        if q.value is None:
            return f"{q.faster} peak memory: not measured"
        return (f"{q.faster} peak memory: {q.value:.4g} MB (bound <= {q.target:g} MB: "
                f"{'met' if q.met else 'MISSED'})")
    what = f"{q.faster} vs {q.slower}: "
    if q.value is None:
        return what + "not measured (a side did not run)"
    line = what + (f"{q.value:.3g}x faster" if q.value >= 1 else f"{q.value:.3g}x (slower)")
    if q.target is not None:
        bound = "<=" if q.at_most else ">="
        line += f" (target {bound} {q.target:g}: {'met' if q.met else 'MISSED'})"
    return line


def format_ratios(run: RunResult) -> str:
    """The cases' ratios, ``time(slower) / time(faster)``, grouped by case; empty without any."""
    lines: list[str] = []
    prev = None
    for q in run.ratios:
        if (q.suite, q.case) != prev:
            lines.append(f"{q.suite} | {q.case}")
            prev = (q.suite, q.case)
        lines.append("  " + _ratio_line(q))
    return ("ratios (time of the slower / time of the faster):\n" + "\n".join(lines)) if lines else ""


def format_summary(run: RunResult, meta: dict[str, Any]) -> str:
    """Markdown headline table: per case, the fastest fastarch provider and its speedups."""
    out = [f"Machine: {meta.get('device_name', '')}; torch {meta.get('torch', '')}, dtype {meta.get('dtype', '')}, "
           f"{meta.get('mode', '')} mode, {meta.get('timestamp', '')[:10]}.", "",
           "| suite | case | fastest fastarch | median ms | reference ms | vs reference | best peer | vs best peer |",
           "|---|---|---|---:|---:|---:|---|---:|"]
    cases: dict[tuple[str, str], list[ProviderResult]] = {}
    for r in run.results:
        cases.setdefault((r.suite, r.case), []).append(r)
    for (suite, case), rs in cases.items():
        ok = [r for r in rs if r.status == "ok" and r.timing is not None]
        fa = [r for r in ok if r.kind == "fastarch"]
        if not fa:
            continue
        best = min(fa, key=lambda r: r.timing.median_ms)
        ref = next((r for r in ok if r.reference), None)
        out.append(
            f"| {suite} | {case} | {best.provider} | {_fmt(best.timing.median_ms)} | "
            f"{_fmt(ref.timing.median_ms) if ref else '-'} | {_x(best.speedup_vs_reference)} | "
            f"{best.best_peer or '-'} | {_x(best.speedup_vs_best_peer)} |"
        )
    ratios = format_ratios(run)
    if ratios:
        out += ["", "```", ratios, "```"]
    return "\n".join(out) + "\n"
