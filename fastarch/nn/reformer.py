"""Reformer: LSH self-attention with shared query/key, reversible residual layers, chunked feed-forward.

- :class:`LSHAttention` is the guide's drop-in (same constructor, same ``state_dict`` keys ``w_q``, ``w_k``,
  ``w_v``, ``w_o``) but does real LSH attention through :func:`fastarch.ops.lsh_attention`.
- :class:`ReformerLayer` is one reversible block ``y1 = x1 + Attn(LN(x2))``, ``y2 = x2 + FF(LN(y1))``.
- :class:`Reformer` stacks layers on the doubled stream ``[x, x]`` and runs them through
  :class:`_ReversibleSequence`, a custom autograd function that keeps only the last output and recomputes
  each layer's inputs (``x2 = y2 - FF(y1)``, ``x1 = y1 - Attn(x2)``) in the backward, replaying the random
  state so hashing rotations and dropout masks match: activation memory does not grow with depth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.lsh_attention import lsh_attention, lsh_hash, lsh_rotations
from ._models_common import key_padding_mask
from .attention import Attention
from .linear import Linear

__all__ = ["LSHAttention", "ChunkedFeedForward", "ReformerLayer", "Reformer", "ReformerLM"]


class LSHAttention(Attention):
    """Reformer LSH self-attention (drop-in for the guide's ``LSHAttention``).

    Args:
        d_model, n_heads: model width and heads (``d_model % n_heads == 0``).
        n_hashes: hashing rounds. bucket_size: chunk length of the sorted sequence.
        dropout: dropout rate. causal: mask later positions (keyword-only, new).
        seed: fixed seed for the random rotations (keyword-only, new); None draws fresh rotations from
            torch's default generator on every call, as the Reformer does.

    Input ``x`` ``(B, L, d_model)``; optional ``mask`` ``(B, L)`` or ``(B, 1, 1, L)``, nonzero = keep key.
    Output ``(B, L, d_model)``.

    Deviations from the guide, whose ``forward`` hashes and then falls back to full O(L^2) attention:

    - real LSH attention (hash, sort, chunk with look-one-back, combine rounds; O(n_hashes L bucket_size));
    - shared query/key as in the Reformer: ``w_q`` projects the shared ``qk``; keys are ``qk`` normalised
      to unit length and a position never attends itself unless it has nothing else. ``w_k`` is kept so
      the guide's ``state_dict`` loads, but it is unused and frozen (``requires_grad=False``);
    - ``dropout`` is applied to the attention output (before ``w_o``), not to the probabilities;
    - ``hash_vectors(vecs, num_buckets)`` is one round of the Reformer hash ``argmax(concat[xR, -xR])``
      (the guide's is ``argmax(xR)``), so ``num_buckets`` must be even;
    - ``mask`` may only be a key mask (``(B, L)`` or ``(B, 1, 1, L)``); a full ``(L, L)`` mask has no
      meaning after the sort (use ``causal=True`` for causal masking).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_hashes: int = 4,
        bucket_size: int = 64,
        dropout: float = 0.1,
        *,
        causal: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"))
        if n_hashes < 1:
            raise ValueError(f"LSHAttention: n_hashes must be >= 1, got {n_hashes}")
        if bucket_size < 1:
            raise ValueError(f"LSHAttention: bucket_size must be >= 1, got {bucket_size}")
        self.n_hashes = n_hashes
        self.bucket_size = bucket_size
        self.causal = causal
        self.seed = seed
        self.w_k.requires_grad_(False)  # kept for the guide's state_dict; shared QK uses w_q
        self.dropout = nn.Dropout(dropout)

    def hash_vectors(self, vecs: torch.Tensor, num_buckets: int) -> torch.Tensor:
        """The guide's hashing entry point, as one round of the Reformer's angular LSH.

        vecs ``(B, H, L, d_k)``; returns ``(B, H, L)`` int64 buckets in ``[0, num_buckets)``:
        ``argmax(concat[x R, -x R])`` with random rotations ``R`` ``(d_k, num_buckets / 2)`` drawn from
        ``seed`` (or torch's default generator). The guide's ``argmax(x R)`` over ``num_buckets`` columns
        is replaced by the Reformer's rule, which needs an even ``num_buckets`` >= 2.
        """
        if vecs.dim() != 4 or vecs.shape[-1] != self.d_k:
            raise ValueError(
                f"LSHAttention.hash_vectors: argument 'vecs' must be (B, H, L, {self.d_k}), "
                f"got {tuple(vecs.shape)}"
            )
        if (
            isinstance(num_buckets, bool)
            or not isinstance(num_buckets, int)
            or num_buckets < 2
            or num_buckets % 2
        ):
            raise ValueError(
                f"LSHAttention.hash_vectors: argument 'num_buckets' must be an even integer >= 2 (the Reformer "
                f"hash splits the buckets into +/- projections), got {num_buckets!r}"
            )
        rotations = lsh_rotations(self.d_k, 1, num_buckets, self.seed, vecs.device)
        return lsh_hash(vecs, rotations)[:, :, 0]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"LSHAttention: argument 'x' must be (B, L, {self.d_model}), got {tuple(x.shape)}"
            )
        B, L, _ = x.shape
        kpm = key_padding_mask(mask, B, L, "LSHAttention")
        qk = self.w_q(x).view(B, L, self.n_heads, self.d_k).transpose(1, 2)
        v = self.w_v(x).view(B, L, self.n_heads, self.d_k).transpose(1, 2)
        o = lsh_attention(
            qk,
            v,
            n_hashes=self.n_hashes,
            bucket_size=self.bucket_size,
            causal=self.causal,
            key_padding_mask=kpm,
            seed=self.seed,
        )
        o = self.dropout(o.transpose(1, 2).reshape(B, L, self.d_model))
        return self.w_o(o)


class ChunkedFeedForward(nn.Module):
    """``Linear -> GELU -> Dropout -> Linear`` applied to ``chunks`` slices of the sequence in turn, so the
    ``(B, L, d_ff)`` hidden activation is never whole (the Reformer's chunked feed-forward)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, chunks: int = 1) -> None:
        super().__init__()
        if chunks < 1:
            raise ValueError(f"ChunkedFeedForward: chunks must be >= 1, got {chunks}")
        self.chunks = chunks
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(F.gelu(self.w1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks == 1 or x.shape[1] <= 1:
            return self._ff(x)
        return torch.cat([self._ff(c) for c in x.chunk(self.chunks, dim=1)], dim=1)


class _Replay:
    """Records the random state before a call and replays it for the recomputation in the backward."""

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.cuda: list[torch.Tensor] | None = None
        self.devices: list[int] = []

    def record(self, x: torch.Tensor) -> None:
        self.cpu = torch.get_rng_state()
        if x.is_cuda:
            self.devices = [x.device.index or 0]
            self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            assert self.cpu is not None
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                for d, s in zip(self.devices, self.cuda):
                    torch.cuda.set_rng_state(s, d)
            yield


class ReformerLayer(nn.Module):
    """One reversible Reformer block on the pair ``(x1, x2)`` (each ``(B, L, d_model)``):
    ``y1 = x1 + Attn(LN(x2))``, ``y2 = x2 + FF(LN(y1))``."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        n_hashes: int = 4,
        bucket_size: int = 64,
        dropout: float = 0.1,
        causal: bool = False,
        ff_chunks: int = 1,
    ) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        self.attn = LSHAttention(d_model, n_heads, n_hashes, bucket_size, dropout, causal=causal)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = ChunkedFeedForward(d_model, d_ff or 4 * d_model, dropout, ff_chunks)

    def f(self, x2: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.attn(self.norm_attn(x2), mask)

    def g(self, y1: torch.Tensor) -> torch.Tensor:
        return self.ff(self.norm_ff(y1))

    def forward(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        rng: tuple[_Replay, _Replay] | None = None,
    ):
        """``rng``: empty ``(f, g)`` records to fill with the random state before each half, so that
        :meth:`backward_pass` can replay this very call (rotations and dropout masks)."""
        if rng is not None:
            rng[0].record(x2)
        y1 = x1 + self.f(x2, mask)
        if rng is not None:
            rng[1].record(y1)
        y2 = x2 + self.g(y1)
        return y1, y2

    def backward_pass(self, y1, y2, dy1, dy2, mask, rng: tuple[_Replay, _Replay]):
        """Recompute the inputs from the outputs, replaying the random state ``rng`` recorded by the forward
        call that produced them; return ``(x1, x2, dx1, dx2, parameter grads)``."""
        f_rng, g_rng = rng
        params = [p for p in self.parameters() if p.requires_grad]
        with torch.enable_grad():
            y1r = y1.detach().requires_grad_(True)
            with g_rng.replay():
                gy = self.g(y1r)
            g_grads = torch.autograd.grad(gy, [y1r, *params], dy2, allow_unused=True)
        with torch.no_grad():
            x2 = y2 - gy
            dy1_total = dy1 + g_grads[0]
        with torch.enable_grad():
            x2r = x2.detach().requires_grad_(True)
            with f_rng.replay():
                fx = self.f(x2r, mask)
            f_grads = torch.autograd.grad(fx, [x2r, *params], dy1_total, allow_unused=True)
        with torch.no_grad():
            x1 = y1 - fx
            dx2 = dy2 + f_grads[0]
        grads = []
        for a, b in zip(g_grads[1:], f_grads[1:]):
            grads.append(a if b is None else (b if a is None else a + b))
        return x1, x2, dy1_total, dx2, grads


class _ReversibleSequence(torch.autograd.Function):
    """Runs the layers without saving activations; the backward walks them in reverse, recomputing.

    The random states are kept per call in ``ctx`` (not on the layers), so several forward calls of the
    same model before one backward (micro-batches, siamese losses) each replay their own."""

    @staticmethod
    def forward(ctx, x1, x2, mask, layers, *params):
        rngs = []
        with torch.no_grad():
            for layer in layers:
                rng = (_Replay(), _Replay())
                x1, x2 = layer(x1, x2, mask, rng=rng)
                rngs.append(rng)
        ctx.layers = layers
        ctx.rngs = rngs
        ctx.mask = mask
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        grads_per_layer = []
        for layer, rng in zip(reversed(ctx.layers), reversed(ctx.rngs)):
            y1, y2, dy1, dy2, grads = layer.backward_pass(y1, y2, dy1, dy2, ctx.mask, rng)
            grads_per_layer.append(grads)
        flat = []
        for grads in reversed(grads_per_layer):
            flat.extend(grads)
        return (dy1, dy2, None, None, *flat)


class Reformer(nn.Module):
    """A stack of :class:`ReformerLayer` on ``(B, L, d_model)``: the input is doubled to ``(x, x)``, the
    reversible layers run, and the two halves are averaged. With ``reversible=False`` the same layers run
    with ordinary autograd (activations saved per layer; used to check the reversible backward)."""

    def __init__(self, d_model: int, n_heads: int, depth: int, d_ff: int | None = None, n_hashes: int = 4,
                 bucket_size: int = 64, dropout: float = 0.1, causal: bool = False, ff_chunks: int = 1,
                 reversible: bool = True) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"Reformer: depth must be >= 1, got {depth}")
        self.reversible = reversible
        self.layers = nn.ModuleList(
            ReformerLayer(d_model, n_heads, d_ff, n_hashes, bucket_size, dropout, causal, ff_chunks)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x1, x2 = x, x
        if self.reversible and torch.is_grad_enabled():
            params = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
            x1, x2 = _ReversibleSequence.apply(x1, x2, mask, list(self.layers), *params)
        else:
            for layer in self.layers:
                x1, x2 = layer(x1, x2, mask)
        return (x1 + x2) / 2


class ReformerLM(nn.Module):
    """Token embedding + learned positions + :class:`Reformer` + LayerNorm + tied-free LM head.

    ``input_ids`` ``(B, L)`` (``L <= max_seq_len``) -> logits ``(B, L, vocab_size)``. ``causal`` defaults to
    True (a language model).
    """

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, depth: int, max_seq_len: int,
                 d_ff: int | None = None, n_hashes: int = 4, bucket_size: int = 64, dropout: float = 0.1,
                 causal: bool = True, ff_chunks: int = 1, reversible: bool = True) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.reformer = Reformer(
            d_model, n_heads, depth, d_ff, n_hashes, bucket_size, dropout, causal, ff_chunks, reversible
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = Linear(d_model, vocab_size)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"ReformerLM: argument 'input_ids' must be (B, L), got {tuple(input_ids.shape)}")
        L = input_ids.shape[1]
        if L > self.max_seq_len:
            raise ValueError(f"ReformerLM: sequence length {L} > max_seq_len {self.max_seq_len}")
        x = self.tok(input_ids) + self.pos(torch.arange(L, device=input_ids.device))
        return self.head(self.norm(self.reformer(x, mask)))
