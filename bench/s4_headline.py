"""Issue 6 headline: S4 convolution mode at L=16384 against the seed guide's loop.

fastarch.nn.S4Layer's state-space part in convolution mode (``ssm``: S4D kernel from the fused C++
Vandermonde op + FFT convolution + D skip; what the guide's layer computes) and the whole layer (plus
GELU, Linear(H, 2H), GLU, which the guide does not have) vs the guide's S4Layer (Python loop over time),
forward in eval mode, B=1, d_state=64. Also times the kernel generation alone (C++ vs chunked PyTorch).

Timings on the shared CPU vary by 2x between calls, so the SSM's median and minimum are both printed.

Usage: python bench/s4_headline.py [--L 16384] [--d-model 64 256] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastarch.bench.suites.s4 import GuideS4Layer  # noqa: E402
from fastarch.nn import S4Layer  # noqa: E402


def times(fn, repeat: int) -> list[float]:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def median_time(fn, repeat: int) -> float:
    return statistics.median(times(fn, repeat))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--d-state", type=int, default=64)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    print(f"L={a.L} B={a.B} d_state={a.d_state}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    for h in a.d_model:
        print(run_one(h, a))


def run_one(h: int, a: argparse.Namespace) -> str:
    x = torch.randn(a.B, a.L, h)
    ours = S4Layer(h, a.d_state, dropout=0.0).eval()
    guide = GuideS4Layer(h, a.d_state, dropout=0.0).eval()
    with torch.no_grad():
        t_ours = median_time(lambda: ours(x), a.repeat)
        core = times(lambda: ours.ssm(x), a.repeat)
        t_core, t_core_min = statistics.median(core), min(core)
        t_kernel = median_time(lambda: ours.kernel(a.L), a.repeat)
        ours.backend = "torch"
        t_kernel_torch = median_time(lambda: ours.kernel(a.L), 1)
        ours.backend = None
        t_guide = median_time(lambda: guide(x), 3)
    return (f"d_model={h}: guide loop {t_guide * 1e3:.0f} ms | fastarch SSM conv mode (kernel + FFT conv + D) "
            f"{t_core * 1e3:.1f} ms median -> {t_guide / t_core:.1f}x (target >= 20), {t_core_min * 1e3:.1f} ms min -> "
            f"{t_guide / t_core_min:.1f}x | whole S4Layer incl. GELU + "
            f"Linear(H, 2H) + GLU, which the guide lacks, {t_ours * 1e3:.1f} ms -> {t_guide / t_ours:.1f}x | "
            f"kernel generation: cpp {t_kernel * 1e3:.1f} ms, torch {t_kernel_torch * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
