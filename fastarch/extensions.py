"""Building and loading the compiled extensions in ``csrc/``.

Convention: ``csrc/cpu/NAME.cpp`` is the CPU extension ``_cpu_NAME`` and ``csrc/cuda/NAME.cu`` the CUDA
extension ``_cuda_NAME``; each is a pybind11 module. Headers shared between files live in
``csrc/cpu/include`` and ``csrc/cuda/include``.

An extension is looked up in this order:

1. built ahead of time by ``setup.py`` (``pip install --no-build-isolation .``) as the module
   ``fastarch._cpu_NAME_<hash>``, where the hash covers the sources, the shared headers, the build flags and
   the torch version: a build of other sources, flags or torch is never loaded;
2. otherwise built just in time with ninja through ``torch.utils.cpp_extension.load`` into a cache folder
   keyed by the same kind of hash. A file lock makes two processes building at once wait for one another.

Flags. Ahead-of-time builds may run on any CPU of the architecture they were built for, so they never use
``-march=native``. On x86-64 they target AVX2 and FMA, the instruction sets the hand-vectorised CPU kernels
are written for, and are loaded only on a CPU that has both (read from ``/proc/cpuinfo``, else from torch's
own CPU capability); elsewhere the just-in-time build takes over. Just-in-time builds run on the machine
that uses them and are tuned to it with ``-march=native``.

``fastarch build`` prebuilds every extension; ``fastarch info`` shows each one's status.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from .backend import ExtensionBuildError

PACKAGE_DIR = Path(__file__).resolve().parent

CPU_CFLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
CPU_LDFLAGS = ["-fopenmp"]
CUDA_CXXFLAGS = ["-O3", "-std=c++17"]
CUDA_CFLAGS = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
# Instruction sets of ahead-of-time x86-64 builds, as compiler flags and as /proc/cpuinfo flags.
X86_AOT_ISA = {"-mavx2": "avx2", "-mfma": "fma"}

_loaded: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}
_lock = threading.Lock()


def csrc_dir() -> Path | None:
    """The ``csrc`` tree: shipped inside the package by a wheel, or beside it in a source checkout."""
    for cand in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if (cand / "cpu").is_dir():
            return cand
    return None


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_cflags(ahead_of_time: bool = False) -> list[str]:
    """Flags of CPU extensions: portable ahead of time, tuned to this machine just in time."""
    if not ahead_of_time:
        return CPU_CFLAGS + ["-march=native"]
    return CPU_CFLAGS + (list(X86_AOT_ISA) if _is_x86_64() else [])


def _cpu_flags() -> list[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo``, or None where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), None)
    except OSError:
        return None


def aot_cpu_reason() -> str | None:
    """Why this CPU cannot run the ahead-of-time CPU builds, or None."""
    if not _is_x86_64():
        return None
    flags = _cpu_flags()
    if flags is None:  # torch's own dispatch level "AVX2" requires AVX2 and FMA
        has = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        missing = [] if has else list(X86_AOT_ISA.values())
    else:
        missing = [f for f in X86_AOT_ISA.values() if f not in flags]
    if missing:
        return f"the ahead-of-time build needs {' and '.join(m.upper() for m in missing)}, which this CPU lacks"
    return None


def sources(name: str, kind: str) -> list[Path]:
    root = csrc_dir()
    if root is None:
        return []
    src = root / kind / (f"{name}.cpp" if kind == "cpu" else f"{name}.cu")
    return [src] if src.exists() else []


def include_dirs(kind: str) -> list[Path]:
    root = csrc_dir()
    inc = root / kind / "include" if root is not None else None
    return [inc] if inc is not None and inc.is_dir() else []


def all_extensions() -> list[tuple[str, str]]:
    """Every (name, kind) that has a source file."""
    root = csrc_dir()
    if root is None:
        return []
    out = [(p.stem, "cpu") for p in sorted((root / "cpu").glob("*.cpp"))]
    out += [(p.stem, "cuda") for p in sorted((root / "cuda").glob("*.cu"))]
    return out


def module_name(name: str, kind: str) -> str:
    """The extension's name without the build hash, e.g. ``_cpu_attention``."""
    return f"_{kind}_{name}"


def compile_flags(kind: str, ahead_of_time: bool) -> list[str]:
    return cpu_cflags(ahead_of_time) if kind == "cpu" else CUDA_CXXFLAGS + CUDA_CFLAGS


def source_hash(name: str, kind: str, ahead_of_time: bool = False) -> str:
    """Hash of the extension's source, the shared headers of its kind, the flags and the torch version."""
    h = hashlib.sha256()
    files = sources(name, kind)
    for inc in include_dirs(kind):
        files += sorted(inc.glob("*"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join(compile_flags(kind, ahead_of_time)).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def aot_module_name(name: str, kind: str) -> str:
    """The module an ahead-of-time build of the current sources has inside ``fastarch``."""
    return f"{module_name(name, kind)}_{source_hash(name, kind, ahead_of_time=True)}"


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


def _aot_reason(name: str, kind: str) -> str | None:
    """Why the ahead-of-time build cannot be used (absent, or not for this CPU), or None."""
    if importlib.util.find_spec(f"fastarch.{aot_module_name(name, kind)}") is None:
        return "no ahead-of-time build of these sources"
    return aot_cpu_reason() if kind == "cpu" else None


def _jit_dir(name: str, kind: str) -> Path:
    return cache_dir() / f"{module_name(name, kind)}-{source_hash(name, kind)}"


def _jit_build(name: str, kind: str) -> ModuleType:
    from torch.utils import cpp_extension

    srcs = sources(name, kind)
    if not srcs:
        raise ExtensionBuildError(f"no source for extension {name!r} ({kind})")
    build_dir = _jit_dir(name, kind)
    build_dir.mkdir(parents=True, exist_ok=True)
    common = dict(
        name=f"fastarch{module_name(name, kind)}_{source_hash(name, kind)}",
        sources=[str(s) for s in srcs],
        extra_include_paths=[str(p) for p in include_dirs(kind)],
        build_directory=str(build_dir),
        verbose=os.environ.get("FASTARCH_VERBOSE_BUILD") == "1",
    )
    with FileLock(str(build_dir / ".fastarch.lock")):
        if kind == "cpu":
            return cpp_extension.load(extra_cflags=cpu_cflags(), extra_ldflags=CPU_LDFLAGS, **common)
        return cpp_extension.load(extra_cflags=CUDA_CXXFLAGS, extra_cuda_cflags=CUDA_CFLAGS, **common)


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
        mod = None
        if _aot_reason(name, kind) is None:
            try:
                mod = importlib.import_module(f"fastarch.{aot_module_name(name, kind)}")
            except ImportError:  # e.g. linked against libraries this system lacks: build here instead
                mod = None
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
    """(module, kind, status) for every extension, building none: 'loaded', 'built ahead of time', ..."""
    out = []
    for name, kind in all_extensions():
        key = module_name(name, kind)
        aot = _aot_reason(name, kind) if key not in _loaded else None
        if key in _loaded:
            st = "loaded"
        elif key in _errors:
            st = _errors[key]
        elif kind_reason(kind):
            st = f"not built: {kind_reason(kind)}"
        elif aot is None:
            st = "built ahead of time"
        elif any(_jit_dir(name, kind).glob("*.so")):
            st = "built just in time (cached)"
        elif aot.startswith("no "):
            st = "not built yet (builds on first use)"
        else:
            st = f"not built yet (builds on first use; {aot})"
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
