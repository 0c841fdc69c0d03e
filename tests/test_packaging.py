"""Build flags and package layout: ahead-of-time builds stay portable, and no top-level folder of the
checkout shadows an installed package."""

from __future__ import annotations

from pathlib import Path

import pytest

import fastarch.kernels
from fastarch import extensions as fx

ROOT = Path(__file__).resolve().parents[1]


def test_only_just_in_time_builds_tune_to_this_machine():
    assert "-march=native" in fx.cpu_cflags()
    assert not any(f.startswith(("-march", "-mtune", "-mcpu")) for f in fx.cpu_cflags(ahead_of_time=True))


def test_ahead_of_time_x86_builds_target_avx2_and_fma(monkeypatch):
    monkeypatch.setattr(fx, "_is_x86_64", lambda: True)
    assert {"-mavx2", "-mfma"} <= set(fx.cpu_cflags(ahead_of_time=True))
    monkeypatch.setattr(fx, "_is_x86_64", lambda: False)
    assert not any(f in ("-mavx2", "-mfma") for f in fx.cpu_cflags(ahead_of_time=True))


@pytest.mark.parametrize("flags,missing", [(["sse2", "avx"], "AVX2 and FMA"), (["avx2"], "FMA"),
                                           (["fma", "avx2", "avx512f"], None)])
def test_ahead_of_time_build_is_refused_on_a_cpu_without_avx2_or_fma(monkeypatch, flags, missing):
    monkeypatch.setattr(fx, "_is_x86_64", lambda: True)
    monkeypatch.setattr(fx, "_cpu_flags", lambda: flags)
    reason = fx.aot_cpu_reason()
    if missing is None:
        assert reason is None
    else:
        assert reason is not None and f"needs {missing}" in reason


def test_ahead_of_time_module_name_changes_with_the_flags():
    name, kind = fx.all_extensions()[0]
    assert fx.aot_module_name(name, kind).startswith(f"{fx.module_name(name, kind)}_")
    assert fx.source_hash(name, kind, ahead_of_time=True) != fx.source_hash(name, kind)


def test_the_triton_kernels_are_a_subpackage_and_no_top_level_folder_is_importable():
    # A checkout's root is on sys.path when Python runs from it (pytest, scripts); a top-level package folder
    # there would shadow an installed package of the same name (``kernels`` is Hugging Face's, which
    # transformers imports).
    assert Path(fastarch.kernels.__file__).resolve() == ROOT / "fastarch" / "kernels" / "__init__.py"
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["fastarch", "tests"], packages
