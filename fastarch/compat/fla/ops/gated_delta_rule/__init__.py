"""``fla.ops.gated_delta_rule``: ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule``."""

from ..._missing import missing_attribute
from .chunk import chunk_gated_delta_rule
from .fused_recurrent import fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

__getattr__ = missing_attribute("fla.ops.gated_delta_rule")
