"""Beam search: the guide-003 ``BeamSearch.search`` API (vectorised over beams and vocabulary) and a batched
beam search over a model (one forward per step for every beam of every batch row).

Scores are sums of log-probabilities; a finished hypothesis of ``n`` generated tokens (its EOS included)
is ranked by ``sum_logprob / n ** length_penalty``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .adapter import LMAdapter, check_request, eos_ids

__all__ = ["BeamSearch", "beam_search"]


class BeamSearch:
    """Guide-003 ``BeamSearch(beam_width, max_length)``.

    ``search(...)`` returns the same list of ``(sequence, score)`` pairs as the guide (sorted by score,
    highest first; sequences start with ``start_token``; ended ones finish with ``end_token``), but selects
    candidates with one tensor sort over ``beams x vocab`` instead of a Python loop over the vocabulary.
    ``generate(model, input_ids, ...)`` is the batched model search (:func:`beam_search`).
    """

    def __init__(self, beam_width: int = 5, max_length: int = 100) -> None:
        if not isinstance(beam_width, int) or beam_width < 1:
            raise ValueError(f"BeamSearch: argument 'beam_width' must be a positive int, got {beam_width!r}")
        if not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"BeamSearch: argument 'max_length' must be a positive int, got {max_length!r}")
        self.beam_width = beam_width
        self.max_length = max_length

    def search(self, initial_logits: torch.Tensor, get_next_logits_fn: Callable[[list[int]], torch.Tensor],
               start_token: int = 0, end_token: int = 1) -> list[tuple[list[int], float]]:
        """Beam search from ``initial_logits`` ``(V,)``; ``get_next_logits_fn(sequence) -> (V,)``."""
        if not isinstance(initial_logits, torch.Tensor) or initial_logits.dim() != 1:
            raise ValueError("BeamSearch.search: argument 'initial_logits' must be a (vocab_size,) tensor")
        V = initial_logits.shape[0]
        logp0 = F.log_softmax(initial_logits.double(), dim=-1)
        k0 = min(self.beam_width, V)
        top = torch.topk(logp0, k0)
        # Guide: the initial top-k become beams even if they are end tokens (they complete on the next step).
        beams = [([start_token, int(t)], float(s)) for s, t in zip(top.values.tolist(), top.indices.tolist())]
        completed: list[tuple[list[int], float]] = []
        for _ in range(self.max_length - 1):
            if not beams:
                break
            live = []
            for seq, score in beams:
                if seq[-1] == end_token:
                    completed.append((seq, score))
                else:
                    live.append((seq, score))
            if not live:
                beams = []
                break
            logps = torch.stack([F.log_softmax(get_next_logits_fn(seq).double(), dim=-1) for seq, _ in live])
            if logps.shape[-1] != V:
                raise ValueError(f"BeamSearch.search: get_next_logits_fn returned {logps.shape[-1]} logits, "
                                 f"expected {V}")
            cand = (torch.tensor([s for _, s in live], dtype=torch.float64)[:, None] + logps).flatten()
            # Stable descending sort = the guide's list.sort(reverse=True) order among equal scores.
            order = torch.sort(cand, descending=True, stable=True).indices[: self.beam_width].tolist()
            cand_l = cand.tolist()
            beams = []
            for j in order:
                b, tok = divmod(j, V)
                seq = live[b][0] + [tok]
                if tok == end_token:
                    completed.append((seq, cand_l[j]))
                else:
                    beams.append((seq, cand_l[j]))
        completed.extend(beams)
        completed.sort(key=lambda x: x[1], reverse=True)
        return completed

    def generate(self, model: Any, input_ids: torch.Tensor, eos_token_id: int | Sequence[int] | None = None,
                 **kw: Any) -> torch.Tensor:
        """Batched model beam search with ``num_beams = beam_width`` and ``max_new_tokens = max_length``."""
        return beam_search(model, input_ids, self.max_length, num_beams=self.beam_width,
                           eos_token_id=eos_token_id, **kw)


def beam_search(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    num_beams: int = 4,
    eos_token_id: int | Sequence[int] | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    use_cache: bool = True,
    pad_token_id: int | None = None,
    num_return_sequences: int = 1,
    return_scores: bool = False,
) -> Any:
    """Beam search over a model for a batch of prompts ``(B, L)``.

    Every step runs the model once on all ``B * num_beams`` beams and keeps, per prompt, the best
    ``num_beams`` continuations among ``2 * num_beams`` candidates (so EOS candidates can finish without
    starving the live beams). ``early_stopping``: ``True`` stops a prompt once it has ``num_beams`` finished
    hypotheses; ``False`` when no live beam can beat the worst of them at the current length; ``"never"``
    when none can at the maximum length (exact for ``length_penalty > 0``).

    Returns ``(B * num_return_sequences, L + n)``, best first per prompt, shorter hypotheses padded with
    ``pad_token_id`` (default: the first EOS, else 0); with ``return_scores`` also their scores
    ``(B * num_return_sequences,)``.
    """
    check_request(input_ids, max_new_tokens, "beam", num_beams)
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"beam_search: argument 'early_stopping' must be True, False or 'never', got {early_stopping!r}")
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"beam_search: argument 'num_return_sequences' must be in [1, num_beams={num_beams}], "
                         f"got {num_return_sequences}")
    eos = eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    B, L = input_ids.shape
    nb = num_beams
    dev = input_ids.device
    if max_new_tokens == 0:
        out = input_ids.repeat_interleave(num_return_sequences, 0)
        return (out, torch.zeros(out.shape[0], device=dev)) if return_scores else out

    adapter = LMAdapter(model, use_cache)
    ids = input_ids.repeat_interleave(nb, dim=0)  # (B*nb, L)
    logits = adapter.prefill(ids, L + max_new_tokens)
    V = logits.shape[-1]
    # Only beam 0 is live at first, so the first step does not pick the same token nb times.
    beam_scores = torch.full((B, nb), float("-inf"), dtype=torch.float64, device=dev)
    beam_scores[:, 0] = 0.0
    hyps: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]  # (normalised score, new tokens)
    done = [False] * B
    gen = torch.empty(B * nb, 0, dtype=input_ids.dtype, device=dev)
    eos_set = set(eos)
    n_cand = min(2 * nb, nb * V)

    def worst(b: int) -> float:
        return min(s for s, _ in hyps[b]) if len(hyps[b]) >= nb else float("-inf")

    def add(b: int, score: float, toks: list[int]) -> None:
        norm = score / (len(toks) ** length_penalty)
        if len(hyps[b]) < nb or norm > worst(b):
            hyps[b].append((norm, toks))
            hyps[b].sort(key=lambda x: x[0], reverse=True)
            del hyps[b][nb:]

    for step in range(max_new_tokens):
        cur_len = step + 1
        logp = F.log_softmax(logits.double(), dim=-1).view(B, nb, V)
        cand = (beam_scores[:, :, None] + logp).view(B, nb * V)
        top_s, top_i = torch.topk(cand, n_cand, dim=1)
        top_s_l, top_i_l = top_s.tolist(), top_i.tolist()
        gen_l = gen.tolist()
        next_beam = torch.zeros(B, nb, dtype=torch.long)
        next_tok = torch.full((B, nb), pad, dtype=torch.long)
        next_score = torch.full((B, nb), float("-inf"), dtype=torch.float64)
        for b in range(B):
            if done[b]:
                next_beam[b] = torch.arange(nb)
                continue
            k = 0
            for rank, (s, j) in enumerate(zip(top_s_l[b], top_i_l[b])):
                beam, tok = divmod(j, V)
                if tok in eos_set:
                    # An EOS ranked below the live-beam count would not have survived as a beam either.
                    if rank < nb and s > float("-inf"):
                        add(b, s, gen_l[b * nb + beam] + [tok])
                    continue
                next_beam[b, k], next_tok[b, k], next_score[b, k] = beam, tok, s
                k += 1
                if k == nb:
                    break
            if len(hyps[b]) >= nb:
                if early_stopping is True:
                    done[b] = True
                else:
                    best_live = float(next_score[b].max())
                    if early_stopping == "never" and length_penalty > 0 and best_live < 0:
                        bound = best_live / (max_new_tokens ** length_penalty)
                    else:
                        bound = best_live / ((cur_len + (early_stopping == "never")) ** length_penalty)
                    done[b] = bound <= worst(b)
        src = (next_beam + torch.arange(B)[:, None] * nb).view(-1).to(dev)
        beam_scores = next_score.to(dev)
        gen = torch.cat([gen.index_select(0, src), next_tok.view(-1, 1).to(dev, gen.dtype)], dim=1)
        if all(done) or step + 1 == max_new_tokens:
            break
        adapter.reorder(src)
        logits = adapter.step(next_tok.view(-1).to(dev))
    # Prompts still running: their live beams become hypotheses.
    gen_l = gen.tolist()
    bs_l = beam_scores.tolist()
    for b in range(B):
        if done[b]:
            continue
        for i in range(nb):
            if bs_l[b][i] > float("-inf"):
                add(b, bs_l[b][i], gen_l[b * nb + i])
    width = max(len(t) for b in range(B) for _, t in hyps[b][:num_return_sequences])
    out = torch.full((B * num_return_sequences, L + width), pad, dtype=input_ids.dtype, device=dev)
    scores = torch.empty(B * num_return_sequences, dtype=torch.float64)
    for b in range(B):
        for r, (s, toks) in enumerate(hyps[b][:num_return_sequences]):
            row = b * num_return_sequences + r
            out[row, :L] = input_ids[b]
            out[row, L:L + len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
            scores[row] = s
    return (out, scores) if return_scores else out
