"""``fla.ops.kda.fused_recurrent``: ``fused_recurrent_kda`` on :func:`fastarch.ops.kda`."""

from __future__ import annotations

from typing import Any

import torch

from .chunk import kda_call

__all__ = ["fused_recurrent_kda"]


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda``: Kimi Delta Attention step by step (decode). Arguments as ``chunk_kda``
    (``beta`` defaults to ones; ``use_gate_in_kernel`` with ``A_log``/``dt_bias`` as keywords)."""
    use_gate = bool(kwargs.pop("use_gate_in_kernel", False))
    return kda_call("fused_recurrent_kda", "recurrent", q, k, v, g, beta, scale, initial_state, output_final_state,
                    use_qk_l2norm_in_kernel, use_gate, cu_seqlens, kwargs)
