"""What fastarch's stand-in for ``fla`` does not provide: a clear ImportError, never a silent absence (on
:mod:`fastarch.compat._missing`, shared by every stand-in)."""

from __future__ import annotations

from collections.abc import Callable

from .._missing import NotProvidedError
from .._missing import missing_attribute as _missing_attribute

__all__ = ["FlaNotProvidedError", "missing_attribute"]

PROVIDED = ("fla.ops.gated_delta_rule.chunk_gated_delta_rule", "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
            "fla.ops.kda.chunk_kda", "fla.ops.kda.fused_recurrent_kda")


class FlaNotProvidedError(NotProvidedError):
    """A name of flash-linear-attention that fastarch does not provide, on ``from fla... import name`` and on
    attribute access alike (so ``hasattr`` on these modules raises it too, rather than answering False)."""


def missing_attribute(module: str) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` (fla's name of it) raising :class:`FlaNotProvidedError`."""
    return _missing_attribute("fla", module, PROVIDED, FlaNotProvidedError)
