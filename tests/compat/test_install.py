"""fastarch.compat.install(): the originals' import paths resolve to fastarch's modules only for packages that
are not installed; an installed package (simulated with a package directory on sys.path) is never shadowed,
not even one that appears after install(); uninstall() removes every alias."""

import importlib
import importlib.util
import sys

import pytest

import fastarch.compat as compat

NAMES = ("causal_conv1d", "mamba_ssm", "flash_attn")


def _real(name: str) -> bool:
    compat.uninstall()
    return importlib.util.find_spec(name) is not None


@pytest.fixture
def clean():
    """No alias and no (fake) package of these names before or after the test."""
    def drop():
        compat.uninstall()
        for n in [n for n in sys.modules if n.partition(".")[0] in NAMES]:
            del sys.modules[n]

    drop()
    yield
    drop()


def _fake_packages(tmp_path, *names):
    for name in names:
        pkg = tmp_path / name
        (pkg / "ops").mkdir(parents=True)
        (pkg / "__init__.py").write_text("FAKE = True\n")
        (pkg / "ops" / "__init__.py").write_text("")
        (pkg / "ops" / "selective_scan_interface.py").write_text("FAKE = True\n")


def test_aliases_resolve_to_fastarch(clean):
    for name in ("causal_conv1d", "mamba_ssm"):
        if _real(name):
            pytest.skip(f"the real {name} is installed here")
    aliased = compat.install()
    assert {"causal_conv1d", "mamba_ssm"} <= set(aliased) and compat.installed() == aliased
    from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
    from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref
    from mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    import fastarch.compat.causal_conv1d.causal_conv1d_interface as conv_iface
    import fastarch.compat.mamba_ssm.ops.selective_scan_interface as scan_iface
    import fastarch.ops as ops

    assert causal_conv1d_fn is ops.causal_conv1d_fn and causal_conv1d_update is conv_iface.causal_conv1d_update
    assert causal_conv1d_ref is conv_iface.causal_conv1d_ref
    assert selective_scan_fn is ops.selective_scan_fn and mamba_inner_fn is scan_iface.mamba_inner_fn
    assert selective_state_update is ops.selective_state_update
    # One module object under both names, which keeps its own name and spec (nothing loaded twice).
    assert sys.modules["mamba_ssm.ops.selective_scan_interface"] is scan_iface
    assert scan_iface.__spec__.name == scan_iface.__name__ == "fastarch.compat.mamba_ssm.ops.selective_scan_interface"
    compat.uninstall()
    assert compat.installed() == [] and not any(n.partition(".")[0] in NAMES for n in sys.modules)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("causal_conv1d")


def test_install_is_idempotent(clean):
    first = compat.install()
    assert compat.install() == first
    assert sum(isinstance(f, compat._AliasFinder) for f in sys.meta_path) == (1 if first else 0)


def test_flash_attn_only_when_fastarch_has_it(clean):
    ours = importlib.util.find_spec("fastarch.compat.flash_attn") is not None
    expected = ours and not _real("flash_attn")
    assert ("flash_attn" in compat.install()) == expected
    if not expected and not _real("flash_attn"):
        compat.install()
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("flash_attn")


def test_installed_package_is_never_shadowed(clean, tmp_path, monkeypatch):
    _fake_packages(tmp_path, "causal_conv1d", "mamba_ssm")
    monkeypatch.syspath_prepend(str(tmp_path))
    aliased = compat.install()
    assert "causal_conv1d" not in aliased and "mamba_ssm" not in aliased
    import causal_conv1d
    import mamba_ssm.ops.selective_scan_interface as iface

    assert causal_conv1d.FAKE and iface.FAKE and iface.__file__.startswith(str(tmp_path))


def test_package_installed_after_install_wins(clean, tmp_path, monkeypatch):
    for name in ("causal_conv1d", "mamba_ssm"):
        if _real(name):
            pytest.skip(f"the real {name} is installed here")
    assert "mamba_ssm" in compat.install()
    _fake_packages(tmp_path, "mamba_ssm")
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches
    import mamba_ssm.ops.selective_scan_interface as iface

    assert iface.FAKE
    import causal_conv1d  # still ours: nothing real of that name appeared

    assert causal_conv1d.__name__ == "fastarch.compat.causal_conv1d"
