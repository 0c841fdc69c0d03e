"""Registered Mamba language models (``fastarch.models.create_model("mamba_tiny")``)."""

from __future__ import annotations

from ..nn.mamba import MambaLM
from .registry import register_configs

__all__: list[str] = []

globals().update(register_configs({
    "mamba_tiny": (MambaLM, "A 4-layer, d_model=128 MambaLM (byte-level vocabulary by default), for tests and demos.",
                   dict(vocab_size=256, d_model=128, n_layers=4, d_state=16)),
    "mamba_small": (MambaLM, "A 12-layer, d_model=512 MambaLM (GPT-2 vocabulary size).",
                    dict(vocab_size=50257, d_model=512, n_layers=12, d_state=16)),
}))
