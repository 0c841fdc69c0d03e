"""Vision Transformers, drop-in: guide 000's ``PatchEmbedding``/``VisionTransformer`` (blocks are guide 000's
``TransformerEncoderLayer``) and guide 001's variants ``PatchEmbedding001``/``VisionTransformer001`` (blocks
are guide 001's ``TransformerBlock``; the names without suffix belong to guide 000). ``vit_b_16`` is the
001 variant at ViT-B/16, 86,567,656 parameters as torchvision's. Attention runs on ``fastarch.ops.attention``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._models_common import check_input, layer_norm
from .transformer import TransformerBlock, TransformerEncoderLayer

__all__ = ["PatchEmbedding", "VisionTransformer", "PatchEmbedding001", "VisionTransformer001"]


def _check_img(x: object, channels: int, size: int, owner: str) -> torch.Tensor:
    check_input("x", x, ndim=4, owner=owner)
    assert isinstance(x, torch.Tensor)
    if x.shape[1] != channels or x.shape[2] != size or x.shape[3] != size:
        raise ValueError(f"{owner}: argument 'x' must be (B, {channels}, {size}, {size}), got {tuple(x.shape)}")
    return x


class PatchEmbedding(nn.Module):
    """Non-overlapping P x P patches -> embed_dim via a strided conv (guide 000).
    x (B, C, H, W) -> (B, (H/P)(W/P), embed_dim)."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768):
        super().__init__()
        self.img_size, self.patch_size = img_size, patch_size
        self.n_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    """ViT of guide 000: patches + [CLS] + learned positions, ``TransformerEncoderLayer`` blocks, final norm,
    linear head on [CLS]. x (B, C, img_size, img_size) -> logits (B, num_classes)."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 dropout: float = 0.1):
        super().__init__()
        self.in_channels, self.img_size = in_channels, img_size
        self.patch_embed = PatchEmbedding(img_size, patch_size, in_channels, embed_dim)
        n = self.patch_embed.n_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TransformerEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio), dropout)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised token states (B, 1 + n_patches, embed_dim)."""
        _check_img(x, self.in_channels, self.img_size, type(self).__name__)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return layer_norm(x, self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)[:, 0])


class PatchEmbedding001(nn.Module):
    """Guide 001's ``PatchEmbedding`` (key ``projection``; attribute ``num_patches``)."""

    def __init__(self, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768):
        super().__init__()
        self.image_size, self.patch_size = image_size, patch_size
        self.num_patches = (image_size // patch_size) ** 2
        self.projection = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x).flatten(2).transpose(1, 2)


class VisionTransformer001(nn.Module):
    """Guide 001's ``VisionTransformer`` (post-norm ``TransformerBlock`` encoder).
    x (B, C, image_size, image_size) -> logits (B, num_classes)."""

    def __init__(self, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, num_heads: int = 12, num_layers: int = 12, ff_dim: int = 3072,
                 dropout: float = 0.1):
        super().__init__()
        self.in_channels, self.image_size = in_channels, image_size
        self.patch_embed = PatchEmbedding001(image_size, patch_size, in_channels, embed_dim)
        n = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, embed_dim))
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(TransformerBlock(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_img(x, self.in_channels, self.image_size, "VisionTransformer001")
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.dropout(x + self.pos_embed)
        for block in self.encoder:
            x = block(x)
        return self.head(layer_norm(x, self.norm)[:, 0])
