"""``python -m fastarch.ops._order_bench``: times the backends of the ops whose automatic order is
measured (:mod:`fastarch.ops._orders`) at the sizes of ``fastarch bench``, beside PyTorch's own function and
the automatic choice, and prints the ratios."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

Step = Callable[[], None]


def _cases() -> dict[str, Callable[[str], Step]]:
    """Per case, a maker of its timed step for a backend name, 'auto' (the selector's choice) or 'native'
    (the PyTorch function called directly, without fastarch)."""
    import torch.nn.functional as F

    from .attention import attention
    from .causal_conv1d import causal_conv1d
    from .layer_norm import layer_norm
    from .rms_norm import rms_norm

    def attn(L: int, causal: bool, bwd: bool, H: int = 4) -> Callable[[str], Step]:
        q, k, v = (torch.randn(1, H, L, 64, requires_grad=bwd) for _ in range(3))
        return _maker(lambda b: attention(q, k, v, causal=causal, backend=b),
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), bwd)

    def norm(fn: Callable[..., torch.Tensor], native: Callable[..., torch.Tensor], bias: bool,
             bwd: bool) -> Callable[[str], Step]:
        x = torch.randn(8192, 1024, requires_grad=bwd)
        params = [torch.randn(1024, requires_grad=bwd) for _ in range(2 if bias else 1)]
        return _maker(lambda b: fn(x, *params, backend=b), lambda: native(x, (1024,), *params), bwd)

    xc = torch.randn(2, 1024, 2048, requires_grad=True)
    wc = torch.randn(1024, 4, requires_grad=True)
    return {
        "attention full fwd B=1,H=4,L=1024,D=64": attn(1024, False, False),
        "attention causal fwd B=1,H=4,L=1024,D=64": attn(1024, True, False),
        "attention causal fwd+bwd B=1,H=4,L=512,D=64": attn(512, True, True),
        "attention full fwd+bwd B=1,H=8,L=1024,D=64": attn(1024, False, True, 8),
        "attention full fwd+bwd B=1,H=8,L=2048,D=64": attn(2048, False, True, 8),
        "attention causal fwd+bwd B=1,H=8,L=2048,D=64": attn(2048, True, True, 8),
        "layer_norm fwd rows=8192,N=1024": norm(layer_norm, F.layer_norm, True, False),
        "layer_norm fwd+bwd rows=8192,N=1024": norm(layer_norm, F.layer_norm, True, True),
        "rms_norm fwd rows=8192,N=1024": norm(rms_norm, F.rms_norm, False, False),
        "rms_norm fwd+bwd rows=8192,N=1024": norm(rms_norm, F.rms_norm, False, True),
        "causal_conv1d fwd+bwd B=2,D=1024,L=2048,W=4": _maker(
            lambda b: causal_conv1d(xc, wc, None, "silu", backend=b),
            lambda: F.silu(F.conv1d(xc, wc.unsqueeze(1), padding=3, groups=1024)[..., :2048]), True),
    }


def _maker(fn: Callable[[str | None], torch.Tensor], native: Callable[[], torch.Tensor],
           bwd: bool) -> Callable[[str], Step]:
    def make(b: str) -> Step:
        def step() -> None:
            out = native() if b == "native" else fn(None if b == "auto" else b)
            if bwd:
                out.sum().backward()

        return step

    return make


def main(argv: list[str] | None = None) -> None:
    """Time the cases on CPU for the given backends and print each one's speed relative to the first.

    The backends alternate over a few rounds and each keeps its best median, so that a noisy, shared
    machine biases none of them.
    """
    from torch.utils import benchmark

    p = argparse.ArgumentParser(prog="python -m fastarch.ops._order_bench")
    p.add_argument("--backends", default="native,aten,cpp,auto",
                   help="comma-separated backend names, 'auto' (the selector's choice) and 'native' (PyTorch's "
                        "function called directly)")
    p.add_argument("--seconds", type=float, default=0.5, help="minimum run time per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--case", default="", help="only the cases whose name contains this")
    a = p.parse_args(argv)
    names = a.backends.split(",")
    for case, make in _cases().items():
        if a.case not in case:
            continue
        steps = {b: make(b) for b in names}
        times = dict.fromkeys(names, float("inf"))
        for _ in range(a.rounds):
            for b, step in steps.items():
                step()
                t = benchmark.Timer("step()", globals={"step": step}).blocked_autorange(min_run_time=a.seconds)
                times[b] = min(times[b], t.median)
        base = times[names[0]]
        cells = ", ".join(f"{b} {t * 1e3:.2f} ms ({base / t:.2f}x)" for b, t in times.items())
        print(f"{case}: {cells}", flush=True)


if __name__ == "__main__":
    main()
