"""Mamba modules on fastarch's ops: the guide's ``MambaBlock`` (drop-in), mamba-ssm's ``Mamba`` and a small
``MambaLM``. All three decode recurrently with O(1) memory per token (``allocate_inference_cache`` + ``step``).

The selective scan runs on :func:`fastarch.ops.selective_scan` (C++ on CPU, CUDA/Triton on GPU) with the dt
projection's bias and softplus fused into it, and the depthwise conv + SiLU on
:func:`fastarch.ops.causal_conv1d`; nothing of size B x L x D x N is ever built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.causal_conv1d import causal_conv1d
from ..ops.mamba_mixer_step import mamba_mixer_step
from ..ops.selective_scan import selective_scan
from ._models_common import keep_logits
from .linear import Linear
from .norms import RMSNorm

__all__ = ["Mamba", "MambaBlock", "MambaCache", "MambaLM"]


def _channel_major(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A linear layer on channel-major activations: x (B, K, L) -> weight @ x + bias, (B, N, L). The products
    of the prompt stay channel-major, the layout the conv and the scan read, so no activation is transposed
    into a copy between them."""
    y = torch.matmul(weight, x)
    return y if bias is None else y + bias[:, None]


def _ssm_core(x: torch.Tensor, z: torch.Tensor, conv: nn.Conv1d, x_proj: nn.Linear, dt_weight: torch.Tensor,
              dt_bias: torch.Tensor | None, A_log: torch.Tensor, D: torch.Tensor, d_state: int, dt_rank: int,
              cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """conv -> SiLU -> projections -> selective scan -> D skip -> silu(z) gate. x, z: (B, d_inner, L) ->
    y (B, d_inner, L).

    ``cache`` = (conv_state (B, d_inner, S), ssm_state (B, d_inner, N)) is filled for decoding afterwards.
    """
    L = x.shape[-1]
    if cache is not None:
        conv_state, _ = cache
        S = conv_state.shape[-1]
        tail = x[..., -S:] if L >= S else F.pad(x, (S - L, 0))
        conv_state.copy_(tail.to(conv_state.dtype))
    xc = causal_conv1d(x, conv.weight.squeeze(1), conv.bias, activation="silu")  # (B, d_inner, L)
    x_dbl = _channel_major(x_proj.weight, x_proj.bias, xc)  # (B, dt_rank + 2N, L)
    dt, Bm, Cm = torch.split(x_dbl, [dt_rank, d_state, d_state], dim=1)
    dt = torch.matmul(dt_weight, dt)  # (B, d_inner, L); bias and softplus are fused into the scan
    A = -torch.exp(A_log.float())
    res = selective_scan(xc, dt, A, Bm, Cm, D.float(), z,
                         delta_bias=None if dt_bias is None else dt_bias.float(), delta_softplus=True,
                         return_last_state=cache is not None)
    if cache is not None:
        y, last = res
        cache[1].copy_(last.to(cache[1].dtype))
    else:
        y = res
    return y


def mixer_step(x: torch.Tensor, in_proj: nn.Linear, conv: nn.Conv1d, x_proj: nn.Linear, dt_proj: nn.Linear,
               A_log: torch.Tensor, D: torch.Tensor, out_proj: nn.Linear, conv_state: torch.Tensor,
               ssm_state: torch.Tensor, norm: RMSNorm | None = None, residual: bool = False) -> torch.Tensor:
    """One decode step of a Mamba-1 mixer on the module's layers: x (B, d_model) -> (B, d_out);
    ``conv_state`` (B, d_inner, S) and ``ssm_state`` (B, d_inner, N) advance in place. It is
    :func:`fastarch.ops.mamba_mixer_step` (one fused C++ call on CPU in fp32 without autograd, else op by op)."""
    d_inner = A_log.shape[0]
    conv_w = conv.weight.view(d_inner, -1) if conv.weight.is_contiguous() else conv.weight.squeeze(1)
    return mamba_mixer_step(x, in_proj.weight, in_proj.bias, conv_w, conv.bias, x_proj.weight, x_proj.bias,
                            dt_proj.weight, dt_proj.bias, A_log, D, out_proj.weight, out_proj.bias, conv_state,
                            ssm_state, None if norm is None else norm.weight,
                            0.0 if norm is None else float(norm.eps), residual)


class _SelectiveSSMLayer(nn.Module):
    """in_proj -> (conv, selective scan, gate) -> output, shared by ``MambaBlock`` and ``Mamba``.

    Subclasses own ``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj`` and the sizes
    ``d_inner``, ``d_conv``, ``d_state``, ``dt_rank``; ``_pre`` and ``_post`` wrap the mixer (norm, residual).
    """

    d_inner: int
    d_conv: int
    d_state: int
    dt_rank: int

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _post(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out: the mixer's output (after out_proj); x: the layer's input."""
        return out

    def _ssm_args(self) -> tuple:
        return (self.conv1d, self.x_proj, self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D, self.d_state,
                self.dt_rank)

    def forward(self, x: torch.Tensor, cache: MambaLayerCache | None = None) -> torch.Tensor:
        """x: (batch, seq_len, d_model) -> (batch, seq_len, d_model). ``cache`` (optional) is filled for
        decoding with :meth:`step` afterwards."""
        xz = _channel_major(self.in_proj.weight, self.in_proj.bias, self._pre(x).transpose(1, 2))  # (B, 2 d_inner, L)
        xi, z = xz.chunk(2, dim=1)
        y = _ssm_core(xi, z, *self._ssm_args(), None if cache is None else (cache.conv_state, cache.ssm_state))
        return self._post(self.out_proj(y.transpose(1, 2)), x)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None, device=None
                                 ) -> MambaLayerCache:
        return MambaLayerCache.empty(batch_size, self.d_inner, self.d_conv, self.d_state,
                                     device=device or self.D.device, dtype=dtype or self.conv1d.weight.dtype)

    def step(self, x: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        """One token: x (batch, d_model) or (batch, 1, d_model) -> same shape; ``cache`` advances in place."""
        squeeze = x.dim() == 3
        x2 = x.squeeze(1) if squeeze else x
        out = self._post(mixer_step(self._pre(x2), self.in_proj, self.conv1d, self.x_proj, self.dt_proj, self.A_log,
                                    self.D, self.out_proj, cache.conv_state, cache.ssm_state), x2)
        return out.unsqueeze(1) if squeeze else out


class MambaBlock(_SelectiveSSMLayer):
    """The seed guide's ``MambaBlock`` (pre-LayerNorm, residual, dropout), on fastarch's fused ops.

    Same constructor, parameter names and eval-mode outputs as the guide for the same weights: its
    ``x_proj`` yields ``[delta (d_inner), B (N), C (N)]``, ``delta = softplus(dt_proj(delta))``, the scan is
    ``h = exp(delta A) h + delta B x``, ``y = C h + D x``, gated by ``silu(z)``. The guide's Python loop over
    time (and its B x L x D x N tensors) is replaced by the selective-scan op, with ``dt_proj``'s bias and
    the softplus fused into it. Adds ``allocate_inference_cache``/``step`` for recurrent decoding.
    """

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dropout: float = 0.1):
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_inner = d_model * expand
        self.d_conv = d_conv
        self.dt_rank = self.d_inner  # the guide's x_proj yields a full-width delta
        self.in_proj = Linear(d_model, self.d_inner * 2)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, padding=d_conv - 1,
                                groups=self.d_inner)
        self.x_proj = Linear(self.d_inner, d_state + d_state + self.d_inner)
        self.dt_proj = Linear(self.d_inner, self.d_inner)
        self.A_log = nn.Parameter(torch.randn(self.d_inner, d_state))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = Linear(self.d_inner, d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def _post(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(out) + x


@dataclass
class MambaLayerCache:
    """Decode state of one Mamba layer: the last ``d_conv`` conv inputs and the SSM state (fp32)."""

    conv_state: torch.Tensor  # (batch, d_inner, d_conv)
    ssm_state: torch.Tensor  # (batch, d_inner, d_state), fp32

    @classmethod
    def empty(cls, batch: int, d_inner: int, d_conv: int, d_state: int, device=None, dtype=torch.float32
              ) -> MambaLayerCache:
        return cls(torch.zeros(batch, d_inner, d_conv, device=device, dtype=dtype),
                   torch.zeros(batch, d_inner, d_state, device=device, dtype=torch.float32))


class Mamba(_SelectiveSSMLayer):
    """mamba-ssm's ``Mamba`` layer: same constructor arguments, parameter names and initialisation.

    S4D-real ``A_log = log(1..N)``, dt bias = inverse softplus of dt ~ logUniform(dt_min, dt_max) (floored
    at ``dt_init_floor``), ``dt_proj.weight`` constant or uniform at ``dt_rank**-0.5 * dt_scale``;
    ``A_log`` and ``D`` carry ``_no_weight_decay = True``. ``forward(hidden_states (B, L, d_model))``.
    Deviation: ``inference_params`` is replaced by an optional :class:`MambaLayerCache` that a forward pass
    fills (prefill) and :meth:`step` advances.
    """

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank: int | str = "auto", dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random",
                 dt_scale: float = 1.0, dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False,
                 use_fast_path: bool = True, layer_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path, self.layer_idx = use_fast_path, layer_idx
        self.in_proj = Linear(d_model, self.d_inner * 2, bias=bias, **fk)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=conv_bias, **fk)
        self.activation = "silu"
        self.act = nn.SiLU()
        self.x_proj = Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **fk)
        self.dt_proj = Linear(self.dt_rank, self.d_inner, bias=True, **fk)
        std = self.dt_rank ** -0.5 * dt_scale
        if dt_init == "constant":
            nn.init.constant_(self.dt_proj.weight, std)
        elif dt_init == "random":
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        else:
            raise NotImplementedError(f"Mamba: dt_init must be 'constant' or 'random', got {dt_init!r}")
        dt = torch.exp(torch.rand(self.d_inner, **fk) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(bias) == dt
        self.dt_proj.bias._no_reinit = True
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.D._no_weight_decay = True
        self.out_proj = Linear(self.d_inner, d_model, bias=bias, **fk)

    def forward(self, hidden_states: torch.Tensor, cache: MambaLayerCache | None = None) -> torch.Tensor:
        return super().forward(hidden_states, cache)

    def step(self, hidden_states: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        return super().step(hidden_states, cache)


class _ResidualMamba(nn.Module):
    def __init__(self, d_model: int, norm_eps: float = 1e-5, **kw):
        super().__init__()
        self.norm = RMSNorm(d_model, eps=norm_eps)
        self.mixer = Mamba(d_model, **kw)

    def step(self, h: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        """h (B, d_model) -> h + mixer(norm(h)) for one token; ``cache`` advances in place."""
        m = self.mixer
        return mixer_step(h, m.in_proj, m.conv1d, m.x_proj, m.dt_proj, m.A_log, m.D, m.out_proj, cache.conv_state,
                          cache.ssm_state, norm=self.norm, residual=True)


@dataclass
class MambaCache:
    """Decode state of a :class:`MambaLM`: one :class:`MambaLayerCache` per layer and the tokens seen."""

    layers: list[MambaLayerCache]
    seqlen_offset: int = 0
    extra: dict = field(default_factory=dict)


class MambaLM(nn.Module):
    """A small Mamba language model: embedding, ``n_layers`` x (x + Mamba(RMSNorm(x))), RMSNorm, tied head
    (untied with ``tie_embeddings=False``); ``norm_eps`` is every RMSNorm's epsilon.

    ``forward(input_ids (B, L), logits_to_keep=0) -> logits (B, L or logits_to_keep, V)`` (the last
    ``logits_to_keep`` positions only when > 0); ``allocate_inference_cache(batch_size)`` and
    ``step(input_ids (B,) or (B, 1), cache) -> logits (B, V)`` decode one token at a time in O(1) memory;
    ``forward(..., cache=cache)`` prefills a cache from a prompt.
    """

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, d_state: int = 16, d_conv: int = 4,
                 expand: int = 2, dt_rank: int | str = "auto", tie_embeddings: bool = True, norm_eps: float = 1e-5,
                 **mamba_kw):
        super().__init__()
        self.vocab_size, self.d_model, self.n_layers = vocab_size, d_model, n_layers
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            _ResidualMamba(d_model, norm_eps, d_state=d_state, d_conv=d_conv, expand=expand, dt_rank=dt_rank,
                           layer_idx=i, **mamba_kw) for i in range(n_layers))
        self.norm_f = RMSNorm(d_model, eps=norm_eps)
        self.lm_head = Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, cache: MambaCache | None = None, *,
                logits_to_keep: int = 0) -> torch.Tensor:
        keep_logits(input_ids[..., None], logits_to_keep)  # validate before any work
        h = self.embedding(input_ids)
        for i, layer in enumerate(self.layers):
            lc = None if cache is None else cache.layers[i]
            h = h + layer.mixer(layer.norm(h), cache=lc)
        if cache is not None:
            cache.seqlen_offset += input_ids.shape[1]
        return self.lm_head(self.norm_f(keep_logits(h, logits_to_keep)))

    def allocate_inference_cache(self, batch_size: int, dtype=None, device=None) -> MambaCache:
        return MambaCache([layer.mixer.allocate_inference_cache(batch_size, dtype=dtype, device=device)
                           for layer in self.layers])

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """input_ids (B,) or (B, 1) -> logits (B, V); the cache advances by one token in place."""
        ids = input_ids.reshape(input_ids.shape[0])
        h = self.embedding(ids)
        for i, layer in enumerate(self.layers):
            h = layer.step(h, cache.layers[i])
        cache.seqlen_offset += 1
        return self.lm_head(self.norm_f(h))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Prefill with one forward pass, then decode with :meth:`step`. ``temperature`` 0 = greedy.
        Returns (B, L + max_new_tokens)."""
        cache = self.allocate_inference_cache(input_ids.shape[0], device=input_ids.device)
        logits = self.forward(input_ids, cache=cache, logits_to_keep=1)[:, -1]
        out = [input_ids]
        for i in range(max_new_tokens):
            if temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                lg = logits.float() / temperature
                if top_k is not None:
                    kth = lg.topk(min(top_k, lg.shape[-1]), dim=-1).values[:, -1:]
                    lg = lg.masked_fill(lg < kth, float("-inf"))
                nxt = torch.multinomial(lg.softmax(-1), 1, generator=generator).squeeze(-1)
            out.append(nxt[:, None])
            if i + 1 < max_new_tokens:
                logits = self.step(nxt, cache)
        return torch.cat(out, dim=1)
