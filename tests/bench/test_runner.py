"""The bench machinery end to end: suite discovery (including a module that fails to import), provider
skipping and errors, derived metrics, case sets and ratios, CSV/JSON schema, plots, and the CLI at toy
sizes."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from fastarch.bench import cli
from fastarch.bench.core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from fastarch.bench.report import CSV_COLUMNS, METRICS
from fastarch.bench.runner import RunOptions, SuiteEntry, discover_suites, run_benchmarks
from fastarch.bench.timing import TimingPolicy, quantile, time_callable

TOY = '''
import torch
from fastarch.bench.core import Case, Provider, Ratio, Skip, Suite


def _mm(n, cfg, slow):
    def setup():
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(cfg.device, cfg.dtype)
        if slow:  # materialises an (n, n, n) product: n**3 * 4 bytes of temporary memory
            return lambda: (a[:, :, None] * a[None, :, :]).sum(1)
        return lambda: a @ a
    return setup


def _unicorn():
    raise Skip("needs a unicorn")


def _boom():
    raise RuntimeError("kaboom")


def cases(cfg):
    sizes = (16, 32, 128) if cfg.toy else (256, 512)
    return [
        Case(name=f"mm n={n}", params={"n": n}, flops=2.0 * n ** 3, bytes=3.0 * n * n * 4,
             measure_memory=(n == 128),
             providers=[
                 Provider("fast", "fastarch", _mm(n, cfg, slow=False)),
                 Provider("reference", "reference", _mm(n, cfg, slow=True)),
                 Provider("torch-peer", "torch", _mm(n, cfg, slow=False)),
                 Provider("unicorn", "fastarch", _unicorn),
                 Provider("boom", "fastarch", _boom),
                 Provider("peerlib", "peer", _mm(n, cfg, slow=False),
                          peer_package="surely_not_installed_pkg_fastarch"),
             ])
        for n in sizes
    ]


def headline(cfg):
    """Toy headline: one matmul, the slow provider timed on a quarter of the work."""
    return [Case(name="head n=128", params={"n": 128}, flops=None, measure_memory=True,
                 providers=[Provider("fast", "fastarch", _mm(128, cfg, slow=False)),
                            Provider("reference", "reference", _mm(128, cfg, slow=True), scale=4.0),
                            Provider("peerlib", "peer", _mm(128, cfg, slow=False),
                                     peer_package="surely_not_installed_pkg_fastarch")],
                 ratios=(Ratio("fast", "reference", target=1e-6), Ratio("reference", "fast", target=1e-6),
                         Ratio("fast", "reference", target=1e6, at_most=True), Ratio("fast", "peerlib")))]


SUITE = Suite(name="zz_toy_suite", description="toy matmuls", cases=cases, case_sets={"zz-headline": headline})
'''


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("suites")
    (d / "zz_toy_suite.py").write_text(TOY)
    (d / "zz_broken_suite.py").write_text("import not_a_real_module_fastarch_xyz\n")
    (d / "zz_nosuite.py").write_text("X = 1\n")
    mp = pytest.MonkeyPatch()
    mp.setenv("FASTARCH_BENCH_SUITES_PATH", str(d))
    yield d
    mp.undo()
    for m in [m for m in sys.modules if m.startswith("fastarch.bench.suites.zz_")]:
        del sys.modules[m]


def test_discovery_reports_broken_modules(suite_dir):
    entries = discover_suites()
    assert entries["zz_toy_suite"].suite is not None
    assert entries["zz_broken_suite"].suite is None
    assert "failed to import" in entries["zz_broken_suite"].error
    assert "not_a_real_module_fastarch_xyz" in entries["zz_broken_suite"].error
    assert "no SUITE" in entries["zz_nosuite"].error
    assert entries["norms"].suite is not None


def test_run_statuses_and_derived_metrics(suite_dir):
    entries = discover_suites()
    opts = RunOptions(quick=True, toy=True, policy=TimingPolicy(repeat=3), memory="none")
    run = run_benchmarks([entries["zz_toy_suite"], entries["zz_broken_suite"]], opts)
    assert run.suites["zz_broken_suite"]["status"] == "error"
    by = {(r.case, r.provider): r for r in run.results}
    assert len(by) == 3 * 6
    r = by[("mm n=32", "unicorn")]
    assert (r.status, r.note) == ("skipped", "needs a unicorn")
    r = by[("mm n=32", "boom")]
    assert r.status == "error" and r.note == "RuntimeError: kaboom"
    r = by[("mm n=32", "peerlib")]
    assert r.status == "skipped" and "not installed" in r.note
    fast, ref, peer = by[("mm n=32", "fast")], by[("mm n=32", "reference")], by[("mm n=32", "torch-peer")]
    for x in (fast, ref, peer):
        assert x.status == "ok"
        assert x.timing.p20_ms <= x.timing.median_ms <= x.timing.p80_ms
        assert x.timing.reps >= 3
    assert ref.speedup_vs_reference == pytest.approx(1.0)
    assert fast.speedup_vs_reference == pytest.approx(ref.timing.median_ms / fast.timing.median_ms)
    assert fast.speedup_vs_best_peer == pytest.approx(peer.timing.median_ms / fast.timing.median_ms)
    assert fast.best_peer == "torch-peer"
    assert fast.gflops == pytest.approx(2.0 * 32**3 / (fast.timing.median_ms * 1e-3) / 1e9)
    assert fast.pct_peak == pytest.approx(100 * fast.gflops / run.matmul_peak_gflops)
    assert fast.gbps == pytest.approx(3.0 * 32 * 32 * 4 / (fast.timing.median_ms * 1e-3) / 1e9)


def test_provider_filter_keeps_reference(suite_dir):
    entries = discover_suites()
    opts = RunOptions(toy=True, providers=["fast"], policy=TimingPolicy(repeat=1), memory="none",
                      measure_peak=False)
    run = run_benchmarks([entries["zz_toy_suite"]], opts)
    assert {r.provider for r in run.results} == {"fast", "reference"}
    opts.providers = ["peer"]  # by kind
    run = run_benchmarks([entries["zz_toy_suite"]], opts)
    assert {r.provider for r in run.results} == {"peerlib", "reference"}


def test_cases_raising_skip_or_error_are_reported():
    def skip_all(cfg):
        raise Skip("no widgets here")

    def crash(cfg):
        raise ValueError("bad sizes")

    entries = [SuiteEntry("s1", "x", Suite("s1", "d", skip_all)), SuiteEntry("s2", "x", Suite("s2", "d", crash))]
    run = run_benchmarks(entries, RunOptions(toy=True, memory="none"))
    assert run.suites["s1"] == {"description": "d", "status": "skipped", "note": "no widgets here"}
    assert run.suites["s2"]["status"] == "error" and "bad sizes" in run.suites["s2"]["note"]
    assert run.results == []


def test_cuda_device_without_cuda_is_reported_not_fatal(suite_dir, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = cli.main(["--suite", "zz_toy_suite", "--device", "cuda", "--out", str(tmp_path), "--no-plot",
                   "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["suites"]["zz_toy_suite"] == {"description": "toy matmuls", "status": "skipped",
                                             "note": "no CUDA device"}
    assert "no CUDA device" in capsys.readouterr().out


def test_unknown_suite_is_a_clear_error(capsys):
    assert cli.main(["--suite", "no_such_suite", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite(s): no_such_suite" in err and "norms" in err


def test_list(suite_dir, capsys):
    assert cli.main(["--list", "--toy", "--suite", "zz_toy_suite,zz_broken_suite"]) == 0
    out = capsys.readouterr().out
    assert "mm n=16: fast (fastarch), reference (reference)" in out
    assert "zz_broken_suite: NOT AVAILABLE" in out


def test_case_validation():
    p = Provider("a", "fastarch", lambda: (lambda: None))
    with pytest.raises(ValueError, match="duplicate provider"):
        Case("c", {}, None, [p, p])
    with pytest.raises(ValueError, match="kind"):
        Provider("a", "friend", lambda: (lambda: None))
    cfg = BenchConfig()
    assert (cfg.quick, cfg.device.type, cfg.dtype, cfg.is_cuda) == (True, "cpu", torch.float32, False)


def test_timing_helpers():
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.2) == pytest.approx(1.8)
    assert quantile([7.0], 0.8) == 7.0
    calls = []
    res = time_callable(lambda: calls.append(1), "cpu", TimingPolicy(warmup=2, repeat=5))
    assert res.reps == 5 and len(calls) == 7 and res.method == "wall"
    res = time_callable(lambda: None, "cpu", TimingPolicy(budget_s=0.01, min_reps=3, max_reps=50))
    assert 3 <= res.reps <= 50


def test_cli_end_to_end_toy(suite_dir, tmp_path, capsys):
    out = tmp_path / "out"
    provs = "fast,torch-peer,unicorn,boom,peerlib,fastarch-torch,torch"
    rc = cli.main(["--suite", "zz_toy_suite,zz_broken_suite,norms", "--quick", "--toy", "--out", str(out),
                   "--repeat", "2", "--providers", provs, "--cases", "mm*,layer_norm fwd+bwd*", "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "== zz_toy_suite: toy matmuls" in stdout
    assert "skipped: not installed (surely_not_installed_pkg_fastarch)" in stdout
    assert "error: RuntimeError: kaboom" in stdout
    assert "zz_broken_suite" in stdout and "failed to import" in stdout

    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    assert rows and all(r["metric"] in METRICS for r in rows)
    assert {r["suite"] for r in rows} == {"zz_toy_suite", "norms"}
    for r in rows:
        assert r["status"] in ("ok", "skipped", "error")
        assert r["torch"] == torch.__version__ and r["timestamp"] and r["cpu"] and r["device"] == "cpu"
        json.loads(r["params"])
        if r["status"] == "ok":
            float(r["value"])
        else:
            assert r["value"] == "" and r["metric"] == "time_median_ms" and r["note"]
    # one row per (suite, case, provider, metric)
    keys = [(r["suite"], r["case"], r["provider"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys))
    fast = {r["metric"]: r for r in rows if r["case"] == "mm n=128" and r["provider"] == "fast"}
    assert {"time_median_ms", "time_p20_ms", "time_p80_ms", "gflops", "pct_matmul_peak", "gbps",
            "speedup_vs_reference", "speedup_vs_best_peer", "peak_memory_mb"} <= set(fast)
    # Peak memory is measured (subprocess RSS): the reference materialises a 128**3 fp32 temporary (8 MiB).
    ref_mem = next(float(r["value"]) for r in rows if r["case"] == "mm n=128" and r["provider"] == "reference"
                   and r["metric"] == "peak_memory_mb")
    assert 6.0 <= ref_mem <= 24.0, ref_mem
    assert float(fast["peak_memory_mb"]["value"]) < 2.0
    assert not any(r["metric"] == "peak_memory_mb" for r in rows if r["case"] == "mm n=16")

    doc = json.loads((out / "results.json").read_text())
    for k in ("timestamp", "machine", "cpu", "device", "device_name", "torch", "triton", "fastarch", "python",
              "matmul_peak_gflops", "wall_time_s"):
        assert k in doc["meta"], k
    assert doc["columns"] == CSV_COLUMNS and len(doc["rows"]) == len(rows)
    assert doc["suites"]["zz_broken_suite"]["status"] == "error"
    norms_ok = [r for r in doc["rows"] if r["suite"] == "norms" and r["status"] == "ok"]
    assert {r["provider"] for r in norms_ok} >= {"reference", "torch", "fastarch-torch"}
    summary = (out / "summary.md").read_text()
    assert summary.count("| zz_toy_suite | mm n=") == 3 and "| fast |" in summary
    assert "== zz_toy_suite" in (out / "table.txt").read_text()
    for name in ("zz_toy_suite.png", "norms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from fastarch.bench.readme import render

    md = render([out], tmp_path)
    assert "## `zz_toy_suite`" in md and "![zz_toy_suite (out)](out/zz_toy_suite.png)" in md
    assert "- `mm`: n=256, n=512 — providers: fast, reference, torch-peer" in md  # the --full cases
    assert "## `zz_broken_suite`\n\nNot available: failed to import" in md


def test_plots_skip_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    from fastarch.bench.plots import plot_suites

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    from fastarch.bench.runner import RunResult

    paths, msg = plot_suites(RunResult([], {}, None, 0.0), tmp_path)
    assert paths == [] and "matplotlib is not installed" in msg


def test_time_limit_shrinks_budgets():
    import time

    from fastarch.bench.runner import _policy_now

    base = TimingPolicy(budget_s=0.25, min_reps=3)
    now = time.perf_counter()
    assert _policy_now(RunOptions(policy=base), now, 10) is base
    assert _policy_now(RunOptions(policy=base, time_limit_s=1000.0), now, 10) is base
    p = _policy_now(RunOptions(policy=base, time_limit_s=100.0), now, 1000)
    assert p.budget_s == pytest.approx(0.04, rel=0.05) and p.min_reps == 2
    p = _policy_now(RunOptions(policy=base, time_limit_s=10.0), now - 20.0, 5)
    assert (p.budget_s, p.min_reps) == (0.0, 1)
    calls = []
    res = time_callable(lambda: calls.append(1), "cpu", p)
    assert res.reps == 1 and len(calls) == 2  # one warm-up, one timed call


@pytest.mark.gpu
def test_cuda_timing_and_memory(suite_dir, tmp_path):
    entries = discover_suites()
    opts = RunOptions(device=torch.device("cuda"), toy=True, memory="all",
                      policy=TimingPolicy(budget_s=0.02))
    run = run_benchmarks([entries["zz_toy_suite"]], opts)
    by = {(r.case, r.provider): r for r in run.results}
    ref = by[("mm n=128", "reference")]
    assert ref.status == "ok" and ref.timing.method in ("triton.do_bench", "cuda-events")
    assert ref.mem_method == "cuda-max-allocated"
    assert 7.5 <= ref.mem_bytes / 2**20 <= 16.5  # the (128, 128, 128) fp32 temporary
    assert run.matmul_peak_gflops > 0


def test_very_slow_call_is_not_repeated_in_quick_mode():
    import time

    calls = []
    res = time_callable(lambda: (calls.append(1), time.sleep(0.06)), "cpu",
                        TimingPolicy(budget_s=0.25, warmup=1, min_reps=3, slow_s=0.01))
    assert len(calls) == 1 and res.reps == 1 and res.method == "wall-warmup-only"
    assert res.median_ms >= 60


def test_interrupt_keeps_partial_results():
    def ok():
        return lambda: None

    def ctrl_c():
        raise KeyboardInterrupt

    def cases(cfg):
        return [Case("a n=1", {"n": 1}, None, [Provider("reference", "reference", ok),
                                               Provider("stop", "fastarch", ctrl_c),
                                               Provider("never", "fastarch", ok)])]

    entries = [SuiteEntry("s1", "x", Suite("s1", "d", cases)), SuiteEntry("s2", "x", Suite("s2", "d", cases))]
    run = run_benchmarks(entries, RunOptions(memory="none", measure_peak=False, policy=TimingPolicy(repeat=1)))
    assert [r.provider for r in run.results] == ["reference"]
    assert "interrupted" in run.suites["s1"]["note"]
    assert run.suites["s2"]["status"] == "skipped"


def test_case_set_ratios_and_scale(suite_dir, tmp_path, capsys):
    from fastarch.bench.runner import case_set_entries

    entries = discover_suites()
    sel = case_set_entries(entries, ["zz-headline"])
    assert [(e.name, e.case_set, e.module) for e in sel] == [
        ("zz-headline", "zz-headline", "fastarch.bench.suites.zz_toy_suite")]
    assert "unknown case set(s): nope" in case_set_entries(entries, ["nope"])
    run = run_benchmarks(sel, RunOptions(toy=True, policy=TimingPolicy(repeat=3), memory="all", measure_peak=False))
    assert run.suites["zz-headline"]["description"] == "Toy headline: one matmul, the slow provider timed on a " \
                                                       "quarter of the work."
    by = {r.provider: r for r in run.results}
    fast, ref = by["fast"], by["reference"]
    assert ref.timing.method == "wall, extrapolated x4" and "extrapolated" in ref.note
    assert ref.mem_bytes is not None and ref.mem_bytes > 4 * 2**20  # measured in the child, by case set
    value = ref.timing.median_ms / fast.timing.median_ms
    got = [(q.faster, q.slower, q.value, q.met) for q in run.ratios]
    assert got[0] == ("fast", "reference", pytest.approx(value), True)
    assert got[1] == ("reference", "fast", pytest.approx(1 / value), True)
    assert got[2] == ("fast", "reference", pytest.approx(value), True)
    assert got[3] == ("fast", "peerlib", None, None)

    out = tmp_path / "out"
    assert cli.main(["--case", "zz-headline", "--toy", "--out", str(out), "--repeat", "2", "--no-plot",
                     "--no-progress", "--memory", "none", "--threads", "1"]) == 0
    stdout = capsys.readouterr().out
    assert "ratios (time of the slower / time of the faster):" in stdout
    assert "zz-headline | head n=128" in stdout and "(target >= 1e-06: met)" in stdout
    assert "fast vs peerlib: not measured" in stdout
    doc = json.loads((out / "results.json").read_text())
    assert [q["slower"] for q in doc["ratios"]] == ["reference", "fast", "reference", "peerlib"]
    assert "ratios" in (out / "table.txt").read_text() and "ratios" in (out / "summary.md").read_text()


def test_case_set_cli_errors(suite_dir, capsys):
    assert cli.main(["--case", "nope", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown case set(s): nope" in err and "lsh-headline" in err and "zz-headline" in err
    assert cli.main(["--case", "zz-headline", "--suite", "norms"]) == 2
    assert "not both" in capsys.readouterr().err
    assert cli.main(["--case", "zz-headline", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert cli.main(["--list", "--toy", "--suite", "zz_toy_suite"]) == 0
    assert "case sets (--case): zz-headline" in capsys.readouterr().out


def test_ratio_and_case_only():
    assert Ratio("a", "b", target=2.0).met(2.0) is True and Ratio("a", "b", target=2.0).met(1.9) is False
    assert Ratio("a", "b", target=2.0, at_most=True).met(1.0) is True and Ratio("a", "b").met(5.0) is None
    ps = [Provider(n, "fastarch", lambda: (lambda: None)) for n in ("a", "b", "c")]
    with pytest.raises(ValueError, match="argument 'ratios' names providers \\['z'\\]"):
        Case("c", {}, None, ps, reference="a", ratios=(Ratio("a", "z"),))
    c = Case("c", {}, None, ps, reference="a", ratios=(Ratio("b", "a"), Ratio("b", "c")))
    kept = c.only("c", "b")
    assert [p.name for p in kept.providers] == ["c", "b"] and kept.ratios == (Ratio("b", "c"),)
    assert kept.reference == "c" and c.only("a").reference == "a"
    with pytest.raises(ValueError, match="no providers"):
        c.only("x")
    with pytest.raises(ValueError, match="argument 'case_set'"):
        Suite("s", "d", lambda cfg: [], case_sets={"x": lambda cfg: []}).cases_for(BenchConfig(), "y")


def test_memory_bounds_are_checked_and_reported():
    from fastarch.bench.core import MemoryBound
    from fastarch.bench.report import format_ratios
    from fastarch.bench.runner import ProviderResult, RunResult, _derive

    ps = [Provider(n, "fastarch", lambda: (lambda: None)) for n in ("a", "b")]
    with pytest.raises(ValueError, match="argument 'memory_bounds' names providers \\['z'\\]"):
        Case("c", {}, None, ps, memory_bounds=(MemoryBound("z", 1.0),))
    c = Case("c", {}, None, ps, reference="a", memory_bounds=(MemoryBound("a", 10.0), MemoryBound("b", 10.0)))
    assert c.measure_memory and c.only("b").memory_bounds == (MemoryBound("b", 10.0),)
    rs = []
    for name, mb in (("a", 8.0), ("b", 12.0)):
        r = ProviderResult(suite="s", case="c", group=None, params={}, x_name=None, x=None, provider=name,
                           kind="fastarch", reference=name == "a", status="ok", flops=None, bytes=None)
        r.mem_bytes = int(mb * 2**20)
        rs.append(r)
    got = _derive(rs, c, None)
    assert [(q.faster, q.met, q.metric) for q in got] == [("a", True, "peak memory"), ("b", False, "peak memory")]
    text = format_ratios(RunResult(results=rs, suites={}, matmul_peak_gflops=None, wall_s=0.0, ratios=got))
    assert "a peak memory: 8 MB (bound <= 10 MB: met)" in text and "b peak memory: 12 MB" in text and "MISSED" in text


def test_timed_call_forward_and_backward():
    from fastarch.bench.helpers import timed_call

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4)
    fwd = timed_call(lambda a, b: a * b, [x, w], False)
    y = fwd()
    assert not y.requires_grad
    fb = timed_call(lambda a, b: (a * b, None), [x, w], True)
    (g1,), (g2,) = fb(), fb()
    torch.testing.assert_close(g1, g2)  # nothing accumulates between iterations
    assert x.grad is None


def test_every_case_set_builds_at_toy_sizes():
    """Each built-in case set builds its cases (provider and ratio names checked by ``Case``), or says why
    it cannot run here."""
    entries = discover_suites()
    names = {cs for e in entries.values() if e.suite for cs in e.suite.case_sets}
    assert {"lsh-headline", "lsh-phases", "attention-headline", "triton-attention-gpu", "selective-scan-headline",
            "s4-headline", "linear-attention-headline", "models-headline", "norms-headline", "optim-headline",
            "tokenizer-headline", "generation-headline"} <= names
    cfg = BenchConfig(toy=True)
    for e in entries.values():
        for name in e.suite.case_sets if e.suite else ():
            try:
                cases = e.suite.cases_for(cfg, name)
            except Skip as exc:
                assert name == "triton-attention-gpu" and "CUDA" in str(exc)
                continue
            assert cases, name
            assert all(c.providers for c in cases), name


@pytest.mark.parametrize("suite, case, peer", [
    ("lsh", "fwd L=256", "reformer_pytorch"),
    ("sliding_window", "fwd B=1,H=2,L=128,D=32,w=16", "local_attention"),
    ("linear_attention", "causal fwd B=1,H=2,L=64,m=16,D=8", "performer_pytorch"),
    ("linear_attention", "favor+ causal fwd B=1,H=2,L=64,m=16,D=8", "performer_pytorch"),
])
def test_peers_run_when_installed(suite, case, peer):
    import importlib.util

    if importlib.util.find_spec(peer) is None:
        pytest.skip(f"{peer} is not installed (the bench extra installs it)")
    entries = discover_suites()
    run = run_benchmarks([entries[suite]], RunOptions(toy=True, cases=[case], providers=["peer"], memory="none",
                                                      measure_peak=False, policy=TimingPolicy(repeat=1)))
    peers = [r for r in run.results if r.kind == "peer" and r.case == case]
    assert peers and all(r.status == "ok" for r in peers), [(r.provider, r.note) for r in peers]


def test_case_set_policy_repeats_slow_calls():
    import time
    from dataclasses import replace

    p = TimingPolicy.for_mode(True, case_set=True)
    assert p.slow_s is None and p.min_reps == 3 and p.warmup == 1
    calls = []
    res = time_callable(lambda: (calls.append(1), time.sleep(0.02)), "cpu", replace(p, budget_s=0.01))
    assert len(calls) == 4 and res.reps == 3 and res.median_ms >= 20


def test_plots_take_cases_that_share_an_x(tmp_path):
    """Several cases of one group at the same x (models at one size) plot without comparing results."""
    pytest.importorskip("matplotlib")
    from fastarch.bench.plots import plot_suites
    from fastarch.bench.runner import ProviderResult, RunResult
    from fastarch.bench.timing import TimingResult

    def result(case: str, provider: str, ms: float) -> ProviderResult:
        return ProviderResult(suite="hf", case=case, group="generate", params={}, x_name="hidden", x=256.0,
                              provider=provider, kind="fastarch" if provider == "fastarch" else "torch",
                              reference=provider != "fastarch", status="ok",
                              timing=TimingResult(ms, ms, ms, 3, "wall"))

    results = [result(c, p, ms) for c in ("llama", "gpt2") for p, ms in (("fastarch", 2.0), ("transformers", 3.0))]
    paths, _ = plot_suites(RunResult(results, {"hf": {}}, None, 0.0), tmp_path)
    assert [p.name for p in paths] == ["hf.png"] and paths[0].read_bytes()[:4] == b"\x89PNG"
