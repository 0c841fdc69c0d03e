"""Drop-in modules for code written against flash-attn, mamba-ssm, causal-conv1d and flash-linear-attention,
running on fastarch's ops (CPU included): :mod:`fastarch.compat.flash_attn`, :mod:`fastarch.compat.mamba_ssm`,
:mod:`fastarch.compat.causal_conv1d` and :mod:`fastarch.compat.fla` (the gated delta rule and KDA), with the originals' signatures, positional order, defaults and return
values.

Code that imports the originals by name can be pointed at them with an opt-in::

    import fastarch.compat
    fastarch.compat.install()
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn   # fastarch's
    import causal_conv1d                                                    # fastarch's

:func:`install` aliases only packages that are not installed: it asks ``importlib.util.find_spec`` (which
imports nothing) before aliasing, and its finder asks the other finders again before it resolves a package,
so a real package on the path always wins, even one installed later. :func:`uninstall` removes the finder and the aliased modules from ``sys.modules``.
Nothing is written to disk.

A submodule a stand-in lacks: ``import mamba_ssm.nope`` raises
:class:`~fastarch.compat._missing.ModuleNotProvidedError` (a ``ModuleNotFoundError``) naming it and listing the
stand-in's modules, while a probe (``importlib.util.find_spec("mamba_ssm.nope")``) still answers None; a name
a stand-in module lacks (``from mamba_ssm.ops import nope``) raises
:class:`~fastarch.compat._missing.NotProvidedError` the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

from ._missing import ModuleNotProvidedError, provided_modules

__all__ = ["install", "installed", "uninstall"]

# Package name -> the fastarch module that stands in for it.
TARGETS: dict[str, str] = {
    "causal_conv1d": "fastarch.compat.causal_conv1d",
    "fla": "fastarch.compat.fla",
    "flash_attn": "fastarch.compat.flash_attn",
    "mamba_ssm": "fastarch.compat.mamba_ssm",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads a name as an already importable fastarch module (the same module object)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias's spec on the module; the module keeps its own.
        module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``name`` and ``name.sub...`` to ``target`` and ``target.sub...`` for each aliased package."""

    def __init__(self, aliases: dict[str, str]) -> None:
        self.aliases = aliases

    def find_spec(self, fullname, path=None, target=None):
        top, _, rest = fullname.partition(".")
        base = self.aliases.get(top)
        if base is None:
            return None
        if rest and not _is_ours(top):  # the package itself did not come from us
            return None
        if not rest and self._real_exists(top):  # installed since install(): the real one wins
            return None
        real = base + ("." + rest if rest else "")
        real_spec = _find(real)
        if real_spec is None:  # a submodule the stand-in lacks
            if rest and _import_statement() and not self._real_exists(fullname, path):
                # an import says what is missing and what the stand-in offers; a probe
                # (importlib.util.find_spec, pkgutil) still gets None
                offered = provided_modules(top)
                raise ModuleNotProvidedError(
                    f"No module named '{fullname}': fastarch's stand-in for '{top}' ({base}) does not provide it; "
                    f"it provides {', '.join(offered) if offered else 'no submodules'}", name=fullname)
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real),
                                               is_package=real_spec.submodule_search_locations is not None)

    def _real_exists(self, name: str, path=None) -> bool:
        return any(f.find_spec(name, path) is not None for f in sys.meta_path
                   if f is not self and hasattr(f, "find_spec"))


def _import_statement() -> bool:
    """Is the finder being asked by the import system loading a module (``import x.y``, ``from x import y``),
    rather than by a probe such as ``importlib.util.find_spec``? The import system's loader asks through its
    spec search, two frames above the finder."""
    try:
        frame = sys._getframe(3)  # this function <- find_spec <- the spec search <- its caller
    except ValueError:  # find_spec called directly near the bottom of the stack
        return False
    return frame.f_code.co_name == "_find_and_load_unlocked" and "importlib" in frame.f_code.co_filename


def _find(name: str) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec`` that answers None for a name whose parent package is missing."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _finder() -> _AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)


def _is_ours(name: str) -> bool:
    """Is ``sys.modules[name]`` one of our aliases (a fastarch module under a package's name)?"""
    base = TARGETS.get(name.partition(".")[0])
    mod = sys.modules.get(name)
    return base is not None and mod is not None and getattr(mod, "__name__", "").startswith(base)


def install() -> list[str]:
    """Alias ``causal_conv1d``, ``mamba_ssm``, ``flash_attn`` and ``fla`` to fastarch's
    modules, each only when the real package is not installed. Idempotent. Returns the aliased names."""
    uninstall()  # so that find_spec below sees only real packages
    aliases = {name: target for name, target in TARGETS.items()
               if _find(name) is None and _find(target) is not None}
    if aliases:
        # First on the path: a package's submodules must resolve through us, not be found again by the path
        # finder under the package's __path__ (that would load fastarch's files a second time).
        sys.meta_path.insert(0, _AliasFinder(aliases))
    return sorted(aliases)


def uninstall() -> None:
    """Remove the finder and every alias it put in ``sys.modules`` (fastarch's own modules stay)."""
    finder = _finder()
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = _finder()
    for name in [n for n in sys.modules if n.partition(".")[0] in TARGETS and _is_ours(n)]:
        del sys.modules[name]


def installed() -> list[str]:
    """The package names currently aliased by :func:`install`."""
    finder = _finder()
    return sorted(finder.aliases) if finder is not None else []
