"""Byte-pair encoding with incremental pair counts.

Guide-003 ``BPETokenizer(vocab_size=1000)`` with ``train(texts)`` and ``encode(text)``. Training keeps,
for every adjacent symbol pair, its corpus count and the set of words containing it, and a max-heap of
``(count, pair)`` with lazy deletion (an entry is used only if its count is still current). A merge
rewrites only the words that contain the pair and updates the counts of the pairs those words gain and
lose, instead of recounting every pair of the corpus after each merge as the guide does.

Deviations from the guide:

- the end-of-word marker ``</w>`` is glued to the word's last character (``"low" -> l o w</w>``), as in
  Sennrich et al.; the guide split the marker itself into the four symbols ``< / w >``;
- ties between equally frequent pairs go to the lexicographically smallest pair (the guide: dict order);
- ``encode`` returns ids (``tokenize`` returns the guide's token strings); characters never seen in
  training map to ``unk_token``; ids are specials first, then the learned tokens sorted.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, defaultdict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from .byte_level import BYTE_TO_CHAR
from .io import BaseTokenizer, TokenizerFileError, require
from .pipeline import byte_token

__all__ = ["BPETokenizer"]

EOW = "</w>"
# symbol lists up to this long are merged by rescanning their pairs (see BPETokenizer._merge_short)
_SCAN_SYMBOLS = 24
_NO_MERGE = 1 << 62  # the rank of a pair without a merge


class BPETokenizer(BaseTokenizer):
    """BPE tokenizer (see the module docstring).

    Args:
        vocab_size: target size: ``train`` performs ``vocab_size - len(alphabet) - len(specials)`` merges
            unless ``num_merges`` is given.
        lowercase: lowercase the text before splitting on whitespace (the guide always does).
        unk_token, pad_token, bos_token, eos_token: special tokens (``None`` to omit); bos/eos are added by
            ``encode(add_special_tokens=True)`` when set.
        byte_level: GPT-2's byte-level BPE instead of words with ``</w>``: the text is split with GPT-2's
            pattern and merged over its UTF-8 bytes, the 256 byte symbols all in the vocabulary, so no text is
            unknown and decoding gives the text back (with ``lowercase=False``; see
            :mod:`fastarch.tokenizers.byte_level`).
        add_prefix_space: with ``byte_level``, put a space before text that does not start with one, so a
            first word is spelled as it is after a space.
        dropout: BPE-dropout probability for encoding (``None``: deterministic); see :meth:`set_dropout`,
            which also seeds it.
        continuing_subword_prefix: a prefix on every symbol that does not start a word (``"##"``: ``"low"`` is
            ``l ##o ##w``); a merge drops the right symbol's prefix (``l`` + ``##o`` makes ``lo``), as in the
            ``tokenizers`` library.

    Attributes read from ``tokenizer.json`` files: ``fuse_unk`` (a run of unknown characters is one
    ``unk_token``), ``byte_fallback`` (an unknown character is spelled by its ``<0xHH>`` byte tokens, as in
    Llama 2 and Mistral) and ``ignore_merges`` (a word that is a token is kept whole).
    """

    def __init__(self, vocab_size: int = 1000, *, lowercase: bool = True, unk_token: str | None = "<unk>",
                 pad_token: str | None = "<pad>", bos_token: str | None = None, eos_token: str | None = None,
                 additional_special_tokens: Sequence[str] = (), byte_level: bool = False,
                 add_prefix_space: bool = False, dropout: float | None = None,
                 continuing_subword_prefix: str = "") -> None:
        super().__init__()
        self._configure(vocab_size, lowercase, pad_token=pad_token, unk_token=unk_token, bos_token=bos_token,
                        eos_token=eos_token)
        self.additional_special_tokens = list(additional_special_tokens)
        self.normalizer = {"type": "Lowercase"} if lowercase else None
        self.pre_tokenizer = {"type": "WhitespaceSplit"}
        self.decoder = {"type": "BPEDecoder", "suffix": EOW}
        self.end_of_word_suffix = EOW
        if not isinstance(continuing_subword_prefix, str):
            raise TypeError(f"BPETokenizer: argument 'continuing_subword_prefix' must be a str, got "
                            f"{continuing_subword_prefix!r}")
        self.continuing_subword_prefix = continuing_subword_prefix
        for name, flag in (("byte_level", byte_level), ("add_prefix_space", add_prefix_space)):
            if not isinstance(flag, bool):
                raise TypeError(f"BPETokenizer: argument '{name}' must be a bool, got {flag!r}")
        if byte_level:
            stage = {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True, "use_regex": True}
            self.pre_tokenizer, self.decoder, self.end_of_word_suffix = stage, dict(stage), ""
        self.fuse_unk = False
        # a character outside the vocabulary becomes its <0xHH> byte tokens (Llama 2, Mistral)
        self.byte_fallback = False
        self.set_dropout(dropout)
        # a word that is itself a token is kept whole, without merging (Llama 3's tokenizer.json sets it)
        self.ignore_merges = False
        self.merges: list[tuple[str, str]] = []
        self._ranks: dict[tuple[str, str], int] = {}
        self._cache: dict[str, list[str]] = {}

    # ---- guide helpers ----------------------------------------------------------------------------------
    def get_word_frequencies(self, texts: Iterable[str]) -> dict[str, int]:
        """``{word + '</w>': count}`` as in the guide."""
        freq: Counter[str] = Counter()
        for text in texts:
            freq.update(self._words(text))
        return {w + EOW: c for w, c in freq.items()}

    def _symbols(self, word: str) -> list[str]:
        """The initial symbols of a word: its characters, all but the first carrying the continuing-subword
        prefix, the last one the end-of-word suffix."""
        prefix = self.continuing_subword_prefix
        syms = [word[0]] + [prefix + c for c in word[1:]] if prefix else list(word)
        syms[-1] += self.end_of_word_suffix
        return syms

    def joined(self, left: str, right: str) -> str:
        """The token that merging ``left`` and ``right`` makes: ``right`` loses the length of the
        continuing-subword prefix (in UTF-8 bytes, as the library cuts it)."""
        prefix = self.continuing_subword_prefix
        if not prefix:
            return left + right
        return left + right.encode("utf-8")[len(prefix.encode("utf-8")):].decode("utf-8")

    def get_character_vocab(self, word_freq: dict[str, int]) -> set[str]:
        """Initial symbols of the guide-format words (``'low</w>'`` gives ``l``, ``o``, ``w</w>``)."""
        out: set[str] = set()
        for w in word_freq:
            base = w[: -len(EOW)] if w.endswith(EOW) else w
            if base:
                out.update(self._symbols(base))
        return out

    @staticmethod
    def get_pairs(word_freq: dict[str, int]) -> dict[tuple[str, str], int]:
        """Adjacent symbol pairs and their counts for space-separated words (guide API)."""
        pairs: defaultdict[tuple[str, str], int] = defaultdict(int)
        for w, c in word_freq.items():
            syms = w.split(" ")
            for p in zip(syms, syms[1:]):
                pairs[p] += c
        return dict(pairs)

    @staticmethod
    def merge_vocab(pair: tuple[str, str], word_freq: dict[str, int]) -> dict[str, int]:
        """Merge ``pair`` in space-separated words (guide API; whole symbols only, unlike a substring replace)."""
        a, b = pair
        out: dict[str, int] = {}
        for w, c in word_freq.items():
            syms, merged, j = w.split(" "), [], 0
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
                    merged.append(a + b)
                    j += 2
                else:
                    merged.append(syms[j])
                    j += 1
            key = " ".join(merged)
            out[key] = out.get(key, 0) + c
        return out

    # ---- training ---------------------------------------------------------------------------------------
    def train(self, texts: Sequence[str] | Iterable[str], num_merges: int | None = None, verbose: bool = False) -> None:
        """Learn merges from ``texts``; ``num_merges`` overrides the count implied by ``vocab_size``."""
        freq: Counter[str] = Counter()
        for text in texts:
            freq.update(self._words(text))
        words = [self._symbols(w) for w in freq]
        counts = list(freq.values())
        symbols = {s for w in words for s in w}
        if isinstance(self.pre_tokenizer, dict) and self.pre_tokenizer.get("type") == "ByteLevel":
            symbols.update(BYTE_TO_CHAR.values())
        alphabet = sorted(symbols)
        specials = self._specials_in_order()
        if num_merges is None:
            num_merges = max(0, self.vocab_size - len(alphabet) - len(specials))
        elif not isinstance(num_merges, int) or num_merges < 0:
            raise ValueError(f"BPETokenizer.train: argument 'num_merges' must be an int >= 0, got {num_merges!r}")

        pair_count: defaultdict[tuple[str, str], int] = defaultdict(int)
        where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
        for i, (w, c) in enumerate(zip(words, counts)):
            for p in zip(w, w[1:]):
                pair_count[p] += c
                where[p].add(i)
        # heapq is a min-heap: (-count, pair) pops the highest count, then the smallest pair.
        heap = [(-c, p) for p, c in pair_count.items()]
        heapq.heapify(heap)
        merges: list[tuple[str, str]] = []
        learned: list[str] = []
        while len(merges) < num_merges and heap:
            negc, pair = heapq.heappop(heap)
            cur = pair_count.get(pair, 0)
            if cur != -negc or cur <= 0:
                continue  # stale entry: the pair's count changed after it was pushed
            a, b = pair
            new = self.joined(a, b)
            changed: set[tuple[str, str]] = set()
            for i in where.pop(pair):
                w = words[i]
                # Skip words that lost the pair in an earlier merge (the index is not pruned eagerly).
                n = len(w)
                j = 0
                hit = False
                while j < n - 1:
                    if w[j] == a and w[j + 1] == b:
                        hit = True
                        break
                    j += 1
                if not hit:
                    continue
                c = counts[i]
                merged: list[str] = w[:j]
                while j < n:
                    if j < n - 1 and w[j] == a and w[j + 1] == b:
                        merged.append(new)
                        j += 2
                    else:
                        merged.append(w[j])
                        j += 1
                for p in zip(w, w[1:]):
                    pair_count[p] -= c
                    changed.add(p)
                for p in zip(merged, merged[1:]):
                    pair_count[p] += c
                    where[p].add(i)
                    changed.add(p)
                words[i] = merged
            pair_count.pop(pair, None)
            changed.discard(pair)
            for p in changed:
                c = pair_count[p]
                if c > 0:
                    heapq.heappush(heap, (-c, p))
                else:
                    del pair_count[p]
            merges.append(pair)
            learned.append(new)
            if verbose and len(merges) % 1000 == 0:
                print(f"BPE: {len(merges)} merges")
        self.merges = merges
        tokens = sorted(set(alphabet) | set(learned))
        self._set_vocab(specials + [t for t in tokens if t not in specials])
        self._ranks = {p: r for r, p in enumerate(merges)}
        self._cache = {}

    # ---- encoding ---------------------------------------------------------------------------------------
    def set_dropout(self, dropout: float | None, seed: int | None = None) -> None:
        """BPE-dropout (Provilkov et al., 2020): while encoding, each merge the queue offers is skipped with
        probability ``dropout``, so one text gets varied segmentations (for training). ``None`` or 0
        encodes deterministically. ``seed`` seeds the generator, for reproducible draws."""
        if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                                    or not 0.0 <= dropout <= 1.0):
            raise ValueError(f"BPETokenizer.set_dropout: argument 'dropout' must be None or a float in [0, 1], "
                             f"got {dropout!r}")
        self.dropout = None if dropout is None else float(dropout)
        self.dropout_rng = random.Random(seed)

    def _initial_symbols(self, word: str) -> list[str]:
        """The symbols merging starts from, as the ``tokenizers`` library builds them: a character outside
        the vocabulary becomes its ``<0xHH>`` byte tokens (``byte_fallback``, when all of them are in the
        vocabulary), else ``unk_token`` (a run of them one unk with ``fuse_unk``), else it is dropped."""
        vocab = self.model_vocab()
        unk = self.special_tokens.get("unk_token")
        out: list[str] = []
        pending_unk = False
        for s in self._symbols(word):
            if s in vocab:
                if pending_unk:
                    out.append(unk)  # type: ignore[arg-type]
                    pending_unk = False
                out.append(s)
                continue
            if self.byte_fallback:
                pieces = [byte_token(b) for b in s.encode("utf-8")]
                if all(p in vocab for p in pieces):
                    out.extend(pieces)  # a pending unk stays pending across them, as in the library
                    continue
            if unk:
                if pending_unk and not self.fuse_unk:
                    out.append(unk)
                pending_unk = True
        if pending_unk:
            out.append(unk)  # type: ignore[arg-type]
        return out

    def _merge(self, syms: list[str], dropout: float | None) -> list[str]:
        """Apply the merges to a symbol list: a queue of candidate merges, lowest rank first and leftmost
        among equals. With ``dropout`` each popped merge is set aside with that probability; the set-aside
        ones return to the queue after the next merge that is not dropped."""
        ranks = self._ranks
        n = len(syms)
        if not dropout and n <= _SCAN_SYMBOLS:
            return self._merge_short(syms)
        sym: list[str | None] = list(syms)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        # entries (rank, position, merged token); an entry is still valid while its pair makes that token
        join = self.joined
        heap = [(r, i, join(a, b)) for i, (a, b) in enumerate(zip(syms, syms[1:]))
                if (r := ranks.get((a, b))) is not None]
        heapq.heapify(heap)
        skipped: list[tuple[int, int, str]] = []
        rng = self.dropout_rng
        while heap:
            entry = heapq.heappop(heap)
            if dropout and rng.random() < dropout:
                skipped.append(entry)
                continue
            for old in skipped:
                heapq.heappush(heap, old)
            skipped.clear()
            _, i, new = entry
            left, j = sym[i], nxt[i]
            if left is None or j == -1 or (left, sym[j]) not in ranks or join(left, sym[j]) != new:  # type: ignore
                continue  # stale entry: a merge since it was queued changed this pair
            sym[i] = new
            sym[j] = None
            nxt[i] = nxt[j]
            if nxt[i] != -1:
                prv[nxt[i]] = i
            for k in (prv[i], i):
                if k != -1 and nxt[k] != -1 and (r := ranks.get((sym[k], sym[nxt[k]]))) is not None:  # type: ignore
                    heapq.heappush(heap, (r, k, join(sym[k], sym[nxt[k]])))  # type: ignore[arg-type]
        return [s for s in sym if s is not None]

    def _merge_short(self, syms: list[str]) -> list[str]:
        """:meth:`_merge` without dropout for a short symbol list, where rescanning the pairs is cheaper than a
        queue: merge the leftmost occurrence of the lowest-ranked pair until no pair has a merge."""
        ranks, none, join = self._ranks, _NO_MERGE, self.joined
        syms = list(syms)
        pair_ranks = [ranks.get(p, none) for p in zip(syms, syms[1:])]  # pair_ranks[i]: syms[i], syms[i + 1]
        while pair_ranks:
            best = min(pair_ranks)
            if best == none:
                break
            i = pair_ranks.index(best)  # the leftmost occurrence
            syms[i:i + 2] = [join(syms[i], syms[i + 1])]
            del pair_ranks[i]
            if i > 0:
                pair_ranks[i - 1] = ranks.get((syms[i - 1], syms[i]), none)
            if i < len(pair_ranks):
                pair_ranks[i] = ranks.get((syms[i], syms[i + 1]), none)
        return syms

    def set_merges(self, path: str, merges: list[tuple[str, str]], vocab: Container[str]) -> None:
        """Set merges read from the file ``path``; each must make a token of ``vocab`` (:meth:`joined`), or
        :class:`TokenizerFileError` names it (the ``tokenizers`` library refuses such a file too)."""
        for i, (a, b) in enumerate(merges):
            try:
                new: str | None = self.joined(a, b)
            except UnicodeDecodeError:  # the prefix's length cuts a character of b
                new = None
            if new is None or new not in vocab:
                raise TokenizerFileError(f"{path}: merge {i} {[a, b]!r} makes {new!r}, which is not in the "
                                         "vocabulary")
        self.merges = list(merges)
        self._ranks = {m: r for r, m in enumerate(self.merges)}
        self._cache = {}

    def _bpe(self, word: str) -> list[str]:
        """One word as token strings: its initial symbols merged, pair by pair, in merge order."""
        if not word:
            return []
        if self.dropout:
            # as the library: with dropout active the cache and ignore_merges are both bypassed
            return self._merge(self._initial_symbols(word), self.dropout)
        if self.ignore_merges and word in self.model_vocab():
            return [word]
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        syms = self._merge(self._initial_symbols(word), None)
        if len(self._cache) < 100_000 and len(word) < 256:  # long texts (no pre-tokenizer) are not kept
            self._cache[word] = syms
        return syms

    def _segment(self, word: str) -> list[str]:
        return self._bpe(word)

    # ---- persistence ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "lowercase": self.lowercase, "merges": [list(p) for p in self.merges],
                "end_of_word_suffix": self.end_of_word_suffix, "continuing_subword_prefix": self.continuing_subword_prefix,
                "fuse_unk": self.fuse_unk,
                "ignore_merges": self.ignore_merges, "byte_fallback": self.byte_fallback, "dropout": self.dropout}

    @classmethod
    def _from_state(cls, path: str, data: dict[str, Any]) -> BPETokenizer:
        tok = cls(require(path, data, "vocab_size", int, "an int"), lowercase=require(path, data, "lowercase", bool,
                                                                                        "a bool"),
                  unk_token=None, pad_token=None)
        merges = require(path, data, "merges", list, "a list of [left, right] pairs")
        prefix = data.get("continuing_subword_prefix", "")
        if not isinstance(prefix, str):
            raise TokenizerFileError(f"{path}: 'continuing_subword_prefix' must be a string, got {prefix!r}")
        tok.continuing_subword_prefix = prefix
        out = []
        for i, m in enumerate(merges):
            if not (isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) and s for s in m)):
                raise TokenizerFileError(f"{path}: merge {i} must be a pair of non-empty strings, got {m!r}")
            out.append((m[0], m[1]))
        tok.set_merges(path, out, set(data.get("vocab", [])))
        tok.end_of_word_suffix = data.get("end_of_word_suffix", EOW)
        tok.fuse_unk = data.get("fuse_unk", False)
        tok.ignore_merges = data.get("ignore_merges", False)
        tok.byte_fallback = data.get("byte_fallback", False)
        if not isinstance(tok.end_of_word_suffix, str) or not all(
                isinstance(f, bool) for f in (tok.fuse_unk, tok.ignore_merges, tok.byte_fallback)):
            raise TokenizerFileError(f"{path}: 'end_of_word_suffix' must be a string, 'fuse_unk', 'ignore_merges' "
                                     "and 'byte_fallback' bools")
        try:
            tok.set_dropout(data.get("dropout"))
        except ValueError as e:
            raise TokenizerFileError(f"{path}: {e}") from None
        return tok
