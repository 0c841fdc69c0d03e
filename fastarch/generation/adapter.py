"""One decoding interface over the model protocols, shared by ``generate`` and ``beam_search``.

Model protocols:

- transformer LMs: ``forward(input_ids (B, T), kv_cache=None) -> logits (B, T, V)`` and
  ``allocate_kv_cache(batch_size, max_seq_len, dtype=None, device=None) -> KVCache``; with a cache the
  prompt is run once (prefill) and then one token per step;
- recurrent LMs (MambaLM): ``allocate_inference_cache(batch_size, dtype=None, device=None)`` and
  ``step(input_ids (B,), cache) -> logits (B, V)``; the prompt is prefilled by ``forward(ids, cache=cache)``
  when the model's forward takes a ``cache`` argument, else fed through ``step`` token by token;
- anything else callable as ``model(input_ids) -> logits (B, L, V)`` decodes without a cache (the whole
  sequence is re-run every step), as does ``use_cache=False``.

A model output may be a tensor, a tuple whose first item is the logits, or an object with ``.logits``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["LMAdapter", "reorder_cache"]

STRATEGIES = ("greedy", "sample", "beam")


def _as_logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"generate: the model returned {type(out).__name__}; expected logits (a tensor, a tuple "
                    "starting with one, or an object with .logits)")


def _accepts_kwarg(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def reorder_cache(cache: Any, index: torch.Tensor) -> None:
    """Reorder a decoding cache along its batch axis in place (beam search).

    Uses ``cache.reorder(index)`` when it exists; otherwise reorders, in place, every tensor reachable
    through attributes, dicts, lists and tuples whose first dimension is the batch size.
    """
    if hasattr(cache, "reorder") and callable(cache.reorder):
        cache.reorder(index)
        return
    n = index.numel()
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dim() >= 1 and obj.shape[0] == n:
                obj.copy_(obj.index_select(0, index.to(obj.device)))
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
            for x in vars(obj).values():
                visit(x)

    visit(cache)


class LMAdapter:
    """Uniform ``prefill``/``step`` over the model protocols; ``next_logits`` returns ``(B, V)``."""

    def __init__(self, model: Any, use_cache: bool = True) -> None:
        self.model = model
        if use_cache and callable(getattr(model, "allocate_kv_cache", None)):
            self.kind = "kv"
        elif use_cache and callable(getattr(model, "step", None)) and callable(
                getattr(model, "allocate_inference_cache", None)):
            self.kind = "recurrent"
        else:
            self.kind = "full"
        self.cache: Any = None
        self.ids: torch.Tensor | None = None

    def _dtype(self) -> torch.dtype | None:
        p = next(iter(self.model.parameters()), None) if isinstance(self.model, nn.Module) else None
        return p.dtype if p is not None else None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, max_len: int) -> torch.Tensor:
        B = input_ids.shape[0]
        if self.kind == "kv":
            self.cache = self.model.allocate_kv_cache(B, max_len, dtype=self._dtype(), device=input_ids.device)
            # Only the last position's logits are needed: models that can skip the rest are told so.
            last = {"logits_to_keep": 1} if _accepts_kwarg(self.model.forward, "logits_to_keep") else {}
            return _as_logits(self.model(input_ids, kv_cache=self.cache, **last))[:, -1]
        if self.kind == "recurrent":
            self.cache = self.model.allocate_inference_cache(B, dtype=self._dtype(), device=input_ids.device)
            if _accepts_kwarg(self.model.forward, "cache"):
                # forward(ids, cache=) prefills the state in one parallel pass (MambaLM does).
                return _as_logits(self.model(input_ids, cache=self.cache))[:, -1]
            logits = None
            for t in range(input_ids.shape[1]):
                logits = _as_logits(self.model.step(input_ids[:, t], self.cache))
            assert logits is not None
            return logits.reshape(B, -1)
        self.ids = input_ids
        return _as_logits(self.model(input_ids))[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the chosen tokens ``(B,)``; returns the next logits ``(B, V)``."""
        if self.kind == "kv":
            return _as_logits(self.model(tokens[:, None], kv_cache=self.cache))[:, -1]
        if self.kind == "recurrent":
            return _as_logits(self.model.step(tokens, self.cache)).reshape(tokens.shape[0], -1)
        assert self.ids is not None
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        return _as_logits(self.model(self.ids))[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        if self.kind == "full":
            assert self.ids is not None
            self.ids = self.ids.index_select(0, index)
        elif self.cache is not None:
            reorder_cache(self.cache, index)


def eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    """``eos_token_id`` (an int, a sequence of ints or None) as a list of ids."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool):
        return [eos_token_id]
    if isinstance(eos_token_id, (list, tuple)) and all(isinstance(x, int) for x in eos_token_id):
        return list(eos_token_id)
    raise ValueError(f"generate: argument 'eos_token_id' must be an int, a sequence of ints or None, "
                     f"got {eos_token_id!r}")


def check_request(input_ids: Any, max_new_tokens: Any, strategy: str, num_beams: int) -> None:
    """Raise ValueError naming the first argument of a decoding call that is out of range."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
            torch.int64, torch.int32):
        got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"generate: argument 'input_ids' must be an integer tensor (B, L), got {got}")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"generate: argument 'input_ids' must be non-empty, got shape {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"generate: argument 'max_new_tokens' must be an int >= 0, got {max_new_tokens!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"generate: argument 'strategy' must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"generate: argument 'num_beams' must be a positive int, got {num_beams!r}")
