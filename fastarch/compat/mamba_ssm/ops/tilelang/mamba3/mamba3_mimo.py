"""``mamba_ssm.ops.tilelang.mamba3.mamba3_mimo``: Mamba-3's MIMO scan with mamba-ssm's signature, on
:func:`fastarch.ops.mamba3_scan` (every fastarch backend, CPU included)."""

from __future__ import annotations

import torch

from fastarch.ops.mamba3_scan import mamba3_scan

from ....._missing import missing_attribute

__all__ = ["mamba3_mimo"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo")


def mamba3_mimo(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    MIMO_V: torch.Tensor,
    MIMO_Z: torch.Tensor | None,
    MIMO_Out: torch.Tensor | None,
    Angles: torch.Tensor,
    D: torch.Tensor | None,
    Z: torch.Tensor | None,
    chunk_size: int,
    rotary_dim_divisor: int,
    dtype: torch.dtype,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Q, K ``(batch, L, R, nheads_qk, N)``; V, Z ``(batch, L, nheads, P)``; ADT, DT, Trap ``(batch, nheads,
    L)``; Q_bias, K_bias ``(nheads, R, N)``; MIMO_V, MIMO_Z, MIMO_Out ``(nheads, R, P)``; Angles ``(batch, L,
    nheads, N // rotary_dim_divisor)``, rotating channel i with i + N/2 as mamba-ssm's kernels do. ``dtype``
    (the kernels' low-precision dtype) is accepted; the arithmetic is fp32. Returns ``out`` ``(batch, L,
    nheads, P)`` (``(batch, L, R, nheads, P)`` without ``MIMO_Out``), or ``(out, angle, ssm, k, v)`` with
    ``return_state`` (see :func:`fastarch.ops.mamba3_scan`)."""
    if rotary_dim_divisor not in (2, 4):
        raise ValueError(f"mamba3_mimo: argument 'rotary_dim_divisor' must be 2 or 4, got {rotary_dim_divisor!r}")
    want = Q.shape[-1] // rotary_dim_divisor
    if Angles.shape[-1] != want:
        raise ValueError(f"mamba3_mimo: argument 'Angles' must have N // rotary_dim_divisor = {want} angles per "
                         f"head, got shape {tuple(Angles.shape)}")
    return mamba3_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, None, chunk_size, return_state,
                       cu_seqlens, mimo_v=MIMO_V, mimo_z=MIMO_Z, mimo_o=MIMO_Out, rotate_pairwise=False)
