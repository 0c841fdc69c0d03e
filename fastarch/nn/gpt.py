"""GPT family, drop-in: guide 000's ``GPTTransformer``/``GPTDecoderLayer`` and guide 001's
``GPTModel``/``GPTBlock``, with causal attention through ``fastarch.ops.attention`` and a KV cache.

Deviations (docs/models.md):

- Guide 000's ``generate_causal_mask`` marks the *future* with True and its attention masks where the mask
  is 0, so as written every token sees only the strictly later tokens. Here the attention is causal (each
  token sees itself and the past), which is what the guide describes.
- ``attention_mask`` (B, L) (accepted and ignored by guide 000) masks padded keys here (1 = real token).
  ``GPTModel`` also takes it with a KV cache and in ``generate`` (left-padded prompts): positions then come
  from the cumulative mask, as Hugging Face's GPT-2 numbers them, and the cache remembers the padding.
- ``GPTBlock``/``GPTModel`` take ``activation="gelu"`` (exact, the guide's) or ``"gelu_new"`` (the tanh
  approximation GPT-2 checkpoints use) and ``layer_norm_eps``.
- ``logits_to_keep=k`` computes logits for the last ``k`` positions only; ``generate`` prefills with 1.
- ``forward(..., kv_cache=cache)`` appends this call's keys/values to ``cache`` (layer index = block index)
  and places the new tokens at positions ``cache.seq_len ...`` (or ``start_pos``); ``allocate_kv_cache``
  builds a cache sized for the model. ``generate`` decodes with the cache: one token per step instead of
  re-running the whole prefix, the same distribution as the guide's loop.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._models_common import check_input, gelu_module, keep_logits, layer_norm
from .attention import FusedQKVAttention
from .kv_cache import KVCache
from .linear import Linear
from .transformer import TransformerEncoderLayer

__all__ = ["GPTDecoderLayer", "GPTTransformer", "GPTBlock", "GPTModel"]


def _new_cache(model, batch_size, max_seq_len, dtype, device):
    p = next(model.parameters())
    dtype = dtype or p.dtype
    device = device or p.device
    max_seq_len = max_seq_len or model.max_seq_len
    if max_seq_len > model.max_seq_len:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's position table ({model.max_seq_len})")
    return KVCache(max_seq_len, model.n_heads, model.d_model // model.n_heads, model.n_layers,
                   batch_size=batch_size, dtype=dtype, device=device)


def _positions(input_ids, kv_cache, start_pos, max_len):
    b, n = input_ids.shape
    start = int(start_pos) if start_pos is not None else (int(kv_cache.seq_len) if kv_cache is not None else 0)
    if start + n > max_len:
        raise ValueError(f"positions {start}..{start + n - 1} exceed max_len {max_len}")
    return torch.arange(start, start + n, device=input_ids.device).unsqueeze(0)


def _mask_positions(attention_mask: torch.Tensor, past_real: torch.Tensor | int, max_len: int) -> torch.Tensor:
    """Position ids (B, L) from a 0/1 mask: real tokens count up from the real tokens before them; padding
    gets position 0."""
    pos = attention_mask.long().cumsum(-1) - 1 + past_real
    pos = pos.masked_fill(attention_mask == 0, 0)
    if pos.numel() and int(pos.max()) >= max_len:
        raise ValueError(f"positions up to {int(pos.max())} exceed max_len {max_len}")
    return pos


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    if top_p is not None:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


class _GPTBase(nn.Module):
    max_seq_len: int
    n_layers: int
    n_heads: int
    d_model: int

    def allocate_kv_cache(self, batch_size: int, max_seq_len: int | None = None, dtype=None, device=None):
        """A KV cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens (default: the model's)."""
        return _new_cache(self, batch_size, max_seq_len, dtype, device)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 50, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, *,
                 attention_mask: torch.Tensor | None = None, do_sample: bool = True) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after the prompt (B, L) -> (B, L + max_new_tokens).

        ``attention_mask`` (B, L), 1 = real token, for padded prompts (left padding: the new tokens follow
        each prompt's last real token). ``do_sample=False`` decodes greedily."""
        check_input("input_ids", input_ids, ndim=2, integer=True, owner=type(self).__name__)
        if temperature <= 0:
            raise ValueError(f"argument 'temperature' must be > 0, got {temperature}")
        if attention_mask is not None:
            check_input("attention_mask", attention_mask, ndim=2, owner=type(self).__name__)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"argument 'attention_mask' must have the shape of 'input_ids' "
                                 f"{tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
        self.eval()
        total = input_ids.shape[1] + max_new_tokens
        if max_new_tokens <= 0:
            return input_ids
        if total > self.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_len {self.max_seq_len}")
        cache = self.allocate_kv_cache(input_ids.shape[0], total)
        mask_kw = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = self(input_ids, kv_cache=cache, logits_to_keep=1, **mask_kw)[:, -1]
        out = [input_ids]
        for i in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_k, top_p) if do_sample else logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = self(nxt, kv_cache=cache, logits_to_keep=1)[:, -1]
        return torch.cat(out, 1)


class GPTDecoderLayer(TransformerEncoderLayer):
    """Guide 000 GPT layer: x = norm1(MHA(x) + x) (MHA with its own add & norm), x = norm2(FFN_gelu(x) + x);
    guide 000's encoder layer with a GELU feed-forward, causal by default."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1):
        super().__init__(d_model, n_heads, d_ff, dropout, activation="gelu")

    def forward(self, x, mask=None, *, causal: bool = True, kv_cache=None, layer_idx: int = 0):
        return super().forward(x, mask, causal=causal, kv_cache=kv_cache, layer_idx=layer_idx)


class GPTTransformer(_GPTBase):
    """Decoder-only LM of guide 000 (tied embedding / lm_head).

    forward(input_ids (B, L), attention_mask (B, L) or None, *, kv_cache=None, start_pos=None) -> (B, L, V).
    """

    def __init__(self, vocab_size: int, d_model: int = 768, n_heads: int = 12, num_layers: int = 12,
                 d_ff: int = 3072, max_len: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(GPTDecoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.dropout = nn.Dropout(dropout)
        self.d_model, self.n_heads, self.n_layers, self.max_seq_len = d_model, n_heads, num_layers, max_len

    def generate_causal_mask(self, sz: int) -> torch.Tensor:
        """The guide's helper (True above the diagonal); not used by forward, which attends causally."""
        return torch.triu(torch.ones(sz, sz), diagonal=1).bool()

    def forward(self, input_ids, attention_mask=None, *, kv_cache=None, start_pos=None, logits_to_keep: int = 0):
        check_input("input_ids", input_ids, ndim=2, integer=True, owner="GPTTransformer")
        pos = _positions(input_ids, kv_cache, start_pos, self.max_seq_len)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(pos))
        mask = None
        if attention_mask is not None:
            if kv_cache is not None:
                raise ValueError("GPTTransformer: 'attention_mask' is not supported together with 'kv_cache'")
            check_input("attention_mask", attention_mask, ndim=2, owner="GPTTransformer")
            mask = attention_mask[:, None, None, :]
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, causal=True, kv_cache=kv_cache, layer_idx=i)
        return self.lm_head(layer_norm(keep_logits(x, logits_to_keep), self.norm))


class GPTBlock(nn.Module):
    """Guide 001 pre-norm GPT block: x += attn(norm1(x)); x += ffn(norm2(x)). Keys ``attention.qkv``,
    ``attention.out_proj``, ``norm1``, ``ffn.{0,3}``, ``norm2``. ``activation``: ``"gelu"`` (exact) or
    ``"gelu_new"`` (tanh approximation, GPT-2's)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, dropout: float = 0.1, *,
                 activation: str = "gelu", layer_norm_eps: float = 1e-5):
        super().__init__()
        self.attention = FusedQKVAttention(embed_dim, num_heads, dropout)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.ffn = nn.Sequential(Linear(embed_dim, ff_dim), gelu_module(activation), nn.Dropout(dropout),
                                 Linear(ff_dim, embed_dim), nn.Dropout(dropout))
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.activation = activation

    def forward(self, x, causal_mask=None, *, causal: bool | None = None, kv_cache=None, layer_idx: int = 0,
                key_padding_mask: torch.Tensor | None = None):
        """x (B, L, E) -> (B, L, E). ``key_padding_mask`` (B, L) bool marks this call's real tokens; with a
        ``kv_cache`` it is stored there, so later calls keep masking the padded positions."""
        # The guide passes a lower-triangular 1/0 mask; without one the block is causal.
        use_causal = causal if causal is not None else causal_mask is None
        pad = {} if key_padding_mask is None else (
            {"kv_valid": key_padding_mask} if kv_cache is not None else {"key_padding_mask": key_padding_mask})
        x = x + self.attention(layer_norm(x, self.norm1), causal_mask, causal=use_causal, kv_cache=kv_cache,
                               layer_idx=layer_idx, **pad)
        return x + self.ffn(layer_norm(x, self.norm2))


class GPTModel(_GPTBase):
    """GPT-2-style LM of guide 001 (pre-norm blocks, tied lm_head); ``gpt2_small`` is this at 124,439,808
    parameters.

    forward(input_ids (B, L), attention_mask (B, L) or None, *, kv_cache=None, start_pos=None,
    logits_to_keep=0) -> logits (B, L or logits_to_keep, V). ``attention_mask``: 1 = real token (right or
    left padding); positions then follow the mask (the k-th real token of a row is at position k - 1).
    With a ``kv_cache`` the mask covers this call's tokens (or, as Hugging Face passes it, every token
    so far; its last L columns are used) and the cache keeps it for later calls.
    """

    def __init__(self, vocab_size: int, embed_dim: int = 768, num_heads: int = 12, num_layers: int = 12,
                 ff_dim: int = 3072, max_len: int = 1024, dropout: float = 0.1, *, activation: str = "gelu",
                 layer_norm_eps: float = 1e-5):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_len, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(embed_dim, num_heads, ff_dim, dropout, activation=activation,
                                             layer_norm_eps=layer_norm_eps) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.lm_head = Linear(embed_dim, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.d_model, self.n_heads, self.n_layers, self.max_seq_len = embed_dim, num_heads, num_layers, max_len
        self.activation = activation

    def _mask_and_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, kv_cache,
                            start_pos) -> tuple[torch.Tensor | None, torch.Tensor]:
        if attention_mask is None:
            if kv_cache is not None and start_pos is None and kv_cache.key_padding_mask(0) is not None:
                # Padding recorded by an earlier call: new tokens follow each row's real tokens.
                real = kv_cache.key_padding_mask(0).sum(1, keepdim=True)
                ones = torch.ones_like(input_ids)
                return None, _mask_positions(ones, real, self.max_seq_len)
            return None, _positions(input_ids, kv_cache, start_pos, self.max_seq_len)
        check_input("attention_mask", attention_mask, ndim=2, owner="GPTModel")
        B, L = input_ids.shape
        past = int(kv_cache.seq_len) if kv_cache is not None else 0
        if attention_mask.shape[0] != B or attention_mask.shape[1] not in (L, past + L):
            want = f"({B}, {L})" + (f" or ({B}, {past + L})" if past else "")
            raise ValueError(f"GPTModel: argument 'attention_mask' must have shape {want}, "
                             f"got {tuple(attention_mask.shape)}")
        if start_pos is not None:
            raise ValueError("GPTModel: give 'attention_mask' or 'start_pos', not both (the mask sets positions)")
        own = attention_mask[:, -L:] != 0
        if attention_mask.shape[1] == past + L:
            pos = _mask_positions(attention_mask, 0, self.max_seq_len)[:, -L:]
        else:
            prev = kv_cache.key_padding_mask(0) if kv_cache is not None and past else None
            real = prev.sum(1, keepdim=True) if prev is not None else past
            pos = _mask_positions(own, real, self.max_seq_len)
        if kv_cache is None and bool(own.all()):
            return None, pos  # nothing padded: the unmasked path
        return own, pos

    def forward(self, input_ids, attention_mask=None, *, kv_cache=None, start_pos=None, logits_to_keep: int = 0):
        check_input("input_ids", input_ids, ndim=2, integer=True, owner="GPTModel")
        keep_logits(input_ids[..., None], logits_to_keep)  # validate before any work
        pad, pos = self._mask_and_positions(input_ids, attention_mask, kv_cache, start_pos)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(pos))
        for i, block in enumerate(self.blocks):
            x = block(x, causal=True, kv_cache=kv_cache, layer_idx=i, key_padding_mask=pad)
        return self.lm_head(layer_norm(keep_logits(x, logits_to_keep), self.norm))
