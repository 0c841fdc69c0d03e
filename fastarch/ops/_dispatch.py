"""Running one function of the implementation the selector picks; used inside the custom ops' bodies so
that selection happens at run time, where torch.compile never has to trace it."""

from __future__ import annotations

from typing import Any

import torch

from ..backend import AUTO, Call, select


def call_of(t: torch.Tensor, **features: Any) -> Call:
    return Call(t.device, t.dtype, features)


def run(op: str, fn: str, call: Call, backend: str, *args: Any) -> Any:
    """Select an implementation of ``op`` for ``call`` (``backend`` is 'auto' or a forced name) and call
    its method ``fn`` with ``args``."""
    impl = select(op, call, None if backend == AUTO else backend)
    return getattr(impl, fn)(*args)
