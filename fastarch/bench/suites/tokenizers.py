"""Tokenizer training and encoding: fastarch's BPE (incremental pair counts) against the seed guide's
algorithm (recount every pair and rewrite every word per merge) and, when installed, HuggingFace
``tokenizers``' BPE trainer.

The corpus is synthetic and deterministic (:func:`synthetic_corpus`): pseudo-words from syllables drawn
with Zipf frequencies. The cases of the sweep are small enough for the quick run (the guide's algorithm is
much slower).
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from typing import Any

from fastarch.testing import guides

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite

ONSETS = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
          "br", "cl", "dr", "fr", "gr", "pl", "pr", "sh", "st", "str", "th", "tr", "ch", "qu", "sp"]
NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "ie", "y"]
CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "x"]


@functools.lru_cache(maxsize=4)
def word_list(n: int, seed: int = 0) -> tuple[str, ...]:
    """``n`` distinct pseudo-words of 1-4 syllables (deterministic)."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        k = rng.choices([1, 2, 3, 4], [0.25, 0.4, 0.25, 0.1])[0]
        w = "".join(rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS) for _ in range(k))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return tuple(words)


def synthetic_corpus(megabytes: float, n_words: int = 30_000, seed: int = 0, zipf_s: float = 1.05) -> list[str]:
    """About ``megabytes`` MB of lines of 12 words drawn with Zipf frequencies ``p(rank r) ~ r^-s``."""
    words = word_list(n_words, seed)
    cum = list(itertools.accumulate(1.0 / (r + 1) ** zipf_s for r in range(n_words)))
    rng = random.Random(seed + 1)
    target = int(megabytes * 1_000_000)
    lines: list[str] = []
    size = 0
    while size < target:
        chunk = rng.choices(words, cum_weights=cum, k=12_000)
        for i in range(0, len(chunk), 12):
            line = " ".join(chunk[i:i + 12])
            lines.append(line)
            size += len(line) + 1
            if size >= target:
                break
    return lines


guide_bpe_train = guides.bpe_train


def _fastarch_train(texts: list[str], merges: int) -> Callable[[], Any]:
    from fastarch.tokenizers import BPETokenizer

    def run() -> Any:
        tok = BPETokenizer()
        tok.train(texts, num_merges=merges)
        return tok
    return run


def _hf_train(texts: list[str], merges: int) -> Callable[[], Any]:
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise Skip("not installed") from None
    alphabet = len({c for t in texts for c in t})

    def run() -> Any:
        tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.BpeTrainer(vocab_size=alphabet * 2 + merges, show_progress=False,
                                      end_of_word_suffix="</w>")
        tok.train_from_iterator(texts, trainer)
        return tok
    return run


def _encode(texts: list[str], train_mb_lines: list[str], merges: int) -> Callable[[], Any]:
    from fastarch.tokenizers import BPETokenizer

    tok = BPETokenizer()
    tok.train(train_mb_lines, num_merges=merges)

    def run() -> Any:
        tok._cache.clear()  # time the merge loop, not the per-word cache
        return [tok.encode(t, add_special_tokens=False) for t in texts]
    return run


def cases(cfg: BenchConfig) -> list[Case]:
    sizes = [(0.02, 50)] if cfg.quick or cfg.toy else [(0.02, 50), (1.0, 2000), (10.0, 8000)]
    out = []
    for mb, merges in sizes:
        texts = synthetic_corpus(mb)
        providers = [Provider("fastarch", "fastarch", lambda t=texts, m=merges: _fastarch_train(t, m)),
                     Provider("hf-tokenizers", "peer", lambda t=texts, m=merges: _hf_train(t, m),
                              peer_package="tokenizers")]
        if mb <= 1.0:
            providers.append(Provider("reference", "reference",
                                      lambda t=texts, m=merges: (lambda: guide_bpe_train(t, m))))
        out.append(Case(name=f"bpe_train MB={mb:g},merges={merges}", params={"MB": mb, "merges": merges},
                        flops=None, providers=providers, reference="reference" if mb <= 1.0 else "fastarch",
                        bytes=mb * 1e6, x="MB", group="bpe_train"))
    texts = synthetic_corpus(0.05, seed=3)
    out.append(Case(name="bpe_encode MB=0.05", params={"MB": 0.05}, flops=None, bytes=0.05e6, x="MB",
                    group="bpe_encode", reference="fastarch",
                    providers=[Provider("fastarch", "fastarch", lambda: _encode(texts, synthetic_corpus(0.2), 500))]))
    return out


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """BPE training to 8,000 merges on 10 MB of text (bar: under 60 s on a 2-core CPU) against HuggingFace
    ``tokenizers`` and the guide's algorithm (timed over its first 20 merges and extrapolated to 8,000: it
    would take too long whole), and the encoding throughput of the trained tokenizer."""
    mb, merges, timed_merges, lines = (0.05, 100, 5, 200) if cfg.toy else (10.0, 8000, 20, 20_000)
    texts = synthetic_corpus(mb)
    scale = merges / timed_merges
    train = Case(name=f"bpe_train MB={mb:g},merges={merges}", params={"MB": mb, "merges": merges}, flops=None,
                 bytes=mb * 1e6, x="MB", group="bpe_train", reference="reference",
                 providers=[Provider("fastarch", "fastarch", lambda: _fastarch_train(texts, merges)),
                            Provider("hf-tokenizers", "peer", lambda: _hf_train(texts, merges),
                                     peer_package="tokenizers"),
                            Provider("reference", "reference", lambda: (lambda: guide_bpe_train(texts, timed_merges)),
                                     scale=scale)],
                 ratios=(Ratio("fastarch", "reference"), Ratio("fastarch", "hf-tokenizers")))
    sample = texts[:lines]
    nbytes = sum(len(t) + 1 for t in sample)
    encode = Case(name=f"bpe_encode lines={len(sample)}", params={"MB": nbytes / 1e6}, flops=None, bytes=nbytes,
                  x="MB", group="bpe_encode", reference="fastarch",
                  providers=[Provider("fastarch", "fastarch", lambda: _encode(sample, texts, merges))])
    return [train, encode]


SUITE = Suite(name="tokenizers", description="BPE training (incremental vs the guide's recount) and encoding",
              cases=cases, case_sets={"tokenizer-headline": headline_cases})
