"""The ``Precompiled`` normalizer: SentencePiece's compiled normalization rules (``precompiled_charsmap``).

Every SentencePiece-converted ``tokenizer.json`` (T5, ALBERT, XLNet, mBART, XLM-R, ...) carries the rules its
model was trained with (by default ``nmt_nfkc``: NFKC plus SentencePiece's NMT clean-up) as a base64 blob:

- a 4-byte little-endian size ``n`` in bytes, then ``n // 4`` little-endian 32-bit units of a Darts
  double-array trie over UTF-8 bytes, whose leaves hold byte offsets into
- the rest of the blob: the replacement strings, each ending with a NUL byte.

A unit packs the node's ``label`` (bits 0-7, and bit 31 which marks a leaf's value unit), ``has_leaf``
(bit 8) and the ``offset`` to its children (``unit >> 10``, shifted left by 8 when bit 9 is set); a leaf's
value unit holds the offset in its low 31 bits. From node ``p`` the child for byte ``c`` sits at
``p ^ offset(unit[p]) ^ c`` and exists when its label is ``c``.

The ``tokenizers`` library applies the rules per extended grapheme cluster, as :func:`normalize_precompiled`
does: a cluster of under 6 UTF-8 bytes whose bytes start with a key of the trie is replaced as a whole by the
replacement of the *shortest* such key (so ``"e\\u0301\\u0302"`` becomes ``"é"`` with ``nmt_nfkc``: the
second accent goes with the cluster); any other cluster is rewritten character by character, each character
replaced when it starts with a key, kept otherwise. Grapheme clusters come from the ``regex`` package's
``\\X`` (transformers installs it); without it the normalizer is refused with an error that says so.
An empty charsmap is the identity (as in SentencePiece; the library refuses to load one).
"""

from __future__ import annotations

import base64
import binascii
import functools
import struct
from collections.abc import Callable

__all__ = ["Charsmap", "charsmap", "normalize_precompiled"]

_FIELD = "field 'precompiled_charsmap'"
_MAX_GRAPHEME_BYTES = 6  # clusters this long or longer are rewritten character by character
_CACHE_LIMIT = 1 << 16


class Charsmap:
    """A decoded ``precompiled_charsmap``: the double-array trie and its replacement strings.

    Args:
        raw: the charsmap's bytes (base64-decoded); empty for the identity.
    """

    def __init__(self, raw: bytes) -> None:
        self.units: tuple[int, ...] = ()
        self.blob = b""
        self._cache: dict[str, str] = {}
        if not raw:
            return
        if len(raw) < 4:
            raise ValueError(f"{_FIELD} is truncated: {len(raw)} bytes, fewer than the 4 of the trie's size")
        (size,) = struct.unpack_from("<I", raw)
        n = size // 4
        if 4 + 4 * n > len(raw):
            raise ValueError(f"{_FIELD} is truncated: its trie takes {size} bytes, only {len(raw) - 4} follow")
        if n == 0:
            raise ValueError(f"{_FIELD} has an empty trie")
        self.units = struct.unpack_from(f"<{n}I", raw, 4)
        self.blob = raw[4 + 4 * n:]
        try:
            self.blob.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{_FIELD}: its replacement strings are not valid UTF-8 ({e.reason} at byte "
                             f"{e.start})") from None

    def _replacement(self, offset: int) -> str:
        if offset > len(self.blob):
            raise ValueError(f"{_FIELD}: a trie leaf points at byte {offset}, past the replacement strings "
                             f"({len(self.blob)} bytes)")
        end = self.blob.find(b"\0", offset)
        piece = self.blob[offset:] if end < 0 else self.blob[offset:end]
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{_FIELD}: a trie leaf points at byte {offset}, inside a character") from None

    def transform(self, chunk: str) -> str | None:
        """The replacement of the shortest trie key that ``chunk``'s UTF-8 bytes start with (None: no key)."""
        units = self.units
        if not units:
            return None
        try:
            unit = units[0]
            pos = (unit >> 10) << ((unit & 0x200) >> 6)
            for c in chunk.encode("utf-8"):
                if c == 0:
                    return None
                pos ^= c
                unit = units[pos]
                if unit & 0x800000FF != c:
                    return None
                pos ^= (unit >> 10) << ((unit & 0x200) >> 6)
                if unit & 0x100:
                    return self._replacement(units[pos] & 0x7FFFFFFF)
        except IndexError:
            raise ValueError(f"{_FIELD}: the trie is corrupt (a node points past its {len(units)} units)") from None
        return None

    def normalize(self, text: str) -> str:
        """``text`` normalized as the ``tokenizers`` library does (see the module docstring)."""
        if not self.units or not text:
            return text
        cache = self._cache
        out = []
        for cluster in _graphemes()(text):
            hit = cache.get(cluster)
            if hit is None:
                if len(cluster.encode("utf-8")) < _MAX_GRAPHEME_BYTES:
                    hit = self.transform(cluster)
                if hit is None:
                    hit = "".join(r if (r := self.transform(ch)) is not None else ch for ch in cluster)
                if len(cache) < _CACHE_LIMIT:
                    cache[cluster] = hit
            out.append(hit)
        return "".join(out)


@functools.lru_cache(maxsize=1)
def _graphemes() -> Callable[[str], list[str]]:
    """A function splitting text into its extended grapheme clusters (the ``regex`` package's ``\\X``)."""
    try:
        import regex
    except ImportError:
        raise ValueError("the Precompiled normalizer needs the 'regex' package for grapheme clusters "
                         "(pip install regex; transformers installs it)") from None
    return regex.compile(r"\X", regex.DOTALL).findall


@functools.lru_cache(maxsize=16)
def charsmap(encoded: str | None) -> Charsmap:
    """The :class:`Charsmap` of a ``precompiled_charsmap`` field (base64), decoded once per distinct field."""
    if not isinstance(encoded, str):
        raise ValueError(f"{_FIELD} must be a base64 string, got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{_FIELD} is not valid base64 ({e})") from None
    return Charsmap(raw)


def normalize_precompiled(encoded: str | None, text: str) -> str:
    """``text`` normalized by the ``Precompiled`` normalizer whose ``precompiled_charsmap`` is ``encoded``."""
    return charsmap(encoded).normalize(text)
