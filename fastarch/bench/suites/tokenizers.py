"""Tokenizer training and encoding: fastarch's BPE (incremental pair counts) against the seed guide's
algorithm (recount every pair and rewrite every word per merge) and, when installed, HuggingFace
``tokenizers``' BPE trainer.

The corpus is synthetic and deterministic (:func:`synthetic_corpus`): pseudo-words from syllables drawn
with Zipf frequencies. The headline (8k merges on 10 MB) is ``bench/tokenizer_headline.py``; the cases
here are small enough for the quick sweep (the guide's algorithm is ~100x slower).
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..core import BenchConfig, Case, Provider, Skip, Suite

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


def guide_bpe_train(texts: list[str], num_merges: int) -> list[tuple[str, str]]:
    """The seed guide's training loop (full recount per merge), with the end-of-word marker fixed."""
    freq = Counter(w for t in texts for w in t.lower().split())
    words = {" ".join(list(w[:-1]) + [w[-1] + "</w>"]): c for w, c in freq.items()}
    merges = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            s = w.split()
            for p in zip(s, s[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=pairs.get)
        big, rep = " ".join(best), "".join(best)
        words = {w.replace(big, rep): c for w, c in words.items()}
        merges.append(best)
    return merges


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


SUITE = Suite(name="tokenizers", description="BPE training (incremental vs the guide's recount) and encoding",
              cases=cases)
