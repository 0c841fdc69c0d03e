"""The backend selector: automatic order, overrides, errors, and fallback when a build fails."""

import importlib
import warnings

import pytest
import torch

import fastarch
from fastarch import backend as B
from fastarch import ops  # noqa: F401  (registers the ops)


class _Probe(B.Implementation):
    """A test-only op whose implementations record which one ran."""

    op = "_probe"
    ran: list[str] = []

    def forward(self, x):
        type(self).ran.append(self.backend)
        return x


class _ProbeTorch(_Probe):
    backend = "torch"


class _ProbeCpp(_Probe):
    backend = "cpp"
    devices = ("cpu",)
    fail_load = False

    def load(self):
        if type(self).fail_load:
            raise RuntimeError("compiler exploded\nerror: no such header")
        return object()


class _ProbeTriton(_Probe):
    backend = "triton"

    def check(self, call):
        return ["head dim too large"] if call.get("head_dim", 0) > 256 else []


@pytest.fixture()
def probe():
    impls = [B.register(c) for c in (_ProbeTorch, _ProbeCpp, _ProbeTriton)]
    _Probe.ran = []
    yield impls
    B._REGISTRY.pop("_probe", None)
    B._ORDER.pop("_probe", None)
    B._reset_warnings_for_tests()


def _call(**f):
    return B.Call(torch.device("cpu"), torch.float32, f)


def test_auto_order_prefers_cpp_on_cpu(probe):
    assert B.select("_probe", _call()).backend == "cpp"
    B.set_order("_probe", "cpu", ("torch", "cpp"))
    assert B.select("_probe", _call()).backend == "torch"


def test_explicit_keyword_beats_context_beats_env(probe, monkeypatch):
    monkeypatch.setenv("FASTARCH_BACKEND", "_probe=torch")
    assert B.select("_probe", _call()).backend == "torch"
    with fastarch.use_backend("cpp"):
        assert B.select("_probe", _call()).backend == "cpp"
        assert B.select("_probe", _call(), backend="torch").backend == "torch"
    monkeypatch.setenv("FASTARCH_BACKEND", "torch")
    assert B.select("_probe", _call()).backend == "torch"


def test_env_per_op_spec_only_touches_named_ops(probe, monkeypatch):
    monkeypatch.setenv("FASTARCH_BACKEND", "attention=torch, selective_scan=cpp")
    assert B.select("_probe", _call()).backend == "cpp"  # not named: automatic
    assert B.requested_backend("attention") == "torch"
    assert B.requested_backend("selective_scan") == "cpp"


def test_use_backend_nests_and_restores(probe):
    with fastarch.use_backend(_probe="torch"):
        with fastarch.use_backend(layer_norm="cpp"):
            assert B.requested_backend("_probe") == "torch"
            assert B.requested_backend("layer_norm") == "cpp"
        assert B.requested_backend("layer_norm") == "auto"
    assert B.requested_backend("_probe") == "auto"


def test_unknown_backend_name_is_rejected(probe, monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'cuda2'"):
        with fastarch.use_backend("cuda2"):
            pass
    monkeypatch.setenv("FASTARCH_BACKEND", "_probe=fast")
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        B.select("_probe", _call())


def test_forced_unavailable_backend_lists_every_reason(probe):
    with pytest.raises(B.BackendUnavailableError) as info:
        B.select("_probe", _call(head_dim=512), backend="triton")
    msg = str(info.value)
    assert "_probe" in msg and "'triton'" in msg
    assert "head dim too large" in msg
    assert "no implementation of _probe" in msg  # cuda
    assert "torch: available" in msg


def test_triton_on_cpu_needs_interpreter(probe, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = probe[2].not_supported_reasons(_call())
    assert any("TRITON_INTERPRET" in r for r in reasons)


def test_failed_build_falls_back_with_one_warning(probe):
    _ProbeCpp.fail_load = True
    try:
        impl = B.implementations("_probe")["cpp"]
        impl._loaded = False
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            assert B.select("_probe", _call()).backend == "torch"
            assert B.select("_probe", _call()).backend == "torch"
        msgs = [str(w.message) for w in rec if "falling back" in str(w.message)]
        assert len(msgs) == 1 and "no such header" in msgs[0]
        # Forced, the same failure is an error that carries the build's reason.
        with pytest.raises(B.BackendUnavailableError, match="failed to load"):
            B.select("_probe", _call(), backend="cpp")
    finally:
        _ProbeCpp.fail_load = False


def test_cuda_tensor_order_has_no_cpp():
    assert "cpp" not in B.DEFAULT_ORDER["cuda"]
    assert "triton" not in B.DEFAULT_ORDER["cpu"]


def test_real_op_respects_override():
    x = torch.randn(3, 8)
    with fastarch.use_backend("torch"):
        assert B.select("layer_norm", B.Call(x.device, x.dtype, {"n": 8})).backend == "torch"
    assert "layer_norm: runs on" in fastarch.explain("layer_norm", x, n=8)


# -- the test suite's rule: a backend is skipped only for a reason outside the code ---------------------------
@pytest.mark.parametrize("env,ci,required", [({}, None, False), ({}, "true", True), ({"FASTARCH_REQUIRE_CPP": "1"}, None, True),
                                             ({"FASTARCH_REQUIRE_CPP": "0"}, "true", False)])
def test_cpp_required_by_env_and_ci(monkeypatch, env, ci, required):
    from tests import _backends

    monkeypatch.delenv("FASTARCH_REQUIRE_CPP", raising=False)
    monkeypatch.delenv("CI", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    assert _backends.cpp_required() is required


@pytest.mark.parametrize("toolchain,required,outcome", [(True, False, "fail"), (False, False, "skip"),
                                                        (False, True, "fail")])
def test_broken_cpp_build_fails_unless_no_toolchain(probe, monkeypatch, toolchain, required, outcome):
    from tests import _backends

    monkeypatch.setenv("FASTARCH_REQUIRE_CPP", "1" if required else "0")
    monkeypatch.setattr(_backends, "_toolchain_missing", lambda kind="cpu": None if toolchain else "no C++ compiler")
    _ProbeCpp.fail_load = True
    try:
        impl = B.implementations("_probe")["cpp"]
        impl._loaded = False
        expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
        with pytest.raises(expected, match="no such header" if outcome == "fail" else "no C\\+\\+ compiler"):
            _backends.require_backend("_probe", "cpp")
    finally:
        _ProbeCpp.fail_load = False
    assert _backends.require_backend("_probe", "torch") is B.implementations("_probe")["torch"]


# -- the backend is pinned per call --------------------------------------------------------------------
def _spy_backward(monkeypatch, op):
    """Record which implementations of ``op`` run their backward."""
    ran = []
    for name, impl in B.implementations(op).items():
        orig = impl.backward

        def spy(*args, _orig=orig, _name=name):
            ran.append(_name)
            return _orig(*args)

        monkeypatch.setattr(impl, "backward", spy)
    return ran


def _attention_case():
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    return lambda: ops.attention(q, k, v, causal=True)


def _layer_norm_case():
    x, w, b = torch.randn(4, 16, requires_grad=True), torch.randn(16), torch.randn(16)
    return lambda: ops.layer_norm(x, w, b)


def _selective_scan_case():
    u, delta = torch.randn(1, 4, 10, requires_grad=True), torch.rand(1, 4, 10)
    A, Bm, C = -torch.rand(4, 3), torch.randn(1, 3, 10), torch.randn(1, 3, 10)
    return lambda: ops.selective_scan(u, delta, A, Bm, C)


@pytest.mark.parametrize("op, case", [("attention", _attention_case), ("layer_norm", _layer_norm_case),
                                      ("selective_scan", _selective_scan_case)])
def test_forced_backend_is_kept_by_the_backward(op, case, monkeypatch):
    run = case()
    auto = B.select(op, B.Call(torch.device("cpu"), torch.float32, {})).backend
    assert auto != "torch"
    ran = _spy_backward(monkeypatch, op)
    with fastarch.use_backend("torch"):
        y = run()
    y.sum().backward()  # outside the block: must still be the torch backward
    assert ran == ["torch"]
    ran.clear()
    y = run()
    with fastarch.use_backend("torch"):
        y.sum().backward()  # a context around the backward alone changes nothing
    assert ran == [B.select(op, B.Call(torch.device("cpu"), torch.float32, {})).backend]


def test_forced_backend_is_kept_under_compile(monkeypatch):
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    ran = _spy_backward(monkeypatch, "attention")
    f = torch.compile(lambda a, b, c: ops.attention(a, b, c, causal=True), fullgraph=True, backend="aot_eager")
    with fastarch.use_backend(attention="torch"):
        y = f(q, k, v)
    y.sum().backward()
    assert ran == ["torch"]
    torch.testing.assert_close(y, ops.attention_ref(q, k, v, causal=True), atol=1e-5, rtol=1e-5)


# -- routing: aten, orders, declared capabilities --------------------------------------------------------
def _attention_call(device="cpu", **f):
    base = {"head_dim": 64, "Lq": 128, "Lk": 128, "H": 4, "Hk": 4, "window": (-1, -1), "has_mask": False,
            "has_bias": False, "dropout": False, "bias_grad": False}
    return B.Call(torch.device(device), torch.float32, {**base, **f})


def test_aten_takes_plain_attention_and_refuses_what_needs_a_dense_mask():
    aten = B.get_implementation("attention", "aten")
    assert aten.not_supported_reasons(_attention_call()) == []
    assert aten.not_supported_reasons(_attention_call(window=(-1, 0), Hk=2)) == []
    assert "sliding window" in " ".join(aten.not_supported_reasons(_attention_call(window=(16, 16))))
    assert "padding mask" in " ".join(aten.not_supported_reasons(_attention_call(has_mask=True)))
    assert "Lq != Lk" in " ".join(aten.not_supported_reasons(_attention_call(window=(-1, 0), Lq=1)))
    assert "no dropout support" in aten.not_supported_reasons(_attention_call(dropout=True))


def test_aten_first_still_sends_what_it_refuses_to_the_next(monkeypatch):
    monkeypatch.setitem(B._ORDER, "attention", {"cpu": ("aten", "cpp", "torch")})
    assert B.select("attention", _attention_call()).backend == "aten"
    assert B.select("attention", _attention_call(window=(16, 16))).backend == "cpp"
    assert B.select("attention", _attention_call(dropout=True)).backend == "cpp"
    assert "runs on 'aten'" in B.explain("attention", _attention_call())


def test_cuda_attention_reaches_aten_before_the_composition():
    order = B.auto_order("attention", "cuda")
    assert order.index("aten") < order.index("torch")
    assert B.get_implementation("attention", "aten").declared_reasons(_attention_call("cuda")) == []


def test_declared_capabilities_give_the_reasons():
    triton = B.get_implementation("attention", "triton")
    assert "head dim 300 > 256" in triton.declared_reasons(_attention_call(head_dim=300))
    assert triton.capabilities()["max_head_dim"] == 256
    scan = B.get_implementation("selective_scan", "triton")
    assert not scan.deterministic
    torch.use_deterministic_algorithms(True)
    try:
        assert any("deterministic" in r for r in scan.declared_reasons(B.Call(torch.device("cpu"), torch.float32)))
    finally:
        torch.use_deterministic_algorithms(False)
    call = B.Call(torch.device("cpu"), torch.float32, {"varlen": True})
    assert "no varlen support" in B.get_implementation("layer_norm", "cpp").declared_reasons(call)


def test_layer_norm_variant_has_no_aten_kernel():
    aten = B.get_implementation("layer_norm", "aten")
    call = B.Call(torch.device("cpu"), torch.float32, {"n": 64, "mode": 3})
    assert aten.not_supported_reasons(call)
    assert B.select("layer_norm", call).backend == "cpp"


def test_every_implementation_declares_how_it_loads():
    from fastarch import extensions

    sources = {name for name, kind in extensions.all_extensions() if kind == "cpu"}
    for op in B.ops():
        for impl in B.implementations(op).values():
            if impl.backend == "cpp":
                assert impl.extension in sources, (op, impl.extension)
            if impl.backend == "triton":
                assert impl.kernel_module and impl.ensure_loaded() is None, (op, impl.ensure_loaded())


def test_measured_orders_are_installed():
    from fastarch.ops import _orders

    for op, per_device in _orders.MEASURED_ORDER.items():
        for device_type, order in per_device.items():
            assert B.auto_order(op, device_type) == order


# -- cached decisions and the lean eager path -------------------------------------------------------------
def test_decision_is_cached_and_reused(probe):
    B.clear_decisions()
    before = B.decision_stats()
    with B.log_decisions() as log:
        for _ in range(3):
            assert B.select("_probe", _call(head_dim=64)).backend == "cpp"
    after = B.decision_stats()
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 2
    assert [hit for *_, hit in log] == [False, True, True]


def test_cached_decision_never_outlives_its_override(probe, monkeypatch):
    assert B.select("_probe", _call()).backend == "cpp"
    with fastarch.use_backend("torch"):
        assert B.select("_probe", _call()).backend == "torch"
    assert B.select("_probe", _call()).backend == "cpp"
    monkeypatch.setenv("FASTARCH_BACKEND", "_probe=triton")
    assert B.select("_probe", _call()).backend == "triton"
    monkeypatch.setenv("FASTARCH_BACKEND", "torch")
    assert B.select("_probe", _call()).backend == "torch"
    monkeypatch.delenv("FASTARCH_BACKEND")
    assert B.select("_probe", _call()).backend == "cpp"
    B.set_order("_probe", "cpu", ("triton", "cpp", "torch"))
    assert B.select("_probe", _call()).backend == "triton"
    # a call the first choice refuses is decided on its own features
    assert B.select("_probe", _call(head_dim=512)).backend == "cpp"


def test_deterministic_mode_is_part_of_the_decision(probe):
    _ProbeCpp.deterministic = False
    try:
        assert B.select("_probe", _call()).backend == "cpp"
        torch.use_deterministic_algorithms(True)
        try:
            assert B.select("_probe", _call()).backend == "torch"
        finally:
            torch.use_deterministic_algorithms(False)
        assert B.select("_probe", _call()).backend == "cpp"
    finally:
        _ProbeCpp.deterministic = True


def test_explain_takes_the_ops_own_arguments():
    x, w = torch.randn(2, 64), torch.randn(64)
    ops.rms_norm(x, w)
    text = fastarch.explain(ops.rms_norm, x, w)
    assert text.startswith("rms_norm: runs on 'cpp'") and "cached decision" in text
    assert "automatic order on cpu" in text and "torch: available" in text
    forced = fastarch.explain(ops.rms_norm, x, w, backend="torch")
    assert forced.startswith("rms_norm: runs on 'torch' (requested: torch")


@pytest.mark.parametrize("grad", [False, True])
def test_lean_path_only_without_autograd(grad, monkeypatch):
    """Without autograd the op runs its implementation directly; with it the custom op records the
    backward; both give the same values, and a forced backend holds for the forward and the backward."""
    calls = []
    module = importlib.import_module("fastarch.ops.rms_norm")

    original = module._rms_norm_fwd
    monkeypatch.setattr(module, "_rms_norm_fwd", lambda *a: calls.append(a[-1]) or original(*a))
    x = torch.randn(3, 32, requires_grad=grad)
    w = torch.randn(32)
    with B.log_decisions() as log:
        y = ops.rms_norm(x, w, backend="torch")
        if grad:
            y.sum().backward()
    assert calls == (["torch"] if grad else [])
    assert {backend for _, _, _, backend, _ in log} == {"torch"}
    torch.testing.assert_close(y, ops.rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)
    if grad:
        xr = x.detach().clone().requires_grad_()
        ops.rms_norm_ref(xr, w).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
