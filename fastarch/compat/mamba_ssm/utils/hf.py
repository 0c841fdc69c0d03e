"""``mamba_ssm.utils.hf``: ``load_config_hf`` and ``load_state_dict_hf`` for a local checkpoint directory
(``config.json`` and ``pytorch_model.bin`` or ``model.safetensors``). Nothing is downloaded: a name that is not
a local directory raises :class:`FileNotFoundError` saying so."""

from __future__ import annotations

import json
import os

import torch

from ..._missing import missing_attribute

__all__ = ["load_config_hf", "load_state_dict_hf"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.utils.hf")

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"


def _local_dir(model_name: str | os.PathLike, who: str) -> str:
    path = os.fspath(model_name)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{who}: {path!r} is not a local directory; fastarch.compat.mamba_ssm reads checkpoints from disk only "
            f"(no hub downloads): download it first (e.g. `huggingface-cli download {path} --local-dir DIR`) and "
            "pass DIR")
    return path


def load_config_hf(model_name: str | os.PathLike) -> dict:
    """The ``config.json`` of the checkpoint directory ``model_name``, as a dict."""
    path = os.path.join(_local_dir(model_name, "load_config_hf"), CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_config_hf: no {CONFIG_NAME} in {os.fspath(model_name)!r}")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"load_config_hf: {path!r} does not hold a JSON object")
    return config


def load_state_dict_hf(model_name: str | os.PathLike, device=None, dtype: torch.dtype | None = None
                       ) -> dict[str, torch.Tensor]:
    """The state dict of the checkpoint directory ``model_name``: ``model.safetensors`` when present, else
    ``pytorch_model.bin`` (``torch.load(weights_only=True)``: tensors only, never arbitrary objects); cast to
    ``dtype`` and moved to ``device`` when given."""
    root = _local_dir(model_name, "load_state_dict_hf")
    safe, pt = os.path.join(root, SAFE_WEIGHTS_NAME), os.path.join(root, WEIGHTS_NAME)
    if os.path.isfile(safe):
        from safetensors.torch import load_file

        state_dict = load_file(safe)
    elif os.path.isfile(pt):
        state_dict = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"load_state_dict_hf: neither {SAFE_WEIGHTS_NAME} nor {WEIGHTS_NAME} in {root!r}")
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError(f"load_state_dict_hf: the weights in {root!r} are not a dict of tensors")
    if dtype is not None:
        state_dict = {k: v.to(dtype=dtype) for k, v in state_dict.items()}
    if device is not None:
        state_dict = {k: v.to(device=device) for k, v in state_dict.items()}
    return state_dict
