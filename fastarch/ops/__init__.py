"""Functional ops. Each op lives in its own file with its validation, its PyTorch reference (``X_ref``)
and the backend implementations it dispatches to; importing this package registers them all and installs
the measured automatic orders (``_orders``)."""

from __future__ import annotations

from . import (
    _orders,
    attention,
    causal_conv1d,
    decoder_layer_step,
    gated_delta_rule,
    kda,
    layer_norm,
    linear,
    linear_attention,
    lsh_attention,
    mamba2_mixer_step,
    mamba3_scan,
    mamba3_step,
    mamba_mixer_step,
    mamba_split_conv1d_scan,
    rms_norm,
    rms_norm_gated,
    rotary,
    s4_kernel,
    selective_scan,
    selective_state_update,
    ssd_scan,
    ssm_convolution,
)

_OPS = (attention, causal_conv1d, decoder_layer_step, gated_delta_rule, kda, layer_norm, linear, linear_attention,
        lsh_attention, mamba2_mixer_step, mamba3_scan, mamba3_step, mamba_mixer_step, mamba_split_conv1d_scan,
        rms_norm, rms_norm_gated, rotary, s4_kernel, selective_scan, selective_state_update, ssd_scan,
        ssm_convolution)

# Each op's public names, re-exported here (the function ``attention`` replaces the module's name).
__all__ = [name for module in _OPS for name in module.__all__]
globals().update({name: getattr(module, name) for module in _OPS for name in module.__all__})

_orders.apply()
