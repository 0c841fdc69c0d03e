"""``mamba_ssm.ops.triton.layernorm_gated``: the gated, grouped norms of Mamba-2 with mamba-ssm's signatures,
on :func:`fastarch.ops.layer_norm_gated` and :func:`fastarch.ops.rms_norm_gated` (every backend, CPU
included).

- ``layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False)``
- ``rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True)``
- ``rms_norm_ref(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, upcast=True)``
- ``LayerNorm(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None)``
  (``weight`` ones, ``bias`` zeros) and ``RMSNorm`` (the same, no bias), ``forward(x, z=None)``.

``norm_before_gate``: ``norm(x) * silu(z)``; otherwise ``norm(x * silu(z))``. Shapes: x, z ``(..., N)``;
weight, bias ``(N,)``; ``group_size`` divides N (None: one group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastarch.compat._missing import missing_attribute
from fastarch.nn.mamba2 import RMSNormGated as RMSNorm
from fastarch.ops.rms_norm_gated import layer_norm_gated, rms_norm_gated

__all__ = ["LayerNorm", "RMSNorm", "layernorm_fn", "rms_norm_ref", "rmsnorm_fn"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.layernorm_gated")


def layernorm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None = None,
                 eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True,
                 is_rms_norm: bool = False) -> torch.Tensor:
    """mamba-ssm's ``layernorm_fn``: the gated, grouped layer norm (RMS norm with ``is_rms_norm``)."""
    return layer_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)


def rmsnorm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None = None,
               eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    """mamba-ssm's ``rmsnorm_fn``: ``norm(x) * silu(z)`` (``norm_before_gate``) or ``norm(x * silu(z))``, the
    RMS taken over groups of ``group_size`` channels."""
    return rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor | None = None,
                 eps: float = 1e-6, group_size: int | None = None, norm_before_gate: bool = True,
                 upcast: bool = True) -> torch.Tensor:
    """mamba-ssm's reference gated RMS norm in composed PyTorch: fp32 when ``upcast``, else ``x``'s dtype
    (the weight and bias in fp32 either way); the result in ``x.dtype``."""
    dtype, n = x.dtype, x.shape[-1]
    gs = n if group_size is None else group_size
    if n % gs:
        raise ValueError(f"rms_norm_ref: group_size must divide the last dimension {n}, got {group_size!r}")
    if upcast:
        x = x.float()
        z = None if z is None else z.float()
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    groups = x.unflatten(-1, (n // gs, gs))
    out = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


class LayerNorm(nn.Module):
    """mamba-ssm's gated ``LayerNorm``: ``forward(x, z=None)`` is :func:`layernorm_fn` with the module's
    ``weight`` ``(hidden_size,)`` (ones) and ``bias`` ``(hidden_size,)`` (zeros)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x, z: ``(..., hidden_size)`` -> ``(..., hidden_size)`` in ``x.dtype``."""
        return layernorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                            norm_before_gate=self.norm_before_gate)
