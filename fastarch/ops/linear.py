"""Linear layer ``y = x W^T + b`` (``torch.nn.functional.linear``), with a C++ kernel for a few rows.

A decode step multiplies one token (a few rows of ``x``) by every weight matrix of the model, so its time is
the time to read the weights from memory. PyTorch's BLAS call for a matrix-vector product on CPU reads them
well below the memory bandwidth; the ``cpp`` kernel streams each weight row once, with independent
accumulators per row, and splits the rows over threads for large matrices.

A prefill multiplies many rows, where the matrix product's speed is everything. PyTorch's fp32 ``F.linear`` on
CPU goes to its BLAS (MKL in the x86 wheels), whose kernels on AMD processors stay on narrower vector paths;
oneDNN, which PyTorch also ships (the library behind ``torch.compile``'s CPU linear), compiles its fp32 GEMM
for the instruction set it finds. So on CPU in fp32 the ``aten`` backend runs oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``): the same fp32 arithmetic in another summation order.

Backends: ``cpp`` (CPU, fp32, up to :data:`CPP_MAX_ROWS` rows, contiguous weight), ``aten`` (oneDNN's
linear for fp32 CPU calls with a contiguous weight where PyTorch has it and ``torch.backends.mkldnn`` is
enabled, ``F.linear`` for every other call) and ``torch`` (fp32 matmul, the reference's arithmetic). Every
backend's backward is the same pair of matrix products and a sum (``aten``: on oneDNN where its forward is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..backend import FLOAT_DTYPES, Call, choose, register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation
from ._checks import check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, dispatch, run_backward

__all__ = ["linear", "linear_ref"]

OP = "linear"
CPP_MAX_ROWS = 16  # rows of x up to which the cpp kernel takes a call (beyond it a matrix product wins)
DTYPES = FLOAT_DTYPES + (torch.float64,)  # nn.Linear's float dtypes: modules built on the op keep them


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: ``x @ weight.T + bias`` in fp32 (fp64 for fp64 inputs), cast back to ``x.dtype``."""
    acc = _accumulator(x.dtype)
    y = x.to(acc) @ weight.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_tensor(OP, "x", x, dtypes=DTYPES)
    if x.dim() < 1:
        fail(OP, "argument 'x' must have at least 1 dimension (..., in_features)")
    check_tensor(OP, "weight", weight, ndim=2, dtypes=DTYPES)
    if weight.shape[1] != x.shape[-1]:
        fail(OP, f"argument 'weight' must be (out_features, {x.shape[-1]}) for 'x' of shape {tuple(x.shape)}, "
                 f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(OP, "bias", bias, ndim=1, dtypes=DTYPES)
        if bias.shape[0] != weight.shape[0]:
            fail(OP, f"argument 'bias' must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(OP, "x", x, weight=weight, bias=bias)
    check_same_dtype(OP, "x", x, weight=weight, bias=bias)


def _call(x: torch.Tensor, weight: torch.Tensor) -> Call:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return call_of(x, rows=rows, weight_contiguous=weight.is_contiguous())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as a contiguous (rows, K) matrix."""
    return x.reshape(-1, x.shape[-1]).contiguous()


# -- the custom ops ---------------------------------------------------------------------------------------
@torch.library.custom_op("fastarch::linear_fwd", mutates_args=())
def _linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _forward(choose(OP, _call(x, weight), backend), x, weight, bias)


def _forward(impl, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return impl.forward(_rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


@_linear_fwd.register_fake
def _(x, weight, bias, backend):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fastarch::linear_bwd", mutates_args=())
def _linear_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, backend: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = run_backward(OP, _call(x, weight), backend, _rows(dy), _rows(x), weight)
    return dx.view(x.shape), dw, db


@_linear_bwd.register_fake
def _(dy, x, weight, backend):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, backend = inputs
    ctx.save_for_backward(x, weight)
    ctx.backend, ctx.has_bias = backend, bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw, db = _linear_bwd(dy, x, weight, ctx.backend)
    return dx, dw, db if ctx.has_bias else None, None


_linear_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, as ``torch.nn.functional.linear``.

    Args:
        x: the input.
        weight: ``(out_features, in_features)``.
        bias: optional ``(out_features,)``.
        backend: force 'aten', 'cpp' or 'torch' (default: the selector's choice; on CPU, ``cpp`` for fp32
            calls of up to :data:`CPP_MAX_ROWS` rows, ``aten`` otherwise).

    Returns:
        ``(..., out_features)`` in ``x``'s dtype; differentiable in ``x``, ``weight`` and ``bias``.

    Shapes:
        x: ``(..., in_features)``; output: ``(..., out_features)``.
    """
    _validate(x, weight, bias)
    if bias is not None and not bias.is_contiguous():
        # A strided bias is valid input; the kernels (cpp, oneDNN) read it as contiguous memory.
        bias = bias.contiguous()
    if x.numel() == 0 or weight.shape[0] == 0:
        return linear_ref(x, weight, bias)
    impl, name = dispatch(OP, lambda: _call(x, weight), backend, x, weight, bias)
    if impl is not None:
        return _forward(impl, x, weight, bias)
    return _linear_fwd(x, weight, bias, name)


# -- backends ---------------------------------------------------------------------------------------------
def _backward_products(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy (M, N), x (M, K), weight (N, K) -> (dx (M, K), dweight (N, K), dbias (N,))."""
    return dy @ weight, dy.t() @ x, dy.sum(0)


class TorchLinear(TorchImplementation):
    op, dtypes = OP, DTYPES
    description = "matrix product in fp32"

    def forward(self, x, weight, bias):
        return linear_ref(x, weight, bias)

    def backward(self, dy, x, weight):
        acc = _accumulator(x.dtype)
        dx, dw, db = _backward_products(dy.to(acc), x.to(acc), weight.to(acc))
        return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """PyTorch's oneDNN linear op, or None in a build without it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does the ``aten`` backend run this (rows, K) x and weight on oneDNN (else ``F.linear``)?"""
    return (_ONEDNN_LINEAR is not None and torch.backends.mkldnn.enabled and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.is_contiguous() and x.is_contiguous())


class AtenLinear(AtenImplementation):
    op, dtypes = OP, DTYPES
    description = ("PyTorch's kernels: oneDNN's linear (torch.ops.mkldnn) for fp32 CPU calls with a contiguous "
                   "weight, forward and backward, torch.nn.functional.linear (BLAS) otherwise")

    def forward(self, x, weight, bias):
        if uses_onednn(x, weight):
            return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def backward(self, dy, x, weight):
        if uses_onednn(x, weight) and dy.dtype == torch.float32 and dy.is_contiguous():
            # dx = dy W and dW = dy^T x as oneDNN linears on transposed views (oneDNN reads the strides).
            return (_ONEDNN_LINEAR(dy, weight.t(), None, "none", [], ""),
                    _ONEDNN_LINEAR(dy.t(), x.t(), None, "none", [], ""), dy.sum(0))
        return _backward_products(dy, x, weight)


class CppLinear(CppImplementation):
    op, extension = OP, "linear"
    dtypes = (torch.float32,)
    limits = {"rows": CPP_MAX_ROWS}
    description = "C++ matrix-vector kernel: weight rows streamed once, rows split over threads"

    def check(self, call):
        return [] if call.get("weight_contiguous", True) else ["the weight must be contiguous"]

    def forward(self, x, weight, bias):
        return self.lib.linear_fwd(x, weight, bias)

    def backward(self, dy, x, weight):
        return _backward_products(dy, x, weight)


for _impl in (TorchLinear, AtenLinear, CppLinear):
    register(_impl)
