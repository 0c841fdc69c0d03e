"""Decoding speed: cached (preallocated KVCache + fastarch.ops.attention) against uncached generation
(re-running the whole sequence every step, what the guide's tools amount to), greedy, on GPTModel.

    python bench/generation_headline.py [--layers 4] [--d 256] [--prompt 32] [--new 128] [--batch 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastarch.generation import generate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a shared 2-core CPU more threads mostly spin)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        from fastarch.nn import GPTModel
    except ImportError:
        print("fastarch.nn.GPTModel is not available")
        return 1
    torch.manual_seed(0)
    model = GPTModel(args.vocab, embed_dim=args.d, num_heads=args.heads, num_layers=args.layers, ff_dim=4 * args.d,
                     max_len=args.prompt + args.new, dropout=0.0).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt))
    generate(model, ids[:, :4], 4)  # warm-up (extension load)
    res = {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        out = generate(model, ids, args.new, use_cache=use_cache)
        res[use_cache] = (time.perf_counter() - t0, out)
    same = torch.equal(res[True][1], res[False][1])
    tc, tu = res[True][0], res[False][0]
    n = args.batch * args.new
    print(f"GPTModel L={args.layers} d={args.d} B={args.batch} prompt={args.prompt} new={args.new} "
          f"threads={torch.get_num_threads()}")
    print(f"  cached   : {tc:.2f} s ({n / tc:.0f} tok/s)")
    print(f"  uncached : {tu:.2f} s ({n / tu:.0f} tok/s)  -> cache speedup {tu / tc:.1f}x; identical tokens: {same}")
    t0 = time.perf_counter()
    generate(model, ids, args.new // 2, strategy="beam", num_beams=args.beams)
    tb = time.perf_counter() - t0
    print(f"  beam k={args.beams}: {tb:.2f} s for {args.new // 2} steps x {args.batch} prompts "
          f"({args.batch * args.beams * (args.new // 2) / tb:.0f} beam-tok/s, one forward per step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
