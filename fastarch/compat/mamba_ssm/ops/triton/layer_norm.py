"""``mamba_ssm.ops.triton.layer_norm``: dropout + residual add + LayerNorm / RMSNorm, mamba-ssm's signatures and
return conventions, on :func:`fastarch.ops.layer_norm` and :func:`fastarch.ops.rms_norm`.

``layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False, return_dropout_mask=False)``:

1. ``s = dropout(x * rowscale) [+ dropout(x1)] [+ residual]``, in fp32;
2. ``out = norm(s) * weight + bias`` in ``x.dtype`` (and ``out1`` with ``weight1``/``bias1``, the same
   normalised rows, when ``weight1`` is given);
3. returns ``out``, ``(out, out1)``; with ``prenorm`` also the residual stream ``s``, in ``residual.dtype``
   when a residual is given, else fp32 with ``residual_in_fp32``, else ``x.dtype`` (``x`` itself when nothing
   was added, dropped or scaled); with ``return_dropout_mask`` also the two keep masks (None without dropout).

Shapes: ``x``, ``residual``, ``x1``: ``(..., N)``; ``weight``, ``bias``, ``weight1``, ``bias1``: ``(N,)``;
``rowscale``: ``x.shape[:-1]``. Differentiable in every tensor. The dropout masks come from torch's generator
(mamba-ssm draws them inside its kernel); ``return_dropout_mask`` gives them back for checking.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.ops.layer_norm import layer_norm
from fastarch.ops.layer_norm import layer_norm_ref as _ln_ref
from fastarch.ops.linear import linear
from fastarch.ops.rms_norm import rms_norm
from fastarch.ops.rms_norm import rms_norm_ref as _rms_ref

from ...._missing import missing_attribute

__all__ = ["LayerNorm", "RMSNorm", "layer_norm_fn", "layer_norm_linear_fn", "layer_norm_ref", "rms_norm_fn",
           "rms_norm_ref"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.layer_norm")


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"layer_norm_fn: argument '{name}' must have shape {shape}, got {tuple(t.shape)}")


def _drop(t: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.rand(t.shape, device=t.device) >= p
    return torch.where(keep, t / (1.0 - p), torch.zeros((), dtype=t.dtype, device=t.device)), keep


def _normed(s: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms_norm: bool
            ) -> torch.Tensor:
    """``s`` fp32 ``(..., N)`` normalised with fp32 copies of the affine parameters."""
    w = weight.float()
    if is_rms_norm:
        y = rms_norm(s, w, eps)
        return y if bias is None else y + bias.float()
    return layer_norm(s, w, None if bias is None else bias.float(), eps)


def layer_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  residual: torch.Tensor | None = None, x1: torch.Tensor | None = None,
                  weight1: torch.Tensor | None = None, bias1: torch.Tensor | None = None, eps: float = 1e-6,
                  dropout_p: float = 0.0, rowscale: torch.Tensor | None = None, prenorm: bool = False,
                  residual_in_fp32: bool = False, is_rms_norm: bool = False, return_dropout_mask: bool = False):
    """mamba-ssm's ``layer_norm_fn`` (see the module docstring for what it computes and returns)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"layer_norm_fn: argument 'x' must be a tensor (..., N), got {type(x).__name__}")
    n = x.shape[-1]
    _check("weight", weight, (n,))
    _check("bias", bias, (n,))
    _check("weight1", weight1, (n,))
    _check("bias1", bias1, (n,))
    _check("residual", residual, tuple(x.shape))
    _check("x1", x1, tuple(x.shape))
    _check("rowscale", rowscale, tuple(x.shape[:-1]))
    if x1 is not None and rowscale is not None:
        raise ValueError("layer_norm_fn: arguments 'x1' and 'rowscale' cannot be given together")
    if bias1 is not None and weight1 is None:
        raise ValueError("layer_norm_fn: argument 'bias1' needs 'weight1'")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"layer_norm_fn: argument 'dropout_p' must be in [0, 1), got {dropout_p}")
    s = x.float()
    mask = mask1 = None
    if rowscale is not None:
        s = s * rowscale.float()[..., None]
    if dropout_p > 0.0:
        s, mask = _drop(s, dropout_p)
    if x1 is not None:
        s1 = x1.float()
        if dropout_p > 0.0:
            s1, mask1 = _drop(s1, dropout_p)
        s = s + s1
    if residual is not None:
        s = s + residual.float()
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    changed = residual is not None or dropout_p > 0.0 or rowscale is not None or x1 is not None
    residual_out = s.to(residual_dtype) if changed or residual_dtype != x.dtype else x
    out = _normed(s, weight, bias, eps, is_rms_norm).to(x.dtype)
    outs: tuple = (out,)
    if weight1 is not None:
        outs += (_normed(s, weight1, bias1, eps, is_rms_norm).to(x.dtype),)
    if prenorm:
        outs += (residual_out,)
    if return_dropout_mask:
        outs += (mask, mask1)
    return outs[0] if len(outs) == 1 else outs


def rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None = None, x1: torch.Tensor | None = None,
                weight1: torch.Tensor | None = None, bias1: torch.Tensor | None = None, eps: float = 1e-6,
                dropout_p: float = 0.0, rowscale: torch.Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False, return_dropout_mask: bool = False):
    """mamba-ssm's ``rms_norm_fn``: :func:`layer_norm_fn` with ``is_rms_norm=True``."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, True, return_dropout_mask)


def layer_norm_linear_fn(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None,
                         linear_weight: torch.Tensor, linear_bias: torch.Tensor | None,
                         residual: torch.Tensor | None = None, eps: float = 1e-6, prenorm: bool = False,
                         residual_in_fp32: bool = False, is_rms_norm: bool = False):
    """mamba-ssm's ``layer_norm_linear_fn``: :func:`layer_norm_fn` then a linear layer, ``x`` ``(..., N)`` ->
    ``(..., out_features)`` (with the residual stream when ``prenorm``)."""
    res = layer_norm_fn(x, norm_weight, norm_bias, residual=residual, eps=eps, prenorm=prenorm,
                        residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
    y, resid = res if prenorm else (res, None)
    w = linear_weight.to(y.dtype)
    out = linear(y, w, None if linear_bias is None else linear_bias.to(y.dtype))
    return (out, resid) if prenorm else out


def _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, dropout_mask,
               dropout_mask1, upcast, norm):
    dtype = x.dtype
    if upcast:
        x, weight = x.float(), weight.float()
        bias, residual, x1, weight1, bias1 = (None if t is None else t.float()
                                              for t in (bias, residual, x1, weight1, bias1))
    if rowscale is not None:
        x = x * rowscale[..., None]
    if dropout_p > 0.0:
        x = x.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p) if dropout_mask is not None else \
            F.dropout(x, p=dropout_p)
        if x1 is not None:
            x1 = x1.masked_fill(~dropout_mask1, 0.0) / (1.0 - dropout_p) if dropout_mask1 is not None else \
                F.dropout(x1, p=dropout_p)
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)
    outs: tuple = (norm(x, weight, bias).to(dtype),)
    if weight1 is not None:
        outs += (norm(x, weight1, bias1).to(dtype),)
    if prenorm:
        outs += (x,)
    return outs[0] if len(outs) == 1 else outs


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, dropout_mask=None, dropout_mask1=None, upcast=False):
    """mamba-ssm's ``layer_norm_ref``: the oracle of :func:`layer_norm_fn`, in the inputs' dtypes (fp32 with
    ``upcast``); ``dropout_mask``/``dropout_mask1`` replay given keep masks."""
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                      dropout_mask, dropout_mask1, upcast,
                      lambda s, w, b: _ln_ref(s.to(w.dtype), w, b, eps))


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, dropout_mask=None, dropout_mask1=None, upcast=False):
    """mamba-ssm's ``rms_norm_ref``: the oracle of :func:`rms_norm_fn` (see :func:`layer_norm_ref`)."""
    def norm(s, w, b):
        y = _rms_ref(s, w, eps)
        return y if b is None else y + b
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                      dropout_mask, dropout_mask1, upcast, norm)


class RMSNorm(nn.Module):
    """mamba-ssm's ``RMSNorm(hidden_size, eps=1e-5, dropout_p=0.0)``: parameter ``weight`` ``(hidden_size,)``
    (ones), ``bias`` None. ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)`` is
    :func:`rms_norm_fn` (dropout on ``x`` in training when ``dropout_p > 0``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.drop = nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):
        p = self.drop.p if self.drop is not None and self.training else 0.0
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps, dropout_p=p, prenorm=prenorm,
                           residual_in_fp32=residual_in_fp32)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same constructor and ``state_dict`` keys) whose ``forward(x, residual=None,
    prenorm=False, residual_in_fp32=False)`` is :func:`layer_norm_fn` over the last dimension."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):
        if len(self.normalized_shape) != 1 or self.weight is None:
            raise ValueError("LayerNorm: the residual form needs one normalized dimension and an affine weight, "
                             f"got normalized_shape={tuple(self.normalized_shape)}, "
                             f"elementwise_affine={self.weight is not None}")
        return layer_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm,
                             residual_in_fp32=residual_in_fp32)
