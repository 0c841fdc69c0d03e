"""The Llama family: ``apply_rotary_pos_emb`` on :func:`fastarch.ops.rotary_embedding` and the MLPs with the SiLU
and the product in place (the norms are in :mod:`.norms`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from transformers import activations as _activations

from ...ops.rotary import rotary_embedding as _rotary_embedding
from .norms import _NATIVE_DTYPES

__all__ = ["LLAMA_MLPS", "LLAMA_MODULES"]

# -- Llama-family norms and rotary embedding ----------------------------------------------------------------
# (modeling module, RMSNorm class) of the models whose norm forward is Llama's (``weight * x * rsqrt(mean(x^2) +
# eps)``, computed in fp32) and whose module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` and
# ``rotate_half`` are Llama's (non-interleaved halves over the whole head). Models with a ``(1 + weight)`` norm
# (Gemma) or a partial or interleaved rotary (Phi-3, GLM, ...) are not listed.
LLAMA_MODULES: tuple[tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
)


# transformers' "silu" activation (ACT2FN) and torch's.
_SILU_TYPES = tuple({torch.nn.SiLU, getattr(_activations, "SiLUActivation", torch.nn.SiLU)})
# (modeling module, MLP class) of the same models whose MLP forward is Llama's: ``down(act(gate(x)) * up(x))``.
LLAMA_MLPS: tuple[tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaMLP"),
    ("transformers.models.mistral.modeling_mistral", "MistralMLP"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
)


def _swiglu_mlp_forward(original: Callable) -> Callable:
    """Llama's MLP with the SiLU and the product done in place in the gate projection's output, for CPU input
    with autograd off: two fewer ``(..., intermediate)`` temporaries per call, the same values. Other
    activations, autograd, other devices and tracing run ``original``."""

    @functools.wraps(original)
    def forward(self, x):
        if (torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.device.type != "cpu"
                or not isinstance(self.act_fn, _SILU_TYPES) or torch.compiler.is_compiling()):
            return original(self, x)
        h = self.gate_proj(x)
        torch.nn.functional.silu(h, inplace=True)
        h.mul_(self.up_proj(x))
        return self.down_proj(h)

    forward.__fastarch_original__ = original
    return forward


# The last cos/sin pair seen and its tables: every layer of a forward gets the same two tensors, so the tables
# (and the check that the halves repeat) are made once per forward, not once per layer. Weak references: the
# cache keeps no tensor alive, and a new tensor at a reused address is never taken for the old one.
_LAST_TABLES: list = [None, None, -1, -1, None]  # weakref(cos), weakref(sin), versions, tables


def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' ``(B, L, D)`` cos/sin as fastarch's ``(B, L, D/2)`` tables, contiguous (made once for q
    and k, and once per forward for every layer), or None when the two halves of the last dimension differ
    (then they are not one angle per rotated pair)."""
    last = _LAST_TABLES
    if (last[0] is not None and last[0]() is cos and last[1]() is sin and last[2] == cos._version
            and last[3] == sin._version):
        return last[4]
    tables = _tables_of(cos, sin)
    last[:] = [weakref.ref(cos), weakref.ref(sin), cos._version, sin._version, tables]
    return tables


def _tables_of(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    R = cos.shape[-1] // 2
    c, s = cos[..., :R], sin[..., :R]
    if not (torch.equal(c, cos[..., R:]) and torch.equal(s, sin[..., R:])):
        return None
    return c.contiguous(), s.contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, L, D)`` rotated by per-batch tables ``(1 or B, L, D/2)`` -> ``(B, H, L, D)``.
    transformers' projections are ``(B, L, H, D)`` transposed, so the op reads them without a copy."""
    xt = x.transpose(1, 2)
    if cos.shape[0] == 1:
        out = _rotary_embedding(xt, cos[0], sin[0])
    else:  # per-sequence positions (left padding): one call per sequence
        out = torch.cat([_rotary_embedding(xt[b:b + 1], cos[b], sin[b]) for b in range(x.shape[0])])
    return out.transpose(1, 2)


def _apply_rotary_pos_emb(original: Callable) -> Callable:
    """Llama's ``apply_rotary_pos_emb`` on :func:`fastarch.ops.rotary_embedding` for CPU ``q``/``k``
    ``(B, H, L, D)`` (fp32, bf16 or fp16, cos/sin of the same dtype; computed in fp32, rounded once) and
    constant cos/sin ``(1 or B, L, D)`` broadcast over the heads (``unsqueeze_dim=1``) whose
    halves repeat; every other call (other devices or dtypes, other layouts, cos/sin with a gradient, tracing
    by dynamo) runs ``original``."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        tensors = (q, k, cos, sin)
        if (unsqueeze_dim == 1 and all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                       and t.dtype == q.dtype for t in tensors) and q.dtype in _NATIVE_DTYPES
                and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
                and q.shape[2] == k.shape[2] == cos.shape[1] and q.shape[3] == k.shape[3] == cos.shape[2]
                and cos.shape[2] % 2 == 0 and not (cos.requires_grad or sin.requires_grad)
                and not torch.compiler.is_compiling()):
            tables = _rotary_tables(cos, sin)
            if tables is not None:
                return _rotate(q, *tables), _rotate(k, *tables)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__fastarch_original__ = original
    return apply_rotary_pos_emb
