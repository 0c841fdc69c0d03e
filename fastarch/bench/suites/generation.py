"""Decoding: greedy generation with the preallocated KV cache (:func:`fastarch.generation.generate`, each
step attends to the cache through :func:`fastarch.ops.attention`) against generation without a cache
(re-running the whole sequence every step, what the guides' decoding loops amount to), and beam search,
on :class:`fastarch.nn.GPTModel`. One timed call generates every new token of the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Ratio, Suite


def _model(cfg: BenchConfig, layers: int, d: int, heads: int, vocab: int, max_len: int) -> torch.nn.Module:
    from fastarch.nn import GPTModel

    torch.manual_seed(cfg.seed)
    return GPTModel(vocab, embed_dim=d, num_heads=heads, num_layers=layers, ff_dim=4 * d, max_len=max_len,
                    dropout=0.0).to(cfg.device).eval()


def _decode(cfg: BenchConfig, sizes: dict[str, int], **kw: Any) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from fastarch.generation import generate

        model = _model(cfg, sizes["layers"], sizes["d"], sizes["heads"], sizes["vocab"],
                       sizes["prompt"] + sizes["new"])
        g = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["prompt"]), generator=g).to(cfg.device)
        new = sizes["new"] // 2 if kw.get("strategy") == "beam" else sizes["new"]

        def run() -> Any:
            with torch.no_grad():
                return generate(model, ids, new, **kw)
        return run
    return setup


def _cases(cfg: BenchConfig, sizes: dict[str, int]) -> list[Case]:
    tag = ",".join(f"{k}={v}" for k, v in sizes.items())
    greedy = Case(name=f"greedy {tag}", params=dict(sizes), flops=None, x="new", group="greedy",
                  reference="uncached",
                  providers=[Provider("fastarch-kv-cache", "fastarch", _decode(cfg, sizes, use_cache=True)),
                             Provider("uncached", "reference", _decode(cfg, sizes, use_cache=False))],
                  ratios=(Ratio("fastarch-kv-cache", "uncached"),))
    beams = 4
    beam = Case(name=f"beam k={beams} {tag}", params=dict(sizes, beams=beams), flops=None, x="new", group="beam",
                reference="fastarch-kv-cache",
                providers=[Provider("fastarch-kv-cache", "fastarch",
                                    _decode(cfg, sizes, strategy="beam", num_beams=beams))])
    return [greedy, beam]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return _cases(cfg, dict(layers=1, d=32, heads=2, vocab=64, batch=1, prompt=4, new=4))
    if cfg.quick:
        return _cases(cfg, dict(layers=2, d=64, heads=2, vocab=512, batch=2, prompt=16, new=16))
    return _cases(cfg, dict(layers=4, d=256, heads=4, vocab=8000, batch=4, prompt=32, new=64))


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """Greedy decoding of a GPTModel (4 layers, d_model 256, 4 heads, vocabulary 8000, batch 4, a 32-token
    prompt and 128 new tokens) with the KV cache against without, and beam search with 4 beams over 64
    steps."""
    if cfg.toy:
        return cases(cfg)
    return _cases(cfg, dict(layers=4, d=256, heads=4, vocab=8000, batch=4, prompt=32, new=128))


SUITE = Suite(name="generation", description="decoding: greedy with the KV cache vs uncached, and beam search, "
              "on GPTModel", cases=cases, case_sets={"generation-headline": headline_cases})
