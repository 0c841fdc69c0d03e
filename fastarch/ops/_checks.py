"""Input validation shared by the ops: every error names the op, the argument, what was expected and what came."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend import FLOAT_DTYPES

__all__ = ["FLOAT_DTYPES", "check_same_device", "check_same_dtype", "check_tensor", "check_writable", "fail"]


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def fail(op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"{op}: {msg}")


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES,
    device: torch.device | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape (None = any size)."""
    if not isinstance(t, torch.Tensor):
        fail(op, f"argument '{name}' must be a torch.Tensor, got {type(t).__name__}", TypeError)
    assert isinstance(t, torch.Tensor)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            fail(op, f"argument '{name}' must have {want} dimensions, got {t.dim()} (shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, f"argument '{name}' must have dtype in ({', '.join(_dt(d) for d in dtypes)}), got {_dt(t.dtype)}",
             TypeError)
    if device is not None and t.device != device:
        fail(op, f"argument '{name}' is on {t.device}, expected {device} (same device as the input)")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            fail(op, f"argument '{name}' must have shape {want}, got {tuple(t.shape)}")
    return t


def check_same_dtype(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            fail(op, f"argument '{name}' has dtype {_dt(t.dtype)} but '{ref_name}' has {_dt(ref.dtype)}",
                 TypeError)


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            fail(op, f"argument '{name}' is on {t.device} but '{ref_name}' is on {ref.device}")


def check_writable(op: str, name: str, t: torch.Tensor) -> None:
    """Refuse an in-place argument whose elements share memory (an ``expand``ed view): writing one row would
    write the others, and some kernels refuse it only once they have started writing."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        fail(op, f"argument '{name}' is updated in place and must not share memory between its elements "
                 f"(an expanded view), got shape {tuple(t.shape)} with strides {t.stride()}; pass a .clone()")
