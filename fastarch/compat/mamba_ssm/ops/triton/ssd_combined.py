"""``mamba_ssm.ops.triton.ssd_combined``: Mamba-2's chunked scan on fastarch's ``ssd_scan``."""

from fastarch.ops.ssd_scan import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined"]
