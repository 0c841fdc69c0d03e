"""The module ``__getattr__`` of the stand-in's packages: a submodule on disk is imported on first access (so
``from mamba_ssm.modules import mamba3`` works whether or not it was imported before); any other public name
raises :class:`~fastarch.compat._missing.NotProvidedError`."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from .._missing import missing_attribute

__all__ = ["package_getattr"]


def package_getattr(module_name: str, peer_name: str) -> Callable[[str], object]:
    """``__getattr__`` for the package ``module_name`` (fastarch's name), which stands in for ``peer_name``."""
    missing = missing_attribute("mamba_ssm", peer_name)

    def __getattr__(name: str) -> object:
        if not name.startswith("_") and importlib.util.find_spec(f"{module_name}.{name}") is not None:
            return importlib.import_module(f"{module_name}.{name}")
        return missing(name)

    return __getattr__
