"""Issue-9 headline: fastarch's fused C++ AdamW step against torch.optim.AdamW (foreach and fused) on CPU.

    python bench/optim_headline.py [--threads 1,2] [--budget 2.0] [--small]

Runs the optim suite's headline cases (a 24.6M-parameter GPT-style model in 148 tensors, and 5000 small
tensors) through the bench runner, every provider in the same process on the same parameter set, once per
thread count, and prints the step times and the fused kernel's ratio to each other provider. ``--small``
uses the quick cases instead (for a fast check).

On a shared machine, timings with several threads suffer from other processes: every parallel region waits
for its slowest thread, and the foreach paths open one region per tensor per op (~1000 per step here)
where the fused kernel opens one. The single-thread figures are the cleaner comparison of the kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fastarch.bench.core import BenchConfig, Suite  # noqa: E402
from fastarch.bench.runner import RunOptions, discover_suites, run_benchmarks  # noqa: E402
from fastarch.bench.timing import TimingPolicy  # noqa: E402

PROVIDERS = ("fastarch-fused", "fastarch-foreach", "torch-foreach", "torch-fused")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed steps per provider")
    ap.add_argument("--small", action="store_true", help="the quick cases instead of the headline sizes")
    a = ap.parse_args()
    import fastarch.bench.suites.optim as optim_suite

    cfg = BenchConfig(device=torch.device("cpu"), quick=a.small)
    cases = optim_suite.cases(cfg) if a.small else optim_suite.headline_cases(cfg)
    worst = True
    for nt in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(nt)
        entry = discover_suites()["optim"]
        entry.suite = Suite("optim", "headline", lambda _cfg: cases)
        run = run_benchmarks([entry], RunOptions(policy=TimingPolicy(budget_s=a.budget, warmup=2, min_reps=5),
                                                 memory="none"))
        print(f"\n== {nt} thread(s), fp32, torch {torch.__version__}")
        for case in cases:
            res = {r.provider: r for r in run.results if r.case == case.name}
            print(case.name)
            for name in PROVIDERS:
                r = res.get(name)
                if r is None or r.status != "ok" or r.timing is None:
                    print(f"  {name:17s} {r.status if r else 'missing'}: {r.note if r else ''}")
                    continue
                t = r.timing
                print(f"  {name:17s} {t.median_ms:9.2f} ms  (p20 {t.p20_ms:.2f}, p80 {t.p80_ms:.2f})  "
                      f"{(r.gbps or 0):6.2f} GB/s")
            fused = res.get("fastarch-fused")
            if fused is None or fused.status != "ok":
                print("  fastarch-fused did not run")
                worst = False
                continue
            for name in PROVIDERS[1:]:
                r = res.get(name)
                if r is not None and r.status == "ok":
                    ratio = r.timing.median_ms / fused.timing.median_ms
                    print(f"  fastarch-fused vs {name:17s} {ratio:6.2f}x faster")
                    if name == "torch-fused" and ratio < 1.0:
                        worst = False
    print("\nfused beats torch's fused AdamW in every case above" if worst else
          "\nfused does NOT beat torch's fused AdamW in every case above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
