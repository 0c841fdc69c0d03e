"""The base class of each backend kind; an op's implementation subclasses one and declares the rest."""

from __future__ import annotations

from typing import Any

from ..backend import Implementation, TritonImplementation
from ..extensions import load_extension

__all__ = ["AtenImplementation", "CppImplementation", "CudaImplementation", "TorchImplementation",
           "TritonImplementation"]


class TorchImplementation(Implementation):
    """PyTorch compositions: run anywhere, used where no kernel takes the call."""

    backend = "torch"


class AtenImplementation(Implementation):
    """PyTorch's native kernels (SDPA, ``native_layer_norm``, ...)."""

    backend = "aten"


class _ExtensionImplementation(Implementation):
    """Kernels of the compiled extension named by ``extension``: ``csrc/cpu/<extension>.cpp`` for ``cpp``,
    ``csrc/cuda/<extension>.cu`` for ``cuda``."""

    extension: str = ""

    def load(self) -> Any:
        return load_extension(self.extension, "cuda" if self.backend == "cuda" else "cpu")


class CppImplementation(_ExtensionImplementation):
    backend, devices = "cpp", ("cpu",)


class CudaImplementation(_ExtensionImplementation):
    backend, devices = "cuda", ("cuda",)
