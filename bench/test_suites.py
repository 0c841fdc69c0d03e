"""One pytest-benchmark test per (suite, case, provider); see bench/conftest.py."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("pytest_benchmark")


def test_bench(benchmark, bench_item, request):
    from fastarch.bench.core import Skip

    suite, case, prov, cfg, _ = bench_item
    if prov.peer_package and importlib.util.find_spec(prov.peer_package) is None:
        pytest.skip(f"not installed ({prov.peer_package})")
    try:
        fn = prov.setup()
    except Skip as exc:
        pytest.skip(str(exc) or "skipped")
    benchmark.group = f"{suite}: {case.name}"
    benchmark.extra_info.update(suite=suite, case=case.name, provider=prov.name, kind=prov.kind,
                                params=case.params, flops=case.flops, device=str(cfg.device),
                                dtype=str(cfg.dtype).replace("torch.", ""))
    rounds = request.config.getoption("--bench-rounds") or (5 if cfg.quick else 20)
    if cfg.is_cuda:
        import torch

        def run():
            fn()
            torch.cuda.synchronize(cfg.device)
    else:
        run = fn
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=1, iterations=1)
    if case.flops:
        benchmark.extra_info["gflops"] = case.flops / benchmark.stats.stats.median / 1e9
