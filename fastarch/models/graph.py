"""Graph builders (guide 001's GCN and GAT) in small, Cora-like sizes."""

from __future__ import annotations

from ..nn.graph import GAT, GCN
from .registry import register_configs

__all__: list[str] = []

globals().update(register_configs({
    "gcn_small": (GCN, "Two-layer GCN, 16 -> 32 -> 4.", dict(in_features=16, hidden_dims=(32,), num_classes=4)),
    "gat_small": (GAT, "Two-layer GAT, 16 -> 4 heads x 8 -> 4.",
                  dict(in_features=16, hidden_dim=8, num_classes=4, num_heads=4)),
}))
