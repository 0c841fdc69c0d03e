"""Reformer language models (LSH attention, reversible layers, chunked feed-forward) in small sizes."""

from __future__ import annotations

from ..nn.reformer import ReformerLM
from .registry import register_configs

__all__: list[str] = []

globals().update(register_configs({
    "reformer_tiny": (ReformerLM, "2 layers, width 64, 4 heads, buckets of 16, byte vocabulary, up to 512 tokens.",
                      dict(vocab_size=256, d_model=64, n_heads=4, depth=2, max_seq_len=512, n_hashes=2,
                           bucket_size=16, dropout=0.0)),
    "reformer_small": (ReformerLM, "6 layers, width 256, 4 heads, buckets of 64, 4 hashes, up to 8192 tokens.",
                       dict(vocab_size=32000, d_model=256, n_heads=4, depth=6, max_seq_len=8192, n_hashes=4,
                            bucket_size=64, dropout=0.1, ff_chunks=4)),
}))
