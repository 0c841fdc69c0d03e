"""The key/value cache lives in :mod:`fastarch.nn.kv_cache` (the attention modules use it); it is re-exported
here so that ``from fastarch.generation import KVCache`` and ``fastarch.generation.kv_cache.KVCache`` keep
working."""

from __future__ import annotations

from ..nn.kv_cache import KVCache

__all__ = ["KVCache"]
