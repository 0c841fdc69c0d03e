"""``fastarch.kernels`` when fastarch runs from a source checkout.

The Triton kernels live in ``kernels/`` beside the package. An install maps that folder to the subpackage
``fastarch.kernels`` (``package_dir`` in ``setup.py``: a wheel copies it in, an editable install maps it
with setuptools' import finder). A checkout that is imported without being installed, for instance by
``python -m pytest`` from its root while another checkout is installed in editable mode, has no such
mapping, or the other checkout's. This finder maps ``fastarch.kernels`` to the ``kernels/`` beside the
``fastarch/`` being imported; the kernel modules below it are then found through its ``__path__``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_PACKAGE = Path(__file__).resolve().parent
_KERNELS = _PACKAGE.parent / "kernels"


class _KernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "fastarch.kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, _KERNELS / "__init__.py", submodule_search_locations=[str(_KERNELS)])


def map_kernels() -> None:
    """Install the finder when this ``fastarch/`` has no ``kernels`` of its own but a checkout's beside it."""
    if (_PACKAGE / "kernels").is_dir() or not (_KERNELS / "__init__.py").is_file():
        return  # an installed wheel, or no checkout around it
    if not any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsFinder())
