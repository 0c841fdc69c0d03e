"""Test configuration.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so that Triton kernels run on CPU
tensors (the interpreter does not handle bf16: test fp32/fp16 there).

Backends come from the registry (see ``tests/_backends.py``). A test that takes a ``backend`` argument and
carries ``@pytest.mark.op("name")`` (or a module-level ``pytestmark``) runs once per registered
implementation of that op on CPU tensors, less the backends named in ``exclude=``; one that also takes
``device`` runs once per (implementation, device present).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests._backends import backend_cases, case_id, devices_present, require_backend  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "op(name, exclude=()): parametrise the test's `backend` over the op's registered backends")


def _explicitly_parametrised(metafunc, name: str) -> bool:
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames or _explicitly_parametrised(metafunc, "backend"):
        return
    marker = metafunc.definition.get_closest_marker("op")
    if marker is None:
        return
    devices = devices_present() if "device" in metafunc.fixturenames else ("cpu",)
    exclude = set(marker.kwargs.get("exclude", ()))
    cases = [c for c in backend_cases(marker.args[0], devices) if c[1] not in exclude]
    metafunc.parametrize("backend", cases, ids=[case_id(c) for c in cases], indirect=True)


@pytest.fixture
def backend(request) -> str:
    """The backend name of a registry-parametrised test, after checking it can run here."""
    param = getattr(request, "param", None)
    if param is None:
        raise pytest.UsageError(f"{request.node.nodeid} takes 'backend' but has no @pytest.mark.op(...) marker")
    op, name, dev = param
    require_backend(op, name, dev)
    return name


@pytest.fixture
def device(request) -> torch.device:
    """The device of a registry-parametrised test (CPU unless its case names CUDA)."""
    callspec = getattr(request.node, "callspec", None)
    case = callspec.params.get("backend") if callspec is not None else None
    return torch.device(case[2] if isinstance(case, tuple) else "cpu")


@pytest.fixture(autouse=True)
def _listed_backend_available(request):
    """A test of an op that lists its own backends still skips or fails by the same rule as the fixture."""
    marker = request.node.get_closest_marker("op")
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("backend") if callspec is not None and marker is not None else None
    if isinstance(name, str):
        require_backend(marker.args[0], name)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """``FASTARCH_FAILURE_LOG=PATH`` appends each failure's report as it happens, so that a run cut short
    (a time limit on a borrowed machine) still leaves the reasons behind."""
    path = os.environ.get("FASTARCH_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
