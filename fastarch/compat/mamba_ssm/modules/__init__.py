"""``mamba_ssm.modules``: ``mamba_simple`` (``Mamba``), ``mamba2`` (``Mamba2``), ``mamba2_simple``
(``Mamba2Simple``), ``block`` (``Block``), ``mha`` (``MHA``) and ``mlp`` (``GatedMLP``)."""

from ..._missing import missing_attribute

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules")
