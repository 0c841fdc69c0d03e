"""The gated delta rule, shared by :mod:`fastarch.ops.gated_delta_rule` (Gated DeltaNet) and
:mod:`fastarch.ops.kda` (Kimi Delta Attention), with flash-linear-attention's semantics.

Each value head ``h`` (of ``Hv``) keeps a fp32 state ``S`` of shape ``(K, V)`` and reads the query/key head
``h // (Hv // Hk)`` (each q/k head serves ``Hv // Hk`` consecutive value heads, as fla's grouped value
attention does). Per step ``t``::

    S   = diag(exp(g_t)) S                      (g_t: a scalar per head for GDN, a K-vector for KDA)
    u_t = beta_t (v_t - S^T k_t)
    S   = S + k_t u_t^T
    o_t = S^T (scale q_t)

GDN is KDA with the gate broadcast over ``K``; one implementation serves both: the gate ``g`` arrives as
``(B, T, Hv)`` or ``(B, T, Hv, K)`` and the shape says which. ``g`` is a log decay (``<= 0``).

Two algorithms compute it:

- the *recurrent* form above, one step at a time (decode, short calls);
- the *chunked* form (prefill, training): within a chunk of ``C = 64`` steps the delta-rule updates are
  folded with the WY/UT transform ``(I + A)^{-1}``, ``A`` the strictly lower ``(C, C)`` matrix of gated
  ``beta_t k_t . k_s``; between chunks only the ``(K, V)`` states pass. Every exponent it forms is a
  difference ``G_t - G_s`` with ``s <= t`` of the gate's cumulative sum (so ``<= 0``): no overflow however
  negative the gates. For a per-key gate the intra-chunk products are formed by blocks (64 -> 16 -> 4 steps):
  each block below the diagonal about a reference step between its rows and columns, the diagonal blocks
  split again, pairwise only within 4 steps.

Memory: neither form materialises a ``(B, T, H, K, V)`` tensor. The chunked form holds the states entering
each chunk, ``(B, H, T / 64, K, V)``, and ``(B, H, T, 64)`` intra-chunk matrices; a per-key gate adds
``(B, H, T, 4, K)`` for the smallest diagonal blocks.

Packed sequences (``cu_seqlens``, batch 1) run as a zero-padded batch of the sequences: a padded step has
``g = 0`` and ``beta = 0``, so it changes no state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..backend import Call, choose
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, dispatch, run_backward

__all__ = ["CHUNK", "delta_rule_chunked", "delta_rule_recurrent", "delta_rule_ref", "l2norm", "run_delta_rule",
           "validate"]

CHUNK = 64
SUB = 4  # the per-key intra-chunk products are pairwise within blocks of at most this many steps
SPLIT = 4  # ... and split into this many blocks per level above that (64 -> 16 -> 4)
INDEX_DTYPES = (torch.int32, torch.int64)
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in fp32 (fla normalises q and k this way)."""
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``(B, T, H, ...)`` -> ``(B, H, T, ...)`` fp32."""
    return t.float().transpose(1, 2)


def _expand_qk(t: torch.Tensor, hv: int) -> torch.Tensor:
    """q or k ``(B, T, Hk, K)`` with each head repeated for the ``Hv // Hk`` value heads it serves."""
    hk = t.shape[2]
    return t if hk == hv else t.repeat_interleave(hv // hk, dim=2)


# -- the recurrence ----------------------------------------------------------------------------------------
def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, h0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring, one step at a time in fp32, for equal-length sequences.

    ``q``, ``k`` ``(B, T, Hk, K)``; ``v`` ``(B, T, Hv, V)``; ``g`` ``(B, T, Hv)`` or ``(B, T, Hv, K)``;
    ``beta`` ``(B, T, Hv)``; ``h0`` ``(B, Hv, K, V)`` or None. Returns (o ``(B, T, Hv, V)``, state
    ``(B, Hv, K, V)``), fp32. Differentiable by autograd (which then stores a state per step: tests only)."""
    B, T, hv, V = v.shape
    K = q.shape[-1]
    qf = _expand_qk(q, hv).float() * scale
    kf = _expand_qk(k, hv).float()
    vf, gf, bf = v.float(), g.float(), beta.float()
    per_key = g.dim() == 4
    S = h0.float() if h0 is not None else vf.new_zeros(B, hv, K, V)
    outs = []
    for t in range(T):
        decay = torch.exp(gf[:, t])
        S = S * (decay[..., None] if per_key else decay[..., None, None])
        kt = kf[:, t]
        u = bf[:, t, :, None] * (vf[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], S))
    o = torch.stack(outs, dim=1) if outs else vf.new_zeros(B, 0, hv, V)
    return o, S


# -- the chunked form --------------------------------------------------------------------------------------
def _gated_gram(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """``M[t, s] = sum_k a[t, k] b[s, k] exp(G[t, k] - G[s, k])`` for ``s < t`` (``strict``) or ``s <= t``,
    else 0: ``(..., C, C)``. ``a``, ``b`` ``(..., C, K)``; ``G`` ``(..., C, 1)`` (a scalar gate) or
    ``(..., C, K)``, non-increasing along C. Only exponents ``<= 0`` are formed."""
    C = a.shape[-2]
    steps = torch.arange(C, device=a.device)
    keep = steps[:, None] > steps[None, :] if strict else steps[:, None] >= steps[None, :]
    if G.shape[-1] == 1:
        seg = G[..., :, None, 0] - G[..., None, :, 0]
        return (a @ b.transpose(-1, -2)) * torch.exp(seg.masked_fill(~keep, -math.inf))
    if C <= SUB or C % SPLIT:  # pairwise, exactly
        seg = G[..., :, None, :] - G[..., None, :, :]  # (..., C, C, K)
        return (a[..., :, None, :] * b[..., None, :, :] * torch.exp(seg.masked_fill(~keep[..., None], -math.inf))
                ).sum(-1)
    # SPLIT blocks of steps: each row block against all columns before it in one product about the step r
    # just before the block (t > r >= s, so both factors are <= 1); the diagonal blocks recursively, all the
    # blocks of a level at once
    n, m = SPLIT, C // SPLIT
    ab, bb, Gb = (t.reshape(*t.shape[:-2], n, m, t.shape[-1]) for t in (a, b, G))
    diag = _gated_gram(ab, bb, Gb, strict)  # (..., n, m, m)
    rows = [torch.cat([diag[..., 0, :, :], a.new_zeros(*a.shape[:-2], m, C - m)], dim=-1)]
    for i in range(1, n):
        r = G[..., i * m - 1:i * m, :]
        ai = ab[..., i, :, :] * torch.exp(Gb[..., i, :, :] - r)
        before = b[..., :i * m, :] * torch.exp(r - G[..., :i * m, :])
        parts = [ai @ before.transpose(-1, -2), diag[..., i, :, :]]
        if i < n - 1:
            parts.append(a.new_zeros(*a.shape[:-2], m, C - (i + 1) * m))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """The inverse of unit lower-triangular matrices ``L`` ``(..., C, C)``, ``C`` a power of two, by doubling
    blocks: ``inv([[L11, 0], [L21, L22]]) = [[X1, 0], [-X2 L21 X1, X2]]``, every block of a level in one batched
    product (exact substitution arithmetic, only matrix products, so autograd differentiates it cheaply;
    a batched triangular solve on CPU costs far more for these small matrices)."""
    C = L.shape[-1]
    lead = L.shape[:-2]
    X = torch.ones(*lead, C, 1, 1, dtype=L.dtype, device=L.device)  # the 1x1 diagonal blocks' inverses
    size = 1
    while size < C:
        nb = C // (2 * size)
        blocks = torch.diagonal(L.reshape(*lead, nb, 2 * size, nb, 2 * size), dim1=-4, dim2=-2)
        L21 = blocks.movedim(-1, -3)[..., size:, :size]  # (..., nb, size, size)
        X1, X2 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        top = torch.cat([X1, torch.zeros_like(X1)], dim=-1)
        bottom = torch.cat([-(X2 @ L21 @ X1), X2], dim=-1)
        X = torch.cat([top, bottom], dim=-2)
        size *= 2
    return X.reshape(*lead, C, C)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       scale: float, h0: torch.Tensor | None, chunk: int = CHUNK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY/UT) form, fp32, for equal-length sequences; arguments and results as
    :func:`delta_rule_recurrent`. Differentiable by autograd through PyTorch ops."""
    B, T, hv, V = v.shape
    K = q.shape[-1]
    per_key = g.dim() == 4
    qh = _heads_first(_expand_qk(q, hv)) * scale  # (B, H, T, K)
    kh = _heads_first(_expand_qk(k, hv))
    vh, bh = _heads_first(v), _heads_first(beta)
    gh = _heads_first(g) if per_key else _heads_first(g)[..., None]  # (B, H, T, Kg)
    pad = (-T) % chunk
    if pad:  # padded steps: no decay, no update, no output kept
        qh, kh, vh, gh = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (qh, kh, vh, gh))
        bh = torch.nn.functional.pad(bh, (0, pad))
    nc = (T + pad) // chunk
    qc, kc, vc, gc = (t.reshape(B, hv, nc, chunk, t.shape[-1]) for t in (qh, kh, vh, gh))
    bc = bh.reshape(B, hv, nc, chunk, 1)
    G = gc.cumsum(3)  # (B, H, nc, C, Kg), non-increasing
    kb = kc * bc
    # the UT transform: (I + A) U = beta (v - (k exp(G))^T S_in), A[t, s] = beta_t k_t.k_s exp(G_t - G_s), s < t
    A = _gated_gram(kb, kc, G, strict=True)
    lhs = A + torch.eye(chunk, device=A.device, dtype=A.dtype)
    if chunk & (chunk - 1) == 0:
        inv = _unit_lower_inverse(lhs)
        U0, W = inv @ (vc * bc), inv @ (kb * torch.exp(G))
    else:
        U0 = torch.linalg.solve_triangular(lhs, vc * bc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(lhs, kb * torch.exp(G), upper=False, unitriangular=True)
    P = _gated_gram(qc, kc, G, strict=False)  # the within-chunk read, s <= t
    last = G[..., -1:, :]
    Kd = kc * torch.exp(last - G)  # each step's key, decayed to the chunk's end
    decay = torch.exp(last[..., 0, :])[..., None]  # (B, H, nc, Kg, 1)
    S = h0.float() if h0 is not None else vh.new_zeros(B, hv, K, V)
    entering, us = [], []
    # per-chunk views by unbind (its backward is one stack; indexing in the loop would make autograd build a
    # zero-filled full-size gradient per chunk, quadratic in the number of chunks)
    for u0, w, dc, kd in zip(U0.unbind(2), W.unbind(2), decay.unbind(2), Kd.unbind(2)):
        entering.append(S)
        u = u0 - w @ S
        us.append(u)
        S = dc * S + kd.transpose(-1, -2) @ u
    S_in = torch.stack(entering, dim=2)  # (B, H, nc, K, V)
    Uc = torch.stack(us, dim=2)  # (B, H, nc, C, V)
    o = (qc * torch.exp(G)) @ S_in + P @ Uc
    o = o.reshape(B, hv, nc * chunk, V)[:, :, :T].transpose(1, 2)
    return o, S


# -- packed sequences --------------------------------------------------------------------------------------
def _padded_index(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed offsets ``cu`` ``(N + 1,)``: the packed position of each (sequence, step) of a padded batch
    ``(N, Lmax)`` (clamped), and the mask of real steps."""
    cu = cu.long()
    lens = cu[1:] - cu[:-1]
    lmax = max(int(lens.max().item()) if lens.numel() else 0, 1)
    steps = torch.arange(lmax, device=cu.device)
    valid = steps[None, :] < lens[:, None]
    idx = (cu[:-1, None] + steps[None, :]).clamp(max=max(total - 1, 0))
    return idx, valid


def _unpack(t: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(1, T, ...)`` packed -> ``(N, Lmax, ...)`` padded with zeros."""
    x = t[0][idx]
    mask = valid.reshape(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _varlen(fn, q, k, v, g, beta, scale, h0, cu):
    """Run ``fn`` (an equal-length form) over packed sequences: outputs packed back ``(1, T, Hv, V)``, one
    final state per sequence ``(N, Hv, K, V)``."""
    T = q.shape[1]
    idx, valid = _padded_index(cu, T)
    o, S = fn(*(_unpack(t, idx, valid) for t in (q, k, v, g, beta)), scale, h0)
    return o[valid][None], S


def run_form(recurrent: bool, q, k, v, g, beta, scale: float, h0, cu) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent or chunked form, fp32, with or without packed sequences."""
    fn = delta_rule_recurrent if recurrent else delta_rule_chunked
    if cu is None:
        return fn(q, k, v, g, beta, scale, h0)
    return _varlen(fn, q, k, v, g, beta, scale, h0, cu)


# -- the oracle ----------------------------------------------------------------------------------------------
def delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float | None = None, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: the recurrence in fp32, one packed sequence at a time. Differentiable by autograd.
    Returns (o in ``q.dtype``, final state fp32 or None), as fla does."""
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        o, S = delta_rule_recurrent(q, k, v, g, beta, scale, initial_state)
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
        outs, states = [], []
        for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            h0 = initial_state[n:n + 1] if initial_state is not None else None
            o_n, S_n = delta_rule_recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, h0)
            outs.append(o_n)
            states.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(dtype), (S if output_final_state else None)


# -- validation ----------------------------------------------------------------------------------------------
def validate(op: str, q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any, initial_state: Any, cu_seqlens: Any,
             per_key: bool, check_gate: bool = True) -> None:
    """Every argument checked, before anything runs or is written: a clear error naming the argument."""
    check_tensor(op, "q", q, ndim=4)
    B, T, hk, K = q.shape
    check_tensor(op, "k", k, shape=(B, T, hk, K))
    check_tensor(op, "v", v, ndim=4)
    check_tensor(op, "v", v, shape=(B, T, None, None))
    hv, V = v.shape[2], v.shape[3]
    if hk < 1 or hv % hk != 0:
        fail(op, f"argument 'v' has {hv} heads (shape {tuple(v.shape)}), which must be a multiple of the q/k "
                 f"heads Hk={hk} (each q/k head serves Hv // Hk value heads)")
    if per_key:
        check_tensor(op, "g", g, shape=(B, T, hv, K))
    else:
        check_tensor(op, "g", g, shape=(B, T, hv))
    check_tensor(op, "beta", beta, shape=(B, T, hv))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        fail(op, f"argument 'scale' must be a positive number or None, got {scale!r}")
    n_seq = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            fail(op, f"argument 'cu_seqlens' must be a torch.Tensor of int32/int64 offsets, got "
                     f"{type(cu_seqlens).__name__}", TypeError)
        check_tensor(op, "cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
        if B != 1:
            fail(op, f"argument 'cu_seqlens' packs sequences into one row: q must have batch 1, got {B}")
        cu = cu_seqlens.tolist()
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            fail(op, f"argument 'cu_seqlens' must be non-decreasing from 0 to the length T={T}, got "
                     f"{cu[:8]}{'...' if len(cu) > 8 else ''}")
        n_seq = len(cu) - 1
    if initial_state is not None:
        check_tensor(op, "initial_state", initial_state, shape=(n_seq, hv, K, V))
    check_same_device(op, "q", q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    # a positive log decay grows the state without bound; not while tracing (it reads the values)
    if check_gate and not torch.compiler.is_compiling() and g.numel() and bool((g > 0).any()):
        fail(op, f"argument 'g' is a log decay and must be <= 0; its largest value is {g.max().item():.4g}")


# -- the custom ops --------------------------------------------------------------------------------------------
def make_call(q: torch.Tensor, v: torch.Tensor, per_key: bool, recurrent: bool, varlen: bool) -> Call:
    return call_of(q, head_dim=q.shape[-1], v_dim=v.shape[-1], per_key=per_key, recurrent=recurrent, varlen=varlen)


def _call_of(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, recurrent: bool, cu: torch.Tensor | None) -> Call:
    return make_call(q, v, g.dim() == 4, recurrent, cu is not None)


@torch.library.custom_op("fastarch::delta_rule_fwd", mutates_args=())
def _delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    recurrent: bool,
    op: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns fp32 (o ``(B, T, Hv, V)``, final state ``(N, Hv, K, V)``)."""
    impl = choose(op, _call_of(q, v, g, recurrent, cu_seqlens), backend)
    o, S = impl.forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent)
    return o.contiguous(), S.contiguous()


@_delta_rule_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent, op, backend):
    B, T, hv, V = v.shape
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (v.new_empty(B, T, hv, V, dtype=torch.float32),
            v.new_empty(n, hv, q.shape[-1], V, dtype=torch.float32))


@torch.library.custom_op("fastarch::delta_rule_bwd", mutates_args=())
def _delta_rule_bwd(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    op: str,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns fp32 (dq, dk, dv, dg, dbeta, dinitial_state); dinitial_state is empty without a state."""
    grads = run_backward(op, _call_of(q, v, g, False, cu_seqlens), backend, do, dfinal, q, k, v, g, beta,
                         initial_state, cu_seqlens, scale)
    like = (q, k, v, g, beta, initial_state)
    return tuple(q.new_empty(0, dtype=torch.float32) if t is None else gr.float().contiguous()
                 for gr, t in zip(grads, like))


@_delta_rule_bwd.register_fake
def _(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale, op, backend):
    def like(t):
        return q.new_empty(0, dtype=torch.float32) if t is None else t.new_empty(t.shape, dtype=torch.float32)

    return like(q), like(k), like(v), like(g), like(beta), like(initial_state)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent, op, backend = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.op, ctx.backend = scale, op, backend
    ctx.set_materialize_grads(False)


def _backward(ctx, do, dfinal):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = v.new_zeros(v.shape, dtype=torch.float32)
    dq, dk, dv, dg, db, dh0 = _delta_rule_bwd(do.float().contiguous(),
                                              None if dfinal is None else dfinal.float().contiguous(),
                                              q, k, v, g, beta, initial_state, cu_seqlens, ctx.scale, ctx.op,
                                              ctx.backend)
    dh0 = None if initial_state is None else dh0.to(initial_state.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), dh0, None, None,
            None, None, None)


_delta_rule_fwd.register_autograd(_backward, setup_context=_setup_context)


def _autograd_enabled():
    """A context where autograd records again: a custom op's body runs with the autograd dispatch keys
    excluded, and the torch backend's backward differentiates its recomputed forward."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    keys = ("AutogradCPU", "AutogradCUDA", "AutogradXPU", "AutogradMPS", "AutogradMeta", "AutogradPrivateUse1",
            "AutogradOther", "ADInplaceOrView")  # every device's autograd key, not only the CPU's
    for name in keys:
        if hasattr(torch._C.DispatchKey, name):
            exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def torch_backward(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    """The gradients of the chunked form by autograd through a recomputed forward (states per chunk only):
    fp32 (dq, dk, dv, dg, dbeta, dinitial_state or None)."""
    with _autograd_enabled(), torch.enable_grad():
        return _torch_backward(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale)


def _torch_backward(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale):
    inputs = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    h0 = initial_state.detach().float().requires_grad_() if initial_state is not None else None
    leaves = inputs + ([h0] if h0 is not None else [])
    o, S = run_form(False, *inputs, scale, h0, cu_seqlens)
    outs, gouts = [o], [do]
    if dfinal is not None:
        outs.append(S)
        gouts.append(dfinal)
    grads = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, leaves)]
    return (*grads[:5], grads[5] if h0 is not None else None)


# -- the public entry --------------------------------------------------------------------------------------------
def run_delta_rule(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                   use_qk_l2norm_in_kernel: bool, cu_seqlens: torch.Tensor | None, recurrent: bool,
                   backend: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validated arguments -> (o in ``q.dtype``, final state fp32 or None), on the backend the selector picks."""
    out_dtype = q.dtype
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if use_qk_l2norm_in_kernel:  # elementwise PyTorch around the kernel, differentiated by autograd
        q, k = l2norm(q), l2norm(k)
    B, T, hv, V = v.shape
    if T == 0 or q.shape[-1] == 0 or V == 0:
        o, S = delta_rule_ref(q, k, v, g, beta, scale, initial_state, True, False, cu_seqlens)
        return o.to(out_dtype), (S if output_final_state else None)
    impl, name = dispatch(op, lambda: _call_of(q, v, g, recurrent, cu_seqlens), backend, q, k, v, g, beta,
                          initial_state)
    if impl is not None:
        o, S = impl.forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent)
    else:
        o, S = _delta_rule_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent, op, name)
    return o.to(out_dtype), (S if output_final_state else None)


class DeltaRuleTorchMixin:
    """The ``torch`` backend's methods, shared by both ops: the chunked or recurrent form in PyTorch (fp32),
    the backward by autograd through the chunked form."""

    supports_varlen = True
    description = ("PyTorch: chunked WY/UT form (chunk 64, states between chunks) or the step recurrence; "
                   "backward by autograd through the recomputed chunked form")

    def forward(self, q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent):
        return run_form(recurrent, q, k, v, g, beta, scale, initial_state, cu_seqlens)

    def backward(self, do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale):
        return torch_backward(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale)


class DeltaRuleCppMixin:
    """The ``cpp`` backend's methods, shared by both ops (``csrc/cpu/delta_rule.cpp``): the chunked WY/UT forward
    or the step recurrence; the backward of the chunked algebra for a shared gate (GDN), the exact reverse of the
    recurrence for a per-key gate (KDA); parallel over (sequence, value head).
    q, k, v are read in their dtype (fp32, fp16 or bf16; fp32 when they differ), the gate, beta and the states
    in fp32."""

    extension = "delta_rule"
    supports_varlen = True
    description = ("C++: chunked WY/UT forward (chunk 64, vectorised fp32 micro-GEMMs) or the step recurrence; "
                   "chunked backward (GDN) or reverse recurrence (KDA) from per-chunk states; parallel over "
                   "(sequence, head)")

    @staticmethod
    def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        same = q.dtype == k.dtype == v.dtype
        return [(t if same else t.float()).contiguous() for t in (q, k, v)]

    @staticmethod
    def _rest(g, beta, initial_state, cu_seqlens):
        return (g.float().contiguous(), beta.float().contiguous(),
                None if initial_state is None else initial_state.float().contiguous(),
                None if cu_seqlens is None else cu_seqlens.long().contiguous())

    def forward(self, q, k, v, g, beta, initial_state, cu_seqlens, scale, recurrent):
        o, S = self.lib.delta_rule_fwd(*self._qkv(q, k, v), *self._rest(g, beta, initial_state, cu_seqlens),
                                       float(scale), bool(recurrent))
        return o, S

    def backward(self, do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale):
        dq, dk, dv, dg, db, dh0 = self.lib.delta_rule_bwd(
            do.float().contiguous(), None if dfinal is None else dfinal.float().contiguous(), *self._qkv(q, k, v),
            *self._rest(g, beta, initial_state, cu_seqlens), float(scale))
        B, T, hk, K = q.shape
        r = v.shape[2] // hk
        # the kernel's q/k gradients are per value head: sum the heads sharing a q/k head
        dq, dk = (t.view(B, T, hk, r, K).sum(3) for t in (dq, dk))
        return dq, dk, dv, dg, db, dh0 if initial_state is not None else None
