"""Attention features against the ways one would do without them (CPU fp32 first):

- ``varlen``: 16 causal sequences of random lengths summing to 8192 (H=8, D=64), packed with
  ``cu_seqlens`` (``fastarch-varlen``), against padding every sequence to the longest with a key padding
  mask (``fastarch-padded``) and against SDPA on the packed sequence with a dense block-diagonal causal
  mask (``sdpa-blockdiag``, the baseline);
- ``decode``: one query token against a cache (B=8, H=8, D=64, cache 8192): fastarch against SDPA;
- ``paged``: the same decode step reading the cache through a block table of 16-token pages
  (``fastarch-paged``) against the contiguous cache with per-batch lengths (``fastarch-contiguous``,
  the baseline);
- ``softcap`` / ``alibi``: causal forward (B=1, H=8, L=2048, D=64) with soft-capping or ALiBi against the
  plain kernel (``fastarch-plain``, the baseline);
- ``sinks``: gpt-oss's attention sinks on a causal window of 128 (B=1, H=8, L=4096, D=64): fastarch with and
  without ``sinks=`` against the eager composition with a sink column (``eager-sinks``, the baseline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Suite
from ..flops import attention_flops
from ..helpers import fastarch_op, randn


def _nograd(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return fn()
    return run


def _lengths(total: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g) + 0.25
    lens = (w / w.sum() * total).floor().long()
    lens[0] += total - int(lens.sum())
    return lens.tolist()


def _varlen_case(cfg: BenchConfig, total: int, n: int, H: int, D: int) -> Case:
    lens = _lengths(total, n, 7)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=cfg.device)

    def packed() -> Callable[[], Any]:
        attention = fastarch_op("attention")
        q, k, v = (randn(total, H, D, cfg=cfg, seed=s) for s in (1, 2, 3))
        return _nograd(lambda: attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         max_seqlen_q=max(lens), max_seqlen_k=max(lens)))

    def padded() -> Callable[[], Any]:
        attention = fastarch_op("attention")
        L = max(lens)
        q, k, v = (randn(n, H, L, D, cfg=cfg, seed=s) for s in (1, 2, 3))
        kpm = torch.arange(L, device=cfg.device)[None, :] < torch.tensor(lens, device=cfg.device)[:, None]
        return _nograd(lambda: attention(q, k, v, causal=True, key_padding_mask=kpm))

    def blockdiag() -> Callable[[], Any]:
        q, k, v = (randn(1, H, total, D, cfg=cfg, seed=s) for s in (1, 2, 3))
        seq = torch.repeat_interleave(torch.arange(n, device=cfg.device), torch.tensor(lens, device=cfg.device))
        pos = torch.arange(total, device=cfg.device)
        mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
        return _nograd(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    flops = sum(attention_flops(1, H, L, L, D, causal=True, mode="fwd") for L in lens)
    return Case(
        name=f"varlen causal fwd n={n},total={total},H={H},D={D}",
        params={"n": n, "total": total, "H": H, "D": D, "feature": "varlen"},
        flops=flops,
        providers=[Provider("fastarch-varlen", "fastarch", packed), Provider("fastarch-padded", "fastarch", padded),
                   Provider("sdpa-blockdiag", "torch", blockdiag)],
        reference="sdpa-blockdiag",
        group="varlen",
        x="total",
    )


def _decode_case(cfg: BenchConfig, B: int, H: int, Lk: int, D: int) -> Case:
    def inputs():
        return randn(B, H, 1, D, cfg=cfg, seed=1), randn(B, H, Lk, D, cfg=cfg, seed=2), randn(B, H, Lk, D, cfg=cfg,
                                                                                             seed=3)

    def fastarch(backend: str | None) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            q, k, v = inputs()
            return _nograd(lambda: attention(q, k, v, backend=backend))
        return setup

    def sdpa() -> Callable[[], Any]:
        q, k, v = inputs()
        return _nograd(lambda: F.scaled_dot_product_attention(q, k, v))

    return Case(
        name=f"decode fwd B={B},H={H},Lk={Lk},D={D}",
        params={"B": B, "H": H, "Lk": Lk, "D": D, "feature": "decode"},
        flops=attention_flops(B, H, 1, Lk, D, causal=False, mode="fwd"),
        providers=[Provider("fastarch", "fastarch", fastarch(None)), Provider("fastarch-cpp", "fastarch", fastarch("cpp")),
                   Provider("sdpa", "torch", sdpa)],
        reference="sdpa",
        group="decode",
        x="Lk",
    )


def _paged_case(cfg: BenchConfig, B: int, H: int, Lk: int, D: int, page: int) -> Case:
    seqlens = torch.full((B,), Lk, dtype=torch.int32, device=cfg.device)

    def contiguous() -> Callable[[], Any]:
        attention = fastarch_op("attention")
        q = randn(B, 1, H, D, cfg=cfg, seed=1)
        k, v = randn(B, Lk, H, D, cfg=cfg, seed=2), randn(B, Lk, H, D, cfg=cfg, seed=3)
        return _nograd(lambda: attention(q, k, v, layout="blhd", causal=True, seqlens_k=seqlens))

    def paged() -> Callable[[], Any]:
        attention = fastarch_op("attention")
        n = Lk // page
        q = randn(B, 1, H, D, cfg=cfg, seed=1)
        k, v = randn(B * n, page, H, D, cfg=cfg, seed=2), randn(B * n, page, H, D, cfg=cfg, seed=3)
        g = torch.Generator().manual_seed(5)
        table = torch.randperm(B * n, generator=g).view(B, n).to(torch.int32).to(cfg.device)
        return _nograd(lambda: attention(q, k, v, layout="blhd", causal=True, seqlens_k=seqlens, block_table=table))

    return Case(
        name=f"paged decode fwd B={B},H={H},Lk={Lk},D={D},page={page}",
        params={"B": B, "H": H, "Lk": Lk, "D": D, "page": page, "feature": "paged"},
        flops=attention_flops(B, H, 1, Lk, D, causal=False, mode="fwd"),
        providers=[Provider("fastarch-paged", "fastarch", paged), Provider("fastarch-contiguous", "fastarch", contiguous)],
        reference="fastarch-contiguous",
        group="paged",
        x="Lk",
    )


def _score_mod_case(cfg: BenchConfig, B: int, H: int, L: int, D: int) -> Case:
    def run(**kw: Any) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            q, k, v = (randn(B, H, L, D, cfg=cfg, seed=s) for s in (1, 2, 3))
            if kw.get("alibi_slopes") is not None:
                kw["alibi_slopes"] = torch.rand(H, generator=torch.Generator().manual_seed(2)).to(cfg.device)
            return _nograd(lambda: attention(q, k, v, causal=True, backend="cpp" if not cfg.is_cuda else None, **kw))
        return setup

    return Case(
        name=f"softcap/alibi causal fwd B={B},H={H},L={L},D={D}",
        params={"B": B, "H": H, "L": L, "D": D, "feature": "score_mod"},
        flops=attention_flops(B, H, L, L, D, causal=True, mode="fwd"),
        providers=[Provider("fastarch-plain", "fastarch", run()),
                   Provider("fastarch-softcap", "fastarch", run(softcap=30.0)),
                   Provider("fastarch-alibi", "fastarch", run(alibi_slopes=True))],
        reference="fastarch-plain",
        group="score_mod",
        x="L",
    )


def _sinks_case(cfg: BenchConfig, B: int, H: int, L: int, D: int, window: int) -> Case:
    """gpt-oss's attention sinks (one logit per head in every row's softmax denominator) on a causal sliding
    window: fastarch with ``sinks=`` against fastarch without them (the cost of the sinks) and against the
    eager composition gpt-oss's own code runs (scores with a sink column, softmax, drop the column)."""
    q, k, v = (randn(B, H, L, D, cfg=cfg, seed=s) for s in (1, 2, 3))
    sinks = randn(H, cfg=cfg, seed=4)

    def fastarch(with_sinks: bool) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            kw = {"sinks": sinks} if with_sinks else {}
            return _nograd(lambda: attention(q, k, v, causal=True, window=(window, 0), **kw))
        return setup

    def eager() -> Callable[[], Any]:
        i = torch.arange(L, device=cfg.device)
        visible = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)
        bias = torch.zeros(L, L, device=cfg.device).masked_fill(~visible, float("-inf"))

        def run() -> Any:
            scores = (q @ k.transpose(-1, -2)) * D ** -0.5 + bias
            scores = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
            probs = torch.softmax(scores - scores.amax(-1, keepdim=True), dim=-1)[..., :-1]
            return probs @ v
        return _nograd(run)

    return Case(
        name=f"sinks window causal fwd B={B},H={H},L={L},D={D},w={window}",
        params={"B": B, "H": H, "L": L, "D": D, "window": window, "feature": "sinks"},
        flops=attention_flops(B, H, L, L, D, window=(window, 0), mode="fwd"),
        providers=[Provider("fastarch-sinks", "fastarch", fastarch(True)),
                   Provider("fastarch-no-sinks", "fastarch", fastarch(False)),
                   Provider("eager-sinks", "torch", eager)],
        reference="eager-sinks",
        group="sinks",
        x="L",
    )


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_varlen_case(cfg, 256, 4, 2, 32), _decode_case(cfg, 2, 2, 128, 32), _paged_case(cfg, 2, 2, 128, 32, 16),
                _score_mod_case(cfg, 1, 2, 128, 32), _sinks_case(cfg, 1, 2, 128, 32, 16)]
    return [_varlen_case(cfg, 8192, 16, 8, 64), _decode_case(cfg, 8, 8, 8192, 64),
            _paged_case(cfg, 8, 8, 8192, 64, 16), _score_mod_case(cfg, 1, 8, 2048, 64),
            _sinks_case(cfg, 1, 8, 4096, 64, 128)]


SUITE = Suite(
    name="attention_features",
    description="varlen vs padding vs block-diagonal SDPA, decode vs SDPA, paged vs contiguous cache, "
                "softcap/ALiBi overhead, attention sinks",
    cases=cases,
)
