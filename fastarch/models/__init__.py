"""Whole-model builders with a timm-style registry. Every file in this package that registers builders is
imported here, so ``create_model`` sees them all."""

from __future__ import annotations

import importlib
import pkgutil

from .registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]


def _load_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name == "registry":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for name in getattr(mod, "__all__", ()):
            globals()[name] = getattr(mod, name)
            __all__.append(name)


_load_all()
