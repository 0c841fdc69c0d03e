"""``fastarch bench``: run benchmark suites and write a table, CSV, JSON and plots.

Examples::

    fastarch bench                                 # all suites, --quick, on CUDA if present else CPU
    fastarch bench --suite norms --full --out bench_out/norms
    fastarch bench --suite attention,sliding_window --providers 'fastarch-*,sdpa' --dtype bfloat16
    fastarch bench --case lsh-headline             # a named case set: a headline comparison at its sizes
    fastarch bench --list                          # suites, case sets, cases and providers, without running
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from .runner import RunOptions, SuiteEntry, case_set_entries, discover_suites, run_benchmarks
from .timing import TimingPolicy

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    out = [p.strip() for v in values for p in v.split(",") if p.strip()]
    return out or None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fastarch bench",
        description="Benchmark fastarch ops and models against the PyTorch reference and peer libraries.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Suites are discovered from fastarch/bench/suites/*.py. Results: OUT/results.csv, "
        "OUT/results.json, OUT/<suite>.png.",
    )
    ap.add_argument("--suite", action="append", metavar="NAME[,NAME]",
                    help="suite(s) to run: 'all' (default) or names such as attention, sliding_window, lsh, "
                    "selective_scan, linear_attention, s4, norms, models, hf, overhead")
    ap.add_argument("--case", action="append", metavar="NAME[,NAME]",
                    help="named case set(s) to run instead of suites, e.g. lsh-headline (see --list); "
                    "their sizes are fixed, --quick/--full only set the timing budget, and every call is "
                    "timed at least 3 times after its warm-up")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="small sizes; all suites in under 3 minutes on a 2-core CPU (default)")
    mode.add_argument("--full", dest="quick", action="store_false", help="the full sweeps")
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    ap.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                    help="input dtype (default: float32 on CPU, float16 on CUDA)")
    ap.add_argument("--out", default="bench_out", help="output directory (default: bench_out)")
    ap.add_argument("--providers", action="append", metavar="PATTERN[,PATTERN]",
                    help="only providers whose name or kind matches a glob, e.g. 'fastarch-*,sdpa' or 'peer' "
                    "(each case's reference is always kept so speedups stay defined)")
    ap.add_argument("--cases", action="append", metavar="PATTERN[,PATTERN]",
                    help="only cases matching a glob")
    ap.add_argument("--repeat", type=int, default=None,
                    help="fixed timed repetitions per provider (default: scaled to --budget)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up calls per provider (default 1 quick, 3 full)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed repetitions per provider (default 0.25 quick, 1.5 full)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="soft limit in seconds for the whole run: per-provider repetition budgets shrink to "
                    "fit (default 150 with --quick, none with --full or --case; 0 disables)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for the run (default: torch's own choice)")
    ap.add_argument("--memory", choices=("auto", "all", "none"), default="auto",
                    help="peak memory: auto = every case in --full, flagged cases in --quick (default)")
    ap.add_argument("--neighbour", action="store_true",
                    help="run a CPU-bound neighbour process (one busy core) for the whole run, as on a shared "
                    "machine; recorded in the results' machine info")
    ap.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar / progress lines")
    ap.add_argument("--toy", action="store_true", help="tiny sizes, for testing the bench machinery")
    ap.add_argument("--list", action="store_true", help="list suites, cases and providers; run nothing")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a provider raised an error")
    return ap


def _select(entries: dict[str, SuiteEntry], wanted: list[str] | None) -> list[SuiteEntry] | str:
    if not wanted or "all" in wanted:
        return list(entries.values())
    unknown = [w for w in wanted if w not in entries]
    if unknown:
        avail = ", ".join(entries) or "none"
        return f"unknown suite(s): {', '.join(unknown)} (available: all, {avail})"
    return [entries[w] for w in wanted]


def _progress(enabled: bool):
    if not enabled:
        return None, lambda: None
    bar = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=0, unit="provider", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None

    def cb(i: int, total: int, desc: str) -> None:
        if bar is not None:
            if bar.total != total:
                bar.total = total
            bar.set_description_str(desc[:70])
            bar.update(1)
        else:
            print(f"[{i}/{total}] {desc}", file=sys.stderr, flush=True)

    return cb, (bar.close if bar is not None else (lambda: None))


def _time_limit(args: argparse.Namespace) -> float | None:
    if args.time_limit is not None:
        return args.time_limit if args.time_limit > 0 else None
    return 150.0 if args.quick and not args.case else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fastarch bench``; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads is not None:
        if args.threads < 1:
            print(f"fastarch bench: argument --threads: expected a positive integer, got {args.threads}",
                  file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    entries = discover_suites()
    if args.case and args.suite:
        print("fastarch bench: give --suite or --case, not both", file=sys.stderr)
        return 2
    sel = case_set_entries(entries, _split(args.case) or []) if args.case else _select(entries, _split(args.suite))
    if isinstance(sel, str):
        print(f"fastarch bench: {sel}", file=sys.stderr)
        return 2

    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as exc:
            print(f"fastarch bench: argument --device: expected cpu, cuda or cuda:N, got {args.device!r} "
                  f"({exc})", file=sys.stderr)
            return 2
    dtype = _DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fastarch bench: no CUDA device; every suite is reported as skipped", file=sys.stderr)
    policy = TimingPolicy.for_mode(args.quick, repeat=args.repeat, warmup=args.warmup, case_set=bool(args.case))
    if args.budget is not None:
        policy.budget_s = args.budget
    opts = RunOptions(quick=args.quick, device=device, dtype=dtype, toy=args.toy,
                      providers=_split(args.providers), cases=_split(args.cases), policy=policy,
                      memory=args.memory, time_limit_s=_time_limit(args))

    if args.list:
        return _list(sel, opts)

    from .plots import plot_suites
    from .report import format_ratios, format_summary, format_table, machine_info, result_rows, write_results

    broken = [e for e in sel if e.suite is None]
    for e in broken:
        print(f"fastarch bench: suite {e.name!r} not run: {e.error}", file=sys.stderr)
    cb, close = _progress(not args.no_progress)
    neighbour = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.neighbour else None)
    try:
        run = run_benchmarks(sel, opts, progress=cb)
    finally:
        close()
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    meta = machine_info(device, dtype, args.quick)
    meta["neighbour"] = bool(args.neighbour)
    rows = result_rows(run, meta)
    out = Path(args.out)
    table = format_table(run)
    ratios = format_ratios(run)
    write_results(out, run, meta, rows, table + ("\n\n" + ratios if ratios else ""), format_summary(run, meta))
    print(table)
    if ratios:
        print(ratios)
    msg = "plots skipped (--no-plot)"
    if not args.no_plot:
        try:
            _, msg = plot_suites(run, out, title_suffix=f"{meta['device_name']}, {meta['dtype']}, "
                                 f"{meta['timestamp'][:10]}")
        except Exception as exc:  # a plotting problem never loses the results
            msg = f"plots failed: {type(exc).__name__}: {exc}"
    print(f"results: {out / 'results.csv'}, {out / 'results.json'}, table.txt, summary.md; {msg}")
    errors = [r for r in run.results if r.status == "error"]
    return 1 if (args.strict and errors) else 0


def _list(sel: list[SuiteEntry], opts: RunOptions) -> int:
    from .core import BenchConfig, Skip

    cfg = BenchConfig(quick=opts.quick, device=opts.device, dtype=opts.dtype, toy=opts.toy)
    for e in sel:
        if e.suite is None:
            print(f"{e.name}: NOT AVAILABLE: {e.error}")
            continue
        print(f"{e.name}: {e.suite.description}")
        if e.suite.case_sets and e.case_set is None:
            print(f"  case sets (--case): {', '.join(e.suite.case_sets)}")
        try:
            cases = e.suite.cases_for(cfg, e.case_set)
        except Skip as exc:
            print(f"  skipped: {exc}")
            continue
        except Exception as exc:
            print(f"  cases() failed: {type(exc).__name__}: {exc}")
            continue
        for c in cases:
            print(f"  {c.name}: " + ", ".join(f"{p.name} ({p.kind})" for p in c.providers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
