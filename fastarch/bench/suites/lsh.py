"""Reformer LSH attention (shared QK, ``n_hashes=4``, ``bucket_size=64``, D=64): fastarch against the
PyTorch reference, dense SDPA and reformer-pytorch.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton``: :func:`fastarch.ops.lsh_attention` (hash, sort, chunked
  attention, round combination — the whole op);
- ``reference``: :func:`fastarch.ops.lsh_attention_ref` (gathers and dense chunk matmuls in PyTorch);
- ``sdpa-dense``: ``F.scaled_dot_product_attention(qk, qk, v)``, the O(L^2) attention the seed guide's
  ``LSHAttention`` falls back to (the crossover against it is in the ``--full`` sweep);
- ``reformer-pytorch`` (peer, if installed): ``reformer_pytorch.LSHAttention`` with the same bucket size,
  hashes and causality on ``(B*H, L, D)``.

The issue-4 bar is the ``fwd L=16384`` case on CPU (``--full``): fastarch-cpp at least 10x faster than
both reformer-pytorch and dense SDPA. ``bench/lsh_headline.py`` runs just that comparison and the crossover.
FLOPs count the chunk attention only (QK^T and PV over 2*bucket_size keys per query and round).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Skip, Suite
from ..helpers import fastarch_op, randn, require_backend, require_package

NH, BS = 4, 64


def _flops(B: int, H: int, L: int, D: int, grad: bool) -> float:
    Lp = -(-L // BS) * BS
    fwd = 4.0 * B * H * NH * Lp * 2 * BS * D
    return fwd * (3.5 if grad else 1.0)


def _runner(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], qk, v, grad: bool) -> Callable[[], Any]:
    if not grad:

        def run() -> Any:
            with torch.no_grad():
                return fn(qk, v)

        return run

    def run_bwd() -> Any:
        o = fn(qk, v)
        o.float().sum().backward()
        qk.grad = v.grad = None
        return o

    return run_bwd


def _case(cfg: BenchConfig, B: int, H: int, L: int, D: int, grad: bool, causal: bool = False) -> Case:
    mode = "fwd_bwd" if grad else "fwd"

    def inputs():
        return randn(B, H, L, D, cfg=cfg, seed=1, requires_grad=grad), randn(
            B, H, L, D, cfg=cfg, seed=2, requires_grad=grad
        )

    def fastarch_provider(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("lsh_attention")
            require_backend(
                "lsh_attention", backend, cfg.device, cfg.dtype, head_dim=D, bucket_size=BS, causal=causal
            )
            qk, v = inputs()
            return _runner(
                lambda a, b: op(a, b, n_hashes=NH, bucket_size=BS, causal=causal, seed=0, backend=backend),
                qk,
                v,
                grad,
            )

        return setup

    def ref_setup() -> Callable[[], Any]:
        ref = fastarch_op("lsh_attention_ref")
        if cfg.quick and L > 4096:
            raise Skip("the reference is slow at this length: --full only")
        qk, v = inputs()
        return _runner(
            lambda a, b: ref(a, b, n_hashes=NH, bucket_size=BS, causal=causal, seed=0), qk, v, grad
        )

    def sdpa_setup() -> Callable[[], Any]:
        if B * H * L * L * 4 > 16 * 2**30:
            raise Skip("dense scores would not fit")
        qk, v = inputs()
        return _runner(lambda a, b: F.scaled_dot_product_attention(a, a, b, is_causal=causal), qk, v, grad)

    def reformer_setup() -> Callable[[], Any]:
        rp = require_package("reformer_pytorch")
        mod = rp.LSHAttention(bucket_size=BS, n_hashes=NH, causal=causal).to(cfg.device)
        if L % (2 * BS):
            raise Skip(f"reformer-pytorch needs L divisible by 2*bucket_size ({L} % {2 * BS})")
        qk, v = inputs()

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return mod(a.reshape(B * H, L, D), b.reshape(B * H, L, D))[0]

        return _runner(fn, qk, v, grad)

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_provider(b)) for b in ("cpp", "triton")]
    providers += [
        Provider("reference", "reference", ref_setup),
        Provider("sdpa-dense", "torch", sdpa_setup),
        Provider("reformer-pytorch", "peer", reformer_setup, peer_package="reformer_pytorch"),
    ]
    return Case(
        name=f"{mode} L={L}" + (",causal" if causal else ""),
        params={"B": B, "H": H, "L": L, "D": D, "n_hashes": NH, "bucket_size": BS, "causal": causal},
        flops=_flops(B, H, L, D, grad),
        providers=providers,
        reference="reference",
        group=mode + (",causal" if causal else ""),
        x="L",
    )


def cases(cfg: BenchConfig) -> list[Case]:
    B, H, D = 1, 8, 64
    if cfg.toy:
        return [_case(cfg, 1, 2, 256, 32, False)]
    if cfg.quick:
        return [_case(cfg, B, H, 512, D, False)]
    out = [_case(cfg, B, H, L, D, False) for L in (512, 1024, 2048, 4096, 8192, 16384)]
    out += [_case(cfg, B, H, 4096, D, False, causal=True)]
    out += [_case(cfg, B, H, L, D, True) for L in (1024, 4096)]
    return out


SUITE = Suite(
    name="lsh",
    description="Reformer LSH attention (n_hashes=4, bucket_size=64): fastarch vs reference, SDPA, reformer-pytorch",
    cases=cases,
)
