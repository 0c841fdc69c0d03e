"""One decode step of a Mamba-1 mixer: (RMSNorm ->) in_proj -> causal conv update + SiLU -> x_proj ->
dt_proj (bias, softplus) -> selective state update (``A = -exp(A_log)``, D skip, ``silu(z)`` gate) -> out_proj
(-> ``+ x``), the conv and SSM states advanced in place.

Backends: ``cpp`` (one fused C++ call: the weights are read once, no per-op overhead; fp32, contiguous,
without autograd) and ``torch`` (the step op by op on fastarch's ops: ``linear``, ``causal_conv1d_update``,
``selective_state_update``, ``rms_norm``; under autograd the two decode ops, which record no gradient, are
replaced by their references, so that the step is differentiable in x and every weight).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backend import Call, choose, register
from ._backends import CppImplementation, TorchImplementation
from ._checks import check_tensor, check_writable, fail
from ._dispatch import call_of, dispatch
from .causal_conv1d import causal_conv1d_update, causal_conv1d_update_ref
from .linear import linear
from .rms_norm import rms_norm, rms_norm_ref
from .selective_state_update import selective_state_update, selective_state_update_ref

__all__ = ["mamba_mixer_step", "mamba_mixer_step_ref"]

OP = "mamba_mixer_step"
_NAMES = ("x", "in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "x_proj_weight", "x_proj_bias",
          "dt_proj_weight", "dt_proj_bias", "A_log", "D", "out_proj_weight", "out_proj_bias", "conv_state",
          "ssm_state", "norm_weight")


def _step(x, in_w, in_b, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, D, out_w, out_b, conv_state, ssm_state,
          norm_w, norm_eps: float, residual: bool, *, lin, conv_update, state_update, norm):
    """The step composed from four functions (fastarch's ops, or their references)."""
    d_inner, d_state = A_log.shape
    h = x if norm_w is None else norm(x, norm_w, norm_eps)
    xi, z = lin(h, in_w, in_b).chunk(2, dim=-1)
    xc = conv_update(xi, conv_state, conv_w, conv_b, "silu")
    dt, Bm, Cm = torch.split(lin(xc, xp_w, xp_b), [dt_w.shape[1], d_state, d_state], dim=-1)
    dt = lin(dt, dt_w, None)
    y = state_update(ssm_state, xc, dt, -torch.exp(A_log.float()), Bm, Cm, None if D is None else D.float(), z,
                     None if dt_b is None else dt_b.float(), True)
    out = lin(y, out_w, out_b)
    return out + x if residual else out


def mamba_mixer_step_ref(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight, x_proj_bias,
                         dt_proj_weight, dt_proj_bias, A_log, D, out_proj_weight, out_proj_bias, conv_state, ssm_state,
                         norm_weight=None, norm_eps: float = 0.0, residual: bool = False) -> torch.Tensor:
    """The oracle: the step on the ops' references, in fp32."""
    return _step(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight, x_proj_bias, dt_proj_weight,
                 dt_proj_bias, A_log, D, out_proj_weight, out_proj_bias, conv_state, ssm_state, norm_weight, norm_eps,
                 residual, lin=lambda a, w, b: F.linear(a.float(), w.float(), None if b is None else b.float()),
                 conv_update=lambda *a: causal_conv1d_update_ref(*a),
                 state_update=lambda *a: selective_state_update_ref(*a[:8], dt_bias=a[8], dt_softplus=a[9]),
                 norm=rms_norm_ref)


def _validate(t: dict, residual: bool) -> None:
    for name in _NAMES:
        if t[name] is not None or name in ("x", "in_proj_weight", "conv_weight", "x_proj_weight", "dt_proj_weight",
                                           "A_log", "out_proj_weight", "conv_state", "ssm_state"):
            check_tensor(OP, name, t[name])
    x, A_log = t["x"], t["A_log"]
    if A_log.dim() != 2:
        fail(OP, f"argument 'A_log' must be (d_inner, d_state), got {tuple(A_log.shape)}")
    d_inner, d_state = A_log.shape
    in_w = t["in_proj_weight"]
    if x.dim() != 2 or in_w.dim() != 2 or x.shape[1] != in_w.shape[1]:
        fail(OP, f"argument 'x' must be (batch, {in_w.shape[-1]}), got {tuple(x.shape)}")
    if in_w.shape[0] != 2 * d_inner:
        fail(OP, f"argument 'in_proj_weight' must have 2 * d_inner = {2 * d_inner} rows, got {in_w.shape[0]}")
    conv_state, ssm_state = t["conv_state"], t["ssm_state"]
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (x.shape[0], d_inner):
        fail(OP, f"argument 'conv_state' must be ({x.shape[0]}, {d_inner}, width), got {tuple(conv_state.shape)}")
    if tuple(ssm_state.shape) != (x.shape[0], d_inner, d_state):
        fail(OP, f"argument 'ssm_state' must be ({x.shape[0]}, {d_inner}, {d_state}), got {tuple(ssm_state.shape)}")
    if t["conv_weight"].dim() != 2 or t["conv_weight"].shape[0] != d_inner:
        fail(OP, f"argument 'conv_weight' must be ({d_inner}, width), got {tuple(t['conv_weight'].shape)}")
    rank = t["dt_proj_weight"].shape[-1]
    if tuple(t["x_proj_weight"].shape) != (rank + 2 * d_state, d_inner):
        fail(OP, f"argument 'x_proj_weight' must be ({rank + 2 * d_state}, {d_inner}), got "
                 f"{tuple(t['x_proj_weight'].shape)}")
    # Every other size and dtype is checked here too: the torch backend runs op by op, and a later op refusing
    # its arguments would do so after the conv state was already written.
    out_w = t["out_proj_weight"]
    sizes = {"in_proj_bias": (2 * d_inner,), "conv_bias": (d_inner,), "x_proj_bias": (rank + 2 * d_state,),
             "dt_proj_weight": (d_inner, rank), "dt_proj_bias": (d_inner,), "D": (d_inner,),
             "out_proj_weight": (out_w.shape[0], d_inner), "out_proj_bias": (out_w.shape[0],),
             "norm_weight": (x.shape[1],)}
    for name, shape in sizes.items():
        if t[name] is not None and tuple(t[name].shape) != shape:
            fail(OP, f"argument '{name}' must have shape {shape}, got {tuple(t[name].shape)}")
    width = t["conv_weight"].shape[1]
    if conv_state.shape[2] < width - 1:
        fail(OP, f"argument 'conv_state' must hold at least width - 1 = {width - 1} steps, got {conv_state.shape[2]}")
    for name in ("in_proj_weight", "in_proj_bias", "x_proj_weight", "x_proj_bias", "dt_proj_weight",
                 "out_proj_weight", "out_proj_bias"):
        if t[name] is not None and t[name].dtype != x.dtype:
            fail(OP, f"argument '{name}' has dtype {t[name].dtype} but 'x' has {x.dtype} (the projections run in "
                     "x's dtype)", TypeError)
    for name in ("conv_state", "ssm_state"):
        check_writable(OP, name, t[name])
    if residual and t["out_proj_weight"].shape[0] != x.shape[1]:
        fail(OP, f"argument 'residual' needs out_proj to give {x.shape[1]} features, it gives "
                 f"{t['out_proj_weight'].shape[0]}")
    for name, tensor in t.items():
        if tensor is not None and tensor.device != x.device:
            fail(OP, f"argument '{name}' is on {tensor.device} but 'x' is on {x.device}")


def _call(tensors: tuple, grad: bool) -> Call:
    x = tensors[0]
    return call_of(x, batch=x.shape[0], all_fp32=all(t is None or t.dtype == torch.float32 for t in tensors),
                   contiguous=all(t is None or t.is_contiguous() for t in tensors), grad=grad)


@torch.library.custom_op("fastarch::mamba_mixer_step", mutates_args=("conv_state", "ssm_state"))
def _mixer_step(x: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None, conv_w: torch.Tensor,
                conv_b: torch.Tensor | None, xp_w: torch.Tensor, xp_b: torch.Tensor | None, dt_w: torch.Tensor,
                dt_b: torch.Tensor | None, A_log: torch.Tensor, D: torch.Tensor | None, out_w: torch.Tensor,
                out_b: torch.Tensor | None, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                norm_w: torch.Tensor | None, norm_eps: float, residual: bool, backend: str) -> torch.Tensor:
    args = (x, in_w, in_b, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, D, out_w, out_b, conv_state, ssm_state,
            norm_w)
    return choose(OP, _call(args, False), backend).forward(*args, norm_eps, residual)


@_mixer_step.register_fake
def _(x, in_w, in_b, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, D, out_w, out_b, conv_state, ssm_state, norm_w,
      norm_eps, residual, backend):
    return x.new_empty(x.shape[0], out_w.shape[0])


def mamba_mixer_step(x: torch.Tensor, in_proj_weight: torch.Tensor, in_proj_bias: torch.Tensor | None,
                     conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, x_proj_weight: torch.Tensor,
                     x_proj_bias: torch.Tensor | None, dt_proj_weight: torch.Tensor, dt_proj_bias: torch.Tensor | None,
                     A_log: torch.Tensor, D: torch.Tensor | None, out_proj_weight: torch.Tensor,
                     out_proj_bias: torch.Tensor | None, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                     norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0, residual: bool = False, *,
                     backend: str | None = None) -> torch.Tensor:
    """One Mamba-1 mixer decode step; ``conv_state`` and ``ssm_state`` advance in place.

    Args:
        x: the step's input.
        in_proj_weight, in_proj_bias: ``(2 d_inner, d_model)``, ``(2 d_inner,)``.
        conv_weight, conv_bias: ``(d_inner, width)``, ``(d_inner,)``.
        x_proj_weight, x_proj_bias: ``(dt_rank + 2 d_state, d_inner)``.
        dt_proj_weight, dt_proj_bias: ``(d_inner, dt_rank)``, ``(d_inner,)`` (softplus after the bias).
        A_log: ``(d_inner, d_state)``, ``A = -exp(A_log)``.
        D: ``(d_inner,)`` skip weight, or None.
        out_proj_weight, out_proj_bias: ``(d_out, d_inner)``, ``(d_out,)``.
        conv_state: ``(batch, d_inner, S)``, ``S >= width - 1``; updated in place.
        ssm_state: ``(batch, d_inner, d_state)``; updated in place.
        norm_weight, norm_eps: an RMSNorm applied to x first, when given.
        residual: add x to the output (``d_out == d_model``).
        backend: force 'cpp' or 'torch' (default: the selector's choice: ``cpp`` for fp32 contiguous calls
            without autograd).

    Returns:
        ``(batch, d_out)`` in x's dtype; differentiable in the weights and x on the ``torch`` backend.

    Shapes:
        x: ``(batch, d_model)``; out: ``(batch, d_out)``.
    """
    tensors = (x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, x_proj_weight, x_proj_bias, dt_proj_weight,
               dt_proj_bias, A_log, D, out_proj_weight, out_proj_bias, conv_state, ssm_state, norm_weight)
    residual = bool(residual)
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not math.isfinite(norm_eps) \
            or norm_eps < 0:
        fail(OP, f"argument 'norm_eps' must be a finite float >= 0, got {norm_eps!r}")
    _validate(dict(zip(_NAMES, tensors)), residual)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    impl, name = dispatch(OP, lambda: _call(tensors, grad), backend, *tensors)
    if impl is not None:
        return impl.forward(*tensors, float(norm_eps), residual)
    if grad and not torch.compiler.is_compiling():
        # autograd through the step's ops (the custom op has no backward: a decode step mutates its states)
        return choose(OP, _call(tensors, grad), name).forward(*tensors, float(norm_eps), residual)
    return _mixer_step(*tensors, float(norm_eps), residual, name)


def fused_step_reasons(call: Call, layout_reason: str) -> list[str]:
    """Why a fused C++ decode step cannot take ``call``: not fp32 (where the call declares ``all_fp32``), not
    contiguous, or under autograd. Shared by the mixer steps and the decoder steps."""
    reasons = []
    if not call.get("all_fp32", True):
        reasons.append("every tensor must be fp32")
    if not call.get("contiguous", True):
        reasons.append(layout_reason)
    if call.get("grad"):
        reasons.append("no backward (autograd needs the op-by-op torch step)")
    return reasons


class TorchMambaMixerStep(TorchImplementation):
    op = OP
    description = "op by op on fastarch's linear, causal_conv1d_update, selective_state_update and rms_norm"

    def forward(self, *args):
        *tensors, norm_eps, residual = args
        # The decode ops record no gradient: under autograd the conv and state updates are their references
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        ssu = selective_state_update_ref if grad else selective_state_update
        return _step(*tensors, norm_eps, residual, lin=linear,
                     conv_update=causal_conv1d_update_ref if grad else causal_conv1d_update,
                     state_update=lambda *a: ssu(*a[:8], dt_bias=a[8], dt_softplus=a[9]),
                     norm=rms_norm)


class CppMambaMixerStep(CppImplementation):
    op, extension = OP, "decode_step"
    dtypes = (torch.float32,)
    description = ("one fused C++ call per step (weights read once, loops split over the task pool); fp32, "
                   "contiguous, without autograd")

    def check(self, call):
        return fused_step_reasons(call, "every tensor must be contiguous")

    def forward(self, x, in_w, in_b, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, D, out_w, out_b, conv_state,
                ssm_state, norm_w, norm_eps, residual):
        # the kernel's argument order; its loops always split over the task pool, which never waits for a
        # descheduled thread
        return self.lib.mamba_step(x, in_w, in_b, conv_state, conv_w, conv_b, xp_w, xp_b, dt_w, dt_b, A_log, D,
                                   ssm_state, out_w, out_b, norm_w, norm_eps, residual, True)


for _impl in (TorchMambaMixerStep, CppMambaMixerStep):
    register(_impl)
