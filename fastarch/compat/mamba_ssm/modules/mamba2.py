"""``mamba_ssm.modules.mamba2``: mamba-ssm's ``Mamba2`` layer, :class:`fastarch.nn.Mamba2` (the same
constructor arguments, ``state_dict`` keys, ``forward(u, seqlen=None, seq_idx=None, cu_seqlens=None,
inference_params=None)``, ``step`` and ``allocate_inference_cache``).

Tensor parallelism as in mamba-ssm: with a ``process_group`` of ``world`` ranks each rank holds
``expand * d_model / world`` inner channels, ``nheads / world`` heads and ``ngroups / world`` groups;
``in_proj`` is a :class:`~fastarch.compat.mamba_ssm.distributed.tensor_parallel.ColumnParallelLinear` (this
rank's ``[z, x, B, C, dt]`` rows) and ``out_proj`` a ``RowParallelLinear`` (bias on rank 0), and the output is
summed over the ranks: all-reduced, or with ``sequence_parallel`` the input's rows are gathered first and the
output reduce-scattered (``u`` is then ``(batch * seqlen / world, d_model)`` with ``seqlen`` given). The gated
norm's groups are this rank's ``ngroups / world`` groups (as mamba-ssm's fused path normalises). Decoding
(``inference_params``) runs unsharded only. ``use_mem_eff_path`` is accepted; both of mamba-ssm's paths are the
same composition of fastarch's ops.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from fastarch.nn.mamba2 import Mamba2 as _Mamba2

from ..._missing import missing_attribute
from ..distributed.distributed_utils import all_reduce, reduce_scatter
from ..distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear

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
        world = 1 if process_group is None else process_group.size()
        if world > 1:
            inner = int(expand * d_model)
            for name, value in (("expand * d_model", inner), ("ngroups", ngroups), ("d_ssm", d_ssm)):
                if value is not None and value % world != 0:
                    raise ValueError(f"Mamba2: {name} ({value}) must be divisible by the process group's size "
                                     f"({world})")
        # each rank builds its share: expand scaled exactly (a Fraction), d_ssm and ngroups divided
        super().__init__(d_model, d_state, d_conv, conv_init, Fraction(expand) / world if world > 1 else expand,
                         headdim, None if d_ssm is None else d_ssm // world, ngroups // world, A_init_range,
                         D_has_hdim, rmsnorm, norm_before_gate, dt_min, dt_max, dt_init_floor, dt_limit, bias,
                         conv_bias, chunk_size, use_mem_eff_path, layer_idx, None, sequence_parallel, device, dtype)
        self.expand, self.process_group = expand, process_group
        self.world_size = world
        self.local_rank = 0 if process_group is None else process_group.rank()
        if process_group is not None:
            fk = {"device": device, "dtype": dtype}
            self.in_proj = ColumnParallelLinear(d_model, self.in_proj.out_features * world, process_group, bias=bias,
                                                sequence_parallel=sequence_parallel, **fk)
            self.out_proj = RowParallelLinear(self.d_inner * world, d_model, process_group, bias=bias,
                                              sequence_parallel=sequence_parallel, **fk)

    def forward(self, u: torch.Tensor, seqlen: int | None = None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, inference_params=None) -> torch.Tensor:
        """u: ``(batch, L, d_model)`` (or ``(batch * seqlen, d_model)``) -> the same shape; with a process group
        see the module docstring."""
        if self.world_size == 1:
            return super().forward(u, seqlen, seq_idx, cu_seqlens, inference_params)
        if inference_params is not None:
            raise NotImplementedError("Mamba2: decoding (inference_params) with a process_group is not supported; "
                                      "decode with the unsharded layer")
        zxbcdt = self.in_proj(u)  # this rank's rows of every token (gathered with sequence_parallel)
        if seqlen is not None:
            zxbcdt = zxbcdt.view(-1, seqlen, zxbcdt.shape[-1])
        out = self._mix(zxbcdt, seq_idx, cu_seqlens)  # this rank's part of out_proj (its bias on rank 0)
        if seqlen is not None:
            out = out.reshape(-1, out.shape[-1])
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)
