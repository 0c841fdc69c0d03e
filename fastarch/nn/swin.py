"""Swin Transformer: guide 001's ``WindowAttention`` and ``SwinTransformerBlock`` (drop-in), completed with
what the guide leaves out — the relative position bias, the shifted-window attention mask, padding to whole
windows, ``PatchMerging`` and the full hierarchical ``SwinTransformer`` (``swin_t``: 28,288,354 parameters,
as torchvision's).

Window attention runs through ``fastarch.ops.attention``: the (B * nW) windows of H heads are viewed as B
sequences-of-windows with nW * H "heads", so the bias (relative position bias + shift mask, (nW * H, N, N))
is shared by the whole batch and passed as the op's differentiable ``attn_bias`` without copies per image.

Defaults follow the guide (no bias table, no shift mask: same keys and outputs as its code); the real Swin
is ``relative_position_bias=True, shift_mask=True``, which ``SwinTransformer`` uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.attention import attention
from ._models_common import check_input, layer_norm
from .linear import Linear

__all__ = ["WindowAttention", "SwinTransformerBlock", "PatchMerging", "SwinTransformer", "window_partition",
           "window_reverse"]

# The official Swin masks cross-region pairs of a shifted window with -100 (not -inf).
_SHIFT_MASK_VALUE = -100.0


def window_partition(x: torch.Tensor, window_size: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * nW, ws, ws, C)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window_size, window_size, w // window_size, window_size, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window_size, window_size, c)


def window_reverse(windows: torch.Tensor, window_size: int, H: int, W: int) -> torch.Tensor:
    """(B * nW, ws, ws, C) -> (B, H, W, C)."""
    b = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.reshape(b, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, H, W, -1)


def _pair(ws: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(ws, int):
        return ws, ws
    a, b = ws
    return int(a), int(b)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside each window.

    forward(x (B * nW, N, C), mask (nW, N, N) additive or None) -> (B * nW, N, C), N = Wh * Ww.
    ``relative_position_bias=True`` adds the learned ((2Wh-1)(2Ww-1), heads) table indexed by relative offset.
    """

    def __init__(self, dim: int, window_size: int | Sequence[int], num_heads: int,
                 relative_position_bias: bool = False, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"WindowAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.window_size, self.num_heads = dim, window_size, num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = Linear(dim, dim)
        self.relative_position_bias = relative_position_bias
        if relative_position_bias:
            wh, ww = _pair(window_size)
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
            coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
            rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
            index = (rel[..., 0] + wh - 1) * (2 * ww - 1) + (rel[..., 1] + ww - 1)
            self.register_buffer("relative_position_index", index, persistent=False)

    def bias(self) -> torch.Tensor | None:
        """The relative position bias (1, heads, N, N), or None."""
        if not self.relative_position_bias:
            return None
        n = self.relative_position_index.shape[0]
        table = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        return table.view(n, n, -1).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.dim, owner="WindowAttention")
        bw, n, c = x.shape
        h = self.num_heads
        qkv = self.qkv(x).view(bw, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        bias = self.bias()
        if mask is not None:
            nw = mask.shape[0]
            if mask.shape[1:] != (n, n) or bw % nw:
                raise ValueError(f"WindowAttention: argument 'mask' must be (nW, {n}, {n}) with nW dividing {bw}, "
                                 f"got {tuple(mask.shape)}")
            full = mask[:, None].to(q.dtype) + (bias if bias is not None else 0.0)  # (nW, H, N, N)
            b = bw // nw
            # (B*nW, H, N, D) viewed as (B, nW*H, N, D): one bias per (window, head), shared across the batch.
            o = attention(q.reshape(b, nw * h, n, -1), k.reshape(b, nw * h, n, -1), v.reshape(b, nw * h, n, -1),
                       attn_bias=full.reshape(1, nw * h, n, n), scale=self.scale)
            o = o.view(bw, h, n, -1)
        else:
            o = attention(q, k, v, attn_bias=bias, scale=self.scale)
        return self.proj(o.transpose(1, 2).reshape(bw, n, c))


def _shift_mask(hp: int, wp: int, ws: int, shift: int, device: torch.device) -> torch.Tensor:
    img = torch.zeros(1, hp, wp, 1, device=device)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
        for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    mw = window_partition(img, ws).reshape(-1, ws * ws)
    diff = mw[:, None, :] - mw[:, :, None]
    return torch.zeros_like(diff).masked_fill(diff != 0, _SHIFT_MASK_VALUE)


class SwinTransformerBlock(nn.Module):
    """Pre-norm Swin block: (shifted) window attention + MLP, each with a residual.

    forward(x (B, H*W, dim), H, W) -> (B, H*W, dim). H and W need not be multiples of the window: the map is
    zero-padded to whole windows (after norm1, as the official code) and cropped back.
    """

    def __init__(self, dim: int, num_heads: int, window_size: int = 7, shift_size: int = 0,
                 mlp_ratio: float = 4.0, relative_position_bias: bool = False, shift_mask: bool = False):
        super().__init__()
        if not 0 <= shift_size < window_size:
            raise ValueError(f"SwinTransformerBlock: shift_size must be in [0, window_size), got {shift_size}")
        self.dim, self.num_heads, self.window_size, self.shift_size = dim, num_heads, window_size, shift_size
        self.shift_mask = shift_mask
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window_size, num_heads, relative_position_bias=relative_position_bias)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(Linear(dim, hidden), nn.GELU(), Linear(hidden, dim))

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.dim, owner="SwinTransformerBlock")
        b, n, c = x.shape
        if n != H * W:
            raise ValueError(f"SwinTransformerBlock: input feature has wrong size: L={n} but H*W={H * W}")
        ws = self.window_size
        shift = self.shift_size if (H > ws or W > ws) else 0  # one window covers the map: nothing to shift
        shortcut = x
        x = layer_norm(x, self.norm1).view(b, H, W, c)
        ph, pw = (-H) % ws, (-W) % ws
        if ph or pw:
            x = F.pad(x, (0, 0, 0, pw, 0, ph))
        hp, wp = H + ph, W + pw
        if shift:
            x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
        win = window_partition(x, ws).reshape(-1, ws * ws, c)
        mask = _shift_mask(hp, wp, ws, shift, x.device) if (shift and self.shift_mask) else None
        win = self.attn(win, mask)
        x = window_reverse(win.reshape(-1, ws, ws, c), ws, hp, wp)
        if shift:
            x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
        x = x[:, :H, :W].reshape(b, H * W, c)
        x = shortcut + x
        return x + self.mlp(layer_norm(x, self.norm2))


class PatchMerging(nn.Module):
    """2x2 neighbourhood concat -> LayerNorm(4C) -> Linear(4C, 2C). (B, H*W, C) -> (B, ceil(H/2)*ceil(W/2), 2C)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor, H: int, W: int) -> tuple[torch.Tensor, int, int]:
        b, n, c = x.shape
        x = x.view(b, H, W, c)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        h2, w2 = x.shape[1], x.shape[2]
        x = self.reduction(layer_norm(x.view(b, h2 * w2, 4 * c), self.norm))
        return x, h2, w2


class _SwinPatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(x)
        h, w = x.shape[-2:]
        return layer_norm(x.flatten(2).transpose(1, 2), self.norm), h, w


class SwinTransformer(nn.Module):
    """Hierarchical Swin (Liu et al., 2021): patch embedding, stages of shifted-window blocks with patch
    merging between them, global average pool, linear head. x (B, 3, H, W) -> logits (B, num_classes)."""

    def __init__(self, patch_size: int = 4, in_channels: int = 3, num_classes: int = 1000, embed_dim: int = 96,
                 depths: Sequence[int] = (2, 2, 6, 2), num_heads: Sequence[int] = (3, 6, 12, 24),
                 window_size: int = 7, mlp_ratio: float = 4.0):
        super().__init__()
        if len(depths) != len(num_heads):
            raise ValueError(f"SwinTransformer: 'depths' {list(depths)} and 'num_heads' {list(num_heads)} differ in length")
        self.in_channels = in_channels
        self.patch_embed = _SwinPatchEmbed(patch_size, in_channels, embed_dim)
        self.stages = nn.ModuleList()
        self.merges = nn.ModuleList()
        dim = embed_dim
        for i, (d, h) in enumerate(zip(depths, num_heads)):
            self.stages.append(nn.ModuleList(
                SwinTransformerBlock(dim, h, window_size, 0 if j % 2 == 0 else window_size // 2, mlp_ratio,
                                     relative_position_bias=True, shift_mask=True) for j in range(d)))
            if i < len(depths) - 1:
                self.merges.append(PatchMerging(dim))
                dim *= 2
        self.norm = nn.LayerNorm(dim)
        self.head = Linear(dim, num_classes)
        self.num_features = dim

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        check_input("x", x, ndim=4, owner="SwinTransformer")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"SwinTransformer: argument 'x' must have {self.in_channels} channels, "
                             f"got shape {tuple(x.shape)}")
        x, h, w = self.patch_embed(x)
        for i, stage in enumerate(self.stages):
            for block in stage:
                x = block(x, h, w)
            if i < len(self.merges):
                x, h, w = self.merges[i](x, h, w)
        return layer_norm(x, self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean(1))
