"""Mamba-3's scan, compatible with mamba-ssm's ``mamba3_siso_combined`` (SISO) and ``mamba3_mimo`` (MIMO).

Every head ``h`` (of ``H``) keeps a ``(P, N)`` state ``S``; the keys ``K`` and queries ``Q`` (mamba-ssm's ``B``
and ``C``) come in ``G`` groups shared by ``H // G`` heads each, and in MIMO in ``R`` ranks. One step ``t``::

    theta_t = (theta_{t-1} + pi * tanh(Angles_t) * DT_t) mod 2 pi       (the data-dependent rotary angles)
    q_t = rot(Q_t + Q_bias, theta_t);   k_t = rot(K_t + K_bias, theta_t)
    lam_t = sigmoid(Trap_t)                                               (trapezoidal mix)
    alpha_t = exp(ADT_t);  beta_t = (1 - lam_t) DT_t alpha_t;  gamma_t = lam_t DT_t
    v_{t,r} = V_t * mimo_v[:, r]                                          (SISO: v_t = V_t, R = 1)
    S_t = alpha_t S_{t-1} + beta_t sum_r v_{t-1,r} k_{t-1,r}^T + gamma_t sum_r v_{t,r} k_{t,r}^T
    y_{t,r} = S_t q_{t,r} + D v_{t,r};   y_{t,r} *= silu(Z_t * mimo_z[:, r])   (when Z is given)
    out_t = sum_r y_{t,r} * mimo_o[:, r]                                  (SISO: out_t = y_t)

``rot`` turns ``S_a`` pairs of channels by the ``S_a`` angles: channels ``(2i, 2i+1)`` (``rotate_pairwise``, SISO's
default) or ``(i, i + N/2)`` (MIMO's default); the channels past them pass unchanged. ``(k_{-1}, v_{-1})`` and
``theta_{-1}`` come from the input states (zero without). The decode step :func:`fastarch.ops.mamba3_step`
is one step of this recurrence; :func:`mamba3_scan_ref` is the recurrence step by step (the oracle).

Shapes (as in mamba-ssm): ``Q``, ``K`` ``(batch, L, G, N)`` (SISO) or ``(batch, L, R, G, N)`` (MIMO); ``V``, ``Z``
``(batch, L, H, P)``; ``ADT``, ``DT``, ``Trap`` ``(batch, H, L)`` (``Trap`` before the sigmoid); ``Q_bias``,
``K_bias`` ``(H, N)`` (SISO) or ``(H, R, N)`` (MIMO); ``Angles`` ``(batch, L, H, S_a)``; ``D`` ``(H,)``;
``mimo_v``, ``mimo_z``, ``mimo_o`` ``(H, R, P)``. States ``(angle, ssm, k, v)``: ``(batch, H, S_a)`` fp32,
``(batch, H, P, N)`` fp32, ``(batch, H, N)`` (SISO) or ``(batch, R, H, N)`` (MIMO), ``(batch, H, P)``.

Backends: ``cpp`` (``csrc/cpu/mamba3.cpp``: the recurrence step by step per (batch, head) in parallel, fp32
state; the backward runs it in reverse from states kept every 32 steps) and ``torch``, the chunked form. With ``S'_t = S_t + DT_{t+1} (1 - lam_{t+1}) sum_r v_{t,r} k_{t,r}^T`` the
recurrence is ``S'_t = alpha_t S'_{t-1} + w_t sum_r v_{t,r} k_{t,r}^T``, ``w_t = gamma_t + DT_{t+1} (1 -
lam_{t+1})``, so within a chunk the output is a masked ``(chunk, chunk)`` product (the diagonal weighted
``gamma_t``, not ``w_t``), and between chunks only ``(H, P, N)`` states pass: memory
``O(batch * L * H * (R * (N + P) + chunk * R^2) + batch * (L / chunk) * H * P * N)``, never
``batch * L * H * P * N``. The torch backward differentiates a recomputed forward with autograd (the forward
keeps only its inputs). Arithmetic in fp32 (float64 for float64 inputs, torch only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..backend import FLOAT_DTYPES, Call, register
from ._backends import CppImplementation, TorchImplementation
from ._checks import check_same_device, check_tensor, fail
from ._delta_rule import _autograd_enabled
from ._dispatch import call_of, dispatch, in_layout_of, run, run_backward

__all__ = ["mamba3_scan", "mamba3_scan_ref"]

OP = "mamba3_scan"
TWO_PI = 2.0 * math.pi
DTYPES = (*FLOAT_DTYPES, torch.float64)  # float64 for gradient checks

# The differentiable tensor inputs of the custom ops, in order (the scan's and the step's).
SCAN_INPUTS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z", "angle_state",
               "ssm_state", "k_state", "v_state", "mimo_v", "mimo_z", "mimo_o")


# -- the pieces every path shares ---------------------------------------------------------------------------
def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def wrap_angle(theta: torch.Tensor) -> torch.Tensor:
    """``theta mod 2 pi`` in ``[0, 2 pi)`` (the floor carries no gradient)."""
    return theta - TWO_PI * torch.floor(theta / TWO_PI)


def rotate(x: torch.Tensor, theta: torch.Tensor, pairwise: bool) -> torch.Tensor:
    """Turn pairs of ``x``'s last dimension ``N`` by the angles ``theta`` ``(..., S_a)`` (broadcasting with
    ``x[..., :S_a]``): pairs ``(2i, 2i+1)`` when ``pairwise``, else ``(i, i + N/2)``; the others pass."""
    n, s = x.shape[-1], theta.shape[-1]
    cos, sin = torch.cos(theta), torch.sin(theta)
    if pairwise:
        x0, x1 = x[..., 0:2 * s:2], x[..., 1:2 * s:2]
        turned = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
        return torch.cat([turned, x[..., 2 * s:]], dim=-1)
    half = n // 2
    x0, x1 = x[..., :s], x[..., half:half + s]
    return torch.cat([x0 * cos - x1 * sin, x[..., s:half], x0 * sin + x1 * cos, x[..., half + s:]], dim=-1)


def per_rank(x: torch.Tensor, proj: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(..., H, P)`` per rank: ``(..., R, H, P)`` with ``x * proj[:, r]`` (``proj`` ``(H, R, P)``), or
    ``(..., 1, H, P)`` when ``proj`` is None."""
    if proj is None:
        return x.unsqueeze(-3)
    return x.unsqueeze(-3) * proj.transpose(0, 1)


def finish(y: torch.Tensor, vr: torch.Tensor, D: torch.Tensor | None, Z: torch.Tensor | None,
           mimo_z: torch.Tensor | None, mimo_o: torch.Tensor | None, mimo: bool) -> torch.Tensor:
    """Skip, gate and rank contraction of ``y`` ``(..., R, H, P)``: ``(..., H, P)``, or ``(..., R, H, P)`` for a
    MIMO call without ``mimo_o``."""
    if D is not None:
        y = y + D[:, None] * vr
    if Z is not None:
        y = y * F.silu(per_rank(Z.to(y.dtype), mimo_z))
    if mimo_o is not None:
        return torch.einsum("...rhp,hrp->...hp", y, mimo_o.to(y.dtype))
    return y if mimo else y.squeeze(-3)


# -- the oracle ----------------------------------------------------------------------------------------------
def step_math(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, angle_state, ssm_state, k_state, v_state, D, Z,
              mimo_v, mimo_z, mimo_o, pairwise: bool, mimo: bool, cdt: torch.dtype):
    """One step of the recurrence in ``cdt``, canonical shapes: ``Q``, ``K`` ``(batch, R, G, N)``; ``V``, ``Z``
    ``(batch, H, P)``; ``ADT``, ``DT``, ``Trap`` ``(batch, H)``; biases ``(H, R, N)``; ``Angles`` and
    ``angle_state`` ``(batch, H, S_a)``; ``ssm_state`` ``(batch, H, P, N)``; ``k_state`` ``(batch, R, H, N)``;
    ``v_state`` ``(batch, H, P)``. Returns (out, angle, ssm, k, v) in ``cdt``."""
    rep = V.shape[1] // Q.shape[2]
    dt = DT.to(cdt)
    theta = wrap_angle(angle_state.to(cdt) + math.pi * torch.tanh(Angles.to(cdt)) * dt[..., None])
    th = theta.unsqueeze(1)  # (batch, 1, H, S_a)
    q = rotate(Q.to(cdt).repeat_interleave(rep, dim=2) + Q_bias.to(cdt).transpose(0, 1), th, pairwise)
    k = rotate(K.to(cdt).repeat_interleave(rep, dim=2) + K_bias.to(cdt).transpose(0, 1), th, pairwise)
    lam = torch.sigmoid(Trap.to(cdt))
    alpha = torch.exp(ADT.to(cdt))
    beta = (1 - lam) * dt * alpha
    gamma = lam * dt
    mv = None if mimo_v is None else mimo_v.to(cdt)
    vr, vr_prev = per_rank(V.to(cdt), mv), per_rank(v_state.to(cdt), mv)
    S = (alpha[..., None, None] * ssm_state.to(cdt)
         + beta[..., None, None] * torch.einsum("brhp,brhn->bhpn", vr_prev, k_state.to(cdt))
         + gamma[..., None, None] * torch.einsum("brhp,brhn->bhpn", vr, k))
    y = torch.einsum("bhpn,brhn->brhp", S, q)
    out = finish(y, vr, None if D is None else D.to(cdt), Z, None if mimo_z is None else mimo_z.to(cdt),
                 None if mimo_o is None else mimo_o.to(cdt), mimo)
    return out, theta, S, k, V.to(cdt)


def canonical(Q, K, Q_bias, K_bias, k_state, mimo: bool):
    """SISO arguments in MIMO's shapes (a rank dimension of 1 after batch/L; biases ``(H, 1, N)``)."""
    if mimo:
        return Q, K, Q_bias, K_bias, k_state
    r = Q.dim() - 2  # the rank dimension sits before the group dimension
    return (Q.unsqueeze(r), K.unsqueeze(r), Q_bias.unsqueeze(1), K_bias.unsqueeze(1),
            None if k_state is None else k_state.unsqueeze(1))


def zero_states(V: torch.Tensor, R: int, N: int, S_a: int, k_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    b, _, h, p = V.shape
    return (V.new_zeros(b, h, S_a, dtype=torch.float32), V.new_zeros(b, h, p, N, dtype=torch.float32),
            V.new_zeros(b, R, h, N, dtype=k_dtype), V.new_zeros(b, h, p))


def mamba3_scan_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, input_states=None,
                    chunk_size: int = 64, return_final_states: bool = False, cu_seqlens=None, *, mimo_v=None,
                    mimo_z=None, mimo_o=None, rotate_pairwise: bool | None = None) -> Any:
    """The oracle: the recurrence of the module docstring one step at a time, in fp32 (float64 for float64
    inputs); ``chunk_size`` is accepted and ignored. Differentiable by autograd. Returns what
    :func:`mamba3_scan` returns (the output in ``V.dtype``)."""
    if cu_seqlens is not None:
        return per_sequence(
            lambda sl, st: mamba3_scan_ref(Q[:, sl], K[:, sl], V[:, sl], ADT[..., sl], DT[..., sl], Trap[..., sl],
                                           Q_bias, K_bias, Angles[:, sl], D, None if Z is None else Z[:, sl], st,
                                           return_final_states=True, mimo_v=mimo_v, mimo_z=mimo_z, mimo_o=mimo_o,
                                           rotate_pairwise=rotate_pairwise),
            cu_seqlens, input_states, return_final_states, Q, K, V, Angles, mimo_v, mimo_o)
    mimo = Q.dim() == 5
    pairwise = (not mimo) if rotate_pairwise is None else bool(rotate_pairwise)
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    Qc, Kc, qb, kb, _ = canonical(Q, K, Q_bias, K_bias, None, mimo)
    R, N, S_a = Qc.shape[2], Qc.shape[-1], Angles.shape[-1]
    if input_states is None:
        angle, ssm, k, v = zero_states(V, R, N, S_a, K.dtype)
    else:
        angle, ssm, k, v = input_states
        if not mimo:
            k = k.unsqueeze(1)
    outs = []
    for t in range(V.shape[1]):
        o, angle, ssm, k, v = step_math(Qc[:, t], Kc[:, t], V[:, t], ADT[:, :, t], DT[:, :, t], Trap[:, :, t], qb, kb,
                                        Angles[:, t], angle, ssm, k, v, D, None if Z is None else Z[:, t], mimo_v,
                                        mimo_z, mimo_o, pairwise, mimo, cdt)
        outs.append(o)
    out = torch.stack(outs, dim=1).to(V.dtype)
    if not return_final_states:
        return out
    return out, angle, ssm, (k if mimo else k.squeeze(1)).to(K.dtype), v.to(V.dtype)


# -- the chunked form ----------------------------------------------------------------------------------------
def chunked_forward(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state,
                    mimo_v, mimo_z, mimo_o, chunk_size: int, pairwise: bool, mimo: bool):
    """The scan by chunks in canonical shapes (``Q``, ``K`` ``(batch, L, R, G, N)``, biases ``(H, R, N)``,
    ``k_state`` ``(batch, R, H, N)``), differentiable by autograd. Returns (out in ``V.dtype``, angle and
    ssm in the compute dtype, k ``(batch, R, H, N)`` in ``K.dtype``, v in ``V.dtype``)."""
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    b, L, R, G, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    rep = H // G
    dt, a = DT.to(cdt).transpose(1, 2), ADT.to(cdt).transpose(1, 2)  # (b, L, H)
    lam = torch.sigmoid(Trap.to(cdt)).transpose(1, 2)
    # the angles: a running sum over the whole sequence, wrapped to [0, 2 pi)
    theta = torch.cumsum(math.pi * torch.tanh(Angles.to(cdt)) * dt[..., None], dim=1)
    if angle_state is not None:
        theta = theta + angle_state.to(cdt)[:, None]
    theta = wrap_angle(theta)  # (b, L, H, S_a)
    th = theta.unsqueeze(2)
    q = rotate(Q.to(cdt).repeat_interleave(rep, dim=3) + Q_bias.to(cdt).transpose(0, 1), th, pairwise)
    k = rotate(K.to(cdt).repeat_interleave(rep, dim=3) + K_bias.to(cdt).transpose(0, 1), th, pairwise)
    mv = None if mimo_v is None else mimo_v.to(cdt)
    vr = per_rank(V.to(cdt), mv)  # (b, L, R, H, P)
    gamma = lam * dt
    shifted = F.pad((dt * (1 - lam))[:, 1:], (0, 0, 0, 1))  # DT_{t+1} (1 - lam_{t+1}); 0 after the last step
    w = gamma + shifted
    # the entering state, with the input states' pending beta term folded in
    if ssm_state is not None:
        prev = torch.einsum("brhp,brhn->bhpn", per_rank(v_state.to(cdt), mv), k_state.to(cdt))
        state = ssm_state.to(cdt) + (dt[:, 0] * (1 - lam[:, 0]))[..., None, None] * prev
    else:
        state = V.new_zeros(b, H, P, N, dtype=cdt)
    # chunks, padded with steps that neither decay nor add
    cs = max(1, min(chunk_size, L))
    nc = (L + cs - 1) // cs
    pad = nc * cs - L

    def chunks(t: torch.Tensor) -> torch.Tensor:
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, nc, cs, *t.shape[2:])

    qc, kc, vc = chunks(q), chunks(k), chunks(vr)
    ac, wc, sc = chunks(a), chunks(w), chunks(shifted)
    cum = ac.cumsum(2)  # (b, nc, cs, H)
    steps = torch.arange(cs, device=V.device)
    causal = (steps[:, None] >= steps[None, :])[None, None, :, :, None]
    seg = cum[:, :, :, None] - cum[:, :, None, :]  # (b, nc, t, s, H)
    decay = torch.exp(torch.where(causal, seg, torch.full_like(seg, -math.inf)))
    eye = torch.eye(cs, device=V.device, dtype=cdt)[None, None, :, :, None]
    coef = decay * wc[:, :, None] - eye * sc[:, :, :, None]  # the diagonal weighs gamma_t
    scores = torch.einsum("bctxhn,bcsyhn->bctsxyh", qc, kc)  # (b, nc, t, s, R, R, H)
    y = torch.einsum("bctsxyh,bcsyhp->bctxhp", scores * coef[:, :, :, :, None, None], vc)
    # each chunk's contribution to the state at its end, and the states passed along
    to_end = torch.exp(cum[:, :, -1:] - cum) * wc  # (b, nc, s, H)
    own = torch.einsum("bcsyhp,bcsyhn->bchpn", vc * to_end[:, :, :, None, :, None], kc)
    chunk_decay = torch.exp(cum[:, :, -1])  # (b, nc, H)
    entering = []
    for c in range(nc):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + own[:, c]
    states_in = torch.stack(entering, dim=1)  # (b, nc, H, P, N)
    y = y + torch.einsum("bctxhn,bchpn->bctxhp", qc * torch.exp(cum)[:, :, :, None, :, None], states_in)
    y = y.reshape(b, nc * cs, R, H, P)[:, :L]
    out = finish(y, vr, None if D is None else D.to(cdt), Z, None if mimo_z is None else mimo_z.to(cdt),
                 None if mimo_o is None else mimo_o.to(cdt), mimo)
    c = torch.contiguous_format
    return (out.to(V.dtype).clone(memory_format=c), theta[:, -1].clone(memory_format=c), state.contiguous(),
            k[:, -1].to(K.dtype).clone(memory_format=c), V[:, -1].clone(memory_format=c))


# -- validation ----------------------------------------------------------------------------------------------
def _check(op: str, name: str, t: object, **kw: Any) -> None:
    check_tensor(op, name, t, dtypes=DTYPES, **kw)


def validate(op: str, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, states: Sequence | None, mimo_v,
             mimo_z, mimo_o, pairwise: bool | None, step: bool, cu_seqlens: torch.Tensor | None = None) -> None:
    """Shapes, dtypes and devices of a scan (``step=False``, with the ``L`` dimension; ``cu_seqlens`` packs
    sequences into its one row) or a decode step."""
    lead = 1 if step else 2  # batch (, L)
    _check(op, "V", V, ndim=lead + 2)
    b, H, P = V.shape[0], V.shape[-2], V.shape[-1]
    L = None if step else V.shape[1]
    bl = (b,) if step else (b, L)
    if cu_seqlens is not None:
        check_tensor(op, "cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=1)
        if b != 1:
            fail(op, f"argument 'cu_seqlens' packs sequences into one row: V must have batch 1, got {b}")
        cu = cu_seqlens.tolist()
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != L or any(e < s for s, e in zip(cu, cu[1:])):
            fail(op, f"argument 'cu_seqlens' must be non-decreasing from 0 to the length L={L}, got "
                     f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
    elif not step and L == 0:
        fail(op, f"argument 'V' must have at least one step (L >= 1), got shape {tuple(V.shape)}")
    _check(op, "Q", Q, ndim=(lead + 2, lead + 3))
    mimo = Q.dim() == lead + 3
    if mimo:
        _check(op, "Q", Q, shape=(*bl, None, None, None))
        R, G, N = Q.shape[-3:]
    else:
        _check(op, "Q", Q, shape=(*bl, None, None))
        R, G, N = 1, Q.shape[-2], Q.shape[-1]
    qshape = (*bl, R, G, N) if mimo else (*bl, G, N)
    _check(op, "K", K, shape=qshape)
    if G < 1 or H % G != 0:
        fail(op, f"argument 'Q' has {G} groups (shape {tuple(Q.shape)}) but the number of heads H={H} (from V) "
                 f"must be a multiple of it")
    hl = (b, H) if step else (b, H, L)
    for name, t in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        _check(op, name, t, shape=hl)
    bshape = (H, R, N) if mimo else (H, N)
    _check(op, "Q_bias", Q_bias, shape=bshape)
    _check(op, "K_bias", K_bias, shape=bshape)
    _check(op, "Angles", Angles, ndim=lead + 2)
    _check(op, "Angles", Angles, shape=(*bl, H, None))
    S_a = Angles.shape[-1]
    use_pairwise = (not mimo) if pairwise is None else pairwise
    if use_pairwise and 2 * S_a > N:
        fail(op, f"argument 'Angles' has {S_a} angles per head but pairwise rotation of N={N} channels takes at "
                 f"most N // 2 = {N // 2}")
    if not use_pairwise and (N % 2 != 0 or 2 * S_a > N):
        fail(op, f"argument 'Angles' has {S_a} angles per head but rotating channel i with i + N/2 needs an even "
                 f"N and at most N/2 angles, got N={N}")
    if D is not None:
        _check(op, "D", D, shape=(H,))
    if Z is not None:
        _check(op, "Z", Z, shape=(*bl, H, P))
    if states is not None:
        if not (isinstance(states, (tuple, list)) and len(states) == 4):
            fail(op, "the input states must be a tuple (angle_state, ssm_state, k_state, v_state), got "
                     f"{type(states).__name__}" + (f" of length {len(states)}" if isinstance(states, (tuple, list))
                                                   else ""), TypeError)
        angle, ssm, ks, vs = states
        n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1  # one row per sequence
        _check(op, "angle_state", angle, shape=(n, H, S_a))
        _check(op, "ssm_state", ssm, shape=(n, H, P, N))
        _check(op, "k_state", ks, shape=(n, R, H, N) if mimo else (n, H, N))
        _check(op, "v_state", vs, shape=(n, H, P))
        check_same_device(op, "V", V, angle_state=angle, ssm_state=ssm, k_state=ks, v_state=vs)
    if mimo:
        if mimo_v is None:
            fail(op, f"a MIMO call (Q of shape {tuple(Q.shape)}) needs argument 'mimo_v' of shape ({H}, {R}, {P})")
        _check(op, "mimo_v", mimo_v, shape=(H, R, P))
        if Z is not None and mimo_z is None:
            fail(op, f"a MIMO call with 'Z' needs argument 'mimo_z' of shape ({H}, {R}, {P})")
        if mimo_z is not None:
            _check(op, "mimo_z", mimo_z, shape=(H, R, P))
        if mimo_o is not None:
            _check(op, "mimo_o", mimo_o, shape=(H, R, P))
    else:
        for name, t in (("mimo_v", mimo_v), ("mimo_z", mimo_z), ("mimo_o", mimo_o)):
            if t is not None:
                fail(op, f"argument '{name}' belongs to MIMO calls (Q of shape (batch, L, R, G, N)); this call is "
                         f"SISO (Q of shape {tuple(Q.shape)})")
    check_same_device(op, "V", V, Q=Q, K=K, ADT=ADT, DT=DT, Trap=Trap, Q_bias=Q_bias, K_bias=K_bias, Angles=Angles,
                      D=D, Z=Z, mimo_v=mimo_v, mimo_z=mimo_z, mimo_o=mimo_o, cu_seqlens=cu_seqlens)


def check_chunk_size(op: str, chunk_size: object) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        fail(op, f"argument 'chunk_size' must be a positive int, got {chunk_size!r}")


# -- the custom ops ------------------------------------------------------------------------------------------
def _call(V: torch.Tensor, Q: torch.Tensor, chunk_size: int) -> Call:
    return call_of(V, headdim=V.shape[-1], dstate=Q.shape[-1], chunk_size=chunk_size)


def out_shape(V: torch.Tensor, mimo_v: torch.Tensor | None, mimo_o: torch.Tensor | None) -> tuple[int, ...]:
    """``V``'s shape, with the rank dimension before the heads for MIMO without ``mimo_o``."""
    if mimo_v is not None and mimo_o is None:
        return (*V.shape[:-2], mimo_v.shape[1], *V.shape[-2:])
    return tuple(V.shape)


@torch.library.custom_op("fastarch::mamba3_scan_fwd", mutates_args=())
def _mamba3_scan_fwd(
    Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor, Trap: torch.Tensor,
    Q_bias: torch.Tensor, K_bias: torch.Tensor, Angles: torch.Tensor, D: torch.Tensor | None, Z: torch.Tensor | None,
    angle_state: torch.Tensor | None, ssm_state: torch.Tensor | None, k_state: torch.Tensor | None,
    v_state: torch.Tensor | None, mimo_v: torch.Tensor | None, mimo_z: torch.Tensor | None,
    mimo_o: torch.Tensor | None, chunk_size: int, pairwise: bool, mimo: bool, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical shapes (see :func:`chunked_forward`). Returns (out, angle, ssm, k, v)."""
    return run(OP, "forward", _call(V, Q, chunk_size), backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z,
               angle_state, ssm_state, k_state, v_state, mimo_v, mimo_z, mimo_o, chunk_size, pairwise, mimo)


@_mamba3_scan_fwd.register_fake
def _(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v, mimo_z,
      mimo_o, chunk_size, pairwise, mimo, backend):
    b, _, R, _, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    return (V.new_empty(out_shape(V, mimo_v, mimo_o)), V.new_empty(b, H, Angles.shape[-1], dtype=cdt),
            V.new_empty(b, H, P, N, dtype=cdt), K.new_empty(b, R, H, N), V.new_empty(b, H, P))


def grads_by_recompute(forward, douts: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor | None],
                       *args: Any) -> tuple[torch.Tensor, ...]:
    """The gradients of ``forward(*inputs, *args)`` (a tuple of outputs) for the output gradients ``douts``
    (None: no gradient), by autograd through a recomputed forward; an empty tensor for each absent input."""
    with _autograd_enabled(), torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
        outs = forward(*leaves, *args)
        pairs = [(o, g) for o, g in zip(outs, douts) if g is not None and o.requires_grad]
        present = [t for t in leaves if t is not None]
        grads = (torch.autograd.grad([o for o, _ in pairs], present, [g.to(o.dtype) for o, g in pairs],
                                     allow_unused=True) if pairs else [None] * len(present))
    it = iter(grads)
    res: list[torch.Tensor] = []
    seen = {d.untyped_storage().data_ptr() for d in douts if d is not None}
    for t in leaves:
        if t is None:
            res.append(inputs[0].new_empty(0))
            continue
        g = next(it)
        g = torch.zeros_like(t) if g is None else in_layout_of(t, g.to(t.dtype))
        if g.untyped_storage().data_ptr() in seen:  # a custom op's outputs alias neither inputs nor each other
            g = g.clone()
        seen.add(g.untyped_storage().data_ptr())
        res.append(g)
    return tuple(res)


@torch.library.custom_op("fastarch::mamba3_scan_bwd", mutates_args=())
def _mamba3_scan_bwd(
    dout: torch.Tensor | None, dangle: torch.Tensor | None, dssm: torch.Tensor | None, dk: torch.Tensor | None,
    dv: torch.Tensor | None, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, ADT: torch.Tensor, DT: torch.Tensor,
    Trap: torch.Tensor, Q_bias: torch.Tensor, K_bias: torch.Tensor, Angles: torch.Tensor, D: torch.Tensor | None,
    Z: torch.Tensor | None, angle_state: torch.Tensor | None, ssm_state: torch.Tensor | None,
    k_state: torch.Tensor | None, v_state: torch.Tensor | None, mimo_v: torch.Tensor | None,
    mimo_z: torch.Tensor | None, mimo_o: torch.Tensor | None, chunk_size: int, pairwise: bool, mimo: bool,
    backend: str,
) -> list[torch.Tensor]:
    """The gradients of the 18 tensor inputs (an empty tensor for an absent one)."""
    inputs = (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v,
              mimo_z, mimo_o)
    return list(run_backward(OP, _call(V, Q, chunk_size), backend, (dout, dangle, dssm, dk, dv), inputs, chunk_size,
                             pairwise, mimo))


@_mamba3_scan_bwd.register_fake
def _(dout, dangle, dssm, dk, dv, *rest):
    inputs = rest[:18]
    return [inputs[0].new_empty(0) if t is None else torch.empty_like(t) for t in inputs]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:18])
    ctx.chunk_size, ctx.pairwise, ctx.mimo, ctx.backend = inputs[18:22]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dangle, dssm, dk, dv):
    saved = ctx.saved_tensors
    grads = _mamba3_scan_bwd(dout, dangle, dssm, dk, dv, *saved, ctx.chunk_size, ctx.pairwise, ctx.mimo, ctx.backend)
    return (*[None if t is None else g for g, t in zip(grads, saved)], None, None, None, None)


_mamba3_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- the public op -------------------------------------------------------------------------------------------
def mamba3_scan(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    Angles: torch.Tensor,
    D: torch.Tensor | None = None,
    Z: torch.Tensor | None = None,
    input_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    chunk_size: int = 64,
    return_final_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    mimo_v: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    rotate_pairwise: bool | None = None,
    backend: str | None = None,
) -> Any:
    """Mamba-3's scan (the recurrence of the module docstring), SISO or MIMO.

    Args:
        Q, K: queries and keys (mamba-ssm's ``C`` and ``B``): ``(batch, L, G, N)`` (SISO) or
            ``(batch, L, R, G, N)`` (MIMO, rank ``R``).
        V: the input ``(batch, L, H, P)``, ``G`` dividing ``H``.
        ADT: ``A * DT``, the log decay per step, ``(batch, H, L)``.
        DT: the steps ``(batch, H, L)``.
        Trap: the trapezoidal mix before its sigmoid, ``(batch, H, L)``.
        Q_bias, K_bias: ``(H, N)`` (SISO) or ``(H, R, N)`` (MIMO), added before the rotation.
        Angles: the rotary angle rates ``(batch, L, H, S_a)``, before ``pi * tanh``.
        D: optional skip weight ``(H,)``.
        Z: optional gate ``(batch, L, H, P)``: the output is multiplied by ``silu(Z)`` (MIMO: per rank, by
            ``silu(Z * mimo_z[:, r])``).
        input_states: optional ``(angle, ssm, k, v)`` before the first step (shapes in the module docstring).
        chunk_size: steps per chunk of the chunked form; the result does not depend on it beyond rounding.
        return_final_states: also return the states after the last step.
        cu_seqlens: optional ``(num_seqs + 1,)`` integer offsets of sequences packed into one row (batch 1):
            each runs from its own row of ``input_states`` (zeros without), and the final states have one
            row per sequence (an empty sequence keeps its input states).
        mimo_v, mimo_z, mimo_o: MIMO's ``(H, R, P)`` projections of ``V`` (required), ``Z`` (required with
            ``Z``) and the output (optional: without it the output keeps its ranks).
        rotate_pairwise: rotate channel pairs ``(2i, 2i+1)`` (True) or ``(i, i + N/2)`` (False); default True
            for SISO, False for MIMO (what mamba-ssm's kernels do).
        backend: force 'torch' (default: the selector's choice).

    Returns:
        ``out`` ``(batch, L, H, P)`` in ``V.dtype`` (MIMO without ``mimo_o``: ``(batch, L, R, H, P)``); with
        ``return_final_states``, ``(out, angle, ssm, k, v)``: angle ``(batch, H, S_a)`` in ``[0, 2 pi)`` and
        ssm ``(batch, H, P, N)`` in fp32 (float64 for float64 inputs), k ``(batch, H, N)`` (MIMO ``(batch, R, H, N)``) in ``K.dtype``, the
        rotated biased key of the last step, v ``(batch, H, P)`` the last ``V``. Differentiable in every
        floating input, through the final states too.
    """
    validate(OP, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, input_states, mimo_v, mimo_z, mimo_o,
             rotate_pairwise, step=False, cu_seqlens=cu_seqlens)
    check_chunk_size(OP, chunk_size)
    mimo = Q.dim() == 5
    pairwise = (not mimo) if rotate_pairwise is None else bool(rotate_pairwise)
    if cu_seqlens is None:
        return _scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, input_states, chunk_size,
                     return_final_states, mimo_v, mimo_z, mimo_o, pairwise, mimo, backend)
    return per_sequence(
        lambda sl, st: _scan(Q[:, sl], K[:, sl], V[:, sl], ADT[..., sl], DT[..., sl], Trap[..., sl], Q_bias, K_bias,
                             Angles[:, sl], D, None if Z is None else Z[:, sl], st, chunk_size, True, mimo_v, mimo_z,
                             mimo_o, pairwise, mimo, backend),
        cu_seqlens, input_states, return_final_states, Q, K, V, Angles, mimo_v, mimo_o)


def per_sequence(scan, cu_seqlens, input_states, return_final_states, Q, K, V, Angles, mimo_v, mimo_o):
    """Packed sequences, one ``scan(slice, states)`` (returning ``(out, *final_states)``) each, from its own row
    of ``input_states``; an empty sequence keeps its input states (zeros without)."""
    mimo = Q.dim() == 5
    cu = [int(c) for c in cu_seqlens.tolist()]
    outs, finals = [], []
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        states_i = None if input_states is None else tuple(t[i:i + 1] for t in input_states)
        if e == s:
            if return_final_states:
                zeros = list(zero_states(V[:1], Q.shape[2] if mimo else 1, Q.shape[-1], Angles.shape[-1], K.dtype))
                zeros[2] = zeros[2] if mimo else zeros[2][:, 0]
                finals.append([z if st is None else st.to(z.dtype) for z, st in zip(zeros, states_i or (None,) * 4)])
            continue
        res = scan(slice(s, e), states_i)
        outs.append(res[0])
        finals.append(res[1:])
    out = torch.cat(outs, dim=1) if outs else V.new_zeros(out_shape(V, mimo_v, mimo_o))
    if not return_final_states:
        return out
    return (out, *(torch.cat(parts, dim=0) for parts in zip(*finals)))


def _scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, input_states, chunk_size, return_final_states, mimo_v,
          mimo_z, mimo_o, pairwise, mimo, backend):
    """One validated scan without ``cu_seqlens``."""
    angle0, ssm0, k0, v0 = input_states if input_states is not None else (None, None, None, None)
    Qc, Kc, qb, kb, k0 = canonical(Q, K, Q_bias, K_bias, k0, mimo)
    args = (Qc, Kc, V, ADT, DT, Trap, qb, kb, Angles, D, Z, angle0, ssm0, k0, v0, mimo_v, mimo_z, mimo_o)
    impl, name = dispatch(OP, lambda: _call(V, Q, chunk_size), backend, *args)
    if impl is not None:
        res = impl.forward(*args, chunk_size, pairwise, mimo)
    else:
        res = _mamba3_scan_fwd(*args, chunk_size, pairwise, mimo, name)
    out, angle, ssm, k, v = res
    if not return_final_states:
        return out
    return out, angle, ssm, (k if mimo else k.squeeze(1)), v


class TorchMamba3Scan(TorchImplementation):
    op = OP
    dtypes = DTYPES
    description = ("PyTorch chunked form (masked chunk x chunk products within chunks, (H, P, N) states passed "
                   "between); backward by autograd through a recomputed forward")

    def forward(self, *args):
        return chunked_forward(*args)

    def backward(self, douts, inputs, chunk_size, pairwise, mimo):
        return grads_by_recompute(chunked_forward, douts, inputs, chunk_size, pairwise, mimo)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def cpp_forward(lib: Any, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state,
                v_state, mimo_v, mimo_z, mimo_o, pairwise: bool):
    """The C++ recurrence on canonical inputs (with the ``L`` dimension): (out, angle, ssm, k, v) in the
    dtypes :func:`chunked_forward` gives."""
    cdt = compute_dtype(Q, K, V, ADT, DT, Angles)
    out, angle, ssm, k, v = lib.mamba3_scan_fwd(*(_f32(t) for t in (
        Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state, mimo_v,
        mimo_z, mimo_o)), pairwise)
    return out.to(V.dtype), angle.to(cdt), ssm.to(cdt), k.to(K.dtype), v.to(V.dtype)


def cpp_backward(lib: Any, douts, inputs, pairwise: bool) -> tuple[torch.Tensor, ...]:
    """The C++ reverse recurrence on canonical inputs (with the ``L`` dimension): the 18 gradients as
    :func:`grads_by_recompute` gives them (an empty tensor for an absent input)."""
    grads = list(lib.mamba3_scan_bwd(*(_f32(t) for t in douts), *(_f32(t) for t in inputs), pairwise))
    Q, V = inputs[0], inputs[2]
    b, L, R, G, N = Q.shape
    H = V.shape[2]
    for i in (0, 1):  # per head -> per group
        grads[i] = grads[i].view(b, L, R, G, H // G, N).sum(4)
    for i in (6, 7, 9, 15, 16, 17):  # shared by the batch rows
        grads[i] = grads[i].sum(0)
    return tuple(inputs[0].new_empty(0) if t is None else in_layout_of(t, g.to(t.dtype))
                 for g, t in zip(grads, inputs))


class CppMamba3Scan(CppImplementation):
    op, extension = OP, "mamba3"  # csrc/cpu/mamba3.cpp
    dtypes = FLOAT_DTYPES
    description = ("C++: the recurrence one step at a time per (batch, head) in parallel, fp32 state in place; "
                   "backward by the reverse recurrence from states kept every 32 steps")

    def forward(self, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state, k_state, v_state,
                mimo_v, mimo_z, mimo_o, chunk_size, pairwise, mimo):
        return cpp_forward(self.lib, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, angle_state, ssm_state,
                           k_state, v_state, mimo_v, mimo_z, mimo_o, pairwise)

    def backward(self, douts, inputs, chunk_size, pairwise, mimo):
        return cpp_backward(self.lib, douts, inputs, pairwise)


register(TorchMamba3Scan)
register(CppMamba3Scan)
