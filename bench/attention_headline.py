"""Headline CPU comparison for fastarch.ops.attention (issue 3).

Sliding window: B=1, H=8, L=8192, D=64, window (256, 256), fp32, forward — fastarch's C++ kernel vs
``flex_attention`` with a sliding-window block mask under ``torch.compile`` (timed after compilation, in the
same run) and dense masked SDPA. Full and causal: C++ kernel vs ``F.scaled_dot_product_attention``.
Memory: L=65536, window 128, peak RSS growth of the forward.

Run: ``python bench/attention_headline.py [--quick] [--skip-flex] [--skip-dense]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastarch.ops.attention import attention  # noqa: E402


def timeit(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def interleaved(fns: dict, reps: int) -> dict:
    """Round-robin timing of several callables (one warm-up each): {name: (min s, median s)}.

    On a machine shared with other jobs the load drifts; interleaving exposes every provider to the same
    drift, and the minimum is the least disturbed run."""
    for f in fns.values():
        f()
    ts: dict = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            t = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t)
    return {n: (min(v), statistics.median(v)) for n, v in ts.items()}


def sliding_vs_flex(L: int, w: int, reps: int) -> None:
    """fastarch cpp and compiled flex_attention, interleaved in one loop."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

    def win(b, h, qi, kj):
        return (qi - kj <= w) & (kj - qi <= w)

    bm = create_block_mask(win, None, None, L, L, device="cpu")
    flex = torch.compile(flex_attention)
    with torch.no_grad():
        t0 = time.perf_counter()
        flex(q, k, v, block_mask=bm)
        print(f"  (flex compile + first call {time.perf_counter() - t0:.1f} s)")
        r = interleaved({"cpp": lambda: attention(q, k, v, window=(w, w), backend="cpp"),
                         "flex": lambda: flex(q, k, v, block_mask=bm)}, reps)
    (c_min, c_med), (f_min, f_med) = r["cpp"], r["flex"]
    print(f"interleaved L={L} w={w}: fastarch cpp min {c_min * 1e3:.1f} / median {c_med * 1e3:.1f} ms; "
          f"flex min {f_min * 1e3:.1f} / median {f_med * 1e3:.1f} ms; speed-up x{f_min / c_min:.2f} (min), "
          f"x{f_med / c_med:.2f} (median)")


def sliding(L: int, w: int, reps: int, skip_flex: bool, skip_dense: bool) -> None:
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    with torch.no_grad():
        t_cpp = timeit(lambda: attention(q, k, v, window=(w, w), backend="cpp"), reps)
        print(f"sliding L={L} w={w}: fastarch cpp        {t_cpp * 1e3:8.1f} ms")
        if not skip_flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def win(b, h, qi, kj):
                return (qi - kj <= w) & (kj - qi <= w)

            bm = create_block_mask(win, None, None, L, L, device="cpu")
            flex = torch.compile(flex_attention)
            t0 = time.perf_counter()
            ref = flex(q, k, v, block_mask=bm)
            print(f"  (flex compile + first call {time.perf_counter() - t0:.1f} s)")
            err = (ref - attention(q, k, v, window=(w, w), backend="cpp")).abs().max().item()
            t_flex = timeit(lambda: flex(q, k, v, block_mask=bm), reps)
            print(f"sliding L={L} w={w}: flex (compiled)     {t_flex * 1e3:8.1f} ms   "
                  f"fastarch speed-up x{t_flex / t_cpp:.2f}  (max |diff| {err:.1e})")
        if not skip_dense:
            i = torch.arange(L)
            mask = (i[:, None] - i[None, :]).abs() <= w
            t_dense = timeit(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), max(1, reps // 2))
            print(f"sliding L={L} w={w}: dense masked SDPA   {t_dense * 1e3:8.1f} ms   "
                  f"fastarch speed-up x{t_dense / t_cpp:.2f}")


def full_causal(L: int, reps: int) -> None:
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    with torch.no_grad():
        for causal in (False, True):
            r = interleaved({
                "sdpa": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                "cpp": lambda c=causal: attention(q, k, v, causal=c, backend="cpp"),
            }, reps)
            (s_min, s_med), (c_min, c_med) = r["sdpa"], r["cpp"]
            name = "causal" if causal else "full"
            print(f"{name:6s} L={L} (interleaved): SDPA min {s_min * 1e3:7.1f} / median {s_med * 1e3:7.1f} ms | "
                  f"cpp kernel min {c_min * 1e3:7.1f} / median {c_med * 1e3:7.1f} ms | "
                  f"x{s_min / c_min:.2f} (min), x{s_med / c_med:.2f} (median) vs SDPA")


def backward(L: int, w: int, reps: int) -> None:
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))

    def step():
        o = attention(q, k, v, window=(w, w), backend="cpp")
        o.sum().backward()

    t = timeit(step, reps)
    print(f"sliding L={L} w={w}: fastarch cpp forward+backward {t * 1e3:8.1f} ms")


def memory(L: int, w: int) -> None:
    """Peak RSS growth of one forward at L (fresh process gives the cleanest reading)."""
    B, H, D = 1, 8, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    with torch.no_grad():
        attention(q, k, v, window=(w, w), backend="cpp")
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    inputs = 3 * q.numel() * 4 / 2**20
    print(f"memory L={L} w={w}: forward {dt * 1e3:.0f} ms, peak RSS {peak / 1024:.0f} MiB "
          f"(growth during the call {(peak - base) / 1024:.0f} MiB; inputs {inputs:.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (L=2048)")
    ap.add_argument("--skip-flex", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only-flex", action="store_true", help="just the interleaved cpp vs flex comparison")
    ap.add_argument("--only-full", action="store_true", help="just full/causal vs SDPA")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    L = 2048 if args.quick else 8192
    if args.only_flex:
        sliding_vs_flex(L, 256, args.reps)
        return
    if args.only_full:
        full_causal(2048 if args.quick else 4096, args.reps)
        return
    memory(65536 if not args.quick else 16384, 128)
    sliding(L, 256, args.reps, args.skip_flex, args.skip_dense)
    if not args.skip_flex:
        sliding_vs_flex(L, 256, args.reps)
    full_causal(2048 if args.quick else 4096, args.reps)
    backward(L, 256, max(1, args.reps // 2))


if __name__ == "__main__":
    main()
