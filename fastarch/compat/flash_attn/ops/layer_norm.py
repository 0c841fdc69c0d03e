"""flash-attn's ``flash_attn.ops.layer_norm`` (the fused dropout-add-LayerNorm functions and module) on
:func:`fastarch.ops.layer_norm`, on any device.

``dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
prenorm=False, residual_in_fp32=False, return_dropout_mask=False)`` computes
``z = LN(dropout(x0 * rowscale * layerscale) + residual)`` and returns ``z``, ``(z, x)`` with ``prenorm`` (``x``
the pre-norm sum, in ``residual``'s dtype, or fp32 with ``residual_in_fp32``), and the dropout keep mask (uint8;
all ones without dropout) last with ``return_dropout_mask``. ``dropout_add_layer_norm_parallel_residual`` adds a
second input ``x1`` and a second output normalised with ``weight1``/``bias1``. ``layer_norm(x, weight, bias,
epsilon)`` and ``DropoutAddLayerNorm`` as in flash-attn.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import init

from .._missing import missing_attribute
from .triton.layer_norm import _fused

__all__ = [
    "DropoutAddLayerNorm",
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_parallel_residual",
    "layer_norm",
]

__getattr__ = missing_attribute("flash_attn.ops.layer_norm")


def _mask(mask: Tensor | None, like: Tensor) -> Tensor:
    return mask.to(torch.uint8) if mask is not None else torch.ones(like.shape, dtype=torch.uint8, device=like.device)


def _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                      residual_in_fp32, return_dropout_mask, is_rms_norm):
    z, _, x, mask, _ = _fused(x0, weight, bias, residual, None, None, None, epsilon, dropout_p, rowscale, layerscale,
                              residual_in_fp32, is_rms_norm)
    outs = [z, x] if prenorm else [z]
    if return_dropout_mask:
        outs.append(_mask(mask, x0))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                       residual_in_fp32, return_dropout_mask, is_rms_norm):
    z0, z1, x, mask0, mask1 = _fused(x0, weight0, bias0, residual, x1, weight1, bias1, epsilon, dropout_p, None,
                                     None, residual_in_fp32, is_rms_norm)
    outs = [z0, z1, x] if prenorm else [z0, z1]
    if return_dropout_mask:
        outs += [_mask(mask0, x0), _mask(mask1, x0)]
    return tuple(outs)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, epsilon: float) -> Tensor:
    """LayerNorm over the last dimension: x ``(..., N)``, weight/bias ``(N,)`` -> ``(..., N)``."""
    return _dropout_add_norm(x, None, weight, bias, 0.0, epsilon, None, None, False, False, False, False)


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """See the module docstring. Shapes: x0, residual ``(..., N)``; weight, bias, layerscale ``(N,)``;
    rowscale ``(...)``."""
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, False)


def dropout_add_layer_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                             prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """``x = dropout(x0) + dropout(x1) + residual``; returns ``(z0, z1)`` (``z1`` None without ``weight1``), then
    ``x`` with ``prenorm``, then both uint8 keep masks with ``return_dropout_mask``."""
    return _parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                              residual_in_fp32, return_dropout_mask, False)


class DropoutAddLayerNorm(torch.nn.Module):
    """flash-attn's ``DropoutAddLayerNorm``: ``weight`` (ones) and ``bias`` (zeros) ``(hidden_size,)``;
    ``forward(x0, residual=None)`` is :func:`dropout_add_layer_norm` with dropout ``p`` while training."""

    def __init__(self, hidden_size: int, prenorm: bool = False, p: float = 0.0, eps: float = 1e-5,
                 residual_in_fp32: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.epsilon = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x0: Tensor, residual: Tensor | None = None):
        return dropout_add_layer_norm(x0, residual, self.weight, self.bias, self.p if self.training else 0.0,
                                      self.epsilon, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
