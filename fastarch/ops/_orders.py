"""The measured automatic orders, per op and device type, fastest first.

An op not listed here uses :data:`fastarch.backend.DEFAULT_ORDER`. Each entry comes from
``python -m fastarch.ops._orders``, which times every backend that can take the cases below (forward and
backward, ``torch.utils.benchmark``, fp32) and prints the ratios; docs/backends.md records the last run.
A backend that refuses a call is skipped for it, so ``aten`` first for attention still sends windowed,
padded, biased and dropout calls to ``cpp``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from .. import backend

MEASURED_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {"cpu": ("aten", "cpp", "torch")},
    "layer_norm": {"cpu": ("aten", "cpp", "torch")},
    "rms_norm": {"cpu": ("cpp", "aten", "torch")},
    "causal_conv1d": {"cpu": ("cpp", "aten", "torch")},
}


def apply() -> None:
    """Install :data:`MEASURED_ORDER` with :func:`fastarch.backend.set_order`."""
    for op, per_device in MEASURED_ORDER.items():
        for device_type, order in per_device.items():
            backend.set_order(op, device_type, order)


def _cases() -> dict[str, Callable[[str], Callable[[], None]]]:
    from .attention import attention
    from .causal_conv1d import causal_conv1d
    from .layer_norm import layer_norm
    from .rms_norm import rms_norm

    def attn(L: int, causal: bool, bwd: bool) -> Callable[[str], Callable[[], None]]:
        q, k, v = (torch.randn(1, 4, L, 64, requires_grad=bwd) for _ in range(3))
        return _runner(lambda b: attention(q, k, v, causal=causal, backend=b), bwd)

    def norm(fn: Callable[..., torch.Tensor], bias: bool, bwd: bool) -> Callable[[str], Callable[[], None]]:
        x = torch.randn(8192, 1024, requires_grad=bwd)
        params = [torch.randn(1024, requires_grad=bwd) for _ in range(2 if bias else 1)]
        return _runner(lambda b: fn(x, *params, backend=b), bwd)

    xc = torch.randn(2, 1024, 2048, requires_grad=True)
    wc = torch.randn(1024, 4, requires_grad=True)
    return {
        "attention full fwd B=1,H=4,L=1024,D=64": attn(1024, False, False),
        "attention causal fwd B=1,H=4,L=1024,D=64": attn(1024, True, False),
        "attention causal fwd+bwd B=1,H=4,L=512,D=64": attn(512, True, True),
        "layer_norm fwd rows=8192,N=1024": norm(layer_norm, True, False),
        "layer_norm fwd+bwd rows=8192,N=1024": norm(layer_norm, True, True),
        "rms_norm fwd rows=8192,N=1024": norm(rms_norm, False, False),
        "rms_norm fwd+bwd rows=8192,N=1024": norm(rms_norm, False, True),
        "causal_conv1d fwd+bwd B=2,D=1024,L=2048,W=4": _runner(
            lambda b: causal_conv1d(xc, wc, None, "silu", backend=b), True),
    }


def _runner(fn: Callable[[str], torch.Tensor], bwd: bool) -> Callable[[str], Callable[[], None]]:
    def make(b: str) -> Callable[[], None]:
        def step() -> None:
            out = fn(b)
            if bwd:
                out.sum().backward()

        return step

    return make


def main(argv: list[str] | None = None) -> None:
    """Time the cases on CPU for the given backends and print each one's time relative to the first."""
    from torch.utils import benchmark

    p = argparse.ArgumentParser(prog="python -m fastarch.ops._orders")
    p.add_argument("--backends", default="aten,cpp")
    p.add_argument("--seconds", type=float, default=1.0, help="minimum run time per measurement")
    a = p.parse_args(argv)
    names = a.backends.split(",")
    for case, make in _cases().items():
        times = {}
        for b in names:
            step = make(b)
            step()
            times[b] = benchmark.Timer("step()", globals={"step": step}).blocked_autorange(
                min_run_time=a.seconds).median
        base = times[names[0]]
        cells = ", ".join(f"{b} {t * 1e3:.2f} ms (speed {base / t:.2f}x {names[0]}'s)" for b, t in times.items())
        print(f"{case}: {cells}")


if __name__ == "__main__":
    main()
