"""Helpers shared by the model families: layer norm through the op, and argument validation."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.layer_norm import layer_norm as _layer_norm_op


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """Apply an ``nn.LayerNorm`` module's parameters (last dimension) through ``fastarch.ops.layer_norm``."""
    return _layer_norm_op(x, norm.weight, norm.bias, norm.eps)


def check_input(name: str, t: object, *, ndim: int | tuple[int, ...] | None = None, last: int | None = None,
                integer: bool = False, owner: str = "") -> torch.Tensor:
    """Clear errors for bad module inputs: the argument, what was expected and what came."""
    where = f"{owner}: " if owner else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{where}argument '{name}' must have {want} dimensions, got shape {tuple(t.shape)}")
    if last is not None and t.shape[-1] != last:
        raise ValueError(f"{where}argument '{name}' must have last dimension {last}, got shape {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{where}argument '{name}' must hold integer token ids, got dtype {t.dtype}")
    return t
