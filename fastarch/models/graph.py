"""Graph builders (guide 001's GCN and GAT) in small, Cora-like sizes."""

from __future__ import annotations

from typing import Any

from ..nn.graph import GAT, GCN
from .registry import register_model

__all__: list[str] = []


@register_model
def gcn_small(in_features: int = 16, hidden_dims: tuple[int, ...] = (32,), num_classes: int = 4, **kw: Any) -> GCN:
    return GCN(in_features, list(hidden_dims), num_classes, **kw)


@register_model
def gat_small(in_features: int = 16, hidden_dim: int = 8, num_classes: int = 4, num_heads: int = 4, **kw: Any) -> GAT:
    return GAT(in_features, hidden_dim, num_classes, num_heads=num_heads, **kw)
