"""Transformer family of the guides, drop-in, with every attention on the one core of
:mod:`fastarch.nn.attention` (and so on ``fastarch.ops.attention``).

Architectures, by what they are (guide names kept as aliases):

- guide 000: ``PositionwiseFeedForward``, the post-norm ``TransformerEncoderLayer``/``TransformerEncoder``,
  ``TransformerDecoderLayer``/``TransformerDecoder``, the encoder-decoder ``Transformer``, and guide 004's
  ``GPTStyle``/``BERTStyle`` wrappers of those stacks;
- ``TransformerBlock``: post-norm block with a fused ``qkv`` projection (guide 001; BERTModel and the 001 ViT
  use it) and ``TextTransformerEncoder``, its token encoder (alias ``TransformerEncoder001``);
- ``PostNormRotaryBlock`` (alias ``TransformerBlock003``): post-norm block with optional RoPE and a choice of
  norm, and ``TransformerLM`` (alias ``Transformer003``): guide 003's encoder/decoder language model with a
  positional-encoding choice; ``TokenEmbedding``, ``FeedFowardNetwork`` (sic);
- ``PostNormBlock`` (alias ``TransformerBlock004``) and ``SinusoidalEncoderLM`` (alias ``Transformer004``):
  guide 004's block and encoder language model.

Deviations, where the guides' code cannot run or is wrong (documented in docs/models.md):

- Guide 000's layers call ``self.self_attn.mha(...)`` on a ``MultiHeadAttention``, which has no ``mha``
  attribute. The evident intent is implemented: the layer calls its ``MultiHeadAttention`` (keys
  ``self_attn.w_q`` ..., ``self_attn.layer_norm``), whose forward includes its own residual + LayerNorm.
- Guide 000's ``Transformer.generate_square_subsequent_mask`` builds a 0/-inf float mask, which its attention
  reads with ``masked_fill(mask == 0, ...)``, i.e. inverted (each target token would see only the future).
  When ``tgt_mask`` is None the decoder here is causal, as the guide intends; explicit masks keep the guides'
  convention (0 = masked).
- Attention weights are not materialised: layers that return ``(output, attention)`` return ``None`` for
  the weights.
- Guide 003's block passes ``norm_type`` to a constructor that does not take it, calls an undefined
  ``MultiHeadSelfAttention`` and never applies RoPE. Here the block honours ``norm_type`` (``'layer'``:
  ``nn.LayerNorm`` keys ``ln1.weight``/``ln1.bias`` as written; ``'batch'``: guide 003's ``BatchNorm``, keys
  ``ln1.gamma``...), the attention is guide 003's ``MultiHeadAttention`` (keys ``W_Q``..``W_O``), and
  ``pos_encoding='rotary'`` rotates q and k per head (interleaved pairs, base 10000, as guide 003's
  ``RotaryPositionalEncoding.apply_rotary`` with the head size).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import check_input, gelu_module, layer_norm
from .attention import FusedQKVAttention, MultiHeadAttention, MultiHeadAttention004, RotarySelfAttention
from .linear import Linear
from .norms import BatchNorm, FusedLayerNorm, LayerNorm
from .positional import LearnedPositionalEncoding003, PositionalEncoding, SinusoidalPositionalEncoding

__all__ = [
    "PositionwiseFeedForward",
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
    "TransformerDecoder",
    "Transformer",
    "TransformerBlock",
    "TextTransformerEncoder",
    "TransformerEncoder001",
    "TokenEmbedding",
    "FeedFowardNetwork",
    "PostNormRotaryBlock",
    "TransformerBlock003",
    "TransformerLM",
    "Transformer003",
    "PostNormBlock",
    "TransformerBlock004",
    "SinusoidalEncoderLM",
    "Transformer004",
    "GPTStyle",
    "BERTStyle",
]


# --------------------------------------------------------------------------------------------------------
# Guide 000
# --------------------------------------------------------------------------------------------------------
class PositionwiseFeedForward(nn.Module):
    """FFN(x) = dropout(w_2(dropout(act(w_1 x)))), act 'relu' or 'gelu' (guide 000). (B, L, d) -> (B, L, d)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, activation: str = "relu"):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"PositionwiseFeedForward: argument 'activation' must be 'relu' or 'gelu', "
                             f"got {activation!r}")
        self.w_1 = Linear(d_model, d_ff)
        self.w_2 = Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w_2(self.dropout(self.activation(self.w_1(x)))))


class TransformerEncoderLayer(nn.Module):
    """Post-norm encoder layer of guide 000: x = norm1(MHA(x) + x); x = norm2(FFN(x) + x), where MHA has its
    own add & norm. ``activation`` (extension) is the FFN's ('relu' as the guide, 'gelu' for the GPT layer).

    forward(x (B, L, d_model), mask broadcastable to (B, H, L, L), 0 = masked, *, causal=False, kv_cache=None,
    layer_idx=0) -> (B, L, d_model).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1, *, activation: str = "relu"):
        super().__init__()
        self.d_model = d_model
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout, activation)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False,
                kv_cache=None, layer_idx: int = 0) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.d_model, owner=type(self).__name__)
        a, _ = self.self_attn(x, x, x, mask, causal=causal, kv_cache=kv_cache, layer_idx=layer_idx)
        x = layer_norm(self.dropout(a) + x, self.norm1)
        return layer_norm(self.ffn(x) + x, self.norm2)


class TransformerDecoderLayer(TransformerEncoderLayer):
    """Decoder layer of guide 000: masked self-attention, cross-attention to the encoder, FFN, each followed
    by add & norm. ``causal=True`` gives the causal self-attention without building a mask."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__(d_model, n_heads, d_ff, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout, need_weights=False)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None, *, causal: bool = False):  # type: ignore[override]
        """x (B, Lt, d), encoder_output (B, Ls, d) or None -> (B, Lt, d).

        ``encoder_output=None`` (decoder-only use, guide 004's ``GPTStyle``) skips the cross-attention
        sub-layer (``cross_attn`` and ``norm2`` stay in the state_dict, unused)."""
        check_input("x", x, ndim=3, last=self.d_model, owner="TransformerDecoderLayer")
        a, _ = self.self_attn(x, x, x, tgt_mask, causal=causal)
        x = layer_norm(self.dropout(a) + x, self.norm1)
        if encoder_output is not None:
            check_input("encoder_output", encoder_output, ndim=3, last=self.d_model,
                        owner="TransformerDecoderLayer")
            a, _ = self.cross_attn(x, encoder_output, encoder_output, src_mask)
            x = layer_norm(self.dropout(a) + x, self.norm2)
        return layer_norm(self.ffn(x) + x, self.norm3)


class _NormedStack(nn.Module):
    """``num_layers`` layers of ``layer_type`` and a final LayerNorm ``norm`` (guide 000's stacks)."""

    layer_type: type[nn.Module]

    def __init__(self, num_layers: int, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(self.layer_type(d_model, n_heads, d_ff, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)


class TransformerEncoder(_NormedStack):
    """Stack of ``TransformerEncoderLayer`` + final LayerNorm (guide 000). (B, L, d) -> (B, L, d)."""

    layer_type = TransformerEncoderLayer

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, causal=causal)
        return layer_norm(x, self.norm)


class TransformerDecoder(_NormedStack):
    """Stack of ``TransformerDecoderLayer`` + final LayerNorm (guide 000)."""

    layer_type = TransformerDecoderLayer

    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None, *, causal: bool = False):
        for layer in self.layers:
            x = layer(x, encoder_output, tgt_mask, src_mask, causal=causal)
        return layer_norm(x, self.norm)


class Transformer(nn.Module):
    """Encoder-decoder Transformer of guide 000. forward(src (B, Ls), tgt (B, Lt)) -> (B, Lt, tgt_vocab).

    With ``tgt_mask=None`` the decoder self-attention is causal (see the module docstring for the guide's
    inverted mask). ``src_mask`` follows the guides' convention (0 = masked), e.g. (B, 1, 1, Ls).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, n_heads: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, d_ff: int = 2048, max_len: int = 5000,
                 dropout: float = 0.1):
        super().__init__()
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len, dropout)
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, n_heads, d_ff, dropout)
        self.decoder = TransformerDecoder(num_decoder_layers, d_model, n_heads, d_ff, dropout)
        self.output_linear = Linear(d_model, tgt_vocab_size)
        self.d_model = d_model
        self._init_weights()

    def _init_weights(self) -> None:
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def generate_square_subsequent_mask(self, sz: int) -> torch.Tensor:
        """The guide's additive causal mask (0 on and below the diagonal, -inf above)."""
        mask = torch.triu(torch.ones(sz, sz), diagonal=1)
        return mask.masked_fill(mask == 1, float("-inf"))

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        check_input("src", src, ndim=2, integer=True, owner="Transformer")
        check_input("tgt", tgt, ndim=2, integer=True, owner="Transformer")
        src = self.pos_encoding(self.src_embedding(src) * (self.d_model**0.5))
        tgt = self.pos_encoding(self.tgt_embedding(tgt) * (self.d_model**0.5))
        memory = self.encoder(src, src_mask)
        out = self.decoder(tgt, memory, tgt_mask, src_mask, causal=tgt_mask is None)
        return self.output_linear(out)


class GPTStyle(nn.Module):
    """Guide 004's decoder-only wrapper: ``self.decoder = TransformerDecoder()`` (guide 000's decoder stack).

    forward(x (B, L, d_model) embeddings, mask=None) -> (B, L, d_model); the self-attention is causal.
    ``state_dict`` keys are the guide's (``decoder.layers.{i}.self_attn.w_q.weight`` ..., ``decoder.norm``).

    Deviations (the guide's class cannot run): it calls ``TransformerDecoder()`` without the required sizes,
    so the sizes are keyword arguments whose defaults are guide 000's example decoder (6 layers, d_model 512,
    8 heads, d_ff 2048, dropout 0.1) and ``GPTStyle()`` still works; it calls ``self.decoder(x)`` without the
    encoder output the decoder requires, so there is no cross-attention (a decoder-only model has no encoder:
    each layer runs causal self-attention and the FFN; ``cross_attn``/``norm2`` stay as unused parameters so
    checkpoints load with ``strict=True``). ``mask`` (guide convention, 0 = masked, e.g. (B, 1, 1, L) padding)
    is applied on top of causality.
    """

    def __init__(self, num_layers: int = 6, d_model: int = 512, n_heads: int = 8, d_ff: int = 2048,
                 dropout: float = 0.1):
        super().__init__()
        self.decoder = TransformerDecoder(num_layers, d_model, n_heads, d_ff, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder(x, None, mask, causal=True)


class BERTStyle(nn.Module):
    """Guide 004's encoder-only wrapper: ``self.encoder = TransformerEncoder()`` (guide 000's encoder stack).

    forward(x (B, L, d_model) embeddings, mask=None) -> (B, L, d_model), bidirectional attention; ``mask``
    follows the guides' convention (0 = masked), e.g. (B, 1, 1, L) padding. Keys ``encoder.layers.{i}...``.

    Deviation: the guide calls ``TransformerEncoder()`` without the required sizes; they are keyword
    arguments here with guide 000's example encoder as defaults (6 layers, d_model 512, 8 heads, d_ff 2048,
    dropout 0.1), so ``BERTStyle()`` builds the same model the guide meant.
    """

    def __init__(self, num_layers: int = 6, d_model: int = 512, n_heads: int = 8, d_ff: int = 2048,
                 dropout: float = 0.1):
        super().__init__()
        self.encoder = TransformerEncoder(num_layers, d_model, n_heads, d_ff, dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(x, mask)


# --------------------------------------------------------------------------------------------------------
# Guide 001
# --------------------------------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Post-norm encoder block of guide 001: x = norm1(x + drop(attn(x))); x = norm2(x + drop(ffn(x))).

    Keys: ``attention.qkv``, ``attention.out_proj``, ``norm1``, ``ffn.{0,3}``, ``norm2``.
    forward(x (B, L, E), mask (B, 1, 1, L) or broadcastable, 0 = masked, *, causal=False,
    key_padding_mask=None) -> (B, L, E). ``layer_norm_eps`` (extension, default PyTorch's 1e-5) lets Hugging
    Face BERT (1e-12) load exactly; ``activation`` (extension) is ``"gelu"`` or ``"gelu_new"``.
    """

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-5, activation: str = "gelu"):
        super().__init__()
        self.embed_dim = embed_dim
        self.attention = FusedQKVAttention(embed_dim, num_heads, dropout)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.ffn = nn.Sequential(Linear(embed_dim, ff_dim), gelu_module(activation, inplace=True),
                                 nn.Dropout(dropout), Linear(ff_dim, embed_dim))
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.embed_dim, owner="TransformerBlock")
        a = self.attention(x, mask, causal=causal, key_padding_mask=key_padding_mask)
        x = layer_norm(x + self.dropout1(a), self.norm1)
        return layer_norm(x + self.dropout2(self.ffn(x)), self.norm2)


class TextTransformerEncoder(nn.Module):
    """Guide 001's ``TransformerEncoder`` (token ids in; the name ``TransformerEncoder`` is guide 000's):
    embedding * sqrt(E) + sinusoidal positions, ``TransformerBlock`` stack, final norm.
    forward(x (B, L) token ids, mask) -> (B, L, E)."""

    def __init__(self, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, ff_dim: int,
                 max_len: int = 5000, dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.pos_encoding = SinusoidalPositionalEncoding(embed_dim, max_len)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(TransformerBlock(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=2, integer=True, owner="TextTransformerEncoder")
        x = self.dropout(self.pos_encoding(self.embedding(x) * math.sqrt(self.embedding.embedding_dim)))
        for layer in self.layers:
            x = layer(x, mask)
        return layer_norm(x, self.norm)


# --------------------------------------------------------------------------------------------------------
# Guide 003
# --------------------------------------------------------------------------------------------------------
class TokenEmbedding(nn.Module):
    """Embedding scaled by sqrt(d_model) (guide 003). (B, L) ids -> (B, L, d_model)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.d_model = d_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x) * math.sqrt(self.d_model)


class FeedFowardNetwork(nn.Module):
    """Linear -> ReLU -> Dropout -> Linear (guide 003, name as spelled there). (..., d) -> (..., d)."""

    def __init__(self, d_model: int, d_ffn: int, dropout: float = 0.1):
        super().__init__()
        self.d_model, self.d_ffn = d_model, d_ffn
        self.ffn = nn.Sequential(Linear(d_model, d_ffn), nn.ReLU(), nn.Dropout(dropout), Linear(d_ffn, d_model))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.ffn(X)


_NORM_TYPES = ("layer", "batch")


def _check_norm_type(owner: str, norm_type: str) -> None:
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"{owner}: argument 'norm_type' must be 'layer' or 'batch', got {norm_type!r}")


class PostNormRotaryBlock(nn.Module):
    """Guide 003's ``TransformerBlock`` (post-norm): X = ln1(X + drop(mha(X))); X = ln2(X + drop(ffn(X))).

    Keys ``mha.W_Q``..``mha.W_O``, ``ln1``, ``ffn.ffn.{0,3}``, ``ln2``. ``rotary=True`` applies RoPE to q, k.
    ``norm_type``: ``'layer'`` (``nn.LayerNorm``, as the guide's code) or ``'batch'`` (guide 003's
    ``BatchNorm``). forward(X (B, L, d_model), mask (B, L) 0 = padding, causal=False) -> (B, L, d_model).
    """

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float = 0.1, norm_type: str = "layer",
                 rotary: bool = False):
        super().__init__()
        _check_norm_type("TransformerBlock003", norm_type)
        self.d_model, self.n_heads, self.d_ffn, self.norm_type = d_model, n_heads, d_ffn, norm_type
        self.mha = RotarySelfAttention(d_model, n_heads, dropout, rotary=rotary)
        self.ln1 = FusedLayerNorm(d_model) if norm_type == "layer" else BatchNorm(d_model)
        self.ffn = FeedFowardNetwork(d_model=d_model, d_ffn=d_ffn)
        self.ln2 = FusedLayerNorm(d_model) if norm_type == "layer" else BatchNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, X: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        X = self.ln1(X + self.dropout(self.mha(X, mask, causal)))
        return self.ln2(X + self.dropout(self.ffn(X)))


class TransformerLM(nn.Module):
    """Guide 003's language model ``Transformer`` (alias ``Transformer003``; ``Transformer`` is guide 000's).

    mode 'encoder' (bidirectional) or 'decoder' (causal); pos_encoding 'sinusoidal' | 'learned' | 'rotary';
    norm_type 'layer' | 'batch' (the blocks' norms and the final norm, guide 003's ``LayerNorm``/``BatchNorm``).
    forward(x (B, L) ids, mask (B, L) padding) -> logits (B, L, V).
    """

    def __init__(self, vocab_size: int, d_model: int = 512, n_heads: int = 8, n_layers: int = 6, d_ff: int = 2048,
                 max_len: int = 5000, dropout: float = 0.1, mode: str = "encoder", pos_encoding: str = "sinusoidal",
                 norm_type: str = "layer"):
        super().__init__()
        if mode not in ("encoder", "decoder"):
            raise ValueError(f"Transformer003: argument 'mode' must be 'encoder' or 'decoder', got {mode!r}")
        if pos_encoding not in ("sinusoidal", "learned", "rotary"):
            raise ValueError("Transformer003: argument 'pos_encoding' must be 'sinusoidal', 'learned' or 'rotary', "
                             f"got {pos_encoding!r}")
        _check_norm_type("Transformer003", norm_type)
        self.mode, self.d_model = mode, d_model
        self.token_embedding = TokenEmbedding(vocab_size, d_model)
        self.pos_encoding: nn.Module | None = {
            "sinusoidal": lambda: SinusoidalPositionalEncoding(d_model, max_len),
            "learned": lambda: LearnedPositionalEncoding003(d_model, max_len),
            "rotary": lambda: None,
        }[pos_encoding]()
        self.blocks = nn.ModuleList(
            PostNormRotaryBlock(d_model, n_heads, d_ff, dropout, norm_type, rotary=pos_encoding == "rotary")
            for _ in range(n_layers))
        self.final_norm = LayerNorm(d_model) if norm_type == "layer" else BatchNorm(d_model)
        self.output_projection = Linear(d_model, vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=2, integer=True, owner="Transformer003")
        x = self.token_embedding(x)
        if self.pos_encoding is not None:
            x = self.pos_encoding(x)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask, causal=self.mode == "decoder")
        return self.output_projection(self.final_norm(x))


# --------------------------------------------------------------------------------------------------------
# Guide 004
# --------------------------------------------------------------------------------------------------------
class _FFN004(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.linear1 = Linear(d_model, d_ff)
        self.linear2 = Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class PostNormBlock(nn.Module):
    """Guide 004's post-norm ``TransformerBlock`` (alias ``TransformerBlock004``): keys ``attention.W_q``..,
    ``feed_forward.linear1/2``, ``norm1``, ``norm2``. forward(x (B, L, d), mask, 0 = masked) -> (B, L, d)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.attention = MultiHeadAttention004(d_model, num_heads)
        self.feed_forward = _FFN004(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        attn, _ = self.attention(x, x, x, mask)
        x = layer_norm(x + self.dropout(attn), self.norm1)
        return layer_norm(x + self.dropout(self.feed_forward(x)), self.norm2)


class SinusoidalEncoderLM(nn.Module):
    """Guide 004's ``Transformer`` (alias ``Transformer004``): embedding, sinusoidal positions, bidirectional
    ``PostNormBlock`` stack, vocabulary projection. forward(x (B, L) ids, mask) -> logits (B, L, V)."""

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, d_ff: int,
                 max_seq_length: int = 5000, dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.positional_encoding = SinusoidalPositionalEncoding(d_model, max_seq_length)
        self.transformer_blocks = nn.ModuleList(PostNormBlock(d_model, num_heads, d_ff, dropout)
                                                for _ in range(num_layers))
        self.final_layer = Linear(d_model, vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=2, integer=True, owner="Transformer004")
        x = self.dropout(self.positional_encoding(self.embedding(x)))
        for block in self.transformer_blocks:
            x = block(x, mask)
        return self.final_layer(x)


# Guide-numbered names, for drop-in use.
TransformerEncoder001 = TextTransformerEncoder
TransformerBlock003 = PostNormRotaryBlock
Transformer003 = TransformerLM
TransformerBlock004 = PostNormBlock
Transformer004 = SinusoidalEncoderLM
_MHA000 = MultiHeadAttention
_QKVAttention = FusedQKVAttention
_MHA003 = RotarySelfAttention
_MHA004 = MultiHeadAttention004
