"""Mamba-3's scan (:func:`fastarch.ops.mamba3_scan`, SISO): forward per backend.

Providers: ``fastarch-cpp`` (the C++ recurrence, one step at a time per (batch, head)) and ``fastarch-torch``
(the chunked form as PyTorch matrix products), the op forced to each backend, and ``reference``
(:func:`fastarch.ops.mamba3_scan_ref`, the step-by-step oracle, only at the small sizes). The call is what
``fastarch.nn.Mamba3`` makes: RMS-normed B and C in one group, per-head biases, ``D``, the gate ``Z``, chunk 64.

The headline (case set ``mamba3-headline``, also in ``--full``): the defaults of ``Mamba3(d_model=768)``: B=1,
L=4096, H=24, P=64, N=128, 32 rotary angles, fp32, the C++ backend against the torch composition (no bar
set). ``--quick`` runs L=128, H=4, P=16, N=32 with the reference; ``--full`` adds L=1024 and the headline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import randn, require_backend, timed_call

BACKENDS = ("cpp", "torch")
REFERENCE_MAX_L = 512  # the oracle loops over L in Python
CHUNK = 64


def _inputs(cfg: BenchConfig, b: int, L: int, h: int, p: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    dt = (torch.rand(b, h, L, generator=g) * 0.1 + 1e-3).to(cfg.device)
    return [
        torch.nn.functional.rms_norm(randn(b, L, 1, n, cfg=cfg, seed=1), (n,)),  # Q (C)
        torch.nn.functional.rms_norm(randn(b, L, 1, n, cfg=cfg, seed=2), (n,)),  # K (B)
        randn(b, L, h, p, cfg=cfg, seed=3),  # V (x)
        -(torch.rand(b, h, L, generator=g) * 4).to(cfg.device) * dt,  # ADT
        dt,  # DT
        randn(b, h, L, cfg=cfg, seed=4),  # Trap
        torch.ones(h, n, device=cfg.device, dtype=cfg.dtype),  # Q_bias
        torch.ones(h, n, device=cfg.device, dtype=cfg.dtype),  # K_bias
        randn(b, L, h, n // 4, cfg=cfg, seed=5).float(),  # Angles
        torch.ones(h, device=cfg.device),  # D
        randn(b, L, h, p, cfg=cfg, seed=6),  # Z
    ]


def _case(cfg: BenchConfig, shape: tuple[int, int, int, int, int], reference: bool) -> Case:
    b, L, h, p, n = shape

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("mamba3_scan", backend, cfg.device, cfg.dtype, headdim=p, dstate=n, chunk_size=CHUNK)
            from fastarch.ops import mamba3_scan

            run = timed_call(lambda *a: mamba3_scan(*a, chunk_size=CHUNK, backend=backend), _inputs(cfg, *shape),
                             False)
            run()  # warm-up outside the timed region (extension load, first call)
            return run
        return setup

    def oracle() -> Callable[[], Any]:
        if not reference:
            raise Skip(f"the step-by-step oracle runs only up to L={REFERENCE_MAX_L}")
        from fastarch.ops import mamba3_scan_ref

        return timed_call(mamba3_scan_ref, _inputs(cfg, *shape), False)

    providers = [Provider(f"fastarch-{be}", "fastarch", ours(be)) for be in BACKENDS]
    if reference:
        providers.append(Provider("reference", "reference", oracle))
    # per step and head: the state update (2 rank-1 terms) and the readout, each P x N multiply-adds
    flops = 2.0 * b * L * h * 3 * p * n
    return Case(name=f"fwd B={b},L={L},H={h},P={p},N={n}",
                params={"B": b, "L": L, "H": h, "P": p, "N": n, "chunk": CHUNK, "mode": "fwd"},
                flops=flops, providers=providers, reference="reference" if reference else "fastarch-torch",
                group="fwd", x="L", ratios=(Ratio("fastarch-cpp", "fastarch-torch"),))


HEADLINE = (1, 4096, 24, 64, 128)  # Mamba3(d_model=768): d_inner 1536 = 24 heads of 64, d_state 128


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """Mamba3(d_model=768)'s scan at B=1, L=4096, fp32: C++ against the torch chunked composition."""
    if cfg.toy:
        return [_case(cfg, (1, 32, 2, 8, 8), reference=True)]
    return [_case(cfg, HEADLINE, reference=False)]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case(cfg, (1, 16, 2, 4, 8), reference=True)]
    if cfg.quick:
        return [_case(cfg, (1, 128, 4, 16, 32), reference=True)]
    return [_case(cfg, (1, 1024, 8, 64, 64), reference=False)] + headline_cases(cfg)


SUITE = Suite(name="mamba3", description="Mamba-3's scan (mamba-ssm mamba3_siso_combined semantics), forward",
              cases=cases, case_sets={"mamba3-headline": headline_cases})
