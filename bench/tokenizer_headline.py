"""Headline: train BPE to 8k merges on ~10 MB of text (target: under 60 s on the 2-core CI CPU).

The corpus is synthetic and deterministic: a 30k-entry word list of pseudo-words built from syllables,
drawn with Zipf frequencies (p(rank r) ~ 1/r^1.05), ~10 MB of text in lines of 12 words. Also reports the
naive full-recount-per-merge baseline (the guide's algorithm) extrapolated from its first merges, and the
encoding throughput of the trained tokenizer.

    python bench/tokenizer_headline.py [--mb 10] [--merges 8000] [--baseline-merges 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastarch.bench.suites.tokenizers import guide_bpe_train, synthetic_corpus  # noqa: E402
from fastarch.tokenizers import BPETokenizer  # noqa: E402


def naive_merge_seconds(texts: list[str], merges: int) -> float:
    """The guide's algorithm (recount all pairs, rewrite every word, per merge): seconds per merge."""
    t0 = time.perf_counter()
    guide_bpe_train(texts, merges)
    return (time.perf_counter() - t0) / merges


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--merges", type=int, default=8000)
    ap.add_argument("--baseline-merges", type=int, default=20, help="0 to skip the naive baseline")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    texts = synthetic_corpus(args.mb)
    nbytes = sum(len(t) + 1 for t in texts)
    t_gen = time.perf_counter() - t0
    print(f"corpus: {nbytes / 1e6:.2f} MB, {len(texts)} lines, generated in {t_gen:.1f} s")

    tok = BPETokenizer()
    t0, c0 = time.perf_counter(), time.process_time()
    tok.train(texts, num_merges=args.merges)
    t_train, c_train = time.perf_counter() - t0, time.process_time() - c0
    print(f"fastarch BPE: {len(tok.merges)} merges, vocab {len(tok)}, trained in {t_train:.1f} s wall "
          f"({c_train:.1f} s CPU) "
          f"(target < 60 s) -> {'PASS' if t_train < 60 and len(tok.merges) == args.merges else 'FAIL'}")

    sample = texts[:20_000]
    sb = sum(len(t) + 1 for t in sample)
    t0 = time.perf_counter()
    n_tok = sum(len(tok.encode(t, add_special_tokens=False)) for t in sample)
    t_enc = time.perf_counter() - t0
    print(f"encode: {sb / 1e6 / t_enc:.2f} MB/s ({n_tok} tokens for {sb / 1e6:.2f} MB)")

    if args.baseline_merges:
        per = naive_merge_seconds(texts, args.baseline_merges)
        est = per * args.merges
        print(f"naive full recount (guide algorithm): {per:.3f} s/merge -> ~{est:.0f} s for {args.merges} "
              f"merges (extrapolated); speedup ~{est / t_train:.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
