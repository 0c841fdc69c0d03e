"""Fused layer normalisation over the last dimension, with the seed guide's variant as an option.

``layer_norm(x, weight, bias, eps)`` normalises each row of ``x`` (``(..., N)``):

- standard (``torch.nn.LayerNorm``): ``y = (x - mean) / sqrt(var_biased + eps) * weight + bias``;
- ``unbiased=True, eps_inside_sqrt=False`` (the guide-003 ``LayerNorm``):
  ``y = (x - mean) / (std_unbiased + eps) * weight + bias``.

Backends: ``aten`` (``native_layer_norm``, the standard mode only), ``cpp`` (fused OpenMP kernel),
``triton`` and ``torch`` (composed PyTorch in fp32). Each returns the output plus per-row ``mean`` and
``rstd`` (fp32, ``(rows,)``) that any backend's backward can use.
"""

from __future__ import annotations

import torch

from ..backend import Call, choose, register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import FLOAT_DTYPES, check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, dispatch, run_backward

__all__ = ["layer_norm", "layer_norm_ref"]

OP = "layer_norm"


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    unbiased: bool = False,
    eps_inside_sqrt: bool = True,
) -> torch.Tensor:
    """The oracle: composed PyTorch in fp32, cast back to ``x.dtype``."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = xf.var(-1, keepdim=True, unbiased=unbiased)
    denom = torch.sqrt(var + eps) if eps_inside_sqrt else torch.sqrt(var) + eps
    y = (xf - mean) / denom
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _validate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> None:
    if _plainly_valid(x, weight, bias, eps):
        return
    check_tensor(OP, "x", x)
    if x.dim() < 1:
        fail(OP, "argument 'x' must have at least 1 dimension")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(OP, name, t, ndim=1)
            if t.shape[0] != n:
                fail(OP, f"argument '{name}' has shape {tuple(t.shape)} but the normalized shape is ({n},)")
    check_same_device(OP, "x", x, weight=weight, bias=bias)
    check_same_dtype(OP, "x", x, weight=weight, bias=bias)
    if not eps >= 0:
        fail(OP, f"argument 'eps' must be >= 0, got {eps}")


def _plainly_valid(x, weight, bias, eps) -> bool:
    """The usual call, accepted in a few attribute reads; anything else goes through the checks that name
    what is wrong."""
    if not (isinstance(x, torch.Tensor) and x.dim() >= 1 and x.dtype in FLOAT_DTYPES
            and isinstance(eps, (int, float)) and eps >= 0):
        return False
    n, dt, dev = x.shape[-1], x.dtype, x.device
    return all(t is None or (isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] == n and t.dtype == dt
                             and t.device == dev) for t in (weight, bias))


def _mode(unbiased: bool, eps_inside_sqrt: bool) -> int:
    # 0: torch.nn.LayerNorm; 1: unbiased std with eps outside the root (the guide's); others by the bits.
    return int(unbiased) | (0 if eps_inside_sqrt else 2)


def _call(x: torch.Tensor, mode: int) -> Call:
    return call_of(x, n=x.shape[-1], mode=mode)


# -- the custom ops ---------------------------------------------------------------------------------------
@torch.library.custom_op("fastarch::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, mode: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(choose(OP, _call(x, mode), backend), x, weight, bias, eps, mode)


def _forward(impl, x, weight, bias, eps: float, mode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = impl.forward(x.reshape(-1, x.shape[-1]).contiguous(), weight, bias, eps, mode)
    return y.view(x.shape), mean, rstd


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps, mode, backend):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # contiguous, as the backends return it (they work on a contiguous (rows, N) copy)
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("fastarch::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    mode: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    dy2 = dy.reshape(-1, n).contiguous()
    x2 = x.reshape(-1, n).contiguous()
    dx, dw, db = run_backward(OP, _call(x, mode), backend, dy2, x2, weight, mean, rstd, eps, mode)
    return dx.view(x.shape), dw, db


@_layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, eps, mode, backend):
    n = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, eps, mode, backend = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.eps, ctx.mode, ctx.backend = eps, mode, backend
    ctx.has_bias = bias is not None


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd, ctx.eps, ctx.mode, ctx.backend)
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(x.dtype) if ctx.has_bias else None
    return dx, dw, db, None, None, None


_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    unbiased: bool = False,
    eps_inside_sqrt: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Layer normalisation over the last dimension.

    Args:
        x: the input; normalised over its last dimension.
        weight: optional scale.
        bias: optional shift.
        eps: added to the variance (or to the standard deviation when ``eps_inside_sqrt=False``).
        unbiased: use the N-1 variance instead of the biased one.
        eps_inside_sqrt: ``sqrt(var + eps)`` when True (``torch.nn.LayerNorm``), ``std + eps`` when False.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The normalised tensor, in ``x``'s shape and dtype; differentiable in ``x``, ``weight`` and ``bias``.

    Shapes:
        x: ``(..., N)``; weight, bias: ``(N,)``; output: ``(..., N)``.
    """
    _validate(x, weight, bias, eps)
    if x.numel() == 0:
        return layer_norm_ref(x, weight, bias, eps, unbiased=unbiased, eps_inside_sqrt=eps_inside_sqrt)
    mode = _mode(unbiased, eps_inside_sqrt)
    impl, name = dispatch(OP, lambda: _call(x, mode), backend, x, weight, bias)
    if impl is not None:
        return impl.infer(x, weight, bias, float(eps), mode)
    y, _, _ = _layer_norm_fwd(x, weight, bias, float(eps), mode, name)
    return y


# -- backends ---------------------------------------------------------------------------------------------
def _row_stats(xf: torch.Tensor, eps: float, mode: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, rstd, d rstd / d var) per row, fp32."""
    n = xf.shape[-1]
    mean = xf.mean(-1)
    xc = xf - mean[:, None]
    ss = (xc * xc).sum(-1)
    var = ss / max(n - 1, 1) if mode & 1 else ss / n
    if mode & 2:
        std = var.sqrt()
        rstd = 1.0 / (std + eps)
        # d(1/(sqrt(v)+eps))/dv; zero-variance rows have xc == 0, so their term vanishes anyway.
        drstd = torch.where(std > 0, -rstd * rstd / (2 * std.clamp_min(1e-30)), torch.zeros_like(std))
    else:
        rstd = torch.rsqrt(var + eps)
        drstd = -0.5 * rstd**3
    return mean, rstd, drstd


class _OutputOnly:
    """``infer``: the output alone (no statistics), for calls that record no gradient."""

    def infer(self, x, weight, bias, eps, mode):
        return _forward(self, x, weight, bias, eps, mode)[0]


class TorchLayerNorm(_OutputOnly, TorchImplementation):
    op = OP
    description = "composed PyTorch in fp32"

    def forward(self, x, weight, bias, eps, mode):
        xf = x.float()
        mean, rstd, _ = _row_stats(xf, eps, mode)
        y = (xf - mean[:, None]) * rstd[:, None]
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype), mean, rstd

    def backward(self, dy, x, weight, mean, rstd, eps, mode):
        n = x.shape[-1]
        xf, g = x.float(), dy.float()
        _, rstd, drstd = _row_stats(xf, eps, mode)
        xc = xf - mean[:, None]
        xhat = xc * rstd[:, None]
        dw = (g * xhat).sum(0)
        db = g.sum(0)
        if weight is not None:
            g = g * weight.float()
        c = (n - 1 if mode & 1 else n) or 1
        dx = rstd[:, None] * (g - g.mean(-1, keepdim=True)) + xc * (
            (g * xc).sum(-1, keepdim=True) * drstd[:, None] * (2.0 / c)
        )
        return dx.to(x.dtype), dw, db


class AtenLayerNorm(_OutputOnly, AtenImplementation):
    op = OP
    description = "PyTorch's native_layer_norm and its backward (the torch.nn.LayerNorm mode only)"

    def check(self, call):
        return [] if call.get("mode", 0) == 0 else ["only the torch.nn.LayerNorm mode (biased variance, "
                                                    "eps inside the root)"]

    def infer(self, x, weight, bias, eps, mode):
        return torch.layer_norm(x, [x.shape[-1]], weight, bias, eps, False)

    def forward(self, x, weight, bias, eps, mode):
        y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], weight, bias, eps)
        return y, mean.float().view(-1), rstd.float().view(-1)

    def backward(self, dy, x, weight, mean, rstd, eps, mode):
        # The native kernel on CPU keeps its statistics in x's dtype, on CUDA in fp32.
        stat = x.dtype if x.device.type == "cpu" else torch.float32
        mean, rstd = (t.to(stat).view(-1, 1) for t in (mean, rstd))
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, x, [x.shape[-1]], mean, rstd, weight, weight, [True, weight is not None, weight is not None])
        if weight is None:  # the gradients of absent parameters are discarded
            dw, db = (torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device) for _ in range(2))
        return dx, dw.float(), db.float()


class CppLayerNorm(_OutputOnly, CppImplementation):
    op, extension = OP, "norms"
    description = "fused C++ kernel, OpenMP over rows, fp32 accumulation"

    def forward(self, x, weight, bias, eps, mode):
        return tuple(self.lib.layer_norm_fwd(x, weight, bias, eps, mode))

    def backward(self, dy, x, weight, mean, rstd, eps, mode):
        return tuple(self.lib.layer_norm_bwd(dy, x, weight, mean, eps, mode))


class TritonLayerNorm(_OutputOnly, TritonImplementation):
    op, kernel_module = OP, "norms"
    limits = {"n": 65536}
    description = "Triton row kernels, one row per program"

    def forward(self, x, weight, bias, eps, mode):
        return self.lib.layer_norm_fwd(x, weight, bias, eps, mode)

    def backward(self, dy, x, weight, mean, rstd, eps, mode):
        return self.lib.layer_norm_bwd(dy, x, weight, mean, eps, mode)


for _impl in (TorchLayerNorm, AtenLayerNorm, CppLayerNorm, TritonLayerNorm):
    register(_impl)
