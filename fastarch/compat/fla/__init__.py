"""flash-linear-attention's gated delta rule and KDA on fastarch's ops: CPU and GPU, fla's signatures.

``import fastarch.compat.fla as fla`` (or :func:`fastarch.compat.install`, then ``import fla``) gives the module
paths programs and transformers import the functions from:

- ``fla.ops.gated_delta_rule``: ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``
  (:func:`fastarch.ops.gated_delta_rule`);
- ``fla.ops.kda``: ``chunk_kda``, ``fused_recurrent_kda`` (:func:`fastarch.ops.kda`).

The four functions are attributes of the top-level ``fla`` too (transformers looks a kernel function up there
first). Anything else of fla (its layers, models, modules and other ops) raises an ImportError that names it.
"""

from . import ops
from ._missing import missing_attribute
from .ops import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "ops"]

__getattr__ = missing_attribute("fla")
