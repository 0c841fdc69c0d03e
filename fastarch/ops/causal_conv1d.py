"""Depthwise causal conv1d and its decode step, with the semantics of the ``causal_conv1d`` package.

``causal_conv1d(x, weight, bias=None, activation=None, *, seq_idx=None, initial_states=None,
return_final_states=False, final_states_out=None)``:

- ``x`` ``(B, D, L)`` (any strides, e.g. channel-last), ``weight`` ``(D, W)``, ``bias`` ``(D,)``;
- each row is convolved over ``[initial_states (D, W - 1; zeros when absent), x]``:
  ``out[b, d, t] = bias[d] + sum_k weight[d, k] * v[b, d, t + k]``, then SiLU when ``activation`` is
  ``"silu"`` or ``"swish"``; output ``(B, D, L)`` in ``x.dtype``;
- ``seq_idx`` ``(B, L)`` integer: several sequences packed in one row; a tap only reads positions of the
  same sequence (equal ``seq_idx``), so no sequence sees its predecessor. A negative ``seq_idx`` marks
  padding: its outputs are 0 (bias and activation not applied) and no sequence reads it. Not combinable with
  initial or final states (the package refuses that too);
- ``return_final_states`` also returns the last ``W - 1`` entries of that virtual sequence, ``(B, D, W - 1)``
  in ``x.dtype``, written into ``final_states_out`` when given; the states a later call continues from.

Differentiable in ``x``, ``weight``, ``bias`` and ``initial_states`` (the final states' gradient included).

``causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
conv_state_indices=None)``: T decode steps. ``x`` ``(B, D)`` or ``(B, D, T)``; ``conv_state``
``(B_state, D, S)``, ``S >= W - 1``, updated in place; row ``b`` uses ``conv_state[conv_state_indices[b]]``
(distinct indices) or ``conv_state[b]``; an index of -1 marks a padded row: its outputs are 0 and no state
is touched. Without ``cache_seqlens`` the state holds the last S inputs in
order and is shifted; with ``cache_seqlens`` ``(B,)`` it is a circular buffer: the i-th new input goes to
``(cache_seqlens[b] + i) % S`` and the window before it is read from just below. Every argument is
validated before ``conv_state`` is touched.

Backends (both ops; ``aten`` only for the convolution without ``seq_idx`` or initial states): ``aten``
(PyTorch's native grouped convolution and its backward), ``torch`` (composed PyTorch; an analytic backward in
composed PyTorch), ``cpp``
(the ``causal_conv1d`` C++ extension: loops parallel over batch x channel) and ``triton`` (tiled kernels in
``fastarch/kernels/causal_conv1d.py``; the backward sums per-tile partials of dw/dbias, no atomics). The compiled
backends take fp32 contiguous tensors (other inputs are converted), except that the ``cpp`` forward and
backward read a channel-last ``x`` (unit stride over ``D``, e.g. a transposed slice of a ``(B, L, D')``
projection) in place, and the forward then returns ``out`` channel-last (``(B, L, D)`` transposed), so
``out.transpose(1, 2)`` is contiguous; the update works on ``conv_state`` in
place when it is fp32 contiguous and through an fp32 copy written back otherwise (after validation).

``causal_conv1d_varlen_states(x, cu_seqlens, state_len)``: the conv states of packed variable-length
sequences (prefill of a batch laid out as ``(total, D)``): for sequence ``b`` the last ``state_len`` rows of
``x[cu_seqlens[b]:cu_seqlens[b + 1]]``, right-aligned, zeros before a shorter sequence's start; returns
``(B, D, state_len)`` (channel-last: ``(B, state_len, D)`` transposed), differentiable in ``x``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..backend import register
from ._backends import AtenImplementation, CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, check_writable, fail
from ._dispatch import call_of, dispatch, in_layout_of, resolve, run, run_backward

__all__ = ["causal_conv1d", "causal_conv1d_fn", "causal_conv1d_ref", "causal_conv1d_update",
           "causal_conv1d_update_ref", "causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"]

OP = "causal_conv1d"
OP_UPDATE = "causal_conv1d_update"
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_WIDTH = 64
_INT32_MAX = 2**31 - 1
PAD_SLOT = -1  # a conv_state_indices entry marking a padded batch row


def _check_activation(op: str, activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        fail(op, f"argument 'activation' must be None, 'silu' or 'swish', got {activation!r}", NotImplementedError)
    return activation is not None


# -- the oracle -------------------------------------------------------------------------------------------
def _same_sequence(seq_idx: torch.Tensor, width: int) -> torch.Tensor:
    """(B, L, W) bool: tap k of output t reads position t - (W - 1) + k of t's own sequence."""
    L = seq_idx.shape[-1]
    s = seq_idx.long()
    taps = F.pad(s, (width - 1, 0)).unfold(-1, width, 1)  # (B, L, W): seq_idx at each tap's position
    pos = torch.arange(L, device=s.device)[:, None] - (width - 1) + torch.arange(width, device=s.device)
    return (taps == s[..., None]) & (pos >= 0)


def _final_states(x: torch.Tensor, initial_states: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last W - 1 entries of ``[initial_states (or zeros), x]``: ``(B, D, W - 1)`` in ``x.dtype``."""
    keep, L = width - 1, x.shape[-1]
    if L >= keep:
        return x[..., L - keep:].contiguous()
    pre = x.new_zeros(*x.shape[:2], keep) if initial_states is None else initial_states.to(x.dtype)
    return torch.cat([pre[..., L:], x], dim=-1)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      activation: str | None = None, *, seq_idx: torch.Tensor | None = None,
                      initial_states: torch.Tensor | None = None, return_final_states: bool = False,
                      final_states_out: torch.Tensor | None = None
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: ``F.conv1d`` (or, with ``seq_idx``, masked windows) in the weight's dtype, cast back to
    ``x.dtype``. Returns ``out`` or ``(out, final_states)`` (see the module docstring)."""
    silu = _check_activation(OP, activation)
    dim, width = weight.shape
    xf = x.to(weight.dtype)
    pre = (xf.new_zeros(*x.shape[:2], width - 1) if initial_states is None
           else initial_states.to(weight.dtype))
    full = torch.cat([pre, xf], dim=-1)  # (B, D, W - 1 + L)
    if seq_idx is None:
        out = F.conv1d(full, weight.unsqueeze(1), bias, groups=dim)
    else:
        windows = full.unfold(-1, width, 1)  # (B, D, L, W)
        out = torch.einsum("bdlw,dw->bdl", windows * _same_sequence(seq_idx, width)[:, None], weight)
        if bias is not None:
            out = out + bias[:, None]
    out = F.silu(out) if silu else out
    if seq_idx is not None:
        out = out.masked_fill((seq_idx < 0)[:, None, :], 0)  # padding positions
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = full[..., full.shape[-1] - (width - 1):].to(x.dtype)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


# -- validation ---------------------------------------------------------------------------------------------
def _validate(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out) -> None:
    check_tensor(OP, "x", x, ndim=3)
    batch, dim, L = x.shape
    check_tensor(OP, "weight", weight, ndim=2)
    if weight.shape[0] != dim:
        fail(OP, f"argument 'weight' must have shape ({dim}, width) for x with {dim} channels, "
                 f"got {tuple(weight.shape)}")
    width = weight.shape[1]
    if not 1 <= width <= MAX_WIDTH:
        fail(OP, f"argument 'weight' must have a width between 1 and {MAX_WIDTH}, got {width}")
    if bias is not None:
        check_tensor(OP, "bias", bias, shape=(dim,))
    if seq_idx is not None:
        check_tensor(OP, "seq_idx", seq_idx, dtypes=INDEX_DTYPES, shape=(batch, L))
        if initial_states is not None:
            fail(OP, "argument 'initial_states' must be None when 'seq_idx' is given (the packed sequences "
                     "start from zeros)")
        if return_final_states:
            fail(OP, "argument 'return_final_states' must be False when 'seq_idx' is given (final states of "
                     "packed sequences are not defined)")
    if initial_states is not None:
        check_tensor(OP, "initial_states", initial_states, shape=(batch, dim, width - 1))
    if return_final_states and final_states_out is not None:
        check_tensor(OP, "final_states_out", final_states_out, shape=(batch, dim, width - 1))
    check_same_device(OP, "x", x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states,
                      final_states_out=final_states_out if return_final_states else None)


# -- the differentiable op ------------------------------------------------------------------------------------
def _channel_last(x: torch.Tensor) -> bool:
    """A non-contiguous ``(B, D, L)`` view with unit stride over ``D`` (e.g. ``(B, L, D')[..., :D]``
    transposed): the layout the C++ backend reads and writes without a transposing copy."""
    return not x.is_contiguous() and x.stride(1) == 1


def _empty_out(x: torch.Tensor) -> torch.Tensor:
    """The forward's output for ``x`` ``(B, D, L)``: dense channel-last (``(B, L, D)`` transposed) when ``x``
    is channel-last, else contiguous."""
    batch, dim, L = x.shape
    # new_empty_strided, not a transposed view: callers may update the op's output in place
    return x.new_empty_strided((batch, dim, L), (L * dim, 1, dim)) if _channel_last(x) else x.new_empty(x.shape)


def _call(x: torch.Tensor, weight: torch.Tensor, seq_idx: torch.Tensor | None,
          initial_states: torch.Tensor | None):
    return call_of(x, width=weight.shape[1], has_seq_idx=seq_idx is not None,
                   has_initial_states=initial_states is not None)


@torch.library.custom_op("fastarch::causal_conv1d_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None,
              initial_states: torch.Tensor | None, silu: bool, backend: str) -> torch.Tensor:
    out = run(OP, "forward", _call(x, weight, seq_idx, initial_states), backend, x, weight, bias, seq_idx,
              initial_states, silu)
    # the fake's layout: the F.conv1d backends may return other strides
    want = _empty_out(x)
    out = out if out.stride() == want.stride() else want.copy_(out)
    # a backend's transposed buffer is a view of it: autograd forbids in-place updates of a custom op's view
    return out.detach() if out._is_view() else out


@_conv_fwd.register_fake
def _(x, weight, bias, seq_idx, initial_states, silu, backend):
    return _empty_out(x)


@torch.library.custom_op("fastarch::causal_conv1d_bwd", mutates_args=())
def _conv_bwd(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              seq_idx: torch.Tensor | None, initial_states: torch.Tensor | None, silu: bool, backend: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return run_backward(OP, _call(x, weight, seq_idx, initial_states), backend, dout, x, weight, bias, seq_idx,
                        initial_states, silu)


@_conv_bwd.register_fake
def _(dout, x, weight, bias, seq_idx, initial_states, silu, backend):
    f32 = dict(dtype=torch.float32, device=x.device)
    batch, dim, _ = x.shape
    width = weight.shape[1]
    return (torch.empty(x.shape, **f32), torch.empty(dim, width, **f32), torch.empty(dim, **f32),
            torch.empty(batch, dim, width - 1, **f32))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, seq_idx, initial_states, silu, backend = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.silu, ctx.backend = silu, backend


def _backward(ctx, dout):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    dx, dw, db, dinit = _conv_bwd(dout if _channel_last(dout) else dout.contiguous(), x, weight, bias, seq_idx, initial_states, ctx.silu,
                                  ctx.backend)
    return (dx.to(x.dtype), dw.to(weight.dtype), None if bias is None else db.to(bias.dtype), None,
            None if initial_states is None else dinit.to(initial_states.dtype), None, None)


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, seq_idx: torch.Tensor | None = None,
                  initial_states: torch.Tensor | None = None, return_final_states: bool = False,
                  final_states_out: torch.Tensor | None = None, backend: str | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d: ``out[b, d, t] = bias[d] + sum_k weight[d, k] v[b, d, t + k]`` over
    ``v = [initial_states, x]`` (see the module docstring).

    Args:
        x: the input; steps before the start are ``initial_states`` (zeros when absent).
        weight: one filter of width ``W`` (1 to 64) per channel.
        bias: optional per-channel bias.
        activation: None, ``"silu"`` or ``"swish"``.
        seq_idx: optional sequence index of every step; taps never cross a change of sequence; a negative
            index marks padding, whose outputs are 0.
        initial_states: optional ``W - 1`` steps before the start.
        return_final_states: also return the last ``W - 1`` steps, the state a later call continues from.
        final_states_out: optional tensor the final states are written into.
        backend: force 'aten', 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        ``out`` in ``x.dtype``, or ``(out, final_states)`` when ``return_final_states``; differentiable in
        ``x``, ``weight``, ``bias`` and ``initial_states``.

    Shapes:
        x, out: ``(B, D, L)``; weight: ``(D, W)``; bias: ``(D,)``; seq_idx: ``(B, L)``;
        initial_states, final_states: ``(B, D, W - 1)``.
    """
    silu = _check_activation(OP, activation)
    _validate(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out)
    if x.numel() == 0:
        return causal_conv1d_ref(x, weight, bias, activation, seq_idx=seq_idx, initial_states=initial_states,
                                 return_final_states=return_final_states, final_states_out=final_states_out)
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    init = None if initial_states is None else initial_states.contiguous()
    name = resolve(OP, lambda: _call(x, weight, seq, init), backend)
    # channel-last x stays as it is: the C++ backend reads it in place and answers in the same layout
    out = _conv_fwd(x if _channel_last(x) else x.contiguous(), weight, bias, seq, init, silu, name)
    if seq is not None:
        pad = seq < 0
        if bool(pad.any()):  # padding positions answer 0 (and pass no gradient)
            out = out.masked_fill(pad[:, None, :], 0)
    if not return_final_states:
        return out
    # A slice of the inputs: autograd carries its gradient back to x and initial_states.
    final = _final_states(x, initial_states, weight.shape[1])
    if final_states_out is not None:
        final_states_out.copy_(final)  # recorded by autograd, so gradients still reach x / initial_states
        return out, final_states_out
    return out, final


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``causal_conv1d`` package's ``causal_conv1d_fn``, with its positional order."""
    return causal_conv1d(x, weight, bias, activation, seq_idx=seq_idx, initial_states=initial_states,
                         return_final_states=return_final_states, final_states_out=final_states_out)


# -- decode step ------------------------------------------------------------------------------------------
def _window_positions(cache_seqlens: torch.Tensor | None, S: int, width: int, batch: int,
                      device: torch.device) -> torch.Tensor:
    """(B, W - 1): where in each state row the W - 1 inputs before the new ones are."""
    j = torch.arange(width - 1, device=device)
    if cache_seqlens is None:
        return (S - (width - 1) + j).expand(batch, width - 1)
    return torch.remainder(cache_seqlens.long()[:, None] - (width - 1) + j, max(S, 1))


def causal_conv1d_update_ref(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = None,
                             cache_seqlens: torch.Tensor | None = None,
                             conv_state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """Reference decode step (see the module docstring); updates ``conv_state`` in place."""
    silu = _check_activation(OP_UPDATE, activation)
    if conv_state_indices is not None and bool((conv_state_indices == PAD_SLOT).any()):
        keep = conv_state_indices != PAD_SLOT  # padded rows: outputs 0, no state touched
        out = torch.zeros_like(x)
        out[keep] = causal_conv1d_update_ref(x[keep], conv_state, weight, bias, activation,
                                             None if cache_seqlens is None else cache_seqlens[keep],
                                             conv_state_indices[keep])
        return out
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    batch, dim, T = xs.shape
    width, S = weight.shape[1], conv_state.shape[-1]
    rows = (torch.arange(batch, device=x.device) if conv_state_indices is None
            else conv_state_indices.long())
    st = conv_state[rows]  # (B, D, S), a copy
    pos = _window_positions(cache_seqlens, S, width, batch, x.device)  # (B, W - 1)
    prev = st.gather(2, pos[:, None, :].expand(batch, dim, width - 1))
    full = torch.cat([prev.to(weight.dtype), xs.to(weight.dtype)], dim=-1)  # (B, D, W - 1 + T)
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=dim)
    if S > 0:
        if cache_seqlens is None:
            new = torch.cat([st, xs.to(st.dtype)], dim=-1)[..., -S:]
        else:
            # Only the last S new inputs survive; they land on distinct positions.
            first = max(0, T - S)
            put = torch.remainder(cache_seqlens.long()[:, None] + torch.arange(first, T, device=x.device), S)
            new = st.scatter(2, put[:, None, :].expand(batch, dim, T - first), xs[..., first:].to(st.dtype))
        conv_state[rows] = new
    out = F.silu(out) if silu else out
    return (out.squeeze(-1) if squeeze else out).to(x.dtype)


@torch.library.custom_op("fastarch::causal_conv1d_update", mutates_args=("conv_state",))
def _conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 silu: bool, cache_seqlens: torch.Tensor | None, conv_state_indices: torch.Tensor | None,
                 backend: str) -> torch.Tensor:
    out = run(OP_UPDATE, "update", _update_call(x, weight, cache_seqlens, conv_state_indices), backend, x,
              conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)
    return in_layout_of(x, out)  # x's layout, as the fake declares


def _update_call(x: torch.Tensor, weight: torch.Tensor, cache_seqlens: torch.Tensor | None,
                 conv_state_indices: torch.Tensor | None):
    return call_of(x, width=weight.shape[1], circular=cache_seqlens is not None,
                   has_conv_state_indices=conv_state_indices is not None)


@_conv_update.register_fake
def _(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices, backend):
    return torch.empty_like(x)


def _validate_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices) -> None:
    op = OP_UPDATE
    check_tensor(op, "x", x, ndim=(2, 3))
    batch, dim = x.shape[:2]
    check_tensor(op, "weight", weight, ndim=2)
    if weight.shape[0] != dim:
        fail(op, f"argument 'weight' must have shape ({dim}, width), got {tuple(weight.shape)}")
    if not 1 <= weight.shape[1] <= MAX_WIDTH:
        fail(op, f"argument 'weight' must have a width between 1 and {MAX_WIDTH}, got {weight.shape[1]}")
    check_tensor(op, "conv_state", conv_state, ndim=3)
    if conv_state_indices is None:
        check_tensor(op, "conv_state", conv_state, shape=(batch, dim, None))
    else:
        check_tensor(op, "conv_state", conv_state, shape=(None, dim, None))
        check_tensor(op, "conv_state_indices", conv_state_indices, dtypes=INDEX_DTYPES, shape=(batch,))
        n = conv_state.shape[0]
        if batch and (int(conv_state_indices.min()) < PAD_SLOT or int(conv_state_indices.max()) >= n):
            fail(op, f"argument 'conv_state_indices' must lie in [0, {n}) (conv_state has {n} rows) or be "
                     f"{PAD_SLOT} (a padded row), got values in [{int(conv_state_indices.min())}, "
                     f"{int(conv_state_indices.max())}]", IndexError)
        used = conv_state_indices[conv_state_indices != PAD_SLOT]
        if used.unique().numel() != used.numel():
            fail(op, "argument 'conv_state_indices' must not repeat a row (two rows would write one state)")
    if conv_state.shape[-1] < weight.shape[1] - 1:
        fail(op, f"argument 'conv_state' must hold at least width - 1 = {weight.shape[1] - 1} steps, "
                 f"got {conv_state.shape[-1]}")
    if cache_seqlens is not None:
        check_tensor(op, "cache_seqlens", cache_seqlens, dtypes=INDEX_DTYPES, shape=(batch,))
        if batch:
            lo, hi = (int(c) for c in torch.aminmax(cache_seqlens))
            if lo < 0 or hi > _INT32_MAX:
                # The kernels take int32 positions: a larger count would silently wrap.
                fail(op, f"argument 'cache_seqlens' must lie in [0, {_INT32_MAX}], got values in [{lo}, {hi}]")
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(dim,))
    check_same_device(op, "x", x, conv_state=conv_state, weight=weight, bias=bias, cache_seqlens=cache_seqlens,
                      conv_state_indices=conv_state_indices)
    check_writable(op, "conv_state", conv_state)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         cache_seqlens: torch.Tensor | None = None,
                         conv_state_indices: torch.Tensor | None = None, *,
                         backend: str | None = None) -> torch.Tensor:
    """One (or T) decode steps of :func:`causal_conv1d`, the ``causal_conv1d`` package's
    ``causal_conv1d_update``; ``conv_state`` is updated in place after every argument is validated.

    Args:
        x: the new inputs.
        conv_state: the last ``S >= W - 1`` inputs of each channel (a circular buffer with ``cache_seqlens``).
        weight: one filter of width ``W`` per channel.
        bias: optional per-channel bias.
        activation: None, ``"silu"`` or ``"swish"``.
        cache_seqlens: optional steps already in each row's circular buffer.
        conv_state_indices: optional row of ``conv_state`` for each batch row (distinct; -1: a padded row,
            whose outputs are 0 and which touches no state).
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The outputs of the new steps in ``x.dtype`` and ``x``'s shape (not differentiable).

    Shapes:
        x, out: ``(B, D)`` or ``(B, D, T)``; conv_state: ``(B_state, D, S)``; weight: ``(D, W)``;
        bias: ``(D,)``; cache_seqlens, conv_state_indices: ``(B,)``.
    """
    silu = _check_activation(OP_UPDATE, activation)
    _validate_update(x, conv_state, weight, bias, cache_seqlens, conv_state_indices)
    with torch.no_grad():
        if x.numel() == 0:
            return causal_conv1d_update_ref(x, conv_state, weight, bias, activation, cache_seqlens,
                                            conv_state_indices)
        if conv_state_indices is not None and bool((conv_state_indices == PAD_SLOT).any()):
            keep = conv_state_indices != PAD_SLOT  # padded rows: outputs 0, no state touched
            out = torch.zeros_like(x)
            if bool(keep.any()):
                out[keep] = causal_conv1d_update(x[keep], conv_state, weight, bias, activation,
                                                 None if cache_seqlens is None else cache_seqlens[keep],
                                                 conv_state_indices[keep], backend=backend)
            return out
        cs = None if cache_seqlens is None else cache_seqlens.to(torch.int32).contiguous()
        idx = None if conv_state_indices is None else conv_state_indices.to(torch.int32).contiguous()
        impl, name = dispatch(OP_UPDATE, lambda: _update_call(x, weight, cs, idx), backend, x, conv_state)
        if impl is not None:
            return in_layout_of(x, impl.update(x, conv_state, weight, bias, silu, cs, idx))
        return _conv_update(x, conv_state, weight, bias, silu, cs, idx, name)


# -- states of packed variable-length sequences -------------------------------------------------------------
def _validate_varlen_states(x, cu_seqlens, state_len) -> None:
    op = "causal_conv1d_varlen_states"
    check_tensor(op, "x", x, ndim=2)
    check_tensor(op, "cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
    if cu_seqlens.shape[0] < 1:
        fail(op, "argument 'cu_seqlens' must have batch + 1 >= 1 entries, got 0")
    if isinstance(state_len, bool) or not isinstance(state_len, int) or state_len < 0:
        fail(op, f"argument 'state_len' must be an int >= 0, got {state_len!r}")
    check_same_device(op, "x", x, cu_seqlens=cu_seqlens)
    total = x.shape[0]
    if cu_seqlens.numel():
        lo, hi = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if lo < 0 or hi > total or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            fail(op, f"argument 'cu_seqlens' must be non-decreasing offsets in [0, {total}] (x has {total} "
                     f"rows), got {cu_seqlens.tolist() if cu_seqlens.numel() <= 8 else 'values'} from {lo} to {hi}")


def causal_conv1d_varlen_states_ref(x: torch.Tensor, cu_seqlens: torch.Tensor, state_len: int) -> torch.Tensor:
    """Reference of :func:`causal_conv1d_varlen_states`, one sequence at a time."""
    batch, dim = cu_seqlens.shape[0] - 1, x.shape[1]
    states = x.new_zeros(batch, state_len, dim)
    for b in range(batch):
        end = int(cu_seqlens[b + 1])
        start = max(int(cu_seqlens[b]), end - state_len)
        if end > start:
            states[b, state_len - (end - start):] = x[start:end]
    return states.transpose(1, 2)


def causal_conv1d_varlen_states(x: torch.Tensor, cu_seqlens: torch.Tensor, state_len: int) -> torch.Tensor:
    """The conv states of packed variable-length sequences: for sequence ``b`` the last ``state_len`` rows of
    ``x[cu_seqlens[b]:cu_seqlens[b + 1]]``, right-aligned, zeros before the start of a shorter sequence
    (the ``causal_conv1d`` package's ``causal_conv1d_varlen_states``).

    Args:
        x: the packed inputs of every sequence, one row per step.
        cu_seqlens: offsets of the sequences in ``x`` (non-decreasing, in ``[0, total]``).
        state_len: how many steps each state keeps (e.g. the conv width - 1).

    Returns:
        The states in ``x.dtype``, channel-last (a ``(B, state_len, D)`` tensor transposed); differentiable
        in ``x``.

    Shapes:
        x: ``(total, D)``; cu_seqlens: ``(B + 1,)``; out: ``(B, D, state_len)``.
    """
    _validate_varlen_states(x, cu_seqlens, state_len)
    batch, (total, dim) = cu_seqlens.shape[0] - 1, x.shape
    if batch == 0 or state_len == 0 or total == 0:
        return x.new_zeros(batch, state_len, dim).transpose(1, 2)
    cu = cu_seqlens.long()
    end, begin = cu[1:, None], cu[:-1, None]
    src = end - state_len + torch.arange(state_len, device=x.device)  # (B, state_len): the row of each slot
    inside = src >= begin  # slots before the sequence's start stay zero
    rows = x[src.clamp(0, total - 1)]  # (B, state_len, D)
    return torch.where(inside[..., None], rows, rows.new_zeros(())).transpose(1, 2)


# -- backends ---------------------------------------------------------------------------------------------
class TorchCausalConv1d(TorchImplementation):
    op = OP
    description = "F.conv1d (grouped; masked windows with seq_idx); analytic backward in composed PyTorch, fp32"

    def forward(self, x, weight, bias, seq_idx, initial_states, silu):
        return causal_conv1d_ref(x, weight, bias, "silu" if silu else None, seq_idx=seq_idx,
                                 initial_states=initial_states).contiguous()  # conv1d may pick other strides

    def backward(self, dout, x, weight, bias, seq_idx, initial_states, silu):
        batch, dim, L = x.shape
        w = weight.float()
        width = w.shape[1]
        g = dout.float()
        if silu:
            pre = causal_conv1d_ref(x.float(), w, None if bias is None else bias.float(), seq_idx=seq_idx,
                                    initial_states=None if initial_states is None else initial_states.float())
            sg = torch.sigmoid(pre)
            g = g * sg * (1 + pre * (1 - sg))
        pad = (x.new_zeros(batch, dim, width - 1, dtype=torch.float32) if initial_states is None
               else initial_states.float())
        full = torch.cat([pad, x.float()], dim=-1)  # (B, D, W - 1 + L)
        windows = full.unfold(-1, width, 1)  # (B, D, L, W): the inputs each output reads
        keep = None if seq_idx is None else _same_sequence(seq_idx, width)[:, None].float()  # (B, 1, L, W)
        if keep is not None:
            windows = windows * keep
        dw = torch.einsum("bdl,bdlw->dw", g, windows)
        dfull = torch.zeros_like(full)
        for k in range(width):  # output t reads full[t + k] with weight w[k]
            gk = g if keep is None else g * keep[..., k]
            dfull[..., k:k + L] += w[:, k, None] * gk
        return dfull[..., width - 1:].clone(), dw, g.sum((0, 2)), dfull[..., :width - 1].clone()

    def update(self, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
        return causal_conv1d_update_ref(x, conv_state, weight, bias, "silu" if silu else None, cache_seqlens,
                                        conv_state_indices)


class AtenCausalConv1d(AtenImplementation):
    op = OP
    description = "PyTorch's native grouped convolution (F.conv1d) and convolution_backward, in fp32"

    def check(self, call):
        reasons = []
        if call.get("has_seq_idx"):
            reasons.append("seq_idx (the native convolution reads across sequences)")
        if call.get("has_initial_states"):
            reasons.append("initial_states")
        return reasons

    def forward(self, x, weight, bias, seq_idx, initial_states, silu):
        return causal_conv1d_ref(x, weight.float(), None if bias is None else bias.float(),
                                 "silu" if silu else None)

    def backward(self, dout, x, weight, bias, seq_idx, initial_states, silu):
        xf, w = x.float(), weight.float().unsqueeze(1)
        dim, width = weight.shape
        g = dout.float()
        if silu:
            pre = F.conv1d(xf, w, None if bias is None else bias.float(), padding=width - 1,
                           groups=dim)[..., : x.shape[-1]]
            sg = torch.sigmoid(pre)
            g = g * sg * (1 + pre * (1 - sg))
        # The convolution's output has L + W - 1 steps, of which the first L are kept.
        g = F.pad(g, (0, width - 1))
        dx, dw, db = torch.ops.aten.convolution_backward(g, xf, w, [dim], [1], [width - 1], [1], False, [0], dim,
                                                          [True, True, True])
        # no initial states here (declined): their gradient slot is zeros
        return dx, dw.squeeze(1), db, x.new_zeros(x.shape[0], dim, width - 1, dtype=torch.float32)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class _CompiledCausalConv1d:
    """Shared glue of the C++ and Triton backends: fp32 contiguous tensors in, the kernels' results out.
    ``self.lib`` provides ``causal_conv1d_fwd``, ``causal_conv1d_bwd`` and ``causal_conv1d_update`` with
    the C++ extension's signatures."""

    lib: Any

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        """``x`` or ``dout`` as the kernels read it: fp32 contiguous."""
        return t.float().contiguous()

    def forward(self, x, weight, bias, seq_idx, initial_states, silu):
        return self.lib.causal_conv1d_fwd(self._rows(x), _f32(weight), _f32(bias), seq_idx, _f32(initial_states),
                                          silu).to(x.dtype)

    def backward(self, dout, x, weight, bias, seq_idx, initial_states, silu):
        return tuple(self.lib.causal_conv1d_bwd(self._rows(x), _f32(weight), _f32(bias), self._rows(dout), seq_idx,
                                                _f32(initial_states), silu))

    def update(self, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
        xs = _f32(x.unsqueeze(-1) if x.dim() == 2 else x)
        direct = conv_state.dtype == torch.float32 and conv_state.is_contiguous()
        work = conv_state if direct else _f32(conv_state)
        out = self.lib.causal_conv1d_update(xs, work, _f32(weight), _f32(bias), silu, cache_seqlens,
                                            conv_state_indices)
        if not direct:
            conv_state.copy_(work)
        out = out.to(x.dtype)
        return out.squeeze(-1) if x.dim() == 2 else out


class CppCausalConv1d(CppImplementation, _CompiledCausalConv1d):
    op, extension = OP, "causal_conv1d"
    description = ("C++ loops over (batch, channel) rows, or over steps vectorised across channels for "
                   "channel-last x (read and written in place), fp32 (the causal_conv1d extension)")

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        """fp32, contiguous or channel-last (the C++ kernels read both layouts)."""
        t = t.float()
        return t if _channel_last(t) else t.contiguous()


class TritonCausalConv1d(TritonImplementation, _CompiledCausalConv1d):
    op, kernel_module = OP, "causal_conv1d"
    description = "Triton: tiled (channel block x time block) forward; backward with per-tile dw/dbias partials"


class TorchCausalConv1dUpdate(TorchCausalConv1d):
    op = OP_UPDATE
    description = "composed PyTorch (the reference), in place on conv_state"


class CppCausalConv1dUpdate(CppCausalConv1d):
    op = OP_UPDATE
    description = "C++ loop over (batch, channel) rows, in place on conv_state (linear or circular)"


class TritonCausalConv1dUpdate(TritonCausalConv1d):
    op = OP_UPDATE
    description = "Triton: a program per (batch, channel block); state updated in place (linear or circular)"


for _impl in (TorchCausalConv1d, AtenCausalConv1d, CppCausalConv1d, TritonCausalConv1d, TorchCausalConv1dUpdate,
              CppCausalConv1dUpdate, TritonCausalConv1dUpdate):
    register(_impl)
