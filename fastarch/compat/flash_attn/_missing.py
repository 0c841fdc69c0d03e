"""What fastarch's stand-in for ``flash_attn`` does not provide: a clear ImportError naming it and listing what
fastarch offers instead."""

from __future__ import annotations

from collections.abc import Callable

from .._missing import NotProvidedError
from .._missing import missing_attribute as _missing_attribute

__all__ = ["FlashAttnNotProvidedError", "PROVIDED", "missing_attribute"]

PROVIDED = (
    "flash_attn.flash_attn_interface (flash_attn_func and its packed, varlen and kvcache variants)",
    "flash_attn.bert_padding", "flash_attn.layers.rotary", "flash_attn.ops.triton.rotary.apply_rotary",
    "flash_attn.ops.triton.layer_norm", "flash_attn.ops.triton.cross_entropy.cross_entropy_loss",
    "flash_attn.ops.layer_norm", "flash_attn.ops.rms_norm", "flash_attn.losses.cross_entropy.CrossEntropyLoss",
    "flash_attn.modules.mha", "flash_attn.modules.mlp (Mlp, GatedMlp)", "flash_attn.modules.block.Block",
    "flash_attn.utils.distributed (world size 1)", "flash_attn.utils.generation.InferenceParams",
)


class FlashAttnNotProvidedError(NotProvidedError):
    """A name of flash-attn that fastarch does not provide (see :class:`fastarch.compat._missing.NotProvidedError`)."""


def missing_attribute(module: str) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` (flash-attn's name of it) raising
    :class:`FlashAttnNotProvidedError`."""
    return _missing_attribute("flash_attn", module, PROVIDED, FlashAttnNotProvidedError)
