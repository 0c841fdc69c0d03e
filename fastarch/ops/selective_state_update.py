"""One decode step of the selective scan, compatible with mamba-ssm's ``selective_state_update``.

``selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
state_batch_indices=None)`` accepts every form mamba-ssm does; each argument may independently take the
no-heads form, which counts as one head:

- ``state`` ``(batch, dim, N)`` or ``(batch, nheads, dim, N)``, updated in place (fp32 recommended);
- ``x``, ``dt``, ``z`` ``(batch, dim)`` or ``(batch, nheads, dim)``;
- ``A`` ``(dim, N)`` or ``(nheads, dim, N)``; ``D``, ``dt_bias`` ``(dim,)`` or ``(nheads, dim)``; any of
  them may be a stride-0 expansion (Mamba-2 passes ``A[:, None, None].expand(nheads, dim, N)``);
- ``B``, ``C`` ``(batch, N)`` or ``(batch, ngroups, N)`` with ``ngroups`` dividing ``nheads``;
- ``state_batch_indices`` ``(batch,)`` integer: row ``b`` updates ``state[state_batch_indices[b]]`` (then
  ``state`` may have more rows than ``x``); a negative index marks a padding row, whose output is 0 and
  which touches no state. Non-negative indices must be distinct and in range.

``state = state * exp(dt * A) + dt * B * x``; ``out = <state, C> + D * x``, times ``silu(z)``; returns
``out`` in ``x.dtype`` with ``x``'s shape (no heads axis when ``state`` is 3-D). Every argument is
validated before ``state`` is written. Inference only (not differentiable), like mamba-ssm's.

Backends: ``torch`` (composed PyTorch in fp32, as the reference), ``cpp`` (parallel over batch x heads x
channels, each row's N-long update one vectorised loop with a polynomial exp; in the selective_scan
extension) and ``triton`` (a program per (batch, head, channel block), the state tile in registers). The
compiled backends update an fp32 contiguous ``state`` directly; any other state is updated through an fp32
copy that is written back (after validation, so a rejected call never touches it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..backend import Call, register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, check_writable, fail
from ._dispatch import call_of, dispatch, run

__all__ = ["selective_state_update", "selective_state_update_ref"]

OP = "selective_state_update"


def _to_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Bring each argument given in the no-heads form to the heads form (one head), as mamba-ssm does."""
    def add(t, ndim, axis):
        return t.unsqueeze(axis) if t is not None and t.dim() == ndim else t

    return (add(state, 3, 1), add(x, 2, 1), add(dt, 2, 1), add(A, 2, 0), add(B, 2, 1), add(C, 2, 1),
            add(D, 1, 0), add(z, 2, 1), add(dt_bias, 1, 0))


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               state_batch_indices=None):
    """The oracle (fp32 arithmetic); writes the new state into ``state`` and returns ``out``."""
    has_heads = state.dim() == 4
    st, x4, dt4, A4, B4, C4, D4, z4, db4 = _to_heads(state, x, dt, A, B, C, D, z, dt_bias)
    nheads = st.shape[1]
    batch = x4.shape[0]
    if state_batch_indices is None:
        rows = torch.arange(batch, device=x.device)
    else:
        rows = state_batch_indices.long()
    live = rows >= 0
    rows = rows[live]
    dtf = dt4.float()
    if db4 is not None:
        dtf = dtf + db4.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    Bh = B4.float().repeat_interleave(nheads // B4.shape[1], dim=1)  # (batch, nheads, N)
    Ch = C4.float().repeat_interleave(nheads // C4.shape[1], dim=1)
    dA = torch.exp(dtf[..., None] * A4.float())
    new = st[rows].float() * dA[live] + (dtf * x4.float())[live][..., None] * Bh[live][:, :, None, :]
    st[rows] = new.to(st.dtype)
    out = torch.zeros(x4.shape, dtype=torch.float32, device=x.device)
    out[live] = (new * Ch[live][:, :, None, :]).sum(-1)
    if D4 is not None:
        out[live] += (x4.float() * D4.float())[live]
    if z4 is not None:
        out = out * F.silu(z4.float())
    out = out.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def _validate(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices) -> None:
    check_tensor(OP, "state", state, ndim=(3, 4))
    check_tensor(OP, "x", x, ndim=(2, 3))
    for name, t, nd in (("dt", dt, (2, 3)), ("A", A, (2, 3)), ("B", B, (2, 3)), ("C", C, (2, 3)),
                        ("D", D, (1, 2)), ("z", z, (2, 3)), ("dt_bias", dt_bias, (1, 2))):
        if t is not None:
            if name == "A" and isinstance(t, torch.Tensor) and t.is_complex():
                fail(OP, "argument 'A' is complex; only real A is supported", NotImplementedError)
            check_tensor(OP, name, t, ndim=nd)
    st, x4, dt4, A4, B4, C4, D4, z4, db4 = _to_heads(state, x, dt, A, B, C, D, z, dt_bias)
    _, nheads, dim, n = st.shape
    batch = x4.shape[0]
    hd = (nheads, dim)
    check_tensor(OP, "x", x4, shape=(batch, *hd))
    check_tensor(OP, "dt", dt4, shape=(batch, *hd))
    check_tensor(OP, "A", A4, shape=(*hd, n))
    for name, t in (("B", B4), ("C", C4)):
        check_tensor(OP, name, t, shape=(batch, None, n))
        if t.shape[1] < 1 or nheads % t.shape[1] != 0:
            fail(OP, f"argument '{name}' has {t.shape[1]} groups but nheads={nheads} must be a multiple of it")
    if D4 is not None:
        check_tensor(OP, "D", D4, shape=hd)
    if db4 is not None:
        check_tensor(OP, "dt_bias", db4, shape=hd)
    if z4 is not None:
        check_tensor(OP, "z", z4, shape=(batch, *hd))
    if state_batch_indices is None:
        if st.shape[0] != batch:
            fail(OP, f"argument 'state' must have {batch} rows (one per row of x) when state_batch_indices is "
                     f"None, got shape {tuple(state.shape)}")
    else:
        check_tensor(OP, "state_batch_indices", state_batch_indices, dtypes=(torch.int32, torch.int64),
                     shape=(batch,))
        live = state_batch_indices[state_batch_indices >= 0]
        if live.numel() and int(live.max()) >= st.shape[0]:
            fail(OP, f"argument 'state_batch_indices' must be < {st.shape[0]} (the rows of state), got "
                     f"{int(live.max())}", IndexError)
        if live.unique().numel() != live.numel():
            fail(OP, "argument 'state_batch_indices' must not repeat a row (two rows would write one state)")
    check_same_device(OP, "state", state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      state_batch_indices=state_batch_indices)
    check_writable(OP, "state", state)


def _call(x: torch.Tensor, state: torch.Tensor, state_batch_indices: torch.Tensor | None) -> Call:
    return call_of(x, dstate=state.shape[-1], has_state_batch_indices=state_batch_indices is not None)


@torch.library.custom_op("fastarch::selective_state_update", mutates_args=("state",))
def _ssu(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
         dt_softplus: bool, state_batch_indices: torch.Tensor | None, backend: str) -> torch.Tensor:
    return run(OP, "forward", _call(x, state, state_batch_indices), backend, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
               state_batch_indices)


@_ssu.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, backend):
    heads_shape = x.shape if x.dim() == 3 else (x.shape[0], 1, x.shape[1])
    return x.new_empty(heads_shape if state.dim() == 4 else (heads_shape[0], heads_shape[2]))


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = False, state_batch_indices: torch.Tensor | None = None, *,
                           backend: str | None = None) -> torch.Tensor:
    """One decode step of the selective scan (mamba-ssm's ``selective_state_update``).

    Args:
        state: the SSM state; updated in place (fp32 recommended).
        x: the step's input.
        dt: the step's time steps (before ``dt_bias`` and softplus).
        A: the real state matrix.
        B: input weights, shared by the heads of a group.
        C: output weights, shared by the heads of a group.
        D: optional skip weight.
        z: optional gate: the output is multiplied by ``silu(z)``.
        dt_bias: optional bias added to ``dt``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        state_batch_indices: optional ``(batch,)`` integers: row ``b`` updates ``state[state_batch_indices[b]]``;
            a negative index marks a padding row (output 0, no state touched).
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The step's output in ``x.dtype`` and ``x``'s shape (not differentiable).

    Shapes:
        without heads: state ``(B, dim, N)``; x, dt, z, out ``(B, dim)``; A ``(dim, N)``; B, C ``(B, N)``;
        D, dt_bias ``(dim,)``. With heads: state ``(B, H, dim, N)``; x, dt, z, out ``(B, H, dim)``;
        A ``(H, dim, N)``; B, C ``(B, G, N)`` with ``G`` dividing ``H``; D, dt_bias ``(H, dim)``.
    """
    _validate(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    idx = None if state_batch_indices is None else state_batch_indices.to(torch.int64).contiguous()
    with torch.no_grad():
        impl, name = dispatch(OP, lambda: _call(x, state, idx), backend, state, x)
        if impl is not None:
            return impl.forward(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), idx)
        return _ssu(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), idx, name)


class TorchSelectiveStateUpdate(TorchImplementation):
    op = OP
    description = "composed PyTorch, fp32 arithmetic"

    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def _heads_args(state, x, dt, A, B, C, D, z, dt_bias):
    """The heads form with fp32 contiguous tensors for the compiled kernels; ``state`` is returned as the
    tensor to update (itself when already fp32 contiguous, else an fp32 copy to be written back)."""
    st, x4, dt4, A4, B4, C4, D4, z4, db4 = _to_heads(state, x, dt, A, B, C, D, z, dt_bias)
    work = st if (st.dtype == torch.float32 and st.is_contiguous()) else st.float().contiguous()

    def c(t):
        return None if t is None else t.float().contiguous()

    return st, work, (c(x4), c(dt4), c(A4), c(B4), c(C4), c(D4), c(z4), c(db4))


class _CompiledStateUpdate:
    """Shared glue: heads form, fp32 working state written back when the caller's state is not fp32
    contiguous; the C++ extension and the Triton module expose ``selective_state_update_fwd(work, *fp32 args,
    softplus, state_batch_indices)`` alike, returning out (batch, nheads, dim) fp32. Stride-0 expanded
    arguments are materialised (a few KB: A, D and dt_bias are per head x channel)."""

    lib: Any

    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices):
        st, work, args = _heads_args(state, x, dt, A, B, C, D, z, dt_bias)
        out = self.lib.selective_state_update_fwd(work, *args, bool(dt_softplus), state_batch_indices)
        if work is not st:
            st.copy_(work)
        out = out.to(x.dtype)
        return out if state.dim() == 4 else out.squeeze(1)


class CppSelectiveStateUpdate(CppImplementation, _CompiledStateUpdate):
    op, extension = OP, "selective_scan"
    description = "C++: parallel over batch x heads x channels, vectorised over N (polynomial exp), in place"


class TritonSelectiveStateUpdate(TritonImplementation, _CompiledStateUpdate):
    op, kernel_module = OP, "selective_scan"
    description = "Triton: a program per (batch, head, channel block), state tile in registers, in place"


for _impl in (TorchSelectiveStateUpdate, CppSelectiveStateUpdate, TritonSelectiveStateUpdate):
    register(_impl)
