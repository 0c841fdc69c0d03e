"""Issue-2 headline: fused C++ LayerNorm forward+backward vs the guide-003 composed LayerNorm on CPU.

    python bench/norms_headline.py [--rows 8192] [--width 1024]

Runs the norms suite's ``layer_norm fwd+bwd`` case through the bench runner (same inputs, same process
for every provider) and prints the speedups; the bar is fastarch-cpp >= 3x over the reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from fastarch.bench.runner import RunOptions, discover_suites, run_benchmarks  # noqa: E402
from fastarch.bench.timing import TimingPolicy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=1.0)
    a = ap.parse_args()
    import fastarch.bench.suites.norms as norms

    cfg_case = norms._norm_case("layer_norm", a.rows, a.width, True,
                                norms.BenchConfig(device=torch.device("cpu")))
    entry = discover_suites()["norms"]
    # A one-case suite with the requested size, run by the same runner as `fastarch bench`.
    entry.suite = norms.Suite("norms", "headline", lambda cfg: [cfg_case])
    run = run_benchmarks([entry], RunOptions(policy=TimingPolicy(budget_s=a.budget, warmup=2, min_reps=5),
                                             memory="none"))
    res = {r.provider: r for r in run.results}
    print(f"LayerNorm fwd+bwd, rows={a.rows}, width={a.width}, fp32, {torch.get_num_threads()} threads")
    for name, r in res.items():
        if r.status != "ok":
            print(f"  {name:16s} {r.status}: {r.note}")
            continue
        t = r.timing
        print(f"  {name:16s} {t.median_ms:9.2f} ms (p20 {t.p20_ms:.2f}, p80 {t.p80_ms:.2f})  "
              f"vs reference {r.speedup_vs_reference:.2f}x")
    cpp = res.get("fastarch-cpp")
    if cpp is None or cpp.status != "ok":
        print("fastarch-cpp did not run")
        return 1
    ok = cpp.speedup_vs_reference >= 3.0
    print(f"issue-2 bar (fastarch-cpp >= 3x reference): {cpp.speedup_vs_reference:.2f}x -> "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
