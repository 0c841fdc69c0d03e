"""A timm-style model registry: ``@register_model``, ``create_model(name, **kw)``, ``list_models(pattern)``.

The builders register themselves when their files are imported; importing any part of ``fastarch.models``
(this file included) runs the package's ``__init__``, which imports them all.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable
from typing import Any, TypeVar

import torch.nn as nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}
F = TypeVar("F", bound=Callable[..., nn.Module])


def register_model(fn: F | None = None, *, name: str | None = None) -> Any:
    """Register a builder under its function name (or ``name``). Usable bare or with arguments."""

    def wrap(f: F) -> F:
        key = name or f.__name__
        if key in _MODELS and _MODELS[key] is not f:
            raise ValueError(f"model {key!r} is already registered")
        _MODELS[key] = f
        return f

    return wrap(fn) if fn is not None else wrap


def list_models(pattern: str = "*") -> list[str]:
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the registered model ``name`` with ``kwargs`` overriding its defaults."""
    if name not in _MODELS:
        close = difflib.get_close_matches(name, list(_MODELS), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(f"unknown model {name!r}{hint} (see fastarch.models.list_models())")
    return _MODELS[name](**kwargs)


def register_configs(table: dict[str, tuple[Callable[..., nn.Module], str, dict[str, Any]]]
                     ) -> dict[str, Callable[..., nn.Module]]:
    """Register one builder per entry ``name: (cls, doc, defaults)``: ``create_model(name, **kw)`` builds
    ``cls(**{**defaults, **kw})``. Returns the builders by name (functions called ``name``)."""

    def builder(name: str, cls: Callable[..., nn.Module], doc: str, defaults: dict[str, Any]):
        def build(**kw: Any) -> nn.Module:
            return cls(**{**defaults, **kw})

        build.__name__ = build.__qualname__ = name
        build.__doc__ = doc
        return register_model(build)

    return {name: builder(name, cls, doc, defaults) for name, (cls, doc, defaults) in table.items()}
