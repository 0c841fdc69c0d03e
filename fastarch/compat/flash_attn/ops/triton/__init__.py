"""flash-attn's Triton-op modules on fastarch's ops: ``rotary`` (``apply_rotary``), ``layer_norm``
(``layer_norm_fn``, ``rms_norm_fn``, ``RMSNorm``, ...) and ``cross_entropy`` (``cross_entropy_loss``)."""

from ..._missing import missing_attribute
from . import cross_entropy, layer_norm, rotary

__all__ = ["cross_entropy", "layer_norm", "rotary"]

__getattr__ = missing_attribute("flash_attn.ops.triton")
