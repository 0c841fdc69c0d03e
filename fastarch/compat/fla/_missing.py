"""What fastarch's stand-in for ``fla`` does not provide: a clear ImportError, never a silent absence."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FlaNotProvidedError", "missing_attribute"]

PROVIDED = ("fla.ops.gated_delta_rule.chunk_gated_delta_rule", "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
            "fla.ops.kda.chunk_kda", "fla.ops.kda.fused_recurrent_kda")


class FlaNotProvidedError(ImportError):
    """A name of flash-linear-attention that fastarch does not provide, on ``from fla... import name`` and on
    attribute access alike (so ``hasattr`` on these modules raises it too, rather than answering False)."""


def missing_attribute(module: str) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` (fla's name of it) raising :class:`FlaNotProvidedError`."""

    def __getattr__(name: str) -> object:
        if name.startswith("_"):  # private and dunder probes (copy, pickle, inspect) are plain attribute misses
            raise AttributeError(name)
        raise FlaNotProvidedError(
            f"fastarch.compat.fla (installed as 'fla') does not provide {module}.{name}; it provides "
            f"{', '.join(PROVIDED)}", name=name)

    return __getattr__
