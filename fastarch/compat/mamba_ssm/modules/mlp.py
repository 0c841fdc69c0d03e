"""``mamba_ssm.modules.mlp``: mamba-ssm's ``GatedMLP``, ``fc2(y * activation(gate))`` with ``[y, gate] =
fc1(x)``, on :class:`fastarch.nn.Linear` (keys ``fc1.weight``, ``fc2.weight``, and their biases with
``bias=True``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.nn.linear import Linear

from ..._missing import missing_attribute

__all__ = ["GatedMLP"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mlp")


class GatedMLP(nn.Module):
    """``GatedMLP(in_features, hidden_features=None, out_features=None, activation=F.silu, bias=False,
    multiple_of=128)``: the hidden width (``8 * in_features / 3`` by default) rounded up to ``multiple_of``;
    ``forward(x (..., in_features)) -> (..., out_features)``."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, bias: bool = False,
                 multiple_of: int = 128, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden = (hidden + multiple_of - 1) // multiple_of * multiple_of
        self.fc1 = Linear(in_features, 2 * hidden, bias=bias, **fk)
        self.activation = activation
        self.fc2 = Linear(hidden, out_features, bias=bias, **fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * self.activation(gate))
