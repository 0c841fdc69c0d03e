"""Small sequence models on the efficient mixers: S4 (S4D), Performer (FAVOR+), Linformer.

``EfficientLM``: token embedding -> ``n_layers`` pre-norm residual blocks (mixer + feed-forward) -> norm ->
tied LM head; ``(B, L)`` token ids -> ``(B, L, vocab)`` logits. With ``mixer="s4"`` the blocks are
:class:`fastarch.nn.S4Block` and the model can also run token by token (``allocate_state`` / ``step``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn.linear import Linear
from ..nn.linformer import Linformer
from ..nn.performer import Performer
from ..nn.s4 import S4Block
from .registry import register_configs

__all__ = ["EfficientLM"]


class _AttnBlock(nn.Module):
    def __init__(self, mixer: nn.Module, d_model: int, dropout: float) -> None:
        super().__init__()
        self.mixer = mixer
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(Linear(d_model, 4 * d_model), nn.GELU(), nn.Dropout(dropout),
                                Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.ff(self.norm2(x))


class EfficientLM(nn.Module):
    """Args: vocab_size, d_model, n_layers, mixer ('s4' | 'performer' | 'linformer'), n_heads (attention
    mixers), d_state (S4), nb_features (Performer, causal), seq_len and k (Linformer, bidirectional),
    dropout."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 2, mixer: str = "s4", *,
                 n_heads: int = 4, d_state: int = 64, nb_features: int = 64, seq_len: int = 512, k: int = 64,
                 dropout: float = 0.1) -> None:
        super().__init__()
        if mixer not in ("s4", "performer", "linformer"):
            raise ValueError(f"EfficientLM: mixer must be 's4', 'performer' or 'linformer', got {mixer!r}")
        self.mixer = mixer
        self.embed = nn.Embedding(vocab_size, d_model)
        blocks: list[nn.Module] = []
        for _ in range(n_layers):
            if mixer == "s4":
                blocks.append(S4Block(d_model, d_state, dropout=dropout))
            elif mixer == "performer":
                blocks.append(_AttnBlock(Performer(d_model, n_heads, nb_features, dropout, causal=True),
                                         d_model, dropout))
            else:
                blocks.append(_AttnBlock(Linformer(d_model, n_heads, seq_len, k, dropout), d_model, dropout))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(d_model)
        self.head = Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    def allocate_state(self, batch: int, device=None) -> list[torch.Tensor]:
        if self.mixer != "s4":
            raise NotImplementedError("EfficientLM: token-by-token stepping needs mixer='s4'")
        return [blk.allocate_state(batch, device) for blk in self.blocks]

    def step(self, input_ids: torch.Tensor, state: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``input_ids`` ``(B,)`` -> ``(logits (B, vocab), new_state)`` (S4 only)."""
        if self.mixer != "s4":
            raise NotImplementedError("EfficientLM: token-by-token stepping needs mixer='s4'")
        x = self.embed(input_ids)
        new = []
        for blk, s in zip(self.blocks, state):
            x, s = blk.step(x, s)
            new.append(s)
        return self.head(self.norm(x)), new


globals().update(register_configs({
    f"{name}_tiny": (EfficientLM, f"EfficientLM with the {mixer} mixer: 2 layers of width 128, byte vocabulary.",
                     dict(vocab_size=256, d_model=128, n_layers=2, mixer=mixer))
    for name, mixer in (("s4_lm", "s4"), ("performer_lm", "performer"), ("linformer_encoder", "linformer"))
}))
