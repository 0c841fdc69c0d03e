"""``fastarch info``: versions, devices, extension builds, and which backend can run each op."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import torch

from . import __version__, backend, extensions


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"error: {exc}"
    rel = [ln for ln in out.splitlines() if "release" in ln]
    return rel[0].split("release")[-1].strip() if rel else out.strip().splitlines()[-1]


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def devices() -> list[str]:
    out = [f"cpu: {cpu_name()}, {torch.get_num_threads()} threads, SIMD {torch.backends.cpu.get_cpu_capability()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                       f"{p.multi_processor_count} SMs")
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def capabilities_table() -> str:
    """One row per op and backend: what the implementation declares it supports."""
    keys = ["devices", "dtypes", "max_head_dim", "dropout", "bias_grad", "varlen", "deterministic", "limits"]
    rows = [["op", "backend", *keys]]
    for op in backend.ops():
        if op.startswith("_"):
            continue
        for name, impl in backend.implementations(op).items():
            caps = impl.capabilities()
            limits = ", ".join(f"{k}<={v}" for k, v in impl.limits.items()) or "-"
            cells = ["/".join(map(str, caps[k])) if isinstance(caps[k], tuple) else
                     ("-" if caps[k] is None else str(caps[k]).lower()) for k in keys[:-1]]
            rows.append([op, name, *cells, limits])
    return _table(rows)


def report(build: bool = True) -> str:
    """The whole report as text. ``build`` lets implementations load (and JIT-build) their extensions."""
    from . import ops  # noqa: F401  (registers every op)

    parts = ["fastarch info", "=" * 13]
    versions = [
        ("fastarch", __version__),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("triton", _triton_version()),
        ("CUDA runtime (torch)", torch.version.cuda or "none (CPU build)"),
        ("nvcc", _nvcc_version()),
        ("platform", platform.platform()),
    ]
    parts.append(_table([["component", "version"]] + [[a, b] for a, b in versions]))
    parts += ["", "Devices", "-------", *devices()]
    if build:
        for name, kind in extensions.all_extensions():
            if extensions.kind_reason(kind) is None:
                try:
                    extensions.load_extension(name, kind)
                except extensions.ExtensionBuildError:
                    pass
    parts += ["", "Extensions (csrc/)", "------------------"]
    ext_rows = [["module", "kind", "status"]] + [list(r) for r in extensions.status()]
    parts.append(_table(ext_rows) if len(ext_rows) > 1 else "none found")
    device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in device_types:
        parts += ["", f"Ops x backends on {dev} (float32)", "-" * 60]
        rows = [["op", "auto order", "auto choice", *backend.BACKENDS]]
        for op in backend.ops():
            if op.startswith("_"):
                continue
            avail = backend.availability(op, dev)
            cells = ["available" if not r else "; ".join(r) for r in (avail[b] for b in backend.BACKENDS)]
            order = backend.auto_order(op, dev)
            auto = next((b for b in order if not avail[b]), "-")
            rows.append([op, " > ".join(order), auto, *cells])
        parts.append(_table(rows))
    parts += ["", "Declared capabilities", "---------------------", capabilities_table()]
    parts += ["", "Override with FASTARCH_BACKEND=torch, FASTARCH_BACKEND=attention=triton,selective_scan=cpp,",
              "fastarch.use_backend(...), or backend=... on any op. Triton runs on CPU only with TRITON_INTERPRET=1."]
    return "\n".join(parts)
