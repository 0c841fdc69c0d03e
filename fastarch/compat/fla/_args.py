"""The arguments fla's entry points take beyond fastarch's ops: ``head_first``, keyword extras, options
fastarch refuses with a clear error rather than ignores."""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["from_head_first", "split_kwargs", "to_head_first"]

# keyword options that change the result and that fastarch does not implement: refused when set
REFUSED = frozenset({"cp_context", "allow_neg_eigval", "return_intermediate_states", "transpose_state_layout",
                     "state_v_first"})


def split_kwargs(fn: str, kwargs: dict[str, Any], accepted: tuple[str, ...] = ()) -> tuple[dict[str, Any], bool]:
    """``kwargs`` of fla's ``fn`` -> (the ``accepted`` ones, ``head_first``). ``head_first`` is deprecated in fla
    (a warning, as fla gives); an option of :data:`REFUSED` that is set raises NotImplementedError naming it;
    the options that only choose fla's kernels (``chunk_indices``, ``cu_seqlens_cpu``, ``safe_gate``,
    ``disable_recompute``, ...) and unknown ones are dropped, as fla drops them."""
    head_first = bool(kwargs.get("head_first", False))
    if "head_first" in kwargs:
        warnings.warn(f"{fn}: head_first is deprecated in fla; pass (B, T, H, ...) tensors with head_first=False",
                      DeprecationWarning, stacklevel=3)
    for name in REFUSED:
        if kwargs.get(name) not in (None, False):
            raise NotImplementedError(f"{fn}: argument '{name}' is not supported by fastarch's fla (got "
                                      f"{kwargs[name]!r}); leave it unset")
    return {k: kwargs[k] for k in accepted if k in kwargs}, head_first


def from_head_first(head_first: bool, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``(B, H, T, ...)`` inputs (``head_first``) as ``(B, T, H, ...)`` views."""
    return [t.transpose(1, 2) if head_first and t is not None else t for t in tensors]


def to_head_first(head_first: bool, o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2) if head_first else o
