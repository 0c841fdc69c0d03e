"""``mamba_ssm.ops.triton.ssd_chunk_state``: ``chunk_state(B, x, dt, dA_cumsum, states_in_fp32=True)``, its
``chunk_state_ref`` and ``chunk_state_varlen(B, x, dt, dA_cumsum, cu_seqlens, chunk_states)`` on
:mod:`fastarch.ops.ssd_scan` (composed PyTorch, every device). The kernels' private helpers
(``_chunk_cumsum_fwd``, ``_chunk_state_fwd``, ...) are not provided: importing one raises an ImportError naming
it."""

from fastarch.compat._missing import missing_attribute
from fastarch.ops.ssd_scan import chunk_state, chunk_state_ref, chunk_state_varlen

__all__ = ["chunk_state", "chunk_state_ref", "chunk_state_varlen"]

__getattr__ = missing_attribute(
    "mamba_ssm", "mamba_ssm.ops.triton.ssd_chunk_state",
    internal=("_chunk_cumsum_fwd", "_chunk_cumsum_bwd", "_chunk_state_fwd", "_chunk_state_bwd_db",
              "_chunk_state_bwd_dx", "_chunk_state_bwd_ddAcs_stable", "_chunk_state_varlen"))
