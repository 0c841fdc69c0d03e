"""Mamba mixers: the projections on :func:`fastarch.ops.linear` (a ``TorchFunctionMode`` scoped to the mixer's
call), ``MambaMixer``'s decode step as one :func:`fastarch.ops.mamba_mixer_step` and ``Mamba2Mixer``'s as one
:func:`fastarch.ops.mamba2_mixer_step`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from transformers.utils.import_utils import is_torchdynamo_exporting

from ...nn.mamba import mixer_step as _mixer_step
from ...ops.linear import linear as _linear
from ...ops.mamba2_mixer_step import mamba2_mixer_step as _mamba2_step

__all__: list[str] = []

# -- the mixers' projections ----------------------------------------------------------------------------------
_F_LINEAR = torch.nn.functional.linear


def _linear_arguments(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``torch.nn.functional.linear``'s arguments, however they were passed."""
    return input, weight, bias


class _LinearOnFastarch(TorchFunctionMode):
    """While active: ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) on fp32 CPU tensors runs
    :func:`fastarch.ops.linear`, whose selector takes the C++ kernel for a decode step's few rows and oneDNN's
    GEMM beyond; every other call runs as it would. A mode is scoped to the thread and the ``with`` block,
    so nothing of the model or of torch is modified."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_LINEAR:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.device.type == "cpu"
                    and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)):
                return _linear(x, weight, bias)
        return func(*args, **kwargs)


def _projections_on_fastarch(original: Callable) -> Callable:
    """A mixer ``forward`` whose ``nn.Linear`` projections (in_proj, out_proj, ...) run on
    :func:`fastarch.ops.linear` when the input is on the CPU (see :class:`_LinearOnFastarch`); on other devices
    and under export it is transformers' forward untouched."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.device.type != "cpu" or is_torchdynamo_exporting() or torch.compiler.is_compiling():
            return original(self, hidden_states, *args, **kwargs)
        with _LinearOnFastarch():
            return original(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


# -- Mamba's decode step and norm ------------------------------------------------------------------------------
def _argument_reader(original: Callable, *names: str) -> Callable[[tuple, dict], tuple]:
    """A reader of ``original``'s arguments ``names`` (each a tuple of accepted spellings, the first the one
    the signature has, later ones deprecated aliases) from a call's ``(args, kwargs)`` that exclude ``self``
    and the first tensor argument: transformers renames keywords between releases (``cache_params`` became
    ``cache``), so positions and spellings are read off the signature once, not assumed."""
    params = list(inspect.signature(original).parameters)[2:]
    slots = []
    for spellings in names:
        found = next((n for n in spellings if n in params), spellings[0])
        slots.append((params.index(found) if found in params else None, (found, *spellings)))

    def read(args: tuple, kwargs: dict) -> tuple:
        values = []
        for index, spellings in slots:
            if index is not None and index < len(args):
                values.append(args[index])
            else:
                values.append(next((kwargs[n] for n in spellings if n in kwargs), None))
        return tuple(values)

    return read


def _decode_states(self, hidden_states: torch.Tensor, cache, attention_mask) -> tuple | None:
    """The layer's (conv_state, ssm_state) when this call is a single-token decode step that a fused CPU step
    may take: a cache holding both states on the CPU, no padding mask, fp32 input and weights on the CPU, no
    gradient recorded, no offloading hook, not exported; else None."""
    if not (cache is not None and attention_mask is None and hidden_states.dim() == 3
            and hidden_states.shape[1] == 1 and hidden_states.device.type == "cpu"
            and hidden_states.dtype == torch.float32 and self.in_proj.weight.dtype == torch.float32
            and self.in_proj.weight.device.type == "cpu" and not hasattr(self, "_hf_hook")
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.in_proj.weight.requires_grad))
            and not is_torchdynamo_exporting()):
        return None
    conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
    ssm_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    if (conv_state is None or ssm_state is None or conv_state.device.type != "cpu"
            or cache.is_recording_past(self.layer_idx)):
        return None
    return conv_state, ssm_state


def _mamba_mixer_forward(original: Callable) -> Callable:
    """``MambaMixer.forward`` whose single-token decode step on CPU in fp32 (:func:`_decode_states`) runs as one
    :func:`fastarch.nn.mamba.mixer_step` on the module's own weights; every other call (prefill, autograd,
    accelerators, other dtypes, offloaded weights, export) runs transformers' forward, with its projections on
    :func:`fastarch.ops.linear` for CPU input (:func:`_projections_on_fastarch`). The cache argument is found by
    the signature (``cache`` from transformers 5.24, ``cache_params`` before)."""
    rest = _projections_on_fastarch(original)
    read = _argument_reader(original, ("cache", "cache_params"), ("attention_mask",))

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        cache, attention_mask = read(args, kwargs)
        states = _decode_states(self, hidden_states, cache, attention_mask)
        if states is not None:
            out = _mixer_step(hidden_states[:, 0], self.in_proj, self.conv1d, self.x_proj, self.dt_proj,
                              self.A_log, self.D, self.out_proj, *states)
            return out.unsqueeze(1)
        return rest(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


def _mamba2_mixer_forward(original: Callable) -> Callable:
    """``Mamba2Mixer.forward`` whose single-token decode step on CPU in fp32 (:func:`_decode_states`, SiLU
    convolution) runs as one :func:`fastarch.ops.mamba2_mixer_step` on the module's own weights, as transformers'
    decode path computes it (``norm(y * silu(z))`` over the norm's groups; no ``time_step_limit`` clamp in a
    decode step); every other call runs transformers' forward with its projections on
    :func:`fastarch.ops.linear` for CPU input."""
    rest = _projections_on_fastarch(original)
    read = _argument_reader(original, ("cache", "cache_params"), ("attention_mask",))

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        cache, attention_mask = read(args, kwargs)
        states = _decode_states(self, hidden_states, cache, attention_mask) if self.activation == "silu" else None
        if states is not None:
            norm = self.norm
            out = _mamba2_step(hidden_states[:, 0], self.in_proj.weight, self.in_proj.bias,
                               self.conv1d.weight.squeeze(1), self.conv1d.bias, self.dt_bias, self.A_log, self.D,
                               norm.weight, self.out_proj.weight, self.out_proj.bias, *states, ngroups=self.n_groups,
                               norm_eps=norm.variance_epsilon,
                               norm_group_size=getattr(norm, "group_size", None) or self.intermediate_size,
                               norm_before_gate=False)
            return out.unsqueeze(1)
        return rest(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward
