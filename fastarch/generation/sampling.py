"""Logit processors and samplers, vectorised over the batch, plus the guide-003 per-sequence functions.

Every processor takes logits ``(B, V)`` and returns new logits ``(B, V)`` (masked entries are ``-inf``).
Order used by :func:`process_logits` (and ``generate``): penalties -> temperature -> top-k -> top-p -> min-p.

Deviation from the guide's ``top_p_decode``: the guide keeps the tokens *before* the first one whose
cumulative probability exceeds ``p``, so the kept mass can fall below ``p`` (two tokens of 0.5 with
``p=0.9`` keep one). Here the smallest prefix whose mass reaches ``p`` is kept (kept mass >= p), as in
the nucleus-sampling paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "RepetitionPenaltyController",
    "apply_penalties",
    "apply_temperature",
    "greedy_decode",
    "min_p_filter",
    "process_logits",
    "sample_from_logits",
    "temperature_decode",
    "token_counts",
    "top_k_decode",
    "top_k_filter",
    "top_p_decode",
    "top_p_filter",
]


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"argument '{name}' must be a floating (B, V) tensor, got {got}")


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token per row: ``ids`` ``(B, L)`` int -> ``(B, V)`` int64.
    Negative ids (padding) are ignored."""
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.int64, device=ids.device)
    valid = ids >= 0
    counts.scatter_add_(1, ids.clamp_min(0).long(), valid.long())
    return counts


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, *, repetition_penalty: float = 1.0,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> torch.Tensor:
    """Guide-003 ``RepetitionPenaltyController.apply_penalties`` for a batch.

    ``counts`` ``(B, V)``: how often each token appeared. In order: ``logit -= frequency * count``;
    ``logit -= presence`` where it appeared; then, where it appeared, ``logit / r`` if ``logit > 0``
    else ``logit * r`` (on the already shifted logit, as the guide does).
    """
    _check_logits(logits)
    if counts.shape != logits.shape:
        raise ValueError(f"argument 'counts' must have shape {tuple(logits.shape)}, got {tuple(counts.shape)}")
    if repetition_penalty <= 0:
        raise ValueError(f"argument 'repetition_penalty' must be > 0, got {repetition_penalty}")
    out = logits
    present = counts > 0
    if frequency_penalty != 0.0:
        out = out - frequency_penalty * counts.to(out.dtype)
    if presence_penalty != 0.0:
        out = out - presence_penalty * present.to(out.dtype)
    if repetition_penalty != 1.0:
        scaled = torch.where(out > 0, out / repetition_penalty, out * repetition_penalty)
        out = torch.where(present, scaled, out)
    return out


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"argument 'temperature' must be > 0 for sampling, got {temperature}")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the ``k`` largest logits per row (ties broken by ``torch.topk``); others -> -inf."""
    _check_logits(logits)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"argument 'top_k' must be a positive int, got {k!r}")
    if k >= logits.shape[-1]:
        return logits
    idx = torch.topk(logits, k, dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass is at least ``p``."""
    _check_logits(logits)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"argument 'top_p' must be in (0, 1], got {p}")
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = F.softmax(sorted_logits.float(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    drop_sorted = before >= p
    drop_sorted[..., 0] = False  # always keep the most likely token
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    _check_logits(logits)
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"argument 'min_p' must be in [0, 1], got {min_p}")
    if min_p == 0.0:
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    thresh = logits.max(dim=-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=torch.float32)).item()
    return logits.masked_fill(logits < thresh, float("-inf"))


def process_logits(logits: torch.Tensor, *, counts: torch.Tensor | None = None, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                   repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0) -> torch.Tensor:
    """Penalties, temperature and the truncations, in that order; returns logits ``(B, V)``."""
    _check_logits(logits)
    out = logits.float()
    if counts is not None and (repetition_penalty != 1.0 or frequency_penalty != 0.0 or presence_penalty != 0.0):
        out = apply_penalties(out, counts, repetition_penalty=repetition_penalty,
                              frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    out = apply_temperature(out, temperature)
    if top_k is not None:
        out = top_k_filter(out, top_k)
    if top_p is not None:
        out = top_p_filter(out, top_p)
    if min_p is not None:
        out = min_p_filter(out, min_p)
    return out


def sample_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from ``softmax(logits)``: ``(B, V)`` -> ``(B,)`` int64."""
    probs = F.softmax(logits.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------
# Guide-003 per-sequence API (logits (V,) -> int); kept for drop-in use.
def greedy_decode(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits, dim=-1).item())


def temperature_decode(logits: torch.Tensor, temperature: float = 1.0,
                       generator: torch.Generator | None = None) -> int:
    return int(sample_from_logits(apply_temperature(logits.view(1, -1).float(), temperature), generator))


def top_k_decode(logits: torch.Tensor, temperature: float = 1.0, k: int = 50,
                 generator: torch.Generator | None = None) -> int:
    out = top_k_filter(apply_temperature(logits.view(1, -1).float(), temperature), min(k, logits.numel()))
    return int(sample_from_logits(out, generator))


def top_p_decode(logits: torch.Tensor, temperature: float = 1.0, p: float = 0.9,
                 generator: torch.Generator | None = None) -> int:
    # The guide filters on the untempered distribution and samples from it; we filter after temperature.
    out = top_p_filter(apply_temperature(logits.view(1, -1).float(), temperature), p)
    return int(sample_from_logits(out, generator))


class RepetitionPenaltyController:
    """Guide-003 controller (same methods and semantics), backed by a count vector.

    ``update`` also accepts a tensor of ids; ``apply_penalties`` accepts ``(V,)`` or ``(1, V)`` logits.
    """

    def __init__(self, vocab_size: int) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"argument 'vocab_size' must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.vocab_size, dtype=torch.int64)

    @property
    def token_counts(self) -> dict[int, int]:
        nz = torch.nonzero(self.counts).flatten().tolist()
        return {i: int(self.counts[i]) for i in nz}

    @property
    def token_presence(self) -> set[int]:
        return set(torch.nonzero(self.counts).flatten().tolist())

    def update(self, token_id: int | torch.Tensor) -> None:
        ids = torch.as_tensor(token_id, dtype=torch.int64).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"argument 'token_id' must be in [0, {self.vocab_size}), got {ids.tolist()}")
        self.counts.index_add_(0, ids, torch.ones_like(ids))

    def apply_penalties(self, logits: torch.Tensor, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                        repetition_penalty: float = 1.0) -> torch.Tensor:
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"argument 'logits' must end in vocab_size={self.vocab_size}, got {tuple(logits.shape)}")
        flat = logits.reshape(-1, self.vocab_size)
        counts = self.counts.to(logits.device).expand(flat.shape[0], -1)
        out = apply_penalties(flat, counts, repetition_penalty=repetition_penalty,
                              frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
        return out.reshape(logits.shape)
