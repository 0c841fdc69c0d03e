"""flash-attn's ``flash_attn.losses``: ``cross_entropy`` (``CrossEntropyLoss``)."""

from .._missing import missing_attribute
from . import cross_entropy

__all__ = ["cross_entropy"]

__getattr__ = missing_attribute("flash_attn.losses")
