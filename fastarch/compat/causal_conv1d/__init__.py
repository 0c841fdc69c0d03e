"""``causal_conv1d``'s public functions on fastarch's ops: CPU and GPU, the package's signatures.

``import fastarch.compat.causal_conv1d as causal_conv1d`` (or :func:`fastarch.compat.install`, then
``import causal_conv1d``) gives ``causal_conv1d_fn`` and ``causal_conv1d_update``; the references are in
:mod:`.causal_conv1d_interface`, as in the package, and ``causal_conv1d_varlen_states`` (with its reference)
in :mod:`.causal_conv1d_varlen`. Any other name raises an ImportError that names it.
"""

from .._missing import missing_attribute
from .causal_conv1d_interface import (
    causal_conv1d_fn,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

__all__ = ["causal_conv1d_fn", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref"]

__getattr__ = missing_attribute("causal_conv1d", "causal_conv1d")
