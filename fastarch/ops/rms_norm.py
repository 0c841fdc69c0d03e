"""Fused RMS normalisation over the last dimension: ``y = x / sqrt(mean(x^2) + eps) * weight``.

Backends: ``aten`` (``_fused_rms_norm``, what ``F.rms_norm`` runs), ``cpp``, ``triton`` and ``torch``
(composed PyTorch in fp32). The forward also yields the per-row ``rstd`` (fp32) that every backend's
backward accepts.
"""

from __future__ import annotations

import torch

from ..backend import choose, register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, dispatch, run_backward

__all__ = ["rms_norm", "rms_norm_ref"]

OP = "rms_norm"


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """The oracle, composed PyTorch in fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def _validate(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> None:
    check_tensor(OP, "x", x)
    if x.dim() < 1:
        fail(OP, "argument 'x' must have at least 1 dimension")
    if weight is not None:
        check_tensor(OP, "weight", weight, ndim=1)
        if weight.shape[0] != x.shape[-1]:
            fail(OP, f"argument 'weight' has shape {tuple(weight.shape)} but the normalized shape is "
                     f"({x.shape[-1]},)")
    check_same_device(OP, "x", x, weight=weight)
    check_same_dtype(OP, "x", x, weight=weight)
    if not eps >= 0:
        fail(OP, f"argument 'eps' must be >= 0, got {eps}")


def _forward(impl, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = impl.forward(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)
    return y.view(x.shape), rstd


@torch.library.custom_op("fastarch::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float, backend: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(choose(OP, call_of(x, n=x.shape[-1]), backend), x, weight, eps)


@_rms_norm_fwd.register_fake
def _(x, weight, eps, backend):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)  # contiguous, as the backends return


@torch.library.custom_op("fastarch::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                  backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    dx, dw = run_backward(OP, call_of(x, n=n), backend, dy.reshape(-1, n).contiguous(),
                          x.reshape(-1, n).contiguous(), weight, rstd)
    return dx.view(x.shape), dw


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, backend):
    return x.new_empty(x.shape), x.new_empty(x.shape[-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend = backend


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd(dy, x, weight, rstd, ctx.backend)
    return dx, (dw.to(weight.dtype) if weight is not None else None), None, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """RMS normalisation over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        x: the input; normalised over its last dimension.
        weight: optional scale.
        eps: added to the mean square.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The normalised tensor, in ``x``'s shape and dtype; differentiable in ``x`` and ``weight``.

    Shapes:
        x: ``(..., N)``; weight: ``(N,)``; output: ``(..., N)``.
    """
    _validate(x, weight, eps)
    if x.numel() == 0:
        return rms_norm_ref(x, weight, eps)
    impl, name = dispatch(OP, lambda: call_of(x, n=x.shape[-1]), backend, x, weight)
    if impl is not None:
        return _forward(impl, x, weight, eps)[0]
    return _rms_norm_fwd(x, weight, float(eps), name)[0]


def _composed_backward(dy, x, weight, rstd):
    """(dx, dw fp32) from the forward's ``rstd``, in composed PyTorch."""
    xf, g = x.float(), dy.float()
    dw = (g * xf * rstd[:, None]).sum(0)
    if weight is not None:
        g = g * weight.float()
    k = rstd**3 * (g * xf).mean(-1)
    dx = rstd[:, None] * g - xf * k[:, None]
    return dx.to(x.dtype), dw


class TorchRMSNorm(TorchImplementation):
    op = OP
    description = "composed PyTorch in fp32"

    def forward(self, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        y = xf * rstd[:, None]
        if weight is not None:
            y = y * weight.float()
        return y.to(x.dtype), rstd

    backward = staticmethod(_composed_backward)


class AtenRMSNorm(AtenImplementation):
    op = OP
    description = ("PyTorch's _fused_rms_norm (what F.rms_norm runs); the backward is composed, as PyTorch "
                   "has no native CPU kernel for it")

    def forward(self, x, weight, eps):
        y, rstd = torch._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd.float().view(-1)

    backward = staticmethod(_composed_backward)


class CppRMSNorm(CppImplementation):
    op, extension = OP, "norms"
    description = "fused C++ kernel, OpenMP over rows"

    def forward(self, x, weight, eps):
        return tuple(self.lib.rms_norm_fwd(x, weight, eps))

    def backward(self, dy, x, weight, rstd):
        return tuple(self.lib.rms_norm_bwd(dy, x, weight, rstd))


class TritonRMSNorm(TritonImplementation):
    op, kernel_module = OP, "norms"
    limits = {"n": 65536}
    description = "Triton row kernels"

    def forward(self, x, weight, eps):
        return self.lib.rms_norm_fwd(x, weight, eps)

    def backward(self, dy, x, weight, rstd):
        return self.lib.rms_norm_bwd(dy, x, weight, rstd)


for _impl in (TorchRMSNorm, AtenRMSNorm, CppRMSNorm, TritonRMSNorm):
    register(_impl)
