"""Linear attention (Performer / FAVOR+): the causal prefix-sum kernels against the dense oracle, the
non-causal two-matmul form and performer-pytorch.

Cases (B=1, H=8, m=256 features, D=64, as the headline ``linear-attention-headline``, which runs L=4096;
quick runs L=512, full 1024/4096/8192):

- ``causal fwd`` / ``causal fwd+bwd``: :func:`fastarch.ops.linear_attention` on given positive features,
  per backend; ``fastarch-noncausal`` is the same call with ``causal=False`` (the bar: causal within 2x
  of it); ``reference`` is the dense oracle ``tril(phi_q phi_k^T) v / rowsum`` (skipped above
  L=4096, it is L^2); the peer is performer-pytorch's ``causal_linear_attention_noncuda`` (what
  ``FastAttention(causal=True)`` runs without CUDA) on the same features.
- ``favor+ causal fwd``: whole FAVOR+ attention from raw q/k/v: our feature map + op against
  ``performer_pytorch.FastAttention(dim_heads=64, nb_features=256, causal=True)``; reference = the peer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import fastarch_op, randn, require_backend, require_package, timed_call

BACKENDS = ("cpp", "triton", "torch")


def _features(cfg: BenchConfig, b: int, h: int, L: int, m: int, d: int, grad: bool) -> list[torch.Tensor]:
    # Positive features of moderate spread, like a FAVOR+ map produces.
    q = randn(b, h, L, m, cfg=cfg, seed=1).abs().mul_(0.5).detach().requires_grad_(grad)
    k = randn(b, h, L, m, cfg=cfg, seed=2).abs().mul_(0.5).detach().requires_grad_(grad)
    v = randn(b, h, L, d, cfg=cfg, seed=3, requires_grad=grad)
    return [q, k, v]


def _kernel_case(cfg: BenchConfig, L: int, backward: bool, b: int = 1, h: int = 8, m: int = 256,
                 d: int = 64) -> Case:
    mode = "fwd+bwd" if backward else "fwd"
    inputs = lambda: _features(cfg, b, h, L, m, d, backward)

    def ours(backend: str, causal: bool = True) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("linear_attention")
            if causal:
                require_backend("linear_attention", backend, cfg.device, cfg.dtype, m=m, d=d, L=L)
            return timed_call(lambda q, k, v: op(q, k, v, causal=causal, backend=backend), inputs(), backward)
        return setup

    def reference() -> Callable[[], Any]:
        if L > 4096:
            raise Skip("dense oracle is O(L^2) memory; skipped above L=4096")
        from fastarch.ops.linear_attention import linear_attention_ref

        return timed_call(lambda q, k, v: linear_attention_ref(q, k, v, causal=True), inputs(), backward)

    def performer() -> Callable[[], Any]:
        mod = require_package("performer_pytorch.performer_pytorch")
        return timed_call(mod.causal_linear_attention_noncuda, inputs(), backward)

    providers = [Provider(f"fastarch-{bk}", "fastarch", ours(bk)) for bk in BACKENDS]
    providers += [
        Provider("fastarch-noncausal", "fastarch", ours("auto", causal=False)),
        Provider("reference", "reference", reference),
        Provider("performer-pytorch", "peer", performer, peer_package="performer_pytorch"),
    ]
    # Chunked causal work: per row 2*(m*D) for q S, 2*(m*D) for the state update, plus the C x C block.
    flops = 4.0 * b * h * L * m * (d + 1) * (3 if backward else 1)
    return Case(name=f"causal {mode} B={b},H={h},L={L},m={m},D={d}",
                params={"B": b, "H": h, "L": L, "m": m, "D": d, "mode": mode}, flops=flops,
                providers=providers, group=f"causal {mode}", x="L",
                ratios=(Ratio("fastarch-noncausal", "fastarch-cpp"), Ratio("fastarch-cpp", "performer-pytorch")))


def _favor_case(cfg: BenchConfig, L: int, b: int = 1, h: int = 8, m: int = 256, d: int = 64) -> Case:
    def qkv() -> list[torch.Tensor]:
        return [randn(b, h, L, d, cfg=cfg, seed=s, scale=0.5) for s in (4, 5, 6)]

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("linear_attention")
            require_backend("linear_attention", backend, cfg.device, cfg.dtype, m=m, d=d, L=L)
            from fastarch.nn.performer import favor_plus_features, orthogonal_random_features

            w = orthogonal_random_features(m, d, device=cfg.device)

            def fn(q, k, v):
                qf = favor_plus_features(q, w, is_query=True)
                kf = favor_plus_features(k, w, is_query=False, causal=True)
                return op(qf, kf, v, causal=True, backend=backend)
            return timed_call(fn, qkv(), False)
        return setup

    def performer() -> Callable[[], Any]:
        mod = require_package("performer_pytorch.performer_pytorch")
        attn = mod.FastAttention(dim_heads=d, nb_features=m, causal=True).to(cfg.device)
        return timed_call(attn, qkv(), False)

    def reference() -> Callable[[], Any]:
        from fastarch.nn.performer import favor_plus_features, orthogonal_random_features
        from fastarch.ops.linear_attention import linear_attention_ref

        w = orthogonal_random_features(m, d, device=cfg.device)

        def fn(q, k, v):
            qf = favor_plus_features(q, w, is_query=True)
            kf = favor_plus_features(k, w, is_query=False, causal=True)
            return linear_attention_ref(qf, kf, v, causal=True)
        return timed_call(fn, qkv(), False)

    providers = [Provider(f"fastarch-{bk}", "fastarch", ours(bk)) for bk in BACKENDS]
    providers.append(Provider("reference", "reference", reference))
    providers.append(Provider("performer-pytorch", "peer", performer, peer_package="performer_pytorch"))
    return Case(name=f"favor+ causal fwd B={b},H={h},L={L},m={m},D={d}",
                params={"B": b, "H": h, "L": L, "m": m, "D": d, "mode": "favor+ fwd"}, flops=None,
                providers=providers, reference="reference", group="favor+ causal fwd", x="L",
                ratios=(Ratio("fastarch-cpp", "performer-pytorch"),))


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_kernel_case(cfg, 64, False, h=2, m=16, d=8), _favor_case(cfg, 64, h=2, m=16, d=8)]
    lengths = [512] if cfg.quick else [1024, 4096, 8192]
    out = [_kernel_case(cfg, L, False) for L in lengths]
    out += [_kernel_case(cfg, L, True) for L in (lengths if not cfg.quick else [])]
    out += [_favor_case(cfg, L) for L in lengths]
    return out


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """CPU causal linear attention at B=1, H=8, L=4096, m=256, D=64, forward and forward+backward: the C++
    kernel against performer-pytorch's non-CUDA causal path on the same features (bar: 6x) and against
    the non-causal form (bar: within 2x); whole FAVOR+ causal attention against performer-pytorch's
    ``FastAttention(causal=True)``."""
    if cfg.toy:
        return [_kernel_case(cfg, 64, g, h=2, m=16, d=8) for g in (False, True)] + [_favor_case(cfg, 64, h=2, m=16, d=8)]
    fwd = _kernel_case(cfg, 4096, False)
    fwd = replace(fwd, ratios=(replace(fwd.ratios[0], target=2.0, at_most=True), replace(fwd.ratios[1], target=6.0)))
    return [fwd, _kernel_case(cfg, 4096, True), _favor_case(cfg, 4096)]


SUITE = Suite(name="linear_attention", description="causal linear attention (FAVOR+): chunked prefix-sum "
              "kernels vs dense oracle, non-causal matmuls and performer-pytorch", cases=cases,
              case_sets={"linear-attention-headline": headline_cases})
