"""A preallocated key/value cache for autoregressive decoding.

Keeps the guide-003 ``KVCache`` API (``get``, ``update``, ``reset``, ``seq_len``) but, instead of
concatenating on every step, writes new entries in place into buffers sized ``max_seq_len`` (or
``window`` in ring-buffer mode).

Layout: per layer, keys and values ``(B, Hk, S_cap, D)``; ``Hk`` is the number of *key/value* heads
(pass the KV head count for GQA/MQA models). Cached attention is

    k_all, v_all = cache.update(layer, k_new, v_new)
    o = fastarch.ops.attention(q, k_all, v_all, **cache.attention_kwargs(layer))

where ``attention_kwargs`` is ``{"causal": True}`` in the common case (the op aligns causal masks
bottom-right, so new query ``t`` sees every cached key and the new keys up to itself), plus
``key_padding_mask`` when some positions are padding, ``window=(w, 0)`` in ring mode, or an additive
``attn_bias`` when sequences of a batch have different lengths.

Deviations from the guide (whose ``update`` concatenates along dim -2 of ``(B, T, H, D)`` tensors, i.e.
along heads, and whose ``seq_len`` is the head count after a second update): entries are
``(B, Hk, T, D)`` and ``seq_len`` is the number of positions cached.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KVCache"]


def _err(msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"KVCache: {msg}")


class KVCache:
    """Preallocated per-layer key/value buffers with per-sequence lengths, padding masks and a ring mode.

    Args:
        max_seq_len: capacity in positions (per sequence). In ring mode (``window`` given) it is not a limit.
        n_heads: number of key/value heads ``Hk`` stored (the KV head count under GQA).
        head_dim: ``D``.
        n_layers: number of attention layers (``layer_idx`` in ``0..n_layers-1``).
        batch_size, dtype, device: when all given the buffers are allocated now; any left as ``None`` is
            taken from the first ``update`` (which then allocates every layer's buffers at once).
        window: ring-buffer mode: keep only the last ``window`` positions; pair it with attention
            ``window=(window, 0)`` (``attention_kwargs`` does). Per-sequence lengths are not supported
            there (all sequences advance together); padding masks are.
    """

    def __init__(
        self,
        max_seq_len: int,
        n_heads: int,
        head_dim: int,
        n_layers: int,
        *,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> None:
        for name, val in (("max_seq_len", max_seq_len), ("n_heads", n_heads), ("head_dim", head_dim),
                          ("n_layers", n_layers)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise _err(f"argument '{name}' must be a positive int, got {val!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise _err(f"argument 'batch_size' must be a positive int or None, got {batch_size!r}")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise _err(f"argument 'window' must be a positive int or None, got {window!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise _err(f"argument 'dtype' must be a torch.dtype or None, got {dtype!r}", TypeError)
        self.max_seq_len = max_seq_len
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.n_layers = n_layers
        self.window = window
        self.capacity = window if window is not None else max_seq_len
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._valid: torch.Tensor | None = None
        self.reset()
        if batch_size is not None and dtype is not None and device is not None:
            self._allocate(batch_size, dtype, self.device)

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every cached entry (buffers are kept and reused)."""
        b = self.batch_size or 0
        self._lens: list[list[int]] = [[0] * b for _ in range(self.n_layers)]  # positions per layer/seq
        self._last: list[tuple[list[int], int] | None] = [None] * self.n_layers  # (starts, T) of last update
        self._valid = None  # (n_layers, B, capacity) bool, created by the first masked update
        self._has_invalid = False
        self._last_pad: list[torch.Tensor | None] = [None] * self.n_layers

    def _allocate(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch_size, self.n_heads, self.capacity, self.head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.batch_size, self.dtype, self.device = batch_size, dtype, device
        if not self._lens or len(self._lens[0]) != batch_size:
            self._lens = [[0] * batch_size for _ in range(self.n_layers)]

    @property
    def allocated(self) -> bool:
        return bool(self._k)

    @property
    def seq_len(self) -> int:
        """Positions cached so far (the longest sequence, the most advanced layer)."""
        return max((max(lens) for lens in self._lens if lens), default=0)

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        # The guide's reset() assigned seq_len = 0; only that is meaningful here.
        if value != 0:
            raise _err(f"seq_len can only be set to 0 (use reset()), got {value!r}")
        self.reset()

    def lengths(self, layer_idx: int = 0) -> list[int]:
        """Positions cached per sequence for ``layer_idx`` (absolute counts, also in ring mode)."""
        self._check_layer(layer_idx)
        return list(self._lens[layer_idx])

    def key_padding_mask(self, layer_idx: int = 0) -> torch.Tensor | None:
        """``(B, S)`` bool, True = real token, for the keys ``get(layer_idx)`` returns; None if all real."""
        self._check_layer(layer_idx)
        if not self._has_invalid or self._valid is None:
            return None
        vb = self._valid[layer_idx]
        if self.window is not None:
            return vb.index_select(1, self._ring_order(self._lens[layer_idx][0], vb.device))
        return vb[:, :max(self._lens[layer_idx])]

    # ------------------------------------------------------------------ checks
    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < self.n_layers:
            raise _err(f"argument 'layer_idx' must be an int in [0, {self.n_layers}), got {layer_idx!r}",
                       IndexError)

    def _validate(self, layer_idx: int, k: Any, v: Any, lengths: Any, valid: Any) -> tuple[int, list[int]]:
        self._check_layer(layer_idx)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise _err(f"argument '{name}' must be a torch.Tensor, got {type(t).__name__}", TypeError)
            if t.dim() != 4:
                raise _err(f"argument '{name}' must be (B, Hk, T, D) with 4 dims, got shape {tuple(t.shape)}")
            if not t.is_floating_point():
                raise _err(f"argument '{name}' must be floating point, got {t.dtype}", TypeError)
        if k.shape != v.shape:
            raise _err(f"arguments 'k' and 'v' must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise _err(f"arguments 'k' and 'v' must share dtype and device, got {k.dtype}/{k.device} and "
                       f"{v.dtype}/{v.device}", TypeError)
        B, H, T, D = k.shape
        if H != self.n_heads or D != self.head_dim:
            raise _err(f"argument 'k' must have shape (B, {self.n_heads}, T, {self.head_dim}), got {tuple(k.shape)}")
        if T < 1:
            raise _err(f"argument 'k' must hold at least one new position, got T={T}")
        if self.batch_size is not None and B != self.batch_size:
            raise _err(f"argument 'k' has batch {B} but the cache holds batch {self.batch_size}")
        if self.dtype is not None and k.dtype != self.dtype:
            raise _err(f"argument 'k' has dtype {k.dtype} but the cache stores {self.dtype}", TypeError)
        if self.device is not None and (k.device.type != self.device.type or (
                self.device.index is not None and k.device.index != self.device.index)):
            raise _err(f"argument 'k' is on {k.device} but the cache is on {self.device}")
        if lengths is None:
            new = [T] * B
        else:
            if self.window is not None:
                raise _err("argument 'lengths' (per-sequence advance) is not supported in ring-buffer mode "
                           "(window set); use 'valid' to mark padding instead")
            if isinstance(lengths, torch.Tensor):
                if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
                    raise _err(f"argument 'lengths' must be an integer tensor, got {lengths.dtype}", TypeError)
                lengths = lengths.tolist()
            if not isinstance(lengths, Sequence) or len(lengths) != B:
                raise _err(f"argument 'lengths' must hold {B} ints (one per sequence), got {lengths!r}")
            if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in lengths):
                # int(1.5) would silently advance a sequence by 1.
                raise _err(f"argument 'lengths' entries must be ints, got {list(lengths)!r}", TypeError)
            new = [int(x) for x in lengths]
            if any(x < 0 or x > T for x in new):
                raise _err(f"argument 'lengths' entries must be in [0, T={T}], got {new}")
        if valid is not None:
            if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or tuple(valid.shape) != (B, T):
                got = f"{valid.dtype} {tuple(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
                raise _err(f"argument 'valid' must be a bool tensor of shape ({B}, {T}), got {got}")
        if self.window is None:
            lens = self._lens[layer_idx] if self._lens and len(self._lens[layer_idx]) == B else [0] * B
            worst = max(lens)
            if worst + T > self.capacity:
                raise _err(f"overflow: layer {layer_idx} holds {worst} positions, adding T={T} exceeds "
                           f"max_seq_len={self.capacity}")
        return T, new

    # ------------------------------------------------------------------ API
    def update(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        lengths: Sequence[int] | torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` ``(B, Hk, T, D)`` after each sequence's cached positions and return every key
        and value the new queries attend to, ``(B, Hk, S, D)``.

        ``lengths`` (B,): how many of the T entries are real per sequence (right padding inside the chunk);
        a sequence advances by its length and its padded tail is overwritten by the next update.
        ``valid`` (B, T) bool: False marks padding positions that stay in the cache but are masked out
        (left padding). Everything is validated before anything is written.
        """
        T, new = self._validate(layer_idx, k, v, lengths, valid)
        B = k.shape[0]
        if not self.allocated:
            self._allocate(B, self.dtype or k.dtype, self.device or k.device)
        starts = self._lens[layer_idx]
        if self.window is not None:
            k_all, v_all = self._update_ring(layer_idx, k, v, starts[0], T)
        else:
            k_all, v_all = self._update_linear(layer_idx, k, v, starts, T, new)
        if valid is not None or self._has_invalid:
            self._write_valid(layer_idx, starts, T, valid)
        self._last[layer_idx] = (list(starts), T)
        self._lens[layer_idx] = [s + n for s, n in zip(starts, new)]
        return k_all, v_all

    def _update_linear(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, starts: list[int], T: int,
                       new: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self._k[layer_idx], self._v[layer_idx]
        if all(s == starts[0] for s in starts):
            s0 = starts[0]
            kb[:, :, s0:s0 + T].copy_(k)
            vb[:, :, s0:s0 + T].copy_(v)
        else:
            # Each sequence writes at its own offset: one scatter along the position axis.
            idx = torch.tensor(starts, device=kb.device).view(-1, 1) + torch.arange(T, device=kb.device)
            idx = idx.view(k.shape[0], 1, T, 1).expand(-1, k.shape[1], -1, k.shape[3])
            kb.scatter_(2, idx, k.to(kb.dtype))
            vb.scatter_(2, idx, v.to(vb.dtype))
        S = max(s + T for s in starts)
        return kb[:, :, :S], vb[:, :, :S]

    def _ring_order(self, n_old: int, device: torch.device) -> torch.Tensor:
        # Slots of the last min(n_old, capacity) positions, oldest first.
        kept = min(n_old, self.capacity)
        return torch.arange(n_old - kept, n_old, device=device) % self.capacity

    def _update_ring(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, n_old: int,
                     T: int) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self._k[layer_idx], self._v[layer_idx]
        order = self._ring_order(n_old, kb.device)
        # Old entries in time order, then the new ones: the window mask is then aligned bottom-right.
        k_all = torch.cat([kb.index_select(2, order), k], dim=2)
        v_all = torch.cat([vb.index_select(2, order), v], dim=2)
        m = min(T, self.capacity)
        slots = torch.arange(n_old + T - m, n_old + T, device=kb.device) % self.capacity
        kb.index_copy_(2, slots, k[:, :, T - m:])
        vb.index_copy_(2, slots, v[:, :, T - m:])
        return k_all, v_all

    def _write_valid(self, layer_idx: int, starts: list[int], T: int, valid: torch.Tensor | None) -> None:
        # One padding mask per layer (tiny next to K/V): every layer writes the same values, and in ring
        # mode a layer must still see the slots that an earlier layer's update of this step overwrote.
        B = len(starts)
        if self._valid is None:
            self._valid = torch.ones(self.n_layers, B, self.capacity, dtype=torch.bool, device=self._k[0].device)
        vb = self._valid[layer_idx]
        dev = vb.device
        vals = valid.to(dev) if valid is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
        if self.window is not None:
            old = vb.index_select(1, self._ring_order(starts[0], dev))
            self._last_pad[layer_idx] = torch.cat([old, vals], dim=1)
            m = min(T, self.capacity)
            slots = torch.arange(starts[0] + T - m, starts[0] + T, device=dev) % self.capacity
            vb.index_copy_(1, slots, vals[:, T - m:])
        else:
            idx = torch.tensor(starts, device=dev).view(-1, 1) + torch.arange(T, device=dev)
            vb.scatter_(1, idx, vals)
            self._last_pad[layer_idx] = vb[:, :max(s + T for s in starts)]
        if valid is not None and not bool(valid.all()):
            self._has_invalid = True

    def get(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Cached keys/values of ``layer_idx``, ``(B, Hk, S, D)`` (time order), or ``(None, None)``."""
        self._check_layer(layer_idx)
        if not self.allocated or not self._lens[layer_idx] or max(self._lens[layer_idx]) == 0:
            return None, None
        kb, vb = self._k[layer_idx], self._v[layer_idx]
        if self.window is not None:
            order = self._ring_order(self._lens[layer_idx][0], kb.device)
            return kb.index_select(2, order), vb.index_select(2, order)
        S = max(self._lens[layer_idx])
        return kb[:, :, :S], vb[:, :, :S]

    def attention_kwargs(self, layer_idx: int, window: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``fastarch.ops.attention`` matching the keys the last ``update`` of
        ``layer_idx`` returned: masks padding, per-sequence offsets and the ring window.

        ``window``: the model's own sliding window (each query sees itself and ``window`` earlier positions),
        folded in correctly also when sequences have different offsets; defaults to the ring size.
        """
        self._check_layer(layer_idx)
        if window is not None and (not isinstance(window, int) or window < 0):
            raise _err(f"argument 'window' must be an int >= 0 or None, got {window!r}")
        if window is None:
            window = self.window
        elif self.window is not None and window > self.window:
            raise _err(f"attention window {window} is wider than the ring buffer (window={self.window}): the "
                       "keys it needs were overwritten")
        last = self._last[layer_idx]
        if last is None:
            raise _err(f"attention_kwargs({layer_idx}) called before any update of that layer", RuntimeError)
        starts, T = last
        kw: dict[str, Any] = {}
        pad = self._last_pad[layer_idx] if self._has_invalid else None
        if all(s == starts[0] for s in starts):
            kw["causal"] = True
            if window is not None:
                kw["window"] = (window, 0)
        else:
            # Sequence b's query t sits at position starts[b] + t: not one bottom-right offset, so mask
            # explicitly with an additive bias (B, 1, T, S).
            S = max(s + T for s in starts)
            dev = self._k[layer_idx].device
            qpos = torch.tensor(starts, device=dev).view(-1, 1, 1) + torch.arange(T, device=dev).view(1, -1, 1)
            kpos = torch.arange(S, device=dev).view(1, 1, -1)
            allowed = kpos <= qpos
            if window is not None:
                allowed = allowed & (kpos >= qpos - window)
            if pad is not None:
                allowed = allowed & pad.view(pad.shape[0], 1, -1)
                pad = None
            bias = torch.zeros(allowed.shape, dtype=self.dtype, device=dev)
            bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)
            kw["attn_bias"] = bias.unsqueeze(1)
        if pad is not None:
            kw["key_padding_mask"] = pad
        return kw

    def reorder(self, index: torch.Tensor) -> None:
        """Select/reorder sequences along the batch (beam search): row ``i`` becomes old row ``index[i]``."""
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
            raise _err("argument 'index' must be a 1-D integer tensor", TypeError)
        if self.batch_size is not None and index.numel() != self.batch_size:
            raise _err(f"argument 'index' must have {self.batch_size} entries, got {index.numel()}")
        if not self.allocated:
            return
        idx = index.to(self._k[0].device).long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch_size):
            raise _err(f"argument 'index' entries must be in [0, {self.batch_size})", IndexError)
        for t in self._k + self._v:
            t.copy_(t.index_select(0, idx))
        if self._valid is not None:
            self._valid.copy_(self._valid.index_select(1, idx))
        il = idx.tolist()
        self._lens = [[lens[i] for i in il] for lens in self._lens]

    def __repr__(self) -> str:
        mode = f", window={self.window}" if self.window is not None else ""
        return (f"KVCache(max_seq_len={self.max_seq_len}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"n_layers={self.n_layers}, batch_size={self.batch_size}, dtype={self.dtype}, "
                f"device={self.device}{mode}, seq_len={self.seq_len})")
