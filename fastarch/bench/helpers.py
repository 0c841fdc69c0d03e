"""Helpers for writing suites: turning the backend selector's reasons into :class:`Skip`, peers'
availability, and a deterministic input generator."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from .core import BenchConfig, Skip

__all__ = ["require_backend", "require_package", "require_cuda", "randn", "fastarch_op"]


def fastarch_op(name: str) -> Any:
    """``fastarch.ops.<name>``, or :class:`Skip` when that op does not exist (yet)."""
    try:
        ops = importlib.import_module("fastarch.ops")
    except Exception as exc:
        raise Skip(f"fastarch.ops failed to import: {type(exc).__name__}: {exc}") from None
    fn = getattr(ops, name, None)
    if fn is None:
        raise Skip(f"fastarch.ops.{name} is not available")
    return fn


def require_backend(op: str, backend: str, device: torch.device, dtype: torch.dtype, **features: Any) -> None:
    """Raise :class:`Skip` with the selector's reasons when ``backend`` cannot run ``op`` for a call on
    ``device``/``dtype`` with ``features``. Triton on CPU (interpreter mode, which exists for tests) is
    never benchmarked."""
    from fastarch import backend as be

    importlib.import_module("fastarch.ops")  # registers implementations
    if torch.device(device).type == "cpu" and backend == "triton":
        raise Skip("triton on CPU runs only in the interpreter (tests), not benchmarked")
    try:
        impl = be.get_implementation(op, backend)
    except (KeyError, be.BackendUnavailableError) as exc:
        raise Skip(str(exc).strip("'\"")) from None
    reasons = impl.not_supported_reasons(be.Call(torch.device(device), dtype, dict(features)))
    if reasons:
        raise Skip("; ".join(reasons))


def require_package(name: str) -> Any:
    """Import ``name`` or raise ``Skip("not installed (name)")``."""
    if importlib.util.find_spec(name) is None:
        raise Skip(f"not installed ({name})")
    try:
        return importlib.import_module(name)
    except Exception as exc:  # installed but broken (e.g. built for another torch)
        raise Skip(f"{name} failed to import: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None


def require_cuda(cfg: BenchConfig) -> None:
    if not cfg.is_cuda:
        raise Skip("needs a CUDA device")


def randn(*shape: int, cfg: BenchConfig, seed: int = 0, requires_grad: bool = False, scale: float = 1.0
          ) -> torch.Tensor:
    """Normal inputs drawn on the CPU from a seeded generator (identical for every provider), then moved."""
    g = torch.Generator(device="cpu").manual_seed(cfg.seed * 1000003 + seed)
    t = (torch.randn(*shape, generator=g) * scale).to(device=cfg.device, dtype=cfg.dtype)
    return t.requires_grad_(requires_grad)
