"""``mamba_ssm.ops.triton.ssd_chunk_scan``: ``chunk_scan(B, C, x, dt, dA_cumsum, prev_states, D=None, z=None)``
and ``chunk_scan_ref`` on :mod:`fastarch.ops.ssd_scan`. The kernels' private helpers (``_chunk_scan_fwd``,
``_chunk_scan_bwd_dx``, ...) are not provided: importing one raises an ImportError naming it."""

from fastarch.compat._missing import missing_attribute
from fastarch.ops.ssd_scan import chunk_scan, chunk_scan_ref

__all__ = ["chunk_scan", "chunk_scan_ref"]

__getattr__ = missing_attribute(
    "mamba_ssm", "mamba_ssm.ops.triton.ssd_chunk_scan",
    internal=("_chunk_scan_fwd", "_chunk_scan_bwd_dz", "_chunk_scan_bwd_dstates", "_chunk_scan_bwd_dC",
              "_chunk_scan_bwd_dcb", "_chunk_scan_bwd_dx", "_chunk_scan_bwd_ddAcs_stable",
              "_chunk_scan_bwd_ddAcs_prev"))
