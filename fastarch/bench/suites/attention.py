"""Full and causal attention: fastarch's backends against ``F.scaled_dot_product_attention`` and the dense
fp32 reference.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-torch``: :func:`fastarch.ops.attention` forced to each
  backend (Triton only on CUDA; the torch backend is the dense masked fp32 implementation);
- ``fastarch``: the automatic choice;
- ``sdpa``: ``F.scaled_dot_product_attention`` (speed-ups are measured against it: the issue's bar for
  CPU full/causal attention is "no slower than SDPA");
- ``reference``: :func:`fastarch.ops.attention_ref` (dense, fp32, materialises L x L).

Forward cases, and forward+backward cases (``fwd_bwd``: one forward and one backward of ``o.sum()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Suite
from ..flops import attention_flops
from ..helpers import fastarch_op, randn, require_backend

BACKENDS = ("cpp", "triton", "torch")


def _inputs(cfg: BenchConfig, B: int, H: int, L: int, D: int, grad: bool):
    return tuple(randn(B, H, L, D, cfg=cfg, seed=s, requires_grad=grad) for s in (1, 2, 3))


def _runner(fn: Callable[..., torch.Tensor], q, k, v, grad: bool) -> Callable[[], Any]:
    if not grad:
        def run() -> Any:
            with torch.no_grad():
                return fn(q, k, v)
        return run

    def run_bwd() -> Any:
        o = fn(q, k, v)
        o.sum().backward()
        q.grad = k.grad = v.grad = None
        return o
    return run_bwd


def _case(cfg: BenchConfig, B: int, H: int, L: int, D: int, causal: bool, grad: bool) -> Case:
    mode = "fwd_bwd" if grad else "fwd"

    def fastarch_provider(backend: str | None) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            if backend is not None:
                require_backend("attention", backend, cfg.device, cfg.dtype, head_dim=D, Lq=L, Lk=L)
            q, k, v = _inputs(cfg, B, H, L, D, grad)
            return _runner(lambda a, b, c: attention(a, b, c, causal=causal, backend=backend), q, k, v, grad)
        return setup

    def sdpa_setup() -> Callable[[], Any]:
        q, k, v = _inputs(cfg, B, H, L, D, grad)
        return _runner(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, grad)

    def ref_setup() -> Callable[[], Any]:
        from fastarch.ops.attention import attention_ref

        q, k, v = _inputs(cfg, B, H, L, D, grad)
        return _runner(lambda a, b, c: attention_ref(a, b, c, causal=causal), q, k, v, grad)

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_provider(b)) for b in BACKENDS]
    providers += [
        Provider("fastarch", "fastarch", fastarch_provider(None)),
        Provider("sdpa", "torch", sdpa_setup),
        Provider("reference", "reference", ref_setup),
    ]
    kind = "causal" if causal else "full"
    return Case(
        name=f"{kind} {mode} B={B},H={H},L={L},D={D}",
        params={"B": B, "H": H, "L": L, "D": D, "causal": causal, "mode": mode},
        flops=attention_flops(B, H, L, L, D, causal=causal, mode=mode),
        providers=providers,
        reference="reference",
        group=f"{kind} {mode}",
        x="L",
    )


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case(cfg, 1, 2, 64, 32, c, g) for c in (False, True) for g in (False, True)]
    if cfg.quick:
        out = [_case(cfg, 1, 4, 1024, 64, c, False) for c in (False, True)]
        out += [_case(cfg, 1, 4, 512, 64, True, True)]
        return out
    lengths = (1024, 2048, 4096) if not cfg.is_cuda else (2048, 4096, 8192)
    out = []
    for grad in (False, True):
        for causal in (False, True):
            for L in lengths:
                for D in ((64,) if not cfg.is_cuda else (64, 128)):
                    out.append(_case(cfg, 1 if not cfg.is_cuda else 4, 8, L, D, causal, grad))
    return out


SUITE = Suite(
    name="attention",
    description="full and causal attention, fwd and fwd+bwd: fastarch backends vs SDPA and the dense reference",
    cases=cases,
)
