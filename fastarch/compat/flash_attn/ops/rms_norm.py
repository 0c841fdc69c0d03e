"""flash-attn's ``flash_attn.ops.rms_norm`` on :func:`fastarch.ops.rms_norm`, on any device: ``rms_norm``,
``dropout_add_rms_norm``, ``dropout_add_rms_norm_parallel_residual``, ``DropoutAddRMSNorm`` and ``RMSNorm``, the
RMSNorm counterparts of :mod:`fastarch.compat.flash_attn.ops.layer_norm` (same arguments and returns)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import init

from .._missing import missing_attribute
from .layer_norm import DropoutAddLayerNorm, _dropout_add_norm, _parallel_residual

__all__ = ["DropoutAddRMSNorm", "RMSNorm", "dropout_add_rms_norm", "dropout_add_rms_norm_parallel_residual",
           "rms_norm"]

__getattr__ = missing_attribute("flash_attn.ops.rms_norm")


def rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    """RMSNorm over the last dimension: x ``(..., N)``, weight ``(N,)`` -> ``(..., N)``."""
    return _dropout_add_norm(x, None, weight, None, 0.0, epsilon, None, None, False, False, False, True)


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                         prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """``z = RMSNorm(dropout(x0 * rowscale * layerscale) + residual) * weight + bias``; returns as
    :func:`fastarch.compat.flash_attn.ops.layer_norm.dropout_add_layer_norm`."""
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """The RMSNorm version of ``dropout_add_layer_norm_parallel_residual``."""
    return _parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                              residual_in_fp32, return_dropout_mask, True)


class DropoutAddRMSNorm(DropoutAddLayerNorm):
    """flash-attn's ``DropoutAddRMSNorm``: :class:`DropoutAddLayerNorm` without a bias (``weight`` (ones)
    ``(hidden_size,)``); ``forward(x0, residual=None)`` is :func:`dropout_add_rms_norm`."""

    def __init__(self, hidden_size: int, prenorm: bool = False, p: float = 0.0, eps: float = 1e-5,
                 residual_in_fp32: bool = False, device=None, dtype=None) -> None:
        super().__init__(hidden_size, prenorm, p, eps, residual_in_fp32, device, dtype)
        del self.bias
        self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        init.ones_(self.weight)

    def forward(self, x0: Tensor, residual: Tensor | None = None):
        return dropout_add_rms_norm(x0, residual, self.weight, None, self.p if self.training else 0.0, self.epsilon,
                                    prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)


class RMSNorm(torch.nn.Module):
    """flash-attn's ``flash_attn.ops.rms_norm.RMSNorm``: ``weight`` (ones) ``(hidden_size,)``, ``eps``;
    ``forward(x)`` -> :func:`rms_norm`. Shapes: ``(..., hidden_size)`` -> same."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)
