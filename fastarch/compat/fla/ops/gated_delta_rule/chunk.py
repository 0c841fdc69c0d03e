"""``fla.ops.gated_delta_rule.chunk``: ``chunk_gated_delta_rule`` on :func:`fastarch.ops.gated_delta_rule`."""

from __future__ import annotations

from typing import Any

import torch

from .....ops.gated_delta_rule import gated_delta_rule
from ..._args import from_head_first, split_kwargs, to_head_first

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule``: the chunked gated delta rule of Gated DeltaNet.

    Args:
        q, k: ``(B, T, H, K)``; v: ``(B, T, HV, V)``, ``HV`` a multiple of ``H`` (grouped value heads).
        g: log decay ``(B, T, HV)``; beta: ``(B, T, HV)``.
        scale: default ``K ** -0.5``.
        initial_state: ``(N, HV, K, V)``, ``N`` = B or the number of packed sequences.
        output_final_state: return the final state too.
        use_qk_l2norm_in_kernel: L2-normalise q and k first.
        cu_seqlens: ``(N + 1,)`` offsets of packed sequences (batch 1).
        cp_context: context parallelism; not supported (NotImplementedError unless None).
        kwargs: ``head_first`` (deprecated: a warning, and ``(B, H, T, ...)`` inputs are accepted); fla's
            kernel options (``chunk_indices``, ...) are ignored.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, HV, V)`` in ``q.dtype``; ``final_state`` ``(N, HV, K, V)`` fp32 or None.
    """
    _, head_first = split_kwargs("chunk_gated_delta_rule", {**kwargs, "cp_context": cp_context})
    q, k, v, g, beta = from_head_first(head_first, q, k, v, g, beta)
    o, final = gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens, mode="chunk")
    return to_head_first(head_first, o), final
