"""fastarch: fast attention, long-sequence attention and state-space kernels for PyTorch.

``fastarch.ops`` holds the functional ops, ``fastarch.nn`` drop-in modules for the architectures of the
seed guides, ``fastarch.models`` whole-model builders, ``fastarch.compat`` drop-ins for mamba-ssm and
causal-conv1d code, and ``fastarch.backend`` the selector that picks an implementation per call.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._source_tree import map_kernels
from .backend import BackendUnavailableError, ExtensionBuildError, use_backend

map_kernels()

__version__ = "0.1.0"
__all__ = ["BackendUnavailableError", "ExtensionBuildError", "use_backend", "__version__", "explain"]

_SUBMODULES = {"ops", "nn", "models", "generation", "tokenizers", "optim", "train", "distributed", "bench",
               "extensions", "backend", "info", "compat"}


def __getattr__(name: str) -> Any:
    # Submodules load on first use so that `import fastarch` stays cheap.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fastarch' has no attribute {name!r}")


def explain(op: str, *tensors: Any, backend: str | None = None, **features: Any) -> str:
    """Which backend runs ``op`` for a call on these tensors, and why the others do not."""
    import torch

    from . import backend as _backend
    from . import ops as _ops  # noqa: F401  (registers implementations)

    t = next(x for x in tensors if isinstance(x, torch.Tensor))
    return _backend.explain(op, _backend.Call(t.device, t.dtype, features), backend)
