"""flash-attn's ``flash_attn.modules``: ``mha`` (``MHA``), ``mlp`` (``Mlp``, ``GatedMlp``) and ``block``
(``Block``)."""

from .._missing import missing_attribute
from . import block, mha, mlp

__all__ = ["block", "mha", "mlp"]

__getattr__ = missing_attribute("flash_attn.modules")
