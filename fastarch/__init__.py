"""fastarch: fast attention, long-sequence attention and state-space kernels for PyTorch.

``fastarch.ops`` holds the functional ops, ``fastarch.nn`` drop-in modules for the architectures of the
seed guides, ``fastarch.models`` whole-model builders, ``fastarch.compat`` drop-ins for mamba-ssm and
causal-conv1d code, and ``fastarch.backend`` the selector that picks an implementation per call.
"""

from __future__ import annotations

import importlib
from typing import Any

from .backend import BackendUnavailableError, ExtensionBuildError, use_backend

__version__ = "0.1.0"
__all__ = ["BackendUnavailableError", "ExtensionBuildError", "use_backend", "__version__", "explain"]

_SUBMODULES = {"ops", "nn", "models", "generation", "tokenizers", "optim", "train", "distributed", "bench",
               "extensions", "backend", "info", "compat"}


def __getattr__(name: str) -> Any:
    # Submodules load on first use so that `import fastarch` stays cheap.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fastarch' has no attribute {name!r}")


def explain(op: Any, *args: Any, backend: str | None = None, **kwargs: Any) -> str:
    """Which backend runs a call, why the others do not, and whether the decision was cached.

    ``explain(fastarch.ops.attention, q, k, v, causal=True)``: the op with its own arguments (it runs once,
    without autograd, and every decision it makes is reported). ``explain("attention", q, head_dim=64)``:
    an op name, a tensor giving device and dtype, and the call's features as keywords.
    """
    import torch

    from . import backend as _backend
    from . import ops as _ops  # noqa: F401  (registers implementations)

    if callable(op):
        if backend is not None:
            kwargs["backend"] = backend
        return _backend.explain_call(op, *args, **kwargs)
    t = next(x for x in args if isinstance(x, torch.Tensor))
    return _backend.explain(op, _backend.Call(t.device, t.dtype, kwargs), backend)
