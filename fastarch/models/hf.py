"""Hugging Face checkpoints both ways: ``from_hf`` builds the fastarch model a checkpoint describes,
``to_hf`` writes one that transformers loads. Neither needs ``transformers`` (``safetensors`` is used).

Supported ``model_type``: ``bert`` (``fastarch.nn.BERT``), ``gpt2`` (``fastarch.nn.GPTModel`` with
``activation="gelu_new"``), ``mamba`` (``fastarch.nn.MambaLM``), ``mamba2`` (``fastarch.nn.Mamba2LM``) and,
for ``from_hf`` only, ``vit``
(``fastarch.nn.PreNormViT``). mamba-ssm's own checkpoint format (``config.json`` with ``d_model``, ``n_layer``,
``ssm_cfg``..., ``pytorch_model.bin``) is read by ``from_hf`` too (``MambaLM`` / ``Mamba2LM`` per
``ssm_cfg["layer"]``) and written by ``to_hf(model, path, format="mamba_ssm")``, so a checkpoint converts between
the two formats through fastarch. Every checkpoint key maps to a parameter
or the load fails, and a config value the fastarch model cannot honour raises: no partial loads.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .._files import atomic_directory
from ..nn.bert import BERT
from ..nn.gpt import GPTModel
from ..nn.mamba import MambaLM
from ..nn.mamba2 import Mamba2LM
from ..nn.vision import PreNormViT
from ._hf_files import (
    check_config_against_shapes,
    check_shapes_on_meta,
    header_shapes,
    read_config,
    require_regular_file,
)
from .hf_bert import bert_from_hf

__all__ = ["from_hf", "to_hf"]


# ---------------------------------------------------------------------------------------------- reading
def _read_checkpoint(path_or_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, config dict) from a checkpoint directory or an in-memory HF model. The config is checked
    against the weights' shapes (read from the safetensors header) before a tensor is loaded."""
    if isinstance(path_or_model, nn.Module):
        config = getattr(path_or_model, "config", None)
        if config is None or not hasattr(config, "to_dict"):
            raise TypeError("from_hf: argument 'path_or_model' is a module without a Hugging Face config; pass a "
                            f"transformers PreTrainedModel or a checkpoint directory, got {type(path_or_model).__name__}")
        sd, cfg = dict(path_or_model.state_dict()), config.to_dict()
        check_config_against_shapes(cfg.get("model_type"), cfg, {k: tuple(v.shape) for k, v in sd.items()},
                                    "from_hf")
        return sd, cfg
    if not isinstance(path_or_model, (str, os.PathLike)):
        raise TypeError("from_hf: argument 'path_or_model' must be a checkpoint directory or a Hugging Face model, "
                        f"got {type(path_or_model).__name__}")
    path = os.fspath(path_or_model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_hf: {path!r} is not a directory (expected config.json and model.safetensors "
                                "or pytorch_model.bin)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.lexists(cfg_path):
        raise FileNotFoundError(f"from_hf: no config.json in {path!r}")
    config = read_config(cfg_path, "from_hf")
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.lexists(st):
        from safetensors.torch import load_file

        require_regular_file(st, "from_hf")
        check_config_against_shapes(config.get("model_type"), config, header_shapes(st), "from_hf")
        return load_file(st), config
    if os.path.lexists(pt):
        require_regular_file(pt, "from_hf")
        sd = torch.load(pt, map_location="cpu", weights_only=True)
        if not isinstance(sd, dict):
            raise ValueError(f"from_hf: {pt!r} does not hold a state dict")
        check_config_against_shapes(config.get("model_type"), config,
                                    {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)},
                                    "from_hf")
        return sd, config
    raise FileNotFoundError(f"from_hf: no model.safetensors or pytorch_model.bin in {path!r} (sharded checkpoints "
                            "are not supported)")


def _strip(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def _require(config: dict[str, Any], key: str, allowed: tuple, model_type: str, default: Any = None) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(f"from_hf: {model_type} config {key}={value!r} is not supported by fastarch (expected "
                         f"{' or '.join(repr(a) for a in allowed)})")


def _fail_unmapped(keys: list[str], model_type: str) -> None:
    if keys:
        shown = ", ".join(sorted(keys)[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
        raise KeyError(f"from_hf: {model_type} checkpoint keys that map to no fastarch parameter: {shown}")


def _tied(sd: dict[str, torch.Tensor], head: str, embedding: str) -> bool:
    return head not in sd or sd[head] is sd[embedding] or torch.equal(sd[head], sd[embedding])


def _load(build: Callable[[], nn.Module], mapped: dict[str, torch.Tensor], model_type: str) -> nn.Module:
    """Check the mapped weights against the model ``build`` makes, on the meta device, then build it for real
    and load them: a config that does not fit the weights never allocates a model."""
    check_shapes_on_meta(build, mapped, f"from_hf: {model_type}")
    model = build()
    ref = model.state_dict()
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in mapped.items()}, strict=True)
    return model.eval()


# ---------------------------------------------------------------------------------------------- GPT-2
_GPT2_ACT = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu"}
_GPT2_LAYER = {  # HF name -> (fastarch name, transpose: HF's Conv1D stores (in, out))
    "ln_1.weight": ("norm1.weight", False), "ln_1.bias": ("norm1.bias", False),
    "attn.c_attn.weight": ("attention.qkv.weight", True), "attn.c_attn.bias": ("attention.qkv.bias", False),
    "attn.c_proj.weight": ("attention.out_proj.weight", True), "attn.c_proj.bias": ("attention.out_proj.bias", False),
    "ln_2.weight": ("norm2.weight", False), "ln_2.bias": ("norm2.bias", False),
    "mlp.c_fc.weight": ("ffn.0.weight", True), "mlp.c_fc.bias": ("ffn.0.bias", False),
    "mlp.c_proj.weight": ("ffn.3.weight", True), "mlp.c_proj.bias": ("ffn.3.bias", False),
}
_GPT2_TOP = {"wte.weight": "token_embedding.weight", "wpe.weight": "position_embedding.weight",
             "ln_f.weight": "norm.weight", "ln_f.bias": "norm.bias"}
_GPT2_DERIVED = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of older checkpoints


def _gpt2(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]) -> GPTModel:
    t = "gpt2"
    act = config.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise ValueError(f"from_hf: gpt2 config activation_function={act!r} is not supported by fastarch "
                         f"(expected one of {sorted(_GPT2_ACT)})")
    _require(config, "scale_attn_weights", (True,), t, True)
    _require(config, "scale_attn_by_inverse_layer_idx", (False,), t, False)
    _require(config, "add_cross_attention", (False,), t, False)
    _require(config, "tie_word_embeddings", (True,), t, True)
    sd = _strip(sd, "transformer.")
    if not _tied(sd, "lm_head.weight", "wte.weight"):
        raise ValueError("from_hf: the gpt2 checkpoint's lm_head.weight differs from wte.weight; fastarch's GPTModel "
                         "ties them")
    drops = {config.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(drops) > 1 and "dropout" not in overrides:
        raise ValueError(f"from_hf: gpt2 config has different dropouts {sorted(drops)}; fastarch's GPTModel has one "
                         "(pass dropout=...)")
    hidden = config.get("n_embd", 768)
    kw: dict[str, Any] = dict(vocab_size=config.get("vocab_size", 50257), embed_dim=hidden,
                              num_heads=config.get("n_head", 12), num_layers=config.get("n_layer", 12),
                              ff_dim=config.get("n_inner") or 4 * hidden, max_len=config.get("n_positions", 1024),
                              dropout=drops.pop(), activation=_GPT2_ACT[act],
                              layer_norm_eps=config.get("layer_norm_epsilon", 1e-5))
    kw.update(overrides)
    mapped: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue
        if k in _GPT2_TOP:
            mapped[_GPT2_TOP[k]] = v
            continue
        parts = k.split(".", 2)
        if len(parts) == 3 and parts[0] == "h" and parts[1].isdigit():
            if parts[2] in _GPT2_LAYER:
                name, transpose = _GPT2_LAYER[parts[2]]
                mapped[f"blocks.{parts[1]}.{name}"] = v.t() if transpose else v
                continue
            if parts[2] in _GPT2_DERIVED:
                continue
        unmapped.append(k)
    _fail_unmapped(unmapped, t)
    if "token_embedding.weight" in mapped:
        mapped["lm_head.weight"] = mapped["token_embedding.weight"]  # tied
    return _load(lambda: GPTModel(**kw), mapped, t)


def _gpt2_to_hf(model: GPTModel) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    top = {v: k for k, v in _GPT2_TOP.items()}
    layer = {v[0]: (k, v[1]) for k, v in _GPT2_LAYER.items()}
    sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to wte; transformers ties it back
        if k in top:
            sd[f"transformer.{top[k]}"] = v
        else:
            _, i, rest = k.split(".", 2)
            name, transpose = layer[rest]
            sd[f"transformer.h.{i}.{name}"] = v.t() if transpose else v
    block = model.blocks[0] if len(model.blocks) else None
    p = model.dropout.p
    config = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=model.token_embedding.num_embeddings,
                  n_embd=model.d_model, n_head=model.n_heads, n_layer=model.n_layers, n_positions=model.max_seq_len,
                  n_inner=block.ffn[0].out_features if block is not None else 4 * model.d_model,
                  activation_function=model.activation, layer_norm_epsilon=model.norm.eps,
                  resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, tie_word_embeddings=True)
    return sd, config


# ---------------------------------------------------------------------------------------------- Mamba
_MAMBA_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
                "dt_proj.bias", "A_log", "D", "out_proj.weight", "out_proj.bias")


def _mamba(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]) -> MambaLM:
    t = "mamba"
    _require(config, "hidden_act", ("silu",), t, "silu")
    hidden, expand = config.get("hidden_size", 768), config.get("expand", 2)
    inter = config.get("intermediate_size", expand * hidden)
    if inter != int(expand * hidden):
        raise ValueError(f"from_hf: mamba config intermediate_size={inter} is not expand * hidden_size = "
                         f"{expand} * {hidden}; fastarch's Mamba derives it")
    tie = config.get("tie_word_embeddings", True)
    sd = _strip(sd, "backbone.")
    if tie and not _tied(sd, "lm_head.weight", "embeddings.weight"):
        raise ValueError("from_hf: mamba config ties the embeddings but lm_head.weight differs from "
                         "embeddings.weight")
    kw: dict[str, Any] = dict(vocab_size=config.get("vocab_size", 50280), d_model=hidden,
                              n_layers=config.get("num_hidden_layers", 32), d_state=config.get("state_size", 16),
                              d_conv=config.get("conv_kernel", 4), expand=expand,
                              dt_rank=config.get("time_step_rank", "auto"), tie_embeddings=tie,
                              norm_eps=config.get("layer_norm_epsilon", 1e-5), bias=config.get("use_bias", False),
                              conv_bias=config.get("use_conv_bias", True))
    kw.update(overrides)
    return _load(lambda: MambaLM(**kw), _map_mamba_lm(sd, tie, _MAMBA_MIXER, "embeddings.weight", t), t)


def _map_mamba_lm(sd: dict[str, torch.Tensor], tie: bool, mixer_keys: tuple[str, ...], embedding: str,
                  model_type: str) -> dict[str, torch.Tensor]:
    """A Mamba-family backbone's keys (``backbone.`` stripped) as MambaLM/Mamba2LM state-dict keys."""
    mapped: dict[str, torch.Tensor] = {}
    unmapped: list[str] = []
    for k, v in sd.items():
        if k == embedding:
            mapped["embedding.weight"] = v
        elif k == "norm_f.weight":
            mapped[k] = v
        elif k == "lm_head.weight":
            if not tie:
                mapped[k] = v
        else:
            parts = k.split(".", 2)
            ok = len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and (
                parts[2] == "norm.weight" or (parts[2].startswith("mixer.") and parts[2][6:] in mixer_keys))
            if ok:
                mapped[k] = v
            else:
                unmapped.append(k)
    _fail_unmapped(unmapped, model_type)
    if not tie and "lm_head.weight" not in mapped:
        raise KeyError(f"from_hf: {model_type} config has untied embeddings but the checkpoint lacks lm_head.weight")
    if tie and "embedding.weight" in mapped:
        mapped["lm_head.weight"] = mapped["embedding.weight"]
    return mapped


def _mamba_lm_to_hf(model: MambaLM | Mamba2LM) -> tuple[dict[str, torch.Tensor], bool]:
    """(HF state dict, tied) of a MambaLM or Mamba2LM: ``backbone.`` names, the head only when untied."""
    tied = model.lm_head.weight is model.embedding.weight
    sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            if not tied:
                sd[k] = v
        elif k == "embedding.weight":
            sd["backbone.embeddings.weight"] = v
        else:
            sd[f"backbone.{k}"] = v
    return sd, tied


def _mamba_to_hf(model: MambaLM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd, tied = _mamba_lm_to_hf(model)
    mixer = model.layers[0].mixer
    config = dict(model_type="mamba", architectures=["MambaForCausalLM"], vocab_size=model.vocab_size,
                  hidden_size=model.d_model, num_hidden_layers=model.n_layers, state_size=mixer.d_state,
                  conv_kernel=mixer.d_conv, expand=mixer.expand, intermediate_size=mixer.d_inner,
                  time_step_rank=mixer.dt_rank, use_bias=mixer.in_proj.bias is not None,
                  use_conv_bias=mixer.conv1d.bias is not None, hidden_act="silu",
                  layer_norm_epsilon=model.norm_f.eps, tie_word_embeddings=tied, residual_in_fp32=True)
    return sd, config


# ---------------------------------------------------------------------------------------------- Mamba-2
_MAMBA2_MIXER = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                 "norm.weight", "out_proj.weight", "out_proj.bias")


def _json_float(value: Any) -> float:
    """A float from config.json; transformers writes infinities as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _mamba2(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]) -> Mamba2LM:
    t = "mamba2"
    _require(config, "hidden_act", ("silu",), t, "silu")
    hidden, expand = config.get("hidden_size", 4096), config.get("expand", 2)
    heads, head_dim = config.get("num_heads", 128), config.get("head_dim", 64)
    if heads * head_dim != int(expand * hidden):
        raise ValueError(f"from_hf: mamba2 config num_heads * head_dim = {heads} * {head_dim} is not expand * "
                         f"hidden_size = {expand} * {hidden}; fastarch's Mamba2 derives the heads from them")
    tie = config.get("tie_word_embeddings", False)
    sd = _strip(sd, "backbone.")
    emb = "embedding.weight" if "embedding.weight" in sd else "embeddings.weight"  # transformers reads both
    if tie and not _tied(sd, "lm_head.weight", emb):
        raise ValueError("from_hf: mamba2 config ties the embeddings but lm_head.weight differs from "
                         "embeddings.weight")
    eps = config.get("layer_norm_epsilon", 1e-5)
    kw: dict[str, Any] = dict(vocab_size=config.get("vocab_size", 32768), d_model=hidden,
                              n_layers=config.get("num_hidden_layers", 64), d_state=config.get("state_size", 128),
                              d_conv=config.get("conv_kernel", 4), expand=expand, headdim=head_dim,
                              ngroups=config.get("n_groups", 8), chunk_size=config.get("chunk_size", 256),
                              tie_embeddings=tie, norm_eps=eps, bias=config.get("use_bias", False),
                              conv_bias=config.get("use_conv_bias", True),
                              dt_limit=tuple(_json_float(v) for v in config.get("time_step_limit", (0.0, math.inf))),
                              dt_min=config.get("time_step_min", 0.001), dt_max=config.get("time_step_max", 0.1),
                              dt_init_floor=config.get("time_step_floor", 1e-4))
    kw.update(overrides)
    mapped = _map_mamba_lm(sd, tie, _MAMBA2_MIXER, emb, t)

    def build() -> Mamba2LM:
        model = Mamba2LM(**kw)
        for layer in model.layers:  # transformers' gated norm takes layer_norm_epsilon too
            layer.mixer.norm.eps = kw["norm_eps"]
        return model

    return _load(build, mapped, t)


def _mamba2_to_hf(model: Mamba2LM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    mixers = [layer.mixer for layer in model.layers]
    if not mixers:
        raise ValueError("to_hf: a Mamba2LM without layers has no Hugging Face Mamba2 form")
    m, eps = mixers[0], model.norm_f.eps
    for i, x in enumerate(mixers):
        alike = all(getattr(x, a) == getattr(m, a) for a in ("d_state", "d_conv", "expand", "headdim", "ngroups",
                                                              "chunk_size", "dt_limit"))
        one_bias = (x.in_proj.bias is None) == (x.out_proj.bias is None) == (m.in_proj.bias is None)
        if not (alike and one_bias and x.rmsnorm and not x.norm_before_gate and x.d_ssm == x.d_inner
                and not x.D_has_hdim and (x.conv1d.bias is None) == (m.conv1d.bias is None)):
            raise ValueError(f"to_hf: Mamba2LM layer {i} has no Hugging Face Mamba2 form (its mixers are alike, "
                             "with rmsnorm=True, norm_before_gate=False, d_ssm=None, D_has_hdim=False and one bias "
                             "flag for in_proj and out_proj)")
        if x.norm.eps != eps or model.layers[i].norm.eps != eps:
            raise ValueError(f"to_hf: Mamba2LM layer {i}'s norms have eps {x.norm.eps} (mixer) and "
                             f"{model.layers[i].norm.eps} (block), norm_f {eps}; Hugging Face's Mamba2 has one "
                             "layer_norm_epsilon")
    sd, tied = _mamba_lm_to_hf(model)
    config = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], vocab_size=model.vocab_size,
                  hidden_size=model.d_model, num_hidden_layers=model.n_layers, num_heads=m.nheads,
                  head_dim=m.headdim, state_size=m.d_state, expand=m.expand, conv_kernel=m.d_conv,
                  n_groups=m.ngroups, chunk_size=m.chunk_size, use_bias=m.in_proj.bias is not None,
                  use_conv_bias=m.conv1d.bias is not None, hidden_act="silu", layer_norm_epsilon=eps,
                  time_step_limit=list(m.dt_limit), time_step_min=m.dt_min, time_step_max=m.dt_max,
                  time_step_floor=m.dt_init_floor, residual_in_fp32=True, tie_word_embeddings=tied)
    return sd, config


# ---------------------------------------------------------------------------------------------- mamba-ssm's format
_MAMBA_SSM_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                     "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")
_MAMBA_SSM_EPS = 1e-5  # mamba-ssm's MixerModel norm_epsilon, which its config cannot change


def _is_mamba_ssm(config: dict[str, Any]) -> bool:
    """A mamba-ssm ``MambaConfig`` dump (no ``model_type``; ``d_model`` and ``n_layer``)."""
    return "model_type" not in config and "d_model" in config and "n_layer" in config


def _mamba_ssm(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]
               ) -> MambaLM | Mamba2LM:
    """A mamba-ssm checkpoint as ``MambaLM`` (``ssm_cfg["layer"]`` ``"Mamba1"``) or ``Mamba2LM`` (``"Mamba2"``):
    RMS norms, no MLP or attention layers (those need ``fastarch.compat.mamba_ssm``'s ``MambaLMHeadModel``)."""
    t = "mamba-ssm"
    unknown = sorted(set(config) - set(_MAMBA_SSM_FIELDS))
    if unknown:
        raise ValueError(f"from_hf: {t} config has fields MambaConfig does not know: {unknown}")
    if config.get("d_intermediate", 0) != 0 or config.get("attn_layer_idx") or not config.get("rms_norm", True):
        raise ValueError(f"from_hf: {t} config with d_intermediate={config.get('d_intermediate', 0)}, "
                         f"attn_layer_idx={config.get('attn_layer_idx', [])}, rms_norm={config.get('rms_norm', True)} "
                         "has no MambaLM/Mamba2LM form (needs d_intermediate=0, no attention layers, rms_norm=True); "
                         "load it with fastarch.compat.mamba_ssm's MambaLMHeadModel.from_pretrained")
    ssm = dict(config.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in ("Mamba1", "Mamba2"):
        raise ValueError(f"from_hf: {t} ssm_cfg layer={layer!r} is not supported (expected 'Mamba1' or 'Mamba2')")
    vocab, multiple = config.get("vocab_size", 50277), config.get("pad_vocab_size_multiple", 8)
    if vocab % multiple:
        vocab += multiple - vocab % multiple
    tie = config.get("tie_embeddings", True)
    sd = _strip(sd, "backbone.")
    if tie and not _tied(sd, "lm_head.weight", "embedding.weight"):
        raise ValueError(f"from_hf: {t} config ties the embeddings but lm_head.weight differs from embedding.weight")
    kw: dict[str, Any] = dict(vocab_size=vocab, d_model=config.get("d_model", 2560),
                              n_layers=config.get("n_layer", 64), tie_embeddings=tie, norm_eps=_MAMBA_SSM_EPS, **ssm)
    kw.update(overrides)
    if layer == "Mamba1":
        return _load(lambda: MambaLM(**kw), _map_mamba_lm(sd, tie, _MAMBA_MIXER, "embedding.weight", t), t)
    return _load(lambda: Mamba2LM(**kw), _map_mamba_lm(sd, tie, _MAMBA2_MIXER, "embedding.weight", t), t)


def _to_mamba_ssm(model: MambaLM | Mamba2LM) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, config) of a MambaLM or Mamba2LM in mamba-ssm's format (``lm_head.weight`` always written,
    as mamba-ssm's ``save_pretrained`` does)."""
    eps = {model.norm_f.eps, *(layer.norm.eps for layer in model.layers)}
    if eps != {_MAMBA_SSM_EPS}:
        raise ValueError(f"to_hf: mamba-ssm's format fixes every norm's eps at {_MAMBA_SSM_EPS}, the model has "
                         f"{sorted(eps)}")
    mixers = [layer.mixer for layer in model.layers]
    if isinstance(model, MambaLM):
        def cfg_of(m) -> dict[str, Any]:
            return dict(layer="Mamba1", d_state=m.d_state, d_conv=m.d_conv, expand=m.expand, dt_rank=m.dt_rank,
                        bias=m.in_proj.bias is not None, conv_bias=m.conv1d.bias is not None)
    else:
        def cfg_of(m) -> dict[str, Any]:
            if m.rmsnorm and m.norm.eps != _MAMBA_SSM_EPS:
                raise ValueError(f"to_hf: mamba-ssm's Mamba2 gated norm has eps {_MAMBA_SSM_EPS}, the model's "
                                 f"{m.norm.eps}")
            out = dict(layer="Mamba2", d_state=m.d_state, d_conv=m.d_conv, expand=m.expand, headdim=m.headdim,
                       d_ssm=m.d_ssm, ngroups=m.ngroups, D_has_hdim=m.D_has_hdim, rmsnorm=m.rmsnorm,
                       norm_before_gate=m.norm_before_gate, bias=m.in_proj.bias is not None,
                       conv_bias=m.conv1d.bias is not None, chunk_size=m.chunk_size)
            if tuple(m.dt_limit) != (0.0, math.inf):
                out["dt_limit"] = list(m.dt_limit)
            return out
    cfgs = [cfg_of(m) for m in mixers]
    if any(c != cfgs[0] for c in cfgs):
        raise ValueError("to_hf: mamba-ssm's format has one ssm_cfg for every layer; the model's mixers differ")
    tied = model.lm_head.weight is model.embedding.weight
    sd = {("backbone.embedding.weight" if k == "embedding.weight" else k if k == "lm_head.weight"
           else f"backbone.{k}"): v for k, v in model.state_dict().items()}
    config = dict(d_model=model.d_model, d_intermediate=0, n_layer=model.n_layers, vocab_size=model.vocab_size,
                  ssm_cfg=cfgs[0] if cfgs else {}, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                  residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=1, tie_embeddings=tied)
    return sd, config


# ---------------------------------------------------------------------------------------------- ViT
# Layer names on disk (``encoder.layer.N.``) and in transformers 5's modules (``layers.N.``).
_VIT_LAYER = {"layernorm_before": "norm1", "attention.output.dense": "attention.out_proj",
              "intermediate.dense": "ffn.0", "output.dense": "ffn.3", "layernorm_after": "norm2",
              "attention.o_proj": "attention.out_proj", "mlp.fc1": "ffn.0", "mlp.fc2": "ffn.3"}
_VIT_QKV = {"attention.attention.query": "q", "attention.attention.key": "k", "attention.attention.value": "v",
            "attention.q_proj": "q", "attention.k_proj": "k", "attention.v_proj": "v"}
_VIT_TOP = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
            "embeddings.patch_embeddings.projection.weight": "patch_embed.projection.weight",
            "embeddings.patch_embeddings.projection.bias": "patch_embed.projection.bias",
            "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
            "classifier.weight": "head.weight", "classifier.bias": "head.bias"}


def _vit(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]) -> PreNormViT:
    t = "vit"
    _require(config, "hidden_act", ("gelu", "gelu_new"), t, "gelu")
    _require(config, "qkv_bias", (True,), t, True)
    drops = {config.get(k, 0.0) for k in ("hidden_dropout_prob", "attention_probs_dropout_prob")}
    if len(drops) > 1 and "dropout" not in overrides:
        raise ValueError(f"from_hf: vit config has different dropouts {sorted(drops)}; fastarch's PreNormViT has "
                         "one (pass dropout=...)")
    sd = _strip(sd, "vit.")
    has_head = "classifier.weight" in sd
    kw: dict[str, Any] = dict(image_size=config.get("image_size", 224), patch_size=config.get("patch_size", 16),
                              in_channels=config.get("num_channels", 3),
                              num_classes=sd["classifier.weight"].shape[0] if has_head else 0,
                              embed_dim=config.get("hidden_size", 768), num_heads=config.get("num_attention_heads", 12),
                              num_layers=config.get("num_hidden_layers", 12),
                              ff_dim=config.get("intermediate_size", 3072), dropout=drops.pop(),
                              layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                              activation=config.get("hidden_act", "gelu"))
    kw.update(overrides)
    mapped: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str, str], torch.Tensor] = {}
    unmapped: list[str] = []
    for k, v in sd.items():
        if k in _VIT_TOP:
            mapped[_VIT_TOP[k]] = v
            continue
        m = re.match(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$", k)
        if m:
            i, base, leaf = m.groups()
            if base in _VIT_QKV:
                qkv[(i, _VIT_QKV[base], leaf)] = v
                continue
            if base in _VIT_LAYER:
                mapped[f"blocks.{i}.{_VIT_LAYER[base]}.{leaf}"] = v
                continue
        unmapped.append(k)
    _fail_unmapped(unmapped, t)
    for i, _, leaf in list(qkv):
        try:
            mapped[f"blocks.{i}.attention.qkv.{leaf}"] = torch.cat([qkv[(i, n, leaf)] for n in "qkv"])
        except KeyError as e:
            raise KeyError(f"from_hf: vit layer {i} lacks its {e.args[0][1]} projection's {leaf}") from None
    return _load(lambda: PreNormViT(**kw), mapped, t)


def _put_qkv(sd: dict[str, torch.Tensor], prefix: str, leaf: str, qkv: torch.Tensor) -> None:
    """A fused ``qkv`` weight or bias (3E, ...) as transformers' ``prefix.{query,key,value}.leaf`` entries."""
    for name, part in zip(("query", "key", "value"), qkv.chunk(3, 0)):
        sd[f"{prefix}.{name}.{leaf}"] = part


def _vit_to_hf(model: PreNormViT) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Checkpoint names as transformers saves them: ``ViTForImageClassification`` (``vit.`` prefix and a
    ``classifier``) with a head, ``ViTModel`` without (a model loaded with ``add_pooling_layer=False``)."""
    has_head = model.num_classes > 0
    prefix = "vit." if has_head else ""
    top = {v: k for k, v in _VIT_TOP.items()}
    on_disk = ("layernorm_before", "attention.output.dense", "intermediate.dense", "output.dense", "layernorm_after")
    layer = {_VIT_LAYER[k]: k for k in on_disk}
    sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k in top:
            sd[top[k] if top[k].startswith("classifier") else prefix + top[k]] = v
            continue
        _, i, rest = k.split(".", 2)
        base, leaf = rest.rsplit(".", 1)
        if base == "attention.qkv":
            _put_qkv(sd, f"{prefix}encoder.layer.{i}.attention.attention", leaf, v)
        else:
            sd[f"{prefix}encoder.layer.{i}.{layer[base]}.{leaf}"] = v
    block = model.blocks[0] if len(model.blocks) else None
    p = model.dropout.p
    config = dict(model_type="vit", architectures=["ViTForImageClassification" if has_head else "ViTModel"],
                  image_size=model.image_size, patch_size=model.patch_size, num_channels=model.in_channels,
                  hidden_size=model.cls_token.shape[-1], num_hidden_layers=len(model.blocks),
                  num_attention_heads=block.attention.num_heads if block is not None else 12,
                  intermediate_size=block.ffn[0].out_features if block is not None else 4 * model.cls_token.shape[-1],
                  hidden_act=block.activation if block is not None else "gelu", layer_norm_eps=model.norm.eps,
                  hidden_dropout_prob=p, attention_probs_dropout_prob=p, qkv_bias=True)
    if has_head:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_classes)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(model.num_classes)}
    return sd, config


# ---------------------------------------------------------------------------------------------- BERT
def _bert(sd: dict[str, torch.Tensor], config: dict[str, Any], overrides: dict[str, Any]) -> BERT:
    return bert_from_hf(sd, config=config, **overrides)


def _bert_to_hf(model: BERT) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from .hf_bert import _LAYER_MAP, _TOP_MAP

    top = {v: k for k, v in _TOP_MAP.items()}
    layer = {v: k for k, v in _LAYER_MAP.items()}
    sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        base, leaf = k.rsplit(".", 1)
        if base in top:
            sd[f"{top[base]}.{leaf}"] = v
            continue
        _, i, rest = base.split(".", 2)
        if rest == "attention.qkv":
            _put_qkv(sd, f"encoder.layer.{i}.attention.self", leaf, v)
        else:
            sd[f"encoder.layer.{i}.{layer[rest]}.{leaf}"] = v
    first = model.encoder[0] if len(model.encoder) else None
    config = dict(model_type="bert", architectures=["BertModel"], vocab_size=model.token_embedding.num_embeddings,
                  hidden_size=model.hidden_size, num_hidden_layers=len(model.encoder),
                  num_attention_heads=first.attention.num_heads if first is not None else 12,
                  intermediate_size=first.ffn[0].out_features if first is not None else 4 * model.hidden_size,
                  hidden_act=model.hidden_act, max_position_embeddings=model.max_len,
                  type_vocab_size=model.segment_embedding.num_embeddings, layer_norm_eps=model.norm.eps,
                  hidden_dropout_prob=model.dropout.p, attention_probs_dropout_prob=model.dropout.p,
                  position_embedding_type="absolute")
    return sd, config


_FROM: dict[str, Callable[[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]], nn.Module]] = {
    "bert": _bert, "gpt2": _gpt2, "mamba": _mamba, "mamba2": _mamba2, "vit": _vit}


def from_hf(path_or_model: Any, **overrides: Any) -> nn.Module:
    """Build the fastarch model of a Hugging Face checkpoint, in eval mode.

    Args:
        path_or_model: a directory with ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``,
            read with ``torch.load(weights_only=True)``), or an in-memory transformers model.
        overrides: constructor arguments of the fastarch class, over the ones the config gives.

    Returns: ``BERT`` (``model_type`` ``bert``), ``GPTModel`` (``gpt2``), ``MambaLM`` (``mamba``, or a mamba-ssm
    checkpoint with ``Mamba1`` layers), ``Mamba2LM`` (``mamba2``, or a mamba-ssm checkpoint with ``Mamba2``) or
    ``PreNormViT`` (``vit``; ``ViTForImageClassification`` with its classifier, ``ViTModel`` without a pooler).

    Raises ``ValueError`` for another ``model_type`` or a config value fastarch cannot honour, ``KeyError``
    for a checkpoint key that maps to no parameter or a parameter the checkpoint lacks.
    """
    sd, config = _read_checkpoint(path_or_model)
    if _is_mamba_ssm(config):
        return _mamba_ssm(sd, config, overrides)
    model_type = config.get("model_type")
    if model_type not in _FROM:
        raise ValueError(f"from_hf: model_type {model_type!r} is not supported (fastarch loads "
                         f"{', '.join(sorted(_FROM))})")
    return _FROM[model_type](sd, config, overrides)


# Files of an existing export directory that the new weights supersede (other files, such as a tokenizer's,
# are kept): stale weights in another format or shards would be read instead of, or next to, the new ones.
_WEIGHT_FILE = re.compile(r"^(pytorch_model|model|tf_model|flax_model)([-.].*)?\.(bin|safetensors|h5|msgpack)"
                          r"(\.index\.json)?$")


def to_hf(model: nn.Module, path: str | os.PathLike, *, format: str = "hf") -> None:
    """Write ``model`` (``BERT``, ``GPTModel``, ``MambaLM``, ``Mamba2LM`` or ``PreNormViT``) to the directory
    ``path`` as ``config.json`` and ``model.safetensors`` that transformers' ``from_pretrained`` loads
    (``BertModel``, ``GPT2LMHeadModel``, ``MambaForCausalLM``, ``Mamba2ForCausalLM``,
    ``ViTForImageClassification``; a ``PreNormViT`` without a head is a ``ViTModel`` to load with
    ``add_pooling_layer=False``). The directory is written whole into a sibling temporary directory and renamed
    into place (an existing one is replaced; its files other than weights, such as a tokenizer's, are kept), so
    a reader never sees a half-written export and a failure leaves ``path`` as it was with no temporary left
    behind; ``from_hf(path)`` gives back the same tensors.

    ``format="mamba_ssm"`` writes a ``MambaLM`` or ``Mamba2LM`` in mamba-ssm's format instead (``config.json`` of
    ``MambaConfig``'s fields and ``pytorch_model.bin``), which mamba-ssm's and ``fastarch.compat.mamba_ssm``'s
    ``MambaLMHeadModel.from_pretrained`` load."""
    if format not in ("hf", "mamba_ssm"):
        raise ValueError(f"to_hf: argument 'format' must be 'hf' or 'mamba_ssm', got {format!r}")
    if format == "mamba_ssm":
        if not isinstance(model, (MambaLM, Mamba2LM)):
            raise TypeError(f"to_hf: format='mamba_ssm' takes a MambaLM or Mamba2LM, got {type(model).__name__}")
        sd, config = _to_mamba_ssm(model)
        tensors = {k: v.detach().cpu().contiguous() for k, v in sd.items()}
        if config["tie_embeddings"]:  # one tensor under both names, as mamba-ssm saves a tied head
            tensors["lm_head.weight"] = tensors["backbone.embedding.weight"]

        def fill_mamba_ssm(tmp: Path) -> None:
            torch.save(tensors, tmp / "pytorch_model.bin")
            with open(tmp / "config.json", "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)

        atomic_directory(path, fill_mamba_ssm, replaces=lambda name: bool(_WEIGHT_FILE.match(name)))
        return
    from safetensors.torch import save_file

    if isinstance(model, GPTModel):
        sd, config = _gpt2_to_hf(model)
    elif isinstance(model, MambaLM):
        sd, config = _mamba_to_hf(model)
    elif isinstance(model, Mamba2LM):
        sd, config = _mamba2_to_hf(model)
    elif isinstance(model, BERT):
        sd, config = _bert_to_hf(model)
    elif isinstance(model, PreNormViT):
        sd, config = _vit_to_hf(model)
    else:
        raise TypeError(f"to_hf: argument 'model' must be a BERT, GPTModel, MambaLM, Mamba2LM or PreNormViT, got "
                        f"{type(model).__name__}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in sd.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)

    atomic_directory(path, fill, replaces=lambda name: bool(_WEIGHT_FILE.match(name)))
