"""Mamba-3 on fastarch's ops: mamba-ssm's ``Mamba3`` mixer (SISO and MIMO), its prefill on
:func:`fastarch.ops.mamba3_scan` and its decode step on :func:`fastarch.ops.mamba3_step`."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.mamba3_scan import mamba3_scan
from ..ops.mamba3_step import mamba3_step
from .linear import Linear
from .mamba2 import InferenceParams, Mamba2, RMSNormGated

__all__ = ["Mamba3"]


class Mamba3(nn.Module):
    """mamba-ssm's ``Mamba3`` layer: the same constructor arguments, defaults, initialisation and
    ``state_dict`` keys (``in_proj.weight``, ``dt_bias``, ``B_bias``, ``C_bias``, ``B_norm.weight``,
    ``C_norm.weight``, ``mimo_x``, ``mimo_z``, ``mimo_o`` (MIMO), ``D``, ``norm.weight`` (``is_outproj_norm``),
    ``out_proj.weight``).

    ``in_proj`` gives ``[z, x (d_inner each), B, C (d_state * ngroups * R each), dd_dt, dd_A, trap (nheads
    each), angles (num_rope_angles)]``, ``R = mimo_rank`` for MIMO, else 1. Per step and head:
    ``DT = softplus(dd_dt + dt_bias)``, ``A = min(-softplus(dd_A), -A_floor)``, ``ADT = A * DT``; ``B`` and ``C``
    are RMS-normed over ``d_state`` (``B_norm``, ``C_norm``) and become the keys and queries of
    :func:`fastarch.ops.mamba3_scan` (biases ``B_bias``, ``C_bias``, rotary angles from ``angles``, shared by
    the heads); ``x`` is its input, ``z`` its gate (or the gate of the grouped RMS norm ``norm`` before
    ``out_proj`` with ``is_outproj_norm``).

    ``forward(u, seq_idx=None, cu_seqlens=None, inference_params=None)``: ``u`` ``(batch, L, d_model)`` ->
    ``(batch, L, d_model)``. ``cu_seqlens`` ``(num_seqs + 1,)`` (batch 1) runs each packed sequence from a zero
    state. With ``inference_params`` (:class:`fastarch.nn.InferenceParams`) a forward at ``seqlen_offset == 0``
    fills this layer's states ``(angle, ssm, k, v)`` (one row per sequence) and one at ``seqlen_offset > 0``
    is one :meth:`step`. ``seq_idx`` is accepted and ignored, as in mamba-ssm.

    Deviations: every path is fastarch's PyTorch composition, so no Triton, TileLang or CuTe kernel is needed
    and MIMO needs no extra package; a decode forward returns ``(batch, 1, d_model)``.
    """

    def __init__(self, d_model: int, d_state: int = 128, expand: int = 2, headdim: int = 64, ngroups: int = 1,
                 rope_fraction: float = 0.5, dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 A_floor: float = 1e-4, is_outproj_norm: bool = False, is_mimo: bool = False, mimo_rank: int = 4,
                 chunk_size: int = 64, dropout: float = 0.0, layer_idx: int | None = None, n_layer: int | None = None,
                 device=None, dtype=None, **kwargs):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.chunk_size, self.layer_idx, self.A_floor = chunk_size, layer_idx, A_floor
        self.is_outproj_norm, self.is_mimo = is_outproj_norm, is_mimo
        self.mimo_rank = mimo_rank if is_mimo else 1
        self.d_inner = int(expand * d_model)
        if self.d_inner % headdim != 0:
            raise ValueError(f"Mamba3: d_inner = expand * d_model = {self.d_inner} must be a multiple of "
                             f"headdim={headdim}")
        self.nheads = self.d_inner // headdim
        if ngroups < 1 or self.nheads % ngroups != 0:
            raise ValueError(f"Mamba3: ngroups={ngroups} must divide the number of heads {self.nheads}")
        self.num_bc_heads = ngroups
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction must be 0.5 or 1.0, got {rope_fraction}")
        self.rotary_dim_divisor = int(2 / rope_fraction)
        self.split_tensor_size = int(d_state * rope_fraction)
        if self.split_tensor_size % 2 != 0:
            self.split_tensor_size -= 1
        self.num_rope_angles = self.split_tensor_size // 2
        if self.num_rope_angles <= 0:
            raise ValueError(f"Mamba3: d_state={d_state} with rope_fraction={rope_fraction} leaves no rotary angle")
        R, N, H = self.mimo_rank, d_state, self.nheads

        d_in_proj = 2 * self.d_inner + 2 * N * ngroups * R + 3 * H + self.num_rope_angles
        self.in_proj = Linear(d_model, d_in_proj, bias=False, **fk)
        dt = torch.exp(torch.rand(H, device=device, dtype=torch.float32) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
        self.dt_bias._no_weight_decay = True
        self.B_bias = nn.Parameter(torch.ones(H, R, N, dtype=torch.float32, device=device))
        self.C_bias = nn.Parameter(torch.ones(H, R, N, dtype=torch.float32, device=device))
        self.B_norm = RMSNormGated(N, eps=1e-5, **fk)
        self.C_norm = RMSNormGated(N, eps=1e-5, **fk)
        if is_mimo:
            self.mimo_x = nn.Parameter(torch.ones(H, R, headdim, device=device) / R)
            self.mimo_z = nn.Parameter(torch.ones(H, R, headdim, device=device))
            self.mimo_o = nn.Parameter(torch.ones(H, R, headdim, device=device) / R)
        self.D = nn.Parameter(torch.ones(H, device=device))
        self.D._no_weight_decay = True
        if is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, norm_before_gate=True, group_size=headdim, **fk)
        self.out_proj = Linear(self.d_inner, d_model, bias=False, **fk)

    # -- the pieces forward and step share ---------------------------------------------------------------------
    def _split(self, proj: torch.Tensor) -> list[torch.Tensor]:
        """``[z, x, B, C, dd_dt, dd_A, trap, angles]`` along the last dimension."""
        bc = self.d_state * self.num_bc_heads * self.mimo_rank
        return list(torch.split(proj, [self.d_inner, self.d_inner, bc, bc, self.nheads, self.nheads, self.nheads,
                                       self.num_rope_angles], dim=-1))

    def _steps(self, dd_dt: torch.Tensor, dd_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ADT, DT)`` fp32 in ``dd_dt``'s shape."""
        A = torch.clamp(-F.softplus(dd_A.float()), max=-self.A_floor)
        DT = F.softplus(dd_dt + self.dt_bias)
        return A * DT, DT

    def _qk(self, B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(..., R * G * N)`` -> normed ``(..., R, G, N)``, or ``(..., G, N)`` for SISO: (queries, keys)."""
        shape = (*B.shape[:-1], self.mimo_rank, self.num_bc_heads, self.d_state)
        K, Q = self.B_norm(B.reshape(shape)), self.C_norm(C.reshape(shape))
        if not self.is_mimo:
            Q, K = Q.squeeze(-3), K.squeeze(-3)
        return Q, K

    def _biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_mimo:
            return self.C_bias, self.B_bias
        return self.C_bias.squeeze(1), self.B_bias.squeeze(1)

    def _mimo_kw(self) -> dict:
        if not self.is_mimo:
            return {}
        return dict(mimo_v=self.mimo_x, mimo_z=self.mimo_z, mimo_o=None if self.is_outproj_norm else self.mimo_o)

    def _out_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``is_outproj_norm``: the grouped gated norm of ``y`` (``(..., H, P)``, MIMO ``(..., R, H, P)``, fp32)
        gated by ``z`` ``(..., H, P)``; MIMO gates rank r by ``z * mimo_z[:, r]`` and sums the ranks with
        ``mimo_o``. Returns ``(..., d_inner)``."""
        if not self.is_mimo:
            return self.norm(y.flatten(-2), z.flatten(-2))
        zr = torch.einsum("...hp,hrp->...rhp", z.float(), self.mimo_z)
        y = self.norm(y.float().flatten(-2), zr.flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
        return torch.einsum("...rhp,hrp->...hp", y, self.mimo_o).flatten(-2)

    # -- prefill / training -----------------------------------------------------------------------------------
    def forward(self, u: torch.Tensor, seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                inference_params: InferenceParams | None = None) -> torch.Tensor:
        """u: ``(batch, L, d_model)`` -> ``(batch, L, d_model)`` (see the class)."""
        if u.dim() != 3 or u.shape[-1] != self.d_model:
            raise ValueError(f"Mamba3: argument 'u' must be (batch, L, d_model={self.d_model}), got shape "
                             f"{tuple(u.shape)}")
        batch, seqlen, _ = u.shape
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"Mamba3: argument 'cu_seqlens' packs sequences into one row: u must have batch 1, "
                             f"got {batch}")
        states = None
        if inference_params is not None:
            n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            states = self._get_states_from_cache(inference_params, n)
            if inference_params.seqlen_offset > 0:
                out, *_ = self.step(u, *states)
                return out
        z, x, B, C, dd_dt, dd_A, trap, angles = self._split(self.in_proj(u))
        z = z.unflatten(-1, (self.nheads, self.headdim))
        x = x.unflatten(-1, (self.nheads, self.headdim))
        ADT, DT = self._steps(dd_dt, dd_A)
        ADT, DT, trap = ADT.transpose(1, 2), DT.transpose(1, 2), trap.transpose(1, 2)
        angles = angles.float().unsqueeze(-2).expand(-1, -1, self.nheads, -1)
        Q, K = self._qk(B, C)
        q_bias, k_bias = self._biases()
        gate = None if self.is_outproj_norm else z
        res = mamba3_scan(Q, K, x, ADT, DT, trap, q_bias, k_bias, angles, self.D, gate, chunk_size=self.chunk_size,
                          return_final_states=states is not None, cu_seqlens=cu_seqlens, **self._mimo_kw())
        if states is not None:  # a prefill starts from zero states and leaves the final ones in the cache
            y, *final = res
            for cache, new in zip(states, final):
                cache.copy_(new.reshape(cache.shape))
        else:
            y = res
        y = self._out_norm(y, z) if self.is_outproj_norm else y.flatten(-2)
        return self.out_proj(y.to(x.dtype))

    # -- decode -----------------------------------------------------------------------------------------------
    def step(self, u: torch.Tensor, angle_state: torch.Tensor, ssm_state: torch.Tensor, k_state: torch.Tensor,
             v_state: torch.Tensor, **kwargs) -> tuple[torch.Tensor, ...]:
        """One token: ``u`` ``(batch, d_model)`` or ``(batch, 1, d_model)``; the states ``angle (batch, nheads,
        num_rope_angles)``, ``ssm (batch, nheads, headdim, d_state)``, ``k (batch, R, nheads, d_state)``
        (R = 1 for SISO), ``v (batch, nheads, headdim)`` advance in place. Returns ``(out (u's shape), angle,
        ssm, k, v)``."""
        if u.dim() not in (2, 3) or u.shape[-1] != self.d_model or (u.dim() == 3 and u.shape[1] != 1):
            raise ValueError(f"Mamba3.step: argument 'u' must be (batch, d_model={self.d_model}) or (batch, 1, "
                             f"d_model), got shape {tuple(u.shape)}")
        u2 = u if u.dim() == 2 else u[:, 0]
        z, x, B, C, dd_dt, dd_A, trap, angles = self._split(self.in_proj(u2))
        z = z.unflatten(-1, (self.nheads, self.headdim))
        x = x.unflatten(-1, (self.nheads, self.headdim))
        ADT, DT = self._steps(dd_dt, dd_A)
        Q, K = self._qk(B, C)
        q_bias, k_bias = self._biases()
        angles = angles.float().unsqueeze(-2).expand(-1, self.nheads, -1)
        ks = k_state if self.is_mimo else k_state[:, 0]
        y, angle, ssm, k, v = mamba3_step(Q, K, x, ADT, DT, trap, q_bias, k_bias, angles, angle_state, ssm_state, ks,
                                          v_state, self.D, None if self.is_outproj_norm else z, **self._mimo_kw())
        y = self._out_norm(y, z) if self.is_outproj_norm else y.flatten(-2)
        out = self.out_proj(y.to(x.dtype))
        angle_state.copy_(angle)
        ssm_state.copy_(ssm)
        k_state.copy_(k.reshape(k_state.shape))
        v_state.copy_(v)
        return (out if u.dim() == 2 else out[:, None]), angle_state, ssm_state, k_state, v_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, device=None, dtype=None,
                                 inplace_state=None, **kwargs) -> tuple[torch.Tensor, ...]:
        """Zero states ``(angle (batch, nheads, num_rope_angles) fp32, ssm (batch, nheads, headdim, d_state) fp32,
        k (batch, R, nheads, d_state), v (batch, nheads, headdim))``, k and v in ``in_proj``'s dtype unless
        ``dtype`` is given."""
        device = self.in_proj.weight.device if device is None else device
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        H = self.nheads
        return (torch.zeros(batch_size, H, self.num_rope_angles, device=device, dtype=torch.float32),
                torch.zeros(batch_size, H, self.headdim, self.d_state, device=device, dtype=torch.float32),
                torch.zeros(batch_size, self.mimo_rank, H, self.d_state, device=device, dtype=dtype),
                torch.zeros(batch_size, H, self.headdim, device=device, dtype=dtype))

    # the cache protocol is Mamba2's: key_value_memory_dict[layer_idx], filled by allocate_inference_cache
    _get_states_from_cache = Mamba2._get_states_from_cache
