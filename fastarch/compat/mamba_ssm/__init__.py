"""mamba-ssm's op functions on fastarch's ops: CPU and GPU, mamba-ssm's signatures.

``import fastarch.compat.mamba_ssm as mamba_ssm`` (or :func:`fastarch.compat.install`, then
``import mamba_ssm``) gives ``selective_scan_fn`` and ``mamba_inner_fn``, and the module paths code imports
them from: ``mamba_ssm.ops.selective_scan_interface`` (``selective_scan_fn``, ``selective_scan_ref``,
``mamba_inner_fn``, ``mamba_inner_ref``), ``mamba_ssm.ops.triton.selective_state_update``
(``selective_state_update``, ``selective_state_update_ref``), ``mamba_ssm.ops.triton.ssd_combined``
(``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``, ``mamba_split_conv1d_scan_ref``) and
``mamba_ssm.ops.triton.layernorm_gated`` (``rmsnorm_fn``, ``RMSNorm``). The model classes (``Mamba``,
``Mamba2``) are not part of it: use :mod:`fastarch.nn`.
"""

from .ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn

__all__ = ["mamba_inner_fn", "selective_scan_fn"]
