"""Atomic file and directory writes, shared by checkpoints, tokenizer files and Hugging Face exports."""

from __future__ import annotations

import os
import shutil
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


def _fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # folders cannot be opened for fsync on every platform
        pass


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # no copy of a large file the new directory keeps as it was
    except OSError:
        shutil.copy2(src, dst)


def atomic_directory(path: str | os.PathLike[str], fill: Callable[[Path], None],
                     replaces: Callable[[str], bool] = lambda name: True) -> Path:
    """Create or replace the directory ``path`` with what ``fill(tmp)`` writes into a sibling temporary
    directory, renamed into place only once complete: a reader sees the old directory or the new one, never
    a half-written one, and a failure leaves the old one as it was with no temporary left behind.

    Entries of an existing ``path`` that ``fill`` did not write are carried into the new directory (hard
    links where possible) unless ``replaces(name)`` says the new content supersedes them. ``path`` must not
    be a file, a symbolic link, or the current working directory (or one holding it). Replacing is two
    renames (old aside, new in place, old removed); between them ``path`` is briefly absent, and a failure
    of the second puts the old directory back.
    """
    target = Path(os.path.abspath(path))
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"{str(target)!r} exists and is not a directory; refusing to replace it")
    cwd = Path(os.path.realpath(os.getcwd()))
    if target.exists() and (cwd == Path(os.path.realpath(target)) or Path(os.path.realpath(target)) in cwd.parents):
        # Renamed aside and removed, it would leave this process in a deleted directory.
        raise ValueError(f"{str(target)!r} is or holds the current working directory; refusing to replace it "
                         "(write to another path, or change directory first)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    aside: Path | None = None
    try:
        fill(tmp)
        written = set(os.listdir(tmp))
        if target.exists():
            for name in sorted(set(os.listdir(target)) - written):
                if replaces(name):
                    continue
                src, dst = target / name, tmp / name
                if src.is_dir() and not src.is_symlink():
                    shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
                elif src.is_symlink():
                    os.symlink(os.readlink(src), dst)
                else:
                    _link_or_copy(str(src), str(dst))
        for name in os.listdir(tmp):
            if (tmp / name).is_file() and not (tmp / name).is_symlink():
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; give it the mode mkdir would
        _fsync_dir(tmp)
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.rmdir(aside)  # a free name next to the target
            os.rename(target, aside)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(aside, target)
                aside = None
                raise
        else:
            os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return target
