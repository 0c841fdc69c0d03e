"""Text generation: a preallocated KV cache, logit processors and samplers, beam search, streaming and
``generate`` for GPT-family models (KV cache) and MambaLM (recurrent ``step``)."""

from __future__ import annotations

from . import sampling
from .beam_search import BeamSearch, beam_search
from .generate import LMAdapter, generate, generate_stream, reorder_cache
from .kv_cache import KVCache
from .sampling import *  # noqa: F403  (the logit processors and samplers: sampling.__all__)
from .streaming import CallbackStreamer, TextStreamer, TokenIteratorStreamer

__all__ = [
    "BeamSearch",
    "CallbackStreamer",
    "KVCache",
    "LMAdapter",
    "TextStreamer",
    "TokenIteratorStreamer",
    "beam_search",
    "generate",
    "generate_stream",
    "reorder_cache",
]
__all__ += sampling.__all__
