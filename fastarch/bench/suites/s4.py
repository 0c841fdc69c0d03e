"""S4 (S4D): the fused Vandermonde kernel generation and the whole layer in convolution mode.

Cases:

- ``s4_kernel fwd`` / ``fwd+bwd`` (H channels, N = d_state/2 complex states, length L):
  :func:`fastarch.ops.s4_kernel` per backend; ``reference`` builds the explicit (H, N, L) Vandermonde
  matrix (:func:`s4_kernel_ref`, complex128; skipped when that exceeds 2^23 elements);
- ``S4Layer fwd`` (B=1, d_model=H, d_state=64): :class:`fastarch.nn.S4Layer` in convolution mode (kernel +
  FFT convolution) against the seed guide's ``S4Layer`` (a Python loop over time, the reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fastarch.testing import guides

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import fastarch_op, randn, require_backend, timed_call

BACKENDS = ("cpp", "triton", "torch")


GuideS4Layer = guides.S4Layer


def _system(cfg: BenchConfig, h: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 11)
    dt = torch.exp(torch.rand(h, 1, generator=g) * math.log(100) + math.log(1e-3))
    a = torch.complex(-0.5 * torch.ones(h, n), math.pi * torch.arange(n, dtype=torch.float32).expand(h, n))
    coef = torch.complex(torch.randn(h, n, generator=g), torch.randn(h, n, generator=g))
    return (a * dt).to(cfg.device), coef.to(cfg.device)


def _kernel_case(cfg: BenchConfig, h: int, n: int, L: int, backward: bool) -> Case:
    mode = "fwd+bwd" if backward else "fwd"

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        dta, coef = _system(cfg, h, n)
        return timed_call(fn, (dta.requires_grad_(backward), coef.requires_grad_(backward)), backward)

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("s4_kernel")
            require_backend("s4_kernel", backend, cfg.device, torch.float32, n=n, L=L)
            return timed(lambda a, c: op(a, c, L, backend=backend))
        return setup

    def reference() -> Callable[[], Any]:
        if h * n * L > 1 << 23:
            raise Skip("explicit (H, N, L) complex128 Vandermonde too large (> 2^23 elements)")
        from fastarch.ops.s4_kernel import s4_kernel_ref

        return timed(lambda a, c: s4_kernel_ref(a, c, L))

    providers = [Provider(f"fastarch-{b}", "fastarch", ours(b)) for b in BACKENDS]
    providers.append(Provider("reference", "reference", reference))
    return Case(name=f"s4_kernel {mode} H={h},N={n},L={L}", params={"H": h, "N": n, "L": L, "mode": mode},
                flops=8.0 * h * n * L * (3 if backward else 1), providers=providers,
                group=f"s4_kernel {mode}", x="L")


def _conv_case(cfg: BenchConfig, h: int, n: int, L: int, b: int = 1) -> Case:
    """ops.ssm_convolution (kernel + FFT convolution, no grad) against its float64 oracle."""
    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dta, coef = _system(cfg, h, n)
        return randn(b, h, L, cfg=cfg, seed=2).float(), dta, coef

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("ssm_convolution")
            require_backend("s4_kernel", backend, cfg.device, torch.float32, n=n, L=L)
            u, dta, coef = inputs()

            def run() -> Any:
                with torch.no_grad():
                    return op(u, dta, coef, backend=backend)
            return run
        return setup

    def reference() -> Callable[[], Any]:
        if h * n * L > 1 << 23:
            raise Skip("explicit (H, N, L) complex128 Vandermonde too large (> 2^23 elements)")
        from fastarch.ops.ssm_convolution import ssm_convolution_ref

        u, dta, coef = inputs()
        return lambda: ssm_convolution_ref(u, dta, coef)

    providers = [Provider(f"fastarch-{bk}", "fastarch", ours(bk)) for bk in BACKENDS]
    providers.append(Provider("reference", "reference", reference))
    return Case(name=f"ssm_convolution fwd B={b},H={h},N={n},L={L}",
                params={"B": b, "H": h, "N": n, "L": L, "mode": "conv fwd"}, flops=None,
                providers=providers, group=f"ssm_convolution fwd H={h}", x="L")


def _layer_case(cfg: BenchConfig, h: int, L: int, b: int = 1, d_state: int = 64) -> Case:
    def x() -> torch.Tensor:
        return randn(b, L, h, cfg=cfg, seed=1)

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("s4_kernel", backend, cfg.device, torch.float32, n=d_state // 2, L=L)
            from fastarch.nn import S4Layer

            layer = S4Layer(h, d_state, dropout=0.0, backend=backend).to(cfg.device, cfg.dtype).eval()
            inp = x()

            def run() -> Any:
                with torch.no_grad():
                    return layer(inp)
            return run
        return setup

    def guide() -> Callable[[], Any]:
        layer = guides.S4Layer(h, d_state, dropout=0.0).to(cfg.device, cfg.dtype).eval()
        inp = x()

        def run() -> Any:
            with torch.no_grad():
                return layer(inp)
        return run

    providers = [Provider(f"fastarch-{bk}", "fastarch", ours(bk)) for bk in BACKENDS]
    providers.append(Provider("reference", "reference", guide))
    return Case(name=f"S4Layer fwd B={b},d_model={h},d_state={d_state},L={L}",
                params={"B": b, "H": h, "N": d_state, "L": L, "mode": "layer fwd"}, flops=None,
                providers=providers, group=f"S4Layer fwd d_model={h}", x="L")


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_kernel_case(cfg, 4, 8, 256, False), _conv_case(cfg, 4, 8, 256), _layer_case(cfg, 8, 128)]
    if cfg.quick:
        return [_kernel_case(cfg, 64, 32, 2048, False), _kernel_case(cfg, 32, 32, 512, True),
                _conv_case(cfg, 64, 32, 2048), _layer_case(cfg, 64, 512)]
    out = [_kernel_case(cfg, 256, 32, L, bw) for L in (1024, 4096, 16384) for bw in (False, True)]
    out += [_conv_case(cfg, h, 32, L) for h in (64, 256) for L in (1024, 16384)]
    out += [_layer_case(cfg, h, L) for h in (64, 256) for L in (1024, 4096, 16384)]
    return out


def _headline_layer_case(cfg: BenchConfig, h: int, L: int, d_state: int = 64) -> Case:
    def run(part: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            torch.manual_seed(cfg.seed)
            if part == "reference":
                layer = guides.S4Layer(h, d_state, dropout=0.0)
            else:
                from fastarch.nn import S4Layer

                layer = S4Layer(h, d_state, dropout=0.0)
            layer = layer.to(cfg.device, cfg.dtype).eval()
            fn = layer.ssm if part == "fastarch-ssm" else layer
            return timed_call(fn, [randn(1, L, h, cfg=cfg, seed=1)], False)
        return setup

    parts = ("fastarch-ssm", "fastarch-layer", "reference")
    return Case(name=f"S4 conv mode fwd d_model={h},d_state={d_state},L={L}",
                params={"B": 1, "H": h, "N": d_state, "L": L}, flops=None,
                providers=[Provider(p, "reference" if p == "reference" else "fastarch", run(p)) for p in parts],
                group="S4 conv mode fwd", x="H",
                ratios=(Ratio("fastarch-ssm", "reference", target=20.0), Ratio("fastarch-layer", "reference")))


def _headline_kernel_case(cfg: BenchConfig, h: int, L: int, d_state: int = 64) -> Case:
    def run(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("s4_kernel", backend, cfg.device, torch.float32, n=d_state // 2, L=L)
            from fastarch.nn import S4Layer

            layer = S4Layer(h, d_state, dropout=0.0, backend=backend).to(cfg.device).eval()
            return timed_call(lambda: layer.kernel(L), (), False)
        return setup

    return Case(name=f"S4Layer.kernel d_model={h},d_state={d_state},L={L}",
                params={"H": h, "N": d_state, "L": L}, flops=None,
                providers=[Provider(f"fastarch-{b}", "fastarch", run(b)) for b in BACKENDS],
                reference="fastarch-torch", group="S4Layer.kernel", x="H",
                ratios=(Ratio("fastarch-cpp", "fastarch-torch"),))


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """S4 at L=16384, B=1, d_state=64, d_model 16 ... 256, forward in eval mode: the layer's state-space
    part in convolution mode (``S4Layer.ssm``: kernel + FFT convolution + D skip, what the guide's layer
    computes; bar: 20x the guide's loop over time) and the whole layer (plus GELU, Linear(H, 2H) and GLU,
    which the guide's layer lacks) against the guide's loop, and the kernel generation alone per backend."""
    L, widths = (256, (8, 16)) if cfg.toy else (16384, (16, 32, 64, 128, 256))
    out = [_headline_layer_case(cfg, h, L) for h in widths]
    return out + [_headline_kernel_case(cfg, h, L) for h in widths]


SUITE = Suite(name="s4", description="S4D: fused Vandermonde kernel generation and the conv-mode layer vs "
              "the guide's recurrent loop", cases=cases, case_sets={"s4-headline": headline_cases})
