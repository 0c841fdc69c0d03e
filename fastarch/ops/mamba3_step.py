"""One decode step of Mamba-3 (SISO or MIMO): the recurrence of :mod:`fastarch.ops.mamba3_scan` for a single
position, from the states ``(angle, ssm, k, v)`` to the output and the next states, as mamba-ssm's
``mamba3_siso_step`` and its Mamba-3 ``step``.

Shapes: ``Q``, ``K`` ``(batch, G, N)`` (SISO) or ``(batch, R, G, N)`` (MIMO); ``V``, ``Z`` ``(batch, H, P)``;
``ADT``, ``DT``, ``Trap`` ``(batch, H)``; ``Q_bias``, ``K_bias`` ``(H, N)`` or ``(H, R, N)``; ``Angles``
``(batch, H, S_a)``; states as in :func:`fastarch.ops.mamba3_scan` (``angle`` ``(batch, H, S_a)``, ``ssm``
``(batch, H, P, N)``, ``k`` ``(batch, H, N)`` or ``(batch, R, H, N)``, ``v`` ``(batch, H, P)``).

Backends: ``cpp`` (the scan's C++ recurrence for one step, forward and backward) and ``torch`` (the step as a
few PyTorch products; the backward by autograd through it). Nothing is
written in place: the caller keeps (or copies) the returned states.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend import FLOAT_DTYPES, Call, register
from ._backends import CppImplementation, TorchImplementation
from ._dispatch import call_of, dispatch, in_layout_of, run, run_backward
from .mamba3_scan import (
    DTYPES,
    canonical,
    compute_dtype,
    cpp_backward,
    cpp_forward,
    grads_by_recompute,
    step_math,
    validate,
)

__all__ = ["mamba3_step", "mamba3_step_ref"]

OP = "mamba3_step"


def _step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v,
          mimo_z, mimo_o, pairwise: bool, mimo: bool):
    """Canonical shapes (``Q``, ``K`` ``(batch, R, G, N)``, ``k_state`` ``(batch, R, H, N)``). Returns (out in
    ``V.dtype``, angle and ssm in fp32 (float64 for float64 inputs), k in ``K.dtype``, v in ``V.dtype``)."""
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    out, angle, ssm, k, v = step_math(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, ssm_state, k_state,
                                      v_state, D, Z, mimo_v, mimo_z, mimo_o, pairwise, mimo, cdt)
    c = torch.contiguous_format
    return (out.to(V.dtype).contiguous(), angle.contiguous(), ssm.contiguous(), k.to(K.dtype).contiguous(),
            V.clone(memory_format=c))


def mamba3_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, ssm_state, k_state, v_state,
                    D=None, Z=None, *, mimo_v=None, mimo_z=None, mimo_o=None, rotate_pairwise: bool | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """The oracle: the step in plain PyTorch, fp32 (float64 for float64 inputs). Returns what
    :func:`mamba3_step` returns."""
    mimo = Q.dim() == 4
    pairwise = (not mimo) if rotate_pairwise is None else bool(rotate_pairwise)
    Qc, Kc, qb, kb, ks = canonical(Q, K, Q_bias, K_bias, k_state, mimo)
    out, angle, ssm, k, v = _step(Qc, Kc, V, ADT, DT, Trap, qb, kb, Angles, D, Z, angle_state, ssm_state, ks, v_state,
                                  mimo_v, mimo_z, mimo_o, pairwise, mimo)
    return out, angle, ssm, (k if mimo else k.squeeze(1)), v


def _call(V: torch.Tensor, Q: torch.Tensor) -> Call:
    return call_of(V, headdim=V.shape[-1], dstate=Q.shape[-1])


def _out_shape(V: torch.Tensor, mimo_v: torch.Tensor | None, mimo_o: torch.Tensor | None) -> tuple[int, ...]:
    if mimo_v is not None and mimo_o is None:
        return (V.shape[0], mimo_v.shape[1], *V.shape[1:])
    return tuple(V.shape)


@torch.library.custom_op("fastarch::mamba3_step_fwd", mutates_args=())
def _mamba3_step_fwd(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor, Trap: torch.Tensor,
    Q_bias: torch.Tensor, K_bias: torch.Tensor, Angles: torch.Tensor, D: torch.Tensor | None, Z: torch.Tensor | None,
    angle_state: torch.Tensor, ssm_state: torch.Tensor, k_state: torch.Tensor, v_state: torch.Tensor,
    mimo_v: torch.Tensor | None, mimo_z: torch.Tensor | None, mimo_o: torch.Tensor | None, pairwise: bool,
    mimo: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return run(OP, "forward", _call(V, Q), backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state,
               ssm_state, k_state, v_state, mimo_v, mimo_z, mimo_o, pairwise, mimo)


@_mamba3_step_fwd.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v, mimo_z,
      mimo_o, pairwise, mimo, backend):
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    return (V.new_empty(_out_shape(V, mimo_v, mimo_o)), angle_state.new_empty(angle_state.shape, dtype=cdt),
            ssm_state.new_empty(ssm_state.shape, dtype=cdt), k_state.new_empty(k_state.shape, dtype=K.dtype),
            V.new_empty(V.shape))


@torch.library.custom_op("fastarch::mamba3_step_bwd", mutates_args=())
def _mamba3_step_bwd(
    dout: torch.Tensor | None, dangle: torch.Tensor | None, dssm: torch.Tensor | None, dk: torch.Tensor | None,
    dv: torch.Tensor | None, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
    Trap: torch.Tensor, Q_bias: torch.Tensor, K_bias: torch.Tensor, Angles: torch.Tensor, D: torch.Tensor | None,
    Z: torch.Tensor | None, angle_state: torch.Tensor, ssm_state: torch.Tensor, k_state: torch.Tensor,
    v_state: torch.Tensor, mimo_v: torch.Tensor | None, mimo_z: torch.Tensor | None, mimo_o: torch.Tensor | None,
    pairwise: bool, mimo: bool, backend: str,
) -> list[torch.Tensor]:
    """The gradients of the 18 tensor inputs (an empty tensor for an absent one)."""
    inputs = (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v,
              mimo_z, mimo_o)
    return list(run_backward(OP, _call(V, Q), backend, (dout, dangle, dssm, dk, dv), inputs, pairwise, mimo))


@_mamba3_step_bwd.register_fake
def _(dout, dangle, dssm, dk, dv, *rest):
    inputs = rest[:18]
    return [inputs[0].new_empty(0) if t is None else torch.empty_like(t) for t in inputs]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:18])
    ctx.pairwise, ctx.mimo, ctx.backend = inputs[18:21]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dangle, dssm, dk, dv):
    saved = ctx.saved_tensors
    grads = _mamba3_step_bwd(dout, dangle, dssm, dk, dv, *saved, ctx.pairwise, ctx.mimo, ctx.backend)
    return (*[None if t is None else g for g, t in zip(grads, saved)], None, None, None)


_mamba3_step_fwd.register_autograd(_backward, setup_context=_setup_context)


def mamba3_step(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    Angles: torch.Tensor,
    angle_state: torch.Tensor,
    ssm_state: torch.Tensor,
    k_state: torch.Tensor,
    v_state: torch.Tensor,
    D: torch.Tensor | None = None,
    Z: torch.Tensor | None = None,
    *,
    mimo_v: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    rotate_pairwise: bool | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Mamba-3 decode step.

    Args: as :func:`fastarch.ops.mamba3_scan` without the ``L`` dimension (shapes in the module docstring);
    the four states are required (zeros before the first token).

    Returns:
        ``(out, angle, ssm, k, v)``: ``out`` ``(batch, H, P)`` in ``V.dtype`` (MIMO without ``mimo_o``:
        ``(batch, R, H, P)``), the next angle (fp32, in ``[0, 2 pi)``), ssm (fp32), k (``K.dtype``, the rotated
        biased key of this step) and v (this step's ``V``). Differentiable in every floating input.
    """
    validate(OP, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, (angle_state, ssm_state, k_state, v_state),
             mimo_v, mimo_z, mimo_o, rotate_pairwise, step=True)
    mimo = Q.dim() == 4
    pairwise = (not mimo) if rotate_pairwise is None else bool(rotate_pairwise)
    Qc, Kc, qb, kb, ks = canonical(Q, K, Q_bias, K_bias, k_state, mimo)
    args = (Qc, Kc, V, ADT, DT, Trap, qb, kb, Angles, D, Z, angle_state, ssm_state, ks, v_state, mimo_v, mimo_z,
            mimo_o)
    impl, name = dispatch(OP, lambda: _call(V, Q), backend, *args)
    if impl is not None:
        out, angle, ssm, k, v = impl.forward(*args, pairwise, mimo)
    else:
        out, angle, ssm, k, v = _mamba3_step_fwd(*args, pairwise, mimo, name)
    return out, angle, ssm, (k if mimo else k.squeeze(1)), v


class TorchMamba3Step(TorchImplementation):
    op = OP
    dtypes = DTYPES
    description = "PyTorch step (rotation, state update and readout as a few products); backward by autograd"

    def forward(self, *args: Any):
        return _step(*args)

    def backward(self, douts, inputs, pairwise, mimo):
        return grads_by_recompute(_step, douts, inputs, pairwise, mimo)


class CppMamba3Step(CppImplementation):
    op, extension = OP, "mamba3"  # csrc/cpu/mamba3.cpp: the scan's recurrence for one step
    dtypes = FLOAT_DTYPES
    description = "C++: the recurrence for one step, per (batch, head) in parallel; backward by its reverse"

    def forward(self, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state,
                mimo_v, mimo_z, mimo_o, pairwise, mimo):
        out, angle, ssm, k, v = cpp_forward(
            self.lib, Q[:, None], K[:, None], V[:, None], ADT[..., None], DT[..., None], Trap[..., None], Q_bias,
            K_bias, Angles[:, None], D, None if Z is None else Z[:, None], angle_state, ssm_state, k_state, v_state,
            mimo_v, mimo_z, mimo_o, pairwise)
        return out[:, 0], angle, ssm, k, v

    def backward(self, douts, inputs, pairwise, mimo):
        Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, *rest = inputs
        dout, *dstates = douts
        with_l = (Q[:, None], K[:, None], V[:, None], ADT[..., None], DT[..., None], Trap[..., None], Q_bias, K_bias,
                  Angles[:, None], D, None if Z is None else Z[:, None], *rest)
        grads = list(cpp_backward(self.lib, (None if dout is None else dout[:, None], *dstates), with_l, pairwise))
        for i in (0, 1, 2, 8, 10):  # drop the L dimension again
            if inputs[i] is not None:
                grads[i] = in_layout_of(inputs[i], grads[i][:, 0])
        for i in (3, 4, 5):
            grads[i] = in_layout_of(inputs[i], grads[i][..., 0])
        return tuple(grads)


register(TorchMamba3Step)
register(CppMamba3Step)
