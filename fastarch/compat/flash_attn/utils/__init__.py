"""flash-attn's ``flash_attn.utils``: ``distributed`` (world size 1) and ``generation`` (``InferenceParams``)."""

from .._missing import missing_attribute
from . import distributed, generation

__all__ = ["distributed", "generation"]

__getattr__ = missing_attribute("flash_attn.utils")
