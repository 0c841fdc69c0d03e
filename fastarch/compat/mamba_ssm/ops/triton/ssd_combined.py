"""``mamba_ssm.ops.triton.ssd_combined``: Mamba-2's chunked scan on fastarch's ``ssd_scan``, and the fused
mixer ``mamba_split_conv1d_scan_combined`` (with its ``mamba_split_conv1d_scan_ref``) on fastarch's ops."""

from fastarch.ops.mamba_split_conv1d_scan import mamba_split_conv1d_scan_combined, mamba_split_conv1d_scan_ref
from fastarch.ops.ssd_scan import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "mamba_split_conv1d_scan_ref"]
