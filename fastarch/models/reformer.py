"""Reformer language models (LSH attention, reversible layers, chunked feed-forward) in small sizes."""

from __future__ import annotations

from typing import Any

from ..nn.reformer import ReformerLM
from .registry import register_model

__all__: list[str] = []


@register_model
def reformer_tiny(**kw: Any) -> ReformerLM:
    """2 layers, width 64, 4 heads, buckets of 16, byte vocabulary, up to 512 tokens."""
    cfg: dict[str, Any] = dict(
        vocab_size=256,
        d_model=64,
        n_heads=4,
        depth=2,
        max_seq_len=512,
        n_hashes=2,
        bucket_size=16,
        dropout=0.0,
    )
    cfg.update(kw)
    return ReformerLM(**cfg)


@register_model
def reformer_small(**kw: Any) -> ReformerLM:
    """6 layers, width 256, 4 heads, buckets of 64, 4 hashes, up to 8192 tokens."""
    cfg: dict[str, Any] = dict(
        vocab_size=32000,
        d_model=256,
        n_heads=4,
        depth=6,
        max_seq_len=8192,
        n_hashes=4,
        bucket_size=64,
        dropout=0.1,
        ff_chunks=4,
    )
    cfg.update(kw)
    return ReformerLM(**cfg)
