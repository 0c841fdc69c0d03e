"""Kimi Delta Attention (Kimi-Linear), compatible with flash-linear-attention's ``chunk_kda`` /
``fused_recurrent_kda``.

The gated delta rule of :mod:`fastarch.ops._delta_rule` with a log decay per key channel: ``g``
``(B, T, Hv, K)``; everything else as :mod:`fastarch.ops.gated_delta_rule`. With ``use_gate_in_kernel`` the
decay is formed from the raw ``g`` first (:func:`kda_gate`)::

    g = -exp(A_log[h]) * softplus(g + dt_bias[h])                 (default)
    g = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))    (with lower_bound)

Backends: ``cpp`` where built, ``torch`` (the chunked WY/UT composition with sub-blocked per-key products,
and the step recurrence). The oracle :func:`kda_ref` is the fp32 recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import register
from ._backends import CppImplementation, TorchImplementation
from ._checks import check_tensor, fail
from ._delta_rule import DeltaRuleCppMixin, DeltaRuleTorchMixin, delta_rule_ref, run_delta_rule, validate

__all__ = ["kda", "kda_gate", "kda_ref"]

OP = "kda"
MODES = ("chunk", "recurrent")


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """KDA's log decay from the raw gate ``g`` ``(B, T, H, K)``, ``A_log`` ``(H,)`` and ``dt_bias``
    ``(H * K,)`` or ``(H, K)``: fp32 ``(B, T, H, K)``, ``<= 0`` (formulas in the module docstring)."""
    H, K = g.shape[-2], g.shape[-1]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    a = torch.exp(A_log.float()).reshape(H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def _validate_gate(g: torch.Tensor, A_log, dt_bias, lower_bound) -> None:
    H, K = g.shape[-2], g.shape[-1]
    if A_log is None:
        fail(OP, "use_gate_in_kernel=True needs argument 'A_log' (H,)")
    check_tensor(OP, "A_log", A_log, shape=(H,))
    if dt_bias is not None:
        check_tensor(OP, "dt_bias", dt_bias, ndim=(1, 2))
        check_tensor(OP, "dt_bias", dt_bias, shape=(H * K,) if dt_bias.dim() == 1 else (H, K))
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not lower_bound < 0):
        fail(OP, f"argument 'lower_bound' must be a negative number or None, got {lower_bound!r}")


def kda_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
            use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
            cu_seqlens: torch.Tensor | None = None, *, A_log: torch.Tensor | None = None,
            dt_bias: torch.Tensor | None = None, lower_bound: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: the fp32 recurrence, step by step. Same arguments and returns as :func:`kda`."""
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    return delta_rule_ref(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    mode: str = "chunk",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (see the module docstring).

    Args:
        q, k: ``(B, T, Hk, K)``.
        v: ``(B, T, Hv, V)``, ``Hv`` a multiple of ``Hk``.
        g: log decay per key channel ``(B, T, Hv, K)``, ``<= 0``; the raw gate with ``use_gate_in_kernel``.
        beta: ``(B, T, Hv)``.
        scale: the query scale (default ``K ** -0.5``).
        initial_state: ``(N, Hv, K, V)``; never written.
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: L2-normalise q and k (in fp32) first.
        use_gate_in_kernel: form the decay from ``g`` with ``A_log`` ``(Hv,)``, ``dt_bias`` ``(Hv * K,)`` and
            ``lower_bound`` (:func:`kda_gate`; differentiable in all three).
        cu_seqlens: ``(N + 1,)`` offsets of packed sequences (batch 1).
        mode: ``"chunk"`` or ``"recurrent"``, as in :func:`fastarch.ops.gated_delta_rule`.
        backend: force ``cpp`` or ``torch``.

    Returns:
        ``(o, final_state)`` as :func:`fastarch.ops.gated_delta_rule` returns them.
    """
    if mode not in MODES:
        raise ValueError(f"{OP}: argument 'mode' must be one of {MODES}, got {mode!r}")
    validate(OP, q, k, v, g, beta, scale, initial_state, cu_seqlens, per_key=True,
             check_gate=not use_gate_in_kernel)
    if use_gate_in_kernel:
        _validate_gate(g, A_log, dt_bias, lower_bound)
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    return run_delta_rule(OP, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens, mode == "recurrent", backend)


class TorchKda(DeltaRuleTorchMixin, TorchImplementation):
    op = OP


class CppKda(DeltaRuleCppMixin, CppImplementation):
    op = OP


for _impl in (TorchKda, CppKda):
    register(_impl)
