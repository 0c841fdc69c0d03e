"""Tiny language models for the generation tests, following the model protocols of
:mod:`fastarch.generation.adapter`, and a plain PyTorch attention that implements fastarch.ops.attention's
semantics (bottom-right alignment)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastarch.generation import KVCache


def ref_attention(q, k, v, *, causal=False, window=(-1, -1), key_padding_mask=None, attn_bias=None):
    """Dense attention per the op's spec: (B,H,Lq,D) x (B,Hk,Lk,D); fully masked rows give 0."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    rep = H // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).float()
    v = v.repeat_interleave(rep, dim=1).float()
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(D)
    if attn_bias is not None:
        s = s + attn_bias.float()
    left, right = window
    if causal:
        right = 0
    i = torch.arange(Lq).view(-1, 1) + (Lk - Lq)
    j = torch.arange(Lk).view(1, -1)
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    allowed = allowed.view(1, 1, Lq, Lk).expand(B, H, Lq, Lk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.view(B, 1, 1, Lk)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v).to(q.dtype)


def op_attention(q, k, v, **kw):
    from fastarch.ops.attention import attention

    return attention(q, k, v, **kw)


class TinyGPT(nn.Module):
    """A 2-layer GQA transformer LM with learned positions; ``forward(ids, kv_cache=None) -> (B, T, V)``."""

    def __init__(self, vocab_size=13, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48,
                 window=None, attn=ref_attention):
        super().__init__()
        self.vocab_size, self.n_layers, self.n_heads, self.n_kv = vocab_size, n_layers, n_heads, n_kv_heads
        self.hd = d_model // n_heads
        self.max_seq_len, self.window, self.attn = max_seq_len, window, attn
        self.emb = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.qkv = nn.ModuleList(nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.hd) for _ in range(n_layers))
        self.proj = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 32), nn.GELU(), nn.Linear(32, d_model))
                                 for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab_size)
        self.forward_calls = 0

    def allocate_kv_cache(self, batch_size, max_seq_len, dtype=None, device=None):
        return KVCache(max_seq_len, self.n_kv, self.hd, self.n_layers, batch_size=batch_size,
                       dtype=dtype or torch.float32, device=device or "cpu", window=self.window)

    def forward(self, input_ids, kv_cache=None):
        self.forward_calls += 1
        B, T = input_ids.shape
        start = kv_cache.seq_len if kv_cache is not None else 0
        x = self.emb(input_ids) + self.pos(torch.arange(start, start + T))
        H, Hk, hd = self.n_heads, self.n_kv, self.hd
        for i in range(self.n_layers):
            qkv = self.qkv[i](F.layer_norm(x, x.shape[-1:]))
            q, k, v = qkv.split([H * hd, Hk * hd, Hk * hd], dim=-1)
            q = q.view(B, T, H, hd).transpose(1, 2)
            k = k.view(B, T, Hk, hd).transpose(1, 2)
            v = v.view(B, T, Hk, hd).transpose(1, 2)
            if kv_cache is not None:
                k, v = kv_cache.update(i, k, v)
                kw = kv_cache.attention_kwargs(i)
            else:
                kw = {"causal": True}
                if self.window is not None:
                    kw["window"] = (self.window, 0)
            o = self.attn(q, k, v, **kw).transpose(1, 2).reshape(B, T, H * hd)
            x = x + self.proj[i](o)
            x = x + self.mlp[i](F.layer_norm(x, x.shape[-1:]))
        return self.head(F.layer_norm(x, x.shape[-1:]))


class TinyRecurrentLM(nn.Module):
    """A gated linear recurrence with MambaLM's protocol: forward (B,L)->(B,L,V), step (B,)->(B,V)."""

    def __init__(self, vocab_size=11, d=12):
        super().__init__()
        self.vocab_size, self.d = vocab_size, d
        self.emb = nn.Embedding(vocab_size, d)
        self.gate = nn.Linear(d, d)
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab_size)

    def allocate_inference_cache(self, batch_size, dtype=None, device=None):
        return {"h": torch.zeros(batch_size, self.d, dtype=dtype or torch.float32, device=device)}

    def _cell(self, h, x):
        a = torch.sigmoid(self.gate(x))
        return a * h + (1 - a) * torch.tanh(self.inp(x))

    def forward(self, input_ids):
        e = self.emb(input_ids)
        h = torch.zeros(e.shape[0], self.d)
        outs = []
        for t in range(e.shape[1]):
            h = self._cell(h, e[:, t])
            outs.append(self.out(h))
        return torch.stack(outs, dim=1)

    def step(self, input_ids, cache):
        ids = input_ids.reshape(-1)
        h = self._cell(cache["h"], self.emb(ids))
        cache["h"].copy_(h)
        return self.out(h)


class TableLM(nn.Module):
    """Logits are a fixed function of the last two tokens: log-probs are easy to enumerate."""

    def __init__(self, vocab_size=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.table = nn.Parameter(torch.randn(vocab_size, vocab_size, vocab_size, generator=g) * 2.0)

    def forward(self, input_ids):
        prev2 = torch.cat([input_ids[:, :1], input_ids[:, :-1]], dim=1)
        return self.table[prev2, input_ids]
