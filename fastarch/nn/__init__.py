"""Drop-in modules for every architecture of the seed guides, on fastarch's ops.

Each file holds one family; every public class it lists in ``__all__`` is exported here, so
``from fastarch.nn import MambaBlock`` works whichever file defines it.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__: list[str] = []


def _load_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for name in getattr(mod, "__all__", ()):
            if name in globals() and globals()[name] is not getattr(mod, name):
                raise ImportError(f"fastarch.nn: {name} is defined twice ({info.name} and elsewhere)")
            globals()[name] = getattr(mod, name)
            __all__.append(name)


_load_all()
