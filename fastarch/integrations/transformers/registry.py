"""register(), unregister(), registered() and report()."""

from __future__ import annotations

import logging
import sys
import types

import torch
import transformers
from transformers import masking_utils
from transformers.modeling_utils import AttentionInterface

from . import patches as _patches
from .attention import attention_forward, attention_mask
from .kernels import _MISSING_KERNELS, KERNEL_EXCEPTIONS, KERNEL_GLOBALS, is_kernel_function
from .patches import PATCHES, _is_modeling_module

__all__ = ["register", "registered", "report", "unregister"]

# -- register / unregister ----------------------------------------------------------------------------------
_MISSING = object()
_LOG = logging.getLogger("fastarch.integrations.transformers")
# name -> the previous attention and mask entries register() replaced, and the patch groups it asked for.
_STATE: dict[str, dict] = {}


def register(name: str = "fastarch", *, mamba: bool = True, llama: bool = True) -> None:
    """Register fastarch's attention and mask functions with transformers as ``name`` and apply the patches
    of :data:`PATCHES`: with ``mamba=True`` every kernel function transformers resolves from ``mamba_ssm`` and
    ``causal_conv1d`` (in every modeling module, imported before or after this call) and the Mamba norms and
    mixers; with ``llama=True`` the Llama-family norms, rotary embedding and MLPs. Idempotent; undone by
    :func:`unregister`."""
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(f"register: argument 'name' must be a non-empty string other than 'eager', got {name!r}")
    if name in _STATE:
        return
    masks = masking_utils.AttentionMaskInterface
    groups = {g for g, on in (("mamba", mamba), ("llama", llama)) if on}
    state = {
        "attention": AttentionInterface._global_mapping.get(name, _MISSING),
        "mask": masks._global_mapping.get(name, _MISSING),
        "groups": groups,
    }
    _patches._activate(groups)
    AttentionInterface.register(name, attention_forward)
    masks.register(name, attention_mask)
    _STATE[name] = state
    _LOG.info("fastarch: registered %r with transformers %s; patches: %s", name, transformers.__version__,
              ", ".join(sorted(groups)) or "none")


def unregister(name: str | None = None) -> None:
    """Undo :func:`register` for ``name`` (every registered name when None): the interface entries go back to
    what they were (removed, or the function a name shadowed), and the patches no remaining name asks for
    are undone (each attribute gets its original back).
    Models still set to ``name`` must be switched (``model.set_attn_implementation("sdpa")``) before use."""
    for key in list(_STATE) if name is None else [name]:
        state = _STATE.pop(key, None)
        if state is None:
            continue
        for mapping, previous in ((AttentionInterface._global_mapping, state["attention"]),
                                  (masking_utils.AttentionMaskInterface._global_mapping, state["mask"])):
            if previous is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = previous
    still = set().union(*(s["groups"] for s in _STATE.values())) if _STATE else set()
    _patches._undo(_patches._ACTIVE_GROUPS - still)
    _patches._ACTIVE_GROUPS.intersection_update(still)
    if not _STATE and _patches._IMPORT_HOOK in sys.meta_path:
        sys.meta_path.remove(_patches._IMPORT_HOOK)


_REPORTED: set[type] = set()


def report(model: torch.nn.Module) -> str:
    """What of ``model`` runs on fastarch, module by module, and where something does not, why.

    One line for the attention implementation, one per class whose forward :func:`register` replaced (with
    the conditions under which the replacement runs), and one per kernel function of the model's modeling
    modules: on fastarch, or transformers' PyTorch path and the reason. Logged once per model class on the
    ``fastarch.integrations.transformers`` logger (INFO) as well.
    """
    lines = []
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in _STATE:
        lines.append(f"attention: fastarch ({impl!r}: fastarch.ops.attention, compact masks)")
    else:
        lines.append(f"attention: transformers' {impl!r}, not fastarch (model.set_attn_implementation("
                     f"{(registered() or ['fastarch'])[0]!r}) after register() runs it on fastarch)")
    by_owner = {(p.module, p.owner, p.attr): p for p in PATCHES}
    seen_classes: dict[type, list[str]] = {}
    modules: dict[str, types.ModuleType] = {}
    for name, sub in model.named_modules():
        cls = type(sub)
        seen_classes.setdefault(cls, []).append(name or "(model)")
        mod = sys.modules.get(cls.__module__)
        if mod is not None and _is_modeling_module(mod.__name__):
            modules[mod.__name__] = mod
    for cls, names in seen_classes.items():
        forward = vars(cls).get("forward")
        if hasattr(forward, "__fastarch_original__"):
            p = by_owner.get((cls.__module__, cls.__name__, "forward"))
            what = p.what if p is not None else "forward replaced by fastarch"
            lines.append(f"{cls.__name__} x{len(names)}: {what}")
    for modname, mod in sorted(modules.items()):
        for attr, fn in sorted(vars(mod).items()):
            if not callable(fn):
                continue
            if hasattr(fn, "__fastarch_original__") and attr in KERNEL_GLOBALS:
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: fastarch ({KERNEL_GLOBALS[attr][0]})")
            elif attr in KERNEL_GLOBALS and is_kernel_function(fn):
                why = KERNEL_EXCEPTIONS.get((modname, attr)) or (
                    "register(mamba=False)" if _STATE else "register() has not been called")
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: transformers' resolution, not fastarch ({why})")
            elif attr in _MISSING_KERNELS and is_kernel_function(fn):
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: transformers' PyTorch path: fastarch has no "
                             f"{_MISSING_KERNELS[attr]} yet")
    text = "\n".join(lines)
    if type(model) not in _REPORTED:
        _REPORTED.add(type(model))
        _LOG.info("fastarch: %s\n%s", type(model).__name__, text)
    return text


def registered() -> list[str]:
    """The names currently registered by :func:`register`."""
    return sorted(_STATE)
