"""``fla.ops.kda``: ``chunk_kda`` and ``fused_recurrent_kda``."""

from ..._missing import missing_attribute
from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]

__getattr__ = missing_attribute("fla.ops.kda")
