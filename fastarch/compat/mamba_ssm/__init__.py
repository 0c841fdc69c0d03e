"""mamba-ssm's program namespace on fastarch's ops and modules: CPU and GPU, mamba-ssm's signatures, module paths,
``state_dict`` keys and outputs.

``import fastarch.compat.mamba_ssm as mamba_ssm`` (or :func:`fastarch.compat.install`, then ``import mamba_ssm``)
gives ``Mamba``, ``Mamba2``, ``MambaLMHeadModel``, ``selective_scan_fn`` and ``mamba_inner_fn`` (and ``Mamba3``
when :mod:`fastarch.nn` has it), and the module paths code imports from:

- ``ops.selective_scan_interface``, ``ops.triton.selective_state_update``, ``ops.triton.ssd_combined``,
  ``ops.triton.layernorm_gated`` and ``ops.triton.layer_norm`` (``layer_norm_fn``, ``rms_norm_fn``, ``RMSNorm``,
  ``LayerNorm`` and their references);
- ``modules.mamba_simple`` (``Mamba``), ``modules.mamba2`` (``Mamba2``), ``modules.mamba2_simple``
  (``Mamba2Simple``), ``modules.block`` (``Block``), ``modules.mha`` (``MHA``), ``modules.mlp`` (``GatedMLP``);
- ``models.config_mamba`` (``MambaConfig``), ``models.mixer_seq_simple`` (``create_block``, ``MixerModel``,
  ``MambaLMHeadModel`` with ``from_pretrained`` for local directories and ``save_pretrained``);
- ``utils.generation`` (``InferenceParams``, ``decode``, ``GenerationMixin``, ``sample``, the logit filters),
  ``utils.hf`` (``load_config_hf``, ``load_state_dict_hf``; local directories, no downloads);
- ``distributed.distributed_utils`` and ``distributed.tensor_parallel`` (on ``torch.distributed``; one process
  when no group is given and none is initialised).

A name this namespace does not provide raises an ImportError naming it and listing what the module offers.
"""

from __future__ import annotations

from . import distributed, models, modules, ops, utils  # noqa: F401
from ._package import package_getattr as _package_getattr
from .models.mixer_seq_simple import MambaLMHeadModel
from .modules.mamba2 import Mamba2
from .modules.mamba_simple import Mamba
from .ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn

__all__ = ["Mamba", "Mamba2", "MambaLMHeadModel", "mamba_inner_fn", "selective_scan_fn"]

_package = _package_getattr(__name__, "mamba_ssm")


def __getattr__(name: str) -> object:
    if name == "Mamba3":  # fastarch.nn's Mamba-3, when this fastarch has one
        from fastarch import nn as _nn

        if hasattr(_nn, "Mamba3"):
            return _nn.Mamba3
    return _package(name)
