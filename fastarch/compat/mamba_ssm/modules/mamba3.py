"""``mamba_ssm.modules.mamba3``: mamba-ssm's ``Mamba3`` layer, :class:`fastarch.nn.Mamba3` (the same
constructor arguments, ``state_dict`` keys, ``forward(u, seq_idx=None, cu_seqlens=None,
inference_params=None)``, ``step`` and ``allocate_inference_cache``; SISO and MIMO, on CPU too)."""

from __future__ import annotations

from fastarch.nn.mamba3 import Mamba3

from ..._missing import missing_attribute

__all__ = ["Mamba3"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mamba3")
