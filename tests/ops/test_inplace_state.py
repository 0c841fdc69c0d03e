"""A rejected call of an op that updates state in place leaves that state bit-identical, NaN payloads
included, on every backend."""

from __future__ import annotations

import pytest
import torch

from fastarch.ops.causal_conv1d import causal_conv1d_update
from fastarch.ops.mamba_mixer_step import mamba_mixer_step
from fastarch.ops.selective_state_update import selective_state_update
from tests._inplace import assert_bits_equal, bits, nan_poisoned


def _ssu_args() -> dict:
    g = torch.Generator().manual_seed(3)
    B, H, P, N = 2, 4, 8, 16
    return dict(x=torch.randn(B, H, P, generator=g), dt=torch.rand(B, H, P, generator=g),
                A=-torch.rand(H, P, N, generator=g), B=torch.randn(B, 1, N, generator=g),
                C=torch.randn(B, 1, N, generator=g), D=torch.randn(H, P, generator=g),
                z=torch.randn(B, H, P, generator=g), dt_bias=torch.randn(H, P, generator=g))


_SSU_BAD = {
    "x_float64": (TypeError, "'x'", lambda a: {"x": a["x"].double()}),
    "A_int64": (TypeError, "'A'", lambda a: {"A": a["A"].long()}),
    "D_shape": (ValueError, "'D'", lambda a: {"D": a["D"][:, :7]}),
    "groups": (ValueError, "groups", lambda a: {"B": torch.randn(2, 3, 16)}),
    "indices_dtype": (TypeError, "'state_batch_indices'", lambda a: {"state_batch_indices": torch.tensor([0., 1.])}),
    "indices_repeat": (ValueError, "'state_batch_indices'", lambda a: {"state_batch_indices": torch.tensor([1, 1])}),
    "indices_range": (IndexError, "'state_batch_indices'", lambda a: {"state_batch_indices": torch.tensor([0, 2])}),
    "device": (ValueError, "'x'", lambda a: {"x": a["x"].to("meta")}),
}


@pytest.mark.op("selective_state_update")
@pytest.mark.parametrize("bad", sorted(_SSU_BAD))
def test_selective_state_update_rejection_keeps_state_bits(backend, bad):
    args = _ssu_args()
    exc, match, change = _SSU_BAD[bad]
    args.update(change(args))
    state = nan_poisoned(torch.randn(2, 4, 8, 16))
    before = bits(state)
    with pytest.raises(exc, match=match):
        selective_state_update(state, **args, dt_softplus=True, backend=backend)
    assert_bits_equal(before, state)


@pytest.mark.op("selective_state_update")
def test_selective_state_update_refuses_an_expanded_state(backend):
    """Rows of an expanded state share memory: an update would write every row through one; refused."""
    base = nan_poisoned(torch.randn(1, 4, 8, 16))
    state = base.expand(2, 4, 8, 16)
    before = bits(base)
    with pytest.raises(ValueError, match="'state'.*expanded"):
        selective_state_update(state, **_ssu_args(), backend=backend)
    assert_bits_equal(before, base)


_CCU_BAD = {
    "x_float64": (TypeError, "'x'", {"x": torch.randn(2, 6, 3, dtype=torch.float64)}),
    "bias_shape": (ValueError, "'bias'", {"bias": torch.randn(5)}),
    "activation": (NotImplementedError, "activation", {"activation": "relu"}),
    "seqlens_negative": (ValueError, "'cache_seqlens'", {"cache_seqlens": torch.tensor([-1, 2])}),
    "seqlens_past_int32": (ValueError, "'cache_seqlens'", {"cache_seqlens": torch.tensor([2**31, 2])}),
    "seqlens_float": (TypeError, "'cache_seqlens'", {"cache_seqlens": torch.tensor([1.0, 2.0])}),
    "indices_repeat": (ValueError, "'conv_state_indices'", {"conv_state_indices": torch.tensor([0, 0])}),
    "indices_range": (IndexError, "'conv_state_indices'", {"conv_state_indices": torch.tensor([0, 5])}),
    "weight_wider_than_state": (ValueError, "'conv_state'", {"weight": torch.randn(6, 7)}),
}


@pytest.mark.op("causal_conv1d_update")
@pytest.mark.parametrize("bad", sorted(_CCU_BAD))
def test_causal_conv1d_update_rejection_keeps_state_bits(backend, bad):
    exc, match, change = _CCU_BAD[bad]
    g = torch.Generator().manual_seed(4)
    args = dict(x=torch.randn(2, 6, 3, generator=g), weight=torch.randn(6, 4, generator=g),
                bias=torch.randn(6, generator=g))
    args.update(change)
    state = nan_poisoned(torch.randn(2, 6, 5, generator=g))
    before = bits(state)
    with pytest.raises(exc, match=match):
        causal_conv1d_update(conv_state=state, **args, backend=backend)
    assert_bits_equal(before, state)


@pytest.mark.op("causal_conv1d_update")
def test_causal_conv1d_update_refuses_an_expanded_state(backend):
    base = nan_poisoned(torch.randn(1, 6, 5))
    before = bits(base)
    with pytest.raises(ValueError, match="'conv_state'.*expanded"):
        causal_conv1d_update(torch.randn(2, 6), base.expand(2, 6, 5), torch.randn(6, 4), backend=backend)
    assert_bits_equal(before, base)


def _mixer_args() -> dict:
    g = torch.Generator().manual_seed(6)
    B, d_model, d_inner, d_state, rank, width = 2, 8, 16, 4, 2, 4

    def rn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    return dict(x=rn(B, d_model), in_proj_weight=rn(2 * d_inner, d_model), in_proj_bias=rn(2 * d_inner),
                conv_weight=rn(d_inner, width), conv_bias=rn(d_inner), x_proj_weight=rn(rank + 2 * d_state, d_inner),
                x_proj_bias=None, dt_proj_weight=rn(d_inner, rank), dt_proj_bias=rn(d_inner),
                A_log=torch.log(torch.rand(d_inner, d_state, generator=g) + 1), D=rn(d_inner),
                out_proj_weight=rn(d_model, d_inner), out_proj_bias=rn(d_model),
                conv_state=nan_poisoned(rn(B, d_inner, width - 1)), ssm_state=nan_poisoned(rn(B, d_inner, d_state)),
                norm_weight=rn(d_model), norm_eps=1e-5)


# Each of these was refused only by an op that ran after the conv state (or both states) had been written.
_MIXER_BAD = {
    "D_shape": (ValueError, "'D'", lambda a: {"D": a["D"][:15]}),
    "dt_proj_bias_shape": (ValueError, "'dt_proj_bias'", lambda a: {"dt_proj_bias": a["dt_proj_bias"][:3]}),
    "out_proj_bias_shape": (ValueError, "'out_proj_bias'", lambda a: {"out_proj_bias": a["out_proj_bias"][:5]}),
    "x_proj_dtype": (TypeError, "'x_proj_weight'", lambda a: {"x_proj_weight": a["x_proj_weight"].half()}),
    "out_proj_dtype": (TypeError, "'out_proj_weight'", lambda a: {"out_proj_weight": a["out_proj_weight"].half()}),
    "norm_eps_nan": (ValueError, "'norm_eps'", lambda a: {"norm_eps": float("nan")}),
    "ssm_state_expanded": (ValueError, "'ssm_state'.*expanded",
                           lambda a: {"ssm_state": a["ssm_state"][:1].expand_as(a["ssm_state"])}),
}


@pytest.mark.op("mamba_mixer_step")
@pytest.mark.parametrize("bad", sorted(_MIXER_BAD))
def test_mamba_mixer_step_rejection_keeps_both_states_bits(backend, bad):
    args = _mixer_args()
    exc, match, change = _MIXER_BAD[bad]
    args.update(change(args))
    before = bits(args["conv_state"]), bits(args["ssm_state"])
    with torch.no_grad(), pytest.raises(exc, match=match):
        mamba_mixer_step(**args, backend=backend)
    assert_bits_equal(before[0], args["conv_state"], "conv_state")
    assert_bits_equal(before[1], args["ssm_state"], "ssm_state")
