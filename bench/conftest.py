"""pytest-benchmark front end to the fastarch bench suites (regression tracking).

    pytest bench/ --benchmark-only                          # every suite, --quick sizes, CPU
    pytest bench/ --benchmark-only --bench-suite norms --bench-full
    pytest bench/ --benchmark-only --benchmark-autosave     # store a run; compare with --benchmark-compare

One test per (suite, case, provider), generated from ``fastarch/bench/suites/*.py``; providers that raise
``Skip`` are skipped with their reason. Triton runs on CPU only in interpreter mode, which is for tests, so
this conftest does not set TRITON_INTERPRET.
"""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    g = parser.getgroup("fastarch-bench")
    g.addoption("--bench-suite", action="append", default=None, help="suite name(s) (default: all)")
    g.addoption("--bench-full", action="store_true", help="the --full sweeps instead of --quick sizes")
    g.addoption("--bench-toy", action="store_true", help="toy sizes (smoke test of the harness)")
    g.addoption("--bench-device", default=None, help="cpu or cuda (default: cuda if available)")
    g.addoption("--bench-dtype", default="float32", help="float32, float16 or bfloat16")
    g.addoption("--bench-providers", default=None, help="comma-separated provider globs")
    g.addoption("--bench-rounds", type=int, default=None, help="timed rounds per test (default 5 quick, 20 full)")


def _config(config):
    from fastarch.bench.core import BenchConfig

    dev = config.getoption("--bench-device") or ("cuda" if torch.cuda.is_available() else "cpu")
    return BenchConfig(quick=not config.getoption("--bench-full"), device=torch.device(dev),
                       dtype=getattr(torch, config.getoption("--bench-dtype")),
                       toy=config.getoption("--bench-toy"))


def pytest_generate_tests(metafunc):
    if "bench_item" not in metafunc.fixturenames:
        return
    import fnmatch

    from fastarch.bench.runner import discover_suites

    config = metafunc.config
    cfg = _config(config)
    wanted = [s for v in (config.getoption("--bench-suite") or []) for s in v.split(",")]
    provs = [p for p in (config.getoption("--bench-providers") or "").split(",") if p]
    params, ids = [], []
    for name, entry in discover_suites().items():
        if wanted and name not in wanted:
            continue
        if entry.suite is None:
            params.append(pytest.param((name, None, None, cfg, entry.error),
                                       marks=pytest.mark.skip(reason=f"suite {name}: {entry.error}")))
            ids.append(f"{name}-unavailable")
            continue
        try:
            cases = entry.suite.cases(cfg)
        except Exception as exc:  # Skip or a broken suite: one skipped test that says why
            params.append(pytest.param((name, None, None, cfg, str(exc)),
                                       marks=pytest.mark.skip(reason=f"suite {name}: {exc}")))
            ids.append(f"{name}-cases")
            continue
        for case in cases:
            for prov in case.providers:
                if provs and not any(fnmatch.fnmatch(prov.name, p) or prov.kind == p for p in provs):
                    continue
                params.append((name, case, prov, cfg, None))
                ids.append(f"{name}[{case.name}]-{prov.name}".replace(" ", "_"))
    metafunc.parametrize("bench_item", params, ids=ids)
