"""Optimizer step: fastarch's AdamW (fused C++ kernel, foreach) against torch's own AdamW (foreach, fused).

Providers per case (one timed iteration = one ``optimizer.step()`` on gradients that stay fixed):

- ``fastarch-fused``: :class:`fastarch.optim.AdamW` with ``fused=True`` (``csrc/cpu/adam.cpp``; CPU only);
- ``fastarch-foreach``: the same optimizer on PyTorch's ``_foreach_*`` ops;
- ``torch-foreach`` / ``torch-fused``: ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)`` (torch's
  fused AdamW has a CPU kernel since 2.4). Speedups are measured against ``torch-fused``.

Cases are parameter sets shaped like real models: a GPT-style transformer (embedding, per layer two
LayerNorms, QKV, output projection and MLP weights with biases; ~150 tensors, 25M parameters in --full) and
a many-small-tensors model (thousands of tensors of a few hundred elements, where per-tensor overheads
dominate). ``bytes`` is the minimum traffic of a one-pass update (read p, g, m, v; write p, m, v).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite

LR, WD = 1e-3, 0.01


def transformer_shapes(d: int, layers: int, vocab: int, ctx: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-style model: 12 tensors per layer plus embeddings and a final LayerNorm."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def small_shapes(n: int) -> list[tuple[int, ...]]:
    """``n`` tensors of 64..1023 elements (deterministic sizes), e.g. many small heads, adapters or norms."""
    return [(64 + (i * 379) % 960,) for i in range(n)]


def _params(shapes: list[tuple[int, ...]], cfg: BenchConfig) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(cfg.seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(cfg.device, cfg.dtype))
        p.grad = torch.randn(s, generator=g).to(cfg.device, cfg.dtype)
        ps.append(p)
    return ps


def _setup(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], shapes: list[tuple[int, ...]],
           cfg: BenchConfig) -> Callable[[], Any]:
    opt = make(_params(shapes, cfg))
    opt.step()  # builds the state (and the extension, for fused) outside the timed region
    return opt.step


def _fastarch(fused: bool, shapes: list[tuple[int, ...]], cfg: BenchConfig) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from fastarch import optim

        if fused:
            if cfg.is_cuda:
                raise Skip("the fused kernel is CPU only")
            if not optim.fused_available():
                raise Skip("adam extension unavailable")
            return _setup(lambda ps: optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True), shapes, cfg)
        return _setup(lambda ps: optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True), shapes, cfg)
    return setup


def _torch(fused: bool, shapes: list[tuple[int, ...]], cfg: BenchConfig) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        kw = {"fused": True} if fused else {"foreach": True}
        try:
            return _setup(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, **kw), shapes, cfg)
        except RuntimeError as exc:  # e.g. a torch without a fused kernel for this device
            raise Skip(str(exc).splitlines()[0][:200]) from None
    return setup


def _case(name: str, shapes: list[tuple[int, ...]], cfg: BenchConfig, group: str,
          target: float | None = None) -> Case:
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    providers = [
        Provider("fastarch-fused", "fastarch", _fastarch(True, shapes, cfg)),
        Provider("fastarch-foreach", "fastarch", _fastarch(False, shapes, cfg)),
        Provider("torch-foreach", "torch", _torch(False, shapes, cfg)),
        Provider("torch-fused", "torch", _torch(True, shapes, cfg)),
    ]
    return Case(name=name, params={"params": n, "tensors": len(shapes)}, flops=None, providers=providers,
                reference="torch-fused", bytes=float(7 * n * elt), group=group, x="params",
                ratios=(Ratio("fastarch-fused", "fastarch-foreach"), Ratio("fastarch-fused", "torch-foreach"),
                        Ratio("fastarch-fused", "torch-fused", target=target)))


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """The fused C++ AdamW step against torch.optim.AdamW (foreach and fused) and fastarch's foreach step:
    a 24.6M-parameter GPT-style model in 148 tensors, and 5000 small tensors (bar: faster than torch's
    fused step in both). With several threads other processes on a shared machine slow the foreach paths
    most (one parallel region per tensor per op, where the fused kernel opens one): compare with
    ``--threads 1`` too."""
    if cfg.toy:
        return [_case("AdamW gpt d=32 L=2", transformer_shapes(32, 2, 256, 64), cfg, "transformer", 1.0)]
    return _headline(cfg, target=1.0)


def _headline(cfg: BenchConfig, target: float | None) -> list[Case]:
    return [
        _case("AdamW gpt d=384 L=12 (24.6M params, 148 tensors)", transformer_shapes(384, 12, 8192, 512), cfg,
              "transformer", target),
        _case("AdamW 5000 small tensors", small_shapes(5000), cfg, "small tensors", target),
    ]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case("AdamW gpt d=32 L=2", transformer_shapes(32, 2, 256, 64), cfg, "transformer"),
                _case("AdamW 200 small tensors", small_shapes(200), cfg, "small tensors")]
    if cfg.quick:
        # Small enough that the foreach steps stay well under a second on 2 cores (on a loaded machine torch's
        # fused step, one parallel region per tensor, can still take seconds: that is what it measures).
        return [_case("AdamW gpt d=64 L=12 (0.9M params, 148 tensors)", transformer_shapes(64, 12, 4096, 256),
                      cfg, "transformer"),
                _case("AdamW 500 small tensors", small_shapes(500), cfg, "small tensors")]
    return [_case("AdamW gpt d=128 L=12", transformer_shapes(128, 12, 8192, 512), cfg, "transformer"),
            _case("AdamW gpt d=256 L=12", transformer_shapes(256, 12, 8192, 512), cfg, "transformer"),
            *_headline(cfg, target=None),
            _case("AdamW 1000 small tensors", small_shapes(1000), cfg, "small tensors")]


SUITE = Suite(
    name="optim",
    description="AdamW step: fastarch fused C++ kernel and foreach vs torch.optim.AdamW foreach and fused",
    cases=cases,
    case_sets={"optim-headline": headline_cases},
)
