"""``mamba_ssm.ops.tilelang``: Mamba-3's MIMO scan (``mamba3.mamba3_mimo``) on fastarch's ops; no TileLang
needed."""

from ...._missing import missing_attribute

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.tilelang")
