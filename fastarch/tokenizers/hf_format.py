"""Reading and writing the ``tokenizer.json`` format of the ``tokenizers`` library (what transformers'
fast tokenizers load): ``model`` (BPE, WordPiece or Unigram), ``normalizer``, ``pre_tokenizer``,
``post_processor``, ``decoder`` and ``added_tokens``. The file is plain JSON; nothing is unpickled.

Supported stages are listed in :mod:`fastarch.tokenizers.pipeline`; post-processors ``TemplateProcessing``,
``BertProcessing``, ``RobertaProcessing``, ``ByteLevel`` (offsets only: no special tokens), a ``Sequence``
of ``ByteLevel`` and one of the others, or none. Byte-level BPE (GPT-2, RoBERTa, Llama 3) is a BPE model with
the ``ByteLevel`` pre-tokenizer and decoder; ``ignore_merges``, ``fuse_unk``, ``byte_fallback`` (BPE and
Unigram: an unknown character becomes its ``<0xHH>`` byte tokens, as in Llama 2, Mistral and Gemma), BPE's
``dropout`` (see :meth:`~fastarch.tokenizers.BPETokenizer.set_dropout` to seed it), ``continuing_subword_prefix``
and ``end_of_word_suffix`` are honoured. SentencePiece-converted files (T5, ALBERT, XLNet, ...) carry their
normalization rules in a ``Precompiled`` normalizer (:mod:`fastarch.tokenizers.precompiled`); an unk token they
leave out of the added tokens is ordinary text to the library, and goes to ``not_added``.

Added tokens, special or not, are split out of the text as the library does (see
:meth:`~fastarch.tokenizers.BaseTokenizer.tokenize_with_specials`), with their ``single_word``, ``lstrip``,
``rstrip`` and ``normalized`` options; a ``normalized`` token must be left unchanged by the normalizer (the
library would match and return its normalized spelling). Added tokens missing from the model's vocabulary are
never produced by the model (``added_only``). Anything else raises :class:`TokenizerFileError` naming it.
The file's ``truncation`` sets ``model_max_length``; its ``padding`` is ignored (padding is per call).
"""

from __future__ import annotations

import json
import os
from typing import Any

from .bpe import BPETokenizer
from .io import ADDED_TOKEN_FLAGS, BaseTokenizer, TokenizerFileError, atomic_write_text, read_json, require
from .pipeline import UnsupportedStageError, check_stage, lowercases, normalize
from .unigram import UnigramTokenizer
from .wordpiece import WordPieceTokenizer

__all__ = ["load_tokenizer_json", "save_tokenizer_json", "to_tokenizer_json"]

# Special tokens are given roles by their usual spellings; the others become additional special tokens.
_ROLE_SPELLINGS = {
    "pad_token": ("[PAD]", "<pad>"), "cls_token": ("[CLS]",), "sep_token": ("[SEP]",),
    "mask_token": ("[MASK]", "<mask>"), "bos_token": ("<s>", "<bos>", "[BOS]"), "eos_token": ("</s>", "<eos>", "[EOS]"),
}


# ---- writing ------------------------------------------------------------------------------------------------
def _template_json(tok: BaseTokenizer) -> dict[str, Any]:
    def items(pair: bool) -> list[dict[str, Any]]:
        out = []
        for item, type_id in tok.template(pair):
            if item in ("$A", "$B"):
                out.append({"Sequence": {"id": item[1], "type_id": type_id}})
            else:
                out.append({"SpecialToken": {"id": item, "type_id": type_id}})
        return out

    specials = {item for pair in (False, True) for item, _ in tok.template(pair) if item not in ("$A", "$B")}
    return {"type": "TemplateProcessing", "single": items(False), "pair": items(True),
            "special_tokens": {t: {"id": t, "ids": [tok.vocab[t]], "tokens": [t]} for t in sorted(specials)}}


def _model_json(tok: BaseTokenizer) -> dict[str, Any]:
    vocab = tok.model_vocab()
    if isinstance(tok, BPETokenizer):
        return {"type": "BPE", "dropout": tok.dropout, "unk_token": tok.special_tokens.get("unk_token"),
                "continuing_subword_prefix": tok.continuing_subword_prefix or None, "end_of_word_suffix": tok.end_of_word_suffix or None,
                "fuse_unk": tok.fuse_unk, "byte_fallback": tok.byte_fallback, "ignore_merges": tok.ignore_merges,
                "vocab": dict(vocab), "merges": [list(m) for m in tok.merges]}
    if isinstance(tok, WordPieceTokenizer):
        return {"type": "WordPiece", "unk_token": tok.unk_token, "continuing_subword_prefix": tok.prefix,
                "max_input_chars_per_word": tok.max_input_chars_per_word, "vocab": dict(vocab)}
    if isinstance(tok, UnigramTokenizer):
        scores = tok.piece_scores()
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError("to_tokenizer_json: a Unigram model's pieces must have the ids 0..n-1, before the "
                             f"added-only tokens; got added-only tokens {sorted(tok.added_only)} among them")
        return {"type": "Unigram", "unk_id": tok.vocab[tok.unk_token],
                "vocab": [[t, scores[t]] for t in tok.convert_ids_to_tokens(range(len(vocab)))],
                "byte_fallback": tok.byte_fallback}
    raise TypeError(f"to_tokenizer_json: argument 'tok' must be a BPE, WordPiece or Unigram tokenizer, "
                    f"got {type(tok).__name__}")


def to_tokenizer_json(tok: BaseTokenizer) -> dict[str, Any]:
    """The ``tokenizer.json`` object of ``tok``."""
    tok._require_vocab()
    added = [{"id": tok.vocab[t], "content": t, **flags} for t, flags in tok.added_tokens()]
    truncation = None
    if tok.model_max_length is not None:
        truncation = {"direction": "Right", "max_length": tok.model_max_length, "strategy": "LongestFirst",
                      "stride": 0}
    return {"version": "1.0", "truncation": truncation, "padding": None,
            "added_tokens": sorted(added, key=lambda a: a["id"]), "normalizer": tok.normalizer,
            "pre_tokenizer": tok.pre_tokenizer, "model": _model_json(tok), "post_processor": _template_json(tok),
            "decoder": tok.decoder}


def save_tokenizer_json(tok: BaseTokenizer, path: str | os.PathLike[str]) -> None:
    """Write ``tok`` as a ``tokenizer.json`` file, atomically. A folder gets ``tokenizer.json`` inside it."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    atomic_write_text(p, json.dumps(to_tokenizer_json(tok), ensure_ascii=False, indent=2))


# ---- reading ------------------------------------------------------------------------------------------------
def _added_tokens(p: str, data: dict[str, Any]) -> dict[int, tuple[str, dict[str, bool]]]:
    """``{id: (content, flags)}`` of the file's added tokens."""
    out: dict[int, tuple[str, dict[str, bool]]] = {}
    for i, a in enumerate(require(p, data, "added_tokens", list, "a list of added tokens")):
        if not isinstance(a, dict) or not isinstance(a.get("content"), str) or not isinstance(a.get("id"), int):
            raise TokenizerFileError(f"{p}: added token {i} must have an int 'id' and a str 'content', got {a!r}")
        # the library's defaults for a field left out
        flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": not a.get("special", False),
                 "special": False}
        for flag in ADDED_TOKEN_FLAGS:
            flags[flag] = a.get(flag, flags[flag])
            if not isinstance(flags[flag], bool):
                raise TokenizerFileError(f"{p}: added token {a['content']!r} field '{flag}' must be a bool, "
                                         f"got {flags[flag]!r}")
        if not a["content"]:
            raise TokenizerFileError(f"{p}: added token {i} has an empty 'content'")
        out[a["id"]] = (a["content"], flags)
    return out


def _vocab_list(p: str, model_vocab: dict[str, int], added: dict[int, str]) -> list[str]:
    by_id = {i: t for t, i in model_vocab.items()}
    if len(by_id) != len(model_vocab):
        raise TokenizerFileError(f"{p}: the model vocabulary gives one id to several tokens")
    for i, t in added.items():
        if by_id.setdefault(i, t) != t:
            raise TokenizerFileError(f"{p}: id {i} is {by_id[i]!r} in the model but added token {t!r}")
    n = len(by_id)
    if sorted(by_id) != list(range(n)):
        raise TokenizerFileError(f"{p}: token ids must be 0..{n - 1} without gaps")
    return [by_id[i] for i in range(n)]


def _templates(p: str, post: Any, vocab: dict[str, int]) -> dict[str, list[tuple[str, int]]]:
    kind = post.get("type") if isinstance(post, dict) else None
    if kind == "Sequence":
        # ByteLevel only moves offsets, so a sequence adds the special tokens of its one other processor
        rest = [q for q in post.get("processors", []) if not (isinstance(q, dict) and q.get("type") == "ByteLevel")]
        if len(rest) > 1:
            raise TokenizerFileError(f"{p}: a post_processor Sequence may hold one processor besides ByteLevel, "
                                     f"got {[q.get('type') if isinstance(q, dict) else q for q in rest]}")
        post = rest[0] if rest else None
        kind = post.get("type") if isinstance(post, dict) else None
    if post is None or kind == "ByteLevel":
        return {"single": [("$A", 0)], "pair": [("$A", 0), ("$B", 1)]}
    if kind == "RobertaProcessing":
        cls_t, sep_t = post["cls"][0], post["sep"][0]
        return {"single": [(cls_t, 0), ("$A", 0), (sep_t, 0)],
                "pair": [(cls_t, 0), ("$A", 0), (sep_t, 0), (sep_t, 0), ("$B", 0), (sep_t, 0)]}
    if kind == "BertProcessing":
        cls_t, sep_t = post["cls"][0], post["sep"][0]
        return {"single": [(cls_t, 0), ("$A", 0), (sep_t, 0)],
                "pair": [(cls_t, 0), ("$A", 0), (sep_t, 0), ("$B", 1), (sep_t, 1)]}
    if kind != "TemplateProcessing":
        raise TokenizerFileError(f"{p}: post_processor {kind!r} is not supported")
    names = post.get("special_tokens", {})

    def parse(items: list[dict[str, Any]]) -> list[tuple[str, int]]:
        out = []
        for it in items:
            if "Sequence" in it:
                out.append(("$" + it["Sequence"]["id"], int(it["Sequence"].get("type_id", 0))))
                continue
            name = it["SpecialToken"]["id"]
            tokens = names.get(name, {}).get("tokens", [name])
            if len(tokens) != 1 or tokens[0] not in vocab:
                raise TokenizerFileError(f"{p}: template special token {name!r} must map to one token of the "
                                         f"vocabulary, got {tokens!r}")
            out.append((tokens[0], int(it["SpecialToken"].get("type_id", 0))))
        return out

    return {"single": parse(post["single"]), "pair": parse(post["pair"])}


def _build(p: str, model: dict[str, Any], kind: str, tokens: list[str], model_vocab: dict[str, int]) -> BaseTokenizer:
    n = len(tokens)
    if kind == "BPE":
        prefix = model.get("continuing_subword_prefix") or ""
        if not isinstance(prefix, str):
            raise TokenizerFileError(f"{p}: BPE 'continuing_subword_prefix' must be null or a string, got {prefix!r}")
        bpe = BPETokenizer(n, lowercase=False, unk_token=None, pad_token=None, continuing_subword_prefix=prefix)
        try:
            bpe.set_dropout(model.get("dropout"))
        except ValueError as e:
            raise TokenizerFileError(f"{p}: BPE 'dropout' must be null or a number in [0, 1], "
                                     f"got {model.get('dropout')!r}") from e
        bpe.end_of_word_suffix = model.get("end_of_word_suffix") or ""
        bpe.fuse_unk = bool(model.get("fuse_unk", False))
        bpe.byte_fallback = bool(model.get("byte_fallback", False))
        bpe.ignore_merges = bool(model.get("ignore_merges", False))
        merges = []
        for i, m in enumerate(require(p, model, "merges", list, "a list of merges")):
            pair = m.split(" ") if isinstance(m, str) else m
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
                raise TokenizerFileError(f"{p}: merge {i} must be a pair of strings, got {m!r}")
            merges.append((pair[0], pair[1]))
        bpe.set_merges(p, merges, model_vocab)
        return bpe
    if kind == "WordPiece":
        return WordPieceTokenizer(n, require(p, model, "unk_token", str, "a string"), pad_token=None, cls_token=None,
                                  sep_token=None, mask_token=None, lowercase=False,
                                  max_input_chars_per_word=model.get("max_input_chars_per_word", 100),
                                  prefix=model.get("continuing_subword_prefix", "##"))
    if kind == "Unigram":
        unk_id = model.get("unk_id")
        if not isinstance(unk_id, int) or not 0 <= unk_id < n:
            raise TokenizerFileError(f"{p}: Unigram needs an 'unk_id' in [0, {n}), got {unk_id!r}")
        scores = {t: float(s) for t, s in model["vocab"]}
        uni = UnigramTokenizer(n, tokens[unk_id], lowercase=False, pad_token=None,
                               max_piece_length=max(len(t) for t in tokens))
        uni._logp = scores
        uni.byte_fallback = bool(model.get("byte_fallback", False))
        uni.token_probs = {}
        return uni
    raise TokenizerFileError(f"{p}: model type {kind!r} is not supported (expected BPE, WordPiece or Unigram)")


def load_tokenizer_json(path: str | os.PathLike[str]) -> BaseTokenizer:
    """Load a ``tokenizer.json`` file (or a folder holding one) as a fastarch tokenizer."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    data = read_json(p)
    model = require(p, data, "model", dict, "the tokenization model")
    kind = model.get("type") or ("BPE" if "merges" in model else "Unigram" if isinstance(model.get("vocab"), list)
                                 else "WordPiece")
    try:
        for role in ("normalizer", "pre_tokenizer", "decoder"):
            check_stage(data.get(role), role)
    except UnsupportedStageError as e:
        raise TokenizerFileError(f"{p}: {e}") from None
    if kind == "Unigram":
        vocab = model.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                                  and isinstance(v[1], (int, float)) for v in vocab):
            raise TokenizerFileError(f"{p}: Unigram 'vocab' must be a list of [piece, score] pairs")
        model_vocab = {t: i for i, (t, _) in enumerate(vocab)}
    else:
        model_vocab = require(p, model, "vocab", dict, "an object mapping tokens to ids")
        if not all(isinstance(i, int) for i in model_vocab.values()):
            raise TokenizerFileError(f"{p}: model 'vocab' ids must be ints")
    added = _added_tokens(p, data)
    tokens = _vocab_list(p, model_vocab, {i: t for i, (t, _) in added.items()})
    tok = _build(p, model, kind, tokens, model_vocab)
    tok._set_vocab(tokens)
    unk = tokens[model["unk_id"]] if kind == "Unigram" else model.get("unk_token")
    if unk is not None and unk not in tok.vocab:
        raise TokenizerFileError(f"{p}: the unknown token {unk!r} is not in the vocabulary")
    roles: dict[str, str] = {"unk_token": unk} if unk else {}
    extra: list[str] = []
    for i in sorted(added):
        t, flags = added[i]
        if flags["normalized"] and (n := normalize(data.get("normalizer"), t)) != t:
            # the library then matches the normalized spelling and gives it back as the token's string
            raise TokenizerFileError(f"{p}: added token {t!r} has normalized=true and the normalizer changes it "
                                     f"to {n!r}, which is not supported")
        tok.added_token_flags[t] = flags
        if not flags["special"]:
            continue
        role = next((r for r, names in _ROLE_SPELLINGS.items() if t in names and r in type(tok).SPECIAL_ROLES
                     and r not in roles), None)
        if role is not None:
            roles[role] = t
        elif t != unk:
            extra.append(t)
    tok.added_only = {t for t, _ in added.values() if t not in model_vocab}
    # an unk token that is not a special added token is ordinary text to the library (SentencePiece converters)
    tok.not_added = {unk} if unk and not any(t == unk and f["special"] for t, f in added.values()) else set()
    tok.special_tokens = roles
    tok.additional_special_tokens = extra
    tok._added_cache = None
    tok.normalizer = data.get("normalizer")
    tok.pre_tokenizer = data.get("pre_tokenizer")
    tok.decoder = data.get("decoder")
    tok.templates = _templates(p, data.get("post_processor"), tok.vocab)
    tok.lowercase = lowercases(tok.normalizer)
    trunc = data.get("truncation")
    if isinstance(trunc, dict) and isinstance(trunc.get("max_length"), int):
        tok.model_max_length = trunc["max_length"]
    return tok
