"""``mamba_ssm.modules``: ``mamba_simple`` (``Mamba``), ``mamba2`` (``Mamba2``), ``mamba2_simple``
(``Mamba2Simple``), ``block`` (``Block``), ``mha`` (``MHA``) and ``mlp`` (``GatedMLP``)."""

from ..._missing import missing_attribute
from . import block, mamba2, mamba2_simple, mamba_simple, mha, mlp  # noqa: F401

# submodules are imported above: the module __getattr__ answers only for names it lacks
__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules")
