"""One decode step of a Mamba-2 mixer: in_proj -> ``[z | x B C | dt]`` -> causal conv update + SiLU on
``x B C`` -> selective state update with one ``dt`` and one ``A = -exp(A_log)`` per head (softplus after
``dt_bias``, then the ``dt_limit`` clamp; ``B`` and ``C`` shared by the heads of a group; D skip) -> the
gate: a grouped RMS norm with ``silu(z)`` (``norm(y * silu(z))``, or ``norm(y) * silu(z)`` with
``norm_before_gate``), or ``y * silu(z)`` without a norm -> out_proj. The conv and SSM states advance in place.

This is mamba-ssm's ``Mamba2.step`` and transformers' ``Mamba2Mixer`` decode path (``d_ssm = d_inner``: no
extra gated-MLP channels).

Backends: ``cpp`` (one fused C++ call: the weights are read once, no per-op overhead; fp32, contiguous, without
autograd) and ``torch`` (the step op by op on fastarch's ops: ``linear``, ``causal_conv1d_update``,
``selective_state_update``, ``rms_norm_gated``; under autograd the two decode ops, which record no gradient, are
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
from .mamba_mixer_step import fused_step_reasons
from .rms_norm_gated import rms_norm_gated, rms_norm_gated_ref
from .selective_state_update import selective_state_update, selective_state_update_ref

__all__ = ["mamba2_mixer_step", "mamba2_mixer_step_ref"]

OP = "mamba2_mixer_step"
_NAMES = ("x", "in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm_weight",
          "out_proj_weight", "out_proj_bias", "conv_state", "ssm_state")
_REQUIRED = ("x", "in_proj_weight", "conv_weight", "A_log", "out_proj_weight", "conv_state", "ssm_state")


def _step(x, in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, out_b, conv_state, ssm_state,
          ngroups: int, norm_eps: float, group_size: int, norm_before_gate: bool, dt_limit: tuple[float, float],
          *, lin, conv_update, state_update, gated_norm):
    """The step composed from four functions (fastarch's ops, or their references)."""
    batch, H, P, N = ssm_state.shape
    E = H * P
    z, xBC, dt = torch.split(lin(x, in_w, in_b), [E, E + 2 * ngroups * N, H], dim=-1)
    xBC = conv_update(xBC, conv_state, conv_w, conv_b, "silu")
    xs, Bm, Cm = torch.split(xBC, [E, ngroups * N, ngroups * N], dim=-1)
    dtf = dt.float() + (0.0 if dt_bias is None else dt_bias.float())
    dtf = F.softplus(dtf).clamp(min=dt_limit[0], max=dt_limit[1])
    A = (-torch.exp(A_log.float()))[:, None, None].expand(H, P, N)
    Dh = None if D is None else (D.float().view(H, P) if D.numel() == E and E != H else
                                 D.float()[:, None].expand(H, P))
    y = state_update(ssm_state, xs.reshape(batch, H, P), dtf[:, :, None].expand(batch, H, P), A,
                     Bm.reshape(batch, ngroups, N), Cm.reshape(batch, ngroups, N), Dh,
                     None if norm_w is not None else z.reshape(batch, H, P)).reshape(batch, E)
    if norm_w is not None:
        y = gated_norm(y, norm_w, None, z, norm_eps, group_size, norm_before_gate)
    return lin(y.to(x.dtype), out_w, out_b)


def mamba2_mixer_step_ref(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                          out_proj_weight, out_proj_bias, conv_state, ssm_state, ngroups: int = 1,
                          norm_eps: float = 1e-5, norm_group_size: int | None = None, norm_before_gate: bool = False,
                          dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """The oracle: the step on the ops' references, in fp32."""
    E = ssm_state.shape[1] * ssm_state.shape[2]
    return _step(x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                 out_proj_weight, out_proj_bias, conv_state, ssm_state, ngroups, norm_eps, norm_group_size or E,
                 norm_before_gate, dt_limit,
                 lin=lambda a, w, b: F.linear(a.float(), w.float(), None if b is None else b.float()),
                 conv_update=lambda *a: causal_conv1d_update_ref(*a),
                 state_update=lambda *a: selective_state_update_ref(*a),
                 gated_norm=rms_norm_gated_ref)


def _validate(t: dict, ngroups: int, group_size: int | None, dt_limit, norm_eps) -> tuple[int, int]:
    """Every shape checked against the states' before anything is written; returns (ngroups, group size)."""
    for name in _NAMES:
        if t[name] is not None or name in _REQUIRED:
            check_tensor(OP, name, t[name])
    x, ssm_state, conv_state = t["x"], t["ssm_state"], t["conv_state"]
    if ssm_state.dim() != 4:
        fail(OP, f"argument 'ssm_state' must be (batch, nheads, headdim, d_state), got {tuple(ssm_state.shape)}")
    batch, H, P, N = ssm_state.shape
    E = H * P
    if not isinstance(ngroups, int) or isinstance(ngroups, bool) or ngroups < 1 or H % ngroups:
        fail(OP, f"argument 'ngroups' must be a positive int dividing nheads={H}, got {ngroups!r}")
    conv_dim = E + 2 * ngroups * N
    d_in_proj = 2 * E + 2 * ngroups * N + H
    if x.dim() != 2 or x.shape[0] != batch:
        fail(OP, f"argument 'x' must be ({batch}, d_model), got {tuple(x.shape)}")
    in_w = t["in_proj_weight"]
    if in_w.dim() != 2 or tuple(in_w.shape) != (d_in_proj, x.shape[1]):
        fail(OP, f"argument 'in_proj_weight' must be (2 d_inner + 2 ngroups d_state + nheads, d_model) = "
                 f"({d_in_proj}, {x.shape[1]}), got {tuple(in_w.shape)}")
    conv_w = t["conv_weight"]
    if conv_w.dim() != 2 or conv_w.shape[0] != conv_dim:
        fail(OP, f"argument 'conv_weight' must be ({conv_dim}, width), got {tuple(conv_w.shape)}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (batch, conv_dim) \
            or conv_state.shape[2] < conv_w.shape[1] - 1:
        fail(OP, f"argument 'conv_state' must be ({batch}, {conv_dim}, >= {conv_w.shape[1] - 1}), got "
                 f"{tuple(conv_state.shape)}")
    out_w = t["out_proj_weight"]
    if out_w.dim() != 2 or out_w.shape[1] != E:
        fail(OP, f"argument 'out_proj_weight' must be (d_out, {E}), got {tuple(out_w.shape)}")
    want = {"in_proj_bias": (d_in_proj,), "conv_bias": (conv_dim,), "dt_bias": (H,), "A_log": (H,),
            "norm_weight": (E,), "out_proj_bias": (out_w.shape[0],)}
    for name, shape in want.items():
        if t[name] is not None and tuple(t[name].shape) != shape:
            fail(OP, f"argument '{name}' must have shape {shape}, got {tuple(t[name].shape)}")
    if t["D"] is not None and t["D"].numel() not in (H, E):
        fail(OP, f"argument 'D' must have nheads={H} or d_inner={E} entries, got shape {tuple(t['D'].shape)}")
    if not (isinstance(norm_eps, (int, float)) and not isinstance(norm_eps, bool) and math.isfinite(norm_eps)
            and norm_eps >= 0):
        fail(OP, f"argument 'norm_eps' must be a finite number >= 0, got {norm_eps!r}")
    gs = E if group_size is None else group_size
    if not isinstance(gs, int) or isinstance(gs, bool) or gs < 1 or E % gs:
        fail(OP, f"argument 'norm_group_size' must be a positive int dividing d_inner={E}, got {group_size!r}")
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)
            and not math.isnan(dt_limit[0]) and not math.isnan(dt_limit[1]) and dt_limit[0] <= dt_limit[1]):
        fail(OP, f"argument 'dt_limit' must be a pair (low, high) of numbers with low <= high, got {dt_limit!r}")
    # The torch backend runs op by op: whatever a later op would refuse is refused here, before the conv state
    # is written. The projections, the conv and the norm share x's dtype; dt_bias, A_log and D (read in fp32,
    # which mamba-ssm keeps them in for low-precision modules) and the states may be of any float dtype.
    for name in ("in_proj_weight", "in_proj_bias", "conv_weight", "conv_bias", "norm_weight", "out_proj_weight",
                 "out_proj_bias"):
        if t[name] is not None and t[name].dtype != x.dtype:
            fail(OP, f"argument '{name}' has dtype {t[name].dtype} but 'x' has {x.dtype} (the step runs in x's "
                     "dtype)", TypeError)
    for name in ("conv_state", "ssm_state"):
        check_writable(OP, name, t[name])
    for name, tensor in t.items():
        if tensor is not None and tensor.device != x.device:
            fail(OP, f"argument '{name}' is on {tensor.device} but 'x' is on {x.device}")
    return ngroups, gs


def _call(tensors: tuple, grad: bool) -> Call:
    x = tensors[0]
    # x is copied when strided (a decode step's row); the weights and the in-place states are not
    return call_of(x, batch=x.shape[0], all_fp32=all(t is None or t.dtype == torch.float32 for t in tensors),
                   contiguous=all(t is None or t.is_contiguous() for t in tensors[1:]), grad=grad)


@torch.library.custom_op("fastarch::mamba2_mixer_step", mutates_args=("conv_state", "ssm_state"))
def _mixer_step(x: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor | None, conv_w: torch.Tensor,
                conv_b: torch.Tensor | None, dt_bias: torch.Tensor | None, A_log: torch.Tensor,
                D: torch.Tensor | None, norm_w: torch.Tensor | None, out_w: torch.Tensor, out_b: torch.Tensor | None,
                conv_state: torch.Tensor, ssm_state: torch.Tensor, ngroups: int, norm_eps: float, group_size: int,
                norm_before_gate: bool, dt_lo: float, dt_hi: float, backend: str) -> torch.Tensor:
    args = (x, in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, out_b, conv_state, ssm_state)
    return choose(OP, _call(args, False), backend).forward(*args, ngroups, norm_eps, group_size, norm_before_gate,
                                                           (dt_lo, dt_hi))


@_mixer_step.register_fake
def _(x, in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, out_b, conv_state, ssm_state, ngroups,
      norm_eps, group_size, norm_before_gate, dt_lo, dt_hi, backend):
    return x.new_empty(x.shape[0], out_w.shape[0])


def mamba2_mixer_step(x: torch.Tensor, in_proj_weight: torch.Tensor, in_proj_bias: torch.Tensor | None,
                      conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      A_log: torch.Tensor, D: torch.Tensor | None, norm_weight: torch.Tensor | None,
                      out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None, conv_state: torch.Tensor,
                      ssm_state: torch.Tensor, ngroups: int = 1, norm_eps: float = 1e-5,
                      norm_group_size: int | None = None, norm_before_gate: bool = False,
                      dt_limit: tuple[float, float] = (0.0, math.inf), *, backend: str | None = None
                      ) -> torch.Tensor:
    """One Mamba-2 mixer decode step; ``conv_state`` and ``ssm_state`` advance in place.

    Args:
        x: the step's input.
        in_proj_weight, in_proj_bias: ``(2 d_inner + 2 ngroups d_state + nheads, d_model)``, rows
            ``[z | x B C | dt]``; bias or None.
        conv_weight, conv_bias: ``(conv_dim, width)`` with ``conv_dim = d_inner + 2 ngroups d_state``.
        dt_bias: ``(nheads,)`` added before the softplus, or None.
        A_log: ``(nheads,)``, ``A = -exp(A_log)``.
        D: ``(nheads,)`` or ``(d_inner,)`` skip weight, or None.
        norm_weight: ``(d_inner,)``: the gated RMS norm (epsilon ``norm_eps``, groups of ``norm_group_size``
            channels, default one group); None for the plain gate ``y * silu(z)``.
        out_proj_weight, out_proj_bias: ``(d_out, d_inner)``, ``(d_out,)``.
        conv_state: ``(batch, conv_dim, S)``, ``S >= width - 1``; updated in place.
        ssm_state: ``(batch, nheads, headdim, d_state)`` (``d_inner = nheads * headdim``); updated in place.
        ngroups: the groups of heads that share B and C.
        norm_before_gate: ``norm(y) * silu(z)`` when True, ``norm(y * silu(z))`` when False (mamba-ssm's and
            transformers' default).
        dt_limit: ``(low, high)`` clamp of the time steps after the softplus.
        backend: force 'cpp' or 'torch' (default: the selector's choice: ``cpp`` for fp32 contiguous calls
            without autograd).

    Returns:
        ``(batch, d_out)`` in x's dtype; differentiable in the weights and x on the ``torch`` backend.
    """
    tensors = (x, in_proj_weight, in_proj_bias, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
               out_proj_weight, out_proj_bias, conv_state, ssm_state)
    ngroups, gs = _validate(dict(zip(_NAMES, tensors)), ngroups, norm_group_size, dt_limit, norm_eps)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    impl, name = dispatch(OP, lambda: _call(tensors, grad), backend, *tensors)
    if impl is not None:
        return impl.forward(*tensors, ngroups, float(norm_eps), gs, bool(norm_before_gate), (lo, hi))
    if grad and not torch.compiler.is_compiling():
        # autograd through the step's ops (the custom op has no backward: a decode step mutates its states)
        return choose(OP, _call(tensors, grad), name).forward(*tensors, ngroups, float(norm_eps), gs,
                                                              bool(norm_before_gate), (lo, hi))
    return _mixer_step(*tensors, ngroups, float(norm_eps), gs, bool(norm_before_gate), lo, hi, name)


class TorchMamba2MixerStep(TorchImplementation):
    op = OP
    description = "op by op on fastarch's linear, causal_conv1d_update, selective_state_update and rms_norm_gated"

    def forward(self, *args):
        *tensors, ngroups, norm_eps, group_size, norm_before_gate, dt_limit = args
        # The decode ops record no gradient: under autograd the conv and state updates are their references
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return _step(*tensors, ngroups, norm_eps, group_size, norm_before_gate, dt_limit, lin=linear,
                     conv_update=causal_conv1d_update_ref if grad else causal_conv1d_update,
                     state_update=selective_state_update_ref if grad else selective_state_update,
                     gated_norm=lambda y, w, b, z, eps, gs, nbg: rms_norm_gated(y, w, b, z, eps, gs, nbg))


class CppMamba2MixerStep(CppImplementation):
    op, extension = OP, "decode_step"
    dtypes = (torch.float32,)
    description = ("one fused C++ call per step (weights read once, loops split over the task pool); fp32, "
                   "contiguous, without autograd")

    def check(self, call):
        return fused_step_reasons(call, "the weights and states must be contiguous")

    def forward(self, x, in_w, in_b, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, out_b, conv_state, ssm_state,
                ngroups, norm_eps, group_size, norm_before_gate, dt_limit):
        return self.lib.mamba2_step(x.contiguous(), in_w, in_b, conv_state, conv_w, conv_b, dt_bias, A_log, D, ssm_state, norm_w,
                                    norm_eps, group_size, norm_before_gate, out_w, out_b, ngroups, dt_limit[0],
                                    dt_limit[1], True)


for _impl in (TorchMamba2MixerStep, CppMamba2MixerStep):
    register(_impl)
