"""flash-attn's ``flash_attn.ops`` on fastarch's ops: ``layer_norm`` and ``rms_norm`` (the fused
dropout-add-norm functions and modules) and the ``triton`` subpackage."""

from .._missing import missing_attribute
from . import layer_norm, rms_norm, triton

__all__ = ["layer_norm", "rms_norm", "triton"]

__getattr__ = missing_attribute("flash_attn.ops")
