"""Batch encoding with transformers' conventions: special tokens from the tokenizer's template, truncation
(longest first by default), right padding, attention masks, token type ids and PyTorch tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Encoding", "batch_encode", "truncated_lengths"]

_TRUNCATIONS = ("longest_first", "only_first", "only_second", "do_not_truncate")
_PADDINGS = ("longest", "max_length", "do_not_pad")


class Encoding(dict):
    """The result of a tokenizer call: a dict of ``input_ids``, ``token_type_ids``, ``attention_mask``, whose
    keys are also attributes (``enc.input_ids``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: Any) -> Encoding:
        return Encoding({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()})


def truncated_lengths(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Lengths of a pair after "longest_first" truncation to ``budget`` tokens, as the ``tokenizers``
    library computes them: the shorter sequence is kept whole when the longer one can take the rest;
    otherwise both get half the budget, the longer one the odd token."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)


def _option(value: bool | str, names: tuple[str, ...], on: str, off: str, arg: str) -> str:
    if value is True:
        return on
    if value is False or value is None:
        return off
    if value not in names:
        raise ValueError(f"tokenizer call: argument '{arg}' must be a bool or one of {names}, got {value!r}")
    return value


def _as_batch(text: Any, arg: str) -> list[str]:
    if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
        raise TypeError(f"tokenizer call: argument '{arg}' must be a str or a list of str, got {type(text).__name__}")
    return list(text)


def batch_encode(tok: Any, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *,
                 add_special_tokens: bool = True, padding: bool | str = False, truncation: bool | str = False,
                 max_length: int | None = None, return_tensors: str | None = None) -> Encoding:
    """See ``BaseTokenizer.__call__``."""
    single = isinstance(text, str)
    texts = [text] if single else _as_batch(text, "text")
    pairs: list[str] | None = None
    if text_pair is not None:
        if single != isinstance(text_pair, str):
            raise TypeError("tokenizer call: arguments 'text' and 'text_pair' must both be str or both be lists")
        pairs = [text_pair] if single else _as_batch(text_pair, "text_pair")  # type: ignore[list-item]
        if len(pairs) != len(texts):
            raise ValueError(f"tokenizer call: 'text' has {len(texts)} texts but 'text_pair' has {len(pairs)}")
    pad_mode = _option(padding, _PADDINGS, "longest", "do_not_pad", "padding")
    trunc_mode = _option(truncation, _TRUNCATIONS, "longest_first", "do_not_truncate", "truncation")
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise ValueError(f"tokenizer call: argument 'max_length' must be a positive int, got {max_length!r}")
    limit = max_length if max_length is not None else tok.model_max_length
    if pad_mode == "max_length" and max_length is None:
        raise ValueError("tokenizer call: padding='max_length' needs argument 'max_length'")
    if tok.padding_side not in ("left", "right"):
        raise ValueError(f"{type(tok).__name__}: attribute 'padding_side' must be 'left' or 'right', "
                         f"got {tok.padding_side!r}")
    if return_tensors not in (None, "pt"):
        raise ValueError(f"tokenizer call: argument 'return_tensors' must be None or 'pt', got {return_tensors!r}")

    rows: list[tuple[list[int], list[int]]] = []
    for i, t in enumerate(texts):
        a = tok.encode(t, add_special_tokens=False)
        b = tok.encode(pairs[i], add_special_tokens=False) if pairs is not None else None
        if trunc_mode != "do_not_truncate" and limit is not None:
            budget = limit - (tok.num_special_tokens_to_add(b is not None) if add_special_tokens else 0)
            n2 = len(b) if b is not None else 0
            excess = len(a) + n2 - budget
            if excess > 0:
                if budget < 0:
                    raise ValueError(f"tokenizer call: max_length={limit} is shorter than the special tokens")
                if trunc_mode == "longest_first":
                    k1, k2 = truncated_lengths(len(a), n2, budget)
                elif trunc_mode == "only_first":
                    k1, k2 = len(a) - excess, n2
                else:
                    k1, k2 = len(a), n2 - excess
                if k1 < 0 or k2 < 0 or (trunc_mode == "only_second" and b is None):
                    raise ValueError(f"tokenizer call: truncation={trunc_mode!r} cannot fit text {i} into "
                                     f"max_length={limit}")
                a = a[:k1]
                b = b[:k2] if b is not None else None
        if add_special_tokens:
            rows.append(tok.post_process(a, b))
        else:
            ids = a + (b or [])
            rows.append((ids, [0] * len(a) + [1] * len(b or [])))

    lengths = [len(ids) for ids, _ in rows]
    target = max(lengths, default=0) if pad_mode == "longest" else max_length if pad_mode == "max_length" else None
    input_ids, type_ids, masks = [], [], []
    for ids, types in rows:
        n_pad = max(0, target - len(ids)) if target is not None else 0
        if n_pad and tok.pad_token_id is None:
            raise ValueError(f"{type(tok).__name__}: padding needs a pad_token, and this tokenizer has none")
        pad_ids, pad_zeros, ones = [tok.pad_token_id] * n_pad, [0] * n_pad, [1] * len(ids)
        if tok.padding_side == "left":
            input_ids.append(pad_ids + ids)
            type_ids.append(pad_zeros + types)
            masks.append(pad_zeros + ones)
        else:
            input_ids.append(ids + pad_ids)
            type_ids.append(types + pad_zeros)
            masks.append(ones + pad_zeros)
    out = Encoding(input_ids=input_ids, token_type_ids=type_ids, attention_mask=masks)
    if return_tensors == "pt":
        if len({len(r) for r in input_ids}) > 1:
            raise ValueError("tokenizer call: return_tensors='pt' needs sequences of one length; pass padding=True")
        import torch

        return Encoding({k: torch.tensor(v, dtype=torch.long).reshape(len(v), -1) for k, v in out.items()})
    if single:
        return Encoding({k: v[0] for k, v in out.items()})
    return out
