"""``mamba_ssm.modules.block``: mamba-ssm's ``Block``, add -> norm -> mixer (-> add -> norm -> MLP), returning
the branch output and the residual stream so that the next block can fuse its add into its norm.

``Block(dim, mixer_cls, mlp_cls, norm_cls=nn.LayerNorm, fused_add_norm=False, residual_in_fp32=False)``:
``forward(hidden_states (B, L, dim), residual=None, inference_params=None, **mixer_kwargs) -> (hidden_states,
residual)``, both ``(B, L, dim)``; the residual is kept in fp32 with ``residual_in_fp32``. Keys: ``norm.*``,
``mixer.*``, and ``norm2.*``, ``mlp.*`` when ``mlp_cls`` is not ``nn.Identity``. ``fused_add_norm`` runs the
add and the norm as one :func:`~fastarch.compat.mamba_ssm.ops.triton.layer_norm.layer_norm_fn` call (fp32 sum);
without it they are separate steps. Both paths feed the MLP the normalised sum (mamba-ssm's unfused path did the
same once its ``norm2`` result went to ``hidden_states``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..._missing import missing_attribute
from ..ops.triton.layer_norm import RMSNorm, layer_norm_fn

__all__ = ["Block"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.modules.block")


class Block(nn.Module):
    """mamba-ssm's ``Block`` (see the module docstring)."""

    def __init__(self, dim: int, mixer_cls: Callable[[int], nn.Module], mlp_cls: Callable[[int], nn.Module],
                 norm_cls: Callable[[int], nn.Module] = nn.LayerNorm, fused_add_norm: bool = False,
                 residual_in_fp32: bool = False):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.fused_add_norm = fused_add_norm
        self.norm = norm_cls(dim)
        self.mixer = mixer_cls(dim)
        if mlp_cls is not nn.Identity:
            self.norm2 = norm_cls(dim)
            self.mlp = mlp_cls(dim)
        else:
            self.mlp = None
        if fused_add_norm and not isinstance(self.norm, (nn.LayerNorm, RMSNorm)):
            raise TypeError("Block: fused_add_norm=True needs norm_cls to build an nn.LayerNorm or mamba_ssm's "
                            f"RMSNorm, got {type(self.norm).__name__}")

    def _add_norm(self, norm: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_add_norm:
            return layer_norm_fn(hidden_states, norm.weight, norm.bias, residual=residual, prenorm=True,
                                 residual_in_fp32=self.residual_in_fp32, eps=norm.eps,
                                 is_rms_norm=isinstance(norm, RMSNorm))
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = norm(residual.to(dtype=norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return hidden_states, residual

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, inference_params=None,
                **mixer_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states`` (the previous block's branch output, or the embeddings) and ``residual`` (None for the
        first block), ``(B, L, dim)`` -> ``(branch output, residual stream)``."""
        hidden_states, residual = self._add_norm(self.norm, hidden_states, residual)
        hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        if self.mlp is not None:
            hidden_states, residual = self._add_norm(self.norm2, hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
