"""``mamba_ssm.ops.triton.layernorm_gated``: the gated, grouped RMS norm of Mamba-2 (``rmsnorm_fn`` and the
``RMSNorm`` module) on :func:`fastarch.ops.rms_norm_gated`."""

from __future__ import annotations

import torch

from fastarch.nn.mamba2 import RMSNormGated as RMSNorm
from fastarch.ops.rms_norm_gated import rms_norm_gated

__all__ = ["RMSNorm", "rmsnorm_fn"]


def rmsnorm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None = None,
               eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    """mamba-ssm's ``rmsnorm_fn``: ``norm(x) * silu(z)`` (``norm_before_gate``) or ``norm(x * silu(z))``, the
    RMS taken over groups of ``group_size`` channels."""
    return rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate)
