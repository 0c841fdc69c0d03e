"""Mamba's selective scan, compatible with mamba-ssm's ``selective_scan_fn``.

For every batch ``b`` and channel ``d`` a state ``h`` of size N runs over time::

    dt_t = softplus(delta_t + delta_bias)        (softplus only when delta_softplus)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t
    y_t  = <C_t, h_t> + D * u_t
    out  = y * silu(z)                            (when z is given)

Shapes (as in mamba-ssm): ``u``, ``delta``, ``z`` are ``(B, D, L)``; ``A`` is ``(D, N)``, real; ``B`` and
``C`` are each ``(D, N)`` (constant over time), ``(B, N, L)`` (variable) or ``(B, G, N, L)`` (grouped: channel
``d`` reads group ``d // (D // G)``); ``D`` and ``delta_bias`` are ``(D,)``. ``return_last_state`` adds the
final state ``(B, D, N)`` (fp32) to the result.

Backends: ``torch`` (a step loop in fp32; the backward a reverse step loop), ``cpp`` (vectorised
C++ over blocks of channels, backward recomputing states chunk by chunk from checkpoints), ``triton`` and
``cuda`` (chunked scans with states stored only at chunk boundaries).

Every backend's forward returns ``(out, last_state, ckpt)``: ``ckpt`` is ``(B, D, n_chunks, N)`` fp32, the
state entering each chunk of ``CHUNK`` steps (empty when no gradient is needed). That is all the backward
keeps besides the inputs: memory linear in B*D*L, never B*D*L*N.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..backend import Call, register
from ._backends import CppImplementation, CudaImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, in_layout_of, resolve, run, run_backward

__all__ = ["selective_scan", "selective_scan_fn", "selective_scan_ref"]

OP = "selective_scan"
CHUNK = 64  # time steps between stored states (shared by every backend, so checkpoints are interchangeable)
MAX_STATE = 256  # largest N the compiled kernels take


# -- the oracle -------------------------------------------------------------------------------------------
def _expand_groups(M: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, G, N, L) -> (B, D, N, L): channel d uses group d // (D // G)."""
    return M.repeat_interleave(dim // M.shape[1], dim=1)


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle with mamba-ssm's ``selective_scan_ref`` semantics, fp32 throughout.

    It materialises ``exp(delta * A)`` and ``delta * B * u`` as ``(B, D, L, N)`` tensors and loops over L:
    simple and obviously right, but slow and memory-hungry. Returns ``out`` (``u.dtype``) or
    ``(out, last_state)`` with ``last_state`` ``(B, D, N)`` fp32.
    """
    if A.is_complex():
        raise NotImplementedError("selective_scan_ref: complex A is not supported")
    dtype_in = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, dim, dstate = u.shape[0], A.shape[0], A.shape[1]
    A, B, C = A.float(), B.float(), C.float()
    dA = torch.exp(delta[..., None] * A[:, None, :])  # (B, D, L, N)
    if B.dim() == 2:
        dBu = (delta * u)[..., None] * B[:, None, :]
    else:
        Bf = B[:, None] if B.dim() == 3 else _expand_groups(B, dim)  # (B, 1|D, N, L)
        dBu = (delta * u)[..., None] * Bf.transpose(-1, -2)
    if C.dim() == 2:
        Cf = C[None, :, None, :].expand(batch, dim, u.shape[2], dstate)
    else:
        Cf = (C[:, None] if C.dim() == 3 else _expand_groups(C, dim)).transpose(-1, -2)
        Cf = Cf.expand(batch, dim, u.shape[2], dstate)
    h = u.new_zeros(batch, dim, dstate)
    ys = []
    for t in range(u.shape[2]):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * Cf[:, :, t]).sum(-1))
    y = torch.stack(ys, dim=2) if ys else u.new_zeros(u.shape)
    out = y if D is None else y + u * D.float()[:, None]
    if z is not None:
        out = out * F.silu(z.float())
    out = out.to(dtype_in)
    return (out, h) if return_last_state else out


# -- validation ---------------------------------------------------------------------------------------------
def _check_bc(name: str, t: torch.Tensor, batch: int, dim: int, dstate: int, seqlen: int) -> None:
    check_tensor(OP, name, t, ndim=(2, 3, 4))
    if t.dim() == 2:
        check_tensor(OP, name, t, shape=(dim, dstate))
    elif t.dim() == 3:
        check_tensor(OP, name, t, shape=(batch, dstate, seqlen))
    else:
        check_tensor(OP, name, t, shape=(batch, None, dstate, seqlen))
        g = t.shape[1]
        if g < 1 or dim % g != 0:
            fail(OP, f"argument '{name}' has {g} groups (shape {tuple(t.shape)}) but the number of channels "
                     f"D={dim} must be a multiple of it")


def _validate(u, delta, A, B, C, D, z, delta_bias) -> None:
    check_tensor(OP, "u", u, ndim=3)
    batch, dim, seqlen = u.shape
    check_tensor(OP, "delta", delta, shape=(batch, dim, seqlen))
    if not isinstance(A, torch.Tensor):
        fail(OP, f"argument 'A' must be a torch.Tensor, got {type(A).__name__}", TypeError)
    if A.is_complex():
        fail(OP, "argument 'A' is complex; only real A (S4D-real / Mamba) is supported", NotImplementedError)
    check_tensor(OP, "A", A, ndim=2)
    if A.shape[0] != dim:
        fail(OP, f"argument 'A' must have shape ({dim}, N) for D={dim} channels, got {tuple(A.shape)}")
    dstate = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if isinstance(t, torch.Tensor) and t.is_complex():
            fail(OP, f"argument '{name}' is complex; only real B/C are supported", NotImplementedError)
        _check_bc(name, t, batch, dim, dstate, seqlen)
    if D is not None:
        check_tensor(OP, "D", D, shape=(dim,))
    if delta_bias is not None:
        check_tensor(OP, "delta_bias", delta_bias, shape=(dim,))
    if z is not None:
        check_tensor(OP, "z", z, shape=(batch, dim, seqlen))
    check_same_device(OP, "u", u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)


def _call(u: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor) -> Call:
    return call_of(u, dstate=A.shape[1], seqlen=u.shape[2], b_dim=B.dim(), c_dim=C.dim())


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0, dtype=torch.float32)


# -- the custom ops -----------------------------------------------------------------------------------------
@torch.library.custom_op("fastarch::selective_scan_fwd", mutates_args=())
def _selective_scan_fwd(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    need_ckpt: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = _call(u, A, B, C)
    out, last, ckpt = run(OP, "forward", call, backend, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                          need_ckpt)
    return out, last, ckpt


@_selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus, need_ckpt, backend):
    b, d, L = u.shape
    n = A.shape[1]
    nck = (L + CHUNK - 1) // CHUNK
    ckpt = u.new_empty((b, d, nck, n) if need_ckpt else (0,), dtype=torch.float32)
    return torch.empty_like(u), u.new_empty(b, d, n, dtype=torch.float32), ckpt


@torch.library.custom_op("fastarch::selective_scan_bwd", mutates_args=())
def _selective_scan_bwd(
    dout: torch.Tensor,
    dlast: torch.Tensor | None,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    ckpt: torch.Tensor,
    delta_softplus: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Returns fp32 (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias); absent optional inputs get empty grads."""
    call = _call(u, A, B, C)
    grads = run_backward(OP, call, backend, dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt,
                         delta_softplus)
    # each gradient in its input's memory layout, as the fake declares
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    return tuple(_empty(u) if g is None else in_layout_of(t, g) for g, t in zip(grads, inputs))


@_selective_scan_bwd.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, delta_softplus, backend):
    def like(t):
        return _empty(u) if t is None else torch.empty_like(t, dtype=torch.float32)

    return (like(u), like(delta), like(A), like(B), like(C), like(D), like(z), like(delta_bias))


def _setup_context(ctx, inputs, output) -> None:
    u, delta, A, B, C, D, z, delta_bias, delta_softplus, need_ckpt, backend = inputs
    _, _, ckpt = output
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, ckpt)
    ctx.delta_softplus, ctx.backend = delta_softplus, backend
    # Unused outputs (the checkpoints always, last_state usually) get None instead of zero-filled gradients:
    # a zero tensor the size of the checkpoints would double their memory at the backward's peak.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlast, _dckpt):
    u, delta, A, B, C, D, z, delta_bias, ckpt = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(u)
    grads = _selective_scan_bwd(dout.contiguous(), dlast, u, delta, A, B, C, D, z, delta_bias, ckpt,
                                ctx.delta_softplus, ctx.backend)
    inputs = (u, delta, A, B, C, D, z, delta_bias)
    res = tuple(None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs))
    return (*res, None, None, None)


_selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """mamba-ssm's ``selective_scan_fn``: the recurrence of the module docstring over every channel.

    Args:
        u: the input sequence.
        delta: the time steps (before ``delta_bias`` and softplus).
        A: the real state matrix, one diagonal per channel.
        B: input weights: constant, variable (one row per step) or grouped.
        C: output weights, in any of the forms of ``B``.
        D: optional skip weight.
        z: optional gate: the output is multiplied by ``silu(z)``.
        delta_bias: optional bias added to ``delta``.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        return_last_state: also return the state after the last step.
        backend: force 'cpp', 'cuda', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        ``out`` in ``u.dtype``, or ``(out, last_state)`` with ``last_state`` fp32. Differentiable in every
        tensor argument (``A``, ``D``, ``delta_bias`` and constant ``B``/``C`` get fp32-accumulated gradients).

    Shapes:
        u, delta, z, out: ``(B, D, L)``; A: ``(D, N)``; B, C: ``(D, N)``, ``(B, N, L)`` or ``(B, G, N, L)``
        with ``G`` dividing ``D``; D, delta_bias: ``(D,)``; last_state: ``(B, D, N)``.
    """
    _validate(u, delta, A, B, C, D, z, delta_bias)
    if u.shape[2] == 0 or u.shape[0] == 0 or u.shape[1] == 0:
        return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    tensors = (u, delta, A, B, C, D, z, delta_bias)
    need_ckpt = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    name = resolve(OP, lambda: _call(u, A, B, C), backend)
    out, last, _ = _selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), need_ckpt, name)
    return (out, last) if return_last_state else out


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """mamba-ssm's name and positional signature for :func:`selective_scan` (same Args, Returns and Shapes),
    so ``from fastarch.ops import selective_scan_fn`` is a drop-in."""
    return selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)


# -- the torch backend --------------------------------------------------------------------------------
def _bc_step_view(M: torch.Tensor, batch: int, dim: int) -> torch.Tensor:
    """B or C as fp32 ``(B|1, D|1, N, L|1)`` so that ``[..., t]`` broadcasts against ``(B, D, N)``."""
    M = M.float()
    if M.dim() == 2:
        return M[None, :, :, None]
    if M.dim() == 3:
        return M[:, None]
    return _expand_groups(M, dim)


def _scan_loop(u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt):
    """A step loop in fp32 that keeps one (B, D, N) state: O(B*D*N) extra memory, and checkpoints."""
    batch, dim, L = u.shape
    uf, dt = u.float(), delta.float()
    if delta_bias is not None:
        dt = dt + delta_bias.float()[:, None]
    if softplus:
        dt = F.softplus(dt)
    Af = A.float()
    Bv, Cv = _bc_step_view(B, batch, dim), _bc_step_view(C, batch, dim)
    dtu = dt * uf
    h = uf.new_zeros(batch, dim, A.shape[1])
    y = torch.empty_like(uf)
    ckpts = []
    for t in range(L):
        if need_ckpt and t % CHUNK == 0:
            ckpts.append(h)
        h = torch.exp(dt[:, :, t, None] * Af) * h + dtu[:, :, t, None] * Bv[..., min(t, Bv.shape[-1] - 1)]
        y[:, :, t] = (h * Cv[..., min(t, Cv.shape[-1] - 1)]).sum(-1)
    if D is not None:
        y = y + uf * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    ckpt = torch.stack(ckpts, dim=2) if need_ckpt else _empty(u)
    return y.to(u.dtype), h, ckpt


class TorchSelectiveScan(TorchImplementation):
    op = OP
    description = "PyTorch step loop in fp32; analytic backward as a reverse step loop"

    def forward(self, u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt):
        return _scan_loop(u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt)

    def backward(self, dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus):
        return _scan_loop_backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, softplus)


def _scan_loop_backward(dout, dlast, u, delta, A, B, C, D, z, delta_bias, softplus):
    """Analytic backward of the recurrence as a reverse step loop in fp32 (keeps every state: the torch
    backend is the simple reference path, the compiled backends recompute from checkpoints instead)."""
    batch, dim, L = u.shape
    uf, pre = u.float(), delta.float()
    if delta_bias is not None:
        pre = pre + delta_bias.float()[:, None]
    dt = F.softplus(pre) if softplus else pre
    Af = A.float()
    Bv, Cv = _bc_step_view(B, batch, dim), _bc_step_view(C, batch, dim)
    hs = [uf.new_zeros(batch, dim, A.shape[1])]
    for t in range(L):
        bt = Bv[..., min(t, Bv.shape[-1] - 1)]
        hs.append(torch.exp(dt[:, :, t, None] * Af) * hs[-1] + (dt * uf)[:, :, t, None] * bt)
    g = dout.float()
    dz = None
    if z is not None:
        zf = z.float()
        y = torch.stack([(hs[t + 1] * Cv[..., min(t, Cv.shape[-1] - 1)]).sum(-1) for t in range(L)], dim=2)
        if D is not None:
            y = y + uf * D.float()[:, None]
        sz = torch.sigmoid(zf)
        dz = g * y * sz * (1 + zf * (1 - sz))
        g = g * zf * sz
    du = g * D.float()[:, None] if D is not None else torch.zeros_like(uf)
    dD = (g * uf).sum((0, 2)) if D is not None else None
    ddt = torch.zeros_like(uf)
    dA = torch.zeros_like(Af)
    dBv = uf.new_zeros(Bv.shape[:-1] + (L,))
    dCv = uf.new_zeros(Cv.shape[:-1] + (L,))
    dh = dlast.float().clone() if dlast is not None else torch.zeros_like(hs[0])
    for t in range(L - 1, -1, -1):
        bt, ct = Bv[..., min(t, Bv.shape[-1] - 1)], Cv[..., min(t, Cv.shape[-1] - 1)]
        gt = g[:, :, t, None]
        dCv[..., t] = _reduce_to(gt * hs[t + 1], Cv)
        dh = dh + gt * ct
        e = torch.exp(dt[:, :, t, None] * Af)
        hp_e = hs[t] * e
        dA += (dh * hp_e * dt[:, :, t, None]).sum(0)
        ddt[:, :, t] = (dh * (hp_e * Af + uf[:, :, t, None] * bt)).sum(-1)
        du[:, :, t] += dt[:, :, t] * (dh * bt).sum(-1)
        dBv[..., t] = _reduce_to(dh * (dt * uf)[:, :, t, None], Bv)
        dh = dh * e
    if softplus:
        ddt = ddt * torch.where(pre <= 20, torch.sigmoid(pre), torch.ones_like(pre))
    dbias = ddt.sum((0, 2)) if delta_bias is not None else None
    return (du, ddt, dA, _bc_grad_back(dBv, B), _bc_grad_back(dCv, C), dD, dz, dbias)


def _reduce_to(x: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """Sum a (B, D, N) product over the dims where ``view`` (B|1, D|1, N, .) broadcasts."""
    dims = tuple(i for i in range(2) if view.shape[i] == 1)
    return x.sum(dims, keepdim=True) if dims else x


def _bc_grad_back(g: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """Gradient in the step-view shape (B|1, D|1, N, L) back to the input form of B/C."""
    if M.dim() == 2:
        return g.sum(-1)[0]
    if M.dim() == 3:
        return g[:, 0]
    grp = M.shape[1]
    return g.view(g.shape[0], grp, g.shape[1] // grp, *g.shape[2:]).sum(2)


# -- compiled backends --------------------------------------------------------------------------------
def kernel_bc(M: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """B or C in the compiled kernels' layout: constant -> ``(D, N)``; variable/grouped -> ``(B, G, L, N)``
    (time-major so the N values of one step are contiguous). Returns (tensor fp32 contiguous, groups or 0)."""
    M = M.float()
    if M.dim() == 2:
        return M.contiguous(), 0
    if M.dim() == 3:
        M = M[:, None]
    return M.transpose(-1, -2).contiguous(), M.shape[1]


def grad_bc_to_input(g: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """The kernels' dB/dC (constant ``(D, N)`` or ``(B, G, L, N)``) back in the shape of the input ``M``."""
    if M.dim() == 2:
        return g
    g = g.transpose(-1, -2)
    return g[:, 0] if M.dim() == 3 else g


def _c32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def _opt32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


class _CompiledScan:
    """Shared glue for the C++ and CUDA extensions: both expose ``selective_scan_fwd``/``selective_scan_bwd``
    with the same arguments."""

    lib: Any

    def forward(self, u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt):
        dim = u.shape[1]
        Bk, gb = kernel_bc(B, dim)
        Ck, gc = kernel_bc(C, dim)
        out, last, ckpt = self.lib.selective_scan_fwd(_c32(u), _c32(delta), _c32(A), Bk, gb, Ck, gc, _opt32(D),
                                                      _opt32(z), _opt32(delta_bias), softplus, need_ckpt, CHUNK)
        return out.to(u.dtype), last, ckpt

    def backward(self, dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus):
        dim = u.shape[1]
        Bk, gb = kernel_bc(B, dim)
        Ck, gc = kernel_bc(C, dim)
        if ckpt.numel() == 0:  # forward ran without checkpoints (e.g. under no_grad, then re-used)
            _, _, ckpt = self.forward(u, delta, A, B, C, D, z, delta_bias, softplus, True)
        du, ddelta, dA, dB, dC, dD, dz, dbias = self.lib.selective_scan_bwd(
            _c32(dout), _opt32(dlast), _c32(u), _c32(delta), _c32(A), Bk, gb, Ck, gc, _opt32(D), _opt32(z),
            _opt32(delta_bias), ckpt.contiguous(), softplus, CHUNK)
        return (du, ddelta, dA, grad_bc_to_input(dB, B), grad_bc_to_input(dC, C),
                dD if D is not None else None, dz if z is not None else None,
                dbias if delta_bias is not None else None)


class CppSelectiveScan(CppImplementation, _CompiledScan):
    op, extension = OP, "selective_scan"
    limits = {"dstate": MAX_STATE}
    description = ("C++: 16-channel blocks on AVX-512 or AVX2 vectors, polynomial exp, lane-major chunks via 8x8 "
                   "transposes, chunked recompute backward")


class TritonSelectiveScan(TritonImplementation):
    op, kernel_module = OP, "selective_scan"
    limits = {"dstate": MAX_STATE}
    deterministic = False  # variable B/C gradients are summed with atomics
    description = "Triton: one program per (batch, channel block), chunked, states stored at chunk boundaries"

    def forward(self, u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt):
        return self.lib.selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, softplus, need_ckpt, CHUNK)

    def backward(self, dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus):
        if ckpt.numel() == 0:
            _, _, ckpt = self.forward(u, delta, A, B, C, D, z, delta_bias, softplus, True)
        return self.lib.selective_scan_bwd(dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus,
                                           CHUNK)


class CudaSelectiveScan(CudaImplementation, _CompiledScan):
    op, extension = OP, "selective_scan"
    limits = {"dstate": 64}  # the state lives in registers
    deterministic = False  # variable B/C gradients are summed with atomics
    description = "hand-written CUDA scan: one thread per (batch, channel), state in registers"


for _impl in (TorchSelectiveScan, CppSelectiveScan, TritonSelectiveScan, CudaSelectiveScan):
    register(_impl)
