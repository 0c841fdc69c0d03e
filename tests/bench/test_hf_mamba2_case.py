"""The ``hf-mamba2`` case set at toy size: the model forward on both paths and its timed parts (the projection
GEMMs on fastarch's linear and on PyTorch's BLAS, and fastarch's GEMMs plus its SSD scans) run, and the ratios
that explain the result are reported."""

from __future__ import annotations

import pytest

from fastarch.bench.runner import RunOptions, case_set_entries, discover_suites, run_benchmarks
from fastarch.bench.timing import TimingPolicy

pytest.importorskip("transformers")


def test_hf_mamba2_reports_its_parts():
    sel = case_set_entries(discover_suites(), ["hf-mamba2"])
    run = run_benchmarks(sel, RunOptions(toy=True, policy=TimingPolicy(repeat=1), memory="none", measure_peak=False))
    by = {r.provider: r for r in run.results}
    assert sorted(by) == ["fastarch", "hf-pytorch", "projections", "projections+ssd_scan", "projections-blas"]
    assert all(r.status == "ok" for r in by.values()), {p: r.note for p, r in by.items()}
    ms = {p: r.timing.median_ms for p, r in by.items()}
    got = {(q.faster, q.slower): q.value for q in run.ratios}
    assert got == {
        ("fastarch", "hf-pytorch"): pytest.approx(ms["hf-pytorch"] / ms["fastarch"]),
        ("projections", "fastarch"): pytest.approx(ms["fastarch"] / ms["projections"]),
        ("projections+ssd_scan", "fastarch"): pytest.approx(ms["fastarch"] / ms["projections+ssd_scan"]),
        ("projections", "projections-blas"): pytest.approx(ms["projections-blas"] / ms["projections"]),
        ("projections-blas", "hf-pytorch"): pytest.approx(ms["hf-pytorch"] / ms["projections-blas"]),
    }
