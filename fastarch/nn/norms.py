"""Normalisation layers on fastarch's fused norm ops.

``LayerNorm`` and ``BatchNorm`` are drop-ins for the seed guide 003's classes (same constructor arguments,
``state_dict`` keys and outputs); ``FusedLayerNorm`` matches ``torch.nn.LayerNorm``; ``RMSNorm`` is the
standard root-mean-square norm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops

__all__ = ["LayerNorm", "BatchNorm", "RMSNorm", "FusedLayerNorm"]


class LayerNorm(nn.Module):
    """Guide-003 layer norm: ``gamma * (x - mean) / (std + eps) + beta`` over the last dimension.

    As in the guide, ``std`` is the unbiased (N-1) standard deviation and ``eps`` is added to the std, not
    the variance; this differs from ``torch.nn.LayerNorm`` (use :class:`FusedLayerNorm` for that).
    Parameters: ``gamma`` and ``beta`` of shape ``(d_model,)``.
    """

    def __init__(self, d_model: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(..., d_model)`` -> same shape."""
        return ops.layer_norm(x, self.gamma.to(x.dtype), self.beta.to(x.dtype), self.eps, unbiased=True,
                              eps_inside_sqrt=False)


class FusedLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (a subclass: same constructor, parameters and ``state_dict`` keys) whose forward
    runs ``fastarch.ops.layer_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != tuple(self.normalized_shape):
            raise ValueError(f"FusedLayerNorm: input's trailing shape {tuple(x.shape[-k:])} does not match "
                             f"normalized_shape {tuple(self.normalized_shape)}")
        flat = x.reshape(*x.shape[: x.dim() - k], -1)
        w = self.weight.reshape(-1).to(x.dtype) if self.weight is not None else None
        b = self.bias.reshape(-1).to(x.dtype) if self.bias is not None else None
        return ops.layer_norm(flat, w, b, self.eps).view(x.shape)


class RMSNorm(nn.Module):
    """Root-mean-square norm, ``x / sqrt(mean(x^2) + eps) * weight``; parameter ``weight`` ``(d_model,)``."""

    def __init__(self, d_model: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight.to(x.dtype), self.eps)


class BatchNorm(nn.Module):
    """Guide-003 batch norm over every leading dimension of ``x`` ``(..., d_model)``.

    Training normalises with the biased batch variance and updates ``running_mean``/``running_var`` with
    momentum using the *biased* variance, as the guide does (``torch.nn.BatchNorm1d`` uses the unbiased one
    for the running estimate). Deviations from the guide: the running-statistics update is done without
    autograd history (the guide's keeps the graph alive through its buffers), and 2-D inputs ``(N, d)`` are
    normalised per feature (the guide's ``mean(dim=(0, 1))`` collapses them to one scalar).
    """

    def __init__(self, d_model: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps = eps
        self.momentum = momentum
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.register_buffer("running_mean", torch.zeros(d_model))
        self.register_buffer("running_var", torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``(..., d_model)`` -> same shape."""
        d = self.gamma.shape[0]
        if x.dim() < 2 or x.shape[-1] != d:
            raise ValueError(f"BatchNorm: expected input (..., {d}) with at least 2 dims, got {tuple(x.shape)}")
        flat = x.reshape(-1, d)
        if self.training:
            with torch.no_grad():
                xf = flat.float()
                mean = xf.mean(0)
                var = xf.var(0, unbiased=False)
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.to(self.running_mean.dtype))
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var.to(self.running_var.dtype))
            # torch's native batch norm normalises with the biased batch variance, as the guide does.
            y = F.batch_norm(flat, None, None, self.gamma.to(x.dtype), self.beta.to(x.dtype), True, 0.0, self.eps)
        else:
            y = F.batch_norm(flat, self.running_mean, self.running_var, self.gamma.to(x.dtype),
                             self.beta.to(x.dtype), False, 0.0, self.eps)
        return y.view(x.shape)
