"""``mamba_ssm.models.config_mamba``: ``MambaConfig``, mamba-ssm's model configuration (same fields and
defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..._missing import missing_attribute

__all__ = ["MambaConfig"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.models.config_mamba")


@dataclass
class MambaConfig:
    """``ssm_cfg`` goes to each mixer (``"layer"``: ``"Mamba1"`` or ``"Mamba2"``); ``attn_layer_idx`` lists the
    layers that are :class:`~fastarch.compat.mamba_ssm.modules.mha.MHA` built from ``attn_cfg``;
    ``d_intermediate > 0`` adds a gated MLP to every block; the vocabulary is padded up to a multiple of
    ``pad_vocab_size_multiple``."""

    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    attn_layer_idx: list = field(default_factory=list)
    attn_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
