"""``mamba_ssm.ops.triton.ssd_combined``: Mamba-2's chunked scan on fastarch's ``ssd_scan``
(``mamba_chunk_scan_combined``), the same scan as separate pieces (``mamba_chunk_scan``), as Mamba-1's
selective scan (``ssd_selective_scan``) and from the sequential oracle (``ssd_chunk_scan_combined_ref``), and
the fused mixer ``mamba_split_conv1d_scan_combined`` (with its ``mamba_split_conv1d_scan_ref``) on fastarch's
ops. The kernels' private helpers (``_mamba_chunk_scan_combined_fwd``, ...) are not provided: importing one
raises an ImportError naming it."""

from fastarch.compat._missing import missing_attribute
from fastarch.ops.mamba_split_conv1d_scan import mamba_split_conv1d_scan_combined, mamba_split_conv1d_scan_ref
from fastarch.ops.ssd_scan import (
    mamba_chunk_scan,
    mamba_chunk_scan_combined,
    ssd_chunk_scan_combined_ref,
    ssd_selective_scan,
)

__all__ = ["mamba_chunk_scan", "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
           "mamba_split_conv1d_scan_ref", "ssd_chunk_scan_combined_ref", "ssd_selective_scan"]

__getattr__ = missing_attribute(
    "mamba_ssm", "mamba_ssm.ops.triton.ssd_combined",
    internal=("_mamba_chunk_scan_combined_fwd", "_mamba_chunk_scan_combined_bwd"))
