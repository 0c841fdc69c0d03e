"""Functional ops. Each op lives in its own file with its validation, its PyTorch reference (``X_ref``)
and the backend implementations it dispatches to; importing this package registers them all and installs
the measured automatic orders (``_orders``)."""

from __future__ import annotations

import importlib
import pkgutil

from . import _orders

__all__: list[str] = []


def _load_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for name in getattr(mod, "__all__", ()):
            globals()[name] = getattr(mod, name)
            __all__.append(name)


_load_all()
_orders.apply()
