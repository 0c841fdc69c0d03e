"""Text pipeline stages in the ``tokenizer.json`` vocabulary: normalizers, pre-tokenizers and decoders.

Each stage is described by the JSON object the ``tokenizers`` library writes (``{"type": "Lowercase"}``,
``{"type": "Metaspace", "replacement": "▁", ...}``), so a tokenizer's pipeline is saved and loaded as is.
Supported: normalizers ``BertNormalizer Lowercase NFC NFD NFKC NFKD Nmt Precompiled Strip StripAccents Replace
Prepend Sequence``; pre-tokenizers ``BertPreTokenizer Whitespace WhitespaceSplit Metaspace ByteLevel Split
Punctuation Digits Sequence``; decoders ``WordPiece BPEDecoder Metaspace ByteLevel ByteFallback Fuse Strip Replace
Sequence`` (what SentencePiece-style files such as Llama 2's and Mistral's use: ``Replace`` "▁" by " ",
``ByteFallback``, ``Fuse``, ``Strip``).
Any other stage raises :class:`UnsupportedStageError` naming it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any

from .bert_basic import BasicTokenizer, is_control, is_whitespace
from .byte_level import bytes_to_text, gpt2_split, text_to_bytes
from .precompiled import normalize_precompiled

__all__ = ["UnsupportedStageError", "byte_token", "check_stage", "decode_tokens", "is_word_char", "lowercases",
           "normalize", "pre_tokenize"]

Stage = dict[str, Any] | None

_WORD_CATEGORIES = {"Mn", "Mc", "Me", "Nd", "Pc"}


def _char_class(ch: str) -> int:
    """0: whitespace, 1: a word character as Rust's Unicode ``\\w`` defines it (letters, marks, digits,
    connector punctuation, joiners), 2: anything else."""
    if ch.isspace():
        return 0
    if ch.isalpha() or unicodedata.category(ch) in _WORD_CATEGORIES or ch in "\u200c\u200d":
        return 1
    return 2


def is_word_char(ch: str) -> bool:
    """Whether ``ch`` is a word character as Rust's Unicode ``\\w`` defines it."""
    return _char_class(ch) == 1


def _whitespace_words(text: str) -> list[str]:
    """The ``Whitespace`` pre-tokenizer: runs of word characters and runs of other non-space characters
    (the pattern ``\\w+|[^\\w\\s]+`` with Unicode classes)."""
    out: list[str] = []
    start, cur = 0, 0
    for i, ch in enumerate(text):
        c = _char_class(ch)
        if c != cur:
            if cur:
                out.append(text[start:i])
            start, cur = i, c
    if cur:
        out.append(text[start:])
    return out


# The Nmt normalizer (SentencePiece's NMT rules): control characters removed, some spaces and marks made a space
_NMT = {**{c: None for c in [*range(0x01, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F, 0x8F, 0x9F]},
        **{c: " " for c in [0x09, 0x0A, 0x0C, 0x0D, 0x1680, *range(0x200B, 0x2010), 0x2028, 0x2029, 0x2581, 0xFEFF,
                            0xFFFD]}}


class UnsupportedStageError(ValueError):
    """A ``tokenizer.json`` pipeline stage that fastarch does not implement."""


def _regex(pattern: Any, where: str) -> re.Pattern[str]:
    """A ``{"String": ...}`` or ``{"Regex": ...}`` pattern, compiled. Regexes use the ``regex`` package when it is
    installed (transformers installs it): like the library's engine it knows ``\\p{L}`` and takes ``\\s`` and
    ``\\w`` from Unicode's properties. Python's ``re`` is the fallback: no ``\\p{...}``, and its ``\\s`` also
    matches U+001C..U+001F."""
    if isinstance(pattern, dict) and "String" in pattern:
        return re.compile(re.escape(pattern["String"]))
    if not (isinstance(pattern, dict) and "Regex" in pattern):
        raise UnsupportedStageError(f"{where}: pattern must be {{'String': ...}} or {{'Regex': ...}}, "
                                    f"got {pattern!r}")
    try:
        import regex as engine
    except ImportError:
        engine = re
    try:
        return engine.compile(pattern["Regex"])
    except engine.error as e:
        hint = " (the 'regex' package, pip install regex, knows more patterns)" if engine is re else ""
        raise UnsupportedStageError(f"{where}: pattern {pattern['Regex']!r} is malformed or not supported "
                                    f"({e}){hint}") from None


def normalize(stage: Stage, text: str) -> str:
    """Apply a normalizer described by its ``tokenizer.json`` object (``None``: identity)."""
    if stage is None:
        return text
    kind = stage.get("type")
    if kind == "Sequence":
        for sub in stage["normalizers"]:
            text = normalize(sub, text)
        return text
    if kind == "Lowercase":
        return text.lower()
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return unicodedata.normalize(kind, text)
    if kind == "Strip":
        if stage.get("strip_left", True):
            text = text.lstrip()
        return text.rstrip() if stage.get("strip_right", True) else text
    if kind == "Replace":
        content = stage["content"]
        return _regex(stage["pattern"], "Replace normalizer").sub(lambda _: content, text)
    if kind == "Nmt":
        return text.translate(_NMT)
    if kind == "Precompiled":
        return normalize_precompiled(stage.get("precompiled_charsmap"), text)
    if kind == "StripAccents":
        # the library removes every mark (Mn, Mc, Me), spacing ones too, unlike BertNormalizer's Mn only
        return "".join(c for c in text if not unicodedata.category(c).startswith("M"))
    if kind == "Prepend":
        return stage["prepend"] + text if text else text
    if kind == "BertNormalizer":
        if stage.get("clean_text", True):
            text = "".join(" " if is_whitespace(c) else c for c in text
                           if c not in ("\0", "\ufffd") and not is_control(c))
        if stage.get("handle_chinese_chars", True):
            text = BasicTokenizer.space_chinese_chars(text)
        lowercase = stage.get("lowercase", True)
        strip = stage.get("strip_accents")
        if strip or (strip is None and lowercase):
            text = BasicTokenizer.strip_accents_of(text)
        return text.lower() if lowercase else text
    raise UnsupportedStageError(f"normalizer {kind!r} is not supported")


def _prepend_scheme(stage: dict[str, Any]) -> str:
    # files from before prepend_scheme existed say add_prefix_space
    if "prepend_scheme" in stage:
        return stage["prepend_scheme"]
    return "always" if stage.get("add_prefix_space", True) else "never"


def _metaspace(stage: dict[str, Any], text: str, at_start: bool) -> list[str]:
    rep = stage.get("replacement", "\u2581")
    text = text.replace(" ", rep)
    scheme = _prepend_scheme(stage)
    if scheme not in ("always", "first", "never"):
        raise UnsupportedStageError(f"Metaspace prepend_scheme {scheme!r} is not supported")
    if (scheme == "always" or (scheme == "first" and at_start)) and text and not text.startswith(rep):
        text = rep + text
    if not stage.get("split", True):
        return [text] if text else []
    return [p for p in re.split(f"(?={re.escape(rep)})", text) if p]


def _byte_level(stage: dict[str, Any], text: str) -> list[str]:
    # the prefix space goes before every piece of text between special tokens, as the library does
    if stage.get("add_prefix_space", True) and text and not text.startswith(" "):
        text = " " + text
    words = gpt2_split(text) if stage.get("use_regex", True) else [text] if text else []
    return [text_to_bytes(w) for w in words]


_SPLIT_BEHAVIORS = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _split(stage: dict[str, Any], text: str) -> list[str]:
    """The ``Split`` pre-tokenizer: the pattern's matches (with ``invert``: the text between them) are
    delimiters, handled as :func:`_split_at` does."""
    matches = [m.span() for m in _regex(stage["pattern"], "Split pre-tokenizer").finditer(text)]
    return _split_at(text, matches, stage["behavior"], bool(stage.get("invert", False)), "Split")


def _is_punctuation(ch: str) -> bool:
    """The library's punctuation: ASCII punctuation (symbols such as ``$+<=>^`|~`` included) or Unicode's P*."""
    return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


_ASCII_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_NUMERIC = frozenset(("Nd", "Nl", "No"))


def _split_chars(text: str, hit: Callable[[str], bool], behavior: str, kind: str) -> list[str]:
    """The ``Punctuation`` and ``Digits`` pre-tokenizers: each character ``hit`` accepts is a delimiter."""
    return _split_at(text, [(i, i + 1) for i, ch in enumerate(text) if hit(ch)], behavior, False, kind)


def _split_at(text: str, matches: list[tuple[int, int]], behavior: str, invert: bool, kind: str) -> list[str]:
    """Split ``text`` at the spans ``matches`` (with ``invert``: at the text between them), the delimiters
    removed, kept as pieces, or merged with the piece before or after, as the library does."""
    if behavior not in _SPLIT_BEHAVIORS:
        raise UnsupportedStageError(f"{kind} behavior {behavior!r} is not supported (expected one of "
                                    f"{', '.join(_SPLIT_BEHAVIORS)})")
    spans: list[list[int]] = []  # [start, end, is_delimiter]
    prev = 0
    for start, end in matches:
        if start != prev:
            spans.append([prev, start, invert])
        spans.append([start, end, not invert])
        prev = end
    if prev != len(text):
        spans.append([prev, len(text), invert])
    if behavior == "MergedWithNext":
        spans = [[len(text) - e, len(text) - s, d] for s, e, d in reversed(spans)]
    out: list[list[int]] = []
    before = False  # whether the previous span was a delimiter
    for span in spans:
        delim = span[2]
        if behavior == "Removed":
            if not delim:
                out.append(span)
        elif out and ((behavior == "Contiguous" and delim == before)
                      or (behavior in ("MergedWithPrevious", "MergedWithNext") and delim and not before)):
            out[-1][1] = span[1]
        else:
            out.append(span)
        before = delim
    if behavior == "MergedWithNext":
        out = [[len(text) - e, len(text) - s, d] for s, e, d in reversed(out)]
    return [text[s:e] for s, e, _ in out if e > s]


def pre_tokenize(stage: Stage, text: str, at_start: bool = True) -> list[str]:
    """Split normalized text into words with a pre-tokenizer described by its ``tokenizer.json`` object;
    ``at_start``: the text begins the input (Metaspace's "first" scheme prepends only there)."""
    if stage is None:
        return [text] if text else []
    kind = stage.get("type")
    if kind == "Sequence":
        words = [text]
        for sub in stage["pretokenizers"]:
            words = [w for j, word in enumerate(words) for w in pre_tokenize(sub, word, at_start and j == 0)]
        return words
    if kind == "WhitespaceSplit":
        return text.split()
    if kind == "Whitespace":
        return _whitespace_words(text)
    if kind == "BertPreTokenizer":
        return [w for word in text.split() for w in BasicTokenizer.split_on_punctuation(word)]
    if kind == "Metaspace":
        return _metaspace(stage, text, at_start)
    if kind == "ByteLevel":
        return _byte_level(stage, text)
    if kind == "Split":
        return _split(stage, text)
    if kind == "Punctuation":
        return _split_chars(text, _is_punctuation, stage.get("behavior", "Isolated"), kind)
    if kind == "Digits":
        numeric = lambda ch: unicodedata.category(ch) in _NUMERIC  # noqa: E731  (Rust's char::is_numeric)
        return _split_chars(text, numeric, "Isolated" if stage.get("individual_digits", False) else "Contiguous",
                            kind)
    raise UnsupportedStageError(f"pre-tokenizer {kind!r} is not supported")


_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_tokenization(text: str) -> str:
    """Remove the spaces before punctuation and inside English contractions (transformers' clean-up)."""
    for a, b in _CLEANUP:
        text = text.replace(a, b)
    return text


_BYTE_TOKEN = re.compile(r"<0x(\+[0-9a-fA-F]|[0-9a-fA-F]{2})>")


def byte_token(byte: int) -> str:
    """The vocabulary token that stands for one byte in byte-fallback models: ``<0x41>`` for ``A``."""
    return f"<0x{byte:02X}>"


def _byte_fallback(tokens: list[str]) -> list[str]:
    """The ``ByteFallback`` decoder: each run of ``<0xHH>`` tokens becomes its UTF-8 text, or one U+FFFD per
    byte when the run is not valid UTF-8; other tokens pass through."""
    out: list[str] = []
    run = bytearray()
    for tok in [*tokens, None]:
        m = _BYTE_TOKEN.fullmatch(tok) if tok is not None else None
        if m is not None:
            run.append(int(m.group(1), 16))
            continue
        if run:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" * len(run))
            run.clear()
        if tok is not None:
            out.append(tok)
    return out


def _strip(stage: dict[str, Any], tokens: list[str]) -> list[str]:
    """The ``Strip`` decoder: up to ``start`` leading and ``stop`` trailing ``content`` characters off each token."""
    content, start, stop = stage["content"], int(stage["start"]), int(stage["stop"])
    out = []
    for tok in tokens:
        i = 0
        while i < min(start, len(tok)) and tok[i] == content:
            i += 1
        j = len(tok)
        while j > i and len(tok) - j < stop and tok[j - 1] == content:
            j -= 1
        out.append(tok[i:j])
    return out


def _decode_chain(stage: dict[str, Any], tokens: list[str]) -> list[str]:
    """One decoder over the token strings, as the library chains them: a list of strings for the next one."""
    kind = stage.get("type")
    if kind == "Sequence":
        for sub in stage["decoders"]:
            tokens = _decode_chain(sub, tokens)
        return tokens
    if kind == "WordPiece":
        prefix, cleanup = stage.get("prefix", "##"), stage.get("cleanup", True)
        out = []
        for i, tok in enumerate(tokens):
            if i:
                tok = tok[len(prefix):] if tok.startswith(prefix) else " " + tok
            out.append(clean_up_tokenization(tok) if cleanup else tok)
        return out
    if kind == "BPEDecoder":
        suffix = stage.get("suffix", "</w>")
        n = len(tokens)
        return [t.replace(suffix, "" if i == n - 1 else " ") for i, t in enumerate(tokens)]
    if kind == "Metaspace":
        rep = stage.get("replacement", "\u2581")
        # as the library: unless the scheme is "never", the first token loses every replacement character
        drop_first = _prepend_scheme(stage) != "never"
        return [tok.replace(rep, "" if i == 0 and drop_first else " ") for i, tok in enumerate(tokens)]
    if kind == "ByteLevel":
        return [bytes_to_text(tokens)]
    if kind == "ByteFallback":
        return _byte_fallback(tokens)
    if kind == "Fuse":
        return ["".join(tokens)]
    if kind == "Strip":
        return _strip(stage, tokens)
    if kind == "Replace":
        pattern, content = _regex(stage["pattern"], "Replace decoder"), stage["content"]
        return [pattern.sub(lambda _: content, t) for t in tokens]
    raise UnsupportedStageError(f"decoder {kind!r} is not supported")


def decode_tokens(stage: Stage, tokens: list[str]) -> str:
    """Join token strings into text with a decoder described by its ``tokenizer.json`` object (``None``: the
    tokens joined by spaces, as the library does)."""
    if stage is None:
        return " ".join(tokens)
    return "".join(_decode_chain(stage, tokens))


def check_stage(stage: Stage, role: str) -> None:
    """Raise :class:`UnsupportedStageError` now if ``stage`` (a normalizer, pre_tokenizer or decoder) is not
    supported or malformed, instead of at the first encode."""
    if stage is None:
        return
    if not isinstance(stage, dict) or not isinstance(stage.get("type"), str):
        raise UnsupportedStageError(f"{role} must be null or an object with a 'type', got {stage!r}")
    try:
        if role == "normalizer":
            normalize(stage, "Ab")
        elif role == "pre_tokenizer":
            pre_tokenize(stage, "a b")
        else:
            decode_tokens(stage, ["a", "b"])
    except UnsupportedStageError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, re.error) as e:
        raise UnsupportedStageError(f"{role} {stage.get('type')!r} is malformed ({type(e).__name__}: {e})") from None


def lowercases(stage: Stage) -> bool:
    """Whether a normalizer lowercases the text."""
    if stage is None:
        return False
    if stage.get("type") == "Sequence":
        return any(lowercases(s) for s in stage.get("normalizers", []))
    return stage.get("type") == "Lowercase" or (stage.get("type") == "BertNormalizer" and stage.get("lowercase", True))
