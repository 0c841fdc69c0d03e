"""``mamba_ssm.ops.tilelang.mamba3``: ``mamba3_mimo`` on :func:`fastarch.ops.mamba3_scan`."""

from ....._missing import missing_attribute

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.tilelang.mamba3")
