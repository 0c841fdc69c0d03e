"""The measured automatic orders, per op and device type, fastest first.

An op not listed here uses :data:`fastarch.backend.DEFAULT_ORDER`. Each entry comes from
``python -m fastarch.ops._order_bench``, which times the backends at the sizes of
``fastarch bench`` (fp32, ``torch.utils.benchmark``) beside PyTorch's own function and the automatic choice,
and prints the ratios; docs/backends.md records the last run.
A backend that refuses a call is skipped for it: ``aten`` first for layer_norm still sends the unbiased
variant to ``cpp``.
"""

from __future__ import annotations

from .. import backend

MEASURED_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"cpu": ("cpp", "aten", "torch")},
    "layer_norm": {"cpu": ("aten", "cpp", "torch")},
    "rms_norm": {"cpu": ("cpp", "aten", "torch")},
    "causal_conv1d": {"cpu": ("cpp", "aten", "torch")},
    "linear": {"cpu": ("cpp", "aten", "torch")},
}


def apply() -> None:
    """Install :data:`MEASURED_ORDER` with :func:`fastarch.backend.set_order`."""
    for op, per_device in MEASURED_ORDER.items():
        for device_type, order in per_device.items():
            backend.set_order(op, device_type, order)
