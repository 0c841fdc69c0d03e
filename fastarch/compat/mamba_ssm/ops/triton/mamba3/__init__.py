"""``mamba_ssm.ops.triton.mamba3``: Mamba-3's SISO scan (``mamba3_siso_combined``) and decode step
(``mamba3_siso_step``) on :func:`fastarch.ops.mamba3_scan` and :func:`fastarch.ops.mamba3_step`."""

from ....._missing import missing_attribute

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.mamba3")
