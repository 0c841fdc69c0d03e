"""Byte-level text for BPE (GPT-2, RoBERTa, Llama 3): the GPT-2 split pattern and the byte <-> character map.

A byte-level tokenizer works on the UTF-8 bytes of the text, each byte shown as one printable character so
that tokens stay strings: the bytes of printable Latin-1 characters (``!``..``~``, ``¡``..``¬``,
``®``..``ÿ``) stand for themselves, the other 68 bytes take ``chr(256)``, ``chr(257)``, ... in byte order
(so a space is ``Ġ`` and a newline ``Ċ``). Every byte string is then spelled by 256 symbols, and no text
needs an unknown token.

Before the mapping, text is split with GPT-2's pattern
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``. Python's ``re`` has
no ``\\p{L}``, so :func:`gpt2_split` scans the text by hand with the pattern's semantics (ordered
alternatives, greedy runs, the look-ahead giving back the last whitespace before a word): letters and
numbers are the Unicode categories ``L*`` and ``N*``, whitespace is Unicode's ``White_Space`` property.
"""

from __future__ import annotations

import unicodedata

__all__ = ["BYTE_TO_CHAR", "CHAR_TO_BYTE", "WHITE_SPACE", "bytes_to_text", "gpt2_split", "text_to_bytes"]


def _byte_to_char() -> dict[int, str]:
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


#: byte value -> the character that spells it in a byte-level vocabulary
BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
#: the inverse of :data:`BYTE_TO_CHAR`
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

# Unicode's White_Space property (what ``\s`` matches in the tokenizers library's regex engine); note that
# Python's str.isspace also accepts U+001C..U+001F, which ``\s`` does not.
WHITE_SPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
                         + "".join(chr(c) for c in range(0x2000, 0x200B)))
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def _kind(ch: str) -> str:
    """``"s"`` whitespace, ``"L"`` letter, ``"N"`` number, ``"o"`` anything else."""
    if ch in WHITE_SPACE:
        return "s"
    major = unicodedata.category(ch)[0]
    return major if major in ("L", "N") else "o"


def gpt2_split(text: str) -> list[str]:
    """The matches of GPT-2's pre-tokenization pattern in ``text``, in order; they cover the whole text."""
    kinds = [_kind(ch) for ch in text]
    n = len(text)
    out: list[str] = []
    i = 0
    while i < n:
        if text[i] == "'":
            hit = next((c for c in _CONTRACTIONS if text.startswith(c, i)), None)
            if hit is not None:
                out.append(hit)
                i += len(hit)
                continue
        start = i
        if text[i] == " " and i + 1 < n and kinds[i + 1] != "s":
            i += 1  # the optional space of ` ?\p{L}+`, ` ?\p{N}+` and ` ?[^\s\p{L}\p{N}]+`
        kind = kinds[i]
        j = i + 1
        while j < n and kinds[j] == kind:
            j += 1
        if kind == "s" and j < n and j - 1 > start:
            j -= 1  # \s+(?!\S): the last whitespace before a non-space goes with what follows
        out.append(text[start:j])
        i = j
    return out


def text_to_bytes(text: str) -> str:
    """``text`` as its UTF-8 bytes, each spelled by its byte-level character."""
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


def bytes_to_text(tokens: list[str]) -> str:
    """Join byte-level tokens back into text. A token with a character outside the byte alphabet (an added
    token, say) stands for its own UTF-8 bytes; invalid UTF-8 becomes U+FFFD."""
    data = bytearray()
    for tok in tokens:
        try:
            data.extend([CHAR_TO_BYTE[c] for c in tok])
        except KeyError:
            data.extend(tok.encode("utf-8"))
    return data.decode("utf-8", errors="replace")
