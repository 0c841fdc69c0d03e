"""flash-attn's ``flash_attn.ops.triton.layer_norm`` on :func:`fastarch.ops.layer_norm` and
:func:`fastarch.ops.rms_norm`: dropout + residual add + LayerNorm/RMSNorm in one call.

``layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False, return_dropout_mask=False, out=None,
residual_out=None)`` and ``rms_norm_fn`` (the same without ``is_rms_norm``) compute, on rows of ``(..., N)``::

    h = dropout(x * rowscale) [+ dropout(x1)] [+ residual]        # fp32
    y = norm(h) * weight + bias  [, y1 = norm(h) * weight1 + bias1]

and return flash-attn's tuple: ``y`` (``(y, y1)`` with ``weight1``), then the pre-norm sum ``h`` (in
``residual``'s dtype, fp32 with ``residual_in_fp32``, else ``x``'s) when ``prenorm``, then the boolean keep masks
of ``x`` and ``x1`` (None where there is no dropout / no ``x1``) when ``return_dropout_mask``. Outputs are in
``x``'s dtype. Differentiable in ``x``, ``residual``, ``x1`` and the weights and biases. Dropout draws from
torch's generator. ``RMSNorm`` and ``LayerNorm`` are the modules; ``layer_norm_ref``/``rms_norm_ref`` are
flash-attn's reference functions (on fastarch's fp32 oracles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .....ops.layer_norm import layer_norm, layer_norm_ref
from .....ops.rms_norm import rms_norm, rms_norm_ref
from ..._missing import missing_attribute

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "layer_norm_fn",
    "layer_norm_linear_fn",
    "layer_norm_ref",
    "rms_norm_fn",
    "rms_norm_ref",
]

__getattr__ = missing_attribute("flash_attn.ops.triton.layer_norm")

_ref_layer_norm, _ref_rms_norm = layer_norm_ref, rms_norm_ref


def _fail(msg: str) -> None:
    raise ValueError(f"flash_attn layer_norm_fn: {msg}")


def _check(x: Tensor, weight: Tensor | None, **others: Tensor | None) -> None:
    if not isinstance(x, Tensor) or x.ndim < 1:
        _fail(f"'x' must be a tensor (..., N), got {type(x).__name__}")
    N = x.shape[-1]
    for name, t in others.items():
        if t is None:
            continue
        want = (N,) if name in ("weight1", "bias", "bias1", "colscale") else tuple(x.shape[:-1]) \
            if name == "rowscale" else tuple(x.shape)
        if tuple(t.shape) != want and not (name == "rowscale" and t.numel() == x[..., 0].numel()):
            _fail(f"'{name}' must have shape {want}, got {tuple(t.shape)}")
    if weight is not None and tuple(weight.shape) != (N,):
        _fail(f"'weight' must have shape ({N},), got {tuple(weight.shape)}")


def _dropped(t: Tensor, p: float, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    if p <= 0.0:
        return t, None
    keep = torch.rand_like(t) > p if mask is None else mask.bool()
    return torch.where(keep, t / (1.0 - p), torch.zeros((), dtype=t.dtype, device=t.device)), keep


def _normed(h: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, is_rms_norm: bool, reference: bool
            ) -> Tensor:
    """``norm(h) * weight + bias`` in fp32 (``h`` fp32) through the fastarch op (or its oracle)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    if is_rms_norm:
        y = (_ref_rms_norm if reference else rms_norm)(h, w, eps)
        return y + b if b is not None else y
    return (_ref_layer_norm if reference else layer_norm)(h, w, b, eps)


def _fused(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, colscale, residual_in_fp32,
           is_rms_norm, masks=(None, None), reference=False):
    """-> (y, y1, residual_out (``x`` itself when nothing was added or cast), mask, mask1)."""
    _check(x, weight, bias=bias, residual=residual, x1=x1, weight1=weight1, bias1=bias1, rowscale=rowscale,
           colscale=colscale)
    if x1 is not None and rowscale is not None:
        _fail("'rowscale' is not supported together with 'x1'")
    if not 0.0 <= float(dropout_p) < 1.0:
        _fail(f"'dropout_p' must be in [0, 1), got {dropout_p}")
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    h = x.float()
    if rowscale is not None:
        h = h * rowscale.reshape(x.shape[:-1]).float()[..., None]
    if colscale is not None:
        h = h * colscale.float()
    h, mask = _dropped(h, dropout_p, masks[0])
    mask1 = None
    if x1 is not None:
        h1, mask1 = _dropped(x1.float(), dropout_p, masks[1])
        h = h + h1
    if residual is not None:
        h = h + residual.float()
    added = (residual is not None or residual_dtype != x.dtype or dropout_p > 0.0 or rowscale is not None
             or colscale is not None or x1 is not None)
    y = _normed(h, weight, bias, eps, is_rms_norm, reference).to(x.dtype)
    y1 = _normed(h, weight1, bias1, eps, is_rms_norm, reference).to(x.dtype) if weight1 is not None else None
    return y, y1, (h.to(residual_dtype) if added else x), mask, mask1


def layer_norm_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
):
    """Dropout, residual add and LayerNorm (RMSNorm with ``is_rms_norm``); see the module docstring.

    Shapes: x, residual, x1, out, residual_out ``(..., N)``; weight, bias, weight1, bias1 ``(N,)``; rowscale
    ``(...)``. Returns y ``(..., N)`` or the tuple described in the module docstring.
    """
    y, y1, res, mask, mask1 = _fused(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None,
                                     residual_in_fp32, is_rms_norm)
    if out is not None:
        y = out.copy_(y)
    if residual_out is not None and res is not x:
        res = residual_out.copy_(res)
    outs: list = [y] if weight1 is None else [y, y1]
    if prenorm:
        outs.append(res)
    if return_dropout_mask:
        outs += [mask, mask1]
    return outs[0] if len(outs) == 1 else tuple(outs)


def rms_norm_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    residual: Tensor | None = None,
    x1: Tensor | None = None,
    weight1: Tensor | None = None,
    bias1: Tensor | None = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
):
    """:func:`layer_norm_fn` with ``is_rms_norm=True``."""
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, True, return_dropout_mask, out, residual_out)


def _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, dropout_mask,
               dropout_mask1, upcast, is_rms_norm):
    y, y1, res, _, _ = _fused(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, None, False,
                              is_rms_norm, (dropout_mask, dropout_mask1), reference=True)
    if res is not x:
        res = res.to(torch.float32 if upcast else x.dtype)
    outs = [y] if weight1 is None else [y, y1]
    if prenorm:
        outs.append(res)
    return outs[0] if len(outs) == 1 else tuple(outs)


def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, dropout_mask=None, dropout_mask1=None, upcast=False):
    """flash-attn's reference for :func:`layer_norm_fn` on fastarch's fp32 oracle; with ``dropout_p > 0`` pass the
    keep masks returned by ``layer_norm_fn(..., return_dropout_mask=True)`` to reproduce its dropout."""
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, dropout_mask,
                      dropout_mask1, upcast, False)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, dropout_mask=None, dropout_mask1=None, upcast=False):
    """flash-attn's reference for :func:`rms_norm_fn` (see :func:`layer_norm_ref`)."""
    return _reference(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm, dropout_mask,
                      dropout_mask1, upcast, True)


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6,
                         prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """``F.linear`` of :func:`layer_norm_fn`'s output; returns ``out`` or ``(out, residual_out)`` with
    ``prenorm``. Shapes: x ``(..., N)``, linear_weight ``(M, N)`` -> ``(..., M)``."""
    y, _, res, _, _ = _fused(x, norm_weight, norm_bias, residual, None, None, None, eps, 0.0, None, None,
                             residual_in_fp32, is_rms_norm)
    out = F.linear(y.to(linear_weight.dtype), linear_weight, linear_bias)
    return (out, res) if prenorm else out


class RMSNorm(torch.nn.Module):
    """flash-attn's Triton ``RMSNorm`` module: ``weight`` ``(hidden_size,)`` (ones), no bias, optional dropout
    before the residual add. ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)`` as
    :func:`rms_norm_fn`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.drop = torch.nn.Dropout(dropout_p) if dropout_p > 0.0 else None
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                           prenorm=prenorm, residual_in_fp32=residual_in_fp32)


class LayerNorm(RMSNorm):
    """The LayerNorm counterpart of :class:`RMSNorm`: ``weight`` (ones) and ``bias`` (zeros) ``(hidden_size,)``;
    ``forward(x, residual=None, prenorm=False, residual_in_fp32=False)`` as :func:`layer_norm_fn`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dropout_p: float = 0.0, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, dropout_p, device, dtype)
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False,
                residual_in_fp32: bool = False):
        return layer_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                             dropout_p=self.drop.p if self.drop is not None and self.training else 0.0,
                             prenorm=prenorm, residual_in_fp32=residual_in_fp32)
