"""``mamba_ssm.ops.triton.mamba3.mamba3_siso_step``: one Mamba-3 SISO decode step with mamba-ssm's
signature, on :func:`fastarch.ops.mamba3_step`."""

from __future__ import annotations

import torch

from fastarch.ops.mamba3_scan import zero_states
from fastarch.ops.mamba3_step import mamba3_step

from ....._missing import missing_attribute

__all__ = ["mamba3_siso_step"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.mamba3.mamba3_siso_step")


def mamba3_siso_step(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    Angles: torch.Tensor,
    D: torch.Tensor | None = None,
    Z: torch.Tensor | None = None,
    Input_States: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """Q, K ``(batch, nheads_qk, N)``; V, Z ``(batch, nheads, P)``; ADT, DT, Trap ``(batch, nheads)``; Angles
    ``(batch, nheads, S_a)``; Input_States ``(angle, ssm, k, v)`` (zeros when None). Returns ``(out, (angle,
    ssm, k, v))``, the next states new tensors."""
    if Input_States is None:
        angle, ssm, k, v = zero_states(V[:, None], 1, Q.shape[-1], Angles.shape[-1], K.dtype)
        Input_States = (angle, ssm, k[:, 0], v)
    out, *states = mamba3_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, *Input_States, D, Z)
    return out, tuple(states)
