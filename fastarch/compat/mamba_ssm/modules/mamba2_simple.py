"""``mamba_ssm.modules.mamba2_simple``: mamba-ssm's ``Mamba2Simple``, the Mamba-2 mixer without the extra
gated-MLP channels, with optional learnable initial states, on fastarch's ops
(:func:`fastarch.ops.mamba_split_conv1d_scan_combined`; with ``use_mem_eff_path=False``
:func:`fastarch.ops.causal_conv1d`, :func:`fastarch.ops.mamba_chunk_scan_combined` and the gated RMS norm).

``in_proj`` gives ``[z (d_inner), xBC (d_inner + 2 * ngroups * d_state), dt (nheads)]``. Keys: ``in_proj.weight``,
``conv1d.weight``, ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj.weight``, and
``init_states`` ``(nheads, headdim, d_state)`` with ``learnable_init_states``. ``forward(u (B, L, d_model),
seq_idx=None) -> (B, L, d_model)``. As in mamba-ssm, the fused path normalises each of the ``ngroups`` groups
of channels on its own and the unfused path (``use_mem_eff_path=False``, ``self.norm``) the whole ``d_inner``
at once, so the two differ when ``ngroups > 1``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fastarch.nn.mamba2 import Mamba2 as _Mamba2
from fastarch.nn.mamba2 import RMSNormGated
from fastarch.ops.causal_conv1d import causal_conv1d
from fastarch.ops.mamba_split_conv1d_scan import mamba_split_conv1d_scan_combined
from fastarch.ops.ssd_scan import mamba_chunk_scan_combined

from ..._missing import missing_attribute

__all__ = ["Mamba2Simple"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mamba2_simple")


class Mamba2Simple(_Mamba2):
    """mamba-ssm's ``Mamba2Simple`` (see the module docstring): :class:`fastarch.nn.Mamba2` without the gated-MLP
    channels (``d_ssm = d_inner``), the gated norm after the scan, with mamba-ssm's ``Mamba2Simple`` constructor
    (defaults ``d_state=64``, ``headdim=128``, ``activation="swish"``), initialisation and ``forward``."""

    def __init__(self, d_model: int, d_state: int = 64, d_conv: int = 4, conv_init: float | None = None,
                 expand: int = 2, headdim: int = 128, ngroups: int = 1, A_init_range: tuple[float, float] = (1, 16),
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_limit: tuple[float, float] = (0.0, float("inf")), learnable_init_states: bool = False,
                 activation: str = "swish", bias: bool = False, conv_bias: bool = True, chunk_size: int = 256,
                 use_mem_eff_path: bool = True, layer_idx: int | None = None, device=None, dtype=None):
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2Simple: activation must be 'silu' or 'swish', got {activation!r}")
        super().__init__(d_model, d_state=d_state, d_conv=d_conv, conv_init=conv_init, expand=expand,
                         headdim=headdim, ngroups=ngroups, A_init_range=A_init_range, dt_min=dt_min, dt_max=dt_max,
                         dt_init_floor=dt_init_floor, dt_limit=dt_limit, bias=bias, conv_bias=conv_bias,
                         chunk_size=chunk_size, use_mem_eff_path=use_mem_eff_path, layer_idx=layer_idx,
                         device=device, dtype=dtype)
        self.activation, self.learnable_init_states = activation, learnable_init_states
        # one norm over all of d_inner (the fused op groups it by ngroups itself), as in mamba-ssm
        self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=False, device=device, dtype=dtype)
        if learnable_init_states:
            self.init_states = nn.Parameter(torch.zeros(self.nheads, headdim, d_state, device=device, dtype=dtype))
            self.init_states._no_weight_decay = True

    def forward(self, u: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """u: ``(batch, L, d_model)`` -> ``(batch, L, d_model)``; ``seq_idx`` ``(batch, L)`` keeps packed
        sequences apart."""
        batch = u.shape[0]
        zxbcdt = self.in_proj(u)
        A = -torch.exp(self.A_log.float())
        init = self.init_states.unsqueeze(0).expand(batch, *self.init_states.shape) \
            if self.learnable_init_states else None
        weight = self.conv1d.weight.squeeze(1)
        if self.use_mem_eff_path:
            return mamba_split_conv1d_scan_combined(
                zxbcdt, weight, self.conv1d.bias, self.dt_bias, A, self.D, self.chunk_size, initial_states=init,
                seq_idx=seq_idx, dt_limit=self.dt_limit, activation=self.activation, rmsnorm_weight=self.norm.weight,
                rmsnorm_eps=self.norm.eps, outproj_weight=self.out_proj.weight, outproj_bias=self.out_proj.bias,
                headdim=self.headdim, ngroups=self.ngroups, norm_before_gate=False)
        z, xBC, dt = torch.split(zxbcdt, [self.d_inner, self.d_inner + 2 * self.ngroups * self.d_state, self.nheads],
                                 dim=-1)
        xBC = causal_conv1d(xBC.transpose(1, 2), weight, self.conv1d.bias, activation=self.activation,
                            seq_idx=seq_idx).transpose(1, 2)
        x, B, C = torch.split(xBC, [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        L = u.shape[1]
        y = mamba_chunk_scan_combined(
            x.reshape(batch, L, self.nheads, self.headdim), dt, A, B.reshape(batch, L, self.ngroups, self.d_state),
            C.reshape(batch, L, self.ngroups, self.d_state), self.chunk_size, D=self.D, dt_bias=self.dt_bias,
            initial_states=init, seq_idx=seq_idx, dt_softplus=True, dt_limit=self.dt_limit)
        return self.out_proj(self.norm(y.reshape(batch, L, self.d_inner), z))
