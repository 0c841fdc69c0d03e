"""Mamba-2's SSD scan (:func:`fastarch.ops.ssd_scan`): forward and forward+backward per backend.

Providers: ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-torch`` (the op forced to a backend; the
torch backend is the chunked SSD algorithm in PyTorch) and ``reference`` (:func:`fastarch.ops.ssd_scan_ref`,
the sequential fp32 recurrence, only at the small sizes: it loops over L). Mamba-2's call: ``dt_bias``,
``dt_softplus``, ``D`` of shape ``(H,)``, one group of B and C, fp32 gradients of every input.

``params["mem_unit_MB"]`` is ``4 * (B·L·H·P + B·(L/chunk)·H·P·N)`` bytes, the size the backward may keep
(fp32 inputs and outputs, chunk states): forward+backward cases measure peak memory (in ``--quick`` too),
so the table shows how many such units each backend needs; a ``B·L·H·P·N`` tensor would be ``N`` times the
first term.

The headline (case set ``ssd-headline``, also in ``--full``): B=1, L=4096, H=24, P=64, N=128, chunk 256,
``fastarch-cpp`` at least 3x ``fastarch-torch``, forward and forward+backward, and the compiled backends'
forward+backward peak within ``MEMORY_UNITS`` units. ``--quick`` runs L=128, H=4,
P=16, N=32, chunk 32 with the reference; ``--full`` adds L=512 (with the reference), L=2048 and the headline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import BenchConfig, Case, MemoryBound, Provider, Ratio, Skip, Suite
from ..helpers import randn, require_backend, timed_call

BACKENDS = ("cpp", "triton", "torch")
REFERENCE_MAX_L = 1024  # the oracle loops over L in Python; its autograd graph has L steps
MEMORY_UNITS = 4  # the compiled backends' forward+backward peak, in mem_unit_MB (checked at the headline)


def _inputs(cfg: BenchConfig, b: int, L: int, h: int, p: int, n: int, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    ts = [
        randn(b, L, h, p, cfg=cfg, seed=1),
        randn(b, L, h, cfg=cfg, seed=2, scale=0.5),
        (-torch.rand(h, generator=g) * 8 - 1).to(cfg.device),  # A in [-9, -1], as Mamba2's A_init_range
        randn(b, L, 1, n, cfg=cfg, seed=3),
        randn(b, L, 1, n, cfg=cfg, seed=4),
        torch.ones(h, device=cfg.device),  # D
        (torch.rand(h, generator=g) * 4 - 6).to(cfg.device),  # dt_bias: softplus(dt) around 1e-2
    ]
    return [t.detach().requires_grad_(grad) for t in ts]


def _call(fn: Callable[..., Any], chunk: int) -> Callable[..., Any]:
    def call(x, dt, A, B, C, D, dt_bias):
        return fn(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
    return call


def _case(cfg: BenchConfig, shape: tuple[int, int, int, int, int], chunk: int, backward: bool,
          reference: bool, target: float | None = None, memory_bound: bool = False) -> Case:
    b, L, h, p, n = shape
    mode = "fwd+bwd" if backward else "fwd"

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("ssd_scan", backend, cfg.device, cfg.dtype, headdim=p, dstate=n, chunk_size=chunk)
            from fastarch.ops import ssd_scan

            run = timed_call(_call(lambda *a, **k: ssd_scan(*a, **k, backend=backend), chunk),
                             _inputs(cfg, *shape, grad=backward), backward)
            run()  # warm-up outside the timed region (extension load, first custom-op call)
            return run
        return setup

    def oracle() -> Callable[[], Any]:
        if not reference:
            raise Skip(f"the sequential oracle runs only up to L={REFERENCE_MAX_L}")
        from fastarch.ops import ssd_scan_ref

        return timed_call(_call(ssd_scan_ref, chunk), _inputs(cfg, *shape, grad=backward), backward)

    providers = [Provider(f"fastarch-{be}", "fastarch", ours(be)) for be in BACKENDS]
    if reference:
        providers.append(Provider("reference", "reference", oracle))
    nc = (L + chunk - 1) // chunk
    # within chunks: C B^T, the (chunk, chunk) mix of x, the chunk's own state and the entering state's output
    flops = 2.0 * b * nc * min(chunk, L) * (min(chunk, L) * (n + h * p) + 2 * h * p * n)
    unit_mb = 4 * (b * L * h * p + b * nc * h * p * n) / 2**20
    bounds = tuple(MemoryBound(f"fastarch-{be}", MEMORY_UNITS * unit_mb) for be in ("cpp", "triton")
                   ) if memory_bound and backward else ()
    return Case(name=f"{mode} B={b},L={L},H={h},P={p},N={n},chunk={chunk}",
                params={"B": b, "L": L, "H": h, "P": p, "N": n, "chunk": chunk, "mode": mode,
                        "mem_unit_MB": round(unit_mb, 1)},
                flops=flops * (3 if backward else 1), providers=providers,
                reference="reference" if reference else "fastarch-torch", group=mode, x="L",
                measure_memory=backward,
                ratios=(Ratio("fastarch-cpp", "fastarch-torch", target=target),), memory_bounds=bounds)


HEADLINE = (1, 4096, 24, 64, 128)


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """B=1, L=4096, H=24, P=64, N=128, G=1, chunk 256, fp32: the C++ backend against the chunked torch
    backend, forward and forward+backward (target 3x each), with the forward+backward's peak memory."""
    if cfg.toy:
        return [_case(cfg, (1, 64, 2, 8, 8), 16, bw, reference=True, target=3.0) for bw in (False, True)]
    return [_case(cfg, HEADLINE, 256, bw, reference=False, target=3.0, memory_bound=True) for bw in (False, True)]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case(cfg, (1, 32, 2, 4, 8), 8, bw, reference=True) for bw in (False, True)]
    if cfg.quick:
        return [_case(cfg, (1, 128, 4, 16, 32), 32, bw, reference=True) for bw in (False, True)]
    small = [_case(cfg, (1, 512, 8, 32, 64), 64, bw, reference=True) for bw in (False, True)]
    mid = [_case(cfg, (2, 2048, 8, 64, 64), 128, bw, reference=False) for bw in (False, True)]
    return small + mid + headline_cases(cfg)


SUITE = Suite(name="ssd", description="Mamba-2's SSD chunked scan (mamba-ssm mamba_chunk_scan_combined semantics)",
              cases=cases, case_sets={"ssd-headline": headline_cases})
