"""What a compat stand-in (flash-attn, mamba-ssm, causal-conv1d, fla) does not provide: a clear ImportError naming
the missing name and what fastarch offers instead, never a silent absence.

A stand-in module wires it as its module ``__getattr__``::

    from fastarch.compat._missing import missing_attribute
    __getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton")   # the peer's names

``from mamba_ssm.ops.triton import nope`` (and ``mamba_ssm.ops.triton.nope``, and ``hasattr`` on the module) then
raises :class:`NotProvidedError` naming ``mamba_ssm.ops.triton.nope`` and what the stand-in offers: ``provided``
when given, else the module's ``__all__`` and its submodules. A submodule not yet imported is imported and
returned (``from pkg import sub`` asks the package for it first). Private and dunder names stay plain attribute
misses (copy, pickle and inspect probe them). :func:`fastarch.compat.install`'s finder raises
:class:`ModuleNotProvidedError` for a submodule a stand-in lacks, listing :func:`provided_modules`.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence

__all__ = ["ModuleNotProvidedError", "NotProvidedError", "missing_attribute", "provided_modules"]

_PREFIX = "fastarch.compat."


class NotProvidedError(ImportError):
    """A name of a peer package that fastarch's stand-in does not provide, on ``from pkg... import name`` and on
    attribute access alike (so ``hasattr`` on these modules raises it too, rather than answering False)."""


class ModuleNotProvidedError(NotProvidedError, ModuleNotFoundError):
    """A submodule of a peer package that fastarch's stand-in does not provide (``import pkg.sub``)."""


def provided_modules(package: str) -> list[str]:
    """The submodules (recursively, under the peer's names) of fastarch's stand-in for ``package``, e.g.
    ``provided_modules("mamba_ssm.ops")`` -> ``["mamba_ssm.ops.selective_scan_interface", ...]``. Found on disk;
    nothing is imported. Private modules (``_name``) are left out; empty when the stand-in is not a package."""
    here = os.path.dirname(os.path.abspath(__file__))  # fastarch/compat
    path = os.path.join(here, *package.split("."))
    if not os.path.isfile(os.path.join(path, "__init__.py")):
        return []
    found = []
    for info in pkgutil.iter_modules([path]):
        if info.name.startswith("_"):
            continue
        name = f"{package}.{info.name}"
        found.append(name)
        if info.ispkg:
            found.extend(provided_modules(name))
    return found


def _is_submodule(module: str, name: str) -> bool:
    """Is ``name`` a submodule of the stand-in for ``module`` (on disk, imported or not)?"""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), *module.split("."))
    return os.path.isfile(os.path.join(path, name + ".py")) or os.path.isfile(os.path.join(path, name, "__init__.py"))


def _provided_names(module: str) -> list[str]:
    """What the stand-in for ``module`` offers: its ``__all__`` (when it is imported) and its submodules."""
    mod = sys.modules.get(_PREFIX + module)
    names = {f"{module}.{n}" for n in getattr(mod, "__all__", ())}
    return sorted(names | set(provided_modules(module)))


def missing_attribute(package: str, module: str, provided: Sequence[str] | None = None,
                      error: type[NotProvidedError] = NotProvidedError,
                      internal: Sequence[str] = ()) -> Callable[[str], object]:
    """A module ``__getattr__`` for the stand-in of ``module`` raising ``error`` for a public name it lacks.

    Args:
        package: the peer's top-level package name (``"fla"``, ``"flash_attn"``, ``"mamba_ssm"``).
        module: the peer's dotted name of the module this ``__getattr__`` belongs to (``package`` or under it).
        provided: the dotted names (or short descriptions) of what the stand-in does provide; None: the module's
            ``__all__`` and its submodules, looked up when the error is raised.
        error: the :class:`NotProvidedError` subclass to raise.
        internal: private names of the peer (its kernels' helpers, which its own tests call) refused with
            ``error`` too, rather than as plain attribute misses.
    """
    if module != package and not module.startswith(package + "."):
        raise ValueError(f"missing_attribute: module must be the peer's dotted name under package {package!r} "
                         f"(e.g. '{package}.ops'), got {module!r}")
    if not (isinstance(error, type) and issubclass(error, NotProvidedError)):
        raise TypeError(f"missing_attribute: error must be a NotProvidedError subclass, got {error!r}")

    def __getattr__(name: str) -> object:
        if name in internal:
            raise error(f"fastarch.compat.{package} (installed as '{package}') does not provide {module}.{name}, an "
                        f"internal helper of the peer's kernels; it provides "
                        f"{', '.join(list(provided) if provided is not None else _provided_names(module))}",
                        name=name)
        if name.startswith("_"):  # private and dunder probes (copy, pickle, inspect) are plain attribute misses
            raise AttributeError(name)
        if _is_submodule(module, name):  # ``from pkg import sub`` asks hasattr(pkg, "sub") before importing it
            return importlib.import_module(f"{_PREFIX}{module}.{name}")
        offered = list(provided) if provided is not None else _provided_names(module)
        raise error(
            f"fastarch.compat.{package} (installed as '{package}') does not provide {module}.{name}; "
            f"{'it provides ' + ', '.join(offered) if offered else 'it provides nothing else there'}", name=name)

    return __getattr__
