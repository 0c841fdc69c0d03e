"""BERT family: guide 000's ``BERTTransformer``, guide 001's ``BERTModel`` (MLM and NSP heads), and ``BERT``,
the Hugging Face-shaped encoder (embeddings, post-norm blocks, pooler) that ``bert_base`` builds and
``fastarch.models.bert_from_hf`` loads. Padding masks go to the attention op as ``key_padding_mask``.

Deviation: guide 001's ``BERTModel`` hands its (B, L) ``attention_mask`` straight to ``masked_fill`` on
(B, H, L, L) scores, which broadcasts it along the wrong axes (it only runs when B == L or B == 1). A 2-D mask
is a key padding mask here (1 = real token), as the docstring there says.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._models_common import check_input, layer_norm
from .linear import Linear
from .transformer import TransformerBlock, TransformerEncoder

__all__ = ["BERTTransformer", "BERTModel", "BERT"]


def _padding(attention_mask: torch.Tensor | None, input_ids: torch.Tensor, owner: str) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    check_input("attention_mask", attention_mask, ndim=2, owner=owner)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"{owner}: argument 'attention_mask' must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    real = attention_mask != 0
    return None if bool(real.all()) else real  # nothing padded: attention's unmasked path


class BERTTransformer(nn.Module):
    """Guide 000's encoder-only BERT. forward(input_ids (B, L), segment_ids (B, L) or None,
    attention_mask (B, L), 1 = real) -> (sequence_output (B, L, d), pooled_output (B, d) = [CLS] state).
    ``get_mlm_logits`` / ``get_nsp_logits`` apply the pretraining heads."""

    def __init__(self, vocab_size: int, d_model: int = 768, n_heads: int = 12, num_layers: int = 12,
                 d_ff: int = 3072, max_len: int = 512, num_segments: int = 2, dropout: float = 0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.segment_embedding = nn.Embedding(num_segments, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.encoder = TransformerEncoder(num_layers, d_model, n_heads, d_ff, dropout)
        self.mlm_head = nn.Sequential(Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model),
                                      Linear(d_model, vocab_size))
        self.nsp_head = nn.Sequential(Linear(d_model, d_model), nn.Tanh(), Linear(d_model, 2))
        self.dropout = nn.Dropout(dropout)
        self.d_model = d_model
        self.max_len = max_len

    def forward(self, input_ids, segment_ids=None, attention_mask=None):
        check_input("input_ids", input_ids, ndim=2, integer=True, owner="BERTTransformer")
        b, n = input_ids.shape
        if n > self.max_len:
            raise ValueError(f"BERTTransformer: sequence length {n} exceeds max_len {self.max_len}")
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0)
        emb = self.token_embedding(input_ids) + self.position_embedding(pos)
        if segment_ids is not None:
            emb = emb + self.segment_embedding(segment_ids)
        emb = self.dropout(emb)
        kpm = _padding(attention_mask, input_ids, "BERTTransformer")
        mask = None if kpm is None else kpm[:, None, None, :]
        seq = self.encoder(emb, mask)
        return seq, seq[:, 0, :]

    def get_mlm_logits(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return self.mlm_head(sequence_output)

    def get_nsp_logits(self, pooled_output: torch.Tensor) -> torch.Tensor:
        return self.nsp_head(pooled_output)


class BERTModel(nn.Module):
    """Guide 001's BERT for pretraining. forward(input_ids (B, L), segment_ids (B, L), attention_mask (B, L))
    -> (mlm_logits (B, L, V), nsp_logits (B, 2))."""

    def __init__(self, vocab_size: int, embed_dim: int = 768, num_heads: int = 12, num_layers: int = 12,
                 ff_dim: int = 3072, max_len: int = 512, dropout: float = 0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_len, embed_dim)
        self.segment_embedding = nn.Embedding(2, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(TransformerBlock(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.mlm_head = nn.Sequential(Linear(embed_dim, embed_dim), nn.GELU(), nn.LayerNorm(embed_dim),
                                      Linear(embed_dim, vocab_size))
        self.nsp_head = nn.Sequential(Linear(embed_dim, embed_dim), nn.Tanh(), Linear(embed_dim, 2))
        self.max_len = max_len

    def encode(self, input_ids, segment_ids=None, attention_mask=None) -> torch.Tensor:
        """The final hidden states (B, L, E)."""
        check_input("input_ids", input_ids, ndim=2, integer=True, owner="BERTModel")
        if input_ids.shape[1] > self.max_len:
            raise ValueError(f"BERTModel: sequence length {input_ids.shape[1]} exceeds max_len {self.max_len}")
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        emb = self.token_embedding(input_ids) + self.position_embedding(pos)
        emb = emb + self.segment_embedding(segment_ids if segment_ids is not None else torch.zeros_like(input_ids))
        h = self.dropout(layer_norm(emb, self.norm))
        kpm = None
        mask = attention_mask
        if attention_mask is not None and attention_mask.dim() == 2:
            kpm, mask = _padding(attention_mask, input_ids, "BERTModel"), None
        for layer in self.encoder:
            h = layer(h, mask, key_padding_mask=kpm)
        return h

    def forward(self, input_ids, segment_ids, attention_mask=None):
        h = self.encode(input_ids, segment_ids, attention_mask)
        return self.mlm_head(h), self.nsp_head(h[:, 0])


class BERT(nn.Module):
    """BERT encoder with Hugging Face's architecture (post-norm, GELU, embedding LayerNorm, pooler).

    forward(input_ids (B, L), attention_mask (B, L) 1 = real or None, token_type_ids (B, L) or None)
    -> last hidden states (B, L, hidden_size). ``pooled(hidden)`` gives tanh(W h_[CLS] + b).
    ``hidden_act``: ``"gelu"`` (exact) or ``"gelu_new"`` (tanh approximation).
    ``bert_base`` (vocab 30522) has 109,482,240 parameters, as ``bert-base-uncased``.
    """

    def __init__(self, vocab_size: int = 30522, hidden_size: int = 768, num_heads: int = 12, num_layers: int = 12,
                 intermediate_size: int = 3072, max_position_embeddings: int = 512, type_vocab_size: int = 2,
                 dropout: float = 0.1, layer_norm_eps: float = 1e-12, hidden_act: str = "gelu"):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = nn.Embedding(max_position_embeddings, hidden_size)
        self.segment_embedding = nn.Embedding(type_vocab_size, hidden_size)
        self.norm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(TransformerBlock(hidden_size, num_heads, intermediate_size, dropout,
                                                      layer_norm_eps=layer_norm_eps, activation=hidden_act)
                                     for _ in range(num_layers))
        self.hidden_act = hidden_act
        self.pooler = Linear(hidden_size, hidden_size)
        self.hidden_size = hidden_size
        self.max_len = max_position_embeddings

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        check_input("input_ids", input_ids, ndim=2, integer=True, owner="BERT")
        n = input_ids.shape[1]
        if n > self.max_len:
            raise ValueError(f"BERT: sequence length {n} exceeds max_position_embeddings {self.max_len}")
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0)
        tt = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        emb = self.token_embedding(input_ids) + self.position_embedding(pos) + self.segment_embedding(tt)
        h = self.dropout(layer_norm(emb, self.norm))
        kpm = _padding(attention_mask, input_ids, "BERT")
        for layer in self.encoder:
            h = layer(h, key_padding_mask=kpm)
        return h

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.pooler(hidden[:, 0]))
