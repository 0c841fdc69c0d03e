"""``mamba_ssm.modules.mamba2``: mamba-ssm's ``Mamba2`` layer, :class:`fastarch.nn.Mamba2` (the same
constructor arguments, ``state_dict`` keys, ``forward(u, seqlen=None, seq_idx=None, cu_seqlens=None,
inference_params=None)``, ``step`` and ``allocate_inference_cache``).

``process_group`` may be a group of world size 1 (the layer is then the whole, unsharded layer); tensor
parallelism across several ranks is not supported and raises :class:`NotImplementedError`. ``use_mem_eff_path``
is accepted; both of mamba-ssm's paths are the same composition of fastarch's ops.
"""

from __future__ import annotations

import torch.distributed as dist

from fastarch.nn.mamba2 import Mamba2 as _Mamba2

from ..._missing import missing_attribute

__all__ = ["Mamba2"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mamba2")


class Mamba2(_Mamba2):
    """mamba-ssm's ``Mamba2`` (see the module docstring and :class:`fastarch.nn.Mamba2`)."""

    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, conv_init: float | None = None,
                 expand: int = 2, headdim: int = 64, d_ssm: int | None = None, ngroups: int = 1,
                 A_init_range: tuple[float, float] = (1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit: tuple[float, float] = (0.0, float("inf")),
                 bias: bool = False, conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = True,
                 layer_idx: int | None = None, process_group=None, sequence_parallel: bool = True, device=None,
                 dtype=None):
        if process_group is not None:
            size = dist.get_world_size(process_group)
            if size != 1:
                raise NotImplementedError(f"Mamba2: argument 'process_group' has world size {size}; fastarch runs "
                                          "Mamba2 unsharded (a group of world size 1, or None)")
        super().__init__(d_model, d_state, d_conv, conv_init, expand, headdim, d_ssm, ngroups, A_init_range,
                         D_has_hdim, rmsnorm, norm_before_gate, dt_min, dt_max, dt_init_floor, dt_limit, bias,
                         conv_bias, chunk_size, use_mem_eff_path, layer_idx, None, sequence_parallel, device, dtype)
        self.process_group = process_group
