"""``causal_conv1d.causal_conv1d_interface``: the package's functions, positional order and defaults.

- ``causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
  final_states_out=None, activation=None)`` -> ``out`` or ``(out, final_states)``;
- ``causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False,
  final_states_out=None, activation=None)`` (no ``seq_idx``, like the package's);
- ``causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
  conv_state_indices=None)`` and ``causal_conv1d_update_ref(x, conv_state, weight, bias=None,
  activation=None, cache_seqlens=None)``.

Shapes and semantics: :mod:`fastarch.ops.causal_conv1d`. Where the package's CUDA kernels refuse a layout
(``seq_idx``, initial and final states only for channel-last ``x``), fastarch accepts any strides.
"""

from __future__ import annotations

import torch

from ...ops.causal_conv1d import causal_conv1d_fn
from ...ops.causal_conv1d import causal_conv1d_ref as _ref
from ...ops.causal_conv1d import causal_conv1d_update as _update
from ...ops.causal_conv1d import causal_conv1d_update_ref as _update_ref
from .._missing import missing_attribute

__all__ = ["causal_conv1d_fn", "causal_conv1d_ref", "causal_conv1d_update", "causal_conv1d_update_ref"]

__getattr__ = missing_attribute("causal_conv1d", "causal_conv1d.causal_conv1d_interface")


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      initial_states: torch.Tensor | None = None, return_final_states: bool = False,
                      final_states_out: torch.Tensor | None = None, activation: str | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The package's reference, in composed PyTorch (differentiable through autograd)."""
    return _ref(x, weight, bias, activation, initial_states=initial_states, return_final_states=return_final_states,
                final_states_out=final_states_out)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         cache_seqlens: torch.Tensor | None = None,
                         conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The package's decode step; ``conv_state`` is updated in place (a circular buffer with
    ``cache_seqlens``)."""
    return _update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)


def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = None,
                             cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The package's reference decode step, in composed PyTorch."""
    return _update_ref(x, conv_state, weight, bias, activation, cache_seqlens)
