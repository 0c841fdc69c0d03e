"""Headline CPU comparison for the selective scan (issue 5): fastarch's C++ backend against the reference.

Run from the repo root: ``python bench/selective_scan_headline.py [--quick]``. Prints times and ratios for
the forward, forward+backward and peak-memory estimates at B=2, D=1536, L=2048, N=16 (fp32), and a
MambaBlock (d_model=768, L=2048) forward+backward against the seed guide's version.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastarch.ops.selective_scan import selective_scan, selective_scan_ref  # noqa: E402


def bench(fn, reps: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def scan_inputs(b: int, d: int, L: int, n: int, grad: bool = False):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(b, d, L, generator=g)
    delta = torch.randn(b, d, L, generator=g) * 0.5
    A = -torch.rand(d, n, generator=g) - 0.5
    B = torch.randn(b, n, L, generator=g)
    C = torch.randn(b, n, L, generator=g)
    D = torch.randn(d, generator=g)
    z = torch.randn(b, d, L, generator=g)
    bias = torch.randn(d, generator=g) * 0.1
    ts = [u, delta, A, B, C, D, z, bias]
    if grad:
        ts = [t.requires_grad_() for t in ts]
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller L (512) for a fast check")
    ap.add_argument("--no-block", action="store_true", help="skip the MambaBlock comparison")
    args = ap.parse_args()
    b, d, L, n = 2, 1536, (512 if args.quick else 2048), 16
    print(f"selective_scan B={b} D={d} L={L} N={n} fp32, threads={torch.get_num_threads()}")
    ins = scan_inputs(b, d, L, n)
    with torch.no_grad():
        t_ref = bench(lambda: selective_scan_ref(*ins, delta_softplus=True), reps=2)
        t_cpp = bench(lambda: selective_scan(*ins, delta_softplus=True, backend="cpp"), reps=5)
    print(f"forward      reference {t_ref * 1e3:9.1f} ms   cpp {t_cpp * 1e3:8.1f} ms   speedup {t_ref / t_cpp:6.1f}x")

    gi = scan_inputs(b, d, L, n, grad=True)

    def fb(fn):
        def run():
            for t in gi:
                t.grad = None
            fn(*gi, delta_softplus=True).sum().backward()
        return run

    t_ref_fb = bench(fb(selective_scan_ref), reps=1)
    t_cpp_fb = bench(fb(lambda *a, **k: selective_scan(*a, **k, backend="cpp")), reps=3)
    print(f"fwd+bwd      reference {t_ref_fb * 1e3:9.1f} ms   cpp {t_cpp_fb * 1e3:8.1f} ms   "
          f"speedup {t_ref_fb / t_cpp_fb:6.1f}x")
    # Memory the backward keeps: inputs + checkpoints (B*D*L*N/CHUNK) vs the reference's B*D*L*N tensors.
    from fastarch.ops.selective_scan import CHUNK
    bdl = b * d * L * 4
    print(f"saved state  cpp checkpoints {b * d * ((L + CHUNK - 1) // CHUNK) * n * 4 / 2**20:.1f} MiB "
          f"(B*D*L fp32 = {bdl / 2**20:.1f} MiB); reference keeps >= 3 x B*D*L*N = {3 * bdl * n / 2**20:.0f} MiB")

    if not args.no_block:
        from fastarch.nn.mamba import MambaBlock
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "nn"))
        from test_mamba import GuideMambaBlock

        torch.manual_seed(0)
        Lb = 512 if args.quick else 2048
        guide = GuideMambaBlock(768).eval()
        fast = MambaBlock(768).eval()
        fast.load_state_dict(guide.state_dict())
        x = torch.randn(1, Lb, 768, requires_grad=True)

        def step(m):
            def run():
                x.grad = None
                m.zero_grad(set_to_none=True)
                m(x).sum().backward()
            return run

        t_g = bench(step(guide), reps=1)
        t_f = bench(step(fast), reps=3)
        print(f"MambaBlock fwd+bwd d_model=768 L={Lb} B=1: guide {t_g * 1e3:9.1f} ms   fastarch {t_f * 1e3:8.1f} ms"
              f"   speedup {t_g / t_f:6.1f}x")


if __name__ == "__main__":
    main()
