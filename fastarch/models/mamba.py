"""Registered Mamba and Mamba-2 language models (``fastarch.models.create_model("mamba_tiny")``)."""

from __future__ import annotations

from ..nn.mamba import MambaLM
from ..nn.mamba2 import Mamba2LM
from .registry import register_configs

__all__: list[str] = []

globals().update(register_configs({
    "mamba_tiny": (MambaLM, "A 4-layer, d_model=128 MambaLM (byte-level vocabulary by default), for tests and demos.",
                   dict(vocab_size=256, d_model=128, n_layers=4, d_state=16)),
    "mamba_small": (MambaLM, "A 12-layer, d_model=512 MambaLM (GPT-2 vocabulary size).",
                    dict(vocab_size=50257, d_model=512, n_layers=12, d_state=16)),
    "mamba2_tiny": (Mamba2LM, "A 4-layer, d_model=128 Mamba2LM (4 heads of 64, d_state 64; byte-level vocabulary by "
                    "default), for tests and demos.",
                    dict(vocab_size=256, d_model=128, n_layers=4, d_state=64, headdim=64, chunk_size=64)),
    "mamba2_small": (Mamba2LM, "A 24-layer, d_model=768 Mamba2LM (24 heads of 64, d_state 128; GPT-2 vocabulary "
                     "size), the size of mamba-ssm's mamba2-130m.",
                     dict(vocab_size=50257, d_model=768, n_layers=24, d_state=128, headdim=64)),
}))
