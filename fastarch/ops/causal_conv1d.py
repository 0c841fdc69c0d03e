"""Depthwise causal conv1d, compatible with the ``causal_conv1d`` package (used by Mamba).

``causal_conv1d(x, weight, bias=None, activation=None)``: ``x`` ``(B, D, L)``, ``weight`` ``(D, W)``,
``bias`` ``(D,)``; ``out[b, d, t] = bias[d] + sum_k weight[d, k] * x[b, d, t - W + 1 + k]`` (zeros before
the start), then SiLU when ``activation`` is ``"silu"`` or ``"swish"``. Output in ``x.dtype``.

``causal_conv1d_update(x, conv_state, weight, bias=None, activation=None)``: one decode step (or a few).
``x`` is ``(B, D)`` or ``(B, D, T)``; ``conv_state`` ``(B, D, S)`` with ``S >= W - 1`` holds the last S
inputs and is shifted in place; returns the output in ``x``'s shape. Everything is validated first.

Backends (both ops, but ``aten`` only for the convolution): ``aten`` (PyTorch's native grouped convolution
and its backward), ``torch`` (``F.conv1d``; the backward is analytic, in composed PyTorch), ``cpp`` (C++
loops parallel over batch x channel, in the selective_scan extension) and ``triton`` (tiled kernels in
``kernels/causal_conv1d.py``; the backward sums per-tile partials of dw/dbias, no atomics). The update's
compiled backends shift an fp32 contiguous ``conv_state`` directly and any other one through an fp32 copy
written back after the (already validated) step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward

__all__ = ["causal_conv1d", "causal_conv1d_fn", "causal_conv1d_ref", "causal_conv1d_update",
           "causal_conv1d_update_ref"]

OP = "causal_conv1d"
OP_UPDATE = "causal_conv1d_update"


def _check_activation(op: str, activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        fail(op, f"argument 'activation' must be None, 'silu' or 'swish', got {activation!r}", NotImplementedError)
    return activation is not None


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None) -> torch.Tensor:
    """The oracle: a left-padded grouped ``F.conv1d`` in the weight's dtype (fp32), cast back to ``x.dtype``."""
    silu = _check_activation(OP, activation)
    dim, width = weight.shape
    xf = x.to(weight.dtype)
    out = F.conv1d(xf, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., : x.shape[-1]]
    return (F.silu(out) if silu else out).to(x.dtype)


def _validate(x, weight, bias) -> None:
    check_tensor(OP, "x", x, ndim=3)
    check_tensor(OP, "weight", weight, ndim=2)
    if weight.shape[0] != x.shape[1]:
        fail(OP, f"argument 'weight' must have shape ({x.shape[1]}, width) for x with {x.shape[1]} channels, "
                 f"got {tuple(weight.shape)}")
    if not 1 <= weight.shape[1] <= 64:
        fail(OP, f"argument 'weight' must have a width between 1 and 64, got {weight.shape[1]}")
    if bias is not None:
        check_tensor(OP, "bias", bias, shape=(weight.shape[0],))
    check_same_device(OP, "x", x, weight=weight, bias=bias)


@torch.library.custom_op("fastarch::causal_conv1d_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool, backend: str
              ) -> torch.Tensor:
    # contiguous: the fake output is, and the F.conv1d backends return a slice of a longer output
    return run(OP, "forward", call_of(x, width=weight.shape[1]), backend, x, weight, bias, silu).contiguous()


@_conv_fwd.register_fake
def _(x, weight, bias, silu, backend):
    return torch.empty_like(x)


@torch.library.custom_op("fastarch::causal_conv1d_bwd", mutates_args=())
def _conv_bwd(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool,
              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_backward(OP, call_of(x, width=weight.shape[1]), backend, dout, x, weight, bias, silu)


@_conv_bwd.register_fake
def _(dout, x, weight, bias, silu, backend):
    return (torch.empty_like(x, dtype=torch.float32), torch.empty_like(weight, dtype=torch.float32),
            weight.new_empty(weight.shape[0], dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, silu, backend = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.silu, ctx.backend = silu, backend


def _backward(ctx, dout):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _conv_bwd(dout.contiguous(), x, weight, bias, ctx.silu, ctx.backend)
    return dx.to(x.dtype), dw.to(weight.dtype), (db.to(bias.dtype) if bias is not None else None), None, None


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Depthwise causal conv1d: ``out[b, d, t] = bias[d] + sum_k weight[d, k] x[b, d, t - W + 1 + k]``.

    Args:
        x: the input; steps before the start count as zeros.
        weight: one filter of width ``W`` (1 to 64) per channel.
        bias: optional per-channel bias.
        activation: None, ``"silu"`` or ``"swish"``.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The output in ``x.dtype``; differentiable in ``x``, ``weight`` and ``bias``.

    Shapes:
        x, out: ``(B, D, L)``; weight: ``(D, W)``; bias: ``(D,)``.
    """
    silu = _check_activation(OP, activation)
    _validate(x, weight, bias)
    if x.numel() == 0:
        return causal_conv1d_ref(x, weight, bias, activation)
    return _conv_fwd(x, weight, bias, silu, resolve(OP, lambda: call_of(x, width=weight.shape[1]), backend))


def causal_conv1d_fn(x, weight, bias=None, activation=None):
    """The ``causal_conv1d`` package's name and signature for :func:`causal_conv1d` (same Args, Returns and
    Shapes)."""
    return causal_conv1d(x, weight, bias, activation)


# -- decode step ------------------------------------------------------------------------------------------
def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """Reference decode step: append ``x`` to the state window, convolve, shift ``conv_state`` in place."""
    silu = _check_activation("causal_conv1d_update", activation)
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    width, S, T = weight.shape[1], conv_state.shape[-1], xs.shape[-1]
    full = torch.cat([conv_state.to(weight.dtype), xs.to(weight.dtype)], dim=-1)  # (B, D, S + T)
    out = F.conv1d(full[..., S + T - (T + width - 1):], weight.unsqueeze(1), bias, groups=weight.shape[0])
    conv_state.copy_(full[..., -S:])
    out = F.silu(out) if silu else out
    return (out.squeeze(-1) if squeeze else out).to(x.dtype)


@torch.library.custom_op("fastarch::causal_conv1d_update", mutates_args=("conv_state",))
def _conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 silu: bool, backend: str) -> torch.Tensor:
    return run(OP_UPDATE, "update", call_of(x, width=weight.shape[1]), backend, x, conv_state, weight, bias, silu)


@_conv_update.register_fake
def _(x, conv_state, weight, bias, silu, backend):
    return torch.empty_like(x)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None, *,
                         backend: str | None = None) -> torch.Tensor:
    """One (or T) decode steps of :func:`causal_conv1d`, shifting ``conv_state`` in place.

    Args:
        x: the new inputs.
        conv_state: the last ``S >= W - 1`` inputs of each channel; updated in place.
        weight: one filter of width ``W`` per channel.
        bias: optional per-channel bias.
        activation: None, ``"silu"`` or ``"swish"``.
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The outputs of the new steps in ``x.dtype`` and ``x``'s shape (not differentiable).

    Shapes:
        x, out: ``(B, D)`` or ``(B, D, T)``; conv_state: ``(B, D, S)``; weight: ``(D, W)``; bias: ``(D,)``.
    """
    op = OP_UPDATE
    silu = _check_activation(op, activation)
    check_tensor(op, "x", x, ndim=(2, 3))
    batch, dim = x.shape[:2]
    check_tensor(op, "weight", weight, ndim=2)
    if weight.shape[0] != dim:
        fail(op, f"argument 'weight' must have shape ({dim}, width), got {tuple(weight.shape)}")
    check_tensor(op, "conv_state", conv_state, shape=(batch, dim, None))
    if conv_state.shape[-1] < weight.shape[1] - 1:
        fail(op, f"argument 'conv_state' must hold at least width - 1 = {weight.shape[1] - 1} steps, "
                 f"got {conv_state.shape[-1]}")
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(dim,))
    check_same_device(op, "x", x, conv_state=conv_state, weight=weight, bias=bias)
    with torch.no_grad():
        if x.numel() == 0:
            return causal_conv1d_update_ref(x, conv_state, weight, bias, activation)
        name = resolve(OP_UPDATE, lambda: call_of(x, width=weight.shape[1]), backend)
        return _conv_update(x, conv_state, weight, bias, silu, name)


# -- backends ---------------------------------------------------------------------------------------------
class TorchCausalConv1d(TorchImplementation):
    op = OP
    description = "grouped F.conv1d forward; analytic backward in composed PyTorch"

    def forward(self, x, weight, bias, silu):
        return causal_conv1d_ref(x, weight, bias, "silu" if silu else None)

    def backward(self, dout, x, weight, bias, silu):
        xf, w = x.float(), weight.float()
        width = w.shape[1]
        g = dout.float()
        if silu:
            pre = F.conv1d(xf, w.unsqueeze(1), None if bias is None else bias.float(), padding=width - 1,
                           groups=w.shape[0])[..., : x.shape[-1]]
            sg = torch.sigmoid(pre)
            g = g * sg * (1 + pre * (1 - sg))
        # dx[s] = sum_k w[k] g[s + W - 1 - k]: a correlation of g (right-padded) with the flipped filter.
        dx = F.conv1d(F.pad(g, (0, width - 1)), w.flip(-1).unsqueeze(1), groups=w.shape[0])
        windows = F.pad(xf, (width - 1, 0)).unfold(-1, width, 1)  # (B, D, L, W): the inputs each output saw
        dw = torch.einsum("bdl,bdlw->dw", g, windows)
        return dx, dw, g.sum((0, 2))

    def update(self, x, conv_state, weight, bias, silu):
        return causal_conv1d_update_ref(x, conv_state, weight, bias, "silu" if silu else None)


class AtenCausalConv1d(AtenImplementation):
    op = OP
    description = "PyTorch's native grouped convolution (F.conv1d) and convolution_backward, in fp32"

    def forward(self, x, weight, bias, silu):
        return causal_conv1d_ref(x, weight.float(), None if bias is None else bias.float(),
                                 "silu" if silu else None)

    def backward(self, dout, x, weight, bias, silu):
        xf, w = x.float(), weight.float().unsqueeze(1)
        dim, width = weight.shape
        g = dout.float()
        if silu:
            pre = F.conv1d(xf, w, None if bias is None else bias.float(), padding=width - 1,
                           groups=dim)[..., : x.shape[-1]]
            sg = torch.sigmoid(pre)
            g = g * sg * (1 + pre * (1 - sg))
        # The convolution's output has L + W - 1 steps, of which the first L are kept.
        g = F.pad(g, (0, width - 1))
        dx, dw, db = torch.ops.aten.convolution_backward(g, xf, w, [dim], [1], [width - 1], [1], False, [0], dim,
                                                          [True, True, True])
        return dx, dw.squeeze(1), db


class CppCausalConv1d(CppImplementation):
    op, extension = OP, "selective_scan"
    description = "C++ loop over (batch, channel), width-unrolled, fp32; part of the selective_scan extension"

    def forward(self, x, weight, bias, silu):
        b = None if bias is None else bias.float().contiguous()
        return self.lib.conv_fwd(x.float().contiguous(), weight.float().contiguous(), b, silu).to(x.dtype)

    def backward(self, dout, x, weight, bias, silu):
        b = None if bias is None else bias.float().contiguous()
        dx, dw, db = self.lib.conv_bwd(x.float().contiguous(), weight.float().contiguous(), b,
                                       dout.float().contiguous(), silu)
        return dx, dw, db

    def update(self, x, conv_state, weight, bias, silu):
        return _compiled_update(self.lib.conv_update, x, conv_state, weight, bias, silu)


def _compiled_update(kernel, x, conv_state, weight, bias, silu):
    """Shared glue of the compiled updates: (B, D) -> (B, D, 1); fp32 contiguous state (or a copy of it)."""
    xs = (x.unsqueeze(-1) if x.dim() == 2 else x).float().contiguous()
    work = conv_state if (conv_state.dtype == torch.float32 and conv_state.is_contiguous()) else \
        conv_state.float().contiguous()
    out = kernel(xs, work, weight.float().contiguous(), None if bias is None else bias.float().contiguous(), silu)
    if work is not conv_state:
        conv_state.copy_(work)
    out = out.to(x.dtype)
    return out.squeeze(-1) if x.dim() == 2 else out


class TritonCausalConv1d(TritonImplementation):
    op, kernel_module = OP, "causal_conv1d"
    description = "Triton: tiled (channel block x time block) forward; backward with per-tile dw/dbias partials"

    def forward(self, x, weight, bias, silu):
        b = None if bias is None else bias.contiguous()
        return self.lib.conv_fwd(x.contiguous(), weight.contiguous(), b, silu).to(x.dtype)

    def backward(self, dout, x, weight, bias, silu):
        b = None if bias is None else bias.contiguous()
        return self.lib.conv_bwd(dout.contiguous(), x.contiguous(), weight.contiguous(), b, silu)

    def update(self, x, conv_state, weight, bias, silu):
        return _compiled_update(self.lib.conv_update, x, conv_state, weight, bias, silu)


class TorchCausalConv1dUpdate(TorchCausalConv1d):
    op = OP_UPDATE
    description = "composed PyTorch, in place on conv_state"


class CppCausalConv1dUpdate(CppCausalConv1d):
    op = OP_UPDATE
    description = "C++ loop over (batch, channel) rows, in place on conv_state"


class TritonCausalConv1dUpdate(TritonCausalConv1d):
    op = OP_UPDATE
    description = "Triton: a program per (batch, channel block); state shifted in place"


for _impl in (TorchCausalConv1d, AtenCausalConv1d, CppCausalConv1d, TritonCausalConv1d, TorchCausalConv1dUpdate,
              CppCausalConv1dUpdate, TritonCausalConv1dUpdate):
    register(_impl)
