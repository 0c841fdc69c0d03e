"""Multi-modal fusion of guide 000, drop-in: ``CrossModalAttention``, ``CrossModalLayer`` and
``MultiModalTransformer``. Every attention runs on ``fastarch.ops.attention``.

The guide calls ``self.cross_attn.mha(...)`` on a ``MultiHeadAttention`` (no such attribute); as for the
transformer layers, the intended call is the ``MultiHeadAttention`` itself (with its own add & norm).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._models_common import check_input, layer_norm
from .attention import MultiHeadAttention
from .linear import Linear
from .positional import LearnedPositionalEncoding
from .transformer import PositionwiseFeedForward

__all__ = ["CrossModalAttention", "CrossModalLayer", "MultiModalTransformer"]

class CrossModalAttention(nn.Module):
    """Vision queries attend to text. forward(vision (B, Lv, d), text (B, Lt, d), mask) -> (B, Lv, d)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        self.d_model = d_model
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)

    def forward(self, vision_features, text_features, mask=None):
        check_input("vision_features", vision_features, ndim=3, last=self.d_model, owner="CrossModalAttention")
        check_input("text_features", text_features, ndim=3, last=self.d_model, owner="CrossModalAttention")
        fused, _ = self.cross_attn(vision_features, text_features, text_features, mask)
        return fused


class CrossModalLayer(nn.Module):
    """Self-attention per modality, bidirectional cross-attention, FFNs; each followed by add & norm.
    forward(v (B, Lv, d), t (B, Lt, d)) -> (v', t')."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        self.v_self_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.t_self_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.v2t_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.t2v_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.v_ffn = PositionwiseFeedForward(d_model, d_model * 4, dropout)
        self.t_ffn = PositionwiseFeedForward(d_model, d_model * 4, dropout)
        self.v_norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3))
        self.t_norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3))

    def forward(self, v: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vs, _ = self.v_self_attn(v, v, v)
        v = layer_norm(vs + v, self.v_norms[0])
        ts, _ = self.t_self_attn(t, t, t)
        t = layer_norm(ts + t, self.t_norms[0])
        v_cross, _ = self.v2t_attn(v, t, t)
        v = layer_norm(v + v_cross, self.v_norms[1])
        t_cross, _ = self.t2v_attn(t, v, v)
        t = layer_norm(t + t_cross, self.t_norms[1])
        v = layer_norm(v + self.v_ffn(v), self.v_norms[2])
        t = layer_norm(t + self.t_ffn(t), self.t_norms[2])
        return v, t


class MultiModalTransformer(nn.Module):
    """forward(vision_features (B, Lv, vision_dim), text_tokens (B, Lt)) -> logits (B, num_classes)."""

    def __init__(self, vision_dim: int = 2048, text_vocab: int = 30000, d_model: int = 512, n_heads: int = 8,
                 num_layers: int = 6, num_classes: int = 1000):
        super().__init__()
        self.vision_dim = vision_dim
        self.vision_proj = Linear(vision_dim, d_model)
        self.text_embed = nn.Embedding(text_vocab, d_model)
        self.text_pos = LearnedPositionalEncoding(d_model, max_len=512)
        self.cross_modal_layers = nn.ModuleList(CrossModalLayer(d_model, n_heads) for _ in range(num_layers))
        self.classifier = Linear(d_model, num_classes)

    def forward(self, vision_features: torch.Tensor, text_tokens: torch.Tensor) -> torch.Tensor:
        check_input("vision_features", vision_features, ndim=3, last=self.vision_dim, owner="MultiModalTransformer")
        check_input("text_tokens", text_tokens, ndim=2, integer=True, owner="MultiModalTransformer")
        v = self.vision_proj(vision_features)
        t = self.text_pos(self.text_embed(text_tokens))
        for layer in self.cross_modal_layers:
            v, t = layer(v, t)
        return self.classifier(v.mean(dim=1) + t.mean(dim=1))
