"""Reading Hugging Face checkpoint directories safely: ``config.json`` only as a regular file of bounded size,
the weights' tensor shapes from the safetensors header (nothing allocated), and the config's sizes checked
against those shapes before any model is built."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

__all__ = ["MAX_CONFIG_BYTES", "check_config_against_shapes", "check_shapes_on_meta", "header_shapes",
           "read_config", "require_regular_file"]

# HF configs are a few KB (a large id2label table reaches a few MB): anything past this is not a config.
MAX_CONFIG_BYTES = 16 << 20


def require_regular_file(path: str, who: str) -> None:
    """Refuse anything but a regular file (after links): a FIFO or a device would be read forever."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"{who}: cannot read {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{who}: {path!r} must be a regular file, got {_kind(st.st_mode)}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def read_config(path: str, who: str) -> dict[str, Any]:
    """``config.json`` as a dict. Opened without blocking and checked on the open descriptor (a FIFO swapped
    in after a check is still refused), then read up to :data:`MAX_CONFIG_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise FileNotFoundError(f"{who}: cannot read {path!r}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{who}: {path!r} must be a regular file, got {_kind(st.st_mode)}")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{who}: {path!r} holds {st.st_size} bytes, more than a config's limit of "
                             f"{MAX_CONFIG_BYTES}")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:  # grew since fstat
        raise ValueError(f"{who}: {path!r} holds more than a config's limit of {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{who}: {path!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{who}: {path!r} must hold a JSON object, got {type(config).__name__}")
    return config


def header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header (memory-mapped; no tensor is read)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# Per model_type: checkpoint prefixes, the config sizes each named tensor's dimensions must equal
# ((config key, default) per dimension) and the layer-index pattern with the config key counting them.
# The defaults are the loaders' own.
_SIZES: dict[str, dict[str, Any]] = {
    "gpt2": dict(prefixes=("transformer.",),
                 tensors={"wte.weight": (("vocab_size", 50257), ("n_embd", 768)),
                          "wpe.weight": (("n_positions", 1024), ("n_embd", 768))},
                 layers=(r"h\.(\d+)\.", ("n_layer", 12))),
    "mamba": dict(prefixes=("backbone.",),
                  tensors={"embeddings.weight": (("vocab_size", 50280), ("hidden_size", 768))},
                  layers=(r"layers\.(\d+)\.", ("num_hidden_layers", 32))),
    "mamba2": dict(prefixes=("backbone.",),
                   tensors={"embeddings.weight": (("vocab_size", 32768), ("hidden_size", 4096)),
                            "embedding.weight": (("vocab_size", 32768), ("hidden_size", 4096))},
                   layers=(r"layers\.(\d+)\.", ("num_hidden_layers", 64))),
    "bert": dict(prefixes=("bert.",),
                 tensors={"embeddings.word_embeddings.weight": (("vocab_size", None), ("hidden_size", None)),
                          "embeddings.position_embeddings.weight": (("max_position_embeddings", None),
                                                                    ("hidden_size", None))},
                 layers=(r"encoder\.layer\.(\d+)\.", ("num_hidden_layers", None))),
    "vit": dict(prefixes=("vit.",),
                tensors={"embeddings.patch_embeddings.projection.weight": (
                    ("hidden_size", 768), ("num_channels", 3), ("patch_size", 16), ("patch_size", 16))},
                layers=(r"(?:encoder\.layer|layers)\.(\d+)\.", ("num_hidden_layers", 12))),
}


def check_config_against_shapes(model_type: str, config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                                who: str) -> None:
    """Refuse a config whose sizes (vocabulary, width, positions, layers) are not those of the weights, before
    a model of that size is built (``n_embd=10**9`` next to a small file would allocate gigabytes first)."""
    spec = _SIZES.get(model_type)
    if spec is None:
        return
    names = {}
    for k, shape in shapes.items():
        for p in spec["prefixes"]:
            if k.startswith(p):
                k = k[len(p):]
                break
        names[k] = shape
    for tensor, dims in spec["tensors"].items():
        shape = names.get(tensor)
        if shape is None:
            continue  # the loader names what is missing
        if len(shape) != len(dims):
            raise ValueError(f"{who}: {model_type} weight {tensor} has shape {shape}, expected {len(dims)} dimensions")
        for axis, ((key, default), size) in enumerate(zip(dims, shape)):
            value = config.get(key, default)
            if value is None:
                continue  # the loader takes it from the weights
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{who}: {model_type} config {key}={value!r} must be an int >= 0")
            if value != size:
                raise ValueError(f"{who}: {model_type} config {key}={value} does not match the weights: {tensor} has "
                                 f"shape {shape} (dimension {axis} is {size}); config and weights do not belong "
                                 "together")
    pattern, (key, default) = spec["layers"]
    found = {int(m.group(1)) for k in names if (m := re.match(pattern, k))}
    value = config.get(key, default)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}: {model_type} config {key}={value!r} must be an int >= 0")
    if value != len(found):
        raise ValueError(f"{who}: {model_type} config {key}={value} but the weights hold {len(found)} layers; config "
                         "and weights do not belong together")


def check_shapes_on_meta(build: Callable[[], nn.Module], mapped: Mapping[str, Any], who: str,
                         optional: tuple[str, ...] = ()) -> None:
    """Build the model on the meta device (no memory) and compare its state-dict keys and shapes with the
    mapped weights, so a mismatch is reported before the real model is allocated. ``optional`` keys may be
    absent from ``mapped``."""
    with torch.device("meta"):
        ref = build().state_dict()
    missing = sorted(set(ref) - set(mapped) - set(optional))
    if missing:
        raise KeyError(f"{who}: the checkpoint lacks {', '.join(missing[:8])}"
                       + (f", ... ({len(missing)} in all)" if len(missing) > 8 else ""))
    for k, v in mapped.items():
        if k in ref and tuple(v.shape) != tuple(ref[k].shape):
            raise ValueError(f"{who}: tensor for {k} has shape {tuple(v.shape)}, the config gives "
                             f"{tuple(ref[k].shape)}")
