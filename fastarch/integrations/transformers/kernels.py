"""The kernel functions transformers resolves by package name (``use_kernel_func_from_hub_with_fallback``):
their global names in the modeling modules, and the dispatchers onto :mod:`fastarch.compat` that
:func:`~fastarch.integrations.transformers.register` puts in their place."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable

from transformers.utils.import_utils import is_torchdynamo_exporting

from ...compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from ...compat.fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from ...compat.fla.ops.kda import chunk_kda, fused_recurrent_kda
from ...compat.mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn
from ...compat.mamba_ssm.ops.triton.selective_state_update import selective_state_update
from ...compat.mamba_ssm.ops.triton.ssd_combined import (
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
)

__all__ = ["KERNEL_EXCEPTIONS", "KERNEL_GLOBALS", "is_kernel_function"]

_KERNELS: dict[str, Callable] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "selective_scan_fn": selective_scan_fn,
    "selective_state_update": selective_state_update,
    "mamba_inner_fn": mamba_inner_fn,
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    "chunk_kda": chunk_kda,
    "fused_recurrent_kda": fused_recurrent_kda,
}


# -- Mamba kernel functions -------------------------------------------------------------------------------
# transformers' modeling modules bind each kernel function, made by
# ``use_kernel_func_from_hub_with_fallback(kernel, package)``, to a module global whose name is the same in
# every family: global name -> (kernel name, package). Only globals that transformers made that way
# (:func:`is_kernel_function`) are replaced.
KERNEL_GLOBALS: dict[str, tuple[str, str]] = {
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d_update", "causal_conv1d"),
    "mamba_inner_fn": ("mamba_inner_fn", "mamba_ssm"),
    "mamba_selective_scan": ("selective_scan_fn", "mamba_ssm"),
    "mamba_selective_state_update": ("selective_state_update", "mamba_ssm"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
    "mamba2_selective_state_update": ("selective_state_update", "mamba_ssm"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
    # the gated delta rule (Qwen3-Next, Qwen3.5, OLMo-hybrid) and KDA (Kimi-Linear)
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule", "fla"),
    "torch_recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule", "fla"),
    "chunk_kimi_delta_attention": ("chunk_kda", "fla"),
    "recurrent_kimi_delta_attention": ("fused_recurrent_kda", "fla"),
}


# (modeling module, global) kernel functions left to transformers, and why (report() gives the reason).
KERNEL_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("transformers.models.falcon_mamba.modeling_falcon_mamba", "mamba_inner_fn"):
        "FalconMamba's PyTorch path normalises dt over dt_rank before dt_proj, mamba-ssm's fused mamba_inner_fn "
        "(and fastarch's) over d_inner after it; training keeps transformers' unfused path, whose scan and "
        "convolution run on fastarch",
}


def is_kernel_function(obj: object) -> bool:
    """Did transformers make ``obj`` with its kernel lookup? Its wrapper is a ``functools.wraps`` function
    (``__wrapped__``) or, when Hugging Face's ``kernels`` package is installed (transformers 5.25 requires it),
    that package's hub-replaceable layer around it (``kernel_layer_name``)."""
    return callable(obj) and (hasattr(obj, "__wrapped__") or isinstance(getattr(obj, "kernel_layer_name", None), str))


def _real_package(package: str) -> bool:
    """Is the original package (not fastarch's alias of it, :func:`fastarch.compat.install`) importable?
    transformers resolved its kernel functions to it then."""

    loaded = sys.modules.get(package)
    if loaded is not None:
        return not getattr(loaded, "__name__", package).startswith("fastarch.") and not getattr(
            loaded, "__fastarch_alias__", False)
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _dispatcher(original: Callable, name: str, real_package: bool) -> Callable:
    """``original`` (transformers' kernel function ``name``) with CPU calls, and every call when the real
    package is absent, on fastarch's function of the package's signature, given the keywords it takes (as
    transformers' wrapper calls the real package: the PyTorch path's own switches are dropped)."""
    target = _KERNELS[name]
    params = frozenset(inspect.signature(target).parameters)

    def run(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if is_torchdynamo_exporting() or (real_package and first.device.type != "cpu"):
            return original(*args, **kwargs)
        return target(*args, **{k: v for k, v in kwargs.items() if k in params})

    if isinstance(original, types.FunctionType):
        functools.update_wrapper(run, original)
    else:  # a kernels-package layer object: its name, not its module state
        run.__name__ = run.__qualname__ = name
        run.__wrapped__ = original
    run.__fastarch_original__ = original
    return run


# Kernel functions transformers resolves that fastarch does not provide: global name -> kernel (none now).
_MISSING_KERNELS: dict[str, str] = {}
