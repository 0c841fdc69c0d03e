"""gated_delta_rule (Gated DeltaNet): every backend against the fp32 recurrence on fla's grid, outputs and every
gradient; the chunked and recurrent forms agree; packed sequences; low precision; the memory bound; bad inputs."""

from __future__ import annotations

import pytest
import torch

from fastarch.ops import gated_delta_rule, gated_delta_rule_ref
from tests._tolerance import assert_fa_close
from tests.ops._delta_rule_grid import LargestTensor, assert_matches, case_id, grid, make, run

pytestmark = pytest.mark.op("gated_delta_rule")
GRID = grid()


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", GRID, ids=[case_id(c) for c in GRID])
def test_matches_the_recurrence(backend, case, mode):
    x = make(case, per_key=False)
    got = run(gated_delta_rule, x, use_qk_l2norm_in_kernel=case["l2"], mode=mode, backend=backend)
    want = run(gated_delta_rule_ref, x, use_qk_l2norm_in_kernel=case["l2"])
    assert_matches(got, want)


@pytest.mark.parametrize("case", GRID[:6], ids=[case_id(c) for c in GRID[:6]])
def test_chunked_and_recurrent_forms_agree(backend, case):
    x = make(case, per_key=False, seed=3)
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=case["l2"],
              backend=backend)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o1, s1 = gated_delta_rule(*args, mode="chunk", **kw)
    o2, s2 = gated_delta_rule(*args, mode="recurrent", **kw)
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_sequences_match_separate_calls(backend, mode):
    """cu_seqlens with sequences of length 1 and 0, and one crossing a chunk boundary: each sequence as its
    own call, its own initial state, its own final state; gradients included."""
    lens = [1, 70, 0, 1, 65, 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    case = dict(B=1, T=sum(lens), K=16, V=8, gate="mid", Hk=1, Hv=2, l2=True, init=True)
    x = make(case, per_key=False, cu_seqlens=cu)
    got = run(gated_delta_rule, x, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, mode=mode, backend=backend)
    want = run(gated_delta_rule_ref, x, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert_matches(got, want)
    o, S, _ = got
    s = 0
    for n, length in enumerate(lens):  # the oracle per sequence, as separate calls
        sl = slice(s, s + length)
        on, Sn = gated_delta_rule_ref(*(x[k][:, sl] for k in ("q", "k", "v", "g", "beta")),
                                      initial_state=x["initial_state"][n:n + 1], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, sl].detach(), on, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(S[n:n + 1].detach(), Sn, rtol=1e-4, atol=1e-4)
        s += length


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])  # raw: the kernels read bf16/fp16 q, k, v
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype, l2):
    """bf16/fp16 q, k, v, beta (fp32 gate and state, as the models pass them): the output in the inputs' dtype,
    the state fp32, within FlashAttention's criterion of rounding the exact result to that dtype."""
    case = dict(B=2, T=100, K=32, V=32, gate="mid", Hk=2, Hv=4, l2=l2, init=True)
    x = make(case, per_key=False, dtype=dtype)
    o, S = gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
                            output_final_state=True, use_qk_l2norm_in_kernel=l2, backend=backend)
    assert o.dtype == dtype and S.dtype == torch.float32
    ro, rS = gated_delta_rule_ref(*(x[k].float() for k in ("q", "k", "v", "g", "beta")),
                                  initial_state=x["initial_state"], output_final_state=True,
                                  use_qk_l2norm_in_kernel=l2)
    assert_fa_close(o, ro, ro.to(dtype), factor=2.0, atol=1e-3, what="o")
    torch.testing.assert_close(S, rS, rtol=1e-3, atol=1e-3)


def test_memory_never_holds_a_per_step_state(backend):
    """No tensor of the forward or the backward is as large as a state per step (B * T * Hv * K * V)."""
    B, T, H, K, V = 1, 256, 2, 32, 32
    case = dict(B=B, T=T, K=K, V=V, gate="mid", Hk=H, Hv=H, l2=True, init=True)
    x = make(case, per_key=False)
    with LargestTensor() as seen:
        run(gated_delta_rule, x, use_qk_l2norm_in_kernel=True, backend=backend)
    assert seen.largest < B * T * H * K * V, f"{seen.op} made a tensor of {seen.largest} elements"


def test_the_state_is_never_written(backend):
    case = dict(B=1, T=5, K=8, V=8, gate="mid", Hk=1, Hv=1, l2=True, init=True)
    x = make(case, per_key=False)
    before = x["initial_state"].clone()
    gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"],
                     output_final_state=True, backend=backend)
    assert torch.equal(x["initial_state"], before)


def test_final_state_none_unless_asked():
    case = dict(B=1, T=3, K=8, V=8, gate="mid", Hk=1, Hv=1, l2=True, init=False)
    x = make(case, per_key=False)
    o, S = gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")))
    assert S is None and o.shape == (1, 3, 1, 8)


def test_default_scale_is_inverse_sqrt_k():
    case = dict(B=1, T=7, K=16, V=4, gate="mid", Hk=1, Hv=1, l2=False, init=False)
    x = make(case, per_key=False)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    torch.testing.assert_close(gated_delta_rule(*args)[0], gated_delta_rule(*args, scale=0.25)[0])
    assert not torch.allclose(gated_delta_rule(*args)[0], gated_delta_rule(*args, scale=0.5)[0])


# -- bad inputs: a clear error naming the argument, the passed state untouched ---------------------------------
def _bad_cases() -> list[tuple[str, dict, type, str]]:
    return [
        ("positive gate", dict(g=lambda x: x["g"].abs() + 0.1), ValueError, "'g'"),
        ("heads", dict(v=lambda x: x["v"][:, :, :3]), ValueError, "'v'"),  # 3 value heads, 2 q/k heads
        ("cu_seqlens not monotone", dict(cu_seqlens=lambda x: torch.tensor([0, 4, 2, 6], dtype=torch.int32)),
         ValueError, "'cu_seqlens'"),
        ("cu_seqlens float", dict(cu_seqlens=lambda x: torch.tensor([0.0, 6.0])), TypeError, "'cu_seqlens'"),
        ("cu_seqlens list", dict(cu_seqlens=lambda x: [0, 6]), TypeError, "'cu_seqlens'"),
        ("cu_seqlens wrong end", dict(cu_seqlens=lambda x: torch.tensor([0, 5], dtype=torch.int64)), ValueError,
         "'cu_seqlens'"),
        ("state shape", dict(initial_state=lambda x: torch.zeros(1, 4, 8, 7)), ValueError, "'initial_state'"),
        ("state dtype", dict(initial_state=lambda x: torch.zeros(1, 4, 8, 8, dtype=torch.int32)), TypeError,
         "'initial_state'"),
        ("beta shape", dict(beta=lambda x: x["beta"][..., :1]), ValueError, "'beta'"),
        ("scale", dict(scale=lambda x: -1.0), ValueError, "'scale'"),
    ]


@pytest.mark.parametrize("name,change,exc,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_inputs_raise_naming_the_argument(name, change, exc, arg):
    case = dict(B=1, T=6, K=8, V=8, gate="mid", Hk=2, Hv=4, l2=True, init=True)
    x = make(case, per_key=False)
    state = x["initial_state"]
    before = state.clone()
    kw = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=state, output_final_state=True)
    for key, fn in change.items():
        kw[key] = fn(x)
    with pytest.raises(exc, match=arg):
        gated_delta_rule(**kw)
    assert torch.equal(state, before)


def test_cu_seqlens_needs_batch_one():
    case = dict(B=2, T=6, K=8, V=8, gate="mid", Hk=1, Hv=1, l2=True, init=False)
    x = make(case, per_key=False)
    with pytest.raises(ValueError, match="'cu_seqlens'.*batch 1"):
        gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")),
                         cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


def test_kda_shaped_gate_is_refused():
    case = dict(B=1, T=6, K=8, V=8, gate="mid", Hk=1, Hv=1, l2=True, init=False)
    x = make(case, per_key=True)
    with pytest.raises(ValueError, match="'g'"):
        gated_delta_rule(*(x[k] for k in ("q", "k", "v", "g", "beta")))


def test_gradients_without_the_final_state(backend):
    """output_final_state=False: the backward gets no final-state gradient (None), only the output's."""
    case = dict(B=2, T=70, K=16, V=8, gate="mid", Hk=1, Hv=2, l2=True, init=True)
    x = make(case, per_key=False)
    grads = []
    for fn, kw in ((gated_delta_rule, dict(backend=backend)), (gated_delta_rule_ref, {})):
        leaves = {k: t.clone().requires_grad_() for k, t in x.items()}
        o, S = fn(*(leaves[k] for k in ("q", "k", "v", "g", "beta")), initial_state=leaves["initial_state"], **kw)
        assert S is None
        (o * torch.linspace(-1, 1, o.shape[-1])).sum().backward()
        grads.append({k: t.grad for k, t in leaves.items()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("per_key", [False, True], ids=["gdn", "kda"])
def test_cpp_results_do_not_depend_on_the_thread_count(per_key):
    """Each (sequence, head) is one task's alone: the same bits at any thread count, forward and backward."""
    from tests._backends import require_backend

    op = "kda" if per_key else "gated_delta_rule"
    require_backend(op, "cpp")
    from fastarch.ops import kda

    fn = kda if per_key else gated_delta_rule
    case = dict(B=2, T=150, K=16, V=16, gate="mid", Hk=2, Hv=4, l2=True, init=True)
    x = make(case, per_key=per_key)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for mode in ("chunk", "recurrent"):
                o, S, grads = run(fn, x, mode=mode, backend="cpp")
                results.append((mode, o, S, grads))
        for mode, o, S, grads in results[2:]:
            ref = results[0] if mode == "chunk" else results[1]
            assert torch.equal(o, ref[1]) and torch.equal(S, ref[2])
            assert all(torch.equal(grads[k], ref[3][k]) for k in grads)
    finally:
        torch.set_num_threads(before)
