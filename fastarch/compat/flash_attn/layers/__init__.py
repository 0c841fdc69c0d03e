"""flash-attn's ``flash_attn.layers``: ``rotary`` (``RotaryEmbedding`` and the ``apply_rotary_emb`` family)."""

from .._missing import missing_attribute
from . import rotary

__all__ = ["rotary"]

__getattr__ = missing_attribute("flash_attn.layers")
