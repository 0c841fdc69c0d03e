"""Guide-000 attention modules (drop-ins) and a ``torch.nn.MultiheadAttention``-compatible wrapper, all on
``fastarch.ops.attention``.

Drop-ins keep the guide's class names, constructor arguments, ``state_dict`` keys and, in eval mode,
outputs for the same weights:

- ``ScaledDotProductAttention(temperature=None, dropout=0.1)``: ``forward(q, k, v, mask=None)`` ->
  ``(output, attention_weights)``;
- ``MultiHeadAttention(d_model, n_heads, dropout=0.1)``: projections ``w_q/w_k/w_v/w_o``, then
  ``layer_norm(dropout(w_o(.)) + q)`` as in the guide; returns ``(output, attention_weights)``;
- ``SelfAttention`` / ``CrossAttention``: the guide's thin wrappers (key prefix ``mha.``);
- ``LongformerAttention(d_model, n_heads, window_size=512, global_tokens=[], dropout=0.1)``.

Deviations (documented in docs/attention.md):

- the attention weights the guide returns are an ``(B, H, Lq, Lk)`` tensor; they are computed only when
  asked (``need_weights=True``, the default, for compatibility) from the op's log-sum-exp. Pass
  ``need_weights=False`` to the constructor to skip them (the second output is then ``None``) and keep
  memory O(L);
- dropout on the attention probabilities uses the op's deterministic hash mask instead of ``nn.Dropout``'s
  RNG (same distribution, different draws); the returned weights in training mode use the same mask;
- a mask is ``mask == 0`` -> masked, broadcastable to ``(B, H, Lq, Lk)``; a query row whose keys are all
  masked gets the guide's value (softmax of all ``-1e9`` = uniform over every key), not the op's 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.attention import attention, dropout_keep_mask

__all__ = [
    "ScaledDotProductAttention",
    "MultiHeadAttention",
    "SelfAttention",
    "CrossAttention",
    "LongformerAttention",
    "MultiheadAttention",
]


def _draw_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def _mask_to_op(mask: torch.Tensor, B: int, H: int, Lq: int, Lk: int, dtype: torch.dtype):
    """A guide mask (``0`` = masked, broadcastable to (B, H, Lq, Lk)) -> (key_padding_mask, attn_bias,
    keep) for the op; ``keep`` is the bool mask (broadcast shape) used for the all-masked-row patch."""
    keep = mask != 0
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    if keep.dim() > 4:
        raise ValueError(f"mask must be broadcastable to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}, "
                         f"got shape {tuple(mask.shape)}")
    try:
        torch.broadcast_shapes(keep.shape, (B, H, Lq, Lk))
    except RuntimeError:
        raise ValueError(f"mask must be broadcastable to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}, "
                         f"got shape {tuple(mask.shape)}") from None
    if keep.shape[1] == 1 and keep.shape[2] == 1:
        # A key padding mask: the op takes it directly (no dense bias).
        return keep.expand(B, 1, 1, Lk).reshape(B, Lk).contiguous(), None, keep
    bias = torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, float("-inf"))
    return None, bias, keep


def _pad_last(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


class ScaledDotProductAttention(nn.Module):
    """Guide 000's scaled dot-product attention on the fused op.

    q ``(B, H, Lq, Dk)``, k ``(B, H, Lk, Dk)``, v ``(B, H, Lk, Dv)``; mask broadcastable to
    ``(B, H, Lq, Lk)`` with 0 = masked. Returns ``(output (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``.
    ``need_weights=False`` (constructor keyword, not in the guide) skips the dense weights.
    """

    def __init__(self, temperature: float | None = None, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(dropout)  # kept for the guide's attribute (its p is what the op uses)
        self.need_weights = need_weights

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"ScaledDotProductAttention: q, k, v must be (B, H, L, D), got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        B, H, Lq, Dk = q.shape
        Lk, Dv = k.shape[2], v.shape[-1]
        temperature = self.temperature or Dk**0.5
        scale = 1.0 / temperature
        p = self.dropout.p if self.training else 0.0
        seed = _draw_seed() if p > 0 else 0
        kpm = bias = keep = None
        if mask is not None:
            kpm, bias, keep = _mask_to_op(mask, B, H, Lq, Lk, q.dtype)
        # The op wants one head dim for q, k and v: zero-pad the smaller (scores and outputs unchanged).
        Dm = max(Dk, Dv)
        qq, kk, vv = _pad_last(q, Dm), _pad_last(k, Dm), _pad_last(v, Dm)
        out, lse = attention(qq, kk, vv, key_padding_mask=kpm, attn_bias=bias, dropout_p=p, scale=scale,
                             dropout_seed=seed, return_lse=True)
        out = out[..., :Dv]
        weights = None
        if self.need_weights:
            s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
            if bias is not None:
                s = s + bias.float()
            if kpm is not None:
                s = s.masked_fill(~kpm.view(B, 1, 1, Lk), float("-inf"))
            lse_f = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
            weights = torch.exp(s - lse_f.unsqueeze(-1))
            if p > 0:
                weights = weights * dropout_keep_mask(seed, B, H, Lq, Lk, p, q.device) / (1.0 - p)
        if keep is not None:
            empty = ~keep.any(-1, keepdim=True)  # rows the guide fills uniformly (softmax of all -1e9)
            if bool(empty.any()):
                uniform = v.mean(-2, keepdim=True)
                if p > 0:  # the guide drops the uniform weights too
                    kp = dropout_keep_mask(seed, B, H, Lq, Lk, p, q.device).to(v.dtype) / (1.0 - p)
                    uniform = torch.matmul(kp, v) / Lk
                out = torch.where(empty, uniform.to(out.dtype), out)
                if weights is not None:
                    w_u = torch.full_like(weights, 1.0 / Lk)
                    if p > 0:
                        w_u = w_u * dropout_keep_mask(seed, B, H, Lq, Lk, p, q.device) / (1.0 - p)
                    weights = torch.where(empty, w_u, weights)
        if weights is not None:
            weights = weights.to(q.dtype)
        return out, weights


class MultiHeadAttention(nn.Module):
    """Guide 000's multi-head attention: ``w_q/w_k/w_v/w_o`` projections, attention on the fused op,
    ``dropout``, then ``layer_norm(out + q)``.

    q ``(B, Lq, d_model)``, k/v ``(B, Lk, d_model)``, mask broadcastable to ``(B, H, Lq, Lk)`` (0 = masked).
    Returns ``(output (B, Lq, d_model), weights (B, H, Lq, Lk) or None)``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.attention = ScaledDotProductAttention(dropout=dropout, need_weights=need_weights)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.n_heads, self.d_k).transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"MultiHeadAttention: '{name}' must be (B, L, {self.d_model}), "
                                 f"got {tuple(t.shape)}")
        B = q.shape[0]
        residual = q
        out, weights = self.attention(self._heads(self.w_q(q)), self._heads(self.w_k(k)),
                                      self._heads(self.w_v(v)), mask)
        out = out.transpose(1, 2).reshape(B, -1, self.d_model)
        out = self.dropout(self.w_o(out))
        return self.layer_norm(out + residual), weights


class SelfAttention(nn.Module):
    """Guide 000: ``MultiHeadAttention(x, x, x, mask)``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout, need_weights=need_weights)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        return self.mha(x, x, x, mask)


class CrossAttention(nn.Module):
    """Guide 000: queries from ``q`` (decoder), keys/values from ``kv`` (encoder)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout, need_weights=need_weights)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None):
        return self.mha(q, kv, kv, mask)


class LongformerAttention(nn.Module):
    """Guide 000's Longformer attention on the fused op: local attention over ``window=(w, w)`` (O(L*w)
    time and memory instead of the guide's dense L x L mask), plus global attention.

    ``global_mode="guide"`` (default) reproduces the guide: global query rows (``global_mask``) use the
    global projections over every token and are blended as ``local * (1 - m) + global * m``.
    ``global_mode="hf"`` gives Hugging Face Longformer semantics: every token attends its window *and*
    the global tokens (local projections, no double counting), and global tokens attend every token with
    the global projections. ``global_tokens`` (positions) is used when ``global_mask`` is None.

    x ``(B, L, d_model)``, global_mask ``(B, L)`` (1 = global) -> ``(B, L, d_model)``.
    """

    def __init__(self, d_model: int, n_heads: int, window_size: int = 512, global_tokens=None,
                 dropout: float = 0.1, *, global_mode: str = "guide"):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"LongformerAttention: d_model={d_model} must be divisible by n_heads={n_heads}")
        if window_size < 0:
            raise ValueError(f"LongformerAttention: window_size must be >= 0, got {window_size}")
        if global_mode not in ("guide", "hf"):
            raise ValueError(f"LongformerAttention: global_mode must be 'guide' or 'hf', got {global_mode!r}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.window_size = window_size
        self.global_tokens = list(global_tokens) if global_tokens is not None else []
        self.global_mode = global_mode
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_q_global = nn.Linear(d_model, d_model)
        self.w_k_global = nn.Linear(d_model, d_model)
        self.w_v_global = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, self.d_k).transpose(1, 2)

    def _global_rows(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Global attention for the gathered global rows: (B, H, G, d_k)."""
        B = x.shape[0]
        xg = torch.gather(x, 1, idx.unsqueeze(-1).expand(B, idx.shape[1], self.d_model))
        qg = self._heads(self.w_q_global(xg))
        kg = self._heads(self.w_k_global(x))
        vg = self._heads(self.w_v_global(x))
        return attention(qg, kg, vg)

    def forward(self, x: torch.Tensor, global_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"LongformerAttention: 'x' must be (B, L, {self.d_model}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        if global_mask is None and self.global_tokens:
            global_mask = torch.zeros(B, L, device=x.device, dtype=x.dtype)
            global_mask[:, [t for t in self.global_tokens if -L <= t < L]] = 1
        if global_mask is not None and tuple(global_mask.shape) != (B, L):
            raise ValueError(f"LongformerAttention: 'global_mask' must be (B, L) = {(B, L)}, "
                             f"got {tuple(global_mask.shape)}")
        p = self.dropout.p if self.training else 0.0
        q, k, v = self._heads(self.w_q(x)), self._heads(self.w_k(x)), self._heads(self.w_v(x))
        w = self.window_size
        gm = None if global_mask is None else global_mask.to(x.dtype)
        binary = gm is not None and bool(((gm == 0) | (gm == 1)).all())
        idx = valid = None
        if binary:
            # Positions of the global tokens per batch row, padded to the largest count G.
            G = int(gm.sum(-1).max().item())
            if G == 0:
                gm = None
            else:
                order = torch.argsort((gm == 0).to(torch.int8), dim=1, stable=True)
                idx = order[:, :G]
                valid = torch.gather(gm, 1, idx) == 1

        if self.global_mode == "hf" and gm is not None and idx is not None:
            out = self._hf_local(q, k, v, idx, valid, w, p)
        else:
            out = attention(q, k, v, window=(w, w), dropout_p=p)

        if gm is not None:
            if idx is not None:
                og = self._global_rows(x, idx)  # (B, H, G, d_k)
                # Scatter the global rows into the output (padding slots point at position idx but are
                # invalid: they keep the local value).
                cur = torch.gather(out, 2, idx.view(B, 1, -1, 1).expand(B, self.n_heads, idx.shape[1], self.d_k))
                new = torch.where(valid.view(B, 1, -1, 1), og.to(out.dtype), cur)
                out = out.scatter(2, idx.view(B, 1, -1, 1).expand_as(new), new)
            else:  # fractional mask: the guide's blend over every row
                qg = self._heads(self.w_q_global(x))
                og = attention(qg, self._heads(self.w_k_global(x)), self._heads(self.w_v_global(x)))
                m = gm.view(B, 1, L, 1)
                out = out * (1 - m) + og * m
        out = out.transpose(1, 2).reshape(B, L, self.d_model)
        return self.dropout(self.w_o(out))

    def _hf_local(self, q, k, v, idx, valid, w, p):
        """Every query attends its window and the global tokens: two op calls merged by their lse."""
        B, H, L, D = q.shape
        G = idx.shape[1]
        o1, l1 = attention(q, k, v, window=(w, w), dropout_p=p, return_lse=True)
        gi = idx.view(B, 1, G, 1).expand(B, H, G, D)
        kg, vg = torch.gather(k, 2, gi), torch.gather(v, 2, gi)
        # Exclude global keys already inside the window (no double counting) and the padding slots.
        pos = torch.arange(L, device=q.device).view(1, L, 1)
        inside = (pos - idx.view(B, 1, G)).abs() <= w
        blocked = inside | ~valid.view(B, 1, G)
        bias = torch.zeros(B, 1, L, G, dtype=q.dtype, device=q.device).masked_fill(blocked.unsqueeze(1),
                                                                                     float("-inf"))
        o2, l2 = attention(q, kg, vg, attn_bias=bias, return_lse=True)
        lse = torch.logaddexp(l1, l2)
        lse_s = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        a1 = torch.exp(l1 - lse_s).unsqueeze(-1)
        a2 = torch.exp(l2 - lse_s).unsqueeze(-1)
        return (o1.float() * a1 + o2.float() * a2).to(q.dtype)


class MultiheadAttention(nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` with the same constructor, parameters and ``state_dict``, whose
    forward runs on the fused op when it can: ``need_weights=False``, no ``add_bias_kv`` /
    ``add_zero_attn``. Otherwise (weights requested, ...) it defers to torch's implementation.

    Differences on the fused path: a query row whose keys are all masked gives 0 (torch gives NaN);
    dropout uses the op's hash mask.
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if need_weights or self.bias_k is not None or self.add_zero_attn or query.dim() != 3:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, Lq, E = query.shape
        Lk = key.shape[1]
        H, Dh = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.chunk(3)
        q = F.linear(query, wq, bq).view(B, Lq, H, Dh).transpose(1, 2)
        k = F.linear(key, wk, bk).view(B, Lk, H, Dh).transpose(1, 2)
        v = F.linear(value, wv, bv).view(B, Lk, H, Dh).transpose(1, 2)
        kpm = None
        bias = None
        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                kpm = ~key_padding_mask  # torch: True = ignore; the op: True = real token
            else:
                bias = key_padding_mask.to(q.dtype).view(B, 1, 1, Lk)
        causal = False
        if attn_mask is not None:
            am = attn_mask
            if am.dtype == torch.bool:
                am = torch.zeros(am.shape, dtype=q.dtype, device=am.device).masked_fill(am, float("-inf"))
            am = am.to(q.dtype)
            am = am.view(B, H, Lq, Lk) if am.dim() == 3 else am.view(1, 1, Lq, Lk)
            bias = am if bias is None else bias + am
        elif is_causal:
            causal = True
        p = self.dropout if self.training else 0.0
        o = attention(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=bias, dropout_p=p)
        o = self.out_proj(o.transpose(1, 2).reshape(B, Lq, E))
        if not self.batch_first:
            o = o.transpose(0, 1)
        return o, None
