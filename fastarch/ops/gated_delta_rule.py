"""The gated delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid), compatible with
flash-linear-attention's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``.

The recurrence, the two algorithms (chunked, recurrent), grouped value heads, packed sequences and the memory
bound are described in :mod:`fastarch.ops._delta_rule`; here the gate is one log decay per value head and
step, ``g`` ``(B, T, Hv)``.

Shapes: ``q``, ``k`` ``(B, T, Hk, K)``; ``v`` ``(B, T, Hv, V)`` with ``Hv`` a multiple of ``Hk``; ``g``,
``beta`` ``(B, T, Hv)``; ``initial_state`` and the final state ``(N, Hv, K, V)`` (``N = B``, or the number of
packed sequences with ``cu_seqlens``), fp32 whatever the inputs' dtype; the output ``(B, T, Hv, V)`` in
``q``'s dtype.

Backends: ``cpp`` (C++ chunked and step kernels) where built, ``torch`` (the chunked WY/UT composition and
the step recurrence in PyTorch). The oracle :func:`gated_delta_rule_ref` is the fp32 recurrence.
"""

from __future__ import annotations

import torch

from ..backend import register
from ._backends import CppImplementation, TorchImplementation
from ._delta_rule import DeltaRuleCppMixin, DeltaRuleTorchMixin, delta_rule_ref, run_delta_rule, validate

__all__ = ["gated_delta_rule", "gated_delta_rule_ref"]

OP = "gated_delta_rule"
MODES = ("chunk", "recurrent")


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float | None = None, initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                         cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: the fp32 recurrence, step by step, one packed sequence at a time. Same arguments and
    returns as :func:`gated_delta_rule`."""
    return delta_rule_ref(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    mode: str = "chunk",
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet's gated delta rule (see the module docstring).

    Args:
        q, k: queries and keys ``(B, T, Hk, K)``.
        v: values ``(B, T, Hv, V)``, ``Hv`` a multiple of ``Hk``.
        g: log decay ``(B, T, Hv)``, ``<= 0``.
        beta: the delta rule's step size ``(B, T, Hv)``.
        scale: the query scale (default ``K ** -0.5``).
        initial_state: ``(N, Hv, K, V)``; never written.
        output_final_state: also return the state after the last step.
        use_qk_l2norm_in_kernel: L2-normalise q and k (in fp32) first.
        cu_seqlens: ``(N + 1,)`` int32/int64 offsets of packed sequences (batch 1).
        mode: ``"chunk"`` (the chunked algorithm: prefill, training) or ``"recurrent"`` (step by step: decode).
            The results agree to rounding; the backward is the chunked one either way.
        backend: force ``cpp`` or ``torch`` (default: the selector's choice).

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, Hv, V)`` in ``q.dtype``; ``final_state`` ``(N, Hv, K, V)`` fp32, or
        None unless ``output_final_state``.
    """
    if mode not in MODES:
        raise ValueError(f"{OP}: argument 'mode' must be one of {MODES}, got {mode!r}")
    validate(OP, q, k, v, g, beta, scale, initial_state, cu_seqlens, per_key=False)
    return run_delta_rule(OP, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          cu_seqlens, mode == "recurrent", backend)


class TorchGatedDeltaRule(DeltaRuleTorchMixin, TorchImplementation):
    op = OP


class CppGatedDeltaRule(DeltaRuleCppMixin, CppImplementation):
    op = OP


for _impl in (TorchGatedDeltaRule, CppGatedDeltaRule):
    register(_impl)
