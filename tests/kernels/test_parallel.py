"""The C++ kernels' task pool (csrc/cpu/include/fastarch_parallel.h): results do not depend on the thread
count or on how tasks fall to threads, and calls from several Python threads at once (one runs on the pool,
the others serially on their own thread) are correct."""

from __future__ import annotations

import threading

import pytest
import torch

from fastarch import ops
from tests._backends import require_backend


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _calls():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, 256, generator=g), torch.randn(256, generator=g)
    q, k, v = (torch.randn(2, 4, 300, 32, generator=g) for _ in range(3))
    return {
        "rms_norm": lambda: ops.rms_norm(x, w, backend="cpp"),
        "layer_norm": lambda: ops.layer_norm(x, w, w, backend="cpp"),
        "attention causal": lambda: ops.attention(q, k, v, causal=True, backend="cpp"),
        "attention window": lambda: ops.attention(q, k, v, window=(17, 5), backend="cpp"),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_results_do_not_depend_on_the_thread_count(name, threads):
    require_backend(name.split()[0], "cpp")
    call = _calls()[name]
    torch.set_num_threads(1)
    want = call()
    for n in (2, 3, 8):  # more threads than cores: tasks are claimed by whoever runs
        torch.set_num_threads(n)
        for _ in range(3):
            assert torch.equal(call(), want), (name, n)


def test_calls_from_several_threads_at_once(threads):
    require_backend("rms_norm", "cpp")
    torch.set_num_threads(2)
    calls = _calls()
    want = {name: call() for name, call in calls.items()}
    errors: list[str] = []

    def worker(name: str) -> None:
        for _ in range(20):
            if not torch.equal(calls[name](), want[name]):
                errors.append(name)

    pool = [threading.Thread(target=worker, args=(name,)) for name in calls for _ in range(2)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
