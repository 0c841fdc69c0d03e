"""Whole-model builders with a timm-style registry. Importing the package imports every file of builders, so
``create_model`` and ``list_models`` see them all; the classes each file defines are exported here."""

from __future__ import annotations

from . import efficient, graph, hf, hf_bert, mamba, reformer, text, vision, zoo
from .registry import create_model, list_models, register_configs, register_model

__all__ = ["create_model", "list_models", "register_model", "register_configs"]
for _module in (efficient, graph, hf, hf_bert, mamba, reformer, text, vision, zoo):
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += _module.__all__
