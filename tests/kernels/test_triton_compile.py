"""Triton's code generator on the real kernels, without a GPU: each kernel family is compiled to a cubin for
sm_80 and sm_90 (the quick form of the compile scripts here) and must fit the target's shared memory.

The interpreter that runs the other Triton tests executes the kernels' logic but never this compiler, so
type rules, layouts and shared-memory use are checked only here. Each case runs in a subprocess because the
kernels in this process are the interpreter's versions (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._backends import import_triton

import_triton()

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CASES = {
    "attention": ["compile_triton_attention.py", "fp16", "--quick"],
    "lsh_attention": ["compile_triton_lsh.py", "fp16", "--quick", "--max-head-dim", "64"],
    "ssd_scan": ["compile_triton_ssd_scan.py", "fp16", "--quick"],
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("kernels", sorted(CASES))
def test_kernels_compile_and_fit_shared_memory(kernels, arch):
    script, *args = CASES[kernels]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HERE / script), *args, "--arch", str(arch)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} --arch {arch} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert " ok " in proc.stdout, proc.stdout
