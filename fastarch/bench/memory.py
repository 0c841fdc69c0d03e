"""Peak memory of one provider call, over the memory it holds before the call.

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory allocated
  before the call (inputs, saved weights), measured in the benchmark process itself.
- CPU: measured in a fresh subprocess per suite (``python -m fastarch.bench.memory``), which rebuilds the
  suite's cases and, for each (case, provider): runs ``setup()`` and one warm-up call, resets the kernel's
  peak-RSS counter (writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current RSS),
  reads ``VmRSS`` as the baseline, runs one call, and reports ``VmHWM - baseline``. The child runs with
  glibc's mmap threshold pinned at 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so every tensor-sized buffer is
  its own mapping that is returned to the OS when freed: RSS then tracks live buffers and memory freed by
  an earlier call is not silently reused (which would hide it from the peak). Resolution is a page; small
  Python objects are noise well under 1 MB. When ``clear_refs`` is not writable the peak falls back to
  the process's lifetime ``VmHWM`` (reported with method ``rss-hwm-unreset``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["cuda_peak_bytes", "measure_cpu_in_subprocess", "reset_rss_peak", "read_status_kb"]

_PKG_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds the fastarch package


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak CUDA memory allocated during one call of ``fn`` over what was allocated before it."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def read_status_kb(field: str) -> int:
    """A ``kB`` field (``VmRSS``, ``VmHWM``) of ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no field {field}")


def reset_rss_peak() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["MALLOC_TRIM_THRESHOLD_"] = "0"
    tun = "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0"
    env["GLIBC_TUNABLES"] = f"{env['GLIBC_TUNABLES']}:{tun}" if env.get("GLIBC_TUNABLES") else tun
    paths = [str(_PKG_ROOT), os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def measure_cpu_in_subprocess(
    module: str,
    *,
    quick: bool,
    dtype: torch.dtype,
    toy: bool,
    items: Sequence[tuple[str, str]],
    timeout_s: float | None = None,
    case_set: str | None = None,
) -> dict[tuple[str, str], dict[str, Any]]:
    """Peak RSS over baseline for each ``(case name, provider name)`` of the suite in ``module`` (of its
    case set ``case_set`` when given).

    Returns ``{(case, provider): {"bytes": int | None, "status": "ok" | "skipped" | "error",
    "note": str, "method": str}}``. A child that dies (a crash, out of memory) marks the item it was on
    as an error and a new child takes the remaining items.
    """
    pending = list(items)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    while pending:
        cmd = [
            sys.executable, "-m", "fastarch.bench.memory", "--module", module,
            "--dtype", str(dtype).replace("torch.", ""), "--items", json.dumps(pending),
        ]
        if not quick:
            cmd.append("--full")
        if toy:
            cmd.append("--toy")
        if case_set:
            cmd += ["--case-set", case_set]
        limit = timeout_s if timeout_s is not None else 60.0 + 20.0 * len(pending)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=limit)
            stdout, rc, err = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc, err = -9, f"timed out after {limit:.0f} s"
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            out[(rec["case"], rec["provider"])] = rec
        done = [it for it in pending if tuple(it) in out]
        rest = [it for it in pending if tuple(it) not in out]
        if rest and (rc != 0 or not done):
            # The child died on rest[0] (or never started): record why and go on with the others.
            tail = (err or "").strip().splitlines()
            why = tail[-1] if tail else f"exit code {rc}"
            out[tuple(rest[0])] = {"bytes": None, "status": "error", "note": f"memory child: {why}",
                                   "method": "rss"}
            rest = rest[1:]
        pending = rest
    return out


def _child(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastarch.bench.memory")
    ap.add_argument("--module", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--toy", action="store_true")
    ap.add_argument("--items", required=True, help="JSON list of [case, provider]")
    ap.add_argument("--case-set", default=None)
    a = ap.parse_args(argv)

    import importlib

    from .core import BenchConfig, Skip

    suite = importlib.import_module(a.module).SUITE
    cfg = BenchConfig(quick=not a.full, device=torch.device("cpu"), dtype=getattr(torch, a.dtype), toy=a.toy)
    cases = {c.name: c for c in suite.cases_for(cfg, a.case_set)}
    for case_name, prov_name in json.loads(a.items):
        rec: dict[str, Any] = {"case": case_name, "provider": prov_name, "bytes": None, "method": "rss"}
        try:
            case = cases[case_name]
            prov = next(p for p in case.providers if p.name == prov_name)
            fn = prov.setup()
            fn()  # warm-up: lazy builds, .grad buffers, thread pools
            gc.collect()
            ok = reset_rss_peak()
            base = read_status_kb("VmRSS")
            fn()
            peak = read_status_kb("VmHWM")
            rec.update(bytes=max(0, peak - base) * 1024, status="ok", note="",
                       method="rss" if ok else "rss-hwm-unreset")
            del fn
        except Skip as exc:
            rec.update(status="skipped", note=str(exc) or "skipped")
        except Exception as exc:  # recorded, the other items go on
            rec.update(status="error", note=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        gc.collect()
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
