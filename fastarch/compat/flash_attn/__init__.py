"""flash-attn 2's public functions and program namespaces on fastarch's ops, on any device fastarch runs on.

The top level has ``flash_attn_func``, ``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func``,
``flash_attn_varlen_func``, ``flash_attn_varlen_qkvpacked_func``, ``flash_attn_varlen_kvpacked_func`` and
``flash_attn_with_kvcache`` (:mod:`fastarch.compat.flash_attn.flash_attn_interface`), with flash-attn's names,
signatures, defaults, positional order, layouts and return values. The subpackages mirror flash-attn's:
``bert_padding``, ``layers.rotary``, ``ops.triton.{rotary, layer_norm, cross_entropy}``, ``ops.layer_norm``,
``ops.rms_norm``, ``losses.cross_entropy``, ``modules.{mha, mlp, block}`` and ``utils.{distributed,
generation}``. Any other flash-attn name raises an ImportError that names it and lists what is provided.
"""

from . import bert_padding, flash_attn_interface, layers, losses, modules, ops, utils
from ._missing import missing_attribute
from .flash_attn_interface import *  # noqa: F403

__all__ = [*flash_attn_interface.__all__, "bert_padding", "layers", "losses", "modules", "ops", "utils"]

__getattr__ = missing_attribute("flash_attn")
