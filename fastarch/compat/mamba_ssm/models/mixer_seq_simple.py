"""``mamba_ssm.models.mixer_seq_simple``: mamba-ssm's language model, ``create_block``, ``MixerModel`` and
``MambaLMHeadModel`` (same constructor, ``state_dict`` keys, initialisation and outputs), on the compat modules.

``MambaLMHeadModel(config: MambaConfig)``: ``backbone.embedding`` ``(vocab, d_model)`` (vocabulary padded to
``pad_vocab_size_multiple``), ``backbone.layers.{i}`` (:class:`Block` around ``Mamba`` / ``Mamba2`` per
``ssm_cfg["layer"]``, or ``MHA`` for ``attn_layer_idx``; a ``GatedMLP`` when ``d_intermediate > 0``),
``backbone.norm_f`` and ``lm_head`` (tied to the embedding with ``tie_embeddings``).
``forward(input_ids (B, L), position_ids=None, inference_params=None, num_last_tokens=0)`` returns
``CausalLMOutput(logits (B, L or num_last_tokens, vocab))``; :meth:`generate` is mamba-ssm's decode loop.

``from_pretrained(path)`` reads a local directory (``config.json`` and ``model.safetensors`` or
``pytorch_model.bin``, tensors only); it never loads part of a model: an unknown config field, a missing or
unexpected weight or a shape mismatch raises (a tied ``lm_head.weight`` may be absent from the file).
``save_pretrained(path)`` writes ``config.json`` and ``pytorch_model.bin``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections import namedtuple
from functools import partial

import torch
import torch.nn as nn

from fastarch.nn.linear import Linear
from fastarch.nn.norms import FusedLayerNorm

from ..._missing import missing_attribute
from ..modules.block import Block
from ..modules.mamba2 import Mamba2
from ..modules.mamba_simple import Mamba
from ..modules.mha import MHA
from ..modules.mlp import GatedMLP
from ..ops.triton.layer_norm import RMSNorm, layer_norm_fn
from ..utils.generation import GenerationMixin
from ..utils.hf import load_config_hf, load_state_dict_hf
from .config_mamba import MambaConfig

__all__ = ["MambaLMHeadModel", "MixerModel", "create_block"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.models.mixer_seq_simple")

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


def create_block(d_model: int, d_intermediate: int, ssm_cfg: dict | None = None, attn_layer_idx=None,
                 attn_cfg: dict | None = None, norm_epsilon: float = 1e-5, rms_norm: bool = False,
                 residual_in_fp32: bool = False, fused_add_norm: bool = False, layer_idx: int | None = None,
                 device=None, dtype=None) -> Block:
    """One :class:`Block`: a ``Mamba``/``Mamba2`` mixer (``ssm_cfg["layer"]``, default ``"Mamba1"``) or, for a
    layer in ``attn_layer_idx``, an ``MHA`` from ``attn_cfg``; LayerNorm or RMSNorm; a ``GatedMLP`` of width
    ``d_intermediate`` when it is not 0."""
    attn_layer_idx = attn_layer_idx if attn_layer_idx is not None else []
    attn_cfg = attn_cfg if attn_cfg is not None else {}
    fk = {"device": device, "dtype": dtype}
    if layer_idx not in attn_layer_idx:
        ssm_cfg = copy.deepcopy(ssm_cfg) if ssm_cfg is not None else {}
        layer = ssm_cfg.pop("layer", "Mamba1")
        if layer not in ("Mamba1", "Mamba2"):
            raise ValueError(f"create_block: ssm_cfg['layer'] must be 'Mamba1' or 'Mamba2', got {layer!r}")
        mixer_cls = partial(Mamba2 if layer == "Mamba2" else Mamba, layer_idx=layer_idx, **ssm_cfg, **fk)
    else:
        mixer_cls = partial(MHA, layer_idx=layer_idx, **attn_cfg, **fk)
    norm_cls = partial(RMSNorm if rms_norm else FusedLayerNorm, eps=norm_epsilon, **fk)
    if d_intermediate == 0:
        mlp_cls = nn.Identity
    else:
        mlp_cls = partial(GatedMLP, hidden_features=d_intermediate, out_features=d_model, **fk)
    block = Block(d_model, mixer_cls, mlp_cls, norm_cls=norm_cls, fused_add_norm=fused_add_norm,
                  residual_in_fp32=residual_in_fp32)
    block.layer_idx = layer_idx
    return block


def _init_weights(module: nn.Module, n_layer: int, initializer_range: float = 0.02,
                  rescale_prenorm_residual: bool = True, n_residuals_per_layer: int = 1) -> None:
    """mamba-ssm's initialisation: zero Linear biases (unless marked ``_no_reinit``), N(0, initializer_range)
    embeddings, and ``out_proj.weight``/``fc2.weight`` re-drawn (Kaiming uniform) and scaled by
    ``1 / sqrt(n_residuals_per_layer * n_layer)``."""
    if isinstance(module, nn.Linear):
        if module.bias is not None and not getattr(module.bias, "_no_reinit", False):
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for name, p in module.named_parameters():
            if name in ("out_proj.weight", "fc2.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_residuals_per_layer * n_layer)


class MixerModel(nn.Module):
    """The backbone: embedding, ``n_layer`` blocks, final norm. ``forward(input_ids (B, L),
    inference_params=None) -> hidden_states (B, L, d_model)``."""

    def __init__(self, d_model: int, n_layer: int, d_intermediate: int, vocab_size: int, ssm_cfg: dict | None = None,
                 attn_layer_idx=None, attn_cfg: dict | None = None, norm_epsilon: float = 1e-5,
                 rms_norm: bool = False, initializer_cfg: dict | None = None, fused_add_norm: bool = False,
                 residual_in_fp32: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.residual_in_fp32 = residual_in_fp32
        self.embedding = nn.Embedding(vocab_size, d_model, **fk)
        self.fused_add_norm = fused_add_norm
        self.layers = nn.ModuleList(
            create_block(d_model, d_intermediate=d_intermediate, ssm_cfg=ssm_cfg, attn_layer_idx=attn_layer_idx,
                         attn_cfg=attn_cfg, norm_epsilon=norm_epsilon, rms_norm=rms_norm,
                         residual_in_fp32=residual_in_fp32, fused_add_norm=fused_add_norm, layer_idx=i, **fk)
            for i in range(n_layer))
        self.norm_f = (RMSNorm if rms_norm else FusedLayerNorm)(d_model, eps=norm_epsilon, **fk)
        self.apply(partial(_init_weights, n_layer=n_layer, **(initializer_cfg or {}),
                           n_residuals_per_layer=1 if d_intermediate == 0 else 2))

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs) -> dict:
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids: torch.Tensor, inference_params=None, **mixer_kwargs) -> torch.Tensor:
        hidden_states = self.embedding(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params)
        if not self.fused_add_norm:
            residual = hidden_states + residual if residual is not None else hidden_states
            return self.norm_f(residual.to(dtype=self.norm_f.weight.dtype))
        return layer_norm_fn(hidden_states, self.norm_f.weight, self.norm_f.bias, eps=self.norm_f.eps,
                             residual=residual, prenorm=False, residual_in_fp32=self.residual_in_fp32,
                             is_rms_norm=isinstance(self.norm_f, RMSNorm))


class MambaLMHeadModel(nn.Module, GenerationMixin):
    """mamba-ssm's ``MambaLMHeadModel`` (see the module docstring)."""

    def __init__(self, config: MambaConfig, initializer_cfg: dict | None = None, device=None, dtype=None) -> None:
        if not isinstance(config, MambaConfig):
            raise TypeError(f"MambaLMHeadModel: argument 'config' must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        vocab_size = config.vocab_size
        if vocab_size % config.pad_vocab_size_multiple != 0:
            vocab_size += config.pad_vocab_size_multiple - vocab_size % config.pad_vocab_size_multiple
        fk = {"device": device, "dtype": dtype}
        super().__init__()
        self.backbone = MixerModel(
            d_model=config.d_model, n_layer=config.n_layer, d_intermediate=config.d_intermediate,
            vocab_size=vocab_size, ssm_cfg=config.ssm_cfg, attn_layer_idx=config.attn_layer_idx,
            attn_cfg=config.attn_cfg, rms_norm=config.rms_norm, initializer_cfg=initializer_cfg,
            fused_add_norm=config.fused_add_norm, residual_in_fp32=config.residual_in_fp32, **fk)
        self.lm_head = Linear(config.d_model, vocab_size, bias=False, **fk)
        self.apply(partial(_init_weights, n_layer=config.n_layer, **(initializer_cfg or {})))
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs) -> dict:
        return self.backbone.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids=None, inference_params=None, num_last_tokens: int = 0,
                **mixer_kwargs) -> CausalLMOutput:
        """input_ids ``(B, L)`` -> ``CausalLMOutput(logits (B, L or num_last_tokens, vocab))``; ``position_ids``
        is accepted and unused (as in mamba-ssm)."""
        hidden_states = self.backbone(input_ids, inference_params=inference_params, **mixer_kwargs)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        return CausalLMOutput(logits=self.lm_head(hidden_states))

    @classmethod
    def from_pretrained(cls, pretrained_model_name: str | os.PathLike, device=None, dtype=None, **kwargs
                        ) -> MambaLMHeadModel:
        """Build and load the model of a local checkpoint directory (see the module docstring)."""
        data = load_config_hf(pretrained_model_name)
        known = {f.name for f in dataclasses.fields(MambaConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"MambaLMHeadModel.from_pretrained: config.json of {os.fspath(pretrained_model_name)!r} "
                             f"has fields MambaConfig does not know: {unknown}")
        model = cls(MambaConfig(**data), device=device, dtype=dtype, **kwargs)
        state_dict = load_state_dict_hf(pretrained_model_name, device=device, dtype=dtype)
        if model.config.tie_embeddings and "lm_head.weight" not in state_dict \
                and "backbone.embedding.weight" in state_dict:
            state_dict = {**state_dict, "lm_head.weight": state_dict["backbone.embedding.weight"]}
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        wrong = sorted(k for k in set(expected) & set(state_dict) if expected[k].shape != state_dict[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(
                f"MambaLMHeadModel.from_pretrained: the weights of {os.fspath(pretrained_model_name)!r} do not fit "
                f"the config: missing {missing[:8]}, unexpected {unexpected[:8]}, wrong shape "
                f"{[(k, tuple(state_dict[k].shape), tuple(expected[k].shape)) for k in wrong[:8]]}")
        model.load_state_dict(state_dict)
        return model

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``pytorch_model.bin`` (the state dict) to ``save_directory``."""
        os.makedirs(save_directory, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(save_directory, "pytorch_model.bin"))
        with open(os.path.join(save_directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self.config), f, indent=4)
