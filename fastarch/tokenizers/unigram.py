"""Unigram language-model tokenizer: EM over a seed vocabulary, pruning by loss, Viterbi segmentation.

Guide-003 ``UnigramTokenizer(vocab_size=1000, unk_token='<UNK>')`` with ``train(texts)``, ``encode(text)``,
``viterbi_segment`` and ``token_probs``. Training (Kudo, 2018):

1. seed vocabulary: every character, plus the most frequent substrings (up to ``max_piece_length``
   characters) of the words, ``seed_size_factor * vocab_size`` of them;
2. EM: the E-step runs forward-backward over each word's segmentation lattice to get the expected count
   of every piece; the M-step sets ``p(piece) = expected count / total``;
3. pruning: for every multi-character piece, the loss of removing it is its Viterbi count times the drop
   in log-likelihood when its occurrences are re-segmented without it; the pieces with the smallest loss
   are removed (``shrink_factor`` of the vocabulary per round) until ``vocab_size`` is reached, with EM
   between rounds. Single characters are never removed, so every seen character stays encodable.

Deviations from the guide (whose pruning removed the least frequent substring, "approximately"): the real
algorithm above; each word is prefixed with the boundary marker ``▁`` so that ``decode`` can restore the
spaces; ``encode`` returns ids (``tokenize`` returns the token strings).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from .io import BaseTokenizer, TokenizerFileError, require
from .pipeline import byte_token

__all__ = ["UnigramTokenizer"]

SPACE = "\u2581"


def _logsumexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


class UnigramTokenizer(BaseTokenizer):
    """Unigram tokenizer (see the module docstring)."""

    def __init__(self, vocab_size: int = 1000, unk_token: str = "<UNK>", *, lowercase: bool = True,
                 pad_token: str | None = "<pad>", bos_token: str | None = None, eos_token: str | None = None,
                 max_piece_length: int = 16, seed_size_factor: int = 4, shrink_factor: float = 0.75,
                 em_iterations: int = 2) -> None:
        super().__init__()
        self._configure(vocab_size, lowercase, pad_token=pad_token, unk_token=unk_token, bos_token=bos_token,
                        eos_token=eos_token)
        if not 0.0 < shrink_factor < 1.0:
            raise ValueError(f"UnigramTokenizer: argument 'shrink_factor' must be in (0, 1), got {shrink_factor}")
        self.unk_token = unk_token
        self.max_piece_length = max_piece_length
        self.seed_size_factor = seed_size_factor
        self.shrink_factor = shrink_factor
        self.em_iterations = em_iterations
        self.token_probs: dict[str, float] = {}
        self._logp: dict[str, float] = {}
        # an unknown character run becomes its <0xHH> byte tokens instead of unk_token (tokenizer.json files)
        self.byte_fallback = False
        # Whitespace runs collapse and every word starts with the boundary marker.
        self.normalizer = {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "},
            {"type": "Strip", "strip_left": True, "strip_right": True}] + ([{"type": "Lowercase"}] if lowercase else [])}
        self.pre_tokenizer = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": True}
        self.decoder = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": True}

    def get_initial_vocab(self, texts: Iterable[str]) -> dict[str, int]:
        """Guide API: every substring (up to ``max_piece_length``) of every word, with its count."""
        freq: Counter[str] = Counter()
        for text in texts:
            for w in self._words(text):
                for i in range(len(w)):
                    for j in range(i + 1, min(len(w), i + self.max_piece_length) + 1):
                        freq[w[i:j]] += 1
        return dict(freq)

    # ---- lattice algorithms -----------------------------------------------------------------------------
    def _viterbi(self, word: str, logp: dict[str, float]) -> tuple[list[str], float]:
        n, L = len(word), self.max_piece_length
        best = [-math.inf] * (n + 1)
        back = [0] * (n + 1)
        best[0] = 0.0
        for i in range(1, n + 1):
            for j in range(max(0, i - L), i):
                if best[j] == -math.inf:
                    continue
                lp = logp.get(word[j:i])
                if lp is not None and best[j] + lp > best[i]:
                    best[i], back[i] = best[j] + lp, j
        if best[n] == -math.inf:
            return [], -math.inf
        pieces = []
        i = n
        while i > 0:
            pieces.append(word[back[i]:i])
            i = back[i]
        return pieces[::-1], best[n]

    def piece_scores(self) -> dict[str, float]:
        """Scores of every piece of the model's vocabulary (not :attr:`added_only`), as the lattice sees them:
        learned log-probabilities, and 0.0 for the special tokens (split out of the text before segmentation)."""
        return dict(self._lattice_scores()[0])

    def _lattice_scores(self) -> tuple[dict[str, float], float]:
        """:meth:`piece_scores` (not to be modified) and the unknown-character score, the lowest minus 10."""
        key = (id(self._logp), len(self._logp), id(self._id_to_token), len(self._id_to_token), len(self.added_only))
        cached = getattr(self, "_scores_cache", None)
        if cached is None or cached[0] != key:  # rebuilt only when the vocabulary or the model changes
            scores = {**{t: 0.0 for t in self._id_to_token if t not in self.added_only}, **self._logp}
            cached = (key, scores, min(scores.values(), default=0.0) - 10.0)
            self._scores_cache = cached
        return cached[1], cached[2]

    def viterbi_segment(self, word: str, vocab_probs: dict[str, float] | None = None) -> list[str]:
        """Guide API: best segmentation of ``word``. A position that no single-character piece covers may be
        taken by ``unk_token`` at the lowest score minus 10; consecutive unknowns fuse into one unk
        (the ``tokenizers`` library's Unigram rules)."""
        return [self.unk_token if unknown else p for p, unknown in self._best_path(word, vocab_probs)]

    def _best_path(self, word: str, vocab_probs: dict[str, float] | None = None) -> list[tuple[str, bool]]:
        """:meth:`viterbi_segment` as ``(text, unknown)`` pairs: a run of unknown characters is one pair."""
        if vocab_probs is not None:
            logp = {t: math.log(p) for t, p in vocab_probs.items() if p > 0}
            unk_score = min(logp.values(), default=0.0) - 10.0
        else:
            logp, unk_score = self._lattice_scores()
        n, L = len(word), self.max_piece_length
        best = [-math.inf] * (n + 1)
        back: list[tuple[int, bool]] = [(0, False)] * (n + 1)
        best[0] = 0.0
        for i in range(n):
            if best[i] == -math.inf:
                continue
            single = False
            for j in range(i + 1, min(n, i + L) + 1):
                lp = logp.get(word[i:j])
                if lp is None:
                    continue
                single |= j == i + 1
                if best[i] + lp > best[j]:
                    best[j], back[j] = best[i] + lp, (i, False)
            if not single and best[i] + unk_score > best[i + 1]:
                best[i + 1], back[i + 1] = best[i] + unk_score, (i, True)
        pieces: list[tuple[int, int, bool]] = []  # (start, end, unknown), last first
        i = n
        while i > 0:
            j, unknown = back[i]
            if unknown and pieces and pieces[-1][2]:
                pieces[-1] = (j, pieces[-1][1], True)
            else:
                pieces.append((j, i, unknown))
            i = j
        return [(word[j:i], unknown) for j, i, unknown in reversed(pieces)]

    def _expected_counts(self, word_freq: dict[str, int], logp: dict[str, float]) -> tuple[Counter[str], float]:
        """E-step: expected piece counts (forward-backward) and the corpus log-likelihood."""
        counts: Counter[str] = Counter()
        total_ll = 0.0
        L = self.max_piece_length
        for word, f in word_freq.items():
            n = len(word)
            alpha = [-math.inf] * (n + 1)
            alpha[0] = 0.0
            edges: list[tuple[int, int, float]] = []
            for i in range(1, n + 1):
                acc = -math.inf
                for j in range(max(0, i - L), i):
                    lp = logp.get(word[j:i])
                    if lp is None or alpha[j] == -math.inf:
                        continue
                    edges.append((j, i, lp))
                    acc = _logsumexp(acc, alpha[j] + lp)
                alpha[i] = acc
            z = alpha[n]
            if z == -math.inf:
                continue
            beta = [-math.inf] * (n + 1)
            beta[n] = 0.0
            for j, i, lp in reversed(edges):  # edges are ordered by end position, so reversed is safe
                beta[j] = _logsumexp(beta[j], lp + beta[i])
            total_ll += f * z
            for j, i, lp in edges:
                post = alpha[j] + lp + beta[i] - z
                if post > -30:
                    counts[word[j:i]] += f * math.exp(post)
        return counts, total_ll

    # ---- training ---------------------------------------------------------------------------------------
    def train(self, texts: Sequence[str] | Iterable[str], verbose: bool = False) -> None:
        word_freq: Counter[str] = Counter()
        for text in texts:
            word_freq.update(self._words(text))
        chars: Counter[str] = Counter()
        subs: Counter[str] = Counter()
        for w, f in word_freq.items():
            for ch in w:
                chars[ch] += f
            for i in range(len(w)):
                for j in range(i + 2, min(len(w), i + self.max_piece_length) + 1):
                    subs[w[i:j]] += f
        specials = self._specials_in_order()
        target = max(self.vocab_size - len(specials), len(chars))
        seed = dict(chars)
        # Substrings ranked by frequency x length: long frequent pieces are the useful ones.
        for s, c in sorted(subs.items(), key=lambda kv: (-kv[1] * len(kv[0]), kv[0]))[
                : max(self.seed_size_factor * self.vocab_size, 1)]:
            seed[s] = c
        total = sum(seed.values())
        logp = {t: math.log(c / total) for t, c in seed.items()}

        def em(logp: dict[str, float]) -> dict[str, float]:
            for _ in range(self.em_iterations):
                counts, ll = self._expected_counts(word_freq, logp)
                for ch in chars:  # keep every character reachable
                    counts[ch] = max(counts.get(ch, 0.0), 1e-3)
                tot = sum(counts.values())
                logp = {t: math.log(c / tot) for t, c in counts.items() if c > 0 and t in logp}
                if verbose:
                    print(f"Unigram EM: {len(logp)} pieces, log-likelihood {ll:.1f}")
            return logp

        logp = em(logp)
        while len(logp) > target:
            logp = self._prune(word_freq, logp, chars, target)
            logp = em(logp)
        self._logp = logp
        self.token_probs = {t: math.exp(v) for t, v in logp.items()}
        pieces = sorted(logp)
        unk = self.unk_token
        self._set_vocab(specials + ([unk] if unk not in specials else []) + [p for p in pieces if p not in specials])

    def _prune(self, word_freq: dict[str, int], logp: dict[str, float], chars: Counter[str],
               target: int) -> dict[str, float]:
        viterbi_count: Counter[str] = Counter()
        for w, f in word_freq.items():
            pieces, _ = self._viterbi(w, logp)
            for p in pieces:
                viterbi_count[p] += f
        loss: dict[str, float] = {}
        work = dict(logp)
        for t, lp in logp.items():
            if t in chars:
                continue
            c = viterbi_count.get(t, 0)
            if c == 0:
                loss[t] = 0.0
                continue
            # Re-segment the piece itself without it: the cost of replacing each of its occurrences.
            del work[t]
            _, alt = self._viterbi(t, work)
            work[t] = lp
            loss[t] = c * (lp - alt) if alt > -math.inf else math.inf
        keep_n = max(target, int(len(logp) * self.shrink_factor))
        n_remove = len(logp) - keep_n
        removable = sorted(loss, key=lambda t: (loss[t], t))[:n_remove]
        out = dict(logp)
        for t in removable:
            del out[t]
        return out

    # ---- encoding ---------------------------------------------------------------------------------------
    def _segment(self, word: str) -> list[str]:
        if not self.byte_fallback:
            return self.viterbi_segment(word)
        out: list[str] = []
        for piece, unknown in self._best_path(word):
            if unknown:
                # an unknown run is spelled by its byte tokens when the vocabulary has them all
                pieces = [byte_token(b) for b in piece.encode("utf-8")]
                out.extend(pieces if all(p in self.vocab for p in pieces) else [self.unk_token])
            else:
                out.append(piece)
        return out

    def calculate_loss(self, texts: Iterable[str], vocab_probs: dict[str, float] | None = None) -> float:
        """Guide API: negative log-likelihood of the Viterbi segmentations of ``texts``."""
        logp = self._logp if vocab_probs is None else {t: math.log(p) for t, p in vocab_probs.items() if p > 0}
        total = 0.0
        for text in texts:
            for w in self._words(text):
                total -= sum(logp.get(t, math.log(1e-10)) for t in self.viterbi_segment(w, None if vocab_probs is None
                                                                                           else vocab_probs))
        return total

    # ---- persistence ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "unk_token": self.unk_token, "lowercase": self.lowercase,
                "max_piece_length": self.max_piece_length,
                # log-probabilities as floats: json round-trips doubles exactly
                "log_probs": dict(self._logp), "byte_fallback": self.byte_fallback}

    @classmethod
    def _from_state(cls, path: str, data: dict[str, Any]) -> UnigramTokenizer:
        tok = cls(require(path, data, "vocab_size", int, "an int"), require(path, data, "unk_token", str, "a string"),
                  lowercase=require(path, data, "lowercase", bool, "a bool"),
                  max_piece_length=require(path, data, "max_piece_length", int, "an int"), pad_token=None)
        lps = require(path, data, "log_probs", dict, "an object mapping pieces to log-probabilities")
        vocab = set(data.get("vocab", []))
        for t, v in lps.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v > 0 or v != v:
                raise TokenizerFileError(f"{path}: log-probability of {t!r} must be a number <= 0, got {v!r}")
            if t not in vocab:
                raise TokenizerFileError(f"{path}: piece {t!r} has a probability but is not in the vocab")
            if len(t) > tok.max_piece_length:
                raise TokenizerFileError(f"{path}: piece {t!r} is longer than max_piece_length={tok.max_piece_length}")
        tok._logp = {t: float(v) for t, v in lps.items()}
        tok.byte_fallback = data.get("byte_fallback", False)
        if not isinstance(tok.byte_fallback, bool):
            raise TokenizerFileError(f"{path}: 'byte_fallback' must be a bool, got {tok.byte_fallback!r}")
        tok.token_probs = {t: math.exp(v) for t, v in tok._logp.items()}
        return tok
