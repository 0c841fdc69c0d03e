"""flash-attn 2's public functions on :func:`fastarch.ops.attention`, on any device fastarch runs on.

Same names, signatures, defaults, positional order, layouts (``(batch, seqlen, nheads, headdim)``, packed
``(total, nheads, headdim)`` for varlen) and return values as ``flash_attn``: ``flash_attn_func``,
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``, ``flash_attn_varlen_func``,
``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func`` and ``flash_attn_with_kvcache``;
see :mod:`fastarch.compat.flash_attn.flash_attn_interface`.
"""

from . import flash_attn_interface
from .flash_attn_interface import *  # noqa: F403

__all__ = list(flash_attn_interface.__all__)
