"""Gated, grouped RMS normalisation, mamba-ssm's ``rmsnorm_fn`` (``layernorm_gated``), as Mamba-2 uses it.

Over groups of ``group_size`` channels of the last dimension (one group when ``group_size`` is None)::

    norm(v) = v / sqrt(mean_group(v^2) + eps) * weight (+ bias)
    norm_before_gate=True:  out = norm(x) * silu(z)
    norm_before_gate=False: out = norm(x * silu(z))
    z is None:              out = norm(x)

A composition around :func:`fastarch.ops.rms_norm` (so it runs on that op's backends and backward): the gate
and the per-group weight are elementwise fp32 PyTorch, differentiated by autograd. The result is in
``x.dtype``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import check_same_device, check_tensor, fail
from .rms_norm import rms_norm, rms_norm_ref

__all__ = ["rms_norm_gated", "rms_norm_gated_ref"]

OP = "rms_norm_gated"


def _validate(x, weight, bias, z, eps, group_size) -> int:
    check_tensor(OP, "x", x)
    if x.dim() < 1:
        fail(OP, "argument 'x' must have at least 1 dimension")
    n = x.shape[-1]
    check_tensor(OP, "weight", weight, shape=(n,))
    if bias is not None:
        check_tensor(OP, "bias", bias, shape=(n,))
    if z is not None:
        check_tensor(OP, "z", z, shape=tuple(x.shape))
    gs = n if group_size is None else group_size
    if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1 or n % gs != 0:
        fail(OP, f"argument 'group_size' must be a positive int dividing the last dimension {n}, got {group_size!r}")
    if not eps >= 0:
        fail(OP, f"argument 'eps' must be >= 0, got {eps}")
    check_same_device(OP, "x", x, weight=weight, bias=bias, z=z)
    return gs


def _gated(norm: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           z: torch.Tensor | None, eps: float, group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """The module docstring's formula with ``norm(v, weight, eps)`` the plain RMS norm over the last dim."""
    # Without autograd the products go into buffers this function made: one pass and one allocation fewer each.
    fresh = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, z)))
    xf = x.float()
    gate = None if z is None else F.silu(z.float())
    if gate is not None and not norm_before_gate:
        xf = gate.mul_(xf) if fresh else xf * gate
    n = x.shape[-1]
    if group_size == n:
        y = norm(xf, weight.float(), eps)
    else:  # one RMS per group; the weight spans the groups
        y = norm(xf.unflatten(-1, (n // group_size, group_size)), None, eps).flatten(-2)
        y = y.mul_(weight.float()) if fresh else y * weight.float()
    if bias is not None:
        y = y.add_(bias.float()) if fresh else y + bias.float()
    if gate is not None and norm_before_gate:
        y = y.mul_(gate) if fresh else y * gate
    return y.to(x.dtype)


def rms_norm_gated_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                       norm_before_gate: bool = True) -> torch.Tensor:
    """The oracle: the same composition on :func:`fastarch.ops.rms_norm_ref` (fp32)."""
    gs = _validate(x, weight, bias, z, eps, group_size)
    return _gated(rms_norm_ref, x, weight, bias, z, eps, gs, norm_before_gate)


def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, eps: float = 1e-6, group_size: int | None = None,
                   norm_before_gate: bool = True, *, backend: str | None = None) -> torch.Tensor:
    """Gated, grouped RMS normalisation (see the module docstring); mamba-ssm's ``rmsnorm_fn`` arguments.

    Args:
        x: the input, normalised over groups of its last dimension.
        weight: the scale, one per channel.
        bias: optional shift, one per channel (mamba-ssm's RMSNorm has none).
        z: optional gate, in ``x``'s shape.
        eps: added to each group's mean square.
        group_size: channels per group (dividing the last dimension); None for one group.
        norm_before_gate: ``norm(x) * silu(z)`` when True, ``norm(x * silu(z))`` when False.
        backend: forwarded to :func:`fastarch.ops.rms_norm`.

    Returns:
        The output in ``x``'s shape and dtype; differentiable in ``x``, ``weight``, ``bias`` and ``z``.

    Shapes:
        x, z, out: ``(..., N)``; weight, bias: ``(N,)``.
    """
    gs = _validate(x, weight, bias, z, eps, group_size)
    return _gated(lambda v, w, e: rms_norm(v, w, e, backend=backend), x, weight, bias, z, eps, gs,
                  norm_before_gate)
