"""How a public op reaches its implementation.

A public op resolves its backend once, with :func:`resolve`, and passes the name to its custom op; the
custom op's forward runs that implementation through :func:`run` and its backward through
:func:`run_backward`. So the backward always runs the implementation the forward ran, whatever context is
active when it runs.

Under ``torch.compile`` the override (``backend=``, :func:`fastarch.use_backend`, ``FASTARCH_BACKEND``) is
read when the graph is traced, and an automatic choice is made when the graph runs, from the call alone
(:func:`fastarch.backend.choose` reads no override), so forward and backward still agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..backend import AUTO, Call, Implementation, choose, get_implementation, requested_backend, select

__all__ = ["call_of", "direct", "dispatch", "in_layout_of", "resolve", "run", "run_backward"]


def call_of(t: torch.Tensor, **features: Any) -> Call:
    return Call(t.device, t.dtype, features)


@torch.compiler.assume_constant_result
def _requested(op: str, backend: str | None) -> str:
    return requested_backend(op, backend)


def resolve(op: str, make_call: Callable[[], Call], backend: str | None) -> str:
    """The backend name a public op passes to its custom op: the implementation the selector picks for
    this call (``make_call`` builds the :class:`Call`). While ``torch.compile`` traces, the requested name
    (or 'auto', decided when the graph runs)."""
    if torch.compiler.is_compiling():
        return _requested(op, backend)
    return select(op, make_call(), backend).backend


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dispatch_modes() -> int:
    return torch._C._len_torch_dispatch_stack()


def direct(*tensors: torch.Tensor | None) -> bool:
    """May this call run its implementation directly, without the custom op? Yes when autograd records
    nothing for it (no tensor requires a gradient, or grad mode is off), nothing is being compiled or
    exported, every tensor is a plain tensor (no fake or subclass tensors) and no dispatch mode is active.
    The custom op serves autograd, ``torch.compile``, export and those modes; a decode step skips its
    dispatch, which costs more than a small call's arithmetic."""
    if torch.compiler.is_compiling() or _dispatch_modes():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def dispatch(op: str, make_call: Callable[[], Call], backend: str | None,
             *tensors: torch.Tensor | None) -> tuple[Implementation | None, str]:
    """One decision for a public op's call: ``(implementation, name)``. ``implementation`` is set when the
    call may run it directly (:func:`direct`), else None, and ``name`` is what the op passes to its custom op
    (as :func:`resolve` gives it)."""
    if torch.compiler.is_compiling():
        return None, _requested(op, backend)
    impl = select(op, make_call(), backend)
    return (impl if direct(*tensors) else None), impl.backend


def run(op: str, fn: str, call: Call, backend: str, *args: Any) -> Any:
    """Call the method ``fn`` of ``op``'s implementation ``backend`` (a name from :func:`resolve`)."""
    return getattr(choose(op, call, backend), fn)(*args)


def run_backward(op: str, call: Call, backend: str, *args: Any) -> Any:
    """Call the ``backward`` of the implementation the forward ran. Its capabilities were checked for the
    forward's call (a backward may see other shapes, e.g. the attention lse gradient's extra columns), so a
    named implementation runs without a second check; 'auto' chooses from ``call`` as the forward did."""
    impl = choose(op, call) if backend == AUTO else get_implementation(op, backend)
    return impl.backward(*args)


def in_layout_of(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (ref's shape) in the memory layout ``torch.empty_like(ref)`` has, which is what the custom ops'
    fake implementations declare; a copy only when the layouts differ."""
    out = torch.empty_like(ref, dtype=t.dtype)
    return t if out.stride() == t.stride() else out.copy_(t)
