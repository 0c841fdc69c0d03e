"""``mamba_ssm.utils.generation``: mamba-ssm's decoding loop (``decode``, ``GenerationMixin.generate``), its
sampler and logit filters, and ``InferenceParams`` (the one of :mod:`fastarch.nn.mamba2`).

``decode(input_ids, model, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0, repetition_penalty=1.0,
eos_token_id=None, teacher_outputs=None, vocab_size=None, cg=False, enable_timing=False, output_scores=False,
streamer=None)``: one prefill forward over ``input_ids`` ``(batch, L)`` with a fresh :class:`InferenceParams`,
then one forward per new token (``num_last_tokens=1``), until ``max_length`` tokens in all or every sequence's
last token is ``eos_token_id``. Returns :class:`GreedySearchDecoderOnlyOutput` (``top_k == 1``) or
:class:`SampleDecoderOnlyOutput` with ``sequences`` ``(batch, <= max_length)`` and ``scores``, one ``(batch,
vocab)`` logits tensor per new token (before the repetition penalty).

Sampling (``sample``): ``top_k == 1`` is greedy; ``top_k > 1`` samples among the ``top_k`` largest logits
(divided by ``temperature``, then ``top_p``); ``top_k == 0`` samples from every token after ``temperature``,
``top_p`` and ``min_p``. Deviations: ``min_p`` keeps the tokens whose probability is at least ``min_p`` times
the most likely one's (:func:`fastarch.generation.sampling.min_p_filter`); ``cg=True`` runs the same eager loop
(CUDA graphs do not exist on CPU; on GPU the fused decode steps take their place), with a warning. The output
classes are fastarch's dataclasses of the same names and fields (transformers is not needed).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from fastarch.generation.sampling import min_p_filter, top_k_filter, top_p_filter
from fastarch.nn.mamba2 import InferenceParams

from ..._missing import missing_attribute

__all__ = ["GenerationMixin", "GreedySearchDecoderOnlyOutput", "InferenceParams", "SampleDecoderOnlyOutput",
           "decode", "modify_logit_for_repetition_penalty", "modify_logits_for_min_p_filtering",
           "modify_logits_for_top_k_filtering", "modify_logits_for_top_p_filtering", "sample"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.utils.generation")


@dataclass
class GreedySearchDecoderOnlyOutput:
    """``sequences`` ``(batch, length)``; ``scores``: a tuple of ``(batch, vocab)`` logits, or None."""

    sequences: torch.Tensor
    scores: tuple[torch.Tensor, ...] | None = None


@dataclass
class SampleDecoderOnlyOutput(GreedySearchDecoderOnlyOutput):
    """As :class:`GreedySearchDecoderOnlyOutput`, for sampled sequences."""


def modify_logits_for_top_k_filtering(logits: torch.Tensor, top_k: int) -> None:
    """In place: every logit of ``logits`` ``(batch, vocab)`` outside the ``top_k`` largest of its row -> -inf."""
    logits.copy_(top_k_filter(logits, int(top_k)))


def modify_logits_for_top_p_filtering(logits: torch.Tensor, top_p: float) -> None:
    """In place: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (no-op when
    ``top_p`` is outside (0, 1))."""
    if top_p <= 0.0 or top_p >= 1.0:
        return
    logits.copy_(top_p_filter(logits, float(top_p)))


def modify_logits_for_min_p_filtering(logits: torch.Tensor, min_p: float) -> None:
    """In place: drop the tokens less likely than ``min_p`` times the most likely one (no-op when ``min_p`` is
    outside (0, 1))."""
    if min_p <= 0.0 or min_p >= 1.0:
        return
    logits.copy_(min_p_filter(logits, float(min_p)))


def modify_logit_for_repetition_penalty(logits: torch.Tensor, prev_output_tokens: torch.Tensor,
                                        repetition_penalty: float = 1.0) -> torch.Tensor:
    """In place and returned: the logits ``(batch, vocab)`` of the tokens in ``prev_output_tokens`` ``(batch,
    L)`` divided by ``repetition_penalty`` where positive, multiplied where negative."""
    if repetition_penalty == 1.0:
        return logits
    score = torch.gather(logits, 1, prev_output_tokens)
    score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
    logits.scatter_(1, prev_output_tokens, score)
    return logits


def sample(logits: torch.Tensor, top_k: int = 1, top_p: float = 0.0, min_p: float = 0.0,
           temperature: float = 1.0) -> torch.Tensor:
    """One token per row of ``logits`` ``(batch, vocab)`` -> ``(batch,)`` (see the module docstring)."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if top_p > 1.0:
        raise ValueError(f"sample: argument 'top_p' must be in [0, 1], got {top_p}")
    if temperature <= 0.0:
        raise ValueError(f"sample: argument 'temperature' must be > 0 when sampling (top_k != 1), got {temperature}")
    if top_k > 0:
        k = min(top_k, logits.size(-1))
        top, indices = torch.topk(logits, k, dim=-1)
        if temperature != 1.0:
            top = top / temperature
        modify_logits_for_top_p_filtering(top, top_p)
        pick = torch.multinomial(torch.softmax(top, dim=-1), num_samples=1).squeeze(-1)
        return indices[torch.arange(indices.shape[0], device=indices.device), pick]
    scaled = logits / temperature if temperature != 1.0 else logits.clone()
    modify_logits_for_top_p_filtering(scaled, top_p)
    modify_logits_for_min_p_filtering(scaled, min_p)
    return torch.multinomial(torch.softmax(scaled, dim=-1), num_samples=1).squeeze(-1)


_CG_WARNED = False


@torch.inference_mode()
def decode(input_ids: torch.Tensor, model: nn.Module, max_length: int, top_k: int = 1, top_p: float = 0.0,
           min_p: float = 0.0, temperature: float = 1.0, repetition_penalty: float = 1.0,
           eos_token_id: int | None = None, teacher_outputs: torch.Tensor | None = None,
           vocab_size: int | None = None, cg: bool = False, enable_timing: bool = False,
           output_scores: bool = False, streamer=None):
    """mamba-ssm's ``decode`` (see the module docstring). ``input_ids`` ``(batch, L)``; ``teacher_outputs``
    ``(batch, T)`` forces the token at each position below ``T``; ``vocab_size`` cuts the logits to the true
    vocabulary (padded embeddings); ``streamer`` gets ``put(ids)`` per step and ``end()``."""
    global _CG_WARNED
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("decode: argument 'input_ids' must be a (batch, seq_len) tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    batch_size, seqlen_og = input_ids.shape
    if max_length <= seqlen_og:
        raise ValueError(f"decode: argument 'max_length' ({max_length}) must exceed the prompt length {seqlen_og}")
    if cg and not _CG_WARNED:
        warnings.warn("mamba_ssm decode: cg=True runs the eager decode loop (no CUDA graphs in fastarch)",
                      stacklevel=2)
        _CG_WARNED = True
    if streamer is not None:
        streamer.put(input_ids.cpu())
    inference_params = InferenceParams(max_seqlen=max_length, max_batch_size=batch_size)
    teacher_len = teacher_outputs.shape[1] if teacher_outputs is not None else 0

    def get_logits(ids: torch.Tensor) -> torch.Tensor:
        position_ids = None
        if inference_params.seqlen_offset > 0:
            position_ids = torch.full((batch_size, 1), inference_params.seqlen_offset, dtype=torch.long,
                                      device=ids.device)
        logits = model(ids, position_ids=position_ids, inference_params=inference_params,
                       num_last_tokens=1).logits.squeeze(dim=1)
        return logits[..., :vocab_size] if vocab_size is not None else logits

    def next_tokens(logits: torch.Tensor) -> torch.Tensor:
        if teacher_outputs is None or teacher_len <= inference_params.seqlen_offset:
            token = sample(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
        else:
            token = teacher_outputs[:, inference_params.seqlen_offset]
        return token.unsqueeze(1)

    def should_stop(current: torch.Tensor) -> bool:
        if inference_params.seqlen_offset == 0:
            return False
        if eos_token_id is not None and bool((current == eos_token_id).all()):
            return True
        return inference_params.seqlen_offset >= max_length - 1

    start = time.perf_counter()
    scores, sequences = [], [input_ids]
    sequences_cat = input_ids
    while not should_stop(sequences[-1]):
        scores.append(get_logits(sequences[-1]))
        inference_params.seqlen_offset += sequences[-1].shape[1]
        if repetition_penalty == 1.0:
            tokens = next_tokens(scores[-1])
        else:
            penalised = modify_logit_for_repetition_penalty(scores[-1].clone(), sequences_cat, repetition_penalty)
            tokens = next_tokens(penalised)
            sequences_cat = torch.cat([sequences_cat, tokens], dim=1)
        sequences.append(tokens)
        if streamer is not None:
            streamer.put(tokens.cpu())
    if streamer is not None:
        streamer.end()
    if enable_timing:
        print(f"Prompt processing + decoding time: {(time.perf_counter() - start) * 1000:.0f}ms")
    output_cls = GreedySearchDecoderOnlyOutput if top_k == 1 else SampleDecoderOnlyOutput
    return output_cls(sequences=torch.cat(sequences, dim=1), scores=tuple(scores))


class GenerationMixin:
    """mamba-ssm's ``GenerationMixin``: ``generate`` on a model whose forward takes ``(input_ids,
    position_ids=None, inference_params=None, num_last_tokens=0)`` and returns an object with ``logits``."""

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        raise NotImplementedError

    def generate(self, input_ids: torch.Tensor, max_length: int, top_k: int = 1, top_p: float = 0.0,
                 min_p: float = 0.0, temperature: float = 1.0, return_dict_in_generate: bool = False,
                 output_scores: bool = False, **kwargs):
        """:func:`decode` on this model; the sequences ``(batch, <= max_length)``, or the output object with
        ``return_dict_in_generate`` (``scores`` None unless ``output_scores``)."""
        output = decode(input_ids, self, max_length, top_k=top_k, top_p=top_p, min_p=min_p,
                        temperature=temperature, output_scores=output_scores, **kwargs)
        if not output_scores:
            output.scores = None
        return output if return_dict_in_generate else output.sequences
