"""The Llama-family decoder layers' decode step on :func:`fastarch.ops.decoder_qkv_step` and
:func:`fastarch.ops.decoder_out_step`: one token per sequence, two fused calls per layer around transformers' own
cache write.

A decoder layer's forward runs the fused step when every condition below holds, and its original forward
otherwise (prefill, training, other dtypes or devices, padding, other caches or attention implementations):

- autograd is off, nothing is being compiled, the module is in eval mode;
- the hidden states are CPU fp32 ``(batch, 1, hidden)``;
- the model's attention implementation is fastarch's (``model.set_attn_implementation("fastarch")`` after
  :func:`~fastarch.integrations.transformers.register`), and the mask is its compact causal or sliding-window
  mask without padded keys;
- the cache is a ``DynamicCache`` (written with its own ``update``);
- the layer is the family's plain structure: ``nn.Linear`` projections, the family's RMS norms, a SiLU-gated MLP
  without biases, cos/sin tables whose halves repeat (rotate-half rotary, full or partial), no tensor
  parallelism (``pretraining_tp`` 1).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...ops.decoder_layer_step import decoder_out_step, decoder_qkv_step
from .attention import CompactMask, attention_forward
from .llama import _SILU_TYPES, _rotary_tables

__all__ = ["DECODER_LAYERS"]

# (modeling module, decoder layer class, RMS norm class): the families whose decoder layer is Llama's (pre-norm
# attention and SwiGLU MLP with residuals; Phi-3's residual dropouts are identities in eval mode).
DECODER_LAYERS: tuple[tuple[str, str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm"),
    ("transformers.models.phi3.modeling_phi3", "Phi3DecoderLayer", "Phi3RMSNorm"),
)

# The keyword arguments transformers passes a decoder layer in a decode step; anything else (packed-sequence
# offsets, attention outputs, ...) takes the original forward.
_KNOWN_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                           "cache_position", "position_embeddings", "output_attentions"})


def _norm(module: nn.Module, norm_cls: type) -> tuple[torch.Tensor, float] | None:
    if type(module) is not norm_cls:
        return None
    return module.weight, float(module.variance_epsilon)


def _linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _weights(layer: nn.Module, norm_cls: type) -> tuple | None:
    """What the two halves take from ``layer``: ``(norm1, eps1, q_w, k_w, v_w, q_b, k_b, v_b, q_norm, k_norm,
    head_eps, H, Hk, o_w, o_b, norm2, eps2, gate, up, down)``, or None when the layer is not the plain
    structure."""
    attn, mlp = layer.self_attn, layer.mlp
    n1, n2 = _norm(layer.input_layernorm, norm_cls), _norm(layer.post_attention_layernorm, norm_cls)
    if n1 is None or n2 is None or getattr(attn.config, "pretraining_tp", 1) != 1:
        return None
    D = attn.head_dim
    if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, rows [q | k | v]
        if not _linear(attn.qkv_proj) or attn.qkv_proj.bias is not None:
            return None
        H, Hk = attn.config.num_attention_heads, attn.config.num_key_value_heads
        w = attn.qkv_proj.weight
        q_w, k_w, v_w = w[: H * D], w[H * D: (H + Hk) * D], w[(H + Hk) * D:]
        q_b = k_b = v_b = None
    else:
        if not (_linear(attn.q_proj) and _linear(attn.k_proj) and _linear(attn.v_proj)):
            return None
        q_w, k_w, v_w = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        q_b, k_b, v_b = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
        H, Hk = q_w.shape[0] // D, k_w.shape[0] // D
    q_norm = k_norm = None
    head_eps = 1e-6
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):  # Qwen3: per-head RMS norms of q and k
        qn, kn = _norm(getattr(attn, "q_norm", None), norm_cls), _norm(getattr(attn, "k_norm", None), norm_cls)
        if qn is None or kn is None or qn[1] != kn[1]:
            return None
        (q_norm, head_eps), (k_norm, _) = qn, kn
    if not _linear(attn.o_proj):
        return None
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: rows [gate | up]
        if not (_linear(mlp.gate_up_proj) and _linear(mlp.down_proj)) or mlp.gate_up_proj.bias is not None \
                or mlp.down_proj.bias is not None or not isinstance(mlp.activation_fn, _SILU_TYPES):
            return None
        I = mlp.gate_up_proj.weight.shape[0] // 2
        gate, up = mlp.gate_up_proj.weight[:I], mlp.gate_up_proj.weight[I:]
    else:
        parts = (getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None))
        if not all(p is not None and _linear(p) and p.bias is None for p in parts) \
                or not isinstance(getattr(mlp, "act_fn", None), _SILU_TYPES):
            return None
        gate, up = parts[0].weight, parts[1].weight
    return (n1[0], n1[1], q_w, k_w, v_w, q_b, k_b, v_b, q_norm, k_norm, head_eps, H, Hk, attn.o_proj.weight,
            attn.o_proj.bias, n2[0], n2[1], gate, up, mlp.down_proj.weight)


def _step(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, norm_cls: type) -> torch.Tensor | None:
    """The fused decode step of ``layer``, or None when the call is not one it takes."""
    if not kwargs.keys() <= _KNOWN_KWARGS or kwargs.get("output_attentions"):
        return None
    attn = layer.self_attn
    if ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation) is not attention_forward:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    pe = kwargs.get("position_embeddings")
    mask = kwargs.get("attention_mask")
    if not isinstance(cache, DynamicCache) or not isinstance(pe, tuple) or len(pe) != 2:
        return None
    if not (isinstance(mask, CompactMask) and mask.key_padding_mask is None and mask.window[1] == 0):
        return None
    cos, sin = pe
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dtype == torch.float32
            and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1] == 1 and cos.shape[2] % 2 == 0
            and cos.device.type == "cpu" and cos.shape[0] in (1, hidden.shape[0])):
        return None
    w = _weights(layer, norm_cls)
    if w is None or cos.shape[2] > attn.head_dim:
        return None
    tables = _rotary_tables(cos, sin)
    if tables is None:
        return None
    (norm1, eps1, q_w, k_w, v_w, q_b, k_b, v_b, q_norm, k_norm, head_eps, H, Hk, o_w, o_b, norm2, eps2, gate, up,
     down) = w
    x = hidden[:, 0]
    q, k, v = decoder_qkv_step(x, norm1, q_w, k_w, v_w, q_b, k_b, v_b, tables[0][:, 0], tables[1][:, 0], H, Hk,
                             eps1, q_norm, k_norm, head_eps)
    key, value = cache.update(k[:, :, None], v[:, :, None], attn.layer_idx)
    n, left = mask.key_length, mask.window[0]
    if n > key.shape[2]:
        raise ValueError(f"fastarch attention: the mask covers {n} keys but key has {key.shape[2]}")
    out = decoder_out_step(q, key, value, x, o_w, o_b, norm2, gate, up, down, n, left, float(attn.scaling), eps2)
    return out[:, None]


def _decoder_layer_forward(original: Callable, norm_cls_name: str) -> Callable:
    """A decoder layer's forward that runs the fused decode step when it can (see the module's docstring) and
    ``original`` otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if (not args and not torch.is_grad_enabled() and not self.training and isinstance(hidden_states, torch.Tensor)
                and hidden_states.dtype == torch.float32 and hidden_states.device.type == "cpu"
                and hidden_states.dim() == 3 and hidden_states.shape[1] == 1 and not torch.compiler.is_compiling()):
            norm_cls = getattr(sys.modules[type(self).__module__], norm_cls_name, None)
            out = _step(self, hidden_states, kwargs, norm_cls) if norm_cls is not None else None
            if out is not None:
                return out
        return original(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward
