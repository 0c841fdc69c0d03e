"""``causal_conv1d.causal_conv1d_varlen``: ``causal_conv1d_varlen_states(x, cu_seqlens, state_len)`` and its
``causal_conv1d_varlen_states_ref``, the conv states ``(B, D, state_len)`` of packed variable-length sequences
``x`` ``(total, D)``; see :func:`fastarch.ops.causal_conv1d.causal_conv1d_varlen_states`."""

from ...ops.causal_conv1d import causal_conv1d_varlen_states, causal_conv1d_varlen_states_ref
from .._missing import missing_attribute

__all__ = ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"]

__getattr__ = missing_attribute("causal_conv1d", "causal_conv1d.causal_conv1d_varlen")
