"""Multi-head attention in ``fastarch.nn``: one core, :class:`Attention`, and the guides' classes as thin
subclasses of it, all on ``fastarch.ops.attention``.

:class:`Attention` holds the projections (one fused ``3E`` projection, or separate ones with optional
grouped key/value heads), rotary position embedding, a :class:`~fastarch.nn.kv_cache.KVCache` and the one mask
convention of the guides, and returns ``(output, weights or None)``. The guide classes only name their
parameters and shape their outputs:

- ``MultiHeadAttention`` (guide 000): ``w_q/w_k/w_v/w_o``, then ``layer_norm(dropout(w_o(.)) + q)``;
  ``SelfAttention`` / ``CrossAttention`` wrap it (key prefix ``mha.``); ``ScaledDotProductAttention`` is the
  attention step alone;
- ``FusedQKVAttention`` (guide 001's ``MultiHeadAttention``, alias ``MultiHeadAttention001``): ``qkv`` and
  ``out_proj``;
- ``RotarySelfAttention`` (guide 003's ``MultiHeadAttention``, alias ``MultiHeadAttention003``): ``W_Q..W_O``,
  optional RoPE, a ``(B, L)`` padding mask;
- ``MultiHeadAttention004`` (guide 004): ``W_q..W_o``;
- ``MultiHeadAttentionWithKVCache`` (guide 003, in :mod:`fastarch.nn.kv_attention`): ``w_q..w_o`` without
  biases, causal, incremental decoding;
- ``LongformerAttention`` (guide 000) and ``MultiheadAttention`` (``torch.nn.MultiheadAttention``'s API).

Mask convention (every guide class): ``mask`` is broadcastable to ``(B, H, Lq, Lk)`` and ``0`` means masked.
A mask that varies only along batch and keys reaches the op as ``key_padding_mask``, anything else as an
additive ``-inf`` bias; a query row whose keys are all masked gets the uniform average of the values, which
is what guide 000's ``masked_fill(mask == 0, -1e9)`` gives (guides that fill with ``-inf`` give NaN there).

Attention weights: the op never forms the ``L x L`` matrix. They are computed only when a caller asks
(``need_weights=True``), from the op's log-sum-exp: ``exp(q k^T * scale + bias - lse)``, one extra
``L x L`` product. Guide 000's ``ScaledDotProductAttention`` and ``MultiHeadAttention`` return them by default,
as the guide does; pass ``need_weights=False`` to the constructor or to ``forward`` to skip them. Every other
module calls the core without them. Dropout on the probabilities uses the op's hash mask (same distribution
as ``nn.Dropout``, different draws); returned weights in training mode use the same mask.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.attention import attention, dropout_keep_mask
from ._models_common import check_input, layer_norm
from .kv_cache import KVCache
from .linear import Linear
from .positional import RotaryPositionalEncoding

__all__ = [
    "Attention",
    "scaled_dot_product_attention",
    "guide_mask_to_op",
    "ScaledDotProductAttention",
    "MultiHeadAttention",
    "SelfAttention",
    "CrossAttention",
    "FusedQKVAttention",
    "MultiHeadAttention001",
    "RotarySelfAttention",
    "MultiHeadAttention003",
    "MultiHeadAttention004",
    "LongformerAttention",
    "MultiheadAttention",
]


def guide_mask_to_op(mask: torch.Tensor, B: int, H: int, Lq: int, Lk: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """A guide mask (``0`` = masked, broadcastable to ``(B, H, Lq, Lk)``) -> ``(key_padding_mask (B, Lk) or
    None, attn_bias or None, keep)`` for the op; ``keep`` is the boolean mask (4-D, broadcast shape)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"argument 'mask' must be a torch.Tensor or None, got {type(mask).__name__}")
    keep = mask != 0
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    try:
        if keep.dim() > 4:
            raise RuntimeError
        torch.broadcast_shapes(keep.shape, (B, H, Lq, Lk))
    except RuntimeError:
        raise ValueError(f"argument 'mask' must be broadcastable to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}, "
                         f"got shape {tuple(mask.shape)}") from None
    if keep.shape[1] == 1 and keep.shape[2] == 1:
        return keep.expand(B, 1, 1, Lk).reshape(B, Lk), None, keep
    bias = torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, float("-inf"))
    return None, bias, keep


def _allowed_positions(Lq: int, Lk: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(Lq, Lk) bool: key j is visible to query i under ``window=(left, right)``, aligned bottom-right."""
    i = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)
    j = torch.arange(Lk, device=device)[None, :]
    left, right = window
    ok = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if right >= 0:
        ok = ok & (j <= i + right)
    if left >= 0:
        ok = ok & (j >= i - left)
    return ok


def _window(window, causal: bool) -> tuple[int, int]:
    left, right = (-1, -1) if window is None else ((window, window) if isinstance(window, int) else tuple(window))
    return (left, 0) if causal else (left, right)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    window: int | tuple[int, int] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q k^T * scale + mask) v on ``fastarch.ops.attention``, with the guides' mask convention.

    q ``(B, H, Lq, Dk)``, k ``(B, Hk, Lk, Dk)``, v ``(B, Hk, Lk, Dv)`` (``Hk`` divides ``H``); ``mask``
    broadcastable to ``(B, H, Lq, Lk)``, 0 = masked; ``key_padding_mask`` ``(B, Lk)`` True = real key;
    ``attn_bias`` additive; ``causal``/``window`` as the op (bottom-right aligned). Returns
    ``(output (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``; the weights only with ``need_weights``.
    """
    B, H, Lq, Dk = q.shape
    Hk, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    kpm = bias = keep = None
    if mask is not None:
        kpm, bias, keep = guide_mask_to_op(mask, B, H, Lq, Lk, q.dtype)
    if key_padding_mask is not None:
        kpm = key_padding_mask if kpm is None else (kpm & key_padding_mask)
    if attn_bias is not None:
        bias = attn_bias if bias is None else bias + attn_bias
    win = _window(window, causal)
    scale = Dk**-0.5 if scale is None else scale
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout_p > 0 else 0
    # The op takes one head dim for q, k and v: zero-pad the smaller (scores and outputs are unchanged).
    Dm = max(Dk, Dv)
    qq, kk, vv = (t if t.shape[-1] == Dm else F.pad(t, (0, Dm - t.shape[-1])) for t in (q, k, v))
    out, lse = attention(qq, kk, vv, window=win, key_padding_mask=kpm, attn_bias=bias, dropout_p=dropout_p,
                         scale=scale, dropout_seed=seed, return_lse=True)
    out = out[..., :Dv]
    keep_drop = None
    if dropout_p > 0 and (need_weights or keep is not None):
        keep_drop = dropout_keep_mask(seed, B, H, Lq, Lk, dropout_p, q.device) / (1.0 - dropout_p)
    weights = None
    if need_weights:
        kf = k.float() if Hk == H else k.float().repeat_interleave(H // Hk, dim=1)
        s = torch.matmul(q.float(), kf.transpose(-2, -1)) * scale
        if bias is not None:
            s = s + bias.float()
        if kpm is not None:
            s = s.masked_fill(~kpm.view(B, 1, 1, Lk), float("-inf"))
        if win != (-1, -1):
            s = s.masked_fill(~_allowed_positions(Lq, Lk, win, q.device), float("-inf"))
        weights = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        if keep_drop is not None:
            weights = weights * keep_drop
    if keep is not None:
        # Rows whose keys are all masked: the uniform average (softmax of a row of equal fills).
        empty = ~keep.any(-1, keepdim=True)
        vh = v if Hk == H else v.repeat_interleave(H // Hk, dim=1)
        uniform = vh.mean(-2, keepdim=True) if keep_drop is None else torch.matmul(keep_drop.to(v.dtype), vh) / Lk
        out = torch.where(empty, uniform.to(out.dtype), out)
        if weights is not None:
            w_u = torch.full_like(weights, 1.0 / Lk) * (1.0 if keep_drop is None else keep_drop)
            weights = torch.where(empty, w_u, weights)
    return out, (None if weights is None else weights.to(q.dtype))


class Attention(nn.Module):
    """Multi-head attention: projections, ``fastarch.ops.attention``, output projection.

    Args:
        embed_dim: model width ``E``; ``num_heads`` must divide it.
        num_heads: query heads ``H``.
        names: attribute names of the projections: ``(qkv, out)`` when ``fused`` (one ``E -> 3E`` linear),
            else ``(q, k, v, out)``. They are the ``state_dict`` keys.
        fused: one fused QKV projection (self-attention only) instead of three.
        kv_heads: key/value heads (grouped-query attention, separate projections only); default ``H``.
        bias: biases on the projections.
        dropout: dropout on the attention probabilities.
        scale: score scale, default ``head_dim ** -0.5``.
        rotary: rotate q and k by RoPE (interleaved pairs over the head dim, base 10000) before attention.
        window: sliding window: a query sees itself and ``window`` earlier positions (with ``causal``).

    ``forward(query (B, Lq, E), key=None, value=None, mask=None, *, causal=False, key_padding_mask=None,
    attn_bias=None, kv_cache=None, layer_idx=0, need_weights=False) -> (output (B, Lq, E), weights or None)``.
    ``key``/``value`` default to ``query``. With ``kv_cache`` the new keys/values are appended to layer
    ``layer_idx`` and the queries attend to every cached position (bottom-right aligned). Separate Q/K/V
    projections run as three matmuls on their own weights: nothing is concatenated per call, and no stacked
    copy can go stale when a weight is written in place (``param.data`` writes do not bump its version).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, names: tuple[str, ...] | None = None,
                 fused: bool = False, kv_heads: int | None = None, bias: bool = True, dropout: float = 0.0,
                 scale: float | None = None, rotary: bool = False, window: int | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        if embed_dim % num_heads:
            raise ValueError(f"{owner}: d_model={embed_dim} must be divisible by n_heads={num_heads}")
        n_kv = num_heads if kv_heads is None else kv_heads
        if n_kv < 1 or num_heads % n_kv:
            raise ValueError(f"{owner}: 'n_kv_heads' must divide n_heads={num_heads}, got {kv_heads}")
        if fused and n_kv != num_heads:
            raise ValueError(f"{owner}: a fused QKV projection needs kv_heads == num_heads, got {kv_heads}")
        if window is not None and window < 0:
            raise ValueError(f"{owner}: 'window' must be >= 0 or None, got {window}")
        names = names or (("qkv", "out_proj") if fused else ("q_proj", "k_proj", "v_proj", "out_proj"))
        if len(names) != (2 if fused else 4):
            raise ValueError(f"{owner}: 'names' must hold {2 if fused else 4} attribute names, got {names}")
        self.embed_dim, self.num_heads, self.kv_heads = embed_dim, num_heads, n_kv
        self.head_dim = embed_dim // num_heads
        self.d_model, self.n_heads, self.d_k = embed_dim, num_heads, self.head_dim  # the guides' names
        self.fused, self.window, self.attn_dropout = fused, window, dropout
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self._names = tuple(names)
        kv_dim = n_kv * self.head_dim
        if fused:
            setattr(self, names[0], Linear(embed_dim, 3 * embed_dim, bias=bias))
        else:
            for name, out in zip(names[:3], (embed_dim, kv_dim, kv_dim)):
                setattr(self, name, Linear(embed_dim, out, bias=bias))
        setattr(self, names[-1], Linear(embed_dim, embed_dim, bias=bias))
        self.rope = RotaryPositionalEncoding(self.head_dim, persistent=False) if rotary else None

    @property
    def out_projection(self) -> nn.Linear:
        return getattr(self, self._names[-1])

    def project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L, E) inputs -> q (B, Lq, H, D), k and v (B, Lk, Hk, D)."""
        B, Lq, _ = query.shape
        H, Hk, D = self.num_heads, self.kv_heads, self.head_dim
        if self.fused:
            if key is not query or value is not query:
                raise ValueError(f"{type(self).__name__}: a fused QKV projection takes self-attention only")
            q, k, v = getattr(self, self._names[0])(query).view(B, Lq, 3, H, D).unbind(2)
            return q, k, v
        q, k, v = (getattr(self, n)(t) for n, t in zip(self._names[:3], (query, key, value)))
        Lk = k.shape[1]
        return q.view(B, Lq, H, D), k.view(B, Lk, Hk, D), v.view(B, Lk, Hk, D)

    def attend(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, *, causal: bool = False,
               key_padding_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
               kv_cache: KVCache | None = None, layer_idx: int = 0, need_weights: bool = False,
               dropout_p: float | None = None, kv_valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projections and attention, before the output projection: ``((B, Lq, E), weights or None)``.
        ``kv_valid`` (B, Lq) bool marks the real tokens among the new ones stored in ``kv_cache``."""
        if kv_valid is not None and kv_cache is None:
            raise ValueError("argument 'kv_valid' needs a 'kv_cache' (use 'key_padding_mask' without one)")
        key = query if key is None else key
        value = key if value is None else value
        q, k, v = self.project(query, key, value)
        if self.rope is not None:
            offset = max(kv_cache.lengths(layer_idx) or [0]) if kv_cache is not None else 0
            q, k = self.rope(q, k, offset)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        window = None if self.window is None else (self.window, 0 if causal else self.window)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v, valid=kv_valid)
            if causal:
                kw = kv_cache.attention_kwargs(layer_idx, window=self.window)
                causal = kw.get("causal", False)
                window = kw.get("window", window if causal else None)
                if "key_padding_mask" in kw:
                    key_padding_mask = kw["key_padding_mask"] if key_padding_mask is None else \
                        key_padding_mask & kw["key_padding_mask"]
                if "attn_bias" in kw:
                    attn_bias = kw["attn_bias"] if attn_bias is None else attn_bias + kw["attn_bias"]
        p = (self.attn_dropout if dropout_p is None else dropout_p) if self.training else 0.0
        o, weights = scaled_dot_product_attention(q, k, v, mask, causal=causal, window=window,
                                                  key_padding_mask=key_padding_mask, attn_bias=attn_bias,
                                                  dropout_p=p, scale=self.scale, need_weights=need_weights)
        B, _, Lq, _ = o.shape
        return o.transpose(1, 2).reshape(B, Lq, self.embed_dim), weights

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, weights = self.attend(query, key, value, mask, **kw)
        return self.out_projection(out), weights


class ScaledDotProductAttention(nn.Module):
    """Guide 000's scaled dot-product attention (the attention step alone, no parameters).

    q ``(B, H, Lq, Dk)``, k ``(B, H, Lk, Dk)``, v ``(B, H, Lk, Dv)``; mask broadcastable to
    ``(B, H, Lq, Lk)`` with 0 = masked. Returns ``(output (B, H, Lq, Dv), weights (B, H, Lq, Lk) or None)``;
    ``need_weights`` (constructor default, overridable per call) decides whether the weights are computed.
    """

    def __init__(self, temperature: float | None = None, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(dropout)  # the guide's attribute; its p is the probability dropout
        self.need_weights = need_weights

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                need_weights: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"ScaledDotProductAttention: q, k, v must be (B, H, L, D), got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        temperature = self.temperature or q.shape[-1] ** 0.5
        return scaled_dot_product_attention(
            q, k, v, mask, dropout_p=self.dropout.p if self.training else 0.0, scale=1.0 / temperature,
            need_weights=self.need_weights if need_weights is None else need_weights)


class MultiHeadAttention(Attention):
    """Guide 000's multi-head attention: ``w_q/w_k/w_v/w_o``, attention, ``dropout``, then
    ``layer_norm(out + q)``.

    q ``(B, Lq, d_model)``, k/v ``(B, Lk, d_model)``, mask broadcastable to ``(B, H, Lq, Lk)`` (0 = masked).
    Returns ``(output (B, Lq, d_model), weights (B, H, Lq, Lk) or None)``. Extensions: ``causal``,
    ``kv_cache``/``layer_idx`` and ``need_weights`` keywords.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"), dropout=dropout)
        self.attention = ScaledDotProductAttention(dropout=dropout, need_weights=need_weights)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                causal: bool = False, kv_cache: KVCache | None = None, layer_idx: int = 0,
                need_weights: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_input(name, t, ndim=3, last=self.d_model, owner="MultiHeadAttention")
        out, weights = self.attend(
            q, k, v, mask, causal=causal, kv_cache=kv_cache, layer_idx=layer_idx,
            dropout_p=self.attention.dropout.p,
            need_weights=self.attention.need_weights if need_weights is None else need_weights)
        return layer_norm(self.dropout(self.w_o(out)) + q, self.layer_norm), weights


class SelfAttention(nn.Module):
    """Guide 000: ``MultiHeadAttention(x, x, x, mask)``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, *, need_weights: bool = True):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, n_heads, dropout, need_weights=need_weights)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        return self.mha(x, x, x, mask)


class CrossAttention(SelfAttention):
    """Guide 000: queries from ``q`` (decoder), keys/values from ``kv`` (encoder)."""

    def forward(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None):  # type: ignore[override]
        return self.mha(q, kv, kv, mask)


class FusedQKVAttention(Attention):
    """Guide 001's ``MultiHeadAttention``: fused ``qkv`` projection and ``out_proj``, no norm inside.

    ``forward(x (B, L, E), mask=None, *, causal=False, kv_cache=None, layer_idx=0, key_padding_mask=None)
    -> (B, L, E)``; ``mask`` follows the guide (0 = masked, broadcastable to ``(B, H, L, L)``).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.1):
        super().__init__(embed_dim, num_heads, fused=True, dropout=dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, **kw) -> torch.Tensor:  # type: ignore[override]
        return self.out_proj(self.attend(x, x, x, mask, **kw)[0])


class RotarySelfAttention(Attention):
    """Guide 003's ``MultiHeadAttention``: ``W_Q/W_K/W_V/W_O``, optional RoPE on q and k (``rotary``).

    ``forward(x (B, L, d_model), mask=None, causal=False) -> (B, L, d_model)``; ``mask`` ``(B, L)`` marks real
    keys (0 = padding), as the guide's ``mask.unsqueeze(1).unsqueeze(1)``.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1, rotary: bool = False):
        super().__init__(d_model, n_heads, names=("W_Q", "W_K", "W_V", "W_O"), dropout=dropout, rotary=rotary)
        self.d_head = self.head_dim
        self.dropout = nn.Dropout(dropout)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,  # type: ignore[override]
                causal: bool = False) -> torch.Tensor:
        if mask is not None:
            mask = mask.unsqueeze(1).unsqueeze(1)
        return self.W_O(self.attend(x, x, x, mask, causal=causal)[0])


class MultiHeadAttention004(Attention):
    """Guide 004's ``MultiHeadAttention``: ``W_q/W_k/W_v/W_o``, no dropout. ``forward(query, key, value,
    mask=None) -> (output (B, Lq, d_model), None)``; mask as guide 000 (0 = masked)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__(d_model, num_heads, names=("W_q", "W_k", "W_v", "W_o"))


MultiHeadAttention001 = FusedQKVAttention
MultiHeadAttention003 = RotarySelfAttention


class LongformerAttention(Attention):
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
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"), dropout=dropout)
        if window_size < 0:
            raise ValueError(f"LongformerAttention: window_size must be >= 0, got {window_size}")
        if global_mode not in ("guide", "hf"):
            raise ValueError(f"LongformerAttention: global_mode must be 'guide' or 'hf', got {global_mode!r}")
        self.window_size = window_size
        self.global_tokens = list(global_tokens) if global_tokens is not None else []
        self.global_mode = global_mode
        self.w_q_global = Linear(d_model, d_model)
        self.w_k_global = Linear(d_model, d_model)
        self.w_v_global = Linear(d_model, d_model)
        self._modules["w_o"] = self._modules.pop("w_o")  # the guide's key order: global projections first
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
        q, k, v = (t.transpose(1, 2) for t in self.project(x, x, x))
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
    """``torch.nn.MultiheadAttention`` with the same constructor, parameters, ``state_dict``, forward
    arguments and return values, whose forward runs on the fused op (``add_bias_kv``, ``add_zero_attn`` and
    unbatched inputs defer to torch's implementation).

    ``need_weights=True`` (torch's default) returns the attention weights, averaged over heads unless
    ``average_attn_weights=False``, computed from the op's log-sum-exp; pass ``need_weights=False`` to skip
    them. Differences: a query row whose keys are all masked gives 0 (torch gives NaN); dropout uses the op's
    hash mask.
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if self.bias_k is not None or self.add_zero_attn or query.dim() != 3:
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
        o, weights = scaled_dot_product_attention(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=bias,
                                                  dropout_p=p, need_weights=need_weights)
        o = self.out_proj(o.transpose(1, 2).reshape(B, Lq, E))
        if not self.batch_first:
            o = o.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return o, weights
