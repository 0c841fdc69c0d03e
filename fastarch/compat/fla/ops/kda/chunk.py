"""``fla.ops.kda.chunk``: ``chunk_kda`` on :func:`fastarch.ops.kda`."""

from __future__ import annotations

from typing import Any

import torch

from .....ops.kda import kda
from ..._args import from_head_first, split_kwargs, to_head_first

__all__ = ["chunk_kda", "kda_call"]

GATE_KWARGS = ("A_log", "dt_bias", "lower_bound", "use_beta_sigmoid_in_kernel")


def kda_call(fn: str, mode: str, q, k, v, g, beta, scale, initial_state, output_final_state,
             use_qk_l2norm_in_kernel, use_gate_in_kernel, cu_seqlens, kwargs: dict[str, Any]):
    """The shared body of ``chunk_kda`` and ``fused_recurrent_kda``."""
    extra, head_first = split_kwargs(fn, kwargs, GATE_KWARGS)
    q, k, v, g, beta = from_head_first(head_first, q, k, v, g, beta)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    if extra.get("use_beta_sigmoid_in_kernel"):
        beta = torch.sigmoid(beta.float())
    if use_gate_in_kernel and extra.get("A_log") is None:
        raise ValueError(f"{fn}: use_gate_in_kernel=True needs the keyword argument 'A_log' (H,)")
    o, final = kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, cu_seqlens, A_log=extra.get("A_log"), dt_bias=extra.get("dt_bias"),
                   lower_bound=extra.get("lower_bound"), mode=mode)
    return to_head_first(head_first, o), final


def chunk_kda(
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
    cu_seqlens: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_kda``: Kimi Delta Attention, chunked.

    Args:
        q, k: ``(B, T, H, K)``; v: ``(B, T, HV, V)``, ``HV`` a multiple of ``H``.
        g: log decay per key channel ``(B, T, HV, K)``; with ``use_gate_in_kernel`` the raw gate, the decay
            being ``-exp(A_log) * softplus(g + dt_bias)`` (or ``lower_bound * sigmoid(exp(A_log) * (g +
            dt_bias))`` with ``lower_bound``).
        beta: ``(B, T, HV)``.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens: as
            ``chunk_gated_delta_rule``.
        chunk_indices: fla's precomputed chunk metadata; not needed (ignored).
        kwargs: ``A_log`` ``(HV,)``, ``dt_bias`` ``(HV * K,)``, ``lower_bound``, ``use_beta_sigmoid_in_kernel``;
            ``safe_gate`` and other kernel options are ignored; ``cp_context``, ``transpose_state_layout``, ...
            raise NotImplementedError when set.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, HV, V)`` in ``q.dtype``; ``final_state`` ``(N, HV, K, V)`` fp32 or None.
    """
    return kda_call("chunk_kda", "chunk", q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, cu_seqlens, kwargs)
