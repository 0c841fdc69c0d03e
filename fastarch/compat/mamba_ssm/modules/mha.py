"""``mamba_ssm.modules.mha``: mamba-ssm's ``MHA`` (self-attention with GQA, an optional depthwise causal conv over
the QKV projection, rotary embeddings and a parallel gated-MLP branch) and its inference cache, on fastarch's
ops (:func:`fastarch.ops.attention`, :func:`fastarch.ops.rotary_embedding`, :func:`fastarch.ops.causal_conv1d`).

``MHA(embed_dim, num_heads, num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True, out_proj_bias=True,
softmax_scale=None, causal=False, layer_idx=None, d_conv=0, rotary_emb_dim=0, rotary_emb_base=10000.0,
rotary_emb_interleaved=False)``; keys ``in_proj.*``, ``conv1d.*`` (``d_conv > 0``), ``out_proj.*``.
``forward(x (B, L, embed_dim), inference_params=None) -> (B, L, embed_dim)``. With ``inference_params`` the layer
keeps ``(kv_cache (B, max_seqlen, 2, num_heads_kv, head_dim), conv_state (B, qkv_dim, d_conv) or None)`` in
``key_value_memory_dict[layer_idx]``: the prompt's keys and values are written at ``seqlen_offset`` and the
queries attend to every cached position (bottom-right causal when ``causal``). Differences: the conv state holds
the conv's last inputs, so a decode step continues the prompt's convolution exactly; ``lengths_per_sample``
(per-sequence offsets, used by CUDA-graph decoding) is not supported and raises.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.nn.linear import Linear
from fastarch.ops.attention import attention
from fastarch.ops.causal_conv1d import causal_conv1d, causal_conv1d_update
from fastarch.ops.rotary import rotary_cos_sin, rotary_embedding

from ..._missing import missing_attribute

__all__ = ["MHA"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mha")


class MHA(nn.Module):
    """mamba-ssm's ``MHA`` (see the module docstring)."""

    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: int | None = None, head_dim: int | None = None,
                 mlp_dim: int = 0, qkv_proj_bias: bool = True, out_proj_bias: bool = True,
                 softmax_scale: float | None = None, causal: bool = False, layer_idx: int | None = None,
                 d_conv: int = 0, rotary_emb_dim: int = 0, rotary_emb_base: float = 10000.0,
                 rotary_emb_interleaved: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.embed_dim, self.layer_idx, self.d_conv = embed_dim, layer_idx, d_conv
        self.rotary_emb_dim, self.softmax_scale, self.causal = rotary_emb_dim, softmax_scale, causal
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if num_heads % self.num_heads_kv != 0:
            raise ValueError(f"MHA: num_heads ({num_heads}) must be divisible by num_heads_kv ({self.num_heads_kv})")
        if head_dim is None and embed_dim % num_heads != 0:
            raise ValueError(f"MHA: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.head_dim = head_dim if head_dim is not None else embed_dim // num_heads
        if rotary_emb_dim % 2 != 0 or rotary_emb_dim > self.head_dim:
            raise ValueError(f"MHA: rotary_emb_dim must be even and <= head_dim ({self.head_dim}), got {rotary_emb_dim}")
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        self.rotary_emb_base, self.rotary_emb_interleaved = rotary_emb_base, rotary_emb_interleaved
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        out_dim = self.head_dim * self.num_heads
        self.in_proj = Linear(embed_dim, qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **fk)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(qkv_dim, qkv_dim, kernel_size=d_conv, padding=d_conv - 1, groups=qkv_dim, **fk)
        self.out_proj = Linear(out_dim + self.mlp_dim // 2, embed_dim, bias=out_proj_bias, **fk)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs
                                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(kv_cache (batch, max_seqlen, 2, num_heads_kv, head_dim), conv_state (batch, qkv_dim, d_conv) or
        None)``, in ``dtype`` (default: ``out_proj``'s)."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        device = self.out_proj.weight.device
        conv_state = None
        if self.d_conv > 0:
            conv_state = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device, dtype=dtype)
        kv_cache = torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, dtype=dtype,
                               device=device)
        return kv_cache, conv_state

    def _cos_sin(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rotary is None or self._rotary[0].shape[0] < length or self._rotary[0].device != device:
            self._rotary = rotary_cos_sin(max(length, 16), self.rotary_emb_dim, self.rotary_emb_base, device=device)
        return self._rotary

    def _conv(self, qkv: torch.Tensor, inference_params, offset: int) -> torch.Tensor:
        weight = self.conv1d.weight.squeeze(1)
        if inference_params is None or offset == 0:
            xt = qkv.transpose(1, 2)
            if inference_params is not None:
                _, conv_state = inference_params.key_value_memory_dict[self.layer_idx]
                conv_state.copy_(F.pad(xt, (self.d_conv - xt.shape[-1], 0)))
            return causal_conv1d(xt, weight, self.conv1d.bias).transpose(1, 2)
        if qkv.shape[1] != 1:
            raise ValueError(f"MHA: a decode step takes one token at a time, got {qkv.shape[1]}")
        _, conv_state = inference_params.key_value_memory_dict[self.layer_idx]
        return causal_conv1d_update(qkv[:, 0], conv_state, weight, self.conv1d.bias).unsqueeze(1)

    def forward(self, x: torch.Tensor, inference_params=None) -> torch.Tensor:
        """x: ``(batch, L, embed_dim)`` -> ``(batch, L, embed_dim)``."""
        offset = 0
        if inference_params is not None:
            if self.layer_idx is None:
                raise ValueError("MHA: decoding with inference_params needs the layer's 'layer_idx'")
            if inference_params.lengths_per_sample is not None:
                raise NotImplementedError("MHA: inference_params.lengths_per_sample (per-sequence offsets) is not "
                                          "supported; leave it None")
            if self.layer_idx not in inference_params.key_value_memory_dict:
                inference_params.key_value_memory_dict[self.layer_idx] = self.allocate_inference_cache(
                    x.shape[0], inference_params.max_seqlen, dtype=x.dtype)
            offset = inference_params.seqlen_offset
        qkv = self.in_proj(x)
        if self.mlp_dim > 0:
            qkv, x_mlp = qkv.split([qkv.shape[-1] - self.mlp_dim, self.mlp_dim], dim=-1)
            up, gate = x_mlp.chunk(2, dim=-1)
            x_mlp = up * F.silu(gate)
        if self.d_conv > 0:
            qkv = self._conv(qkv, inference_params, offset)
        b, L = qkv.shape[:2]
        q, kv = qkv.split([self.num_heads * self.head_dim, self.num_heads_kv * 2 * self.head_dim], dim=-1)
        q = q.reshape(b, L, self.num_heads, self.head_dim)
        kv = kv.reshape(b, L, 2, self.num_heads_kv, self.head_dim)
        k, v = kv.unbind(dim=2)
        if self.rotary_emb_dim > 0:
            cos, sin = self._cos_sin(offset + L, q.device)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q = rotary_embedding(q.contiguous(), cos, sin, self.rotary_emb_interleaved, seqlen_offset=offset)
            k = rotary_embedding(k.contiguous(), cos, sin, self.rotary_emb_interleaved, seqlen_offset=offset)
        if inference_params is not None:
            kv_cache, _ = inference_params.key_value_memory_dict[self.layer_idx]
            start = inference_params.batch_size_offset
            if start + b > kv_cache.shape[0] or offset + L > kv_cache.shape[1]:
                raise ValueError(f"MHA: the kv cache {tuple(kv_cache.shape[:2])} cannot take batch rows "
                                 f"[{start}, {start + b}) at positions [{offset}, {offset + L})")
            kv_cache[start:start + b, offset:offset + L, 0] = k
            kv_cache[start:start + b, offset:offset + L, 1] = v
            k = kv_cache[start:start + b, :offset + L, 0]
            v = kv_cache[start:start + b, :offset + L, 1]
        context = attention(q, k.to(q.dtype), v.to(q.dtype), causal=self.causal, scale=self.softmax_scale,
                            layout="blhd")
        context = context.reshape(b, L, self.num_heads * self.head_dim)
        if self.mlp_dim > 0:
            context = torch.cat([context, x_mlp], dim=-1)
        return self.out_proj(context)
