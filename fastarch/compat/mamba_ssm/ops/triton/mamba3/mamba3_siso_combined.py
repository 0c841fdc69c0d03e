"""``mamba_ssm.ops.triton.mamba3.mamba3_siso_combined``: Mamba-3's SISO scan with mamba-ssm's signature, on
:func:`fastarch.ops.mamba3_scan` (every fastarch backend, CPU included; differentiable through the output and
the final states)."""

from __future__ import annotations

import torch

from fastarch.ops.mamba3_scan import mamba3_scan

from ....._missing import missing_attribute

__all__ = ["mamba3_siso_combined"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined")


def mamba3_siso_combined(
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
    chunk_size: int = 64,
    return_final_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Q, K ``(batch, L, nheads_qk, N)``; V, Z ``(batch, L, nheads, P)``; ADT, DT, Trap ``(batch, nheads, L)``;
    Q_bias, K_bias ``(nheads, N)``; Angles ``(batch, L, nheads, S_a)``; D ``(nheads,)``; Input_States
    ``(angle, ssm, k, v)`` with one row per sequence. Returns ``out`` ``(batch, L, nheads, P)``, or ``(out,
    angle, ssm, k, v)`` with ``return_final_states`` (see :func:`fastarch.ops.mamba3_scan`)."""
    return mamba3_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States, chunk_size,
                       return_final_states, cu_seqlens)
