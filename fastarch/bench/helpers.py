"""Helpers for writing suites: turning the backend selector's reasons into :class:`Skip`, peers'
availability, deterministic inputs, and the timed call of a forward or forward+backward."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .core import BenchConfig, Skip

__all__ = ["require_backend", "require_package", "require_cuda", "randn", "qkv", "timed_call", "fastarch_op"]


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


def qkv(cfg: BenchConfig, B: int, H: int, L: int, D: int, requires_grad: bool = False) -> list[torch.Tensor]:
    """Attention inputs q, k, v of shape (B, H, L, D), seeds 1, 2, 3."""
    return [randn(B, H, L, D, cfg=cfg, seed=s, requires_grad=requires_grad) for s in (1, 2, 3)]


def timed_call(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], backward: bool) -> Callable[[], Any]:
    """The timed iteration of ``fn(*inputs)``: the forward under ``no_grad``, or (``backward``) the forward
    and the gradients of the inputs that require grad for a fixed random output gradient (computed with
    ``autograd.grad``, so nothing accumulates between iterations). A tuple output counts by its first item."""
    inputs = list(inputs)
    if not backward:
        def fwd() -> Any:
            with torch.no_grad():
                return fn(*inputs)
        return fwd

    def first(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, (tuple, list)) else out

    with torch.no_grad():
        like = first(fn(*inputs))
    g = torch.Generator(device="cpu").manual_seed(7)
    dy = torch.randn(like.shape, generator=g).to(device=like.device, dtype=like.dtype)
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def fwd_bwd() -> Any:
        return torch.autograd.grad(first(fn(*inputs)), wrt, dy)
    return fwd_bwd
