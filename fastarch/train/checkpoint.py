"""Atomic, safe checkpoints.

``save_checkpoint`` writes to a temporary file in the same folder, fsyncs it, then renames it over the
target, so a crash or kill mid-write leaves the previous checkpoint intact. ``load_checkpoint`` loads with
``weights_only=True``: no arbitrary code is unpickled. RNG states are stored as tensors and plain tuples,
which that loader accepts.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

from .._files import atomic_write

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]

_CKPT_RE = re.compile(r"^ckpt-(\d+)\.pt$")


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename, fsync of the folder)."""
    return atomic_write(path, lambda f: torch.save(state, f), binary=True)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` without unpickling code."""
    return torch.load(path, map_location=map_location, weights_only=True)


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The ``ckpt-<step>.pt`` with the highest step in ``folder`` (temporary files are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in folder.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return best[1] if best else None


def rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
