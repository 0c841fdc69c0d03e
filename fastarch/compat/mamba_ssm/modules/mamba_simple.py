"""``mamba_ssm.modules.mamba_simple``: mamba-ssm 2.x's ``Mamba`` layer, on :class:`fastarch.nn.Mamba` (``Block`` lives
in ``mamba_ssm.modules.block``, as in mamba-ssm 2.x).

``Mamba`` takes mamba-ssm's constructor arguments and ``state_dict`` keys (``in_proj.weight``,
``conv1d.weight``, ``conv1d.bias``, ``x_proj.weight``, ``dt_proj.weight``, ``dt_proj.bias``, ``A_log``, ``D``,
``out_proj.weight``) and its decode protocol: ``forward(hidden_states (B, L, d_model), inference_params=None)``
keeps ``(conv_state (B, d_inner, d_conv), ssm_state (B, d_inner, d_state))`` in
``inference_params.key_value_memory_dict[layer_idx]``; a forward at ``seqlen_offset == 0`` fills them (prefill),
one at ``seqlen_offset > 0`` is one :meth:`Mamba.step`. The SSM state is kept in fp32 unless ``dtype`` is given
to ``allocate_inference_cache``.
"""

from __future__ import annotations

import torch

from fastarch.nn.mamba import Mamba as _Mamba
from fastarch.nn.mamba import MambaLayerCache, mixer_step
from fastarch.nn.mamba2 import Mamba2 as _Mamba2

from ..._missing import missing_attribute

__all__ = ["Mamba"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.mamba_simple")


class Mamba(_Mamba):
    """mamba-ssm's ``Mamba`` (see the module docstring); :class:`fastarch.nn.Mamba` with ``inference_params``."""

    def forward(self, hidden_states: torch.Tensor, inference_params=None, **kwargs) -> torch.Tensor:
        """hidden_states: ``(batch, L, d_model)`` -> ``(batch, L, d_model)``."""
        if isinstance(inference_params, MambaLayerCache):  # fastarch's own cache form
            return super().forward(hidden_states, inference_params)
        if inference_params is None:
            return super().forward(hidden_states)
        conv_state, ssm_state = self._get_states_from_cache(inference_params, hidden_states.shape[0])
        if inference_params.seqlen_offset > 0:
            out, _, _ = self.step(hidden_states, conv_state, ssm_state)
            return out
        return super().forward(hidden_states, MambaLayerCache(conv_state, ssm_state))

    def step(self, hidden_states: torch.Tensor, conv_state, ssm_state: torch.Tensor | None = None):
        """One token: ``hidden_states`` ``(batch, 1, d_model)`` -> ``(out (batch, 1, d_model), conv_state,
        ssm_state)``, the states advanced in place. (Also fastarch's form ``step(x, MambaLayerCache)``.)"""
        if isinstance(conv_state, MambaLayerCache):
            return super().step(hidden_states, conv_state)
        if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            raise ValueError("Mamba.step: argument 'hidden_states' must be (batch, 1, d_model) (one token at a "
                             f"time), got shape {tuple(hidden_states.shape)}")
        out = mixer_step(hidden_states[:, 0], self.in_proj, self.conv1d, self.x_proj, self.dt_proj, self.A_log,
                         self.D, self.out_proj, conv_state, ssm_state)
        return out.unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int | None = None, dtype=None, device=None,
                                 **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero ``(conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state))``; dtypes: the
        conv weight's and fp32 unless ``dtype`` is given."""
        cache = super().allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, device=device)
        if dtype is not None:
            cache.ssm_state = cache.ssm_state.to(dtype)
        return cache.conv_state, cache.ssm_state

    # mamba-ssm's lookup: the layer's states in key_value_memory_dict[layer_idx], allocated on first use
    _get_states_from_cache = _Mamba2._get_states_from_cache
