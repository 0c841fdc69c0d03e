"""One decode step of the selective scan, compatible with mamba-ssm's ``selective_state_update``.

``selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False)``:

- ``state`` ``(batch, dim, N)`` or ``(batch, nheads, dim, N)``, updated in place (fp32 recommended);
- ``x``, ``dt``, ``z`` ``(batch, dim)`` or ``(batch, nheads, dim)``;
- ``A`` ``(dim, N)`` or ``(nheads, dim, N)``; ``D``, ``dt_bias`` ``(dim,)`` or ``(nheads, dim)``;
- ``B``, ``C`` ``(batch, N)`` or ``(batch, ngroups, N)`` with ``ngroups`` dividing ``nheads``.

``state = state * exp(dt * A) + dt * B * x``; ``out = <state, C> + D * x``, times ``silu(z)``; returns
``out`` in ``x.dtype`` with ``x``'s shape. Every argument is validated before ``state`` is written.
Inference only (not differentiable), like mamba-ssm's.

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

from ..backend import register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, resolve, run

__all__ = ["selective_state_update", "selective_state_update_ref"]

OP = "selective_state_update"


def _to_heads(state, x, dt, A, B, C, D, z, dt_bias):
    """Bring the no-heads form (state 3-D) to the heads form with nheads = 1."""
    if state.dim() == 4:
        return state, x, dt, A, B, C, D, z, dt_bias
    u1 = (lambda t: None if t is None else t.unsqueeze(1))
    u0 = (lambda t: None if t is None else t.unsqueeze(0))
    return (state.unsqueeze(1), u1(x), u1(dt), u0(A), u1(B), u1(C), u0(D), u1(z), u0(dt_bias))


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """The oracle (fp32 arithmetic); writes the new state into ``state`` and returns ``out``."""
    has_heads = state.dim() == 4
    st, x4, dt4, A4, B4, C4, D4, z4, db4 = _to_heads(state, x, dt, A, B, C, D, z, dt_bias)
    nheads = st.shape[1]
    dtf = dt4.float()
    if db4 is not None:
        dtf = dtf + db4.float()
    if dt_softplus:
        dtf = F.softplus(dtf)
    rep = nheads // B4.shape[1]
    Bh = B4.float().repeat_interleave(rep, dim=1)  # (batch, nheads, N)
    Ch = C4.float().repeat_interleave(nheads // C4.shape[1], dim=1)
    dA = torch.exp(dtf[..., None] * A4.float())
    new = st.float() * dA + (dtf * x4.float())[..., None] * Bh[:, :, None, :]
    st.copy_(new.to(st.dtype))
    out = (new * Ch[:, :, None, :]).sum(-1)
    if D4 is not None:
        out = out + x4.float() * D4.float()
    if z4 is not None:
        out = out * F.silu(z4.float())
    out = out.to(x.dtype)
    return out if has_heads else out.squeeze(1)


def _validate(state, x, dt, A, B, C, D, z, dt_bias) -> None:
    check_tensor(OP, "state", state, ndim=(3, 4))
    heads = state.dim() == 4
    batch = state.shape[0]
    hd = tuple(state.shape[1:-1])  # (dim,) or (nheads, dim)
    n = state.shape[-1]
    check_tensor(OP, "x", x, shape=(batch, *hd))
    check_tensor(OP, "dt", dt, shape=(batch, *hd))
    if isinstance(A, torch.Tensor) and A.is_complex():
        fail(OP, "argument 'A' is complex; only real A is supported", NotImplementedError)
    check_tensor(OP, "A", A, shape=(*hd, n))
    for name, t in (("B", B), ("C", C)):
        check_tensor(OP, name, t, ndim=3 if heads else 2)
        if heads:
            check_tensor(OP, name, t, shape=(batch, None, n))
            if t.shape[1] < 1 or hd[0] % t.shape[1] != 0:
                fail(OP, f"argument '{name}' has {t.shape[1]} groups but nheads={hd[0]} must be a multiple of it")
        else:
            check_tensor(OP, name, t, shape=(batch, n))
    if D is not None:
        check_tensor(OP, "D", D, shape=hd)
    if dt_bias is not None:
        check_tensor(OP, "dt_bias", dt_bias, shape=hd)
    if z is not None:
        check_tensor(OP, "z", z, shape=(batch, *hd))
    check_same_device(OP, "state", state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


@torch.library.custom_op("fastarch::selective_state_update", mutates_args=("state",))
def _ssu(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
         dt_softplus: bool, backend: str) -> torch.Tensor:
    call = call_of(x, dstate=state.shape[-1])
    return run(OP, "forward", call, backend, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


@_ssu.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, backend):
    return torch.empty_like(x)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = False, *, backend: str | None = None) -> torch.Tensor:
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
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The step's output in ``x.dtype`` and ``x``'s shape (not differentiable).

    Shapes:
        without heads: state ``(B, dim, N)``; x, dt, z, out ``(B, dim)``; A ``(dim, N)``; B, C ``(B, N)``;
        D, dt_bias ``(dim,)``. With heads: state ``(B, H, dim, N)``; x, dt, z, out ``(B, H, dim)``;
        A ``(H, dim, N)``; B, C ``(B, G, N)`` with ``G`` dividing ``H``; D, dt_bias ``(H, dim)``.
    """
    _validate(state, x, dt, A, B, C, D, z, dt_bias)
    with torch.no_grad():
        name = resolve(OP, lambda: call_of(x, dstate=state.shape[-1]), backend)
        return _ssu(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), name)


class TorchSelectiveStateUpdate(TorchImplementation):
    op = OP
    description = "composed PyTorch, fp32 arithmetic"

    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)


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
    contiguous; ``_kernel(work, *fp32 args, softplus)`` returns out (batch, nheads, dim) fp32."""

    lib: Any

    def forward(self, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        st, work, args = _heads_args(state, x, dt, A, B, C, D, z, dt_bias)
        out = self._kernel(work, *args, bool(dt_softplus))
        if work is not st:
            st.copy_(work)
        out = out.to(x.dtype)
        return out if state.dim() == 4 else out.squeeze(1)


class CppSelectiveStateUpdate(CppImplementation, _CompiledStateUpdate):
    op, extension = OP, "selective_scan"
    description = "C++: parallel over batch x heads x channels, vectorised over N (polynomial exp), in place"

    def _kernel(self, work, x, dt, A, B, C, D, z, dt_bias, softplus):
        return self.lib.state_update(work, x, dt, A, B, C, D, z, dt_bias, softplus)


class TritonSelectiveStateUpdate(TritonImplementation, _CompiledStateUpdate):
    op, kernel_module = OP, "selective_scan"
    description = "Triton: a program per (batch, head, channel block), state tile in registers, in place"

    def _kernel(self, work, x, dt, A, B, C, D, z, dt_bias, softplus):
        return self.lib.selective_state_update_fwd(work, x, dt, A, B, C, D, z, dt_bias, softplus)


for _impl in (TorchSelectiveStateUpdate, CppSelectiveStateUpdate, TritonSelectiveStateUpdate):
    register(_impl)
