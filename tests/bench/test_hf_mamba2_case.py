"""The ``hf-mamba2`` case set at toy size: the model forward on both paths and the two floors (the projection
GEMMs, and those GEMMs plus fastarch's SSD scans) run, and the ratios that explain the result are reported."""

from __future__ import annotations

import pytest

from fastarch.bench.runner import RunOptions, case_set_entries, discover_suites, run_benchmarks
from fastarch.bench.timing import TimingPolicy

pytest.importorskip("transformers")


def test_hf_mamba2_reports_its_floors():
    sel = case_set_entries(discover_suites(), ["hf-mamba2"])
    run = run_benchmarks(sel, RunOptions(toy=True, policy=TimingPolicy(repeat=1), memory="none", measure_peak=False))
    by = {r.provider: r for r in run.results}
    assert sorted(by) == ["fastarch", "hf-pytorch", "projections", "projections+ssd_scan"]
    assert all(r.status == "ok" for r in by.values()), {p: r.note for p, r in by.items()}
    ms = {p: r.timing.median_ms for p, r in by.items()}
    got = {(q.faster, q.slower): q.value for q in run.ratios}
    assert got == {
        ("fastarch", "hf-pytorch"): pytest.approx(ms["hf-pytorch"] / ms["fastarch"]),
        ("projections", "hf-pytorch"): pytest.approx(ms["hf-pytorch"] / ms["projections"]),
        ("projections+ssd_scan", "hf-pytorch"): pytest.approx(ms["hf-pytorch"] / ms["projections+ssd_scan"]),
        ("projections", "fastarch"): pytest.approx(ms["fastarch"] / ms["projections"]),
        ("projections+ssd_scan", "fastarch"): pytest.approx(ms["fastarch"] / ms["projections+ssd_scan"]),
    }
