"""The kernel tests run on CPU tensors under the Triton interpreter. ``FASTARCH_KERNEL_TEST_DEVICE=cuda``
runs the same files with CUDA as torch's default device (and ``TRITON_INTERPRET=0``), so that the whole
grid of each launcher is checked on compiled GPU kernels too (``scripts/gpu_check.sh``)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _kernel_test_device():
    dev = os.environ.get("FASTARCH_KERNEL_TEST_DEVICE", "").strip()
    if not dev:
        yield
        return
    if dev.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(f"FASTARCH_KERNEL_TEST_DEVICE={dev}: no CUDA device")
    with torch.device(dev):
        yield
