"""The seed guides' own code (guides 000, 001, 003), transcribed: the oracles of the drop-in tests and the
references of the benchmarks. Changes from the guides are only the minimal fixes the guides need to run at
all, each marked FIX; fastarch documents the same deviations (docs/models.md).

Class names are the guides' (guide 001 and 003 classes carry the guide's number, as ``Transformer003``);
fastarch's drop-in modules load these classes' ``state_dict`` with ``strict=True``."""
# ruff: noqa: N803, N806

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F


# ============================================= guide 000 ==================================================
class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature=None, dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k = q.size(-1)
        temperature = self.temperature or d_k ** 0.5
        scores = torch.matmul(q, k.transpose(-2, -1)) / temperature
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(attention, v), attention


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.attention = ScaledDotProductAttention(dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        residual = q
        q = self.w_q(q).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        k = self.w_k(k).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(batch_size, -1, self.n_heads, self.d_k).transpose(1, 2)
        output, attention = self.attention(q, k, v, mask)
        output = output.transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        output = self.dropout(self.w_o(output))
        output = self.layer_norm(output + residual)
        return output, attention


class SelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout)

    def forward(self, x, mask=None):
        return self.mha(x, x, x, mask)


class CrossAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout)

    def forward(self, q, kv, mask=None):
        return self.mha(q, kv, kv, mask)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-torch.log(torch.tensor(10000.0)) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))

    def forward(self, x):
        return self.dropout(x + self.pe[:, :x.size(1), :])


class LearnedPositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.pe = nn.Embedding(max_len, d_model)

    def forward(self, x):
        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0).expand(x.size(0), -1)
        return self.dropout(x + self.pe(positions))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1, activation='relu'):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == 'relu' else F.gelu

    def forward(self, x):
        x = self.dropout(self.activation(self.w_1(x)))
        return self.dropout(self.w_2(x))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, mask)  # FIX: the guide writes self.self_attn.mha(...)
        x = self.dropout(x)
        x = self.norm1(x + residual)
        residual = x
        x = self.ffn(x)
        return self.norm2(x + residual)


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(d_model, n_heads, d_ff, dropout)
                                     for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, tgt_mask)  # FIX: .mha
        x = self.norm1(self.dropout(x) + residual)
        residual = x
        x, _ = self.cross_attn(x, encoder_output, encoder_output, src_mask)  # FIX: .mha
        x = self.norm2(self.dropout(x) + residual)
        residual = x
        return self.norm3(self.ffn(x) + residual)


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.layers = nn.ModuleList([TransformerDecoderLayer(d_model, n_heads, d_ff, dropout)
                                     for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, encoder_output, tgt_mask=None, src_mask=None):
        for layer in self.layers:
            x = layer(x, encoder_output, tgt_mask, src_mask)
        return self.norm(x)


class Transformer(nn.Module):
    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=512, n_heads=8, num_encoder_layers=6,
                 num_decoder_layers=6, d_ff=2048, max_len=5000, dropout=0.1):
        super().__init__()
        self.src_embedding = nn.Embedding(src_vocab_size, d_model)
        self.tgt_embedding = nn.Embedding(tgt_vocab_size, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len, dropout)
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, n_heads, d_ff, dropout)
        self.decoder = TransformerDecoder(num_decoder_layers, d_model, n_heads, d_ff, dropout)
        self.output_linear = nn.Linear(d_model, tgt_vocab_size)
        self.d_model = d_model
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        src = self.pos_encoding(self.src_embedding(src) * (self.d_model ** 0.5))
        tgt = self.pos_encoding(self.tgt_embedding(tgt) * (self.d_model ** 0.5))
        if tgt_mask is None:
            # FIX: the guide's 0/-inf mask is read as "0 = masked" (inverted); use 1 = keep below the diagonal
            tgt_mask = torch.tril(torch.ones(tgt.size(1), tgt.size(1)))
        encoder_output = self.encoder(src, src_mask)
        return self.output_linear(self.decoder(tgt, encoder_output, tgt_mask, src_mask))


class BERTTransformer(nn.Module):
    def __init__(self, vocab_size, d_model=768, n_heads=12, num_layers=12, d_ff=3072, max_len=512, num_segments=2,
                 dropout=0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.segment_embedding = nn.Embedding(num_segments, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.encoder = TransformerEncoder(num_layers, d_model, n_heads, d_ff, dropout)
        self.mlm_head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model),
                                      nn.Linear(d_model, vocab_size))
        self.nsp_head = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh(), nn.Linear(d_model, 2))
        self.dropout = nn.Dropout(dropout)
        self.d_model = d_model

    def forward(self, input_ids, segment_ids=None, attention_mask=None):
        batch_size, seq_len = input_ids.size()
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch_size, -1)
        emb = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        if segment_ids is not None:
            emb = emb + self.segment_embedding(segment_ids)
        emb = self.dropout(emb)
        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        seq = self.encoder(emb, attention_mask)
        return seq, seq[:, 0, :]


class GPTDecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = PositionwiseFeedForward(d_model, d_ff, dropout, activation='gelu')
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, mask)  # FIX: .mha
        x = self.norm1(self.dropout(x) + residual)
        residual = x
        return self.norm2(self.ffn(x) + residual)


class GPTTransformer(nn.Module):
    def __init__(self, vocab_size, d_model=768, n_heads=12, num_layers=12, d_ff=3072, max_len=1024, dropout=0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList([GPTDecoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.dropout = nn.Dropout(dropout)
        self.d_model = d_model

    def forward(self, input_ids, attention_mask=None):
        batch_size, seq_len = input_ids.size()
        position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0).expand(batch_size, -1)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(position_ids))
        # FIX: the guide's triu(...).bool() mask is inverted under masked_fill(mask == 0); keep = lower triangle
        causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=input_ids.device))
        for layer in self.layers:
            x = layer(x, causal_mask)
        return self.lm_head(self.norm(x))


class PatchEmbedding(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_channels=3, embed_dim=768):
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.n_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_channels=3, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4.0, dropout=0.1):
        super().__init__()
        self.patch_embed = PatchEmbedding(img_size, patch_size, in_channels, embed_dim)
        num_patches = self.patch_embed.n_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([TransformerEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio), dropout)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class CLIPVisionEncoder(nn.Module):
    def __init__(self, img_size=224, patch_size=32, embed_dim=512, depth=12, num_heads=8, mlp_ratio=4.0):
        super().__init__()
        self.patch_embed = PatchEmbedding(img_size, patch_size, 3, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.n_patches + 1, embed_dim))
        self.blocks = nn.ModuleList([TransformerEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio), 0.1)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.proj(self.norm(x)[:, 0]), dim=-1)


class CLIPTextEncoder(nn.Module):
    def __init__(self, vocab_size=49408, embed_dim=512, context_length=77, depth=12, num_heads=8, mlp_ratio=4.0):
        super().__init__()
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.pos_embedding = nn.Parameter(torch.zeros(1, context_length, embed_dim))
        self.blocks = nn.ModuleList([TransformerEncoderLayer(embed_dim, num_heads, int(embed_dim * mlp_ratio), 0.1)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, text):
        x = self.token_embedding(text) + self.pos_embedding
        for block in self.blocks:
            x = block(x)
        return F.normalize(self.proj(self.norm(x)[:, -1, :]), dim=-1)


class CrossModalAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)

    def forward(self, vision_features, text_features, mask=None):
        fused, _ = self.cross_attn(vision_features, text_features, text_features, mask)  # FIX: .mha
        return fused


class CrossModalLayer(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.v_self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.t_self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.v2t_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.t2v_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.v_ffn = PositionwiseFeedForward(d_model, d_model * 4, dropout)
        self.t_ffn = PositionwiseFeedForward(d_model, d_model * 4, dropout)
        self.v_norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(3)])
        self.t_norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(3)])

    def forward(self, v, t):  # FIX throughout: .mha -> direct call
        v_res = v
        v, _ = self.v_self_attn(v, v, v)
        v = self.v_norms[0](v + v_res)
        t_res = t
        t, _ = self.t_self_attn(t, t, t)
        t = self.t_norms[0](t + t_res)
        v_cross, _ = self.v2t_attn(v, t, t)
        v = self.v_norms[1](v + v_cross)
        t_cross, _ = self.t2v_attn(t, v, v)
        t = self.t_norms[1](t + t_cross)
        v = self.v_norms[2](v + self.v_ffn(v))
        t = self.t_norms[2](t + self.t_ffn(t))
        return v, t


class MultiModalTransformer(nn.Module):
    def __init__(self, vision_dim=2048, text_vocab=30000, d_model=512, n_heads=8, num_layers=6, num_classes=1000):
        super().__init__()
        self.vision_proj = nn.Linear(vision_dim, d_model)
        self.text_embed = nn.Embedding(text_vocab, d_model)
        self.text_pos = LearnedPositionalEncoding(d_model, max_len=512)
        self.cross_modal_layers = nn.ModuleList([CrossModalLayer(d_model, n_heads) for _ in range(num_layers)])
        self.classifier = nn.Linear(d_model, num_classes)

    def forward(self, vision_features, text_tokens):
        v = self.vision_proj(vision_features)
        t = self.text_pos(self.text_embed(text_tokens))
        for layer in self.cross_modal_layers:
            v, t = layer(v, t)
        return self.classifier(v.mean(dim=1) + t.mean(dim=1))


# ============================================= guide 001 ==================================================
class MultiHeadAttention001(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        B, L, E = x.shape
        qkv = self.qkv(x).reshape(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float('-inf'))
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().reshape(B, L, E)
        return self.out_proj(out)


class TransformerBlock001(nn.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, dropout=0.1):
        super().__init__()
        self.attention = MultiHeadAttention001(embed_dim, num_heads, dropout)
        self.norm1 = nn.LayerNorm(embed_dim)
        self.dropout1 = nn.Dropout(dropout)
        self.ffn = nn.Sequential(nn.Linear(embed_dim, ff_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ff_dim, embed_dim))
        self.norm2 = nn.LayerNorm(embed_dim)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        x = self.norm1(x + self.dropout1(self.attention(x, mask)))
        return self.norm2(x + self.dropout2(self.ffn(x)))


class BERTModel001(nn.Module):
    def __init__(self, vocab_size, embed_dim=768, num_heads=12, num_layers=12, ff_dim=3072, max_len=512, dropout=0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_len, embed_dim)
        self.segment_embedding = nn.Embedding(2, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList([TransformerBlock001(embed_dim, num_heads, ff_dim, dropout)
                                      for _ in range(num_layers)])
        self.mlm_head = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.GELU(), nn.LayerNorm(embed_dim),
                                      nn.Linear(embed_dim, vocab_size))
        self.nsp_head = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.Tanh(), nn.Linear(embed_dim, 2))

    def forward(self, input_ids, segment_ids, attention_mask=None):
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        emb = (self.token_embedding(input_ids) + self.position_embedding(position_ids)
               + self.segment_embedding(segment_ids))
        h = self.dropout(self.norm(emb))
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask[:, None, None, :]  # FIX: a (B, L) mask broadcast over keys
        for layer in self.encoder:
            h = layer(h, attention_mask)
        return self.mlm_head(h), self.nsp_head(h[:, 0])


class GPTBlock001(nn.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, dropout=0.1):
        super().__init__()
        self.attention = MultiHeadAttention001(embed_dim, num_heads, dropout)
        self.norm1 = nn.LayerNorm(embed_dim)
        self.ffn = nn.Sequential(nn.Linear(embed_dim, ff_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ff_dim, embed_dim), nn.Dropout(dropout))
        self.norm2 = nn.LayerNorm(embed_dim)

    def forward(self, x, causal_mask):
        x = x + self.attention(self.norm1(x), mask=causal_mask)
        return x + self.ffn(self.norm2(x))


class GPTModel001(nn.Module):
    def __init__(self, vocab_size, embed_dim=768, num_heads=12, num_layers=12, ff_dim=3072, max_len=1024,
                 dropout=0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_len, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([GPTBlock001(embed_dim, num_heads, ff_dim, dropout) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight

    def forward(self, input_ids):
        L = input_ids.shape[1]
        causal_mask = torch.tril(torch.ones(L, L)).unsqueeze(0).unsqueeze(0)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(torch.arange(L).unsqueeze(0)))
        for block in self.blocks:
            x = block(x, causal_mask)
        return self.lm_head(self.norm(x))


class PatchEmbedding001(nn.Module):
    def __init__(self, image_size=224, patch_size=16, in_channels=3, embed_dim=768):
        super().__init__()
        self.num_patches = (image_size // patch_size) ** 2
        self.projection = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):
        return self.projection(x).flatten(2).transpose(1, 2)


class VisionTransformer001(nn.Module):
    def __init__(self, image_size=224, patch_size=16, in_channels=3, num_classes=1000, embed_dim=768, num_heads=12,
                 num_layers=12, ff_dim=3072, dropout=0.1):
        super().__init__()
        self.patch_embed = PatchEmbedding001(image_size, patch_size, in_channels, embed_dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim))
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList([TransformerBlock001(embed_dim, num_heads, ff_dim, dropout)
                                      for _ in range(num_layers)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.dropout(x + self.pos_embed)
        for block in self.encoder:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class WindowAttention001(nn.Module):
    def __init__(self, dim, window_size, num_heads):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B_, N, C))


def window_partition(x, window_size):
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size, H, W):
    B = int(windows.shape[0] / (H * W / window_size / window_size))
    x = windows.view(B, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class SwinTransformerBlock001(nn.Module):
    def __init__(self, dim, num_heads, window_size=7, shift_size=0):
        super().__init__()
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention001(dim, window_size, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, H, W):
        B, L, C = x.shape
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.shift_size > 0:
            shifted_x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        else:
            shifted_x = x
        x_windows = window_partition(shifted_x, self.window_size).view(-1, self.window_size * self.window_size, C)
        attn_windows = self.attn(x_windows).view(-1, self.window_size, self.window_size, C)
        shifted_x = window_reverse(attn_windows, self.window_size, H, W)
        if self.shift_size > 0:
            x = torch.roll(shifted_x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        else:
            x = shifted_x
        x = shortcut + x.view(B, H * W, C)
        return x + self.mlp(self.norm2(x))


class GraphConvLayer001(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, X, adj_matrix):
        return self.linear(torch.matmul(adj_matrix, X))


class GCN001(nn.Module):
    def __init__(self, in_features, hidden_dims, num_classes, dropout=0.5):
        super().__init__()
        layers = []
        prev_dim = in_features
        for hidden_dim in hidden_dims:
            layers += [GraphConvLayer001(prev_dim, hidden_dim), nn.ReLU(), nn.Dropout(dropout)]
            prev_dim = hidden_dim
        layers.append(GraphConvLayer001(prev_dim, num_classes))
        self.layers = nn.ModuleList(layers)

    def forward(self, X, adj_matrix):
        a = adj_matrix + torch.eye(adj_matrix.size(0))
        d = torch.pow(a.sum(dim=1), -0.5)
        d[torch.isinf(d)] = 0.
        D = torch.diag(d)
        adj = D @ a @ D
        x = X
        for layer in self.layers:
            x = layer(x, adj) if isinstance(layer, GraphConvLayer001) else layer(x)
        return x


class GATLayer001(nn.Module):
    def __init__(self, in_features, out_features, num_heads=1, dropout=0.6, alpha=0.2):
        super().__init__()
        self.dropout = dropout
        self.W = nn.Parameter(torch.zeros(size=(in_features, out_features * num_heads)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.zeros(size=(2 * out_features * num_heads, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, X, adj_matrix):
        N = X.size(0)
        h = torch.mm(X, self.W)
        h_i = h.repeat(1, N).view(N * N, -1)
        h_j = h.repeat(N, 1)
        attention_input = torch.cat([h_i, h_j], dim=1).view(N, N, -1)
        e = self.leakyrelu(torch.matmul(attention_input, self.a).squeeze(-1))
        attention = torch.where(adj_matrix > 0, e, -9e15 * torch.ones_like(e))
        attention = F.dropout(self.softmax(attention), self.dropout, training=self.training)
        return torch.matmul(attention, h)


class GAT001(nn.Module):
    def __init__(self, in_features, hidden_dim, num_classes, num_heads=8, dropout=0.6):
        super().__init__()
        self.gat1 = GATLayer001(in_features, hidden_dim, num_heads=num_heads, dropout=dropout)
        self.gat2 = GATLayer001(hidden_dim * num_heads, num_classes, num_heads=1, dropout=dropout)
        self.dropout = dropout

    def forward(self, X, adj_matrix):
        x = F.dropout(X, self.dropout, training=self.training)
        x = F.elu(self.gat1(x, adj_matrix))
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(self.gat2(x, adj_matrix), dim=-1)


class LongformerAttention(nn.Module):
    def __init__(self, d_model, n_heads, window_size=512, global_tokens=[], dropout=0.1):  # noqa: B006 (guide)
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.window_size = window_size
        self.global_tokens = global_tokens
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_q_global = nn.Linear(d_model, d_model)
        self.w_k_global = nn.Linear(d_model, d_model)
        self.w_v_global = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _sliding_window_attention(self, q, k, v, window_size):
        batch_size, n_heads, seq_len, d_k = q.size()
        scores = torch.matmul(q, k.transpose(-2, -1)) / (d_k ** 0.5)
        mask = self._create_sliding_window_mask(seq_len, window_size, q.device)
        mask = mask.unsqueeze(0).unsqueeze(0)
        scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(attention, v)

    def _create_sliding_window_mask(self, seq_len, window_size, device):
        positions = torch.arange(seq_len, device=device)
        distance = positions.unsqueeze(0) - positions.unsqueeze(1)
        return (torch.abs(distance) <= window_size).float()

    def forward(self, x, global_mask=None):
        batch_size, seq_len, _ = x.size()
        Q = self.w_q(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        K = self.w_k(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        V = self.w_v(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
        output = self._sliding_window_attention(Q, K, V, self.window_size)
        if global_mask is not None:
            Q_global = self.w_q_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            K_global = self.w_k_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            V_global = self.w_v_global(x).view(batch_size, seq_len, self.n_heads, self.d_k).transpose(1, 2)
            global_scores = torch.matmul(Q_global, K_global.transpose(-2, -1)) / (self.d_k ** 0.5)
            global_output = torch.matmul(F.softmax(global_scores, dim=-1), V_global)
            mask_expanded = global_mask.unsqueeze(1).unsqueeze(-1)
            output = output * (1 - mask_expanded) + global_output * mask_expanded
        output = output.transpose(1, 2).contiguous().view(batch_size, seq_len, self.d_model)
        return self.dropout(self.w_o(output))


class LSTMCell(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.randn(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.randn(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.randn(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.randn(4 * hidden_size))
        std = 1.0 / (self.hidden_size) ** 0.5
        for weight in self.parameters():
            weight.data.uniform_(-std, std)

    def forward(self, x, hidden):
        h, c = hidden
        gates = (torch.mm(x, self.weight_ih.t()) + self.bias_ih + torch.mm(h, self.weight_hh.t()) + self.bias_hh)
        forget_gate, input_gate, output_gate, cell_candidate = gates.chunk(4, 1)
        f_t = torch.sigmoid(forget_gate)
        i_t = torch.sigmoid(input_gate)
        o_t = torch.sigmoid(output_gate)
        c_tilde = torch.tanh(cell_candidate)
        c_new = f_t * c + i_t * c_tilde
        h_new = o_t * torch.tanh(c_new)
        return h_new, c_new


class S4Layer(nn.Module):
    """Guide 000's S4 layer: Euler step at the mean dt, one shared state, a Python loop over time."""

    def __init__(self, d_model, d_state=64, dropout=0.1):
        super().__init__()
        self.d_model, self.d_state = d_model, d_state
        self.A = nn.Parameter(torch.randn(d_state, d_state))
        self.B = nn.Parameter(torch.randn(d_state, d_model))
        self.C = nn.Parameter(torch.randn(d_model, d_state))
        self.D = nn.Parameter(torch.randn(d_model))
        self.log_dt = nn.Parameter(torch.randn(d_model))
        self.dropout = nn.Dropout(dropout)
        nn.init.xavier_uniform_(self.A)
        nn.init.xavier_uniform_(self.B)
        nn.init.xavier_uniform_(self.C)

    def forward(self, x):
        batch_size, seq_len, _ = x.size()
        dt = torch.exp(self.log_dt)
        a_bar = torch.eye(self.d_state, device=self.A.device) + dt.mean() * self.A
        b_bar = dt.mean() * self.B
        h = torch.zeros(batch_size, self.d_state, device=x.device)
        outputs = []
        for t in range(seq_len):
            x_t = x[:, t, :]
            h = torch.matmul(h, a_bar.T) + torch.matmul(x_t, b_bar.T)
            outputs.append(torch.matmul(h, self.C.T) + x_t * self.D)
        return self.dropout(torch.stack(outputs, dim=1))


class MambaBlock(nn.Module):
    """Guide 000's Mamba block: a Python loop over time with B x L x D x N ``A_bar`` / ``B_bar`` tensors."""

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.d_state = d_state
        self.d_inner = d_model * expand
        self.d_conv = d_conv
        self.in_proj = nn.Linear(d_model, self.d_inner * 2)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, padding=d_conv - 1,
                                groups=self.d_inner)
        self.x_proj = nn.Linear(self.d_inner, d_state + d_state + self.d_inner)
        self.dt_proj = nn.Linear(self.d_inner, self.d_inner)
        self.A_log = nn.Parameter(torch.randn(self.d_inner, d_state))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def selective_scan(self, x, delta, A, B, C):
        batch_size, seq_len, d_inner = x.size()
        A_bar = torch.exp(delta.unsqueeze(-1) * A.unsqueeze(0).unsqueeze(0))
        B_bar = delta.unsqueeze(-1) * B.unsqueeze(2)
        h = torch.zeros(batch_size, d_inner, A.size(1), device=x.device)
        outputs = []
        for t in range(seq_len):
            h = A_bar[:, t] * h + B_bar[:, t] * x[:, t].unsqueeze(-1)
            outputs.append(torch.sum(C[:, t].unsqueeze(1) * h, dim=-1))
        return torch.stack(outputs, dim=1)

    def forward(self, x):
        residual = x
        x = self.norm(x)
        x, z = self.in_proj(x).chunk(2, dim=-1)
        x = x.transpose(1, 2)
        x = self.conv1d(x)[:, :, :x.size(2)]
        x = x.transpose(1, 2)
        x = F.silu(x)
        delta, B, C = torch.split(self.x_proj(x), [self.d_inner, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        A = -torch.exp(self.A_log)
        y = self.selective_scan(x, delta, A, B, C)
        y = y + x * self.D.unsqueeze(0).unsqueeze(0)
        y = y * F.silu(z)
        return self.dropout(self.out_proj(y)) + residual


# ============================================= guide 003 ==================================================
class TokenEmbedding003(nn.Module):
    def __init__(self, vocab_size, d_model):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.embedding(x) * math.sqrt(self.d_model)


class SinusoidalPositionalEncoding003(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, :x.size(1), :]


class LearnedPositionalEncoding003(nn.Module):
    def __init__(self, d_model, max_len=5000):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(1, max_len, d_model))

    def forward(self, x):
        return x + self.pe[:, :x.size(1), :]


def apply_rotary003(x, sin, cos):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class MultiHeadAttention003(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1, rotary=False):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.W_O = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.rotary = rotary

    def forward(self, x, mask=None, causal=False):
        B, L, _ = x.shape
        Q = self.W_Q(x).view(B, L, self.n_heads, self.d_head)
        K = self.W_K(x).view(B, L, self.n_heads, self.d_head)
        if self.rotary:  # FIX: the guide's RoPE module (with the head size), applied in (B, L, H, d) layout
            inv_freq = 1.0 / (10000 ** (torch.arange(0, self.d_head, 2).float() / self.d_head))
            sincos = torch.einsum('i,j->ij', torch.arange(L).float(), inv_freq)
            sin, cos = sincos.sin()[None, :, None, :], sincos.cos()[None, :, None, :]
            Q, K = apply_rotary003(Q, sin, cos), apply_rotary003(K, sin, cos)
        Q, K = Q.transpose(1, 2), K.transpose(1, 2)
        V = self.W_V(x).view(B, L, self.n_heads, self.d_head).transpose(1, 2)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_head)
        if causal:
            scores = scores.masked_fill(torch.triu(torch.ones(L, L), diagonal=1).bool(), float('-inf'))
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1).unsqueeze(1) == 0, float('-inf'))
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = torch.matmul(attn, V).transpose(1, 2).contiguous().view(B, L, self.d_model)
        return self.W_O(out)


class FeedFowardNetwork003(nn.Module):
    def __init__(self, d_model, d_ffn, dropout=0.1):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ffn, bias=True), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(d_ffn, d_model, bias=True))

    def forward(self, X):
        return self.ffn(X)


def layer_norm003(x, gamma, beta, eps=1e-6):
    """Guide 003's ``LayerNorm.forward`` on given parameters: unbiased std, ``eps`` added to the std."""
    mean = x.mean(dim=-1, keepdim=True)
    std = x.std(dim=-1, keepdim=True)
    return gamma * (x - mean) / (std + eps) + beta


class LayerNorm003(nn.Module):
    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        return layer_norm003(x, self.gamma, self.beta, self.eps)


class TransformerBlock003(nn.Module):
    def __init__(self, d_model, n_heads, d_ffn, dropout=0.1, norm_type='layer', rotary=False):  # FIX: norm_type
        super().__init__()
        self.mha = MultiHeadAttention003(d_model=d_model, n_heads=n_heads, rotary=rotary)  # FIX: undefined class
        self.ln1 = nn.LayerNorm(d_model)
        self.ffn = FeedFowardNetwork003(d_model=d_model, d_ffn=d_ffn)
        self.ln2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, X, mask=None, causal=False):
        X = X + self.dropout(self.mha(X, mask, causal))
        X = self.ln1(X)
        X = X + self.dropout(self.ffn(X))
        return self.ln2(X)


class Transformer003(nn.Module):
    def __init__(self, vocab_size, d_model=512, n_heads=8, n_layers=6, d_ff=2048, max_len=5000, dropout=0.1,
                 mode='encoder', pos_encoding='sinusoidal', norm_type='layer'):
        super().__init__()
        self.mode = mode
        self.token_embedding = TokenEmbedding003(vocab_size, d_model)
        if pos_encoding == 'sinusoidal':
            self.pos_encoding = SinusoidalPositionalEncoding003(d_model, max_len)
        elif pos_encoding == 'learned':
            self.pos_encoding = LearnedPositionalEncoding003(d_model, max_len)
        else:
            self.pos_encoding = None
        self.blocks = nn.ModuleList([TransformerBlock003(d_model, n_heads, d_ff, dropout, norm_type,
                                                         rotary=pos_encoding == 'rotary') for _ in range(n_layers)])
        self.final_norm = LayerNorm003(d_model)
        self.output_projection = nn.Linear(d_model, vocab_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        x = self.token_embedding(x)
        if self.pos_encoding is not None:
            x = self.pos_encoding(x)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask, causal=(self.mode == 'decoder'))
        return self.output_projection(self.final_norm(x))


# ============================================= tokenizers =================================================
def bpe_train(texts, num_merges):
    """The guide's BPE training loop (recount every pair and rewrite every word per merge), with the
    end-of-word marker kept whole (FIX: the guide splits ``</w>`` into four symbols). Returns the merges."""
    freq = Counter(w for t in texts for w in t.lower().split())
    words = {" ".join(list(w[:-1]) + [w[-1] + "</w>"]): c for w, c in freq.items()}
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for w, c in words.items():
            s = w.split()
            for p in zip(s, s[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=pairs.get)
        big, rep = " ".join(best), "".join(best)
        words = {w.replace(big, rep): c for w, c in words.items()}
        merges.append(best)
    return merges
