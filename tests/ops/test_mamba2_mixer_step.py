"""mamba2_mixer_step: every backend against the op-by-op reference over a sequence of steps, gradients through
the torch backend, and bad input refused with the states untouched. (The hypothesis-drawn grid, opcheck and
torch.compile are in test_conformance.py; fastarch.nn.Mamba2.step, which runs this op, is checked against the
module's forward in tests/nn/test_mamba2.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from fastarch import ops
from tests._inplace import assert_bits_equal, bits

pytestmark = pytest.mark.op("mamba2_mixer_step")


def _inputs(B=2, Dm=16, H=4, P=8, N=6, G=2, W=4, Do=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, Cd = H * P, H * P + 2 * G * N

    def r(*shape, s=0.3):
        return torch.randn(*shape, generator=g) * s

    weights = dict(in_proj_weight=r(2 * E + 2 * G * N + H, Dm), in_proj_bias=r(2 * E + 2 * G * N + H),
                   conv_weight=r(Cd, W), conv_bias=r(Cd), dt_bias=r(H), A_log=torch.log(torch.rand(H, generator=g) + 0.5),
                   D=r(H), norm_weight=1 + r(E, s=0.1), out_proj_weight=r(Do, E), out_proj_bias=r(Do))
    states = dict(conv_state=r(B, Cd, W - 1, s=1.0), ssm_state=r(B, H, P, N, s=1.0))
    xs = [r(B, Dm, s=1.0) for _ in range(5)]
    return weights, states, xs, G


def _run(weights, states, xs, G, backend, **kw):
    st = {k: v.clone() for k, v in states.items()}
    outs = []
    for x in xs:
        args = dict(weights, **st)
        if backend == "ref":
            outs.append(ops.mamba2_mixer_step_ref(x, **args, ngroups=G, **kw))
        else:
            outs.append(ops.mamba2_mixer_step(x, **args, ngroups=G, backend=backend, **kw))
    return torch.stack(outs), st


@pytest.mark.parametrize("kw", [{}, dict(norm_group_size=16, norm_before_gate=True), dict(dt_limit=(0.05, 0.4))],
                         ids=["default", "groups-before-gate", "dt-limit"])
def test_steps_match_the_reference(backend, kw):
    weights, states, xs, G = _inputs()
    got, got_states = _run(weights, states, xs, G, backend, **kw)
    want, want_states = _run(weights, states, xs, G, "ref", **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for name in states:
        torch.testing.assert_close(got_states[name], want_states[name], atol=2e-5, rtol=1e-4)


def test_without_norm_the_gate_is_silu_z(backend):
    weights, states, xs, G = _inputs(seed=1)
    weights["norm_weight"] = None
    got, _ = _run(weights, states, xs[:2], G, backend)
    want, _ = _run(weights, states, xs[:2], G, "ref")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_gradients_through_the_torch_backend():
    weights, states, xs, G = _inputs(B=1, seed=2)
    leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
    x = xs[0].clone().requires_grad_()
    out = ops.mamba2_mixer_step(x, **leaves, **{k: v.clone() for k, v in states.items()}, ngroups=G)
    out.square().sum().backward()
    ref_leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
    xr = xs[0].clone().requires_grad_()
    ops.mamba2_mixer_step_ref(xr, **ref_leaves, **{k: v.clone() for k, v in states.items()},
                              ngroups=G).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    for name in weights:
        torch.testing.assert_close(leaves[name].grad, ref_leaves[name].grad, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("bad,match", [
    (dict(ngroups=3), "ngroups"),
    (dict(norm_group_size=5), "norm_group_size"),
    (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
    (dict(dt_limit=(0.0, math.nan)), "dt_limit"),
    (dict(norm_eps=math.nan), "norm_eps"),
    (dict(norm_eps=-1.0), "norm_eps"),
    (dict(D=torch.ones(7)), "'D'"),
    (dict(dt_bias=torch.ones(3)), "dt_bias"),
    (dict(in_proj_weight=torch.ones(10, 16)), "in_proj_weight"),
    (dict(conv_state=torch.ones(2, 56, 1)), "conv_state"),
    (dict(out_proj_weight=torch.ones(16, 31)), "out_proj_weight"),
    (dict(x=torch.ones(3, 16)), "'x'"),
    (dict(x=torch.ones(2, 16, dtype=torch.int64)), "'x'"),
    (dict(out_proj_weight=torch.ones(16, 32, dtype=torch.float64)), "out_proj_weight"),
    (dict(norm_weight=torch.ones(32, dtype=torch.bfloat16)), "norm_weight"),
    (dict(conv_state=torch.ones(1, 56, 3).expand(2, 56, 3)), "conv_state"),
])
def test_bad_input_is_refused_with_the_states_untouched(backend, bad, match):
    weights, states, xs, G = _inputs()
    args = dict(weights, **states, x=xs[0], ngroups=G)
    before = {k: bits(v) for k, v in states.items()}
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.mamba2_mixer_step(**args, backend=backend)
    for name in states:
        assert_bits_equal(before[name], states[name], name)


def test_mamba1_step_gradients_through_the_torch_backend():
    """Mamba-1's step on the torch backend is differentiable in x and every weight, as its reference is."""
    g = torch.Generator().manual_seed(3)
    B, Dm, E, N, W, R = 2, 6, 5, 3, 4, 2

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    weights = [r(B, Dm), r(2 * E, Dm), r(2 * E), r(E, W), r(E), r(R + 2 * N, E), None, r(E, R), r(E),
               torch.log(torch.rand(E, N, generator=g) + 0.5), r(E), r(Dm, E), r(Dm)]
    conv, ssm = r(B, E, W - 1), r(B, E, N)

    def grads(fn):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in weights]
        fn(*leaves, conv.clone(), ssm.clone()).square().sum().backward()
        return [t.grad if t is not None else None for t in leaves]

    got = grads(lambda *a: ops.mamba_mixer_step(*a, backend="torch"))
    want = grads(ops.mamba_mixer_step_ref)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            continue
        assert a is not None, f"argument {i} got no gradient"
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
