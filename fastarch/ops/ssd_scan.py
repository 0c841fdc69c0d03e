"""Mamba-2's state-space-dual (SSD) scan, compatible with mamba-ssm's ``mamba_chunk_scan_combined``.

Every head ``h`` (of ``H``) keeps a ``(P, N)`` state; heads share ``B`` and ``C`` in ``G`` groups (head ``h``
reads group ``h // (H // G)``)::

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)     (softplus when dt_softplus; clamp when dt_limit
                                                             is not (0, inf))
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T     (x_t: P, B_t: N)
    y_t  = h_t C_t + D * x_t
    out  = y * silu(z)                                    (when z is given)

``seq_idx`` restarts the state where it changes (``h_{t-1}`` counts as 0 when ``seq_idx[t] != seq_idx[t-1]``,
with ``seq_idx[-1]`` taken as 0, as mamba-ssm does, so ``initial_states`` feed the sequence numbered 0). Each
sequence's steps are contiguous: a number does not reappear after another one.

Shapes (as in mamba-ssm): ``x``, ``z``, ``out`` ``(batch, L, H, P)``; ``dt`` ``(batch, L, H)``; ``A`` ``(H,)``;
``B``, ``C`` ``(batch, L, G, N)``; ``D`` ``(H,)`` or ``(H, P)``; ``dt_bias`` ``(H,)``; ``initial_states`` and the
final states ``(batch, H, P, N)``; ``seq_idx`` ``(batch, L)`` integer; ``cu_seqlens`` ``(num_seqs + 1,)``.

The kernels compute the core scan only: ``(x, dt, A, B, C, initial_states, seq_idx, chunk_size) -> (y,
final_states, chunk_states)``, with ``dt`` already biased, softplus-ed and clamped, and ``y = h_t C_t`` in fp32.
The gate is elementwise PyTorch around it, differentiated by autograd. The steps (bias, softplus, clamp) and
the skip ``D * x`` belong to the custom op: an implementation with ``fused_elementwise`` (cpp) takes the raw
``dt`` and forms the steps as it reads them, adds the skip inside its forward, and reads ``x``, ``dt``, ``B``,
``C`` through their strides (they are often views of one projection and one convolution output, so no copy
and no extra pass is made); for the others the op forms the steps with :func:`effective_dt`, makes the inputs
contiguous and adds the skip after the kernel. The op's backward recomputes the steps with autograd (nothing
extra is stored) to carry their gradient to ``dt`` and ``dt_bias``, and forms the skip's gradients (``x``,
``D``) from the saved inputs.
``chunk_states`` ``(batch, n_chunks, H, P, N)`` fp32 holds the state entering each chunk of ``chunk_size``
steps (the true state at position ``c * chunk_size - 1``, before any restart at the chunk's first step;
``initial_states`` or 0 for chunk 0). It is all the backward keeps besides the inputs, and what the varlen
states are computed from: memory ``O(batch * L * H * P + batch * (L / chunk_size) * H * P * N)``, never
``batch * L * H * P * N``.

Backends: ``torch`` (the chunked SSD algorithm as PyTorch matrix multiplies; the backward by autograd
through a recomputed forward), ``cpp`` and ``triton``. The oracle :func:`ssd_scan_ref` is a sequential fp32
recurrence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..backend import Call, choose, register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, in_layout_of, resolve, run_backward
from .selective_scan import selective_scan

__all__ = ["chunk_scan", "chunk_scan_ref", "chunk_state", "chunk_state_ref", "chunk_state_varlen",
           "mamba_chunk_scan", "mamba_chunk_scan_combined", "ssd_chunk_scan_combined_ref", "ssd_scan",
           "ssd_scan_ref", "ssd_selective_scan", "state_passing", "state_passing_ref"]

OP = "ssd_scan"
INDEX_DTYPES = (torch.int32, torch.int64)


# -- the pieces every path shares ---------------------------------------------------------------------------
def effective_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                 dt_limit: tuple[float, float]) -> torch.Tensor:
    """The time steps the scan uses, fp32 ``(batch, L, H)``: bias, softplus (identity above 20, as
    mamba-ssm's kernels do), then the ``dt_limit`` clamp unless it is ``(0, inf)``."""
    dtf = dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = torch.where(dtf <= 20.0, F.softplus(dtf), dtf)
    if tuple(dt_limit) != (0.0, math.inf):
        dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    return dtf


def skip_and_gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
                  ) -> torch.Tensor:
    """``(y + D * x) * silu(z)`` in fp32, as ``x.dtype``; ``y`` fp32 ``(batch, L, H, P)``."""
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """``(1, L)`` int32: the sequence number of each packed position."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(counts.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, counts, output_size=seqlen)[None]


# -- the oracle ----------------------------------------------------------------------------------------------
def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
) -> Any:
    """The oracle: the recurrence of the module docstring, one step at a time in fp32 (``chunk_size`` is
    accepted for signature compatibility and ignored). Differentiable by autograd. Returns what
    :func:`ssd_scan` returns."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, seqlen)
    dtf = effective_dt(dt, dt_bias, dt_softplus, dt_limit)
    xf, Af = x.float(), A.float()
    Bh = B.float().repeat_interleave(nheads // ngroups, dim=2)  # (batch, L, H, N)
    Ch = C.float().repeat_interleave(nheads // ngroups, dim=2)
    h = (initial_states.float() if initial_states is not None
         else xf.new_zeros(batch, nheads, headdim, dstate))
    prev = torch.zeros(batch, dtype=torch.long, device=x.device)
    ys, states = [], []
    for t in range(seqlen):
        if seq_idx is not None:
            cur = seq_idx[:, t].long()
            h = h * (cur == prev).float()[:, None, None, None]
            prev = cur
        decay = torch.exp(dtf[:, t] * Af)  # (batch, H)
        h = decay[..., None, None] * h + (dtf[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
        states.append(h)
    y = torch.stack(ys, dim=1) if ys else xf.new_zeros(x.shape)
    out = skip_and_gate(y, x, D, z)
    res: list[torch.Tensor] = [out]
    if return_final_states:
        res.append(h)
    if return_varlen_states:
        assert cu_seqlens is not None
        ends = cu_seqlens.long()
        varlen = [states[int(e) - 1][0] if int(e) > int(s) else h.new_zeros(nheads, headdim, dstate)
                  for s, e in zip(ends[:-1], ends[1:])]
        res.append(torch.stack(varlen) if varlen else h.new_zeros(0, nheads, headdim, dstate))
    return res[0] if len(res) == 1 else tuple(res)


# -- validation ----------------------------------------------------------------------------------------------
def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
              return_varlen_states) -> None:
    check_tensor(OP, "x", x, ndim=4)
    batch, seqlen, nheads, headdim = x.shape
    check_tensor(OP, "dt", dt, shape=(batch, seqlen, nheads))
    if isinstance(A, torch.Tensor) and A.is_complex():
        fail(OP, "argument 'A' is complex; only real A is supported", NotImplementedError)
    check_tensor(OP, "A", A, shape=(nheads,))
    check_tensor(OP, "B", B, ndim=4)
    check_tensor(OP, "B", B, shape=(batch, seqlen, None, None))
    ngroups, dstate = B.shape[2], B.shape[3]
    if ngroups < 1 or nheads % ngroups != 0:
        fail(OP, f"argument 'B' has {ngroups} groups (shape {tuple(B.shape)}) but the number of heads "
                 f"H={nheads} must be a multiple of it")
    check_tensor(OP, "C", C, shape=(batch, seqlen, ngroups, dstate))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        fail(OP, f"argument 'chunk_size' must be a positive int, got {chunk_size!r}")
    if D is not None:
        check_tensor(OP, "D", D, ndim=(1, 2))
        check_tensor(OP, "D", D, shape=(nheads,) if D.dim() == 1 else (nheads, headdim))
    if z is not None:
        check_tensor(OP, "z", z, shape=(batch, seqlen, nheads, headdim))
    if dt_bias is not None:
        check_tensor(OP, "dt_bias", dt_bias, shape=(nheads,))
    if initial_states is not None:
        check_tensor(OP, "initial_states", initial_states, shape=(batch, nheads, headdim, dstate))
    if seq_idx is not None:
        check_tensor(OP, "seq_idx", seq_idx, dtypes=INDEX_DTYPES, shape=(batch, seqlen))
    if not (isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
            and all(isinstance(v, (int, float)) for v in dt_limit) and dt_limit[0] <= dt_limit[1]):
        fail(OP, f"argument 'dt_limit' must be a pair (low, high) of numbers with low <= high, got {dt_limit!r}")
    if cu_seqlens is not None:
        check_tensor(OP, "cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if batch != 1:
            fail(OP, f"argument 'cu_seqlens' packs sequences into one row: x must have batch 1, got {batch}")
        cu = cu_seqlens.tolist()
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seqlen or any(b < a for a, b in zip(cu, cu[1:])):
            fail(OP, f"argument 'cu_seqlens' must be non-decreasing from 0 to the length L={seqlen}, got "
                     f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
    if return_varlen_states and cu_seqlens is None:
        fail(OP, "return_varlen_states=True needs argument 'cu_seqlens'")
    check_same_device(OP, "x", x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens)


def _call(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> Call:
    return call_of(x, headdim=x.shape[3], dstate=B.shape[3], chunk_size=chunk_size)


# The largest chunk a call runs with: the intra-chunk terms are chunk x chunk per head, so the chunk bounds the
# memory and time of a call. Any larger chunk_size (and any chunk_size past the sequence length) is clamped:
# the result does not depend on the chunk size beyond rounding.
MAX_CHUNK_SIZE = 2048


def effective_chunk_size(chunk_size: int, seqlen: int) -> int:
    """The chunk a call of length ``seqlen`` runs with: ``chunk_size`` clamped to ``[1, min(seqlen,
    MAX_CHUNK_SIZE)]`` (a chunk past the sequence would only add padding)."""
    return max(1, min(chunk_size, seqlen, MAX_CHUNK_SIZE))


def n_chunks(seqlen: int, chunk_size: int) -> int:
    return (seqlen + chunk_size - 1) // chunk_size


# -- the custom ops -----------------------------------------------------------------------------------------
def _skip_weight(D: torch.Tensor) -> torch.Tensor:
    """``D`` ``(H,)`` or ``(H, P)`` as a weight broadcasting over ``(..., H, P)``."""
    return D[:, None] if D.dim() == 1 else D


@torch.library.custom_op("fastarch::ssd_scan_fwd", mutates_args=())
def _ssd_scan_fwd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_low: float,
    dt_high: float,
    initial_states: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    chunk_size: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dt`` is raw (the step is :func:`effective_dt` of it); ``x``, ``dt``, ``B``, ``C`` may have any strides;
    ``D`` and ``dt_bias`` fp32 or None. Returns fp32 (y + D x, final_states, chunk_states)."""
    impl = choose(OP, _call(x, B, chunk_size), backend)
    if getattr(impl, "fused_elementwise", False):
        y, final, chunk_states = impl.forward(x, dt, A, B, C, initial_states, seq_idx, chunk_size, D=D,
                                              dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=(dt_low, dt_high))
        return y, final, chunk_states
    dte = effective_dt(dt, dt_bias, dt_softplus, (dt_low, dt_high)).contiguous()
    y, final, chunk_states = impl.forward(x.contiguous(), dte, A, B.contiguous(), C.contiguous(), initial_states,
                                          seq_idx, chunk_size)
    if D is not None:
        y = y + x.float() * _skip_weight(D)
    return y, final, chunk_states


@_ssd_scan_fwd.register_fake
def _(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_low, dt_high, initial_states, seq_idx, chunk_size, backend):
    b, L, h, p = x.shape
    n = B.shape[3]
    return (x.new_empty(b, L, h, p, dtype=torch.float32), x.new_empty(b, h, p, n, dtype=torch.float32),
            x.new_empty(b, n_chunks(L, chunk_size), h, p, n, dtype=torch.float32))


@torch.library.custom_op("fastarch::ssd_scan_bwd", mutates_args=())
def _ssd_scan_bwd(
    dy: torch.Tensor,
    dfinal: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_states: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    chunk_states: torch.Tensor,
    chunk_size: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fp32 (dx, ddt, dA, dB, dC, dinitial_states); dinitial_states is empty without initial states."""
    grads = run_backward(OP, _call(x, B, chunk_size), backend, dy, dfinal, x, dt, A, B, C, initial_states,
                         seq_idx, chunk_states, chunk_size)
    inputs = (x, dt, A, B, C, initial_states)
    return tuple(x.new_empty(0, dtype=torch.float32) if t is None else in_layout_of(t, g.float())
                 for g, t in zip(grads, inputs))


@_ssd_scan_bwd.register_fake
def _(dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states, chunk_size, backend):
    def like(t):
        return x.new_empty(0, dtype=torch.float32) if t is None else torch.empty_like(t, dtype=torch.float32)

    return like(x), like(dt), like(A), like(B), like(C), like(initial_states)


def _setup_context(ctx, inputs, output) -> None:
    x, dt, A, B, C, D, dt_bias, dt_softplus, dt_low, dt_high, initial_states, seq_idx, chunk_size, backend = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, output[2])
    ctx.dt_softplus, ctx.dt_limit = dt_softplus, (dt_low, dt_high)
    ctx.chunk_size, ctx.backend = chunk_size, backend
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dfinal, _dchunk_states):
    x, dt, A, B, C, D, dt_bias, initial_states, seq_idx, chunk_states = ctx.saved_tensors
    if dy is None:
        dy = x.new_zeros(x.shape, dtype=torch.float32)
    dy = dy.float().contiguous()
    # the steps again, with autograd, to carry their gradient to dt and dt_bias (recomputed, not stored)
    steps_of = [t.detach().requires_grad_() for t in (dt, dt_bias) if t is not None]
    with torch.enable_grad():
        dte = effective_dt(steps_of[0], steps_of[1] if dt_bias is not None else None, ctx.dt_softplus,
                           ctx.dt_limit)
    # the backends' backward takes contiguous inputs (the forward may have read strided views)
    x, B, C = x.contiguous(), B.contiguous(), C.contiguous()
    grads = _ssd_scan_bwd(dy, dfinal, x, dte.detach().contiguous(), A, B, C, initial_states, seq_idx,
                          chunk_states, ctx.chunk_size, ctx.backend)
    dx, ddte, dA, dB, dC, dinit = grads
    step_grads = torch.autograd.grad(dte, steps_of, ddte)
    ddt = step_grads[0].to(dt.dtype)
    dbias = step_grads[1].to(dt_bias.dtype) if dt_bias is not None else None
    dD = None
    if D is not None:  # y += D x
        dx = dx + dy * _skip_weight(D)
        dD = (dy * x.float()).sum((0, 1))
        dD = (dD.sum(-1) if D.dim() == 1 else dD).to(D.dtype)
    dinit = None if initial_states is None else dinit.to(initial_states.dtype)
    return (dx.to(x.dtype), ddt, dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dD, dbias, None, None, None, dinit,
            None, None, None)


_ssd_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- varlen states -------------------------------------------------------------------------------------------
def varlen_states(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, seq_idx: torch.Tensor,
                  chunk_states: torch.Tensor, cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The state after each packed sequence's last step, ``(num_seqs, H, P, N)`` fp32 (0 for an empty one),
    from the chunk states and at most one chunk of steps per sequence. ``x`` ``(1, L, H, P)``, ``dt`` the
    effective steps ``(1, L, H)``, ``B`` ``(1, L, G, N)``, ``seq_idx`` ``(1, L)``."""
    seqlen, nheads = x.shape[1], x.shape[2]
    ngroups = B.shape[2]
    ends = cu_seqlens.long()[1:]
    nonempty = ends > cu_seqlens.long()[:-1]
    last = (ends - 1).clamp(min=0)  # (S,) position of each sequence's last step
    first = (last // chunk_size) * chunk_size  # start of the chunk holding it
    pos = first[:, None] + torch.arange(chunk_size, device=x.device)  # (S, chunk)
    inside = (pos <= last[:, None]) & (seq_idx[0, pos.clamp(max=seqlen - 1)] == seq_idx[0, last][:, None])
    pos = pos.clamp(max=seqlen - 1)
    dA = torch.where(inside[..., None], dt[0, pos].float() * A.float(), 0.0)  # (S, chunk, H)
    cum = dA.cumsum(1)
    decay = torch.exp(cum[:, -1:] - cum) * inside[..., None]  # to the last step
    Bh = B[0, pos].float().repeat_interleave(nheads // ngroups, dim=2)  # (S, chunk, H, N)
    w = decay * dt[0, pos].float()
    states = torch.einsum("sthp,sthn->shpn", w[..., None] * x[0, pos].float(), Bh)
    # the state entering the chunk carries over when that chunk's first step did not start the sequence
    chunk = last // chunk_size
    prev_id = torch.where(first > 0, seq_idx[0, (first - 1).clamp(min=0)], torch.zeros_like(first))
    carry = (prev_id == seq_idx[0, last]).float()
    carried = chunk_states[0, chunk] * (torch.exp(cum[:, -1]) * carry[:, None])[..., None, None]
    return (states + carried) * nonempty.float()[:, None, None, None]


# -- the public op -------------------------------------------------------------------------------------------
def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    *,
    backend: str | None = None,
) -> Any:
    """mamba-ssm's ``mamba_chunk_scan_combined``: the SSD scan of the module docstring.

    Args:
        x: the input ``(batch, L, H, P)``.
        dt: the time steps ``(batch, L, H)``, before ``dt_bias``, softplus and the clamp.
        A: ``(H,)``, real (negative for a decaying state).
        B, C: ``(batch, L, G, N)``, ``G`` dividing ``H``.
        chunk_size: steps per chunk; the result does not depend on it beyond rounding. Clamped to the
            sequence length and to :data:`MAX_CHUNK_SIZE` (2048), which bound each call's work.
        D: optional skip weight, ``(H,)`` or ``(H, P)``.
        z: optional gate ``(batch, L, H, P)``: the output is multiplied by ``silu(z)``.
        dt_bias: optional ``(H,)`` added to ``dt``.
        initial_states: optional ``(batch, H, P, N)`` state before the first step.
        seq_idx: optional ``(batch, L)`` integer sequence numbers; the state restarts where they change.
        cu_seqlens: optional ``(num_seqs + 1,)`` offsets of packed sequences (batch 1). Without ``seq_idx``,
            ``seq_idx`` is derived from it, so the sequences never mix.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: clamp the steps to ``[low, high]`` (no clamp for the default ``(0, inf)``).
        return_final_states: also return the state after the last step.
        return_varlen_states: also return each packed sequence's last state (needs ``cu_seqlens``; not
            differentiable).
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        ``out`` ``(batch, L, H, P)`` in ``x.dtype``; ``(out, final_states)`` with ``return_final_states``;
        ``(out, varlen_states)`` with ``return_varlen_states``; ``(out, final_states, varlen_states)`` with
        both. States are fp32, ``(batch, H, P, N)`` and ``(num_seqs, H, P, N)``.
    """
    _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_limit,
              return_varlen_states)
    chunk_size = effective_chunk_size(chunk_size, x.shape[1])
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1])
    if x.numel() == 0 or B.shape[3] == 0:
        return ssd_scan_ref(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                            dt_softplus, dt_limit, return_final_states, return_varlen_states)
    name = resolve(OP, lambda: _call(x, B, chunk_size), backend)
    y, final, chunk_states = _ssd_scan_fwd(
        x, dt, A.float().contiguous(), B, C, None if D is None else D.float().contiguous(),
        None if dt_bias is None else dt_bias.float().contiguous(), bool(dt_softplus), float(dt_limit[0]),
        float(dt_limit[1]), None if initial_states is None else initial_states.float().contiguous(),
        None if seq_idx is None else seq_idx.to(torch.int32).contiguous(), chunk_size, name)
    res: list[torch.Tensor] = [skip_and_gate(y, x, None, z)]
    if return_final_states:
        res.append(final)
    if return_varlen_states:
        assert cu_seqlens is not None and seq_idx is not None
        with torch.no_grad():
            dte = effective_dt(dt, dt_bias, dt_softplus, dt_limit)
            res.append(varlen_states(x, dte, A, B, seq_idx, chunk_states, cu_seqlens, chunk_size))
    return res[0] if len(res) == 1 else tuple(res)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """mamba-ssm's name and positional signature (``chunk_size`` required) for :func:`ssd_scan`."""
    return ssd_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                    dt_limit, return_final_states, return_varlen_states)


# -- the torch backend: the chunked SSD algorithm -----------------------------------------------------------
class _Chunks:
    """The inputs cut into chunks, in the group view ``(batch, chunk, step, G, R, ...)`` (``R = H // G``
    heads per group), padded to whole chunks with ``dt = 0`` steps, which neither decay nor add, and the
    masks ``seq_idx`` implies. Shared by the chunked forward and its backward."""

    def __init__(self, x, dt, A, B, C, seq_idx, chunk_size):
        self.batch, self.seqlen, self.nheads, self.headdim = x.shape
        self.ngroups, self.dstate = B.shape[2], B.shape[3]
        self.rep, self.cs = self.nheads // self.ngroups, chunk_size
        self.nc = n_chunks(self.seqlen, chunk_size)
        self.pad = self.nc * chunk_size - self.seqlen
        b, nc, cs, g, r = self.batch, self.nc, self.cs, self.ngroups, self.rep
        self.x = self.chunked(x.float()).view(b, nc, cs, g, r, self.headdim)
        self.dt = self.chunked(dt.float()).view(b, nc, cs, g, r)
        self.B = self.chunked(B.float()).view(b, nc, cs, g, self.dstate)
        self.C = self.chunked(C.float()).view(b, nc, cs, g, self.dstate)
        self.A = A.float().view(g, r)
        self.cum = (self.dt * self.A).cumsum(2)  # (batch, nc, cs, G, R), inclusive
        steps = torch.arange(cs, device=x.device)
        causal = steps[:, None] >= steps[None, :]  # (t, s)
        if seq_idx is None:
            self.same = causal.expand(b, nc, cs, cs)
            self.carry_in = self.to_end = self.keep = None
            return
        sid = seq_idx.long()
        if self.pad:
            sid = torch.cat([sid, sid[:, -1:].expand(b, self.pad)], dim=1)
        sidc = sid.view(b, nc, cs)
        self.same = (sidc[:, :, :, None] == sidc[:, :, None, :]) & causal  # (batch, nc, t, s)
        before = torch.cat([sid.new_zeros(b, 1), sid[:, cs - 1:-1:cs]], dim=1)[:, :nc]  # id at c*cs - 1
        self.carry_in = (sidc == before[:, :, None]).float()[..., None, None]  # step t continues the entering state
        self.to_end = (sidc == sidc[:, :, -1:]).float()[..., None, None]  # step s reaches the chunk's end
        self.keep = self.carry_in[:, :, -1]  # (batch, nc, 1, 1): the entering state survives the chunk

    def chunked(self, t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 2) + (0, self.pad)) if self.pad else t

    def unchunked(self, t: torch.Tensor, *tail: int) -> torch.Tensor:
        return t.reshape(self.batch, self.nc * self.cs, *tail)[:, :self.seqlen]

    def masked(self, t: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor | None:
        return t if m is None else t * m

    def intra_decay(self) -> torch.Tensor:
        """``exp(cum_t - cum_s)`` where step s reaches step t, else 0: ``(batch, nc, t, s, G, R)``."""
        seg = self.cum[:, :, :, None] - self.cum[:, :, None, :]
        return torch.exp(seg.masked_fill(~self.same[..., None, None], -math.inf))

    def to_end_weight(self) -> torch.Tensor:
        """``exp(cum_last - cum_s) dt_s`` for the steps that reach the chunk's end: ``(batch, nc, s, G, R)``."""
        return self.masked(torch.exp(self.cum[:, :, -1:] - self.cum) * self.dt, self.to_end)

    def carry_weight(self) -> torch.Tensor:
        """``exp(cum_t)`` where step t continues the entering state: ``(batch, nc, t, G, R)``."""
        return self.masked(torch.exp(self.cum), self.carry_in)

    def chunk_decay(self) -> torch.Tensor:
        """What is left of the entering state at the chunk's end: ``(batch, nc, G, R)``."""
        return self.masked(torch.exp(self.cum[:, :, -1]), self.keep)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                initial_states: torch.Tensor | None, seq_idx: torch.Tensor | None, chunk_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The core scan by chunks, fp32: within a chunk the output is a masked ``(chunk, chunk)`` matrix
    product; between chunks only the ``(H, P, N)`` states pass. Returns (y ``(batch, L, H, P)``,
    final_states, chunk_states) as the module docstring defines them."""
    k = _Chunks(x, dt, A, B, C, seq_idx, chunk_size)
    # within chunks: y_t = sum_{s<=t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s
    cb = torch.einsum("bctgn,bcsgn->bctsg", k.C, k.B)
    w = cb[..., None] * k.intra_decay() * k.dt[:, :, None]  # (batch, nc, t, s, G, R)
    y = torch.einsum("bctsgr,bcsgrp->bctgrp", w, k.x)
    # each chunk's own contribution to the state at its end, then the states passed along
    own = torch.einsum("bcsgrp,bcsgn->bcgrpn", k.to_end_weight()[..., None] * k.x, k.B)
    decay = k.chunk_decay()
    shape = (k.batch, k.ngroups, k.rep, k.headdim, k.dstate)
    state = initial_states.float().view(shape) if initial_states is not None else x.new_zeros(shape, dtype=torch.float32)
    entering = []
    for c in range(k.nc):
        entering.append(state)
        state = decay[:, c, ..., None, None] * state + own[:, c]
    states_in = torch.stack(entering, dim=1)  # (batch, nc, G, R, P, N)
    # and what the entering state gives each step: exp(cum_t) C_t h_in
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", k.C, states_in) * k.carry_weight()[..., None]
    return (k.unchunked(y, k.nheads, k.headdim).contiguous(), state.reshape(k.batch, k.nheads, k.headdim, k.dstate),
            states_in.reshape(k.batch, k.nc, k.nheads, k.headdim, k.dstate))


def ssd_chunked_backward(dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states, chunk_size):
    """The analytic backward of :func:`ssd_chunked`, chunk by chunk from the saved ``chunk_states``:
    fp32 (dx, ddt, dA, dB, dC, dinitial_states or None)."""
    k = _Chunks(x, dt, A, B, C, seq_idx, chunk_size)
    b, nc, g, r, p, n = k.batch, k.nc, k.ngroups, k.rep, k.headdim, k.dstate
    dyc = k.chunked(dy.float()).view(b, nc, k.cs, g, r, p)
    states_in = chunk_states.float().view(b, nc, g, r, p, n)
    # within chunks: y_t = sum_s M_ts x_s, M_ts = (C_t . B_s) L_ts dt_s
    L = k.intra_decay()
    cb = torch.einsum("bctgn,bcsgn->bctsg", k.C, k.B)
    M = cb[..., None] * L * k.dt[:, :, None]
    dx = torch.einsum("bctsgr,bctgrp->bcsgrp", M, dyc)
    dM = torch.einsum("bctgrp,bcsgrp->bctsgr", dyc, k.x)
    dcb = (dM * L * k.dt[:, :, None]).sum(-1)
    dC = torch.einsum("bctsg,bcsgn->bctgn", dcb, k.B)
    dB = torch.einsum("bctsg,bctgn->bcsgn", dcb, k.C)
    ddt = (dM * cb[..., None] * L).sum(2)
    dML = dM * M  # d(cum_t - cum_s) of each term
    dcum = dML.sum(3) - dML.sum(2)
    del L, M, dM, dML
    # the entering state's part of the output: exp(cum_t) C_t h_in
    E = k.carry_weight()
    dyE = dyc * E[..., None]
    dC = dC + torch.einsum("bctgrp,bcgrpn->bctgn", dyE, states_in)
    dcum = dcum + (dyE * torch.einsum("bctgn,bcgrpn->bctgrp", k.C, states_in)).sum(-1)
    from_out = torch.einsum("bctgrp,bctgn->bcgrpn", dyE, k.C)  # d(h_in) through the outputs
    # state passing, reversed: d(h_in[c]) = from_out[c] + decay_c d(h_end[c])
    decay = k.chunk_decay()
    grad = (dfinal.float().view(b, g, r, p, n) if dfinal is not None
            else x.new_zeros(b, g, r, p, n, dtype=torch.float32))
    ends = [None] * nc
    ddecay = x.new_empty(b, nc, g, r, dtype=torch.float32)
    for c in range(nc - 1, -1, -1):
        ends[c] = grad
        ddecay[:, c] = (grad * states_in[:, c]).sum((-1, -2))
        grad = from_out[:, c] + decay[:, c, ..., None, None] * grad
    dend = torch.stack(ends, dim=1)  # (batch, nc, G, R, P, N)
    dcum[:, :, -1] += ddecay * decay
    # each chunk's own contribution to its end state: sum_s w_s x_s B_s^T
    w = k.to_end_weight()
    GB = torch.einsum("bcgrpn,bcsgn->bcsgrp", dend, k.B)
    dx = dx + w[..., None] * GB
    dB = dB + torch.einsum("bcsgrp,bcgrpn->bcsgn", w[..., None] * k.x, dend)
    dw = (k.x * GB).sum(-1)
    ddt = ddt + dw * k.masked(torch.exp(k.cum[:, :, -1:] - k.cum), k.to_end)
    dww = dw * w
    dcum[:, :, -1] += dww.sum(2)
    dcum = dcum - dww
    # cum = cumsum(dt * A) over each chunk's steps
    da = dcum.flip(2).cumsum(2).flip(2)
    ddt = ddt + da * k.A
    dA = (da * k.dt).sum((0, 1, 2)).reshape(k.nheads)
    dinit = grad.reshape(b, k.nheads, p, n) if initial_states is not None else None
    return (k.unchunked(dx, k.nheads, p), k.unchunked(ddt, k.nheads), dA, k.unchunked(dB, g, n),
            k.unchunked(dC, g, n), dinit)


class TorchSsdScan(TorchImplementation):
    op = OP
    fused_elementwise = False  # forward takes contiguous x, B, C and the steps; the op does the rest
    description = "PyTorch chunked SSD (matrix multiplies within chunks, state passing between); analytic backward"

    def forward(self, x, dt, A, B, C, initial_states, seq_idx, chunk_size):
        return ssd_chunked(x, dt, A, B, C, initial_states, seq_idx, chunk_size)

    def backward(self, dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states, chunk_size):
        return ssd_chunked_backward(dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states,
                                    chunk_size)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


class CppSsdScan(CppImplementation):
    """The core scan of the module docstring in ``csrc/cpu/ssd_scan.cpp``. ``x``, ``dt``, ``B``, ``C`` (any float
    dtype; the forward takes any strides) are read as fp32; the forward's ``dt`` is raw, the steps
    :func:`effective_dt` of it with ``dt_bias``, ``dt_softplus``, ``dt_limit``; ``D`` (``(H,)`` or ``(H, P)``,
    optional) adds the skip ``D * x`` to ``y``; every output is fp32: ``forward`` returns (y ``(batch, L, H, P)``, final_states
    ``(batch, H, P, N)``, chunk_states ``(batch, n_chunks, H, P, N)``), ``backward`` the gradients of (x, dt,
    A, B, C, initial_states) in their shapes, None for absent initial states."""

    op, extension = OP, "ssd_scan"
    # forward takes raw dt (bias, softplus, clamp as it reads it), x, dt, B, C through their strides, and adds D x
    fused_elementwise = True
    limits: dict[str, int] = {}  # any headdim, dstate and chunk_size: scratch is chunk-sized per thread
    description = ("C++: chunked SSD, chunk matrix products on ATen's BLAS in parallel over (batch, chunk, group, "
                   "head block), states passed between chunks; backward recomputes each chunk from its state")

    def forward(self, x, dt, A, B, C, initial_states, seq_idx, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                dt_limit=(0.0, math.inf)):
        return tuple(self.lib.ssd_scan_fwd(x.float(), dt.float(), _f32(A), B.float(), C.float(),
                                           None if D is None else _f32(D),
                                           None if dt_bias is None else _f32(dt_bias), dt_softplus,
                                           tuple(dt_limit) != (0.0, math.inf), dt_limit[0], dt_limit[1],
                                           None if initial_states is None else _f32(initial_states),
                                           seq_idx, chunk_size))

    def backward(self, dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states, chunk_size):
        dx, ddt, dA, dB, dC, dinit = self.lib.ssd_scan_bwd(
            _f32(dy), None if dfinal is None else _f32(dfinal), _f32(x), _f32(dt), _f32(A), _f32(B), _f32(C),
            None if initial_states is None else _f32(initial_states), seq_idx, _f32(chunk_states), chunk_size)
        return dx, ddt, dA, dB, dC, dinit if initial_states is not None else None


class TritonSsdScan(TritonImplementation):
    op, kernel_module = OP, "ssd_scan"
    fused_elementwise = False
    limits = {"headdim": 128, "dstate": 256}
    max_state_tile = 128 * 128  # the backward holds a whole (headdim, dstate) tile, padded to powers of two
    description = ("Triton chunked SSD: per-chunk cumsum, state terms and outputs as block matrix products, a "
                   "sequential pass over chunk states; backward by a reverse pass and per-chunk row/column kernels")

    def check(self, call: Call) -> list[str]:
        tile = math.prod(1 << max(int(call.get(k, 1)) - 1, 0).bit_length() for k in ("headdim", "dstate"))
        if tile > self.max_state_tile:
            return [f"state tile headdim x dstate (padded to powers of two) {tile} > {self.max_state_tile}"]
        return []

    def forward(self, x, dt, A, B, C, initial_states, seq_idx, chunk_size):
        return self.lib.ssd_scan_fwd(x, dt, A, B, C, initial_states, seq_idx, chunk_size)

    def backward(self, dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states, chunk_size):
        return self.lib.ssd_scan_bwd(dy, dfinal, x, dt, A, B, C, initial_states, seq_idx, chunk_states,
                                     chunk_size)


for _impl in (TorchSsdScan, CppSsdScan, TritonSsdScan):
    register(_impl)


# -- mamba-ssm's chunk-level pieces (ssd_chunk_state, ssd_state_passing, ssd_chunk_scan, ssd_combined) ------
# The chunked SSD algorithm step by step, as mamba-ssm exposes it, in composed fp32 PyTorch (differentiable by
# autograd); :func:`ssd_scan` is the fused op. Per chunk ``c`` of ``chunk_size`` steps, with ``dt`` the
# processed steps ``(batch, H, n_chunks, chunk_size)`` and ``dA_cumsum`` the in-chunk running sum of ``dt * A``:
#   chunk_state:   S_c = sum_l exp(dA_cumsum[c, -1] - dA_cumsum[c, l]) dt[c, l] x_l B_l^T   (states leaving c,
#                  from a zero state)
#   state_passing: H_0 = initial_states (or 0); H_{c+1} = exp(dA_cumsum[c, -1]) H_c + S_c  (states entering c)
#   chunk_scan:    y_l = C_l (exp(dA_cumsum[l]) H_c) + sum_{s <= l} (C_l . B_s) exp(dA_cumsum[l] - dA_cumsum[s])
#                  dt[s] x_s + D x_l, times silu(z_l)
def _fail_shape(op: str, name: str, want: str, t: torch.Tensor) -> None:
    fail(op, f"argument '{name}' must have shape {want}, got {tuple(t.shape)}")


def _check_chunk_args(op: str, B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
                      dA_cumsum: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    check_tensor(op, "x", x, ndim=4)
    batch, L, H, P = x.shape
    check_tensor(op, "dt", dt, ndim=4)
    if dt.shape[:2] != (batch, H):
        _fail_shape(op, "dt", f"({batch}, {H}, n_chunks, chunk_size)", dt)
    nc, cs = dt.shape[2:]
    if L > nc * cs:
        fail(op, f"argument 'dt' must cover the {L} steps of x, got {nc} chunks of {cs}")
    check_tensor(op, "dA_cumsum", dA_cumsum, shape=tuple(dt.shape))
    check_tensor(op, "B", B, ndim=4)
    G = B.shape[2]
    if B.shape[:2] != (batch, L) or G < 1 or H % G:
        _fail_shape(op, "B", f"({batch}, {L}, G, N) with G dividing {H}", B)
    check_same_device(op, "x", x, dt=dt, dA_cumsum=dA_cumsum, B=B)
    return batch, L, H, P, nc, cs


def _in_chunks(t: torch.Tensor, nc: int, cs: int) -> torch.Tensor:
    """``(batch, L, ...)`` -> ``(batch, nc, cs, ...)`` fp32, zero-padded to ``nc * cs`` steps."""
    pad = nc * cs - t.shape[1]
    t = t.float()
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.unflatten(1, (nc, cs))


def _per_head(t: torch.Tensor, H: int) -> torch.Tensor:
    """``(batch, L, G, N)`` -> ``(batch, L, H, N)``: head ``h`` reads group ``h // (H // G)``."""
    return t.repeat_interleave(H // t.shape[2], dim=2)


def chunk_state(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
                states_in_fp32: bool = True) -> torch.Tensor:
    """mamba-ssm's ``chunk_state``: the state each chunk leaves from a zero state (see above).

    Shapes: B ``(batch, L, G, N)``; x ``(batch, L, H, P)``; dt, dA_cumsum ``(batch, H, n_chunks, chunk_size)``;
    returns ``(batch, n_chunks, H, P, N)`` in fp32 (``x.dtype`` when not ``states_in_fp32``).
    """
    _, _, H, _, nc, cs = _check_chunk_args("chunk_state", B, x, dt, dA_cumsum)
    weight = torch.exp(dA_cumsum[..., -1:].float() - dA_cumsum.float()) * dt.float()  # (b, H, nc, cs)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", _in_chunks(_per_head(B, H), nc, cs), weight,
                          _in_chunks(x, nc, cs))
    return states if states_in_fp32 else states.to(x.dtype)


def chunk_state_ref(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`chunk_state`, step by step in fp32; the result in ``x.dtype`` (as mamba-ssm's)."""
    batch, L, H, P, nc, cs = _check_chunk_args("chunk_state_ref", B, x, dt, dA_cumsum)
    Bh = _per_head(B, H).float()
    states = x.new_zeros(batch, nc, H, P, B.shape[-1], dtype=torch.float32)
    for t in range(L):
        c, i = divmod(t, cs)
        w = torch.exp(dA_cumsum[:, :, c, -1].float() - dA_cumsum[:, :, c, i].float()) * dt[:, :, c, i].float()
        states[:, c] += w[..., None, None] * x[:, t].float()[..., None] * Bh[:, t, :, None, :]
    return states.to(x.dtype)


def chunk_state_varlen(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
                       cu_seqlens: torch.Tensor, chunk_states: torch.Tensor) -> torch.Tensor:
    """mamba-ssm's ``chunk_state_varlen``: the final state of each packed sequence, from the states entering
    every chunk (``chunk_states``, state passing already done with the sequences' restarts) and the steps of
    the sequence inside its last chunk.

    Shapes: B ``(total, G, N)``; x ``(total, H, P)``; dt, dA_cumsum ``(H, n_chunks, chunk_size)``;
    cu_seqlens ``(num_seqs + 1,)``; chunk_states ``(n_chunks, H, P, N)``; returns ``(num_seqs, H, P, N)`` fp32.
    """
    op = "chunk_state_varlen"
    check_tensor(op, "x", x, ndim=3)
    total, H, P = x.shape
    check_tensor(op, "B", B, ndim=3)
    check_tensor(op, "dt", dt, ndim=3)
    check_tensor(op, "dA_cumsum", dA_cumsum, shape=tuple(dt.shape))
    nc, cs = dt.shape[1:]
    check_tensor(op, "chunk_states", chunk_states, shape=(nc, H, P, B.shape[-1]))
    check_tensor(op, "cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
    if B.shape[0] != total or dt.shape[0] != H or total > nc * cs:
        fail(op, f"arguments 'B' ({tuple(B.shape)}) and 'dt' ({tuple(dt.shape)}) must match x {tuple(x.shape)}")
    cu = cu_seqlens.long()
    if cu.numel() < 1 or int(cu[0]) < 0 or int(cu[-1]) > total or bool((cu[1:] <= cu[:-1]).any()):
        fail(op, f"argument 'cu_seqlens' must be increasing offsets in [0, {total}] (no empty sequence)")
    Bh = _per_head(B[None], H)[0].float()  # (total, H, N)
    dA = dA_cumsum.float().flatten(1)  # (H, nc * cs)
    out = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        c = (end - 1) // cs
        first = max(start, c * cs)
        last = dA[:, end - 1]  # (H,)
        w = torch.exp(last[:, None] - dA[:, first:end]) * dt.float().flatten(1)[:, first:end]  # (H, steps)
        state = torch.einsum("hl,lhp,lhn->hpn", w, x[first:end].float(), Bh[first:end])
        if start < c * cs:  # the sequence entered this chunk with a state
            state = state + torch.exp(last)[:, None, None] * chunk_states[c].float()
        out.append(state)
    return torch.stack(out) if out else x.new_zeros(0, H, P, B.shape[-1], dtype=torch.float32)


def _check_passing(op: str, states: torch.Tensor, dA_chunk_cumsum: torch.Tensor,
                   initial_states: torch.Tensor | None) -> None:
    check_tensor(op, "states", states, ndim=4)
    batch, nc, H, dim = states.shape
    check_tensor(op, "dA_chunk_cumsum", dA_chunk_cumsum, shape=(batch, H, nc))
    if initial_states is not None:
        check_tensor(op, "initial_states", initial_states, shape=(batch, H, dim))
    check_same_device(op, "states", states, dA_chunk_cumsum=dA_chunk_cumsum, initial_states=initial_states)


def state_passing(states: torch.Tensor, dA_chunk_cumsum: torch.Tensor, initial_states: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba-ssm's ``state_passing``: ``H_0 = initial_states`` (or 0), ``H_{c+1} = exp(dA_chunk_cumsum[c]) H_c +
    states[c]``; returns ``(H_0 .. H_{n-1}, H_n)``, the states entering each chunk and the final state.

    Shapes: states ``(batch, n_chunks, H, dim)`` (a chunk's state flattened to ``dim``); dA_chunk_cumsum
    ``(batch, H, n_chunks)``; initial_states ``(batch, H, dim)``; returns ``(batch, n_chunks, H, dim)`` and
    ``(batch, H, dim)``, in ``states.dtype``.
    """
    _check_passing("state_passing", states, dA_chunk_cumsum, initial_states)
    h = (states.new_zeros(states[:, 0].shape, dtype=torch.float32) if initial_states is None
         else initial_states.float())
    entering = []
    for c in range(states.shape[1]):
        entering.append(h)
        h = torch.exp(dA_chunk_cumsum[:, :, c].float())[..., None] * h + states[:, c].float()
    out = torch.stack(entering, dim=1) if entering else states.float()
    return out.to(states.dtype), h.to(states.dtype)


def state_passing_ref(states: torch.Tensor, dA_chunk_cumsum: torch.Tensor,
                      initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`state_passing` as one matrix of chunk-to-chunk decays (fp32)."""
    _check_passing("state_passing_ref", states, dA_chunk_cumsum, initial_states)
    init = states.new_zeros(states[:, 0].shape) if initial_states is None else initial_states
    seq = torch.cat([init[:, None], states], dim=1).float()  # (b, nc + 1, H, dim)
    cum = torch.cumsum(F.pad(dA_chunk_cumsum.float(), (1, 0)), dim=-1)  # (b, H, nc + 1)
    n = cum.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=states.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, -math.inf))
    out = torch.einsum("bhzc,bchd->bzhd", decay, seq).to(states.dtype)
    return out[:, :-1], out[:, -1]


def _skip_gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def _check_scan_args(op, B, C, x, dt, dA_cumsum, prev_states, D, z):
    batch, L, H, P, nc, cs = _check_chunk_args(op, B, x, dt, dA_cumsum)
    check_tensor(op, "C", C, shape=tuple(B.shape))
    check_tensor(op, "prev_states", prev_states, shape=(batch, nc, H, P, B.shape[-1]))
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        _fail_shape(op, "D", f"({H},) or ({H}, {P})", D)
    if z is not None:
        check_tensor(op, "z", z, shape=tuple(x.shape))
    check_same_device(op, "x", x, C=C, prev_states=prev_states, D=D, z=z)
    return batch, L, H, P, nc, cs


def chunk_scan(B: torch.Tensor, C: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
               prev_states: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None
               ) -> torch.Tensor:
    """mamba-ssm's ``chunk_scan``: the outputs from the states entering each chunk (``prev_states``) and the
    chunk's own steps, plus ``D * x``, times ``silu(z)`` (see above).

    Shapes: B, C ``(batch, L, G, N)``; x, z, out ``(batch, L, H, P)``; dt, dA_cumsum ``(batch, H, n_chunks,
    chunk_size)``; prev_states ``(batch, n_chunks, H, P, N)``; D ``(H,)`` or ``(H, P)``. Out in ``x.dtype``.
    """
    _, L, H, _, nc, cs = _check_scan_args("chunk_scan", B, C, x, dt, dA_cumsum, prev_states, D, z)
    Bc, Cc = _in_chunks(_per_head(B, H), nc, cs), _in_chunks(_per_head(C, H), nc, cs)  # (b, nc, cs, H, N)
    dA = dA_cumsum.float()
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((dA[..., :, None] - dA[..., None, :]).masked_fill(~causal, -math.inf))  # (b, H, nc, l, s)
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * decay * dt.float()[..., None, :]
    y = torch.einsum("bhcls,bcshp->bclhp", scores, _in_chunks(x, nc, cs))
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, prev_states.float(), torch.exp(dA))
    return _skip_gate(y.flatten(1, 2)[:, :L], x, D, z)


def chunk_scan_ref(B: torch.Tensor, C: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor,
                   prev_states: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Reference of :func:`chunk_scan`: the recurrence step by step from each chunk's entering state (fp32)."""
    _, L, H, _, _, cs = _check_scan_args("chunk_scan_ref", B, C, x, dt, dA_cumsum, prev_states, D, z)
    Bh, Ch = _per_head(B, H).float(), _per_head(C, H).float()
    ys, h = [], None
    for t in range(L):
        c, i = divmod(t, cs)
        step = dA_cumsum[:, :, c, i].float() - (dA_cumsum[:, :, c, i - 1].float() if i else 0.0)
        prev = prev_states[:, c].float() if i == 0 else h
        h = torch.exp(step)[..., None, None] * prev + (dt[:, :, c, i].float()[..., None, None]
                                                      * x[:, t].float()[..., None] * Bh[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.float()
    return _skip_gate(y, x, D, z)


def _chunk_steps(dt: torch.Tensor, A: torch.Tensor, chunk_size: int, dt_bias: torch.Tensor | None,
                 dt_softplus: bool, dt_limit: tuple[float, float] = (0.0, math.inf)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dt`` ``(batch, L, H)`` -> the processed steps and the in-chunk running sums of ``dt * A``, both
    ``(batch, H, n_chunks, chunk_size)`` fp32 (steps past L are 0)."""
    steps = effective_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    nc = n_chunks(dt.shape[1], chunk_size)
    steps = _in_chunks(steps, nc, chunk_size).permute(0, 3, 1, 2)  # (b, H, nc, cs)
    return steps, torch.cumsum(steps * A.float()[:, None, None], dim=-1)


def mamba_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     chunk_size: int, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, dt_softplus: bool = False) -> torch.Tensor:
    """mamba-ssm's ``mamba_chunk_scan``: the SSD scan as its separate pieces (:func:`chunk_state`,
    :func:`state_passing`, :func:`chunk_scan`) rather than the fused :func:`ssd_scan`; same arguments and
    output (shapes in the module docstring)."""
    _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, None, None, None, (0.0, math.inf), False)
    steps, dA_cumsum = _chunk_steps(dt, A, chunk_size, dt_bias, dt_softplus)
    states = chunk_state(B, x, steps, dA_cumsum)
    entering, _ = state_passing(states.flatten(-2), dA_cumsum[..., -1])
    return chunk_scan(B, C, x, steps, dA_cumsum, entering.unflatten(-1, states.shape[-2:]), D, z)


def ssd_chunk_scan_combined_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None,
                                z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                dt_softplus: bool = False) -> torch.Tensor:
    """mamba-ssm's ``ssd_chunk_scan_combined_ref``: the output of :func:`mamba_chunk_scan_combined` from the
    sequential oracle :func:`ssd_scan_ref`."""
    return ssd_scan_ref(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus=dt_softplus)


def ssd_selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """mamba-ssm's ``ssd_selective_scan``: the SSD recurrence as Mamba-1's selective scan
    (:func:`fastarch.ops.selective_scan`) over the ``H * P`` channels, each head's step and ``A`` repeated over
    its ``P`` channels; same arguments and output as :func:`mamba_chunk_scan` (no chunk size)."""
    _validate(x, dt, A, B, C, 1, D, z, dt_bias, None, None, None, dt_limit, False)
    batch, L, H, P = x.shape
    if tuple(dt_limit) != (0.0, math.inf):  # the clamp is not the scan's: form the steps here
        dt, dt_bias, dt_softplus = effective_dt(dt, dt_bias, dt_softplus, dt_limit).to(x.dtype), None, False
    u = x.permute(0, 2, 3, 1).reshape(batch, H * P, L)
    delta = dt.permute(0, 2, 1).repeat_interleave(P, dim=1)  # (b, H * P, L)
    A_ = A.float().repeat_interleave(P)[:, None].expand(H * P, B.shape[-1])
    Bs, Cs = B.permute(0, 2, 3, 1), C.permute(0, 2, 3, 1)  # (b, G, N, L)
    D_ = None if D is None else (D.repeat_interleave(P) if D.dim() == 1 else D.reshape(-1)).float()
    z_ = None if z is None else z.permute(0, 2, 3, 1).reshape(batch, H * P, L)
    bias = None if dt_bias is None else dt_bias.float().repeat_interleave(P)
    out = selective_scan(u, delta, A_, Bs, Cs, D_, z_, bias, dt_softplus)
    return out.reshape(batch, H, P, L).permute(0, 3, 1, 2)
