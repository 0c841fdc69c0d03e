"""flash-attn's ``InferenceParams`` (the decode state the flash-attn modules read and fill:
``key_value_memory_dict[layer_idx]`` holds a layer's ``(batch, max_seqlen, 2, nheads_kv, headdim)`` KV cache;
``seqlen_offset`` counts the tokens already in it). It is :class:`fastarch.nn.mamba2.InferenceParams`, which
has the same fields and ``reset``."""

from __future__ import annotations

from ....nn.mamba2 import InferenceParams
from .._missing import missing_attribute

__all__ = ["InferenceParams"]

__getattr__ = missing_attribute("flash_attn.utils.generation")
