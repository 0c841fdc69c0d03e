"""Helpers shared by the model families (feed-forward, transformers, vision, graphs): how a module calls the
attention op, how the guides' masks map onto its arguments, and argument validation.

Modules never import kernels; they call ``fastarch.ops``. The attention op (``fastarch.ops.attention``) is
owned by the attention issue; until it is importable the helpers fall back to
``torch.nn.functional.scaled_dot_product_attention`` with identical semantics for the masks used here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# The guides mask scores with ``masked_fill(mask == 0, -1e9)``. An additive -1e9 gives the same softmax
# (a fully masked row stays uniform, as in the guides) while letting the fused op take it as ``attn_bias``.
GUIDE_MASK_VALUE = -1e9


def _attention_op():
    try:
        from ..ops.attention import attention
    except ImportError:
        return None
    return attention


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v through ``fastarch.ops.attention``.

    q (B,H,Lq,D), k/v (B,H,Lk,D); key_padding_mask (B,Lk) bool, True = real key; attn_bias additive,
    broadcastable to (B,H,Lq,Lk); causal aligned bottom-right. Returns (B,H,Lq,D).
    """
    op = _attention_op()
    if op is not None:
        return op(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_bias=attn_bias,
                  dropout_p=dropout_p, scale=scale)
    return _attend_sdpa(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_bias=attn_bias,
                        dropout_p=dropout_p, scale=scale)


def _attend_sdpa(q, k, v, *, causal, key_padding_mask, attn_bias, dropout_p, scale):
    """Fallback with the op's semantics (bottom-right causal, fully masked rows -> 0)."""
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        i = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        mask = torch.arange(lk, device=q.device)[None, :] <= i
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        mask = kpm if mask is None else (mask & kpm)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if attn_bias is not None:
        bias = attn_bias.to(q.dtype) if bias is None else bias + attn_bias.to(q.dtype)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    any_key = mask.any(-1, keepdim=True)
    return torch.where(any_key, out, torch.zeros_like(out))


def guide_mask_to_op(
    mask: torch.Tensor | None, batch: int, lq: int, lk: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Map a guide-style mask (``scores.masked_fill(mask == 0, ...)``; any shape broadcastable to
    (B,H,Lq,Lk)) onto the op's arguments: ``(key_padding_mask, attn_bias)``.

    A mask that only varies along batch and keys (BERT's (B,1,1,L), a (B,L) mask) becomes a
    ``key_padding_mask``, which the fused kernels skip cheaply; anything else becomes an additive bias of
    -1e9 where the mask is 0 (same softmax as the guides' masked_fill).
    """
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"argument 'mask' must be a torch.Tensor or None, got {type(mask).__name__}")
    m = mask  # broadcast exactly as the guides' masked_fill does: a 2-D mask is (Lq, Lk)
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dim() != 4:
        raise ValueError(f"argument 'mask' must be broadcastable to (B, H, Lq, Lk) = ({batch}, *, {lq}, {lk}), "
                         f"got shape {tuple(mask.shape)}")
    if m.shape[-1] != lk or m.shape[-2] not in (1, lq) or m.shape[0] not in (1, batch):
        raise ValueError(f"argument 'mask' must be broadcastable to (B, H, Lq, Lk) = ({batch}, *, {lq}, {lk}), "
                         f"got shape {tuple(mask.shape)}")
    if m.shape[1] == 1 and m.shape[2] == 1:
        kpm = (m[:, 0, 0, :] != 0).expand(batch, lk)
        if bool(kpm.any(-1).all()):
            return kpm, None
    bias = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m == 0, GUIDE_MASK_VALUE)
    return None, bias


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """Apply an ``nn.LayerNorm`` module's parameters through fastarch's layer-norm op when it exists."""
    if _USE_FA_LN:
        try:
            from ..ops.layer_norm import layer_norm as fa_ln

            return fa_ln(x, norm.weight, norm.bias, norm.eps)
        except Exception:  # pragma: no cover - the op may be missing a backend here
            pass
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


# torch's own layer_norm is one fused ATen kernel on CPU; the op is used when asked for explicitly.
_USE_FA_LN = False


def check_input(name: str, t: object, *, ndim: int | tuple[int, ...] | None = None, last: int | None = None,
                integer: bool = False, owner: str = "") -> torch.Tensor:
    """Clear errors for bad module inputs: the argument, what was expected and what came."""
    where = f"{owner}: " if owner else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{where}argument '{name}' must have {want} dimensions, got shape {tuple(t.shape)}")
    if last is not None and t.shape[-1] != last:
        raise ValueError(f"{where}argument '{name}' must have last dimension {last}, got shape {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{where}argument '{name}' must hold integer token ids, got dtype {t.dtype}")
    return t
