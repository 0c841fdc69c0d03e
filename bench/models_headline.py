"""Headline comparison of issue 7: forward+backward of whole models, fastarch.nn vs the seed guides' code on
the same weights, CPU. Prints each provider's median time and the speedup over the guide.

    python bench/models_headline.py            # the issue's sizes (GPT d512x8 L1024, ViT-S/16 B8,
                                                # Longformer-style L8192, 4-layer LSTM L512)
    python bench/models_headline.py --quick    # small sizes, seconds
    python bench/models_headline.py --only gpt,lstm --reps 3
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from fastarch.bench.core import BenchConfig, Skip  # noqa: E402
from fastarch.bench.suites.models import cases  # noqa: E402


def _time(fn, reps: int) -> float:
    fn()  # warm-up (also builds any extension)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)  # min: the shared machine adds large random stalls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--only", default="", help="comma-separated case prefixes: gpt,vit_s16,longformer,lstm")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = [s for s in args.only.split(",") if s]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, quick={args.quick}")
    for case in cases(BenchConfig(quick=args.quick)):
        if only and not any(case.name.startswith(o) for o in only):
            continue
        times = {}
        for p in case.providers:
            try:
                times[p.name] = _time(p.setup(), args.reps)
            except Skip as e:
                print(f"  {p.name}: skipped ({e})")
        ref = times.get(case.reference)
        print(case.name)
        for name, t in times.items():
            ratio = f"{ref / t:6.2f}x vs guide" if ref else ""
            print(f"  {name:16s} {t * 1e3:10.1f} ms  {ratio}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
