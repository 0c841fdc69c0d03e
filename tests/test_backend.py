"""The backend selector: automatic order, overrides, errors, and fallback when a build fails."""

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
