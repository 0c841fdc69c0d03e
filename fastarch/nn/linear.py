"""``Linear``: ``torch.nn.Linear`` on ``fastarch.ops.linear``; the same parameters and ``state_dict`` keys."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.linear import linear

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``torch.nn.Linear`` whose forward runs ``fastarch.ops.linear`` (a C++ kernel for the few rows of a
    decode step on CPU). ``forward(x (..., in_features)) -> (..., out_features)``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
