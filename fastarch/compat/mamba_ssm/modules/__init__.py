"""``mamba_ssm.modules``: ``mamba_simple`` (``Mamba``), ``mamba2`` (``Mamba2``), ``mamba2_simple``
(``Mamba2Simple``), ``block`` (``Block``), ``mha`` (``MHA``) and ``mlp`` (``GatedMLP``)."""

from .._package import package_getattr
from . import block, mamba2, mamba2_simple, mamba_simple, mha, mlp  # noqa: F401

__getattr__ = package_getattr(__name__, "mamba_ssm.modules")
