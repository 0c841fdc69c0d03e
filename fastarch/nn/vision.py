"""Vision Transformers, drop-in: guide 000's ``PatchEmbedding``/``VisionTransformer`` (blocks are guide 000's
``TransformerEncoderLayer``) and ``ViT``/``ViTPatchEmbedding`` (guide 001's ``VisionTransformer`` and
``PatchEmbedding``, aliases ``VisionTransformer001``/``PatchEmbedding001``: blocks are guide 001's
``TransformerBlock``). ``vit_b_16`` is ``ViT`` at ViT-B/16, 86,567,656 parameters as torchvision's.
``PreNormViT`` is Hugging Face's ViT (pre-norm blocks, configurable epsilon, ``interpolate_pos_encoding``).
Attention runs on ``fastarch.ops.attention``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._models_common import check_input, layer_norm
from .gpt import GPTBlock
from .linear import Linear
from .transformer import TransformerBlock, TransformerEncoderLayer

__all__ = ["PatchEmbedding", "VisionTransformer", "ViTPatchEmbedding", "ViT", "PreNormViT", "PatchEmbedding001",
           "VisionTransformer001"]


class PatchEmbedding(nn.Module):
    """Non-overlapping P x P patches -> embed_dim via a strided conv (guide 000: key ``proj``, attribute
    ``n_patches``). x (B, C, H, W) -> (B, (H/P)(W/P), embed_dim)."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768):
        super().__init__()
        self.img_size, self.patch_size = img_size, patch_size
        self.n_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ViTPatchEmbedding(PatchEmbedding):
    """Guide 001's ``PatchEmbedding``: the same layer with key ``projection`` and attributes ``image_size``,
    ``num_patches``."""

    def __init__(self, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768):
        super().__init__(image_size, patch_size, in_channels, embed_dim)
        self.image_size, self.num_patches = image_size, self.n_patches
        self.projection = self._modules.pop("proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x).flatten(2).transpose(1, 2)


class _ClassTokenViT(nn.Module):
    """Patches + [CLS] + learned positions, a block stack (attribute ``blocks_attr``), a final norm and a
    linear head on [CLS]. forward(x (B, C, S, S)) -> logits (B, num_classes)."""

    blocks_attr = "blocks"

    def __init__(self, in_channels: int, size: int, patch_embed: PatchEmbedding, embed_dim: int,
                 num_classes: int, dropout: float, blocks: nn.ModuleList):
        super().__init__()
        self.in_channels, self.size = in_channels, size
        self.patch_embed = patch_embed
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patch_embed.n_patches + 1, embed_dim))
        self.dropout = nn.Dropout(dropout)
        setattr(self, self.blocks_attr, blocks)
        self.norm = nn.LayerNorm(embed_dim)
        self.head = Linear(embed_dim, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised token states (B, 1 + n_patches, embed_dim)."""
        check_input("x", x, ndim=4, owner=type(self).__name__)
        c, s = self.in_channels, self.size
        if tuple(x.shape[1:]) != (c, s, s):
            raise ValueError(f"{type(self).__name__}: argument 'x' must be (B, {c}, {s}, {s}), got {tuple(x.shape)}")
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.dropout(x + self.pos_embed)
        for block in getattr(self, self.blocks_attr):
            x = block(x)
        return layer_norm(x, self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x)[:, 0])


class VisionTransformer(_ClassTokenViT):
    """ViT of guide 000: ``TransformerEncoderLayer`` blocks (``blocks``), positions and [CLS] initialised with
    a truncated normal. x (B, C, img_size, img_size) -> logits (B, num_classes)."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 dropout: float = 0.1):
        ff = int(embed_dim * mlp_ratio)
        super().__init__(in_channels, img_size, PatchEmbedding(img_size, patch_size, in_channels, embed_dim),
                         embed_dim, num_classes, dropout,
                         nn.ModuleList(TransformerEncoderLayer(embed_dim, num_heads, ff, dropout) for _ in range(depth)))
        self.img_size = img_size
        self.pos_drop = self.dropout  # the guide's attribute name
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)


class ViT(_ClassTokenViT):
    """Guide 001's ``VisionTransformer`` (alias ``VisionTransformer001``): post-norm ``TransformerBlock``
    encoder (``encoder``), positions and [CLS] drawn from a standard normal. x (B, C, image_size, image_size)
    -> logits (B, num_classes)."""

    blocks_attr = "encoder"

    def __init__(self, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, num_heads: int = 12, num_layers: int = 12, ff_dim: int = 3072,
                 dropout: float = 0.1):
        super().__init__(in_channels, image_size, ViTPatchEmbedding(image_size, patch_size, in_channels, embed_dim),
                         embed_dim, num_classes, dropout,
                         nn.ModuleList(TransformerBlock(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers)))
        self.image_size = image_size
        nn.init.normal_(self.cls_token)
        nn.init.normal_(self.pos_embed)


class PreNormViT(_ClassTokenViT):
    """Hugging Face's ``ViTForImageClassification`` layout: pre-norm blocks (``GPTBlock`` run bidirectionally:
    x += attn(norm1(x)); x += ffn(norm2(x))), every LayerNorm at ``layer_norm_eps``, a final norm and a head on
    [CLS] (``num_classes=0``: no head, forward returns the normalised [CLS] state).

    forward(x (B, C, H, W), interpolate_pos_encoding=False) -> (B, num_classes). Without interpolation H = W =
    ``image_size``; with it any multiple of ``patch_size`` works: the patch position table is resized
    bicubically, as Hugging Face's ViT does.
    """

    def __init__(self, image_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, num_heads: int = 12, num_layers: int = 12, ff_dim: int = 3072,
                 dropout: float = 0.0, layer_norm_eps: float = 1e-12, activation: str = "gelu"):
        blocks = nn.ModuleList(GPTBlock(embed_dim, num_heads, ff_dim, dropout, activation=activation,
                                        layer_norm_eps=layer_norm_eps) for _ in range(num_layers))
        super().__init__(in_channels, image_size, ViTPatchEmbedding(image_size, patch_size, in_channels, embed_dim),
                         embed_dim, max(num_classes, 1), dropout, blocks)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        if num_classes == 0:
            self.head = nn.Identity()
        self.image_size, self.patch_size, self.num_classes = image_size, patch_size, num_classes
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def _positions(self, height: int, width: int) -> torch.Tensor:
        n = self.pos_embed.shape[1] - 1
        h, w = height // self.patch_size, width // self.patch_size
        if h * w == n and height == width:
            return self.pos_embed
        side = int(round(n ** 0.5))
        grid = self.pos_embed[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        grid = nn.functional.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return torch.cat([self.pos_embed[:, :1], grid.permute(0, 2, 3, 1).reshape(1, h * w, -1)], dim=1)

    def forward_features(self, x: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        """Normalised token states (B, 1 + n_patches, embed_dim)."""
        check_input("x", x, ndim=4, owner="PreNormViT")
        c, s, p = self.in_channels, self.size, self.patch_size
        if x.shape[1] != c:
            raise ValueError(f"PreNormViT: argument 'x' must have {c} channels, got shape {tuple(x.shape)}")
        if not interpolate_pos_encoding and tuple(x.shape[2:]) != (s, s):
            raise ValueError(f"PreNormViT: argument 'x' must be (B, {c}, {s}, {s}) without interpolate_pos_encoding, "
                             f"got {tuple(x.shape)}")
        if x.shape[2] % p or x.shape[3] % p:
            raise ValueError(f"PreNormViT: image sides must be multiples of patch_size {p}, got {tuple(x.shape)}")
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], dim=1)
        tokens = self.dropout(tokens + self._positions(x.shape[2], x.shape[3]))
        for block in self.blocks:
            tokens = block(tokens, causal=False)
        return layer_norm(tokens, self.norm)

    def forward(self, x: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        return self.head(self.forward_features(x, interpolate_pos_encoding)[:, 0])


PatchEmbedding001 = ViTPatchEmbedding
VisionTransformer001 = ViT
