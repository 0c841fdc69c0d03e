"""Load a Hugging Face BERT checkpoint into fastarch's ``BERT`` (no ``transformers`` needed).

``bert_from_hf(path_or_state_dict)`` accepts a state dict, a ``.safetensors`` / ``.bin`` / ``.pt`` file, or a
directory holding ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``). Keys of ``BertModel``
and of the heads-wrapping classes (``bert.`` prefix, e.g. ``BertForPreTraining``) are understood; the heads'
weights (``cls.*``) have no place in the encoder and are left out with a warning. Any other key that does not
map, a config of another ``model_type`` (RoBERTa, DistilBERT, ...) or a config value the encoder cannot
honour raises. Without a config the sizes are read off the tensors (heads default to hidden / 64).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch

from ..nn.bert import BERT
from ._hf_files import check_config_against_shapes, check_shapes_on_meta, read_config, require_regular_file

__all__ = ["bert_from_hf", "hf_bert_state_dict_to_fastarch"]

_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "ffn.0",
    "output.dense": "ffn.3",
    "output.LayerNorm": "norm2",
}
_TOP_MAP = {
    "embeddings.word_embeddings": "token_embedding",
    "embeddings.position_embeddings": "position_embedding",
    "embeddings.token_type_embeddings": "segment_embedding",
    "embeddings.LayerNorm": "norm",
    "pooler.dense": "pooler",
}


def _load_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        raise ValueError(f"bert_from_hf: {path!r} does not hold a state dict")
    return obj


def _read(path_or_state_dict: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if isinstance(path_or_state_dict, dict):
        return dict(path_or_state_dict), {}
    if not isinstance(path_or_state_dict, (str, os.PathLike)):
        raise TypeError("bert_from_hf: argument 'path_or_state_dict' must be a state dict, a file or a directory, "
                        f"got {type(path_or_state_dict).__name__}")
    path = os.fspath(path_or_state_dict)
    config: dict[str, Any] = {}
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if os.path.lexists(cfg):
            config = read_config(cfg, "bert_from_hf")
        for name in ("model.safetensors", "pytorch_model.bin"):
            if os.path.lexists(os.path.join(path, name)):
                require_regular_file(os.path.join(path, name), "bert_from_hf")
                return _load_file(os.path.join(path, name)), config
        raise FileNotFoundError(f"bert_from_hf: no model.safetensors or pytorch_model.bin in {path!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"bert_from_hf: {path!r} does not exist")
    require_regular_file(path, "bert_from_hf")
    cfg = os.path.join(os.path.dirname(path), "config.json")
    if os.path.lexists(cfg):
        config = read_config(cfg, "bert_from_hf")
    return _load_file(path), config


_DERIVED = ("embeddings.position_ids",)  # buffers the encoder recomputes


def hf_bert_state_dict_to_fastarch(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and fuse q/k/v of) a Hugging Face ``BertModel`` state dict into ``fastarch.nn.BERT`` keys.
    Raises ``KeyError`` naming every key that maps nowhere (heads' ``cls.*`` keys are dropped with a warning)."""
    src: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        k = k[len("bert."):] if k.startswith("bert.") else k
        k = k.replace(".gamma", ".weight").replace(".beta", ".bias")  # very old checkpoints
        src[k] = v
    if "embeddings.word_embeddings.weight" not in src:
        raise KeyError("bert_from_hf: no embeddings.word_embeddings.weight: not a BERT checkpoint")
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str, str], torch.Tensor] = {}
    unmapped: list[str] = []
    heads: list[str] = []
    for k, v in src.items():
        m = _LAYER.match(k)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            parts = rest.split(".")
            if len(parts) == 4 and rest.startswith("attention.self.") and parts[2] in ("query", "key", "value"):
                qkv[(i, parts[2], parts[3])] = v
                continue
            base, leaf = rest.rsplit(".", 1)
            if base in _LAYER_MAP and leaf in ("weight", "bias"):
                out[f"encoder.{i}.{_LAYER_MAP[base]}.{leaf}"] = v
            else:
                unmapped.append(k)
            continue
        base, _, leaf = k.rpartition(".")
        if base in _TOP_MAP and leaf in ("weight", "bias"):
            out[f"{_TOP_MAP[base]}.{leaf}"] = v
        elif k.startswith("cls."):
            heads.append(k)
        elif k not in _DERIVED:
            unmapped.append(k)
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f", ... ({len(unmapped)} in all)" if len(unmapped) > 8 else "")
        raise KeyError(f"bert_from_hf: checkpoint keys that map to no BERT parameter: {shown}; this is not a "
                       "BERT checkpoint (RoBERTa, DistilBERT, ... are not supported)")
    if heads:
        warnings.warn(f"bert_from_hf: {len(heads)} head weights (cls.*) are not part of the encoder and were "
                      "left out", stacklevel=3)
    layers = sorted({i for i, _, _ in qkv})
    for i in layers:
        for leaf in ("weight", "bias"):
            try:
                out[f"encoder.{i}.attention.qkv.{leaf}"] = torch.cat([qkv[(i, "query", leaf)], qkv[(i, "key", leaf)],
                                                                      qkv[(i, "value", leaf)]], 0)
            except KeyError as e:
                raise KeyError(f"bert_from_hf: layer {i} lacks attention.self.{e.args[0][1]}.{leaf}") from None
    return out


def check_bert_config(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` for a config (HF ``config.json`` as a dict) that fastarch's ``BERT`` cannot honour."""
    model_type = cfg.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(f"bert_from_hf: config model_type {model_type!r} is not 'bert' (only BERT checkpoints "
                         "load into fastarch's BERT)")
    checks = {"hidden_act": ("gelu", "gelu_new"), "position_embedding_type": ("absolute",), "is_decoder": (False,),
              "add_cross_attention": (False,)}
    for key, allowed in checks.items():
        if key in cfg and cfg[key] not in allowed:
            raise ValueError(f"bert_from_hf: config {key}={cfg[key]!r} is not supported (fastarch's BERT takes "
                             f"{' or '.join(repr(a) for a in allowed)})")


def bert_from_hf(path_or_state_dict: Any, config: dict[str, Any] | None = None, **overrides: Any) -> BERT:
    """Build ``fastarch.nn.BERT`` from a Hugging Face BERT checkpoint (eval mode).

    ``config`` (a dict like HF's config.json) overrides the one found next to the weights; ``overrides``
    (BERT constructor arguments) override both.
    """
    sd, found = _read(path_or_state_dict)
    cfg = dict(found)
    cfg.update(config or {})
    check_bert_config(cfg)
    check_config_against_shapes("bert", cfg, {k: tuple(v.shape) for k, v in sd.items()
                                              if isinstance(v, torch.Tensor)}, "bert_from_hf")
    mapped = hf_bert_state_dict_to_fastarch(sd)
    vocab, hidden = mapped["token_embedding.weight"].shape
    n_layers = len({k.split(".")[1] for k in mapped if k.startswith("encoder.")})
    kw = dict(
        vocab_size=cfg.get("vocab_size", vocab),
        hidden_size=cfg.get("hidden_size", hidden),
        num_heads=cfg.get("num_attention_heads", max(1, hidden // 64)),
        num_layers=cfg.get("num_hidden_layers", n_layers),
        intermediate_size=cfg.get("intermediate_size", mapped["encoder.0.ffn.0.weight"].shape[0]
                                  if n_layers else 4 * hidden),
        max_position_embeddings=cfg.get("max_position_embeddings", mapped["position_embedding.weight"].shape[0]),
        type_vocab_size=cfg.get("type_vocab_size", mapped["segment_embedding.weight"].shape[0]
                                if "segment_embedding.weight" in mapped else 2),
        dropout=cfg.get("hidden_dropout_prob", 0.1),
        layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
        hidden_act=cfg.get("hidden_act", "gelu"),
    )
    kw.update(overrides)
    # The sizes are checked against the weights on the meta device first: no model of a wrong size is built.
    check_shapes_on_meta(lambda: BERT(**kw), mapped, "bert_from_hf", optional=("pooler.weight", "pooler.bias"))
    model = BERT(**kw)
    ref = model.state_dict()
    if "pooler.weight" not in mapped:  # BertModel(add_pooling_layer=False): keep the fresh pooler
        mapped["pooler.weight"], mapped["pooler.bias"] = ref["pooler.weight"], ref["pooler.bias"]
    dtype = ref["token_embedding.weight"].dtype
    model.load_state_dict({k: v.to(dtype) for k, v in mapped.items()}, strict=True)
    return model.eval()
