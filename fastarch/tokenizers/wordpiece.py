"""WordPiece: likelihood-ratio training, BERT-compatible encoding, and loading of BERT ``vocab.txt`` files.

Guide-003 ``WordPieceTokenizer(vocab_size=1000, unk_token='[UNK]')`` with ``train(texts)`` and
``encode(text)``. Deviations from the guide, which is incomplete:

- training merges the adjacent pair with the highest likelihood ratio
  ``count(ab) / (count(a) * count(b))`` (the WordPiece criterion) instead of adding the most frequent
  substring, with incremental pair counts and a lazily updated max-heap of scores;
- pre-tokenization is BERT's (clean text, CJK characters, lowercase + accent stripping, punctuation
  split) instead of whitespace only, and encoding is BERT's greedy longest-match-first, where a word
  with an unmatchable position becomes a single ``[UNK]`` (the guide emitted one ``[UNK]`` per character
  and could loop on ``##`` pieces);
- ``encode`` returns ids (``tokenize`` returns the token strings the guide's ``encode`` returned), with
  ``[CLS] ... [SEP]`` when ``add_special_tokens``; ids are assigned specials first, then tokens sorted.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from .bert_basic import BasicTokenizer, wordpiece_tokenize
from .io import BaseTokenizer, TokenizerFileError, atomic_write_text, require

__all__ = ["WordPieceTokenizer"]

BERT_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "mask_token": "[MASK]"}


class WordPieceTokenizer(BaseTokenizer):
    """WordPiece tokenizer (see the module docstring).

    Args:
        vocab_size: target vocabulary size for ``train`` (special tokens included).
        unk_token, pad_token, cls_token, sep_token, mask_token: special tokens (``None`` to omit one).
        lowercase: lowercase and strip accents (BERT uncased).
        max_input_chars_per_word: longer words become ``unk_token``.
    """

    SPECIAL_ROLES = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")

    def __init__(self, vocab_size: int = 1000, unk_token: str = "[UNK]", *, pad_token: str | None = "[PAD]",
                 cls_token: str | None = "[CLS]", sep_token: str | None = "[SEP]", mask_token: str | None = "[MASK]",
                 lowercase: bool = True, strip_accents: bool | None = None, tokenize_chinese_chars: bool = True,
                 max_input_chars_per_word: int = 100, prefix: str = "##") -> None:
        super().__init__()
        self._configure(vocab_size, lowercase, pad_token=pad_token, unk_token=unk_token, cls_token=cls_token,
                        sep_token=sep_token, mask_token=mask_token)
        if not unk_token:
            raise ValueError("WordPieceTokenizer: argument 'unk_token' must be a non-empty string")
        self.unk_token = unk_token
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.max_input_chars_per_word = max_input_chars_per_word
        self.prefix = prefix
        self._basic_cache: BasicTokenizer | None = None
        self.normalizer = {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": tokenize_chinese_chars,
                           "strip_accents": strip_accents, "lowercase": lowercase}
        self.pre_tokenizer = {"type": "BertPreTokenizer"}
        self.decoder = {"type": "WordPiece", "prefix": prefix, "cleanup": True}

    # ---- pre-tokenization -------------------------------------------------------------------------------
    @property
    def basic(self) -> BasicTokenizer:
        if self._basic_cache is None:
            self._basic_cache = BasicTokenizer(do_lower_case=self.lowercase,
                                               tokenize_chinese_chars=self.tokenize_chinese_chars,
                                               strip_accents=self.strip_accents)
        return self._basic_cache

    def get_word_frequencies(self, texts: Iterable[str]) -> dict[str, int]:
        freq: Counter[str] = Counter()
        for text in texts:
            freq.update(self._words(text))
        return dict(freq)

    def get_initial_vocab(self, word_freq: dict[str, int]) -> set[str]:
        """Guide API: the unknown token, word-initial characters and ``##`` continuation characters."""
        out = {self.unk_token}
        for w in word_freq:
            if w:
                out.add(w[0])
                out.update(self.prefix + c for c in w[1:])
        return out

    # ---- training ---------------------------------------------------------------------------------------
    def train(self, texts: Sequence[str] | Iterable[str], verbose: bool = False) -> None:
        """Learn a vocabulary of ``vocab_size`` tokens from ``texts`` by likelihood-ratio merges."""
        word_freq = self.get_word_frequencies(texts)
        pre = self.prefix
        words = [[w[0]] + [pre + c for c in w[1:]] for w in word_freq]
        freqs = list(word_freq.values())
        alphabet = sorted({s for w in words for s in w})
        specials = [self.special_tokens[r] for r in self.SPECIAL_ROLES if r in self.special_tokens]
        vocab_set = set(alphabet) | set(specials)
        sym_count: Counter[str] = Counter()
        pair_count: Counter[tuple[str, str]] = Counter()
        where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
        sym_pairs: defaultdict[str, set[tuple[str, str]]] = defaultdict(set)  # symbol -> pairs holding it
        def count(i: int, w: list[str], f: int) -> list[tuple[str, str]]:
            """Add word ``i`` (symbols ``w``, frequency ``f``) to the counts; returns its pairs."""
            for s in w:
                sym_count[s] += f
            pairs = list(zip(w, w[1:]))
            for p in pairs:
                pair_count[p] += f
                where[p].add(i)
                sym_pairs[p[0]].add(p)
                sym_pairs[p[1]].add(p)
            return pairs

        for i, (w, f) in enumerate(zip(words, freqs)):
            count(i, w, f)

        def score(p: tuple[str, str]) -> float:
            return pair_count[p] / (sym_count[p[0]] * sym_count[p[1]])

        # Max-heap with lazy deletion on (score, count), ties to the smallest pair. A score changes only when
        # the pair's count or one of its symbols' counts changes; every such pair gets a fresh entry, and an
        # entry is used only if it still matches the current counts.
        heap = [(-score(p), -c, p) for p, c in pair_count.items()]
        heapq.heapify(heap)
        self.merges: list[tuple[str, str]] = []
        while len(vocab_set) < self.vocab_size and heap:
            neg_s, neg_c, best = heapq.heappop(heap)
            c_best = pair_count.get(best, 0)
            if c_best <= 0 or c_best != -neg_c or score(best) != -neg_s:
                continue
            a, b = best
            new = a + (b[len(pre):] if b.startswith(pre) else b)
            changed: set[tuple[str, str]] = set()
            for i in list(where.pop(best, ())):
                w, f = words[i], freqs[i]
                if not any(x == a and y == b for x, y in zip(w, w[1:])):
                    continue
                for p in zip(w, w[1:]):
                    pair_count[p] -= f
                    changed.add(p)
                for s in w:
                    sym_count[s] -= f
                merged: list[str] = []
                j = 0
                while j < len(w):
                    if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                        merged.append(new)
                        j += 2
                    else:
                        merged.append(w[j])
                        j += 1
                words[i] = merged
                changed.update(count(i, merged, f))
            pair_count.pop(best, None)
            # count(a) and count(b) fell, so every pair holding a or b scores differently now.
            for sym in (a, b):
                live = {p for p in sym_pairs[sym] if pair_count.get(p, 0) > 0}
                sym_pairs[sym] = live
                changed |= live
            changed.discard(best)
            for p in changed:
                c = pair_count.get(p, 0)
                if c > 0:
                    heapq.heappush(heap, (-score(p), -c, p))
                else:
                    pair_count.pop(p, None)
            self.merges.append(best)
            vocab_set.add(new)
            if verbose and len(vocab_set) % 100 == 0:
                print(f"WordPiece: vocabulary size {len(vocab_set)}")
        learned = sorted(vocab_set - set(specials))
        self._set_vocab(specials + learned)

    # ---- BERT vocab files -------------------------------------------------------------------------------
    @classmethod
    def from_vocab_file(cls, path: str | os.PathLike[str], lowercase: bool = True, **kwargs: Any) -> WordPieceTokenizer:
        """Load a BERT ``vocab.txt`` (one token per line; the line number is the id).

        Special tokens present in the file (``[PAD] [UNK] [CLS] [SEP] [MASK]``) are registered; ``[UNK]``
        must be present. Blank lines in the middle are rejected (they would shift every later id).
        """
        p = os.fspath(path)
        try:
            with open(p, encoding="utf-8") as f:
                raw = f.read()
        except FileNotFoundError:
            raise TokenizerFileError(f"{p}: no such vocab file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerFileError(f"{p}: cannot read the vocab file as UTF-8 ({e})") from None
        lines = raw.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        tokens = [ln.rstrip("\r") for ln in lines]
        if not tokens:
            raise TokenizerFileError(f"{p}: the vocab file is empty")
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t.strip() == "" or t != t.strip():
                raise TokenizerFileError(f"{p}: line {i + 1} is blank or has surrounding whitespace ({t!r}); "
                                         "each line must hold exactly one token")
            if t in seen:
                raise TokenizerFileError(f"{p}: token {t!r} appears on lines {seen[t] + 1} and {i + 1}")
            seen[t] = i
        unk = kwargs.pop("unk_token", "[UNK]")
        if unk not in seen:
            raise TokenizerFileError(f"{p}: the vocab file has no unknown token {unk!r}")
        roles = {r: kwargs.pop(r, d) for r, d in BERT_SPECIALS.items() if r != "unk_token"}
        roles = {r: (t if t in seen else None) for r, t in roles.items()}
        tok = cls(vocab_size=len(tokens), unk_token=unk, lowercase=lowercase, **roles, **kwargs)
        tok._set_vocab(tokens)
        return tok

    def save_vocab_file(self, path: str | os.PathLike[str]) -> None:
        self._require_vocab()
        atomic_write_text(path, "".join(t + "\n" for t in self._id_to_token))

    # ---- encoding ---------------------------------------------------------------------------------------
    def encode_word(self, word: str) -> list[str]:
        """WordPiece of one already pre-tokenized word (guide API)."""
        self._require_vocab()
        return self._segment(word)

    def _segment(self, word: str) -> list[str]:
        return wordpiece_tokenize(word, self.model_vocab(), self.unk_token, self.max_input_chars_per_word,
                                  self.prefix)

    def _default_template(self, pair: bool) -> list[tuple[str, int]]:
        """``[CLS] $A [SEP]`` and ``[CLS] $A [SEP] $B [SEP]`` (type id 1 from ``$B`` on), as BERT."""
        cls_t, sep_t = self.special_tokens.get("cls_token"), self.special_tokens.get("sep_token")
        out = ([(cls_t, 0)] if cls_t else []) + [("$A", 0)] + ([(sep_t, 0)] if sep_t else [])
        if pair:
            out += [("$B", 1)] + ([(sep_t, 1)] if sep_t else [])
        return out

    # ---- persistence ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "unk_token": self.unk_token, "lowercase": self.lowercase,
                "strip_accents": self.strip_accents, "tokenize_chinese_chars": self.tokenize_chinese_chars,
                "max_input_chars_per_word": self.max_input_chars_per_word, "prefix": self.prefix}

    @classmethod
    def _from_state(cls, path: str, data: dict[str, Any]) -> WordPieceTokenizer:
        tok = cls(require(path, data, "vocab_size", int, "an int"), require(path, data, "unk_token", str, "a string"),
                  lowercase=require(path, data, "lowercase", bool, "a bool"),
                  tokenize_chinese_chars=require(path, data, "tokenize_chinese_chars", bool, "a bool"),
                  max_input_chars_per_word=require(path, data, "max_input_chars_per_word", int, "an int"),
                  prefix=require(path, data, "prefix", str, "a string"), strip_accents=data.get("strip_accents"))
        if tok.strip_accents is not None and not isinstance(tok.strip_accents, bool):
            raise TokenizerFileError(f"{path}: field 'strip_accents' must be a bool or null")
        return tok
