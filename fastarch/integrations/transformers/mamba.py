"""Mamba mixers: the projections on :func:`fastarch.ops.linear` (a ``TorchFunctionMode`` scoped to the mixer's
call) and ``MambaMixer``'s decode step as one :func:`fastarch.ops.mamba_mixer_step`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from transformers.utils.import_utils import is_torchdynamo_exporting

from ...nn.mamba import mixer_step as _mixer_step
from ...ops.linear import linear as _linear

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


def _mamba_mixer_forward(original: Callable) -> Callable:
    """``MambaMixer.forward`` whose single-token decode step on CPU in fp32 (a cache holding both states, no
    padding mask) runs as one :func:`fastarch.nn.mamba.mixer_step` on the module's own weights; every other call
    (prefill, autograd, accelerators, other dtypes, offloaded weights, export) runs transformers' forward, with
    its projections on :func:`fastarch.ops.linear` for CPU input (:func:`_projections_on_fastarch`). The cache
    argument is found by the signature (``cache`` from transformers 5.24, ``cache_params`` before)."""
    rest = _projections_on_fastarch(original)
    read = _argument_reader(original, ("cache", "cache_params"), ("attention_mask",))

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        cache, attention_mask = read(args, kwargs)
        if (cache is not None and attention_mask is None and hidden_states.dim() == 3
                and hidden_states.shape[1] == 1 and hidden_states.device.type == "cpu"
                and hidden_states.dtype == torch.float32 and self.in_proj.weight.dtype == torch.float32
                and self.in_proj.weight.device.type == "cpu" and not hasattr(self, "_hf_hook")
                and not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.in_proj.weight.requires_grad))
                and not is_torchdynamo_exporting()):
            conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
            ssm_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
            if (conv_state is not None and ssm_state is not None and conv_state.device.type == "cpu"
                    and not cache.is_recording_past(self.layer_idx)):
                out = _mixer_step(hidden_states[:, 0], self.in_proj, self.conv1d, self.x_proj, self.dt_proj,
                                  self.A_log, self.D, self.out_proj, conv_state, ssm_state)
                return out.unsqueeze(1)
        return rest(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward
