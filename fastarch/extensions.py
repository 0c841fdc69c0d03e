"""Building and loading the compiled extensions in ``csrc/``.

Convention: ``csrc/cpu/NAME.cpp`` is the CPU extension ``fastarch._cpu_NAME`` and ``csrc/cuda/NAME.cu`` the
CUDA extension ``fastarch._cuda_NAME``; each is a pybind11 module. Headers shared between files live in
``csrc/cpu/include`` and ``csrc/cuda/include``.

An extension is looked up in this order:

1. built ahead of time by ``setup.py`` (``pip install --no-build-isolation .``), when the source it was
   built from is unchanged;
2. otherwise built just in time with ninja through ``torch.utils.cpp_extension.load`` into a cache keyed
   by the torch version, the build flags and a hash of the sources. torch's own file baton makes two
   processes building at once wait for one another; we add a file lock around the whole step.

``fastarch build`` prebuilds every extension; ``fastarch info`` shows each one's status.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from .backend import ExtensionBuildError

PACKAGE_DIR = Path(__file__).resolve().parent
_MANIFEST = PACKAGE_DIR / "_aot_manifest.json"

CPU_CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
CPU_LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]

_loaded: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}
_lock = threading.Lock()


def csrc_dir() -> Path | None:
    """The ``csrc`` tree: beside the package in a source checkout, or shipped inside it in a wheel."""
    for cand in (PACKAGE_DIR.parent / "csrc", PACKAGE_DIR / "_csrc"):
        if cand.is_dir():
            return cand
    return None


def _arch_flags() -> list[str]:
    # Tuned to this machine for JIT builds; FASTARCH_PORTABLE=1 drops it for builds shipped elsewhere.
    return [] if os.environ.get("FASTARCH_PORTABLE") == "1" else ["-march=native"]


def cpu_cflags() -> list[str]:
    return CPU_CFLAGS + _arch_flags()


def sources(name: str, kind: str) -> list[Path]:
    root = csrc_dir()
    if root is None:
        return []
    src = root / kind / (f"{name}.cpp" if kind == "cpu" else f"{name}.cu")
    return [src] if src.exists() else []


def all_extensions() -> list[tuple[str, str]]:
    """Every (name, kind) that has a source file."""
    root = csrc_dir()
    if root is None:
        return []
    out = [(p.stem, "cpu") for p in sorted((root / "cpu").glob("*.cpp"))]
    out += [(p.stem, "cuda") for p in sorted((root / "cuda").glob("*.cu"))]
    return out


def module_name(name: str, kind: str) -> str:
    return f"_{kind}_{name}"


def source_hash(name: str, kind: str) -> str:
    """Hash of the extension's source, the shared headers of its kind and the flags."""
    h = hashlib.sha256()
    root = csrc_dir()
    files = sources(name, kind)
    if root is not None:
        files += sorted((root / kind / "include").glob("*")) if (root / kind / "include").is_dir() else []
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    flags = cpu_cflags() if kind == "cpu" else CUDA_CFLAGS
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("FASTARCH_CACHE")
    root = Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastarch"
    tv = torch.__version__.replace("+", "_")
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"torch-{tv}-{py}"


def kind_reason(kind: str) -> str | None:
    """Why extensions of ``kind`` cannot be built here, or None."""
    if kind == "cuda":
        if torch.version.cuda is None:
            return "torch is a CPU build (no CUDA)"
        if not torch.cuda.is_available():
            return "no CUDA device"
    return None


def _aot_manifest() -> dict[str, str]:
    try:
        return json.loads(_MANIFEST.read_text())
    except (OSError, ValueError):
        return {}


def _try_aot(name: str, kind: str) -> ModuleType | None:
    modname = f"fastarch.{module_name(name, kind)}"
    built_hash = _aot_manifest().get(module_name(name, kind))
    if sources(name, kind):
        # Source checkout: only trust an ahead-of-time build of the same source.
        if built_hash is None or built_hash != source_hash(name, kind):
            return None
    try:
        return importlib.import_module(modname)
    except ImportError:
        return None


def _jit_build(name: str, kind: str) -> ModuleType:
    from torch.utils import cpp_extension

    srcs = sources(name, kind)
    if not srcs:
        raise ExtensionBuildError(f"no source for extension {name!r} ({kind})")
    digest = source_hash(name, kind)
    build_dir = cache_dir() / f"{module_name(name, kind)}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    root = csrc_dir()
    assert root is not None
    include = [str(root / kind / "include")] if (root / kind / "include").is_dir() else []
    lock_path = build_dir / ".fastarch.lock"
    try:
        from filelock import FileLock
    except ImportError:  # torch's FileBaton in cpp_extension.load still serialises the compile itself
        FileLock = None  # type: ignore[assignment]
    ctx = FileLock(str(lock_path)) if FileLock is not None else _NullCtx()
    verbose = os.environ.get("FASTARCH_VERBOSE_BUILD") == "1"
    with ctx:
        if kind == "cpu":
            return cpp_extension.load(
                name=f"fastarch{module_name(name, kind)}_{digest}",
                sources=[str(s) for s in srcs],
                extra_cflags=cpu_cflags(),
                extra_ldflags=CPU_LDFLAGS,
                extra_include_paths=include,
                build_directory=str(build_dir),
                verbose=verbose,
            )
        return cpp_extension.load(
            name=f"fastarch{module_name(name, kind)}_{digest}",
            sources=[str(s) for s in srcs],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=CUDA_CFLAGS,
            extra_include_paths=include,
            build_directory=str(build_dir),
            verbose=verbose,
        )


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def load_extension(name: str, kind: str = "cpu") -> ModuleType:
    """Return the compiled extension ``name`` of ``kind`` ('cpu' or 'cuda'), building it if needed.

    Raises :class:`ExtensionBuildError` with the compiler's last words when it cannot be had; the error is
    remembered so a failed build is attempted once per process.
    """
    key = module_name(name, kind)
    if key in _loaded:
        return _loaded[key]
    if key in _errors:
        raise ExtensionBuildError(_errors[key])
    with _lock:
        if key in _loaded:
            return _loaded[key]
        reason = kind_reason(kind)
        if reason is not None:
            _errors[key] = reason
            raise ExtensionBuildError(reason)
        mod = _try_aot(name, kind)
        if mod is None:
            try:
                mod = _jit_build(name, kind)
            except Exception as exc:
                msg = f"build of {key} failed: {_first_compiler_error(exc)}"
                _errors[key] = msg
                raise ExtensionBuildError(msg) from exc
        _loaded[key] = mod
        return mod


def _first_compiler_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    for pat in (": error:", "error:", "Error"):
        hits = [ln.strip() for ln in text if pat in ln]
        if hits:
            return hits[0][:300]
    return (text[0] if text else type(exc).__name__)[:300]


def status() -> list[tuple[str, str, str]]:
    """(module, kind, status) for every extension, building none: 'loaded', 'prebuilt', 'cached', ..."""
    out = []
    manifest = _aot_manifest()
    for name, kind in all_extensions():
        key = module_name(name, kind)
        if key in _loaded:
            st = "loaded"
        elif key in _errors:
            st = _errors[key]
        elif kind_reason(kind):
            st = f"not built: {kind_reason(kind)}"
        elif manifest.get(key) == source_hash(name, kind):
            st = "built ahead of time"
        elif (cache_dir() / f"{key}-{source_hash(name, kind)}").is_dir() and any(
            (cache_dir() / f"{key}-{source_hash(name, kind)}").glob("*.so")
        ):
            st = "built just in time (cached)"
        else:
            st = "not built yet (builds on first use)"
        out.append((key, kind, st))
    return out


def build_all(kinds: tuple[str, ...] = ("cpu", "cuda")) -> list[tuple[str, str, str]]:
    """Build every extension now; return (module, kind, 'ok' or the error)."""
    out = []
    for name, kind in all_extensions():
        if kind not in kinds:
            continue
        try:
            load_extension(name, kind)
            out.append((module_name(name, kind), kind, "ok"))
        except ExtensionBuildError as exc:
            out.append((module_name(name, kind), kind, str(exc)))
    return out
