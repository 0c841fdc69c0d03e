"""Registered Mamba language models (``fastarch.models.create_model("mamba_tiny")``)."""

from __future__ import annotations

from typing import Any

from ..nn.mamba import MambaLM
from .registry import register_model


@register_model
def mamba_tiny(**kw: Any) -> MambaLM:
    """A 4-layer, d_model=128 MambaLM (byte-level vocabulary by default), for tests and demos."""
    cfg: dict[str, Any] = {"vocab_size": 256, "d_model": 128, "n_layers": 4, "d_state": 16}
    cfg.update(kw)
    return MambaLM(**cfg)


@register_model
def mamba_small(**kw: Any) -> MambaLM:
    """A 12-layer, d_model=512 MambaLM (GPT-2 vocabulary size)."""
    cfg: dict[str, Any] = {"vocab_size": 50257, "d_model": 512, "n_layers": 12, "d_state": 16}
    cfg.update(kw)
    return MambaLM(**cfg)
