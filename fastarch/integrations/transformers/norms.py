"""Norm forwards on fastarch's norm ops: Mamba-2's gated, grouped RMSNorm, and the RMSNorms of Mamba, Mamba-2
and the Llama family (CPU; fp32, bf16, fp16)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.utils.import_utils import is_torchdynamo_exporting

from ...ops.rms_norm import rms_norm as _rms_norm
from ...ops.rms_norm_gated import rms_norm_gated as _rms_norm_gated

__all__ = ["NORM_MODULES"]

# Mamba-2's gated norm is ``MambaRMSNormGated`` up to transformers 5.24 and ``Mamba2RMSNormGated`` from 5.25.
NORM_MODULES: tuple[tuple[str, str], ...] = (("transformers.models.mamba2.modeling_mamba2", "MambaRMSNormGated"),
                                            ("transformers.models.mamba2.modeling_mamba2", "Mamba2RMSNormGated"),
                                            ("transformers.models.mamba2.modeling_mamba2", "Mamba2RMSNorm"))

# transformers' kernel name -> fastarch's function with the original package's signature.


# -- Mamba-2's norms -----------------------------------------------------------------------------------------
def _gated_norm(module: torch.nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Mamba-2's gated norm: ``weight * norm(x * silu(gate))``, one RMS per group of ``group_size`` channels."""
    return _rms_norm_gated(hidden_states, module.weight, z=gate, eps=module.variance_epsilon,
                           group_size=getattr(module, "group_size", hidden_states.shape[-1]),
                           norm_before_gate=False)


def _norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Mamba2RMSNorm``: ``weight * norm(x)`` over the last dimension."""
    return _rms_norm(hidden_states, module.weight, module.variance_epsilon)


_NORMS: dict[str, Callable[..., torch.Tensor]] = {"MambaRMSNormGated": _gated_norm, "Mamba2RMSNormGated": _gated_norm,
                                                  "Mamba2RMSNorm": _norm}


def _norm_forward(original: Callable, fast: Callable[..., torch.Tensor]) -> Callable:
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        gate = args[0] if args else kwargs.get("gate")
        # Mixed dtypes (an fp32 residual stream into a bf16 norm) stay on transformers' forward: fastarch's
        # norm ops take one dtype.
        if (is_torchdynamo_exporting() or hidden_states.dtype != self.weight.dtype
                or (gate is not None and gate.dtype != hidden_states.dtype)):
            return original(self, hidden_states, *args, **kwargs)
        out = fast(self, hidden_states, *args, **kwargs)
        # transformers' forwards return weight * x.to(input dtype), in the promoted dtype
        return out.to(torch.promote_types(self.weight.dtype, hidden_states.dtype))

    forward.__fastarch_original__ = original
    return forward


# The dtypes fastarch's norm and rotary ops read and write natively on the CPU (fp32 accumulation).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_cpu(original: Callable, fast: Callable) -> Callable:
    """A forward that runs ``fast`` when the input and the module's weight are CPU tensors of one dtype among
    fp32, bf16 and fp16, else ``original`` (other devices; other or mixed dtypes, e.g. an fp32 residual
    stream into a bf16 norm)."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        native = (hidden_states.device.type == "cpu" and hidden_states.dtype in _NATIVE_DTYPES
                  and self.weight.dtype == hidden_states.dtype)
        return (fast if native else original)(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


def _cpu_rms_norm_forward(original: Callable) -> Callable:
    """An RMSNorm forward (``weight * norm(x)``, one ``weight`` and ``variance_epsilon``) on
    :func:`fastarch.ops.rms_norm` for CPU input and weight of one dtype (fp32, bf16, fp16), else ``original``.
    In bf16 and fp16 the result is rounded once (transformers rounds the normalised input, then the
    product), so the two differ by at most a unit in the last place."""
    return _on_cpu(original, _norm_forward(original, _norm))
