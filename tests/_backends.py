"""Which backends a test runs on: every registered implementation of an op, skipped only for a reason
outside the code (no CUDA device, triton not installed, no C++ toolchain on this machine).

Under ``FASTARCH_REQUIRE_CPP=1`` (the default when ``CI`` is set) a C++ extension that cannot be had fails
even without a toolchain; a build that fails where a toolchain exists always fails.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

import pytest
import torch

from fastarch import backend as registry
from fastarch import ops as _ops  # noqa: F401  (registers every op)

# Backends whose implementations are compiled extensions built from csrc/.
COMPILED_BACKENDS = ("cpp", "cuda")


def cpp_required() -> bool:
    """Whether a C++ extension that cannot be had fails the run even when no toolchain is present."""
    flag = os.environ.get("FASTARCH_REQUIRE_CPP")
    if flag is not None:
        return flag.strip().lower() not in ("", "0", "false", "no")
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def import_triton():
    """triton: a dependency on Linux x86-64, where its absence is a broken install and fails; elsewhere an
    optional package whose absence skips."""
    if sys.platform == "linux" and platform.machine() == "x86_64":
        import triton

        return triton
    return pytest.importorskip("triton", reason="triton is not installed")


def devices_present() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _toolchain_missing(kind: str = "cpu") -> str | None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed"
    if kind == "cuda" and cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit (nvcc not found)"
    return None


def outside_reason(impl: registry.Implementation, device: str) -> str | None:
    """Why ``impl`` cannot run on ``device`` for a reason outside fastarch's code, or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if impl.backend == "cuda" and torch.version.cuda is None:
        return "torch is a CPU build (no CUDA)"
    if impl.backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
    return None


def require_backend(op: str, backend: str, device: str = "cpu") -> registry.Implementation:
    """Skip for a reason outside the code; fail when the implementation cannot load for any other reason."""
    impl = registry.get_implementation(op, backend)
    reason = outside_reason(impl, device)
    if reason is not None:
        pytest.skip(f"{op}/{backend} on {device}: {reason}")
    err = impl.ensure_loaded()
    if err is None:
        return impl
    if impl.backend in COMPILED_BACKENDS and not cpp_required():
        missing = _toolchain_missing("cuda" if impl.backend == "cuda" else "cpu")
        if missing is not None:
            pytest.skip(f"{op}/{backend}: {missing} (set FASTARCH_REQUIRE_CPP=1 to make this a failure)")
    pytest.fail(f"{op}/{backend} cannot be loaded: {err}", pytrace=False)


def require_extension(name: str, kind: str = "cpu"):
    """The compiled extension ``name``; skip only when no toolchain is present and C++ is not required."""
    from fastarch.extensions import ExtensionBuildError, load_extension

    try:
        return load_extension(name, kind)
    except ExtensionBuildError as exc:
        missing = None if cpp_required() else _toolchain_missing(kind)
        if missing is not None:
            pytest.skip(f"extension {name} ({kind}): {missing} (set FASTARCH_REQUIRE_CPP=1 to make this a failure)")
        pytest.fail(f"extension {name} ({kind}) cannot be loaded: {exc}", pytrace=False)


def backend_cases(op: str, devices: tuple[str, ...] = ("cpu",)) -> list[tuple[str, str, str]]:
    """(op, backend, device) for every registered implementation of ``op`` on each of ``devices``."""
    out = []
    for name, impl in registry.implementations(op).items():
        for dev in devices:
            if dev in impl.devices:
                out.append((op, name, dev))
    return out


def case_id(case: tuple[str, str, str]) -> str:
    _, name, dev = case
    return name if dev == "cpu" else f"{name}-{dev}"
