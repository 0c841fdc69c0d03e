"""Text generation: a preallocated KV cache, logit processors and samplers, beam search, streaming and
``generate`` for GPT-family models (KV cache) and MambaLM (recurrent ``step``)."""

from __future__ import annotations

from .beam_search import BeamSearch, beam_search
from .generate import LMAdapter, generate, generate_stream, reorder_cache
from .kv_cache import KVCache
from .sampling import (
    RepetitionPenaltyController,
    apply_penalties,
    greedy_decode,
    min_p_filter,
    process_logits,
    sample_from_logits,
    temperature_decode,
    token_counts,
    top_k_decode,
    top_k_filter,
    top_p_decode,
    top_p_filter,
)
from .streaming import CallbackStreamer, TextStreamer, TokenIteratorStreamer

__all__ = [
    "BeamSearch",
    "CallbackStreamer",
    "KVCache",
    "LMAdapter",
    "RepetitionPenaltyController",
    "TextStreamer",
    "TokenIteratorStreamer",
    "apply_penalties",
    "beam_search",
    "generate",
    "generate_stream",
    "greedy_decode",
    "min_p_filter",
    "process_logits",
    "reorder_cache",
    "sample_from_logits",
    "temperature_decode",
    "token_counts",
    "top_k_decode",
    "top_k_filter",
    "top_p_decode",
    "top_p_filter",
]
