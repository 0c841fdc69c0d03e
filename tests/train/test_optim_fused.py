"""The fused C++ Adam/AdamW step (csrc/cpu/adam.cpp) against the foreach path: trajectories, layouts, dtypes,
state round trips across paths, and errors."""

import copy

import pytest
import torch

import fastarch.optim as O
from tests._backends import require_extension


@pytest.fixture(scope="module")
def adam_ext():
    return require_extension("adam", "cpu")


# Odd sizes, a 0-dim and a 1-element tensor, an empty one, and one of 20011 elements (several vector blocks).
SHAPES = [(7, 13), (), (1,), (0,), (5,), (33, 65), (3, 1, 4), (20011,)]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES]


def _run(make, params, steps=8, seed=1, skip=(2, 5)):
    """``steps`` optimizer steps with seeded gradients; params at index in ``skip`` get no gradient on odd steps
    (their step counters fall behind the others')."""
    opt = make(params)
    g = torch.Generator().manual_seed(seed)
    for t in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.grad = None if (i in skip and t % 2) else grad
        opt.step()
    return opt


def _groups(params, lr, wd):
    # Two groups with their own lr and weight decay.
    return [{"params": params[:4], "lr": lr, "weight_decay": wd},
            {"params": params[4:], "lr": lr * 3, "weight_decay": wd * 0.5}]


@pytest.mark.parametrize("cls", [O.Adam, O.AdamW])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fused_trajectory_equals_foreach(adam_ext, cls, wd):
    pf, pr = _params(), _params()
    of = _run(lambda ps: cls(_groups(ps, 0.01, wd), betas=(0.8, 0.99), fused=True), pf)
    orf = _run(lambda ps: cls(_groups(ps, 0.01, wd), betas=(0.8, 0.99), foreach=True), pr)
    for a, b in zip(pf, pr):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        sa, sb = of.state[a], orf.state[b]
        assert sa.keys() == sb.keys() == {"step", "m", "v"}
        assert torch.equal(sa["step"], sb["step"])
        torch.testing.assert_close(sa["m"], sb["m"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sa["v"], sb["v"], atol=1e-7, rtol=1e-5)
    assert of.state[pf[2]]["step"].item() == 4 and of.state[pf[0]]["step"].item() == 8


def test_fused_matches_torch_adamw(adam_ext):
    pf = _params()
    pt = _params()
    _run(lambda ps: O.AdamW(ps, lr=0.02, weight_decay=0.05, fused=True), pf, skip=())
    _run(lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.05), pt, skip=())
    for a, b in zip(pf, pt):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_threads_split_inside_a_tensor(adam_ext):
    # Above 1M elements the kernel splits the concatenation of all tensors evenly over threads; with two
    # threads the cut at 700K falls inside the second tensor.
    shapes = [(500_001,), (300_007,), (599_992,)]
    g = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=g) for s in shapes]
    pf = [torch.nn.Parameter(x.clone()) for x in init]
    pr = [torch.nn.Parameter(x.clone()) for x in init]
    of, orf = O.AdamW(pf, lr=0.01, fused=True), O.AdamW(pr, lr=0.01, foreach=True)
    prev = torch.get_num_threads()
    torch.set_num_threads(max(prev, 2))
    try:
        for _ in range(2):
            for a, b in zip(pf, pr):
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = a.grad.clone()
            of.step()
            orf.step()
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(pf, pr):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(of.state[a]["v"], orf.state[b]["v"], atol=0, rtol=0)


def test_first_step_moments_are_bit_identical(adam_ext):
    # m and v follow torch's lerp/addcmul rounding exactly; only sqrt (1 ulp in torch's CPU kernel) differs.
    pf, pr = _params(), _params()
    of = _run(lambda ps: O.Adam(ps, weight_decay=0.1, fused=True), pf, steps=1, skip=())
    orf = _run(lambda ps: O.Adam(ps, weight_decay=0.1, foreach=True), pr, steps=1, skip=())
    for a, b in zip(pf, pr):
        assert torch.equal(of.state[a]["m"], orf.state[b]["m"])
        assert torch.equal(of.state[a]["v"], orf.state[b]["v"])


def test_float64_and_strided_params(adam_ext):
    def make():
        base = _params(torch.float64)
        # A transposed (non-contiguous but dense) param whose grads come contiguous: the kernel's staged path.
        gen = torch.Generator().manual_seed(3)
        t = torch.nn.Parameter(torch.randn(9, 6, dtype=torch.float64, generator=gen).t())
        return base + [t]

    pf, pr = make(), make()
    _run(lambda ps: O.AdamW(ps, lr=0.01, fused=True), pf)
    _run(lambda ps: O.AdamW(ps, lr=0.01, foreach=True), pr)
    assert pf[-1].stride() == (1, 6)
    for a, b in zip(pf, pr):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_computed_in_fp32(adam_ext, dtype):
    # One step from zero state: fp32 arithmetic on the upcast values, rounded once, equals the fp32 result
    # rounded to the param dtype (to one ulp where torch's sqrt and ours differ).
    p = _params(dtype)
    p32 = [torch.nn.Parameter(x.detach().float()) for x in p]
    _run(lambda ps: O.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True), p, steps=1, skip=())
    _run(lambda ps: O.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=True), p32, steps=1, skip=())
    for a, b in zip(p, p32):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.detach().to(dtype).float(), atol=0, rtol=1e-2)


def test_low_precision_params_with_fp32_state(adam_ext):
    # bf16 params with fp32 m/v (mixed precision): the kernel keeps the moments in fp32.
    p = torch.nn.Parameter(torch.randn(300).bfloat16())
    g = torch.randn(300).bfloat16()
    m, v, step = torch.zeros(300), torch.zeros(300), torch.zeros(())
    ref = p.detach().float().clone()
    for _ in range(3):
        adam_ext.adam_step([p.detach()], [g], [m], [v], [step], 0.01, 0.9, 0.999, 1e-8, 0.0, True)
    r = torch.nn.Parameter(ref)
    opt = O.AdamW([r], lr=0.01, weight_decay=0.0, foreach=True)
    for _ in range(3):
        r.grad = g.float()
        opt.step()
    torch.testing.assert_close(m, opt.state[r]["m"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v, opt.state[r]["v"], atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(p.float(), r.detach(), atol=2e-2, rtol=1e-2)
    assert step.item() == 3


@pytest.mark.parametrize("first,second", [("fused", "foreach"), ("foreach", "fused")])
def test_state_dict_round_trip_across_paths(adam_ext, first, second):
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}}
    full, p1 = _params(), _params()
    _run(lambda ps: O.AdamW(ps, lr=0.01, foreach=True), full, steps=6, skip=())

    o1 = _run(lambda ps: O.AdamW(ps, lr=0.01, **kw[first]), p1, steps=3, skip=())
    sd = copy.deepcopy(o1.state_dict())
    p2 = [torch.nn.Parameter(x.detach().clone()) for x in p1]
    o2 = O.AdamW(p2, lr=0.01, **kw[second])
    o2.load_state_dict(sd)
    # The receiving optimizer keeps its own execution path; the hyperparameters and state come from sd.
    assert o2.param_groups[0]["fused"] is kw[second].get("fused")
    assert o2.param_groups[0]["foreach"] is kw[second].get("foreach")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # replay the first 3 steps' gradients to keep the generator aligned
        for p in p2:
            torch.randn(p.shape, generator=g, dtype=torch.float64)
    for _ in range(3):
        for p in p2:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).float()
        o2.step()
    for a, b in zip(p2, full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_default_picks_fused_on_plain_cpu_tensors(adam_ext, monkeypatch):
    ps = _params()
    opt = O.AdamW(ps)
    group = opt.param_groups[0]
    assert opt._use_fused(group, ps) is O.AUTO_FUSED
    explicit = O.AdamW(ps, foreach=True)
    assert not explicit._use_fused(explicit.param_groups[0], ps)  # an explicit foreach request wins

    class Sub(torch.Tensor):
        pass

    sub = torch.Tensor._make_subclass(Sub, torch.zeros(3), True)
    assert not opt._use_fused(group, [sub])  # tensor subclasses (DTensor, ...) go the foreach way
    monkeypatch.setattr(O, "AUTO_FUSED", False)
    assert not opt._use_fused(group, ps)


def test_errors(adam_ext, monkeypatch):
    ps = _params()
    with pytest.raises(ValueError, match="fused=True and foreach=True"):
        O.AdamW(ps, fused=True, foreach=True)
    with pytest.raises(TypeError, match="'fused' must be a bool"):
        O.Adam(ps, fused="yes")
    with pytest.raises(TypeError, match="dtype torch.complex64"):
        O.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], fused=True)
    with pytest.raises(RuntimeError, match="CPU tensors only.*meta"):
        O.Adam([torch.nn.Parameter(torch.zeros(3, device="meta"))], fused=True)
    opt = O.Adam(ps[:1], fused=True)
    with pytest.raises(TypeError, match="dtype torch.int32"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.int32)]})

    # The kernel validates everything before it writes: a bad tensor leaves steps, params and state alone.
    p, g = torch.ones(4), torch.ones(4)
    m, v, s = torch.zeros(4), torch.zeros(4), torch.zeros(())
    p2, g2, m2, v2, s2 = torch.ones(5), torch.ones(6), torch.zeros(5), torch.zeros(5), torch.zeros(())
    with pytest.raises(RuntimeError, match=r"grads\[1\] has shape \[6\]"):
        adam_ext.adam_step([p, p2], [g, g2], [m, m2], [v, v2], [s, s2], 0.1, 0.9, 0.999, 1e-8, 0.0, True)
    assert s.item() == 0 and torch.equal(p, torch.ones(4)) and torch.equal(m, torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"params\[0\] has dtype Float with state dtype Double"):
        adam_ext.adam_step([p], [g], [m.double()], [v.double()], [s], 0.1, 0.9, 0.999, 1e-8, 0.0, True)
    with pytest.raises(RuntimeError, match=r"steps\[0\] must be a float32 tensor"):
        adam_ext.adam_step([p], [g], [m], [v], [torch.zeros(2)], 0.1, 0.9, 0.999, 1e-8, 0.0, True)
    with pytest.raises(RuntimeError, match="same length"):
        adam_ext.adam_step([p], [g, g], [m], [v], [s], 0.1, 0.9, 0.999, 1e-8, 0.0, True)


def test_unavailable_extension(monkeypatch):
    monkeypatch.setattr(O, "_fused_ext", None)
    monkeypatch.setattr(O, "_fused_error", "simulated build failure")
    ps = _params()
    with pytest.raises(RuntimeError, match="unavailable: simulated build failure"):
        O.AdamW(ps, fused=True)
    # Automatic mode falls back to foreach (warning once) and still steps.
    monkeypatch.setattr(O, "AUTO_FUSED", True)
    monkeypatch.setattr(O, "fused_available", lambda: False)
    monkeypatch.setattr(O, "_fused_error", None)
    before = [p.detach().clone() for p in ps]
    with pytest.warns(UserWarning, match="unavailable, using foreach"):
        _run(lambda q: O.AdamW(q, lr=0.1), ps, steps=1, skip=())
    assert not torch.equal(ps[0], before[0])
