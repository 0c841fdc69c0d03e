"""flash-attn's ``flash_attn.modules.mlp``: ``Mlp`` and ``GatedMlp`` with flash-attn's constructor arguments,
defaults and ``state_dict`` keys (``fc1.weight``, ``fc1.bias``, ``fc2.weight``, ``fc2.bias``)."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .._missing import missing_attribute

__all__ = ["GatedMlp", "Mlp"]

__getattr__ = missing_attribute("flash_attn.modules.mlp")


class Mlp(nn.Module):
    """``fc2(activation(fc1(x)))``; returns ``(y, x)`` with ``return_residual``. Shapes: ``(..., in_features)``
    -> ``(..., out_features)``; ``hidden_features`` defaults to ``4 * in_features``."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation=F.gelu, bias1: bool = True, bias2: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x: Tensor):
        y = self.fc2(self.activation(self.fc1(x)))
        return y if not self.return_residual else (y, x)


class GatedMlp(nn.Module):
    """``fc2(y * activation(gate))`` with ``y, gate = fc1(x).chunk(2)`` (GLU for ``F.sigmoid``, SwiGLU for
    ``F.silu``); ``hidden_features`` defaults to ``8 * in_features / 3`` rounded up to ``multiple_of``. Shapes:
    ``(..., in_features)`` -> ``(..., out_features)``; ``fc1`` is ``(2 * hidden_features, in_features)``."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation=F.sigmoid, bias1: bool = True, bias2: bool = True, multiple_of: int = 128,
                 return_residual: bool = False, device=None, dtype=None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden_features = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.return_residual = return_residual
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x: Tensor):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        y = self.fc2(y * self.activation(gate))
        return y if not self.return_residual else (y, x)
