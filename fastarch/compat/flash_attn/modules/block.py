"""flash-attn's ``flash_attn.modules.block.Block``: mixer (``MHA`` by default) and MLP sub-layers with dropout,
stochastic depth, residual adds and norms, pre-norm or post-norm, with flash-attn's constructor arguments,
``state_dict`` keys (``mixer.*``, ``norm1.*``, ``mlp.*``, ``norm2.*``) and returns. ``fused_dropout_add_ln=True``
runs the dropout-add-norm through :func:`fastarch.compat.flash_attn.ops.triton.layer_norm.layer_norm_fn`."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch import Tensor

from .._missing import missing_attribute
from ..ops.rms_norm import RMSNorm as _OpsRMSNorm
from ..ops.triton.layer_norm import RMSNorm, layer_norm_fn
from .mha import MHA
from .mlp import Mlp

__all__ = ["Block"]

__getattr__ = missing_attribute("flash_attn.modules.block")


class StochasticDepth(nn.Module):
    """Drop whole rows (``mode='row'``: one draw per leading index) or the whole batch (``'batch'``) with
    probability ``p`` while training, scaling the kept ones by ``1 / (1 - p)``; no parameters."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0 or mode not in ("row", "batch"):
            raise ValueError(f"StochasticDepth: 'p' must be in [0, 1] and 'mode' 'row' or 'batch', got p={p}, "
                             f"mode={mode!r}")
        self.p = p
        self.mode = mode

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p) if self.p < 1.0 else x * keep


_RMS_NORMS = (RMSNorm, _OpsRMSNorm)


class Block(nn.Module):
    """A transformer block.

    ``prenorm=True``: Dropout -> Add -> Norm -> Mixer -> Dropout -> Add -> Norm -> MLP;
    ``forward(hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None)`` returns
    ``(hidden_states, residual)`` (pass ``residual`` from the previous block; None for the first).
    ``prenorm=False``: Mixer -> Dropout -> Add -> Norm -> MLP -> Dropout -> Add -> Norm; returns
    ``hidden_states``. Shapes: ``(batch, seqlen, dim)``.
    """

    def __init__(self, dim: int, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 prenorm: bool = True, resid_dropout1: float = 0.0, resid_dropout2: float = 0.0,
                 drop_path1: float = 0.0, drop_path2: float = 0.0, fused_dropout_add_ln: bool = False,
                 return_residual: bool = False, residual_in_fp32: bool = False, sequence_parallel: bool = False,
                 mark_shared_params: bool = False) -> None:
        super().__init__()
        self.prenorm = prenorm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        if self.residual_in_fp32 and not self.prenorm:
            raise ValueError("flash_attn Block: residual_in_fp32=True needs prenorm=True")
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=dim // 64)
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = StochasticDepth(drop_path1, mode="row")
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = StochasticDepth(drop_path2, mode="row")
            self.norm2 = norm_cls(dim)
        if self.fused_dropout_add_ln and not (isinstance(self.norm1, (nn.LayerNorm, *_RMS_NORMS))
                                              and isinstance(self.dropout1, nn.Dropout)):
            raise ValueError("flash_attn Block: fused_dropout_add_ln=True needs a LayerNorm/RMSNorm norm_cls and "
                             "nn.Dropout dropout_cls")
        for norm in [self.norm1] + ([self.norm2] if hasattr(self, "norm2") else []):
            for p in norm.parameters():
                if sequence_parallel:
                    p._sequence_parallel = True
                if mark_shared_params:
                    p._shared_params = True

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _fused(self, x: Tensor, residual: Tensor | None, norm: nn.Module, dropout: nn.Module, drop_path, prenorm):
        rowscale = None
        if drop_path.p > 0 and self.training:
            rowscale = drop_path(torch.ones(x.shape[:-1], device=x.device, dtype=x.dtype))
        return layer_norm_fn(x, norm.weight, norm.bias, residual=residual, eps=norm.eps,
                             dropout_p=dropout.p if self.training else 0.0, rowscale=rowscale, prenorm=prenorm,
                             residual_in_fp32=self.residual_in_fp32 if prenorm else False,
                             is_rms_norm=isinstance(norm, _RMS_NORMS))

    def _prenorm_step(self, x, residual, norm, dropout, drop_path):
        if self.fused_dropout_add_ln:
            return self._fused(x, residual, norm, dropout, drop_path, True)
        dropped = drop_path(dropout(x))
        residual = dropped + residual if residual is not None else dropped
        x = norm(residual.to(dtype=norm.weight.dtype))
        return x, residual.to(torch.float32) if self.residual_in_fp32 else residual

    def _postnorm_step(self, out, x, norm, dropout, drop_path):
        if self.fused_dropout_add_ln:
            return self._fused(out, x, norm, dropout, drop_path, False)
        return norm((drop_path(dropout(out)) + x).to(dtype=norm.weight.dtype))

    def forward(self, hidden_states: Tensor, residual: Tensor | None = None, mixer_subset=None,
                mixer_kwargs: dict | None = None):
        if self.prenorm:
            hidden_states, residual = self._prenorm_step(hidden_states, residual, self.norm1, self.dropout1,
                                                         self.drop_path1)
            mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {}
            if mixer_subset is not None:
                mixer_kwargs["mixer_subset"] = mixer_subset
            hidden_states = self.mixer(hidden_states, **mixer_kwargs)
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if not isinstance(self.mlp, nn.Identity):
                hidden_states, residual = self._prenorm_step(hidden_states, residual, self.norm2, self.dropout2,
                                                             self.drop_path2)
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual
        if residual is not None:
            raise ValueError("flash_attn Block: 'residual' must be None with prenorm=False")
        mixer_out = self.mixer(hidden_states, **(mixer_kwargs if mixer_kwargs is not None else {}))
        if self.return_residual:  # the mixer returned (out, its input)
            mixer_out, hidden_states = mixer_out
        hidden_states = self._postnorm_step(mixer_out, hidden_states, self.norm1, self.dropout1, self.drop_path1)
        if not isinstance(self.mlp, nn.Identity):
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._postnorm_step(mlp_out, hidden_states, self.norm2, self.dropout2, self.drop_path2)
        return hidden_states
