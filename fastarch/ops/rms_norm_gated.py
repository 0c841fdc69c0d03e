"""Gated, grouped RMS normalisation, mamba-ssm's ``rmsnorm_fn`` (``layernorm_gated``), as Mamba-2 uses it.

Over groups of ``group_size`` channels of the last dimension (one group when ``group_size`` is None)::

    norm(v) = v / sqrt(mean_group(v^2) + eps) * weight (+ bias)
    norm_before_gate=True:  out = norm(x) * silu(z)
    norm_before_gate=False: out = norm(x * silu(z))
    z is None:              out = norm(x)

Backends: ``cpp`` (one fused pass per row, reading ``x`` and ``z`` in place whatever their row stride) and
``torch`` (the composition around :func:`fastarch.ops.rms_norm`, so it runs on that op's backends on every
device; the gate and the per-group weight are elementwise fp32 PyTorch). The math is fp32; the result is in
``x.dtype``. The forward also yields the per-group ``rstd`` (fp32, ``(rows, N / group_size)``) that every
backend's backward accepts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import register
from ._backends import CppImplementation, TorchImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward
from .layer_norm import layer_norm, layer_norm_ref
from .rms_norm import _rms_norm_bwd, _rms_norm_fwd, rms_norm_ref

__all__ = ["layer_norm_gated", "layer_norm_gated_ref", "rms_norm_gated", "rms_norm_gated_ref"]

OP = "rms_norm_gated"


def _validate(x, weight, bias, z, eps, group_size, op: str = OP) -> int:
    check_tensor(op, "x", x)
    if x.dim() < 1:
        fail(op, "argument 'x' must have at least 1 dimension")
    n = x.shape[-1]
    check_tensor(op, "weight", weight, shape=(n,))
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(n,))
    if z is not None:
        check_tensor(op, "z", z, shape=tuple(x.shape))
    gs = n if group_size is None else group_size
    if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1 or n % gs != 0:
        fail(op, f"argument 'group_size' must be a positive int dividing the last dimension {n}, got {group_size!r}")
    if not eps >= 0:
        fail(op, f"argument 'eps' must be >= 0, got {eps}")
    check_same_device(op, "x", x, weight=weight, bias=bias, z=z)
    return gs


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (rows, N) with a contiguous last dimension: a view where one exists (any row stride)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _call(x: torch.Tensor, z: torch.Tensor | None, group_size: int):
    return call_of(x, n=x.shape[-1], group_size=group_size, z_dtype=None if z is None else z.dtype)


def rms_norm_gated_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                       norm_before_gate: bool = True) -> torch.Tensor:
    """The oracle: the module docstring's formula on :func:`fastarch.ops.rms_norm_ref`, in fp32."""
    gs = _validate(x, weight, bias, z, eps, group_size)
    xf = x.float()
    gate = None if z is None else F.silu(z.float())
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    n = x.shape[-1]
    y = rms_norm_ref(xf.unflatten(-1, (n // gs, gs)), None, eps).flatten(-2) * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


@torch.library.custom_op("fastarch::rms_norm_gated_fwd", mutates_args=())
def _rms_norm_gated_fwd(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float, group_size: int, norm_before_gate: bool, backend: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = run(OP, "forward", _call(x, z, group_size), backend, _rows(x), None if z is None else _rows(z),
                  weight, bias, eps, group_size, norm_before_gate)
    return y.view(x.shape), rstd


@_rms_norm_gated_fwd.register_fake
def _(x, z, weight, bias, eps, group_size, norm_before_gate, backend):
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    return x.new_empty(x.shape), x.new_empty(rows, n // group_size, dtype=torch.float32)


@torch.library.custom_op("fastarch::rms_norm_gated_bwd", mutates_args=())
def _rms_norm_gated_bwd(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                        bias: torch.Tensor | None, rstd: torch.Tensor, group_size: int, norm_before_gate: bool,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dz, dweight, dbias): dx, dz contiguous in x's and z's dtypes (dz empty without z), dweight and
    dbias fp32 (dbias empty without bias)."""
    dx, dz, dw, db = run_backward(OP, _call(x, z, group_size), backend, _rows(dy), _rows(x),
                                  None if z is None else _rows(z), weight, bias, rstd, group_size, norm_before_gate)
    return dx.view(x.shape), (dz.view(z.shape) if z is not None else dz), dw, db


@_rms_norm_gated_bwd.register_fake
def _(dy, x, z, weight, bias, rstd, group_size, norm_before_gate, backend):
    n = x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty(0) if z is None else z.new_empty(z.shape),
            x.new_empty(n, dtype=torch.float32), x.new_empty(0 if bias is None else n, dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    x, z, weight, bias, eps, group_size, norm_before_gate, backend = inputs
    ctx.save_for_backward(x, z, weight, bias, output[1])
    ctx.group_size, ctx.norm_before_gate, ctx.backend = group_size, norm_before_gate, backend


def _backward(ctx, dy, _drstd):
    x, z, weight, bias, rstd = ctx.saved_tensors
    dx, dz, dw, db = _rms_norm_gated_bwd(dy, x, z, weight, bias, rstd, ctx.group_size, ctx.norm_before_gate,
                                         ctx.backend)
    return (dx, None if z is None else dz, dw.to(weight.dtype), None if bias is None else db.to(bias.dtype),
            None, None, None, None)


_rms_norm_gated_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                   norm_before_gate: bool = True, *, backend: str | None = None) -> torch.Tensor:
    """Gated, grouped RMS normalisation (see the module docstring); mamba-ssm's ``rmsnorm_fn`` arguments.

    Args:
        x: the input, normalised over groups of its last dimension.
        weight: the scale, one per channel.
        bias: optional shift, one per channel (mamba-ssm's RMSNorm has none).
        z: optional gate, in ``x``'s shape.
        eps: added to each group's mean square.
        group_size: channels per group (dividing the last dimension); None for one group.
        norm_before_gate: ``norm(x) * silu(z)`` when True, ``norm(x * silu(z))`` when False.
        backend: force 'cpp' or 'torch' (default: the selector's choice). This names a backend of this op;
            the ``torch`` backend's inner :func:`fastarch.ops.rms_norm` follows the selector, so
            ``fastarch.use_backend(rms_norm=...)`` chooses that op's backend.

    Returns:
        The output in ``x``'s shape and dtype; differentiable in ``x``, ``weight``, ``bias`` and ``z``.

    Shapes:
        x, z, out: ``(..., N)``; weight, bias: ``(N,)``. A last dimension of stride 1 with any outer strides
        (for instance a slice of a wider projection) is read in place by the ``cpp`` backend.
    """
    gs = _validate(x, weight, bias, z, eps, group_size)
    if x.numel() == 0:
        return rms_norm_gated_ref(x, weight, bias, z, eps, gs, norm_before_gate)
    name = resolve(OP, lambda: _call(x, z, gs), backend)
    return _rms_norm_gated_fwd(x, z, weight, bias, float(eps), gs, bool(norm_before_gate), name)[0]


def _silu_and_derivative(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(z) and silu'(z) = s (1 + z (1 - s)), s = sigmoid(z), in fp32."""
    zf = z.float()
    s = torch.sigmoid(zf)
    return zf * s, s * (1 + zf * (1 - s))


class TorchRMSNormGated(TorchImplementation):
    op = OP
    description = "composed PyTorch in fp32 around rms_norm (which runs on its own backends)"

    def forward(self, x, z, weight, bias, eps, group_size, norm_before_gate):
        """x, z: (rows, N) -> y (rows, N) in x's dtype, rstd (rows, N / group_size) fp32."""
        rows, n = x.shape
        u = x.float()
        gate = None if z is None else F.silu(z.float())
        if gate is not None and not norm_before_gate:
            u = gate.mul_(u)  # a buffer this function made: one allocation fewer
            gate = None
        one_group = group_size == n
        u2 = u.reshape(-1, group_size)
        w = weight.float()
        inner = resolve("rms_norm", lambda: call_of(u2, n=group_size), None)
        y, rstd = _rms_norm_fwd(u2, w if one_group else None, float(eps), inner)
        y = y.view(rows, n)
        if not one_group:
            y = y.mul_(w)
        if bias is not None:
            y = y.add_(bias.float())
        if gate is not None:
            y = y.mul_(gate)
        return y.to(x.dtype), rstd.view(rows, n // group_size)

    @staticmethod
    def backward(dy, x, z, weight, bias, rstd, group_size, norm_before_gate):
        """The backward from the forward's ``rstd``: the gate and the per-group weight in fp32 PyTorch, the
        normalisation's own gradient on :func:`fastarch.ops.rms_norm`'s backward. (dx, dz, dweight, dbias)."""
        rows, n = x.shape
        xf, g, w = x.float(), dy.float(), weight.float()
        silu, dsilu = _silu_and_derivative(z) if z is not None else (None, None)
        u = (xf * silu if z is not None and not norm_before_gate else xf).reshape(-1, group_size)
        n_hat = (u * rstd.reshape(-1, 1)).view(rows, n)
        dz = x.new_empty(0)
        if z is not None and norm_before_gate:
            pre = n_hat * w if bias is None else n_hat * w + bias.float()
            dz = (g * pre * dsilu).to(z.dtype)
            g = g * silu
        dw = (g * n_hat).sum(0)
        db = g.sum(0) if bias is not None else x.new_empty(0, dtype=torch.float32)
        inner = resolve("rms_norm", lambda: call_of(u, n=group_size), None)
        du = _rms_norm_bwd((g * w).reshape(-1, group_size), u, None, rstd.reshape(-1), inner)[0].view(rows, n)
        if z is not None and not norm_before_gate:
            dz = (du * xf * dsilu).to(z.dtype)
            du = du * silu
        return du.to(x.dtype), dz, dw, db


class CppRMSNormGated(CppImplementation):
    op, extension = OP, "norms"
    description = "fused C++ kernel, one pass per row, OpenMP over rows; strided rows read in place"

    def check(self, call):
        zt = call.get("z_dtype")
        if zt is not None and zt != call.dtype:
            return [f"z dtype {str(zt).replace('torch.', '')} differs from x dtype "
                    f"{str(call.dtype).replace('torch.', '')}"]
        return []

    def forward(self, x, z, weight, bias, eps, group_size, norm_before_gate):
        return tuple(self.lib.rms_norm_gated_fwd(x, z, weight, bias, eps, group_size, norm_before_gate))

    def backward(self, dy, x, z, weight, bias, rstd, group_size, norm_before_gate):
        return tuple(self.lib.rms_norm_gated_bwd(dy, x, z, weight, bias, rstd, group_size, norm_before_gate))


for _impl in (TorchRMSNormGated, CppRMSNormGated):
    register(_impl)


# -- the layer-norm variant ---------------------------------------------------------------------------------
OP_LN = "layer_norm_gated"


def _layer_norm_gated(x, weight, bias, z, eps, gs, norm_before_gate, norm) -> torch.Tensor:
    """The gated, grouped layer norm with ``norm`` (:func:`layer_norm` or its reference) per group, in fp32."""
    xf = x.float()
    gate = None if z is None else F.silu(z.float())
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    n = x.shape[-1]
    y = norm(xf.unflatten(-1, (n // gs, gs)), None, None, eps).flatten(-2) * weight.float()
    if bias is not None:
        y = y + bias.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def layer_norm_gated_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                         norm_before_gate: bool = True, is_rms_norm: bool = False) -> torch.Tensor:
    """The oracle of :func:`layer_norm_gated`, on :func:`fastarch.ops.layer_norm_ref` (or
    :func:`rms_norm_gated_ref`), in fp32."""
    if is_rms_norm:
        return rms_norm_gated_ref(x, weight, bias, z, eps, group_size, norm_before_gate)
    gs = _validate(x, weight, bias, z, eps, group_size, OP_LN)
    return _layer_norm_gated(x, weight, bias, z, eps, gs, norm_before_gate, layer_norm_ref)


def layer_norm_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                     norm_before_gate: bool = True, is_rms_norm: bool = False) -> torch.Tensor:
    """Gated, grouped layer (or RMS) normalisation, mamba-ssm's ``layernorm_fn`` arguments::

        norm(v) = (v - mean_group(v)) / sqrt(var_group(v) + eps) * weight (+ bias)   (is_rms_norm: no mean)
        norm_before_gate: out = norm(x) * silu(z);  else out = norm(x * silu(z));  z None: out = norm(x)

    Args:
        x: the input, normalised over groups of its last dimension.
        weight: the scale, one per channel.
        bias: optional shift, one per channel.
        z: optional gate, in ``x``'s shape.
        eps: added to each group's (biased) variance, or mean square with ``is_rms_norm``.
        group_size: channels per group (dividing the last dimension); None for one group.
        norm_before_gate: gate after the norm when True, before it when False.
        is_rms_norm: :func:`rms_norm_gated` instead of the layer norm.

    Returns:
        The output in ``x``'s shape and dtype (fp32 math); differentiable in ``x``, ``weight``, ``bias`` and
        ``z``.

    Shapes:
        x, z, out: ``(..., N)``; weight, bias: ``(N,)``.
    """
    if is_rms_norm:
        return rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate)
    gs = _validate(x, weight, bias, z, eps, group_size, OP_LN)
    return _layer_norm_gated(x, weight, bias, z, eps, gs, norm_before_gate, layer_norm)
