"""kda (Kimi Delta Attention): every backend against the fp32 recurrence on fla's grid with a decay per key
channel, outputs and every gradient; the in-kernel gate (A_log, dt_bias, lower_bound); chunked vs recurrent;
packed sequences; low precision; the memory bound; bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastarch.ops import gated_delta_rule, kda, kda_gate, kda_ref
from tests._tolerance import assert_fa_close
from tests.ops._delta_rule_grid import LargestTensor, assert_matches, case_id, grid, make, run

pytestmark = pytest.mark.op("kda")
GRID = grid()
ARGS = ("q", "k", "v", "g", "beta")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_matches_the_recurrence(backend, case, mode):
    x = make(case, per_key=True)
    got = run(kda, x, use_qk_l2norm_in_kernel=case["l2"], mode=mode, backend=backend)
    want = run(kda_ref, x, use_qk_l2norm_in_kernel=case["l2"])
    assert_matches(got, want)


def test_gates_that_differ_wildly_across_channels(backend):
    """Channels decaying at very different rates in one head (0 and -20 per step): every exponent the chunked
    form takes stays finite, and it matches the recurrence."""
    case = dict(B=1, T=130, K=16, V=8, gate="mid", Hk=1, Hv=1, l2=True, init=True)
    x = make(case, per_key=True)
    x["g"] = torch.where(torch.arange(16) % 2 == 0, 0.0, -20.0).expand_as(x["g"]).clone()
    got = run(kda, x, use_qk_l2norm_in_kernel=True, backend=backend)
    want = run(kda_ref, x, use_qk_l2norm_in_kernel=True)
    assert all(torch.isfinite(t).all() for t in (got[0], got[1]))
    assert_matches(got, want)


def test_equals_gated_delta_rule_for_a_gate_shared_by_channels(backend):
    case = dict(B=2, T=70, K=16, V=8, gate="mid", Hk=1, Hv=2, l2=True, init=True)
    x = make(case, per_key=False)
    args = [x[k] for k in ARGS]
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
              backend=backend)
    o1, s1 = gated_delta_rule(*args, **kw)
    o2, s2 = kda(*args[:3], x["g"][..., None].expand(2, 70, 2, 16), args[4], **kw)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_in_kernel(backend, lower_bound):
    """use_gate_in_kernel: the decay from the raw gate, A_log and dt_bias; gradients reach all three."""
    case = dict(B=1, T=67, K=16, V=8, gate="mid", Hk=1, Hv=2, l2=True, init=True)
    x = make(case, per_key=True)
    x["g"] = torch.randn(x["g"].shape)
    A_log, dt_bias = torch.randn(2), torch.randn(2 * 16) * 0.5
    leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
    params = [A_log.clone().requires_grad_(), dt_bias.clone().requires_grad_()]
    ref_leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
    ref_params = [A_log.clone().requires_grad_(), dt_bias.clone().requires_grad_()]
    for fn, lv, pr, extra in ((kda, leaves, params, dict(backend=backend)), (kda_ref, ref_leaves, ref_params, {})):
        o, S = fn(*(lv[k] for k in ARGS), initial_state=lv["initial_state"], output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=pr[0], dt_bias=pr[1],
                  lower_bound=lower_bound, **extra)
        (o.sum() + S.square().sum()).backward()
        lv["o"], lv["S"] = o.detach(), S.detach()
    torch.testing.assert_close(leaves["o"], ref_leaves["o"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(leaves["S"], ref_leaves["S"], rtol=1e-4, atol=1e-4)
    for name in (*ARGS, "initial_state"):
        torch.testing.assert_close(leaves[name].grad, ref_leaves[name].grad, rtol=1e-3, atol=1e-3)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-3)
    g = kda_gate(x["g"], A_log, dt_bias, lower_bound)
    assert (g <= 0).all()
    want = (lower_bound * torch.sigmoid(A_log.exp()[:, None] * (x["g"] + dt_bias.view(2, 16)))
            if lower_bound is not None else -A_log.exp()[:, None] * F.softplus(x["g"] + dt_bias.view(2, 16)))
    torch.testing.assert_close(g, want)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_sequences(backend, mode):
    lens = [1, 66, 1, 0, 40]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    case = dict(B=1, T=sum(lens), K=16, V=8, gate="strong", Hk=2, Hv=4, l2=False, init=True)
    x = make(case, per_key=True, cu_seqlens=cu)
    got = run(kda, x, cu_seqlens=cu, mode=mode, backend=backend)
    want = run(kda_ref, x, cu_seqlens=cu)
    assert_matches(got, want)


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])  # raw: the kernels read bf16/fp16 q, k, v
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype, l2):
    case = dict(B=1, T=90, K=32, V=16, gate="mid", Hk=1, Hv=2, l2=l2, init=True)
    x = make(case, per_key=True, dtype=dtype)
    o, S = kda(*(x[k] for k in ARGS), initial_state=x["initial_state"], output_final_state=True,
               use_qk_l2norm_in_kernel=l2, backend=backend)
    assert o.dtype == dtype and S.dtype == torch.float32
    ro, rS = kda_ref(*(x[k].float() for k in ARGS), initial_state=x["initial_state"], output_final_state=True,
                     use_qk_l2norm_in_kernel=l2)
    assert_fa_close(o, ro, ro.to(dtype), factor=2.0, atol=1e-3, what="o")
    torch.testing.assert_close(S, rS, rtol=1e-3, atol=1e-3)


def test_memory_never_holds_a_per_step_state(backend):
    B, T, H, K, V = 1, 256, 2, 32, 32
    case = dict(B=B, T=T, K=K, V=V, gate="mid", Hk=H, Hv=H, l2=True, init=True)
    x = make(case, per_key=True)
    with LargestTensor() as seen:
        run(kda, x, use_qk_l2norm_in_kernel=True, backend=backend)
    assert seen.largest < B * T * H * K * V, f"{seen.op} made a tensor of {seen.largest} elements"


def test_bad_inputs():
    case = dict(B=1, T=6, K=8, V=8, gate="mid", Hk=1, Hv=2, l2=True, init=True)
    x = make(case, per_key=True)
    args = [x[k] for k in ARGS]
    state = x["initial_state"]
    before = state.clone()
    with pytest.raises(ValueError, match="'g'"):  # a positive log decay
        kda(*args[:3], x["g"].abs() + 1e-3, args[4], initial_state=state)
    with pytest.raises(ValueError, match="'g'"):  # GDN's gate shape
        kda(*args[:3], x["g"][..., 0], args[4], initial_state=state)
    with pytest.raises(ValueError, match="'A_log'"):
        kda(*args, initial_state=state, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="'dt_bias'"):
        kda(*args, initial_state=state, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(5))
    with pytest.raises(ValueError, match="'lower_bound'"):
        kda(*args, initial_state=state, use_gate_in_kernel=True, A_log=torch.zeros(2), lower_bound=1.0)
    with pytest.raises(ValueError, match="'initial_state'"):
        kda(*args, initial_state=torch.zeros(2, 2, 8, 8))
    with pytest.raises(ValueError, match="'mode'"):
        kda(*args, mode="fused")
    assert torch.equal(state, before)
    # the raw gate of use_gate_in_kernel may be positive
    kda(*args[:3], x["g"].abs(), args[4], use_gate_in_kernel=True, A_log=torch.zeros(2))
