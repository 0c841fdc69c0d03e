"""CLIP of guide 000, drop-in: ``CLIPVisionEncoder``, ``CLIPTextEncoder`` and ``CLIP`` with its symmetric
InfoNCE ``contrastive_loss``. Encoder blocks are guide 000's ``TransformerEncoderLayer`` on the attention op.
As in the guide, the text encoder is bidirectional and reads the last position's state."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import check_input, layer_norm
from .linear import Linear
from .transformer import TransformerEncoderLayer
from .vision import PatchEmbedding

__all__ = ["CLIPVisionEncoder", "CLIPTextEncoder", "CLIP", "clip_contrastive_loss"]


class _CLIPTower(nn.Module):
    """Guide 000's encoder layers + final norm + projection; the embedding of one position, L2-normalised."""

    def __init__(self, embed_dim: int, depth: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.blocks = nn.ModuleList(TransformerEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio), 0.1)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.proj = Linear(embed_dim, embed_dim)

    def _encode(self, x: torch.Tensor, position: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.proj(layer_norm(x, self.norm)[:, position]), dim=-1)


class CLIPVisionEncoder(_CLIPTower):
    """ViT image tower. x (B, 3, img_size, img_size) -> L2-normalised [CLS] embedding (B, embed_dim)."""

    def __init__(self, img_size: int = 224, patch_size: int = 32, embed_dim: int = 512, depth: int = 12,
                 num_heads: int = 8, mlp_ratio: float = 4.0):
        super().__init__(embed_dim, depth, num_heads, mlp_ratio)
        self.img_size = img_size
        self.patch_embed = PatchEmbedding(img_size, patch_size, 3, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.n_patches + 1, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("x", x, ndim=4, owner="CLIPVisionEncoder")
        if tuple(x.shape[1:]) != (3, self.img_size, self.img_size):
            raise ValueError(f"CLIPVisionEncoder: argument 'x' must be (B, 3, {self.img_size}, {self.img_size}), "
                             f"got {tuple(x.shape)}")
        x = self.patch_embed(x)
        return self._encode(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed, 0)


class CLIPTextEncoder(_CLIPTower):
    """Transformer text tower. text (B, context_length) ids -> L2-normalised last-position embedding
    (B, embed_dim)."""

    def __init__(self, vocab_size: int = 49408, embed_dim: int = 512, context_length: int = 77, depth: int = 12,
                 num_heads: int = 8, mlp_ratio: float = 4.0):
        super().__init__(embed_dim, depth, num_heads, mlp_ratio)
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.pos_embedding = nn.Parameter(torch.zeros(1, context_length, embed_dim))

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        check_input("text", text, ndim=2, integer=True, owner="CLIPTextEncoder")
        if text.shape[1] != self.context_length:
            raise ValueError(f"CLIPTextEncoder: argument 'text' must be (B, {self.context_length}), "
                             f"got {tuple(text.shape)}")
        return self._encode(self.token_embedding(text) + self.pos_embedding, -1)


def clip_contrastive_loss(logits_per_image: torch.Tensor, logits_per_text: torch.Tensor) -> torch.Tensor:
    """Symmetric cross-entropy with the matching pairs on the diagonal; logits (B, B)."""
    labels = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


class CLIP(nn.Module):
    """forward(image (B, 3, 224, 224), text (B, 77)) -> (logits_per_image (B, B), logits_per_text (B, B))."""

    def __init__(self, embed_dim: int = 512, vision_depth: int = 12, text_depth: int = 12, vision_heads: int = 8,
                 text_heads: int = 8, vocab_size: int = 49408, img_size: int = 224, patch_size: int = 32,
                 context_length: int = 77):
        super().__init__()
        self.vision_encoder = CLIPVisionEncoder(img_size=img_size, patch_size=patch_size, embed_dim=embed_dim,
                                                depth=vision_depth, num_heads=vision_heads)
        self.text_encoder = CLIPTextEncoder(vocab_size=vocab_size, embed_dim=embed_dim, context_length=context_length,
                                            depth=text_depth, num_heads=text_heads)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        return self.vision_encoder(image)

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(text)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img, txt = self.encode_image(image), self.encode_text(text)
        logits_per_image = self.logit_scale.exp() * img @ txt.t()
        return logits_per_image, logits_per_image.t()

    def contrastive_loss(self, logits_per_image: torch.Tensor, logits_per_text: torch.Tensor) -> torch.Tensor:
        return clip_contrastive_loss(logits_per_image, logits_per_text)
