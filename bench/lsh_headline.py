"""Issue 4's headline: CPU, B=1, H=8, L=16384, D=64, n_hashes=4, bucket_size=64, fp32, forward.

fastarch's C++ LSH attention against reformer_pytorch.LSHAttention (same settings, if installed) and dense
SDPA, in the same run; then the crossover length against dense SDPA. Prints times and ratios.

    python bench/lsh_headline.py [--L 16384] [--repeat 3] [--no-crossover]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastarch.ops.lsh_attention import lsh_attention  # noqa: E402


def timeit(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up call."""
    with torch.no_grad():
        fn()
        ts = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-crossover", action="store_true")
    args = ap.parse_args()
    B, H, L, D, NH, BS = 1, 8, args.L, 64, 4, 64
    g = torch.Generator().manual_seed(0)
    qk = torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.1f}")
    print(f"B={B} H={H} L={L} D={D} n_hashes={NH} bucket_size={BS} fp32 forward, CPU")

    def fa():
        return lsh_attention(qk, v, n_hashes=NH, bucket_size=BS, seed=0, backend="cpp")

    def sdpa():
        return F.scaled_dot_product_attention(qk, qk, v)

    providers = {"fastarch-cpp": fa, "sdpa-dense": sdpa}
    try:
        from reformer_pytorch import LSHAttention
    except ImportError:
        print("reformer-pytorch   not installed (pip install reformer-pytorch)")
    else:
        mod = LSHAttention(bucket_size=BS, n_hashes=NH, causal=False)
        qk3, v3 = qk.reshape(B * H, L, D), v.reshape(B * H, L, D)
        providers["reformer-pytorch"] = lambda: mod(qk3, v3)
    # Interleaved rounds (one call of each provider per round, after a warm-up call): the machine may be
    # shared, so ratios are taken within a round and their median reported.
    times: dict[str, list[float]] = {k: [] for k in providers}
    with torch.no_grad():
        for fn in providers.values():
            fn()
        for _ in range(args.repeat):
            for name, fn in providers.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    t_fa = statistics.median(times["fastarch-cpp"])
    print(f"{'fastarch-cpp':18} {t_fa * 1e3:9.1f} ms (median of {args.repeat})")
    for name in providers:
        if name == "fastarch-cpp":
            continue
        ratios = [a / b for a, b in zip(times[name], times["fastarch-cpp"])]
        print(
            f"{name:18} {statistics.median(times[name]) * 1e3:9.1f} ms   fastarch is "
            f"{statistics.median(ratios):5.1f}x faster (per-round ratios: "
            f"{', '.join(f'{r:.1f}' for r in ratios)})"
        )

    if not args.no_crossover:
        print("\ncrossover against dense SDPA (same B, H, D):")
        print(f"{'L':>7} {'fastarch ms':>12} {'sdpa ms':>10} {'sdpa/fastarch':>14}")
        for n in (256, 512, 1024, 2048, 4096, 8192):
            q = torch.randn(B, H, n, D, generator=g)
            w = torch.randn(B, H, n, D, generator=g)
            a = timeit(
                lambda q=q, w=w: lsh_attention(q, w, n_hashes=NH, bucket_size=BS, seed=0, backend="cpp"), 3
            )
            s = timeit(lambda q=q, w=w: F.scaled_dot_product_attention(q, q, w), 3)
            print(f"{n:>7} {a * 1e3:12.1f} {s * 1e3:10.1f} {s / a:14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
