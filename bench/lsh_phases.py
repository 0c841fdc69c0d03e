"""Where the C++ LSH attention forward spends its time: rotations, hash, sort and chunk attention timed
apart by calling the extension's entry points directly, at issue 4's headline size by default.

    python bench/lsh_phases.py [--L 16384] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastarch.extensions import load_extension  # noqa: E402
from fastarch.ops.lsh_attention import lsh_attention, lsh_n_buckets, lsh_rotations  # noqa: E402


def timed(name: str, fn, repeat: int):
    """Print the median and minimum of ``repeat`` calls after a warm-up call; return the last result."""
    out = fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    print(f"{name:10} median {statistics.median(ts) * 1e3:8.1f} ms   min {min(ts) * 1e3:8.1f} ms")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    B, H, L, D, NH, BS = 1, 8, args.L, 64, 4, 64
    lib = load_extension("lsh_attention", "cpu")
    g = torch.Generator().manual_seed(0)
    qk = torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    nb = lsh_n_buckets(L, BS)
    print(f"B={B} H={H} L={L} D={D} n_hashes={NH} bucket_size={BS}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        rot = timed("rotations", lambda: lsh_rotations(D, NH, nb, seed=0), args.repeat)
        buckets = timed("hash", lambda: lib.lsh_hash(qk, rot), args.repeat)
        perm, inv = timed("sort", lambda: lib.lsh_sort(buckets, BS, nb), args.repeat)
        timed("attention", lambda: lib.lsh_fwd(qk, v, perm, inv, None, False, BS), args.repeat)
        timed(
            "whole op",
            lambda: lsh_attention(qk, v, n_hashes=NH, bucket_size=BS, seed=0, backend="cpp"),
            args.repeat,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
