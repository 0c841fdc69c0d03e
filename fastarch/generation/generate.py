"""``generate``: greedy, sampling and beam decoding for GPT-family models and MambaLM.

The model protocols it accepts are described in :mod:`fastarch.generation.adapter`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .adapter import LMAdapter, check_request, eos_ids, reorder_cache
from .beam_search import beam_search
from .sampling import process_logits, sample_from_logits, token_counts
from .streaming import notify_end, notify_put

__all__ = ["LMAdapter", "generate", "generate_stream", "reorder_cache"]


def generate_stream(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    strategy: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the new tokens ``(B,)`` of each step (greedy or sampling). Finished rows (after an EOS)
    yield ``pad_token_id`` (default: the first EOS id). Stops when every row has finished."""
    check_request(input_ids, max_new_tokens, strategy, 1)
    if strategy == "beam":
        raise ValueError("generate_stream: strategy='beam' cannot stream (the best beam is known only at the end)")
    eos = eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if strategy == "sample" and not temperature > 0:
        raise ValueError(f"generate: argument 'temperature' must be > 0 for sampling, got {temperature}")
    if max_new_tokens == 0:
        return
    penalize = repetition_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0
    adapter = LMAdapter(model, use_cache)
    B, L = input_ids.shape
    logits = adapter.prefill(input_ids, L + max_new_tokens)
    V = logits.shape[-1]
    counts = token_counts(input_ids, V) if penalize else None
    eos_t = torch.tensor(eos, device=input_ids.device, dtype=torch.long)
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        if strategy == "greedy":
            scores = process_logits(logits, counts=counts, repetition_penalty=repetition_penalty,
                                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
            tok = scores.argmax(dim=-1)
        else:
            scores = process_logits(logits, counts=counts, temperature=temperature, top_k=top_k,
                                    top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                                    frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
            tok = sample_from_logits(scores, generator)
        tok = torch.where(finished, torch.full_like(tok, pad), tok)
        if counts is not None:
            counts.scatter_add_(1, tok[:, None], (~finished).long()[:, None])
        if eos:
            finished = finished | torch.isin(tok, eos_t)
        yield tok
        if i + 1 == max_new_tokens or (eos and bool(finished.all())):
            return
        logits = adapter.step(tok)


def generate(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    strategy: str = "greedy",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    eos_token_id: int | Sequence[int] | None = None,
    num_beams: int = 1,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    streamer: Any = None,
    *,
    pad_token_id: int | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> torch.Tensor:
    """Decode up to ``max_new_tokens`` tokens after ``input_ids`` ``(B, L)``; returns ``(B, L + n)``,
    prompt then new tokens (``n < max_new_tokens`` when every row hit an EOS early).

    strategy: ``"greedy"`` (argmax after penalties), ``"sample"`` (penalties, temperature, top-k, top-p,
    min-p, then a draw with ``generator``), ``"beam"`` (``num_beams`` beams, ``length_penalty``,
    ``early_stopping``; see :func:`fastarch.generation.beam_search.beam_search`). Penalties follow the guide's
    ``RepetitionPenaltyController`` and count the prompt's tokens as well as the generated ones.
    ``streamer``: a callable or an object with ``put(tokens (B,))``/``end()`` (e.g.
    :class:`TokenIteratorStreamer`), called once per step; not with beam search.
    """
    check_request(input_ids, max_new_tokens, strategy, num_beams)
    if strategy == "beam" or num_beams > 1:
        if strategy == "sample":
            raise ValueError("generate: sampling with num_beams > 1 is not supported; use strategy='beam'")
        if streamer is not None:
            raise ValueError("generate: argument 'streamer' cannot be used with beam search")
        unsupported = {"temperature": temperature != 1.0, "top_k": top_k is not None, "top_p": top_p is not None,
                       "min_p": min_p is not None, "repetition_penalty": repetition_penalty != 1.0,
                       "frequency_penalty": frequency_penalty != 0.0, "presence_penalty": presence_penalty != 0.0,
                       "generator": generator is not None}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"generate: beam search scores raw log-probabilities; argument(s) {bad} are not "
                             "supported with strategy='beam'")
        return beam_search(model, input_ids, max_new_tokens, num_beams=num_beams, eos_token_id=eos_token_id,
                           length_penalty=length_penalty, early_stopping=early_stopping, use_cache=use_cache,
                           pad_token_id=pad_token_id)
    out = [input_ids]
    try:
        for tok in generate_stream(model, input_ids, max_new_tokens, strategy, temperature, top_k, top_p, min_p,
                                   repetition_penalty, frequency_penalty, presence_penalty, eos_token_id,
                                   use_cache, generator, pad_token_id):
            out.append(tok[:, None].to(input_ids.dtype))
            notify_put(streamer, tok)
    except BaseException as e:
        if streamer is not None and hasattr(streamer, "fail"):
            streamer.fail(e)
        raise
    notify_end(streamer)
    return torch.cat(out, dim=1)
