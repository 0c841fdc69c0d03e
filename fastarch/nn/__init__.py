"""Drop-in modules for every architecture of the seed guides, on fastarch's ops.

Each file holds one family; every public class it lists in ``__all__`` is exported here, so
``from fastarch.nn import MambaBlock`` works whichever file defines it.
"""

from __future__ import annotations

from . import (
    additive_attention,
    attention,
    bert,
    clip,
    cnn,
    feedforward,
    gpt,
    graph,
    kv_attention,
    kv_cache,
    linear,
    linformer,
    mamba,
    mamba2,
    mamba3,
    multimodal,
    norms,
    performer,
    positional,
    recurrent,
    reformer,
    s4,
    swin,
    transformer,
    vision,
)

_FAMILIES = (additive_attention, attention, bert, clip, cnn, feedforward, gpt, graph, kv_attention, kv_cache,
             linear, linformer, mamba, mamba2, mamba3, multimodal, norms, performer, positional, recurrent, reformer, s4,
             swin, transformer,
             vision)

__all__: list[str] = []
for _family in _FAMILIES:
    for _name in _family.__all__:
        if _name in globals() and _name in __all__:
            raise ImportError(f"fastarch.nn: {_name} is exported twice ({_family.__name__} and another file)")
        globals()[_name] = getattr(_family, _name)
        __all__.append(_name)
