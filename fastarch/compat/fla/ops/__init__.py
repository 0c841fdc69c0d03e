"""``fla.ops``: the gated delta rule and KDA (the rest of fla's ops raise an ImportError naming them)."""

from .._missing import missing_attribute
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .kda import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]

__getattr__ = missing_attribute("fla.ops")
