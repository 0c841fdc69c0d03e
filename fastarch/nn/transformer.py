"""Transformer family of the guides, drop-in, with every attention going through ``fastarch.ops.attention``.

Guide 000: ``PositionalEncoding``, ``PositionwiseFeedForward``, ``TransformerEncoderLayer``/``Encoder``,
``TransformerDecoderLayer``/``Decoder`` and the encoder-decoder ``Transformer``.
Guide 001: ``TransformerBlock`` (post-norm block with a fused ``qkv`` projection; used by BERTModel and the
001 ViT) and its text encoder ``TransformerEncoder001``.
Guide 003: ``TokenEmbedding``, ``FeedFowardNetwork`` (sic) and its encoder/decoder language model with a
positional-encoding choice, here ``Transformer003`` (the name ``Transformer`` belongs to guide 000), built from
``TransformerBlock003``. Guide 004: ``TransformerBlock004``/``Transformer004``.

Deviations, where the guides' code cannot run or is wrong (documented in docs/models.md):

- Guide 000's layers call ``self.self_attn.mha(...)`` on a ``MultiHeadAttention``, which has no ``mha``
  attribute. The evident intent (``SelfAttention.mha`` is a ``MultiHeadAttention``) is implemented: the
  layer calls its ``MultiHeadAttention`` (keys ``self_attn.w_q`` ..., ``self_attn.layer_norm``), whose forward
  includes its own residual + LayerNorm, exactly as the guide's ``MultiHeadAttention.forward``.
- Guide 000's ``Transformer.generate_square_subsequent_mask`` builds a 0/-inf float mask, which its attention
  reads with ``masked_fill(mask == 0, ...)``, i.e. inverted (each target token would see only the future).
  When ``tgt_mask`` is None the decoder here is causal, as the guide intends; explicit masks keep the guides'
  convention (0 = masked).
- Attention weights are not materialised: modules that return ``(output, attention)`` return ``None`` for
  the weights (the fused op never forms the L x L matrix).
- Guide 003's block passes ``norm_type`` to a constructor that does not take it, calls an undefined
  ``MultiHeadSelfAttention`` and never applies RoPE. Here the block takes ``norm_type`` (its two norms are
  ``nn.LayerNorm`` as written), the attention is guide 003's ``MultiHeadAttention`` (keys ``W_Q``..``W_O``),
  and ``pos_encoding='rotary'`` rotates q and k per head (interleaved pairs, base 10000, as guide 003's
  ``RotaryPositionalEncoding.apply_rotary`` with the head size).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import attend, check_input, guide_mask_to_op, layer_norm

__all__ = [
    "PositionwiseFeedForward",
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
    "TransformerDecoder",
    "Transformer",
    "TransformerBlock",
    "TransformerEncoder001",
    "TokenEmbedding",
    "FeedFowardNetwork",
    "TransformerBlock003",
    "Transformer003",
    "TransformerBlock004",
    "Transformer004",
    "GPTStyle",
    "BERTStyle",
]

try:  # guide 000's sinusoidal encoding with dropout; the lead's positional module may define it
    from .positional import PositionalEncoding  # type: ignore[attr-defined]
except ImportError:

    class PositionalEncoding(nn.Module):  # type: ignore[no-redef]
        """Sinusoidal positional encoding + dropout (guide 000). x (B, L, d_model) -> same shape."""

        def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.1):
            super().__init__()
            self.dropout = nn.Dropout(dropout)
            self.register_buffer("pe", _sinusoid(max_len, d_model).unsqueeze(0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.size(1) > self.pe.size(1):
                raise ValueError(f"PositionalEncoding: sequence length {x.size(1)} exceeds max_len {self.pe.size(1)}")
            return self.dropout(x + self.pe[:, : x.size(1)])

    __all__.append("PositionalEncoding")


def _sinusoid(max_len: int, d_model: int) -> torch.Tensor:
    pe = torch.zeros(max_len, d_model)
    position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def _split(x: torch.Tensor, h: int) -> torch.Tensor:
    b, n, d = x.shape
    return x.view(b, n, h, d // h).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)


# --------------------------------------------------------------------------------------------------------
# Attention cores with the guides' parameter names. They are internal: the public attention classes
# (guide 000's MultiHeadAttention and friends) belong to fastarch.nn.attention; these keep the same keys and
# outputs and add the fast paths the models need (fused QKV, causal flag, KV cache).
# --------------------------------------------------------------------------------------------------------
class _MHA000(nn.Module):
    """Guide 000 ``MultiHeadAttention``: projections w_q/w_k/w_v/w_o, then ``layer_norm(out + q_input)``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout  # the guide's ScaledDotProductAttention dropout (no parameters)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def project(self, q, k, v):
        if q is k and k is v:  # self-attention: one GEMM for the three projections
            w = torch.cat([self.w_q.weight, self.w_k.weight, self.w_v.weight], 0)
            b = torch.cat([self.w_q.bias, self.w_k.bias, self.w_v.bias], 0)
            return F.linear(q, w, b).chunk(3, -1)
        return self.w_q(q), self.w_k(k), self.w_v(v)

    def forward(self, q, k, v, mask=None, *, causal: bool = False, kv_cache=None, layer_idx: int = 0):
        residual = q
        b, lq = q.shape[0], q.shape[1]
        qp, kp, vp = self.project(q, k, v)
        qh, kh, vh = _split(qp, self.n_heads), _split(kp, self.n_heads), _split(vp, self.n_heads)
        if kv_cache is not None:
            kh, vh = kv_cache.update(layer_idx, kh, vh)
        kpm, bias = guide_mask_to_op(mask, b, lq, kh.shape[2], qh.dtype)
        o = attend(qh, kh, vh, causal=causal, key_padding_mask=kpm, attn_bias=bias,
                   dropout_p=self.attn_dropout if self.training else 0.0)
        out = self.dropout(self.w_o(_merge(o)))
        return layer_norm(out + residual, self.layer_norm), None


class _QKVAttention(nn.Module):
    """Guide 001 ``MultiHeadAttention``: fused ``qkv`` projection and ``out_proj`` (no norm inside)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None, *, causal: bool = False, kv_cache=None, layer_idx: int = 0,
                key_padding_mask=None):
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)
        kpm, bias = guide_mask_to_op(mask, b, n, k.shape[2], q.dtype)
        if key_padding_mask is not None:
            kpm = key_padding_mask if kpm is None else (kpm & key_padding_mask)
        o = attend(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=bias,
                   dropout_p=self.dropout.p if self.training else 0.0, scale=self.scale)
        return self.out_proj(_merge(o))


class _MHA003(nn.Module):
    """Guide 003 ``MultiHeadAttention``: W_Q/W_K/W_V/W_O; ``mask`` (B, L) is a key padding mask."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, rotary: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.W_O = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.rotary = rotary

    def forward(self, x, mask=None, causal: bool = False):
        b, n, _ = x.shape
        w = torch.cat([self.W_Q.weight, self.W_K.weight, self.W_V.weight], 0)
        bb = torch.cat([self.W_Q.bias, self.W_K.bias, self.W_V.bias], 0)
        q, k, v = (_split(t, self.n_heads) for t in F.linear(x, w, bb).chunk(3, -1))
        if self.rotary:
            q, k = _rope_interleaved(q), _rope_interleaved(k)
        kpm = None
        bias = None
        if mask is not None:
            if mask.dim() == 2 and mask.shape == (b, n):
                kpm = mask != 0
            else:
                m = mask.unsqueeze(1).unsqueeze(1)  # as the guide: add the head dims, then broadcast
                bias = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(m == 0, float("-inf"))
        o = attend(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=bias,
                   dropout_p=self.dropout.p if self.training else 0.0)
        return self.W_O(_merge(o))


def _rope_interleaved(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by pos * base^(-2i/d); x (B, H, L, d)."""
    d, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    sin, cos = ang.sin().to(x.dtype), ang.cos().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


# --------------------------------------------------------------------------------------------------------
# Guide 000
# --------------------------------------------------------------------------------------------------------
class PositionwiseFeedForward(nn.Module):
    """FFN(x) = dropout(w_2(dropout(act(w_1 x)))), act 'relu' or 'gelu' (guide 000). (B, L, d) -> (B, L, d)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, activation: str = "relu"):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"Unknown activation: {activation}")
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w_2(self.dropout(self.activation(self.w_1(x)))))


class TransformerEncoderLayer(nn.Module):
    """Post-norm encoder layer of guide 000: x = norm1(MHA(x) + x); x = norm2(FFN(x) + x).

    forward(x (B, L, d_model), mask broadcastable to (B, H, L, L), 0 = masked) -> (B, L, d_model).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.d_model = d_model
        self.self_attn = _MHA000(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.d_model, owner=type(self).__name__)
        residual = x
        x, _ = self.self_attn(x, x, x, mask, causal=causal)
        x = layer_norm(self.dropout(x) + residual, self.norm1)
        return layer_norm(self.ffn(x) + x, self.norm2)


class TransformerEncoder(nn.Module):
    """Stack of ``TransformerEncoderLayer`` + final LayerNorm (guide 000). (B, L, d) -> (B, L, d)."""

    def __init__(self, num_layers: int, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(TransformerEncoderLayer(d_model, n_heads, d_ff, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask, causal=causal)
        return layer_norm(x, self.norm)


class TransformerDecoderLayer(nn.Module):
    """Decoder layer of guide 000: masked self-attention, cross-attention to the encoder, FFN, each followed
    by add & norm. ``causal=True`` gives the causal self-attention without building a mask."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.d_model = d_model
        self.self_attn = _MHA000(d_model, n_heads, dropout)
        self.cross_attn = _MHA000(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None, *, causal: bool = False):
        """x (B, Lt, d), encoder_output (B, Ls, d) or None -> (B, Lt, d).

        ``encoder_output=None`` (decoder-only use, guide 004's ``GPTStyle``) skips the cross-attention
        sub-layer (``cross_attn`` and ``norm2`` stay in the state_dict, unused)."""
        check_input("x", x, ndim=3, last=self.d_model, owner="TransformerDecoderLayer")
        if encoder_output is not None:
            check_input("encoder_output", encoder_output, ndim=3, last=self.d_model,
                        owner="TransformerDecoderLayer")
        residual = x
        x, _ = self.self_attn(x, x, x, tgt_mask, causal=causal)
        x = layer_norm(self.dropout(x) + residual, self.norm1)
        if encoder_output is not None:
            residual = x
            x, _ = self.cross_attn(x, encoder_output, encoder_output, src_mask)
            x = layer_norm(self.dropout(x) + residual, self.norm2)
        return layer_norm(self.ffn(x) + x, self.norm3)


class TransformerDecoder(nn.Module):
    """Stack of ``TransformerDecoderLayer`` + final LayerNorm (guide 000)."""

    def __init__(self, num_layers: int, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList(TransformerDecoderLayer(d_model, n_heads, d_ff, dropout)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)

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
        self.output_linear = nn.Linear(d_model, tgt_vocab_size)
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
    forward(x (B, L, E), mask (B, 1, 1, L) or broadcastable, 0 = masked) -> (B, L, E).
    ``layer_norm_eps`` (extension, default PyTorch's 1e-5) lets Hugging Face BERT (1e-12) load exactly.
    """

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-5):
        super().__init__()
        self.embed_dim = embed_dim
        self.attention = _QKVAttention(embed_dim, num_heads, dropout)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.ffn = nn.Sequential(nn.Linear(embed_dim, ff_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ff_dim, embed_dim))
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = False,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=3, last=self.embed_dim, owner="TransformerBlock")
        x = layer_norm(x + self.dropout1(self.attention(x, mask, causal=causal,
                                                        key_padding_mask=key_padding_mask)), self.norm1)
        return layer_norm(x + self.dropout2(self.ffn(x)), self.norm2)


class TransformerEncoder001(nn.Module):
    """Guide 001's ``TransformerEncoder`` (token ids in; the name ``TransformerEncoder`` is guide 000's):
    embedding * sqrt(E) + sinusoidal positions, ``TransformerBlock`` stack, final norm.
    forward(x (B, L) token ids, mask) -> (B, L, E)."""

    def __init__(self, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, ff_dim: int,
                 max_len: int = 5000, dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.pos_encoding = _SinusoidalBuffer(embed_dim, max_len)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(TransformerBlock(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=2, integer=True, owner="TransformerEncoder001")
        x = self.dropout(self.pos_encoding(self.embedding(x) * math.sqrt(self.embedding.embedding_dim)))
        for layer in self.layers:
            x = layer(x, mask)
        return layer_norm(x, self.norm)


class _SinusoidalBuffer(nn.Module):
    """x + pe[:L] with ``pe`` a (1, max_len, d) buffer (guides 001/003/004's sinusoidal encodings)."""

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        self.register_buffer("pe", _sinusoid(max_len, d_model).unsqueeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) > self.pe.size(1):
            raise ValueError(f"sequence length {x.size(1)} exceeds the positional table's max_len {self.pe.size(1)}")
        return x + self.pe[:, : x.size(1)]


class _LearnedTable(nn.Module):
    """Guide 003's ``LearnedPositionalEncoding``: x + pe[:, :L] with ``pe`` a (1, max_len, d) parameter."""

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(1, max_len, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) > self.pe.size(1):
            raise ValueError(f"sequence length {x.size(1)} exceeds the positional table's max_len {self.pe.size(1)}")
        return x + self.pe[:, : x.size(1)]


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
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ffn, d_model))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.ffn(X)


class TransformerBlock003(nn.Module):
    """Guide 003's ``TransformerBlock`` (post-norm): X = ln1(X + drop(mha(X))); X = ln2(X + drop(ffn(X))).

    Keys ``mha.W_Q``..``mha.W_O``, ``ln1``, ``ffn.ffn.{0,3}``, ``ln2``. ``rotary=True`` applies RoPE to q, k.
    """

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float = 0.1, norm_type: str = "layer",
                 rotary: bool = False):
        super().__init__()
        self.d_model, self.n_heads, self.d_ffn = d_model, n_heads, d_ffn
        self.mha = _MHA003(d_model, n_heads, dropout, rotary=rotary)
        self.ln1 = nn.LayerNorm(d_model)
        self.ffn = FeedFowardNetwork(d_model=d_model, d_ffn=d_ffn)
        self.ln2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, X: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        X = layer_norm(X + self.dropout(self.mha(X, mask, causal)), self.ln1)
        return layer_norm(X + self.dropout(self.ffn(X)), self.ln2)


def _norm003(kind: str, d_model: int) -> nn.Module:
    """Guide 003's own LayerNorm (gamma/beta, unbiased std, eps outside the root) or BatchNorm."""
    try:
        from .norms import BatchNorm as _BN  # type: ignore[attr-defined]
        from .norms import LayerNorm as _LN  # type: ignore[attr-defined]
    except ImportError:
        _LN, _BN = _LayerNorm003, _BatchNorm003
    return _LN(d_model) if kind == "layer" else _BN(d_model)


class _LayerNorm003(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..ops.layer_norm import layer_norm as fa_ln

        return fa_ln(x, self.gamma, self.beta, self.eps, unbiased=True, eps_inside_sqrt=False)


class _BatchNorm003(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.register_buffer("running_mean", torch.zeros(d_model))
        self.register_buffer("running_var", torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mean = x.mean(dim=(0, 1))
            var = x.var(dim=(0, 1), unbiased=False)
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
        else:
            mean, var = self.running_mean, self.running_var
        return self.gamma * (x - mean) / torch.sqrt(var + self.eps) + self.beta


class Transformer003(nn.Module):
    """Guide 003's language model ``Transformer`` (renamed: ``Transformer`` is guide 000's).

    mode 'encoder' (bidirectional) or 'decoder' (causal); pos_encoding 'sinusoidal' | 'learned' | 'rotary';
    norm_type 'layer' | 'batch' for the final norm. forward(x (B, L) ids, mask (B, L) padding) -> logits (B, L, V).
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
        if norm_type not in ("layer", "batch"):
            raise ValueError(f"Transformer003: argument 'norm_type' must be 'layer' or 'batch', got {norm_type!r}")
        self.mode, self.d_model = mode, d_model
        self.token_embedding = TokenEmbedding(vocab_size, d_model)
        self.pos_encoding: nn.Module | None
        if pos_encoding == "sinusoidal":
            self.pos_encoding = _SinusoidalBuffer(d_model, max_len)
        elif pos_encoding == "learned":
            self.pos_encoding = _LearnedTable(d_model, max_len)
        else:
            self.pos_encoding = None
        rotary = pos_encoding == "rotary"
        self.blocks = nn.ModuleList(TransformerBlock003(d_model, n_heads, d_ff, dropout, norm_type, rotary=rotary)
                                    for _ in range(n_layers))
        self.final_norm = _norm003(norm_type, d_model)
        self.output_projection = nn.Linear(d_model, vocab_size)
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
class _MHA004(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model, self.num_heads, self.d_k = d_model, num_heads, d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        b = query.shape[0]
        q, k, v = _split(self.W_q(query), self.num_heads), _split(self.W_k(key), self.num_heads), \
            _split(self.W_v(value), self.num_heads)
        kpm, bias = guide_mask_to_op(mask, b, q.shape[2], k.shape[2], q.dtype)
        o = attend(q, k, v, key_padding_mask=kpm, attn_bias=bias)
        return self.W_o(_merge(o)), None


class _FFN004(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class TransformerBlock004(nn.Module):
    """Guide 004's post-norm ``TransformerBlock`` (keys ``attention.W_q``.., ``feed_forward.linear1/2``)."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__()
        self.attention = _MHA004(d_model, num_heads)
        self.feed_forward = _FFN004(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        attn, _ = self.attention(x, x, x, mask)
        x = layer_norm(x + self.dropout(attn), self.norm1)
        return layer_norm(x + self.dropout(self.feed_forward(x)), self.norm2)


class Transformer004(nn.Module):
    """Guide 004's ``Transformer`` (embedding, sinusoidal positions, blocks, vocabulary projection)."""

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, d_ff: int,
                 max_seq_length: int = 5000, dropout: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.positional_encoding = _SinusoidalBuffer(d_model, max_seq_length)
        self.transformer_blocks = nn.ModuleList(TransformerBlock004(d_model, num_heads, d_ff, dropout)
                                                for _ in range(num_layers))
        self.final_layer = nn.Linear(d_model, vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        check_input("x", x, ndim=2, integer=True, owner="Transformer004")
        x = self.dropout(self.positional_encoding(self.embedding(x)))
        for block in self.transformer_blocks:
            x = block(x, mask)
        return self.final_layer(x)
