"""The guide-000 multi-layer perceptron (drop-in: same constructor, ``state_dict`` keys and outputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from ._models_common import check_input
from .linear import Linear

__all__ = ["MLP"]


class MLP(nn.Module):
    """Multi-layer perceptron: ``[Linear -> ReLU -> Dropout] * len(hidden_dims) -> Linear``.

    Keys: ``network.{3i}.weight/bias`` for the hidden layers, the last index for the output layer.
    x (B, input_dim) or (..., input_dim) -> (..., output_dim).
    """

    def __init__(self, input_dim: int, hidden_dims: Sequence[int], output_dim: int, dropout: float = 0.1):
        super().__init__()
        if input_dim <= 0 or output_dim <= 0:
            raise ValueError(f"MLP: input_dim and output_dim must be positive, got {input_dim} and {output_dim}")
        layers: list[nn.Module] = []
        prev = input_dim
        for h in hidden_dims:
            layers += [Linear(prev, h), nn.ReLU(), nn.Dropout(dropout)]
            prev = h
        layers.append(Linear(prev, output_dim))
        self.network = nn.Sequential(*layers)
        self.input_dim = input_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("x", x, last=self.input_dim, owner="MLP")
        return self.network(x)
