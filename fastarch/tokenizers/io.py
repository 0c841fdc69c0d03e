"""Shared tokenizer plumbing: vocabulary/id maps, special tokens, atomic JSON save/load with validation."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from .._files import atomic_write
from .batch import Encoding, batch_encode
from .byte_level import WHITE_SPACE
from .pipeline import check_stage, clean_up_tokenization, decode_tokens, is_word_char, normalize, pre_tokenize

__all__ = ["BaseTokenizer", "TokenizerFileError", "atomic_write_text", "load_tokenizer"]

FORMAT_VERSION = 1

#: the options of an added token (``tokenizer.json``'s names), and their values for a plain special token
ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
_SPECIAL_DEFAULT = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}

# the added tokens matched in a text: a regex of their spellings (None: none) and spelling -> (token, flags)
_Matcher = tuple["re.Pattern[str] | None", dict[str, tuple[str, dict[str, bool]]]]

# class name -> tokenizer class, filled as subclasses of BaseTokenizer are defined
_TOKENIZER_TYPES: dict[str, type[BaseTokenizer]] = {}


class TokenizerFileError(ValueError):
    """A tokenizer or vocabulary file is missing, unreadable or malformed."""


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, fsync, ``os.replace``."""
    atomic_write(path, lambda f: f.write(text), binary=False)


def _fail(path: str, msg: str) -> TokenizerFileError:
    return TokenizerFileError(f"{path}: {msg}")


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise _fail(path, "no such tokenizer file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot read the tokenizer file ({e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise _fail(path, f"expected a JSON object at the top level, got {type(data).__name__}")
    return data


def require(path: str, data: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in data:
        raise _fail(path, f"missing field '{key}' ({what})")
    val = data[key]
    if not isinstance(val, kind) or (kind is int and isinstance(val, bool)):
        raise _fail(path, f"field '{key}' must be {what}, got {type(val).__name__}")
    return val


def _role_id_property(role: str) -> property:
    """``<role>_id``: the id of the special token with that role, or None (as transformers' tokenizers)."""
    return property(lambda self: self._role_id(role))


class BaseTokenizer:
    """Vocabulary, ids and special tokens shared by the BPE, WordPiece and Unigram tokenizers.

    Subclasses implement ``_words`` and ``_segment`` (or ``tokenize(text) -> list[str]`` as a whole) for
    ordinary text, ``_decode_tokens`` and the ``_state``/``_from_state`` pair used by :meth:`save`/:meth:`load`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A saved file names its class; load() finds it here without importing the subclasses' modules.
        super().__init_subclass__(**kwargs)
        _TOKENIZER_TYPES[cls.__name__] = cls

    #: special-token roles, in the order their ids are assigned
    SPECIAL_ROLES: tuple[str, ...] = ("pad_token", "unk_token", "bos_token", "eos_token")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self._id_to_token: list[str] = []
        self.special_tokens: dict[str, str] = {}
        self.additional_special_tokens: list[str] = []
        # Options of added tokens (ADDED_TOKEN_FLAGS; a missing one takes a plain special token's value). An
        # entry with special=False is an added token that is not special (split out of the text, kept by
        # decode). Replace an entry to change it: the matchers are rebuilt when an entry is another object.
        self.added_token_flags: dict[str, dict[str, bool]] = {}
        self._added_cache: tuple[Any, _Matcher, _Matcher] | None = None  # the matchers of _added_matchers
        # Tokens that only the added tokens have (a tokenizer.json's added tokens missing from its model's
        # vocabulary): the model never produces them.
        self.added_only: set[str] = set()
        # Special-role tokens that are not added tokens (a tokenizer.json whose unk token is missing from its
        # added tokens, as SentencePiece converters write them): the model uses them, but they are ordinary
        # text, kept by decode and not written back as added tokens.
        self.not_added: set[str] = set()
        # The text pipeline as tokenizer.json stages (see pipeline.py); subclasses set their defaults.
        self.normalizer: dict[str, Any] | None = None
        self.pre_tokenizer: dict[str, Any] | None = None
        self.decoder: dict[str, Any] | None = None
        # Post-processing templates: lists of ("$A" | "$B" | special token, type id); None: the default.
        self.templates: dict[str, list[tuple[str, int]]] | None = None
        self.model_max_length: int | None = None
        self.padding_side = "right"  # "left" for batched generation with decoder-only models

    def _configure(self, vocab_size: int, lowercase: bool, **roles: str | None) -> None:
        """Check and set the options every tokenizer has; ``roles`` maps special-token roles to tokens."""
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"{type(self).__name__}: argument 'vocab_size' must be a positive int, "
                             f"got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.lowercase = lowercase
        self.special_tokens = {r: t for r, t in roles.items() if t}

    # ---- vocabulary -------------------------------------------------------------------------------------
    def _set_vocab(self, tokens: Sequence[str]) -> None:
        if len(set(tokens)) != len(tokens):
            dup = sorted({t for t in tokens if tokens.count(t) > 1})[:5]
            raise ValueError(f"{type(self).__name__}: duplicate tokens in the vocabulary: {dup}")
        self._id_to_token = list(tokens)
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self._added_cache = None

    def model_vocab(self) -> dict[str, int]:
        """The vocabulary the model segments words into: :attr:`vocab` without :attr:`added_only`."""
        if not self.added_only:
            return self.vocab
        key = (self.vocab, len(self.vocab), self.added_only, len(self.added_only))  # the same objects: identity
        cached = getattr(self, "_model_vocab_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, {t: i for t, i in self.vocab.items() if t not in self.added_only})
            self._model_vocab_cache = cached
        return cached[1]

    def _specials_in_order(self) -> list[str]:
        out = [self.special_tokens[r] for r in self.SPECIAL_ROLES if self.special_tokens.get(r)]
        out += [t for t in self.additional_special_tokens if t not in out]
        return [t for t in out if t not in self.not_added] if self.not_added else out

    @property
    def all_special_tokens(self) -> list[str]:
        return self._specials_in_order()

    @property
    def all_special_ids(self) -> list[int]:
        return [self.vocab[t] for t in self._specials_in_order() if t in self.vocab]

    def _role_id(self, role: str) -> int | None:
        tok = self.special_tokens.get(role)
        return self.vocab.get(tok) if tok else None

    pad_token_id = _role_id_property("pad_token")
    unk_token_id = _role_id_property("unk_token")
    bos_token_id = _role_id_property("bos_token")
    eos_token_id = _role_id_property("eos_token")
    cls_token_id = _role_id_property("cls_token")
    sep_token_id = _role_id_property("sep_token")
    mask_token_id = _role_id_property("mask_token")

    def __len__(self) -> int:
        return len(self._id_to_token)

    def get_vocab_size(self) -> int:
        return len(self._id_to_token)

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, idx: int) -> str:
        if not isinstance(idx, int) or not 0 <= idx < len(self._id_to_token):
            raise ValueError(f"{type(self).__name__}: token id must be in [0, {len(self._id_to_token)}), got {idx!r}")
        return self._id_to_token[idx]

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        unk = self.special_tokens.get("unk_token")
        unk_id = self.vocab.get(unk) if unk else None
        out = []
        for t in tokens:
            i = self.vocab.get(t, unk_id)
            if i is None:
                raise ValueError(f"{type(self).__name__}: token {t!r} is not in the vocabulary and there is no "
                                 "unk_token")
            out.append(i)
        return out

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_token(int(i)) for i in ids]

    def _require_vocab(self) -> None:
        if not self.vocab:
            raise ValueError(f"{type(self).__name__}: tokenizer not trained yet (call train() or load())")

    # ---- text <-> ids -----------------------------------------------------------------------------------
    def added_tokens(self) -> list[tuple[str, dict[str, bool]]]:
        """The tokens split out of the text before the model sees it, with their options (ADDED_TOKEN_FLAGS):
        the special tokens, then the added tokens that are not special."""
        out = [(t, {**_SPECIAL_DEFAULT, **self.added_token_flags.get(t, {}), "special": True})
               for t in self._specials_in_order() if t in self.vocab]
        out += [(t, {**_SPECIAL_DEFAULT, **f}) for t, f in self.added_token_flags.items()
                if not f.get("special", True) and t in self.vocab]
        return out

    def _added_matchers(self) -> tuple[_Matcher, _Matcher]:
        """Matchers of the added tokens found in the raw text and of those found in the normalized text (their
        normalized spelling), rebuilt when the added tokens or the normalizer change."""
        # cheap to compare on every call (the same objects compare by identity); an entry of added_token_flags
        # or the normalizer is replaced, not edited in place
        key = (tuple(self._specials_in_order()), tuple(self.added_token_flags.items()), self.normalizer, self.vocab)
        if self._added_cache is None or self._added_cache[0] != key:
            added = self.added_tokens()
            raw = {t: (t, f) for t, f in reversed(added) if not f["normalized"]}
            norm = {n: (t, f) for t, f in reversed(added) if f["normalized"] and (n := normalize(self.normalizer, t))}
            self._added_cache = (key, _matcher(raw), _matcher(norm))
        return self._added_cache[1], self._added_cache[2]

    def _words(self, text: str, at_start: bool = True) -> list[str]:
        """Normalization and pre-tokenization: ``text`` as the words that :meth:`_segment` splits.
        ``at_start``: the text begins the input (not after a special token), for Metaspace's "first"."""
        return pre_tokenize(self.pre_tokenizer, normalize(self.normalizer, text), at_start)

    def _segment(self, word: str) -> list[str]:
        """One word as token strings."""
        raise NotImplementedError

    def tokenize(self, text: str, at_start: bool = True) -> list[str]:
        """Token strings of ``text`` (ordinary text, no special tokens)."""
        self._require_vocab()
        return [t for w in self._words(text, at_start) for t in self._segment(w)]

    def tokenize_with_specials(self, text: str) -> list[str]:
        """Token strings of ``text``, with the added tokens written in it, as the ``tokenizers`` library does:
        the tokens matched on the raw text are split out first, then each other piece is normalized, the
        tokens matched on normalized text are split out of it, and the rest is pre-tokenized and segmented."""
        self._require_vocab()
        raw, norm = self._added_matchers()
        out: list[str] = []
        for i, (piece, token) in enumerate(split_added(text, raw)):
            if token is not None:
                out.append(token)
                continue
            for j, (sub, token) in enumerate(split_added(normalize(self.normalizer, piece), norm)):
                if token is not None:
                    out.append(token)
                else:
                    words = pre_tokenize(self.pre_tokenizer, sub, i == 0 and j == 0)
                    out += [t for w in words for t in self._segment(w)]
        return out

    def _default_template(self, pair: bool) -> list[tuple[str, int]]:
        """``<bos> $A <eos>`` (and ``<bos> $B <eos>`` with type id 1 for pairs), with the specials defined."""
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        out: list[tuple[str, int]] = []
        for seq, type_id in (("$A", 0), ("$B", 1))[: 2 if pair else 1]:
            out += ([(bos, type_id)] if bos else []) + [(seq, type_id)] + ([(eos, type_id)] if eos else [])
        return out

    def template(self, pair: bool = False) -> list[tuple[str, int]]:
        """The post-processing template for one sequence or a pair: ``("$A" | "$B" | token, type id)``."""
        if self.templates is not None:
            return self.templates["pair" if pair else "single"]
        return self._default_template(pair)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return sum(1 for item, _ in self.template(pair) if item not in ("$A", "$B"))

    def post_process(self, ids: list[int], pair_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Add the special tokens of the template: ``(ids, token type ids)``."""
        out: list[int] = []
        types: list[int] = []
        for item, type_id in self.template(pair_ids is not None):
            part = ids if item == "$A" else pair_ids if item == "$B" else [self.vocab[item]]
            out += part or []
            types += [type_id] * len(part or [])
        return out, types

    def _wrap_special(self, ids: list[int]) -> list[int]:
        """Add the model's special tokens around one sequence."""
        return self.post_process(ids)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text`` (special tokens written in the text map to their ids)."""
        if not isinstance(text, str):
            raise TypeError(f"{type(self).__name__}.encode: argument 'text' must be a str, got {type(text).__name__}")
        ids = self.convert_tokens_to_ids(self.tokenize_with_specials(text))
        return self._wrap_special(ids) if add_special_tokens else ids

    def encode_pair(self, text: str, text_pair: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of a sequence pair (``[CLS] a [SEP] b [SEP]`` for BERT)."""
        a = self.encode(text, add_special_tokens=False)
        b = self.encode(text_pair, add_special_tokens=False)
        return self.post_process(a, b)[0] if add_special_tokens else a + b

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def _decode_tokens(self, tokens: list[str]) -> str:
        return decode_tokens(self.decoder, tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool = False) -> str:
        """Text of ``ids``, joined by the tokenizer's decoder as transformers does; special tokens are dropped
        (``skip_special_tokens``) or kept. ``clean_up_tokenization_spaces`` also removes the spaces before
        ``. , ! ?`` and inside contractions (transformers' default is off; the WordPiece decoder does it)."""
        self._require_vocab()
        specials = set(self._specials_in_order())
        tokens = [t for t in self.convert_ids_to_tokens(ids) if not (skip_special_tokens and t in specials)]
        text = self._decode_tokens(tokens)
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True,
                     clean_up_tokenization_spaces: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    # ---- batch calls ------------------------------------------------------------------------------------
    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *,
                 add_special_tokens: bool = True, padding: bool | str = False, truncation: bool | str = False,
                 max_length: int | None = None, return_tensors: str | None = None) -> Encoding:
        """Encode a text or a batch as transformers does: ``input_ids``, ``token_type_ids``, ``attention_mask``.

        ``padding``: ``True``/``"longest"`` (to the longest of the batch), ``"max_length"`` or ``False``; pads
        with ``pad_token`` (type id 0, mask 0) on ``padding_side`` (``"right"`` unless set to ``"left"``). ``truncation``: ``True``/``"longest_first"``,
        ``"only_first"``, ``"only_second"`` or ``False``, to ``max_length`` (or ``model_max_length``) tokens
        special tokens included. ``return_tensors="pt"`` gives (B, L) long tensors (a single text: B = 1).
        """
        return batch_encode(self, text, text_pair, add_special_tokens=add_special_tokens, padding=padding,
                            truncation=truncation, max_length=max_length, return_tensors=return_tensors)

    # ---- persistence ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_state(cls, path: str, data: dict[str, Any]) -> BaseTokenizer:
        raise NotImplementedError

    def _common_state(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "version": FORMAT_VERSION, "vocab": list(self._id_to_token),
                "special_tokens": dict(self.special_tokens),
                "additional_special_tokens": list(self.additional_special_tokens),
                "added_token_flags": {t: dict(f) for t, f in self.added_token_flags.items()},
                "added_only": sorted(self.added_only), "not_added": sorted(self.not_added),
                "pipeline": {"normalizer": self.normalizer, "pre_tokenizer": self.pre_tokenizer, "decoder": self.decoder,
                             "templates": self.templates, "model_max_length": self.model_max_length}}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the tokenizer as JSON, atomically (a crash never leaves a half-written file)."""
        state = self._common_state()
        state.update(self._state())
        atomic_write_text(path, json.dumps(state, ensure_ascii=False, indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BaseTokenizer:
        """Load a tokenizer saved by :meth:`save`; malformed files raise :class:`TokenizerFileError`."""
        p = os.fspath(path)
        data = read_json(p)
        typ = require(p, data, "type", str, "the tokenizer class name")
        if cls is not BaseTokenizer and typ != cls.__name__:
            raise _fail(p, f"holds a {typ}, not a {cls.__name__}")
        version = require(p, data, "version", int, "an int")
        if version != FORMAT_VERSION:
            raise _fail(p, f"format version {version} is not supported (expected {FORMAT_VERSION})")
        target = cls if cls is not BaseTokenizer else _TOKENIZER_TYPES.get(typ)
        if target is None:
            raise _fail(p, f"unknown tokenizer type {typ!r}")
        vocab = require(p, data, "vocab", list, "a list of token strings")
        if not all(isinstance(t, str) for t in vocab):
            raise _fail(p, "field 'vocab' must hold only strings")
        if len(set(vocab)) != len(vocab):
            raise _fail(p, "field 'vocab' has duplicate tokens")
        specials = require(p, data, "special_tokens", dict, "an object mapping roles to tokens")
        extra = require(p, data, "additional_special_tokens", list, "a list of strings")
        for role, tok in specials.items():
            if not isinstance(tok, str) or tok not in vocab:
                raise _fail(p, f"special token {role}={tok!r} is not a token of the vocabulary")
        for tok in extra:
            if not isinstance(tok, str) or tok not in vocab:
                raise _fail(p, f"additional special token {tok!r} is not a token of the vocabulary")
        tok = target._from_state(p, data)
        pipeline = data.get("pipeline")
        if pipeline is not None:  # files written before the pipeline was saved keep the class defaults
            if not isinstance(pipeline, dict):
                raise _fail(p, f"field 'pipeline' must be an object, got {type(pipeline).__name__}")
            try:
                for role in ("normalizer", "pre_tokenizer", "decoder"):
                    check_stage(pipeline.get(role), role)
                    setattr(tok, role, pipeline.get(role))
            except ValueError as e:
                raise _fail(p, str(e)) from None
            templates = pipeline.get("templates")
            if templates is not None:
                tok.templates = {k: [(str(item), int(t)) for item, t in templates[k]] for k in ("single", "pair")}
            tok.model_max_length = pipeline.get("model_max_length")
        known = set(vocab)
        flags = data.get("added_token_flags", {})  # absent from files written before added tokens had options
        if not isinstance(flags, dict) or not all(
                isinstance(t, str) and t in known and isinstance(f, dict)
                and all(k in ADDED_TOKEN_FLAGS and isinstance(v, bool) for k, v in f.items())
                for t, f in flags.items()):
            raise _fail(p, f"field 'added_token_flags' must map tokens of the vocabulary to {{option: bool}} with "
                           f"options among {ADDED_TOKEN_FLAGS}")
        added_only = data.get("added_only", [])
        if not isinstance(added_only, list) or not all(isinstance(t, str) and t in known for t in added_only):
            raise _fail(p, "field 'added_only' must be a list of tokens of the vocabulary")
        not_added = data.get("not_added", [])
        if not isinstance(not_added, list) or not all(isinstance(t, str) and t in known for t in not_added):
            raise _fail(p, "field 'not_added' must be a list of tokens of the vocabulary")
        tok.special_tokens = dict(specials)
        tok.additional_special_tokens = list(extra)
        tok.added_token_flags = {t: dict(f) for t, f in flags.items()}
        tok.added_only = set(added_only)
        tok.not_added = set(not_added)
        tok._set_vocab(vocab)
        return tok


def _matcher(spellings: dict[str, tuple[str, dict[str, bool]]]) -> _Matcher:
    if not spellings:
        return None, spellings
    # longest first: at a position the longest spelling wins, as the library's leftmost-longest matching
    return re.compile("|".join(re.escape(s) for s in sorted(spellings, key=len, reverse=True))), spellings


def split_added(text: str, matcher: _Matcher) -> list[tuple[str, str | None]]:
    """``text`` as non-empty pieces ``(piece, added token or None)``. A match of a ``single_word`` token with a
    word character next to it is not one; ``lstrip`` / ``rstrip`` tokens take the whitespace on their left /
    right into their piece (the library's rules)."""
    regex, spellings = matcher
    if regex is None:
        return [(text, None)] if text else []
    out: list[tuple[str, str | None]] = []
    prev = 0
    for m in regex.finditer(text):
        start, stop = m.span()
        token, flags = spellings[m.group()]
        if flags["single_word"] and ((start > 0 and is_word_char(text[start - 1]))
                                     or (stop < len(text) and is_word_char(text[stop]))):
            continue
        if flags["lstrip"]:
            while start > prev and text[start - 1] in WHITE_SPACE:
                start -= 1
        if flags["rstrip"]:
            while stop < len(text) and text[stop] in WHITE_SPACE:
                stop += 1
        if prev < start:
            out.append((text[prev:start], None))
        out.append((text[start:stop], token))
        prev = stop
    if prev < len(text):
        out.append((text[prev:], None))
    return out


def load_tokenizer(path: str | os.PathLike[str]) -> BaseTokenizer:
    """Load any tokenizer saved by ``save`` (the class is read from the file)."""
    return BaseTokenizer.load(path)
