"""mamba-ssm's Mamba-2 entry points in fastarch.compat: ``ops.triton.ssd_combined``
(``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``, ``mamba_split_conv1d_scan_ref``) and
``ops.triton.layernorm_gated`` (``RMSNorm``, ``rmsnorm_fn``): signatures, import paths after install(), and
code written for mamba-ssm running unchanged."""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import fastarch.compat as compat
import fastarch.ops as ops
from fastarch.compat.mamba_ssm.ops.triton import layernorm_gated, ssd_combined

E = inspect.Parameter.empty


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]


def test_signatures():
    assert _params(ssd_combined.mamba_split_conv1d_scan_combined) == [
        ("zxbcdt", E), ("conv1d_weight", E), ("conv1d_bias", E), ("dt_bias", E), ("A", E), ("D", E),
        ("chunk_size", E), ("initial_states", None), ("seq_idx", None), ("dt_limit", (0.0, math.inf)),
        ("return_final_states", False), ("activation", "silu"), ("rmsnorm_weight", None), ("rmsnorm_eps", 1e-6),
        ("outproj_weight", None), ("outproj_bias", None), ("headdim", None), ("ngroups", 1),
        ("norm_before_gate", True)]
    assert _params(ssd_combined.mamba_split_conv1d_scan_ref) == [
        ("zxbcdt", E), ("conv1d_weight", E), ("conv1d_bias", E), ("dt_bias", E), ("A", E), ("D", E),
        ("chunk_size", E), ("dt_limit", (0.0, math.inf)), ("activation", "silu"), ("rmsnorm_weight", None),
        ("rmsnorm_eps", 1e-6), ("outproj_weight", None), ("outproj_bias", None), ("headdim", None),
        ("ngroups", 1), ("norm_before_gate", True)]
    assert _params(layernorm_gated.rmsnorm_fn) == [
        ("x", E), ("weight", E), ("bias", E), ("z", None), ("eps", 1e-6), ("group_size", None),
        ("norm_before_gate", True)]
    assert [(p.name, p.default) for p in inspect.signature(layernorm_gated.RMSNorm).parameters.values()] == [
        ("hidden_size", E), ("eps", 1e-5), ("group_size", None), ("norm_before_gate", True), ("device", None),
        ("dtype", None)]
    assert ssd_combined.mamba_chunk_scan_combined is ops.mamba_chunk_scan_combined
    assert ssd_combined.mamba_split_conv1d_scan_combined is ops.mamba_split_conv1d_scan_combined


@pytest.fixture
def installed():
    if importlib.util.find_spec("mamba_ssm") is not None and not compat.installed():
        pytest.skip("the real mamba_ssm is installed here")
    compat.install()
    yield
    compat.uninstall()
    for n in [n for n in sys.modules if n.partition(".")[0] == "mamba_ssm"]:
        del sys.modules[n]


def test_import_paths_after_install(installed):
    from mamba_ssm.ops.triton.layernorm_gated import RMSNorm, rmsnorm_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

    assert mamba_chunk_scan_combined is ops.mamba_chunk_scan_combined
    assert mamba_split_conv1d_scan_combined is ops.mamba_split_conv1d_scan_combined
    assert rmsnorm_fn is layernorm_gated.rmsnorm_fn and RMSNorm is layernorm_gated.RMSNorm


def test_mamba2_style_code_runs_unchanged(installed):
    """What mamba-ssm's Mamba2.forward does on its fused path, with mamba-ssm's imports and argument style."""
    from mamba_ssm.ops.triton.layernorm_gated import RMSNorm as RMSNormGated
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined

    torch.manual_seed(0)
    batch, L, nheads, headdim, ngroups, dstate, d_model = 2, 21, 4, 8, 2, 8, 16
    dim = nheads * headdim
    in_proj = torch.nn.Linear(d_model, 2 * dim + 2 * ngroups * dstate + nheads, bias=False)
    conv = torch.nn.Conv1d(dim + 2 * ngroups * dstate, dim + 2 * ngroups * dstate, 4, groups=dim + 2 * ngroups * dstate,
                           padding=3)
    norm = RMSNormGated(dim, eps=1e-5, norm_before_gate=False, group_size=dim // ngroups)
    out_proj = torch.nn.Linear(dim, d_model, bias=False)
    dt_bias, A_log, D = torch.randn(nheads) * 0.3, torch.log(torch.rand(nheads) * 4 + 1), torch.ones(nheads)
    u = torch.randn(batch, L, d_model)
    zxbcdt = in_proj(u)
    A = -torch.exp(A_log)
    fused = mamba_split_conv1d_scan_combined(
        zxbcdt, conv.weight.squeeze(1), conv.bias, dt_bias, A, D=D, chunk_size=8, seq_idx=None, activation="silu",
        rmsnorm_weight=norm.weight, rmsnorm_eps=norm.eps, outproj_weight=out_proj.weight, outproj_bias=None,
        headdim=headdim, ngroups=ngroups, norm_before_gate=False)
    # mamba-ssm's unfused path: conv1d, mamba_chunk_scan_combined, RMSNormGated(y, z), out_proj
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = F.silu(conv(xBC.transpose(1, 2))[..., :L].transpose(1, 2))
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    y = mamba_chunk_scan_combined(x.reshape(batch, L, nheads, headdim), dt, A,
                                  B.reshape(batch, L, ngroups, dstate), C.reshape(batch, L, ngroups, dstate),
                                  chunk_size=8, D=D, z=None, dt_bias=dt_bias, dt_softplus=True)
    unfused = out_proj(norm(y.reshape(batch, L, dim), z))
    torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-5)


def test_rmsnorm_fn_and_module_agree():
    x, z = torch.randn(3, 16), torch.randn(3, 16)
    norm = layernorm_gated.RMSNorm(16, group_size=8, norm_before_gate=True)
    torch.testing.assert_close(norm(x, z), layernorm_gated.rmsnorm_fn(x, norm.weight, None, z, 1e-5, 8, True))
    torch.testing.assert_close(norm(x), ops.rms_norm_gated(x, norm.weight, eps=1e-5, group_size=8))
