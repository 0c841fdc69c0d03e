"""``fla.ops.gated_delta_rule.fused_recurrent``: ``fused_recurrent_gated_delta_rule`` on fastarch's ops."""

from __future__ import annotations

from typing import Any

import torch

from .....ops.gated_delta_rule import gated_delta_rule
from .....ops.kda import kda
from ..._args import from_head_first, split_kwargs, to_head_first

__all__ = ["fused_recurrent_gated_delta_rule"]


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_gated_delta_rule``: the gated delta rule step by step (decode).

    Args:
        q, k: ``(B, T, H, K)``; v: ``(B, T, HV, V)``, ``HV`` a multiple of ``H``.
        g: optional log decay per head ``(B, T, HV)``.
        gk: optional log decay per key channel ``(B, T, HV, K)`` (added to ``g`` when both are given).
        gv: a per-value-channel decay; not supported (NotImplementedError unless None).
        beta: ``(B, T, HV)``; default ones.
        scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens: as
            :func:`~fastarch.compat.fla.ops.gated_delta_rule.chunk_gated_delta_rule`.
        kwargs: ``head_first`` (deprecated, honoured with a warning).

    Returns:
        ``(o, final_state)`` as ``chunk_gated_delta_rule`` returns them.
    """
    if gv is not None:
        raise NotImplementedError("fused_recurrent_gated_delta_rule: argument 'gv' (a decay per value channel) is "
                                  "not supported by fastarch's fla; pass g or gk")
    _, head_first = split_kwargs("fused_recurrent_gated_delta_rule", kwargs)
    q, k, v, g, gk, beta = from_head_first(head_first, q, k, v, g, gk, beta)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, mode="recurrent")
    if gk is not None:  # a decay per key channel (plus the per-head one): KDA's recurrence
        o, final = kda(q, k, v, gk if g is None else gk + g[..., None], beta, **kw)
    else:
        if g is None:  # no decay at all: the plain delta rule
            g = torch.zeros(v.shape[:3], dtype=torch.float32, device=q.device)
        o, final = gated_delta_rule(q, k, v, g, beta, **kw)
    return to_head_first(head_first, o), final
