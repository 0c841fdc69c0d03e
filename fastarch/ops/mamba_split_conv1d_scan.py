"""Mamba-2's whole mixer after the input projection, mamba-ssm's ``mamba_split_conv1d_scan_combined``.

``zxbcdt`` ``(batch, L, 2 * d_mlp + 2 * dim + 2 * ngroups * dstate + nheads)`` (``dim = nheads * headdim``)
is split along its last dimension into ``[z0, x0 (d_mlp each), z (dim), xBC (dim + 2 * ngroups * dstate),
dt (nheads)]``; ``dstate`` comes from ``conv1d_weight`` ``(dim + 2 * ngroups * dstate, width)``, ``d_mlp``
from what is left of the width. Then::

    xBC        = activation(causal_conv1d(xBC))           (seq_idx keeps packed sequences apart)
    x, B, C    = split(xBC, [dim, ngroups * dstate, ngroups * dstate])
    y          = ssd_scan(x, dt, A, B, C, D, dt_bias, dt_softplus=True, dt_limit, initial_states, seq_idx)
    y          = rms_norm_gated(y, rmsnorm_weight, z, group_size=dim // ngroups, norm_before_gate)
                 (without rmsnorm_weight the scan gates instead: y * silu(z))
    y          = [silu(z0) * x0, y]                       (when d_mlp > 0)
    out        = y @ outproj_weight.T + outproj_bias      (when outproj_weight is given)

Each step is one of fastarch's ops (:func:`~fastarch.ops.causal_conv1d`, :func:`~fastarch.ops.ssd_scan`,
:func:`~fastarch.ops.rms_norm_gated`) or a PyTorch linear, so the whole is differentiable by autograd in
every tensor argument and runs on whichever backends those ops select. :func:`mamba_split_conv1d_scan_ref`
is the same composition on the ops' oracles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._checks import check_same_device, check_tensor, fail
from .causal_conv1d import causal_conv1d, causal_conv1d_ref
from .rms_norm_gated import rms_norm_gated, rms_norm_gated_ref
from .ssd_scan import INDEX_DTYPES, seq_idx_from_cu_seqlens, ssd_scan, ssd_scan_ref

__all__ = ["mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref"]

OP = "mamba_split_conv1d_scan_combined"


def _sizes(zxbcdt, conv1d_weight, dt_bias, A, D, rmsnorm_weight, outproj_weight, outproj_bias, headdim,
           ngroups) -> tuple[int, int, int, int, int]:
    """Validate the shapes; returns (nheads, headdim, dim, dstate, d_mlp)."""
    check_tensor(OP, "zxbcdt", zxbcdt, ndim=3)
    check_tensor(OP, "conv1d_weight", conv1d_weight, ndim=2)
    check_tensor(OP, "D", D, ndim=(1, 2))
    if D.dim() == 1:
        if isinstance(headdim, bool) or not isinstance(headdim, int) or headdim < 1:
            fail(OP, f"argument 'headdim' must be a positive int when D is 1-D (nheads,), got {headdim!r}")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    if isinstance(ngroups, bool) or not isinstance(ngroups, int) or ngroups < 1 or nheads % ngroups != 0:
        fail(OP, f"argument 'ngroups' must be a positive int dividing nheads={nheads}, got {ngroups!r}")
    dim = nheads * headdim
    bc = conv1d_weight.shape[0] - dim
    if bc <= 0 or bc % (2 * ngroups) != 0:
        fail(OP, f"argument 'conv1d_weight' must have dim + 2 * ngroups * dstate rows (dim={dim}, "
                 f"ngroups={ngroups}), got shape {tuple(conv1d_weight.shape)}")
    dstate = bc // (2 * ngroups)
    rest = zxbcdt.shape[2] - (2 * dim + 2 * ngroups * dstate + nheads)
    if rest < 0 or rest % 2 != 0:
        fail(OP, f"argument 'zxbcdt' must have 2 * d_mlp + 2 * dim + 2 * ngroups * dstate + nheads features "
                 f"(dim={dim}, ngroups={ngroups}, dstate={dstate}, nheads={nheads}, d_mlp >= 0), "
                 f"got shape {tuple(zxbcdt.shape)}")
    d_mlp = rest // 2
    check_tensor(OP, "dt_bias", dt_bias, shape=(nheads,))
    check_tensor(OP, "A", A, shape=(nheads,))
    if rmsnorm_weight is not None:
        check_tensor(OP, "rmsnorm_weight", rmsnorm_weight, shape=(dim,))
    if outproj_weight is not None:
        check_tensor(OP, "outproj_weight", outproj_weight, shape=(None, d_mlp + dim))
        if outproj_bias is not None:
            check_tensor(OP, "outproj_bias", outproj_bias, shape=(outproj_weight.shape[0],))
    elif outproj_bias is not None:
        fail(OP, "argument 'outproj_bias' needs 'outproj_weight'")
    check_same_device(OP, "zxbcdt", zxbcdt, conv1d_weight=conv1d_weight, dt_bias=dt_bias, A=A, D=D,
                      rmsnorm_weight=rmsnorm_weight, outproj_weight=outproj_weight, outproj_bias=outproj_bias)
    return nheads, headdim, dim, dstate, d_mlp


def _combined(conv: Callable[..., torch.Tensor], scan: Callable[..., Any], norm: Callable[..., torch.Tensor],
              zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit,
              return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim,
              ngroups, norm_before_gate, cu_seqlens, return_varlen_states) -> Any:
    """The module docstring's composition with the given conv, scan and gated-norm functions."""
    nheads, headdim, dim, dstate, d_mlp = _sizes(zxbcdt, conv1d_weight, dt_bias, A, D, rmsnorm_weight,
                                                 outproj_weight, outproj_bias, headdim, ngroups)
    batch, seqlen, _ = zxbcdt.shape
    if cu_seqlens is not None:
        check_tensor(OP, "cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if batch != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[-1]) != seqlen:
            fail(OP, f"argument 'cu_seqlens' packs sequences into one row: zxbcdt must have batch 1 and "
                     f"cu_seqlens[-1] == L={seqlen}, got batch {batch} and cu_seqlens {cu_seqlens.tolist()[:8]}")
        if seq_idx is None:  # the conv must not mix the packed sequences either
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, seqlen)
    z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = conv(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, activation, seq_idx=seq_idx).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    gate_in_scan = rmsnorm_weight is None
    res = scan(x.reshape(batch, seqlen, nheads, headdim), dt, A, B.reshape(batch, seqlen, ngroups, dstate),
               C.reshape(batch, seqlen, ngroups, dstate), chunk_size, D=D,
               z=z.reshape(batch, seqlen, nheads, headdim) if gate_in_scan else None, dt_bias=dt_bias,
               initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=True,
               dt_limit=dt_limit, return_final_states=return_final_states, return_varlen_states=return_varlen_states)
    y, *states = res if isinstance(res, tuple) else (res,)
    y = y.reshape(batch, seqlen, dim)
    if not gate_in_scan:
        y = norm(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                 norm_before_gate=norm_before_gate)
    if d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, *states) if states else y


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    *,
    cu_seqlens: torch.Tensor | None = None,
    return_varlen_states: bool = False,
) -> Any:
    """mamba-ssm's ``mamba_split_conv1d_scan_combined``: split, conv, SSD scan, gated RMS norm and output
    projection (see the module docstring), on fastarch's ops.

    Args:
        zxbcdt: the input projection's output ``(batch, L, 2 * d_mlp + 2 * dim + 2 * ngroups * dstate + nheads)``.
        conv1d_weight: ``(dim + 2 * ngroups * dstate, width)``; conv1d_bias: ``(dim + 2 * ngroups * dstate,)``.
        dt_bias: ``(nheads,)``; A: ``(nheads,)``; D: ``(nheads,)`` (then ``headdim`` is needed) or
            ``(nheads, headdim)``.
        chunk_size: the scan's chunk length.
        initial_states: optional ``(batch, nheads, headdim, dstate)`` state before the first step.
        seq_idx: optional ``(batch, L)`` integer sequence numbers of packed sequences.
        dt_limit: clamp of the time steps after softplus.
        return_final_states: also return the scan's last state ``(batch, nheads, headdim, dstate)`` fp32.
        activation: the conv's activation: ``"silu"``, ``"swish"`` or None.
        rmsnorm_weight: optional ``(dim,)``: gated RMS norm of the scan's output (else the scan gates).
        rmsnorm_eps: the norm's epsilon.
        outproj_weight: optional ``(out_dim, d_mlp + dim)``; outproj_bias: optional ``(out_dim,)``.
        headdim: the head dimension when ``D`` is 1-D.
        ngroups: groups of ``B``/``C`` (and of the norm), dividing ``nheads``.
        norm_before_gate: ``norm(y) * silu(z)`` when True, ``norm(y * silu(z))`` when False.
        cu_seqlens: keyword-only (not in mamba-ssm's signature): ``(num_seqs + 1,)`` offsets of sequences
            packed in one row (batch 1); without ``seq_idx`` it is derived from them, for the conv and the scan.
        return_varlen_states: keyword-only: also return each packed sequence's last state
            ``(num_seqs, nheads, headdim, dstate)`` fp32 (needs ``cu_seqlens``; not differentiable).

    Returns:
        ``out`` ``(batch, L, out_dim or d_mlp + dim)`` in ``zxbcdt``'s dtype; ``(out, final_states)``,
        ``(out, varlen_states)`` or ``(out, final_states, varlen_states)`` as asked.
    """
    return _combined(causal_conv1d, ssd_scan, rms_norm_gated, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                     chunk_size, initial_states, seq_idx, dt_limit, return_final_states, activation, rmsnorm_weight,
                     rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate, cu_seqlens,
                     return_varlen_states)


def mamba_split_conv1d_scan_ref(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    activation: str | None = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    *,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> Any:
    """The oracle, mamba-ssm's ``mamba_split_conv1d_scan_ref`` positional order (plus keyword-only
    ``initial_states``, ``seq_idx`` and ``return_final_states``): the same composition on the oracles
    :func:`~fastarch.ops.causal_conv1d_ref`, :func:`~fastarch.ops.ssd_scan_ref` (a sequential fp32 scan) and
    :func:`~fastarch.ops.rms_norm_gated_ref`."""
    return _combined(causal_conv1d_ref, ssd_scan_ref, rms_norm_gated_ref, zxbcdt, conv1d_weight, conv1d_bias,
                     dt_bias, A, D, chunk_size, initial_states, seq_idx, dt_limit, return_final_states, activation,
                     rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups, norm_before_gate,
                     None, False)
