"""BERT's pre-tokenization ("BasicTokenizer") and greedy longest-match-first WordPiece, written from the
published rules of the original BERT release:

1. clean: drop NUL, U+FFFD and control characters (Unicode category C*, except tab/newline/CR, which
   are whitespace); map every whitespace character (space, tab, newline, CR, category Zs) to a space;
2. put spaces around CJK ideographs (the CJK Unified Ideographs blocks and extensions, and the
   compatibility ideographs), so each becomes its own word;
3. split on whitespace; for uncased models lowercase each word and strip accents (NFD, drop category Mn);
4. split every punctuation character into its own word: Unicode category P*, plus the ASCII symbol
   ranges 33-47, 58-64, 91-96, 123-126 (so ``$``, ``+``, ``^``, ``|`` and ``~`` split too);
5. WordPiece: for each word of at most ``max_input_chars_per_word`` characters, repeatedly take the
   longest vocabulary entry starting at the current position (continuations carry the ``##`` prefix);
   if some position has no match the whole word becomes ``[UNK]``.
"""

from __future__ import annotations

import unicodedata

__all__ = ["BasicTokenizer", "is_chinese_char", "is_control", "is_punctuation", "is_whitespace",
           "wordpiece_tokenize"]

_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def is_whitespace(ch: str) -> bool:
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def is_control(ch: str) -> bool:
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch).startswith("C")


def is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_chinese_char(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


class BasicTokenizer:
    """Split text into words the way BERT does before WordPiece (see the module docstring).

    ``never_split``: words returned unchanged (neither lowercased nor split on punctuation).
    """

    def __init__(self, do_lower_case: bool = True, tokenize_chinese_chars: bool = True,
                 strip_accents: bool | None = None, never_split: set[str] | None = None) -> None:
        self.do_lower_case = do_lower_case
        self.tokenize_chinese_chars = tokenize_chinese_chars
        self.strip_accents = strip_accents
        self.never_split = set(never_split or ())

    @staticmethod
    def clean_text(text: str) -> str:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or is_control(ch):
                continue
            out.append(" " if is_whitespace(ch) else ch)
        return "".join(out)

    @staticmethod
    def space_chinese_chars(text: str) -> str:
        out = []
        for ch in text:
            if is_chinese_char(ord(ch)):
                out.extend((" ", ch, " "))
            else:
                out.append(ch)
        return "".join(out)

    @staticmethod
    def strip_accents_of(text: str) -> str:
        return "".join(ch for ch in unicodedata.normalize("NFD", text) if unicodedata.category(ch) != "Mn")

    @staticmethod
    def split_on_punctuation(word: str) -> list[str]:
        out: list[str] = []
        cur: list[str] = []
        for ch in word:
            if is_punctuation(ch):
                if cur:
                    out.append("".join(cur))
                    cur = []
                out.append(ch)
            else:
                cur.append(ch)
        if cur:
            out.append("".join(cur))
        return out

    def tokenize(self, text: str) -> list[str]:
        text = self.clean_text(text)
        if self.tokenize_chinese_chars:
            text = self.space_chinese_chars(text)
        # NFC first so that one character written with different code points is treated alike.
        text = unicodedata.normalize("NFC", text)
        words: list[str] = []
        for word in text.split():
            if word in self.never_split:
                words.append(word)
                continue
            if self.do_lower_case:
                word = word.lower()
                if self.strip_accents is not False:
                    word = self.strip_accents_of(word)
            elif self.strip_accents:
                word = self.strip_accents_of(word)
            words.extend(self.split_on_punctuation(word))
        # Lowercasing/accent stripping can expose whitespace (e.g. a lone combining mark): split again.
        return " ".join(words).split()


def wordpiece_tokenize(word: str, vocab: dict[str, int] | set[str], unk_token: str = "[UNK]",
                       max_input_chars_per_word: int = 100, prefix: str = "##") -> list[str]:
    """Greedy longest-match-first WordPiece of one pre-tokenized word."""
    if len(word) > max_input_chars_per_word:
        return [unk_token]
    pieces: list[str] = []
    start, n = 0, len(word)
    while start < n:
        end = n
        cur = None
        while start < end:
            sub = word[start:end]
            if start > 0:
                sub = prefix + sub
            if sub in vocab:
                cur = sub
                break
            end -= 1
        if cur is None:
            return [unk_token]
        pieces.append(cur)
        start = end
    return pieces
