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

The bar is the ``fwd L=16384`` case on CPU: fastarch-cpp at least 10x faster than both reformer-pytorch and
dense SDPA. Case set ``lsh-headline`` runs just that comparison and the crossover against dense SDPA
(L = 256 ... 8192); ``lsh-phases`` times the C++ forward's phases (rotations, hash, sort, chunk attention)
apart at L=16384 by calling the extension's entry points. FLOPs count the chunk attention only (QK^T and
PV over 2*bucket_size keys per query and round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import fastarch_op, randn, require_backend, require_package, timed_call

NH, BS = 4, 64


def _flops(B: int, H: int, L: int, D: int, grad: bool) -> float:
    Lp = -(-L // BS) * BS
    fwd = 4.0 * B * H * NH * Lp * 2 * BS * D
    return fwd * (3.5 if grad else 1.0)


def _case(cfg: BenchConfig, B: int, H: int, L: int, D: int, grad: bool, causal: bool = False) -> Case:
    mode = "fwd_bwd" if grad else "fwd"

    def timed(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        qk = randn(B, H, L, D, cfg=cfg, seed=1, requires_grad=grad)
        return timed_call(fn, (qk, randn(B, H, L, D, cfg=cfg, seed=2, requires_grad=grad)), grad)

    def fastarch_provider(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("lsh_attention")
            require_backend(
                "lsh_attention", backend, cfg.device, cfg.dtype, head_dim=D, bucket_size=BS, causal=causal
            )
            return timed(lambda a, b: op(a, b, n_hashes=NH, bucket_size=BS, causal=causal, seed=0, backend=backend))

        return setup

    def ref_setup() -> Callable[[], Any]:
        ref = fastarch_op("lsh_attention_ref")
        if cfg.quick and L > 4096:
            raise Skip("the reference is slow at this length: --full only")
        return timed(lambda a, b: ref(a, b, n_hashes=NH, bucket_size=BS, causal=causal, seed=0))

    def sdpa_setup() -> Callable[[], Any]:
        if B * H * L * L * 4 > 16 * 2**30:
            raise Skip("dense scores would not fit")
        return timed(lambda a, b: F.scaled_dot_product_attention(a, a, b, is_causal=causal))

    def reformer_setup() -> Callable[[], Any]:
        rp = require_package("reformer_pytorch")
        mod = rp.LSHAttention(bucket_size=BS, n_hashes=NH, causal=causal).to(cfg.device)
        if L % (2 * BS):
            raise Skip(f"reformer-pytorch needs L divisible by 2*bucket_size ({L} % {2 * BS})")
        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return mod(a.reshape(B * H, L, D), b.reshape(B * H, L, D))[0]

        return timed(fn)

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
        ratios=(Ratio("fastarch-cpp", "reformer-pytorch"), Ratio("fastarch-cpp", "sdpa-dense")),
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


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """CPU, B=1, H=8, D=64, fp32 forward: L=16384 against reformer-pytorch and dense SDPA (bar: 10x both),
    then the crossover length against dense SDPA."""
    B, H, D = (1, 2, 32) if cfg.toy else (1, 8, 64)
    L = 512 if cfg.toy else 16384
    crossover = (256,) if cfg.toy else (256, 512, 1024, 2048, 4096, 8192)
    head = _case(cfg, B, H, L, D, False).only("fastarch-cpp", "fastarch-triton", "sdpa-dense", "reformer-pytorch")
    head = replace(head, ratios=tuple(replace(q, target=10.0) for q in head.ratios))
    return [head] + [replace(_case(cfg, B, H, n, D, False).only("fastarch-cpp", "sdpa-dense"), group="crossover")
                     for n in crossover]


def phases_cases(cfg: BenchConfig) -> list[Case]:
    """The C++ forward's phases timed apart (the extension's entry points), next to the whole op."""
    B, H, D = (1, 2, 32) if cfg.toy else (1, 8, 64)
    L = 512 if cfg.toy else 16384

    def phase(name: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("lsh_attention", "cpp", cfg.device, cfg.dtype, head_dim=D, bucket_size=BS)
            from fastarch.extensions import load_extension
            from fastarch.ops.lsh_attention import lsh_attention, lsh_n_buckets, lsh_rotations

            lib = load_extension("lsh_attention", "cpu")
            qk, v = randn(B, H, L, D, cfg=cfg, seed=1), randn(B, H, L, D, cfg=cfg, seed=2)
            nb = lsh_n_buckets(L, BS)
            rot = lsh_rotations(D, NH, nb, seed=0)
            buckets = lib.lsh_hash(qk, rot)
            perm, inv = lib.lsh_sort(buckets, BS, nb)
            calls = {
                "rotations": lambda: lsh_rotations(D, NH, nb, seed=0),
                "hash": lambda: lib.lsh_hash(qk, rot),
                "sort": lambda: lib.lsh_sort(buckets, BS, nb),
                "attention": lambda: lib.lsh_attention_fwd(qk, v, perm, inv, None, False, BS),
                "whole op": lambda: lsh_attention(qk, v, n_hashes=NH, bucket_size=BS, seed=0, backend="cpp"),
            }
            return timed_call(calls[name], (), False)
        return setup

    names = ("rotations", "hash", "sort", "attention", "whole op")
    return [Case(name=f"phases L={L}", params={"B": B, "H": H, "L": L, "D": D, "n_hashes": NH, "bucket_size": BS},
                 flops=None, providers=[Provider(n, "fastarch", phase(n)) for n in names], reference="whole op",
                 x="L")]


SUITE = Suite(
    name="lsh",
    description="Reformer LSH attention (n_hashes=4, bucket_size=64): fastarch vs reference, SDPA, reformer-pytorch",
    cases=cases,
    case_sets={"lsh-headline": headline_cases, "lsh-phases": phases_cases},
)
