"""transformers' attention and mask interfaces on :func:`fastarch.ops.attention`: :func:`attention_forward`
and :func:`attention_mask` (a :class:`CompactMask` for banded patterns, recognised by the mask function's
values, else transformers' dense mask)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import masking_utils
from transformers.utils.import_utils import is_torchdynamo_exporting

from ...ops import attention as _attention

__all__ = ["CompactMask", "attention_forward", "attention_mask", "hf_window"]

_OP_PARAMS = frozenset(inspect.signature(_attention).parameters)


# -- the mask ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CompactMask:
    """What :func:`attention_mask` hands to :func:`attention_forward` instead of an ``L x L`` mask.

    ``window``: ``(left, right)`` as in :func:`fastarch.ops.attention` (bottom-right aligned, -1 unlimited);
    ``key_padding_mask``: ``(B, key_length)`` bool, True = a real token, or None when no key is padded;
    ``key_length``: how many keys the queries can see; keys past it (the unused tail of a static cache) are
    dropped before the op runs.
    """

    window: tuple[int, int]
    key_padding_mask: torch.Tensor | None
    key_length: int

    # transformers' generation code builds the masks of compileable caches before the forward and calls
    # these on them; the model's mask builder then takes a mask with ndim 4 as already prepared and passes it
    # back to attention_mask(), which returns it unchanged.
    ndim = 4

    def contiguous(self) -> CompactMask:
        return self

    def to(self, *args, **kwargs) -> CompactMask:
        kpm = self.key_padding_mask
        if kpm is None:
            return self
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), kpm.device))
        return CompactMask(self.window, kpm.to(device=device), self.key_length)


def hf_window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` convention as fastarch's inclusive ``window=(left, right)``."""
    if sliding_window is None:
        return (-1, 0) if causal else (-1, -1)
    if causal:
        return (sliding_window - 1, 0)
    return (sliding_window, sliding_window)


# Query positions the mask functions are probed at: dense rows of keys ``0 .. 2q + 1`` for the short ones,
# a binary search of the first visible key for the long one (windows longer than the dense probes).
_DENSE_PROBES = (0, 1, 5, 97, 1030)
_LONG_PROBE = (1 << 24) + 3


def _row(mask_function: Callable, b: int, q: int, kv: torch.Tensor) -> torch.Tensor:
    out = mask_function(torch.tensor(b), torch.tensor(0), torch.tensor(q), kv)
    return torch.as_tensor(out, dtype=torch.bool).expand(kv.shape)


def _long_window(mask_function: Callable, b: int) -> tuple[int, int] | None:
    """The window ``(left, right)`` seen from query ``q = _LONG_PROBE`` (-1: unlimited, up to ``q`` keys
    either side), or None when the visible keys near it are not one interval around it. A k-ary search
    brackets the first and the last visible key together, 64 keys a side per call of the mask function."""
    q = _LONG_PROBE
    # first visible key in (lo_out, lo_in], last in [hi_in, hi_out): *_out not visible, *_in visible
    lo_out, lo_in, hi_in, hi_out = -1, q, q, 2 * q + 1
    while lo_in - lo_out > 1 or hi_out - hi_in > 1:
        left = torch.linspace(lo_out + 1, lo_in, min(64, lo_in - lo_out), dtype=torch.float64).round().long().unique()
        right = torch.linspace(hi_in, hi_out - 1, min(64, hi_out - hi_in), dtype=torch.float64).round().long().unique()
        kv = torch.cat([left, right, torch.tensor([q])])
        seen = _row(mask_function, b, q, kv)
        if not bool(seen[-1]):
            return None
        seen_left, seen_right = seen[: left.numel()], seen[left.numel(): -1]
        first = int(seen_left.nonzero()[0]) if bool(seen_left.any()) else None
        if first is None or not bool(seen_left[first:].all()):
            return None
        lo_in = int(left[first])
        lo_out = int(left[first - 1]) if first > 0 else lo_out
        if not bool(seen_right[0]):
            return None
        gone = (~seen_right).nonzero()
        stop = int(gone[0]) if gone.numel() else seen_right.numel()
        if bool(seen_right[stop:].any()):
            return None
        hi_in = int(right[stop - 1])
        hi_out = int(right[stop]) if stop < right.numel() else hi_out
    return (-1 if lo_in == 0 else q - lo_in), (-1 if hi_in == 2 * q else hi_in - q)


def _band(q: torch.Tensor, kv: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """The visible keys of the band ``window`` for queries ``q`` (Q, 1) over keys ``kv`` (1, K)."""
    left, right = window
    want = kv <= q + right if right >= 0 else torch.ones_like(kv, dtype=torch.bool).expand(q.shape[0], -1)
    return want & (kv >= q - left) if left >= 0 else want & (kv >= 0)


def _matches(mask_function: Callable, b: int, window: tuple[int, int]) -> bool:
    """Does ``mask_function`` give the band ``window`` on every short probe row (keys ``0 .. 2q + 1``, one
    broadcast call) and at the band's edges seen from the long probe (one call)?"""
    qs = torch.tensor(_DENSE_PROBES)[:, None]
    kv = torch.arange(2 * _DENSE_PROBES[-1] + 2)[None, :]
    got = torch.as_tensor(mask_function(torch.tensor(b), torch.tensor(0), qs, kv), dtype=torch.bool)
    row = kv <= 2 * qs + 1
    if not torch.equal(got.expand(qs.shape[0], kv.shape[1]) & row, _band(qs, kv, window) & row):
        return False
    q, (left, right) = _LONG_PROBE, window
    edges = [q, 0 if left < 0 else q - left, 2 * q if right < 0 else q + right]
    outside = ([q - left - 1] if left >= 0 else []) + ([q + right + 1] if right >= 0 else [])
    row = _row(mask_function, b, q, torch.tensor(edges + outside))
    return bool(row[: len(edges)].all()) and not bool(row[len(edges):].any())


# Windows recognised so far, most recent first: a new mask function (transformers builds one per forward) is
# first checked against them, two calls each, before the k-ary search.
_KNOWN_WINDOWS: list[tuple[int, int]] = []


def _pattern(mask_function: Callable, batch_size: int = 1) -> tuple[tuple[int, int], bool] | None:
    """``(window, causal)`` when ``mask_function`` is a banded pattern (each query sees the keys
    ``q - left .. q + right``, the same for every query and batch row), found by evaluating it on probe
    positions, else None (the caller then builds transformers' dense mask). Nothing about the function but
    its values is read, so any release's causal, sliding-window and bidirectional builders are recognised,
    and anything else (chunked, block-wise, token-type overlays) is not."""
    if mask_function is masking_utils.causal_mask_function:
        return hf_window(None, True), True
    if mask_function is masking_utils.bidirectional_mask_function:
        return hf_window(None, False), False
    try:
        window = next((w for w in _KNOWN_WINDOWS if _matches(mask_function, 0, w)), None)
        if window is None:
            window = _long_window(mask_function, 0)
            if window is None or not _matches(mask_function, 0, window):
                return None
            _KNOWN_WINDOWS.insert(0, window)
            del _KNOWN_WINDOWS[8:]
        if batch_size > 1 and not _matches(mask_function, batch_size - 1, window):
            return None
    except Exception:  # noqa: BLE001 - a mask function that cannot be probed gets the dense mask
        return None
    return window, window[1] == 0


def _offset(x) -> int | None:
    # Static cache layers give tensor offsets (so that a compiled decode step does not specialise on them):
    # those calls get the dense mask, whose shape does not change from step to step.
    return None if isinstance(x, torch.Tensor) else int(x)


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> CompactMask | torch.Tensor:
    """transformers' mask-interface function for fastarch: a :class:`CompactMask` for the causal, sliding-window
    and bidirectional patterns, else transformers' dense ``(B, 1, q_length, kv_length)`` boolean mask.

    ``attention_mask`` is the 2-D padding mask ``(B, >= kv_offset + kv_length)`` (True/1 = real token) or
    None; query ``i`` sits at position ``q_offset + i`` and key ``j`` at ``kv_offset + j``.
    """
    if isinstance(attention_mask, CompactMask):  # prepared before the forward (generation, static caches)
        return attention_mask
    found = _pattern(mask_function, batch_size)
    q0, k0 = _offset(q_offset), _offset(kv_offset)
    compact = found is not None and q0 is not None and k0 is not None and not is_torchdynamo_exporting()
    if compact:
        window, causal = found
        # Queries see no key past the last query's position; the op aligns the last query with the last key.
        key_length = q0 + q_length - k0 if window != (-1, -1) else kv_length
        compact = 0 < key_length <= kv_length and (causal or key_length == kv_length)
    if not compact:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                       attention_mask, **kwargs)
    padding = None
    if attention_mask is not None:
        padding = masking_utils.prepare_padding_mask(attention_mask.bool(), kv_length, k0)
        padding = padding[:, k0:k0 + key_length].expand(batch_size, key_length)
        padding = None if bool(padding.all()) else padding.contiguous()
    return CompactMask(window=window, key_padding_mask=padding, key_length=key_length)


# -- the attention function ----------------------------------------------------------------------------------
def _dense_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4-D boolean (True = attend) or additive mask as an additive bias."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: CompactMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function on :func:`fastarch.ops.attention`.

    ``query`` ``(B, H, Lq, D)``, ``key``/``value`` ``(B, Hk, Lk, D)`` with ``Hk`` dividing ``H`` (GQA runs on
    the ``Hk`` heads, no repeated copies) -> ``((B, Lq, H, D), None)``. ``attention_mask``: a
    :class:`CompactMask`, a 4-D mask broadcastable to ``(B, H, Lq, Lk)`` (boolean, True = attend, or additive),
    a 2-D key padding mask, or None (then ``is_causal``, else ``module.is_causal``, and ``sliding_window`` set
    the window). ``position_bias`` is added to the scores; ``dropout`` is the probability dropout;
    ``scaling`` defaults to ``D ** -0.5``; ``s_aux`` (gpt-oss's attention sinks, one logit per query head)
    joins every row's softmax denominator.
    """
    if kwargs.get("cache") is not None:
        raise NotImplementedError("fastarch attention: paged caches (continuous batching) are not supported; "
                                  "use attn_implementation='sdpa' for continuous batching")
    extra = {}
    if softcap is not None:
        if "softcap" not in _OP_PARAMS:
            raise NotImplementedError(
                f"fastarch attention: argument 'softcap' ({softcap}) is not supported by this fastarch's "
                "ops.attention; use attn_implementation='eager' for this model")
        extra["softcap"] = softcap
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"fastarch attention: query/key/value must be (B, heads, L, D), got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")

    bias = position_bias
    kpm = None
    if isinstance(attention_mask, CompactMask):
        window = attention_mask.window
        kpm = attention_mask.key_padding_mask
        n = attention_mask.key_length
        if key.shape[2] < n:
            raise ValueError(f"fastarch attention: the mask covers {n} keys but key has {key.shape[2]}")
        if key.shape[2] > n:
            key, value = key[:, :, :n], value[:, :, :n]
            if bias is not None and bias.shape[-1] > n:
                bias = bias[..., :n]
    elif attention_mask is None or attention_mask.dim() == 2:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = hf_window(sliding_window, bool(causal))
        if attention_mask is not None:
            kpm = attention_mask.bool()
            kpm = None if bool(kpm.all()) else kpm
    elif attention_mask.dim() == 4:
        window = (-1, -1)
        mask_bias = _dense_bias(attention_mask[..., : key.shape[2]], query.dtype)
        bias = mask_bias if bias is None else bias + mask_bias
    else:
        raise ValueError(f"fastarch attention: argument 'attention_mask' must be a CompactMask, a 2-D key "
                         f"padding mask or a 4-D mask, got shape {tuple(attention_mask.shape)}")

    sinks = kwargs.get("s_aux")
    if sinks is not None:  # gpt-oss: one logit per query head in every row's softmax denominator
        extra["sinks"] = sinks.reshape(-1)
    out = _attention(query, key, value, window=window, key_padding_mask=kpm, attn_bias=bias,
                     dropout_p=float(dropout), scale=scaling, **extra)
    return out.transpose(1, 2).contiguous(), None
