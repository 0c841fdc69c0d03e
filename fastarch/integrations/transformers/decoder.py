"""The decode step of the Llama-family decoder layers and GPT-2's block on :func:`fastarch.ops.decoder_qkv_step`
and :func:`fastarch.ops.decoder_out_step`: one token per sequence, two fused calls per layer around transformers'
own cache write.

A layer's forward runs the fused step when every condition below holds, and its original forward otherwise
(prefill, training, other dtypes or devices, padding, other caches or attention implementations):

- autograd is off, nothing is being compiled, the module is in eval mode;
- the hidden states are CPU fp32 or bf16 ``(batch, 1, hidden)`` (the weights and the cache in the same dtype);
- the model's attention implementation is fastarch's (``model.set_attn_implementation("fastarch")`` after
  :func:`~fastarch.integrations.transformers.register`), and the mask is its compact causal or sliding-window
  mask without padded keys;
- the cache is a ``DynamicCache`` (written with its own ``update``);
- the layer is its family's plain structure: for the Llama family ``nn.Linear`` projections, the family's RMS
  norms, a SiLU-gated MLP without biases, cos/sin tables whose halves repeat (rotate-half rotary, full or
  partial), no tensor parallelism (``pretraining_tp`` 1); for GPT-2 self-attention only, ``nn.LayerNorm`` norms,
  ``Conv1D`` projections and a GELU-tanh MLP."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import activations as _activations
from transformers.cache_utils import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from ...ops.decoder_layer_step import decoder_out_step, decoder_qkv_step
from .attention import CompactMask, attention_forward
from .llama import _SILU_TYPES, _rotary_tables

__all__ = ["DECODER_LAYERS", "GPT2_BLOCKS"]

# (modeling module, decoder layer class, RMS norm class): the families whose decoder layer is Llama's (pre-norm
# attention and SwiGLU MLP with residuals; Phi-3's residual dropouts are identities in eval mode).
DECODER_LAYERS: tuple[tuple[str, str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm"),
    ("transformers.models.phi3.modeling_phi3", "Phi3DecoderLayer", "Phi3RMSNorm"),
)

# GPT-2's block (``GPT2Block``: layer norms, ``Conv1D`` weights kept ``(in, out)``, a GELU-tanh MLP, no rotary).
GPT2_BLOCKS: tuple[tuple[str, str], ...] = (("transformers.models.gpt2.modeling_gpt2", "GPT2Block"),)

# The keyword arguments transformers passes a decoder layer in a decode step; anything else (packed-sequence
# offsets, attention outputs, ...) takes the original forward.
_KNOWN_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                           "cache_position", "position_embeddings", "output_attentions", "encoder_hidden_states",
                           "encoder_attention_mask"})
# transformers' GELU-tanh activations (GPT-2's "gelu_new", "gelu_pytorch_tanh"), by their public names.
_GELU_TANH_TYPES = tuple(t for t in (getattr(_activations, n, None) for n in ("NewGELUActivation", "GELUTanh",
                                                                          "PytorchGELUTanh")) if t is not None)


@dataclass(frozen=True)
class _Weights:
    """What the two halves take from a layer (see :func:`fastarch.ops.decoder_qkv_step` and
    :func:`~fastarch.ops.decoder_out_step`)."""

    norm1: torch.Tensor
    norm1_b: torch.Tensor | None
    eps1: float
    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    q_b: torch.Tensor | None
    k_b: torch.Tensor | None
    v_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    head_eps: float
    H: int
    Hk: int
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    norm2: torch.Tensor
    norm2_b: torch.Tensor | None
    eps2: float
    gate: torch.Tensor | None
    up: torch.Tensor
    up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None


def _rms(module: nn.Module | None, norm_cls: type) -> tuple[torch.Tensor, float] | None:
    if type(module) is not norm_cls:
        return None
    return module.weight, float(module.variance_epsilon)


def _linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _llama_weights(layer: nn.Module, norm_cls: type) -> _Weights | None:
    """A Llama-family layer's weights, or None when the layer is not the plain structure."""
    attn, mlp = layer.self_attn, layer.mlp
    n1, n2 = _rms(layer.input_layernorm, norm_cls), _rms(layer.post_attention_layernorm, norm_cls)
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
        qn, kn = _rms(getattr(attn, "q_norm", None), norm_cls), _rms(getattr(attn, "k_norm", None), norm_cls)
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
    return _Weights(n1[0], None, n1[1], q_w, k_w, v_w, q_b, k_b, v_b, q_norm, k_norm, head_eps, H, Hk,
                    attn.o_proj.weight, attn.o_proj.bias, n2[0], None, n2[1], gate, up, None, mlp.down_proj.weight,
                    None)


def _layer_norm(module: nn.Module) -> bool:
    return (type(module) is nn.LayerNorm and module.weight is not None and module.bias is not None
            and len(module.normalized_shape) == 1)


def _gpt2_weights(block: nn.Module) -> _Weights | None:
    """A GPT-2 block's weights (its ``Conv1D`` weights transposed, read in place), or None when the block is not
    the plain structure (cross-attention, other activations or modules)."""
    attn, mlp = block.attn, block.mlp
    convs = (getattr(attn, "c_attn", None), getattr(attn, "c_proj", None), getattr(mlp, "c_fc", None),
             getattr(mlp, "c_proj", None))
    if (getattr(attn, "is_cross_attention", False) or not _layer_norm(block.ln_1) or not _layer_norm(block.ln_2)
            or not all(type(c) is Conv1D for c in convs) or not isinstance(getattr(mlp, "act", None),
                                                                         _GELU_TANH_TYPES)):
        return None
    d, H, D = attn.embed_dim, attn.num_heads, attn.head_dim
    w, b = attn.c_attn.weight, attn.c_attn.bias
    if tuple(w.shape) != (d, 3 * H * D):
        return None
    qkv = [w[:, i * H * D:(i + 1) * H * D].t() for i in range(3)]
    bias = b.split(H * D)
    return _Weights(block.ln_1.weight, block.ln_1.bias, float(block.ln_1.eps), *qkv, *bias, None, None, 1e-6, H, H,
                    attn.c_proj.weight.t(), attn.c_proj.bias, block.ln_2.weight, block.ln_2.bias,
                    float(block.ln_2.eps), None, mlp.c_fc.weight.t(), mlp.c_fc.bias, mlp.c_proj.weight.t(),
                    mlp.c_proj.bias)


def _structure(layer: nn.Module) -> list[tuple[dict, str, object]]:
    """Every ``(parent's registry, name, member)`` of ``layer``'s submodules and parameters: what the cached
    weights were taken from."""
    out: list[tuple[dict, str, object]] = []
    for module in layer.modules():
        out += [(module._modules, name, child) for name, child in module._modules.items()]
        out += [(module._parameters, name, param) for name, param in module._parameters.items()]
    return out


_CACHE_ATTR = "_fastarch_decode_weights"


def _layer_weights(layer: nn.Module, build: Callable[[], _Weights | None]) -> _Weights | None:
    """``build()``, kept on the layer while none of its submodules or parameters has been replaced (in-place
    updates, such as ``load_state_dict``, reach the kept views; a replaced module or parameter rebuilds)."""
    kept = layer.__dict__.get(_CACHE_ATTR)
    if kept is not None and all(registry.get(name) is member for registry, name, member in kept[1]):
        return kept[0]
    weights = build()
    layer.__dict__[_CACHE_ATTR] = (weights, _structure(layer))
    return weights


def _step(attn: nn.Module, hidden: torch.Tensor, kwargs: dict, weights: Callable[[], _Weights | None],
          rotary: bool) -> torch.Tensor | None:
    """The fused decode step of a layer whose attention module is ``attn``, or None when the call is not one it
    takes (``weights`` gives the layer's weights)."""
    if not kwargs.keys() <= _KNOWN_KWARGS or kwargs.get("output_attentions") \
            or kwargs.get("encoder_hidden_states") is not None:
        return None
    if ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation) is not attention_forward:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    mask = kwargs.get("attention_mask")
    if not isinstance(cache, DynamicCache):
        return None
    if not (isinstance(mask, CompactMask) and mask.key_padding_mask is None and mask.window[1] == 0):
        return None
    cos = sin = None
    if rotary:
        pe = kwargs.get("position_embeddings")
        if not isinstance(pe, tuple) or len(pe) != 2:
            return None
        cos, sin = pe
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dtype == hidden.dtype
                and cos.dim() == 3 and cos.shape == sin.shape and cos.shape[1] == 1 and cos.shape[2] % 2 == 0
                and cos.device.type == "cpu" and cos.shape[0] in (1, hidden.shape[0])
                and cos.shape[2] <= attn.head_dim):
            return None
    w = weights()
    if w is None:
        return None
    if rotary:
        tables = _rotary_tables(cos, sin)
        if tables is None:
            return None
        cos, sin = tables[0][:, 0], tables[1][:, 0]
    x = hidden[:, 0]
    q, k, v = decoder_qkv_step(x, w.norm1, w.q_w, w.k_w, w.v_w, w.q_b, w.k_b, w.v_b, cos, sin, w.H, w.Hk, w.eps1,
                               w.q_norm, w.k_norm, w.head_eps, w.norm1_b)
    key, value = cache.update(k[:, :, None], v[:, :, None], attn.layer_idx)
    n, left = mask.key_length, mask.window[0]
    if n > key.shape[2]:
        raise ValueError(f"fastarch attention: the mask covers {n} keys but key has {key.shape[2]}")
    out = decoder_out_step(q, key, value, x, w.o_w, w.o_b, w.norm2, w.gate, w.up, w.down, n, left,
                           float(attn.scaling), w.eps2, w.norm2_b, w.up_b, w.down_b)
    return out[:, None]


# The dtypes the fused step takes (the model's weights, cache and hidden states all in one of them).
_STEP_DTYPES = (torch.float32, torch.bfloat16)


def _decodes(layer: nn.Module, hidden_states) -> bool:
    """Could this call be a fused decode step (before the layer's own conditions)?"""
    return (not torch.is_grad_enabled() and not layer.training and isinstance(hidden_states, torch.Tensor)
            and hidden_states.dtype in _STEP_DTYPES and hidden_states.device.type == "cpu"
            and hidden_states.dim() == 3 and hidden_states.shape[1] == 1 and not torch.compiler.is_compiling())


def _decoder_layer_forward(original: Callable, norm_cls_name: str) -> Callable:
    """A Llama-family decoder layer's forward that runs the fused decode step when it can (see the module's
    docstring) and ``original`` otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if not args and _decodes(self, hidden_states):
            norm_cls = getattr(sys.modules[type(self).__module__], norm_cls_name, None)
            if norm_cls is not None:
                out = _step(self.self_attn, hidden_states, kwargs,
                            lambda: _layer_weights(self, lambda: _llama_weights(self, norm_cls)), True)
                if out is not None:
                    return out
        return original(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


def _gpt2_block_forward(original: Callable) -> Callable:
    """GPT-2's block forward with the fused decode step. transformers passes the cache, the mask and the encoder
    states positionally: they are named from the original forward's own signature."""
    names = tuple(inspect.signature(original).parameters)[2:]

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if len(args) <= len(names) and _decodes(self, hidden_states):
            named = dict(zip(names, args))
            if not named.keys() & kwargs.keys():
                out = _step(self.attn, hidden_states, {**kwargs, **named},
                            lambda: _layer_weights(self, lambda: _gpt2_weights(self)), False)
                if out is not None:
                    return out
        return original(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward
