"""fastarch.compat._missing: a stand-in's module ``__getattr__`` refuses a public name it lacks with an ImportError
naming it and listing what the stand-in offers; private names stay plain attribute misses."""

import sys

import pytest

from fastarch.compat._missing import (
    ModuleNotProvidedError,
    NotProvidedError,
    missing_attribute,
    provided_modules,
)


def test_missing_public_name_names_it_and_the_offer():
    import fastarch.compat.mamba_ssm.ops  # noqa: F401  (its __all__, when it has one, joins the offer)

    getattr_ = missing_attribute("mamba_ssm", "mamba_ssm.ops")
    with pytest.raises(NotProvidedError, match=r"does not provide mamba_ssm\.ops\.nope; it provides .*"
                                               r"mamba_ssm\.ops\.selective_scan_interface") as info:
        getattr_("nope")
    assert isinstance(info.value, ImportError) and info.value.name == "nope"


def test_explicit_offer_and_private_names():
    getattr_ = missing_attribute("causal_conv1d", "causal_conv1d", provided=["causal_conv1d.causal_conv1d_fn"])
    with pytest.raises(ImportError, match=r"causal_conv1d\.other; it provides causal_conv1d\.causal_conv1d_fn$"):
        getattr_("other")
    with pytest.raises(AttributeError) as info:
        getattr_("__wrapped__")
    assert not isinstance(info.value, ImportError)


def test_module_must_be_the_mirrored_name():
    with pytest.raises(ValueError, match=r"module must be .*under package 'fla'.*got 'fastarch\.compat\.fla'"):
        missing_attribute("fla", "fastarch.compat.fla")
    with pytest.raises(TypeError, match=r"error must be a NotProvidedError subclass, got <class 'KeyError'>"):
        missing_attribute("fla", "fla.ops", error=KeyError)


def test_provided_modules_imports_nothing():
    name = "fastarch.compat.fla.ops.kda.chunk"
    saved = sys.modules.pop(name, None)
    try:
        found = provided_modules("fla")
        assert name not in sys.modules
    finally:
        if saved is not None:
            sys.modules[name] = saved
    assert {"fla.ops", "fla.ops.kda", "fla.ops.kda.chunk", "fla.ops.gated_delta_rule.chunk"} <= set(found)
    assert not any(n.rpartition(".")[2].startswith("_") for n in found)
    assert provided_modules("fla.ops.kda.chunk") == []  # a module, not a package
    assert issubclass(ModuleNotProvidedError, ModuleNotFoundError) and issubclass(ModuleNotProvidedError,
                                                                                  NotProvidedError)


def test_submodule_is_imported_not_refused():
    """``from pkg import sub`` asks the package for ``sub`` before importing it: the stand-in answers with the
    submodule."""
    import sys

    import fastarch.compat.causal_conv1d as pkg

    name = "fastarch.compat.causal_conv1d.causal_conv1d_varlen"
    saved = sys.modules.pop(name, None)
    had = pkg.__dict__.pop("causal_conv1d_varlen", None)
    try:
        sub = missing_attribute("causal_conv1d", "causal_conv1d")("causal_conv1d_varlen")
        assert sub.__name__ == name and hasattr(sub, "causal_conv1d_varlen_states")
    finally:
        if saved is not None:
            sys.modules[name] = saved
        if had is not None:
            pkg.causal_conv1d_varlen = had
