"""Mamba-2 on fastarch's ops: mamba-ssm's ``Mamba2`` layer, its gated RMS norm (``RMSNormGated``), the
decode state holder ``InferenceParams`` and a small language model ``Mamba2LM``.

The mixer runs on :func:`fastarch.ops.mamba_split_conv1d_scan_combined` (the causal conv, the SSD scan
:func:`fastarch.ops.ssd_scan`, the gated RMS norm and the output projection); one decode step runs on
:func:`fastarch.ops.causal_conv1d_update` and the multi-head :func:`fastarch.ops.selective_state_update`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.causal_conv1d import causal_conv1d_update
from ..ops.mamba2_mixer_step import mamba2_mixer_step
from ..ops.mamba_split_conv1d_scan import mamba_split_conv1d_scan_combined
from ..ops.rms_norm_gated import rms_norm_gated
from ..ops.selective_state_update import selective_state_update
from ..ops.ssd_scan import effective_dt
from ._models_common import keep_logits
from .linear import Linear
from .mamba import MambaLM
from .norms import RMSNorm

__all__ = ["InferenceParams", "Mamba2", "Mamba2LM", "RMSNormGated"]


class RMSNormGated(nn.Module):
    """mamba-ssm's ``layernorm_gated.RMSNorm``: ``forward(x, z=None)`` is ``norm(x) * silu(z)``
    (``norm_before_gate``) or ``norm(x * silu(z))``, the RMS taken over groups of ``group_size`` channels
    (one group when None), times ``weight``. Parameters: ``weight`` ``(hidden_size,)`` (ones); ``bias`` is None.
    Runs on :func:`fastarch.ops.rms_norm_gated`."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x, z: ``(..., hidden_size)`` -> ``(..., hidden_size)`` in ``x.dtype``."""
        return rms_norm_gated(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate)


@dataclass
class InferenceParams:
    """mamba-ssm's ``InferenceParams``: the decode state of a model's layers. Each :class:`Mamba2` keeps its
    ``(conv_state, ssm_state)`` in ``key_value_memory_dict[layer_idx]``; ``seqlen_offset`` counts the tokens
    already consumed (0: the next forward is a prefill; > 0: it is one decode step)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        if self.lengths_per_sample is not None:
            self.lengths_per_sample.zero_()


def _varlen_conv_states(xBC: torch.Tensor, cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` inputs of each packed sequence (zeros before its start): ``xBC`` ``(L, D)`` ->
    ``(num_seqs, D, width)``."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    pos = ends[:, None] - width + torch.arange(width, device=xBC.device)  # (S, width)
    inside = pos >= starts[:, None]
    taps = xBC[pos.clamp(min=0)] * inside[..., None].to(xBC.dtype)  # (S, width, D)
    return taps.transpose(1, 2)


class Mamba2(nn.Module):
    """mamba-ssm's ``Mamba2`` layer: the same constructor arguments, defaults, initialisation and
    ``state_dict`` keys (``in_proj.weight``, ``conv1d.weight``, ``conv1d.bias``, ``dt_bias``, ``A_log``,
    ``D``, ``norm.weight``, ``out_proj.weight``).

    ``in_proj`` gives ``[z0, x0 (d_inner - d_ssm each, a gated MLP), z (d_ssm), xBC (d_ssm + 2 * ngroups *
    d_state), dt (nheads)]``; ``nheads = d_ssm / headdim``. Initialisation: ``dt_bias`` the inverse softplus of
    dt ~ logUniform(dt_min, dt_max) floored at ``dt_init_floor``; ``A_log = log(U(A_init_range))``; ``D``
    ones; ``conv1d.weight`` ~ U(-conv_init, conv_init) when ``conv_init`` is given.

    ``forward(u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None)``: ``u`` ``(batch, L,
    d_model)``, or ``(batch * seqlen, d_model)`` when ``seqlen`` is given; returns ``u``'s shape. ``seq_idx``
    ``(batch, L)`` keeps packed sequences apart; ``cu_seqlens`` (batch 1) does the same (its ``seq_idx`` is
    derived) and, with ``inference_params``, makes the cache hold each sequence's state. With
    ``inference_params`` (:class:`InferenceParams`) a forward at ``seqlen_offset == 0`` fills this layer's
    states (prefill) and one at ``seqlen_offset > 0`` is one :meth:`step`.

    Deviations: ``use_mem_eff_path`` is kept but both of mamba-ssm's paths are the same composition of
    fastarch's ops here; ``process_group`` (tensor parallelism) is not supported; :meth:`step` applies
    ``dt_limit`` (mamba-ssm's step ignores it), so that stepping equals the full forward.
    """

    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, conv_init: float | None = None,
                 expand: int = 2, headdim: int = 64, d_ssm: int | None = None, ngroups: int = 1,
                 A_init_range: tuple[float, float] = (1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, dt_limit: tuple[float, float] = (0.0, float("inf")),
                 bias: bool = False, conv_bias: bool = True, chunk_size: int = 256, use_mem_eff_path: bool = True,
                 layer_idx: int | None = None, process_group=None, sequence_parallel: bool = True, device=None,
                 dtype=None):
        super().__init__()
        if process_group is not None:
            raise NotImplementedError("Mamba2: argument 'process_group' (tensor parallelism) is not supported; "
                                      "pass None")
        fk = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.conv_init, self.expand = d_model, d_state, d_conv, conv_init, expand
        self.process_group, self.sequence_parallel = None, sequence_parallel
        self.world_size, self.local_rank = 1, 0
        self.d_inner = int(expand * d_model)
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        if not 0 < self.d_ssm <= self.d_inner or self.d_ssm % headdim != 0:
            raise ValueError(f"Mamba2: d_ssm={self.d_ssm} must be in (0, d_inner={self.d_inner}] and a multiple "
                             f"of headdim={headdim}")
        self.nheads = self.d_ssm // headdim
        if ngroups < 1 or self.nheads % ngroups != 0:
            raise ValueError(f"Mamba2: ngroups={ngroups} must divide the number of heads {self.nheads}")
        if not (A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]):
            raise ValueError(f"Mamba2: A_init_range must be (low, high) with 0 < low <= high, got {A_init_range}")
        self.ngroups = ngroups
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit = tuple(dt_limit)
        self.activation = "silu"
        self.chunk_size, self.use_mem_eff_path, self.layer_idx = chunk_size, use_mem_eff_path, layer_idx
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor
        self.A_init_range = tuple(A_init_range)

        d_in_proj = 2 * self.d_inner + 2 * ngroups * d_state + self.nheads  # [z0, x0, z, x, B, C, dt]
        self.in_proj = Linear(d_model, d_in_proj, bias=bias, **fk)
        conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size=d_conv, groups=conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **fk)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()

        dt = torch.exp(torch.rand(self.nheads, **fk) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
        self.dt_bias._no_weight_decay = True
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))
        self.D._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                     group_size=self.d_ssm // ngroups, **fk)
        self.out_proj = Linear(self.d_inner, d_model, bias=bias, **fk)

    def _D(self) -> torch.Tensor:
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def _split(self, zxbcdt: torch.Tensor) -> list[torch.Tensor]:
        """``[z0, x0, z, xBC, dt]`` along the last dimension."""
        d_mlp = self.d_inner - self.d_ssm
        return list(torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, self.d_ssm + 2 * self.ngroups * self.d_state,
                                         self.nheads], dim=-1))

    def forward(self, u: torch.Tensor, seqlen: int | None = None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, inference_params: InferenceParams | None = None
                ) -> torch.Tensor:
        """u: ``(batch, L, d_model)`` (or ``(batch * seqlen, d_model)``) -> the same shape (see the class)."""
        if seqlen is None:
            batch, seqlen = u.shape[:2]
        else:
            batch = u.shape[0] // seqlen
        conv_state = ssm_state = None
        if inference_params is not None:
            n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else batch
            conv_state, ssm_state = self._get_states_from_cache(inference_params, n)
            if inference_params.seqlen_offset > 0:
                out, _, _ = self.step(u if u.dim() == 3 else u[:, None], conv_state, ssm_state)
                return out if u.dim() == 3 else out[:, 0]
        zxbcdt = self.in_proj(u).view(batch, seqlen, -1)
        if conv_state is not None:
            xBC = self._split(zxbcdt)[3]
            if cu_seqlens is None:  # the last d_conv inputs, zeros in front of a shorter prompt
                conv_state.copy_(F.pad(xBC.transpose(1, 2), (self.d_conv - seqlen, 0)))
            else:
                conv_state.copy_(_varlen_conv_states(xBC[0], cu_seqlens, self.d_conv))
        want_states = ssm_state is not None
        res = self._mix(zxbcdt, seq_idx, cu_seqlens, want_states)
        if want_states:
            out, states = res
            ssm_state.copy_(states)
        else:
            out = res
        return out.reshape(u.shape[0], -1) if u.dim() == 2 else out

    def _mix(self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
             want_states: bool = False):
        """The mixer after ``in_proj``: ``zxbcdt`` ``(batch, L, d_in_proj)`` -> ``(batch, L, d_model)`` (and the
        final or per-sequence SSM states with ``want_states``)."""
        return mamba_split_conv1d_scan_combined(
            zxbcdt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, -torch.exp(self.A_log.float()),
            self._D(), self.chunk_size, seq_idx=seq_idx, dt_limit=self.dt_limit,
            return_final_states=want_states and cu_seqlens is None, activation=self.activation,
            rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6, outproj_weight=self.out_proj.weight,
            outproj_bias=self.out_proj.bias, headdim=None if self.D_has_hdim else self.headdim,
            ngroups=self.ngroups, norm_before_gate=self.norm_before_gate, cu_seqlens=cu_seqlens,
            return_varlen_states=want_states and cu_seqlens is not None)

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: ``hidden_states`` ``(batch, 1, d_model)`` -> ``(out (batch, 1, d_model), conv_state,
        ssm_state)``; the states ``(batch, conv_dim, d_conv)`` and ``(batch, nheads, headdim, d_state)``
        advance in place."""
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError(f"Mamba2.step: argument 'hidden_states' must be (batch, 1, d_model), got shape "
                             f"{tuple(hidden_states.shape)}")
        batch = hidden_states.shape[0]
        if self.d_inner == self.d_ssm:  # no extra gated-MLP channels: the whole step is one op
            out = mamba2_mixer_step(
                hidden_states[:, 0], self.in_proj.weight, self.in_proj.bias, self.conv1d.weight.squeeze(1),
                self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight if self.rmsnorm else None,
                self.out_proj.weight, self.out_proj.bias, conv_state, ssm_state, ngroups=self.ngroups,
                norm_eps=self.norm.eps if self.rmsnorm else 1e-5,
                norm_group_size=self.norm.group_size if self.rmsnorm else None,
                norm_before_gate=self.norm_before_gate, dt_limit=self.dt_limit)
            return out.unsqueeze(1), conv_state, ssm_state
        z0, x0, z, xBC, dt = self._split(self.in_proj(hidden_states.squeeze(1)))
        xBC = causal_conv1d_update(xBC, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.activation)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        h, p, n = self.nheads, self.headdim, self.d_state
        A = (-torch.exp(self.A_log.float()))[:, None, None].expand(h, p, n)
        # the forward's time steps (bias, softplus, dt_limit), one per head, shared by its channels
        dt = effective_dt(dt, self.dt_bias, True, self.dt_limit)[:, :, None].expand(batch, h, p)
        D = self.D.view(h, p) if self.D_has_hdim else self.D[:, None].expand(h, p)
        y = selective_state_update(ssm_state, x.reshape(batch, h, p), dt, A, B.reshape(batch, self.ngroups, n),
                                   C.reshape(batch, self.ngroups, n), D,
                                   z=None if self.rmsnorm else z.reshape(batch, h, p))
        y = y.reshape(batch, self.d_ssm)
        if self.rmsnorm:
            y = self.norm(y, z)
        if self.d_inner > self.d_ssm:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y).unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None, device=None,
                                 **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero states ``(conv_state (batch, conv_dim, d_conv), ssm_state (batch, nheads, headdim, d_state))``;
        dtype: the conv weight's (conv) and ``in_proj``'s (SSM) unless given."""
        device = device or self.out_proj.weight.device
        conv = torch.zeros(batch_size, self.conv1d.weight.shape[0], self.d_conv, device=device,
                           dtype=dtype or self.conv1d.weight.dtype)
        ssm = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                          dtype=dtype or self.in_proj.weight.dtype)
        return conv, ssm

    def _get_states_from_cache(self, inference_params: InferenceParams, batch_size: int,
                               initialize_states: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx is None:
            raise ValueError(f"{type(self).__name__}: decoding with inference_params needs the layer's 'layer_idx'")
        states = inference_params.key_value_memory_dict.get(self.layer_idx)
        if states is None:
            states = self.allocate_inference_cache(batch_size, inference_params.max_seqlen)
            inference_params.key_value_memory_dict[self.layer_idx] = states
        elif initialize_states:
            for s in states:
                s.zero_()
        return states


class _ResidualMamba2(nn.Module):
    def __init__(self, d_model: int, norm_eps: float, **kw):
        super().__init__()
        self.norm = RMSNorm(d_model, eps=norm_eps)
        self.mixer = Mamba2(d_model, **kw)


class Mamba2LM(nn.Module):
    """A Mamba-2 language model, as mamba-ssm's ``MambaLMHeadModel`` with ``ssm_cfg={"layer": "Mamba2"}``:
    embedding, ``n_layers`` x (x + Mamba2(RMSNorm(x))), RMSNorm, a head tied to the embedding (untied with
    ``tie_embeddings=False``); ``norm_eps`` is every RMSNorm's epsilon; other keywords go to :class:`Mamba2`.

    ``forward(input_ids (B, L), cache=None, logits_to_keep=0) -> logits (B, L or logits_to_keep, V)`` (the
    last ``logits_to_keep`` positions only when > 0); ``allocate_inference_cache(batch_size)``
    gives an :class:`InferenceParams` that ``forward(..., cache=cache)`` prefills and ``step(input_ids (B,) or
    (B, 1), cache) -> logits (B, V)`` advances one token; :meth:`generate` as :meth:`MambaLM.generate`.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, d_state: int = 128, d_conv: int = 4,
                 expand: int = 2, headdim: int = 64, ngroups: int = 1, chunk_size: int = 256,
                 tie_embeddings: bool = True, norm_eps: float = 1e-5, **mamba2_kw):
        super().__init__()
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            _ResidualMamba2(d_model, norm_eps, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim,
                            ngroups=ngroups, chunk_size=chunk_size, layer_idx=i, **mamba2_kw)
            for i in range(n_layers))
        self.norm_f = RMSNorm(d_model, eps=norm_eps)
        self.lm_head = Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, cache: InferenceParams | None = None, *,
                logits_to_keep: int = 0) -> torch.Tensor:
        keep_logits(input_ids[..., None], logits_to_keep)  # validate before any work
        if cache is not None and cache.seqlen_offset > 0 and input_ids.shape[1] != 1:
            raise ValueError("Mamba2LM: a cache that has consumed tokens continues one token at a time; got "
                             f"{input_ids.shape[1]} tokens")
        h = self.embedding(input_ids)
        for layer in self.layers:
            h = h + layer.mixer(layer.norm(h), inference_params=cache)
        if cache is not None:
            cache.seqlen_offset += input_ids.shape[1]
        return self.lm_head(self.norm_f(keep_logits(h, logits_to_keep)))

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int = 0, dtype=None, device=None
                                 ) -> InferenceParams:
        cache = InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch_size)
        for layer in self.layers:
            cache.key_value_memory_dict[layer.mixer.layer_idx] = layer.mixer.allocate_inference_cache(
                batch_size, max_seqlen, dtype=dtype, device=device)
        return cache

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: InferenceParams) -> torch.Tensor:
        """input_ids (B,) or (B, 1) -> logits (B, V); the cache advances by one token in place."""
        return self.forward(input_ids.reshape(input_ids.shape[0], 1), cache=cache)[:, -1]

    generate = MambaLM.generate
