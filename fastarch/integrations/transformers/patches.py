"""One registry of the patches :func:`~fastarch.integrations.transformers.register` makes (:data:`PATCHES`), one
function that applies them to a modeling module, one that undoes them, and the import hook that applies them
to modules imported later."""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

from .decoder import DECODER_LAYERS, GPT2_BLOCKS, _decoder_layer_forward, _gpt2_block_forward
from .kernels import KERNEL_EXCEPTIONS, KERNEL_GLOBALS, _dispatcher, _real_package, is_kernel_function
from .llama import LLAMA_MLPS, LLAMA_MODULES, _apply_rotary_pos_emb, _swiglu_mlp_forward
from .mamba import _mamba2_mixer_forward, _mamba_mixer_forward
from .norms import _NORMS, NORM_MODULES, _cpu_rms_norm_forward, _norm_forward

__all__ = ["PATCHES", "Patch"]

# -- the patches: one registry, one undo ---------------------------------------------------------------------
@dataclass(frozen=True)
class Patch:
    """One replacement :func:`register` makes: attribute ``attr`` of class ``owner`` (None: of the modeling
    module itself) in modeling module ``module`` becomes ``make(original)``. ``module="*"`` applies to every
    modeling module that has the attribute as a transformers kernel function (``kernel``). ``group`` is the
    :func:`register` keyword that enables it; ``what`` says what runs on fastarch, for :func:`report`."""

    group: str
    module: str
    owner: str | None
    attr: str
    make: Callable[[Callable], Callable]
    what: str
    kernel: bool = False


def _kernel_patch(attr: str, name: str, package: str) -> Patch:
    def make(original: Callable) -> Callable:
        return _dispatcher(original, name, _real_package(package))

    return Patch("mamba", "*", None, attr, make, f"{name} on fastarch.compat's {package} (CPU tensors; every "
                 f"device when {package} is not installed)", kernel=True)


def _norm_patch(module: str, cls: str) -> Patch:
    return Patch("mamba", module, cls, "forward", functools.partial(_norm_forward, fast=_NORMS[cls]),
                 f"{cls}.forward on fastarch.ops.{'rms_norm_gated' if 'Gated' in cls else 'rms_norm'}")


PATCHES: tuple[Patch, ...] = (
    *(_kernel_patch(attr, name, package) for attr, (name, package) in KERNEL_GLOBALS.items()),
    *(_norm_patch(modname, clsname) for modname, clsname in NORM_MODULES),
    Patch("mamba", "transformers.models.mamba.modeling_mamba", "MambaMixer", "forward", _mamba_mixer_forward,
          "MambaMixer: the CPU fp32 decode step as one fused mixer step, projections on fastarch.ops.linear"),
    Patch("mamba", "transformers.models.mamba.modeling_mamba", "MambaRMSNorm", "forward",
          _cpu_rms_norm_forward, "MambaRMSNorm.forward on fastarch.ops.rms_norm (CPU; fp32, bf16, fp16)"),
    Patch("mamba", "transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer", "forward", _mamba2_mixer_forward,
          "Mamba2Mixer: the CPU fp32 decode step as one fused mixer step, projections on fastarch.ops.linear"),
    # The hybrid families' Mamba-2 mixers compute what Mamba2Mixer does (their decode steps are tested against
    # transformers' own, family by family); FalconH1's adds multipliers and keeps transformers' step.
    *(Patch("mamba", f"transformers.models.{family}.modeling_{family}", cls, "forward", _mamba2_mixer_forward,
            f"{cls}: the CPU fp32 decode step as one fused Mamba-2 mixer step")
      for family, cls in (("bamba", "BambaMixer"), ("zamba2", "Zamba2MambaMixer"),
                          ("nemotron_h", "NemotronHMamba2Mixer"), ("granitemoehybrid", "GraniteMoeHybridMambaLayer"))),
    *(Patch("llama", modname, None, "apply_rotary_pos_emb", _apply_rotary_pos_emb,
            "apply_rotary_pos_emb on fastarch.ops.rotary_embedding (CPU; fp32, bf16, fp16)") for modname, _ in LLAMA_MODULES),
    *(Patch("llama", modname, clsname, "forward", _cpu_rms_norm_forward,
            f"{clsname}.forward on fastarch.ops.rms_norm (CPU; fp32, bf16, fp16)") for modname, clsname in LLAMA_MODULES),
    *(Patch("llama", modname, clsname, "forward", functools.partial(_decoder_layer_forward, norm_cls_name=norm),
            f"{clsname}: the CPU fp32 decode step (fastarch attention, DynamicCache) as two fused calls "
            "(fastarch.ops.decoder_qkv_step, decoder_out_step)") for modname, clsname, norm in DECODER_LAYERS),
    *(Patch("llama", modname, clsname, "forward", _gpt2_block_forward,
            f"{clsname}: the CPU fp32 decode step (fastarch attention, DynamicCache) as two fused calls "
            "(fastarch.ops.decoder_qkv_step, decoder_out_step)") for modname, clsname in GPT2_BLOCKS),
    *(Patch("llama", modname, clsname, "forward", _swiglu_mlp_forward,
            f"{clsname}: SiLU and product in place without autograd") for modname, clsname in LLAMA_MLPS),
)

# (group, owner object, attribute) -> the original value, for every patch in place.
_SAVED: dict[tuple[str, object, str], Callable] = {}
_ACTIVE_GROUPS: set[str] = set()


def _is_modeling_module(name: str) -> bool:
    return name.startswith("transformers.models.") and name.rsplit(".", 1)[-1].startswith("modeling_")


def _apply(module: types.ModuleType) -> None:
    """Apply every active patch that concerns ``module`` (a transformers modeling module)."""
    for p in PATCHES:
        if p.group not in _ACTIVE_GROUPS or p.module not in (module.__name__, "*"):
            continue
        owner = module if p.owner is None else getattr(module, p.owner, None)
        if owner is None:
            continue
        original = vars(owner).get(p.attr)
        if original is None or hasattr(original, "__fastarch_original__"):
            continue
        if p.kernel and (not is_kernel_function(original)  # not a kernel function transformers made
                         or (module.__name__, p.attr) in KERNEL_EXCEPTIONS):
            continue
        _SAVED[(p.group, owner, p.attr)] = original
        setattr(owner, p.attr, p.make(original))


def _undo(groups: set[str]) -> None:
    for key in [k for k in _SAVED if k[0] in groups]:
        _, owner, attr = key
        setattr(owner, attr, _SAVED.pop(key))


class _WrappedLoader(importlib.abc.Loader):
    """A modeling module's loader that applies the active patches once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _apply(module)

    def __getattr__(self, name: str):  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Python's import hook: modeling modules imported after :func:`register` get its patches as they load,
    so registering before or after importing a model's module gives the same result."""

    def find_spec(self, fullname, path, target=None):
        if not _is_modeling_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappedLoader(spec.loader)
                return spec
        return None


_IMPORT_HOOK = _PatchOnImport()


def _activate(groups: set[str]) -> None:
    _ACTIVE_GROUPS.update(groups)
    if _IMPORT_HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _IMPORT_HOOK)
    # The modules named by a patch are imported now (cheap next to a model); the kernel functions of every
    # other modeling module are patched when it is (or was already) imported.
    for modname in sorted({p.module for p in PATCHES if p.group in groups and p.module != "*"}):
        if importlib.util.find_spec(modname) is not None:
            importlib.import_module(modname)
    for name, module in list(sys.modules.items()):
        if module is not None and _is_modeling_module(name):
            _apply(module)
