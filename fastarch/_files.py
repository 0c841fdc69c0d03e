"""Atomic file writes, shared by checkpoints and tokenizer files."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[Any]], None], *, binary: bool) -> Path:
    """Write ``path`` through ``write(file)`` so that a crash never leaves a half-written file.

    ``write`` fills a temporary file in the same folder; it is flushed, fsynced and renamed over ``path``,
    then the folder is fsynced so that the rename survives a power loss. The folder is created if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="\n")) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # folders cannot be opened for fsync on every platform
        pass
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
