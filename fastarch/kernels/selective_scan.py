"""Triton kernels for the selective scan (forward and backward), its decode step (``selective_state_update``)
and their launchers.

One program owns a (batch, block of channels) pair and keeps the state tile ``h`` (BLOCK_D x BLOCK_N) in
registers while it walks time. The forward stores the state only at chunk boundaries (``ckpt``, every
``CHUNK`` steps). The backward walks the chunks from last to first: it re-runs the forward of one chunk from
its checkpoint into a per-program scratch tile (CHUNK+1 states, independent of L), then walks that chunk
backward. Variable B/C gradients from several channel blocks meet in the same (batch, group, t) rows, so
they are accumulated with atomics (one reduced row per step when a block lies inside one group).

Layouts match the C++ backend: constant B/C are ``(D, N)``, variable ones ``(batch, G, L, N)`` (time-major),
``u``/``delta``/``z`` ``(batch, D, L)`` in any float dtype (upcast to fp32 in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # log1p(exp(x)) accurately for small exp(x): log(w) * e / (w - 1) with w = 1 + e.
    e = tl.exp(x)
    w = 1.0 + e
    lp = tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(x <= 20.0, lp, x)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _ss_fwd_kernel(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, out_ptr, last_ptr, ckpt_ptr,
                   dim, L, N, nck, GB, GC,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   VAR_B: tl.constexpr, VAR_C: tl.constexpr, SAVE_CKPT: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < dim
    m2 = md[:, None] & (offs_n < N)[None, :]
    dn = offs_d[:, None] * N + offs_n[None, :]
    A = tl.load(A_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    if VAR_B:
        b_rows = B_ptr + ((b * GB + offs_d // (dim // GB)) * L)[:, None] * N + offs_n[None, :]
        Bt = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    else:
        Bt = tl.load(B_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    if VAR_C:
        c_rows = C_ptr + ((b * GC + offs_d // (dim // GC)) * L)[:, None] * N + offs_n[None, :]
        Ct = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    else:
        Ct = tl.load(C_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    Dv = tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32) if HAS_D else tl.zeros([BLOCK_D], tl.float32)
    bias = tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros(
        [BLOCK_D], tl.float32)
    row = (b * dim + offs_d) * L
    ck = ((b * dim + offs_d) * nck)[:, None] * N + offs_n[None, :]
    h = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    for t in range(0, L):
        if SAVE_CKPT:
            if t % CHUNK == 0:
                tl.store(ckpt_ptr + ck + (t // CHUNK) * N, h, mask=m2)
        uv = tl.load(u_ptr + row + t, mask=md, other=0.0).to(tl.float32)
        dv = tl.load(dt_ptr + row + t, mask=md, other=0.0).to(tl.float32) + bias
        if SOFTPLUS:
            dv = _softplus(dv)
        if VAR_B:
            Bt = tl.load(b_rows + t * N, mask=m2, other=0.0).to(tl.float32)
        if VAR_C:
            Ct = tl.load(c_rows + t * N, mask=m2, other=0.0).to(tl.float32)
        h = tl.exp(dv[:, None] * A) * h + (dv * uv)[:, None] * Bt
        y = tl.sum(h * Ct, axis=1) + Dv * uv
        if HAS_Z:
            zv = tl.load(z_ptr + row + t, mask=md, other=0.0).to(tl.float32)
            y = y * zv * _sigmoid(zv)
        tl.store(out_ptr + row + t, y, mask=md)
    tl.store(last_ptr + (b * dim + offs_d)[:, None] * N + offs_n[None, :], h, mask=m2)


@triton.jit
def _ss_bwd_kernel(dout_ptr, dlast_ptr, u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, ckpt_ptr,
                   scratch_ptr, du_ptr, ddt_ptr, dz_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dbias_ptr,
                   dim, L, N, nck, GB, GC,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   VAR_B: tl.constexpr, VAR_C: tl.constexpr, HAS_DLAST: tl.constexpr,
                   B_ONE_GROUP: tl.constexpr, C_ONE_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md = offs_d < dim
    mn = offs_n < N
    m2 = md[:, None] & mn[None, :]
    dn = offs_d[:, None] * N + offs_n[None, :]
    bdn = (b * dim + offs_d)[:, None] * N + offs_n[None, :]
    A = tl.load(A_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    if VAR_B:
        gb = offs_d // (dim // GB)
        b_rows = ((b * GB + gb) * L)[:, None] * N + offs_n[None, :]
        b_row0 = (b * GB + (pid_d * BLOCK_D) // (dim // GB)) * L * N + offs_n
        Bt = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    else:
        Bt = tl.load(B_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    if VAR_C:
        gc = offs_d // (dim // GC)
        c_rows = ((b * GC + gc) * L)[:, None] * N + offs_n[None, :]
        c_row0 = (b * GC + (pid_d * BLOCK_D) // (dim // GC)) * L * N + offs_n
        Ct = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    else:
        Ct = tl.load(C_ptr + dn, mask=m2, other=0.0).to(tl.float32)
    Dv = tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32) if HAS_D else tl.zeros([BLOCK_D], tl.float32)
    bias = tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros(
        [BLOCK_D], tl.float32)
    row = (b * dim + offs_d) * L
    ck = ((b * dim + offs_d) * nck)[:, None] * N + offs_n[None, :]
    tile = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + offs_n[None, :]
    scratch = scratch_ptr + (b * tl.num_programs(1) + pid_d) * (CHUNK + 1) * BLOCK_D * BLOCK_N + tile
    if HAS_DLAST:
        dh = tl.load(dlast_ptr + bdn, mask=m2, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dA_acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dB_acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dC_acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dD_acc = tl.zeros([BLOCK_D], tl.float32)
    db_acc = tl.zeros([BLOCK_D], tl.float32)
    for kk in range(0, nck):
        k = nck - 1 - kk
        t0 = k * CHUNK
        tlen = tl.minimum(CHUNK, L - t0)
        # Re-run this chunk forward from its checkpoint, keeping every state in the scratch tile.
        h = tl.load(ckpt_ptr + ck + k * N, mask=m2, other=0.0)
        tl.store(scratch, h)
        for i in range(0, tlen):
            t = t0 + i
            uv = tl.load(u_ptr + row + t, mask=md, other=0.0).to(tl.float32)
            dv = tl.load(dt_ptr + row + t, mask=md, other=0.0).to(tl.float32) + bias
            if SOFTPLUS:
                dv = _softplus(dv)
            if VAR_B:
                Bt = tl.load(B_ptr + b_rows + t * N, mask=m2, other=0.0).to(tl.float32)
            h = tl.exp(dv[:, None] * A) * h + (dv * uv)[:, None] * Bt
            tl.store(scratch + (i + 1) * BLOCK_D * BLOCK_N, h)
        tl.debug_barrier()
        for j in range(0, tlen):
            i = tlen - 1 - j
            t = t0 + i
            uv = tl.load(u_ptr + row + t, mask=md, other=0.0).to(tl.float32)
            pre = tl.load(dt_ptr + row + t, mask=md, other=0.0).to(tl.float32) + bias
            if SOFTPLUS:
                dv = _softplus(pre)
                dsp = tl.where(pre <= 20.0, _sigmoid(pre), 1.0)
            else:
                dv = pre
                dsp = tl.full([BLOCK_D], 1.0, tl.float32)
            if VAR_B:
                Bt = tl.load(B_ptr + b_rows + t * N, mask=m2, other=0.0).to(tl.float32)
            if VAR_C:
                Ct = tl.load(C_ptr + c_rows + t * N, mask=m2, other=0.0).to(tl.float32)
            hcur = tl.load(scratch + (i + 1) * BLOCK_D * BLOCK_N)
            hprev = tl.load(scratch + i * BLOCK_D * BLOCK_N)
            g = tl.load(dout_ptr + row + t, mask=md, other=0.0).to(tl.float32)
            if HAS_Z:
                zv = tl.load(z_ptr + row + t, mask=md, other=0.0).to(tl.float32)
                sz = _sigmoid(zv)
                y = tl.sum(hcur * Ct, axis=1) + Dv * uv
                tl.store(dz_ptr + row + t, g * y * sz * (1.0 + zv * (1.0 - sz)), mask=md)
                g = g * zv * sz
            dD_acc += g * uv
            duv = g * Dv
            dh += g[:, None] * Ct
            dCc = g[:, None] * hcur
            if VAR_C:
                if C_ONE_GROUP:
                    tl.atomic_add(dC_ptr + c_row0 + t * N, tl.sum(dCc, axis=0), mask=mn)
                else:
                    tl.atomic_add(dC_ptr + c_rows + t * N, dCc, mask=m2)
            else:
                dC_acc += dCc
            e = tl.exp(dv[:, None] * A)
            hp_e = hprev * e
            dA_acc += dh * hp_e * dv[:, None]
            ddt = tl.sum(dh * (hp_e * A + uv[:, None] * Bt), axis=1)
            duv += dv * tl.sum(dh * Bt, axis=1)
            dBc = dh * (dv * uv)[:, None]
            if VAR_B:
                if B_ONE_GROUP:
                    tl.atomic_add(dB_ptr + b_row0 + t * N, tl.sum(dBc, axis=0), mask=mn)
                else:
                    tl.atomic_add(dB_ptr + b_rows + t * N, dBc, mask=m2)
            else:
                dB_acc += dBc
            dh = dh * e
            dd = ddt * dsp
            db_acc += dd
            tl.store(du_ptr + row + t, duv, mask=md)
            tl.store(ddt_ptr + row + t, dd, mask=md)
        tl.debug_barrier()
    # Per-batch rows of the per-channel gradients; the launcher sums over batch.
    tl.store(dA_ptr + bdn, dA_acc, mask=m2)
    if not VAR_B:
        tl.store(dB_ptr + bdn, dB_acc, mask=m2)
    if not VAR_C:
        tl.store(dC_ptr + bdn, dC_acc, mask=m2)
    tl.store(dD_ptr + b * dim + offs_d, dD_acc, mask=md)
    tl.store(dbias_ptr + b * dim + offs_d, db_acc, mask=md)


def _bc(M: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Constant (D, N) as is; variable (B, N, L) / (B, G, N, L) -> (B, G, L, N) contiguous."""
    if M.dim() == 2:
        return M.contiguous(), 0
    if M.dim() == 3:
        M = M[:, None]
    return M.transpose(-1, -2).contiguous(), M.shape[1]


def _blocks(dim: int, n: int) -> tuple[int, int]:
    block_n = max(triton.next_power_of_2(n), 2)
    block_d = max(2, min(32, triton.next_power_of_2(dim), max(2, 2048 // block_n)))
    return block_d, block_n


def _dummy(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(1, dtype=torch.float32)


def selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, softplus: bool, need_ckpt: bool, chunk: int):
    """Returns (out in u.dtype (B, D, L), last_state fp32 (B, D, N), ckpt fp32 (B, D, n_chunks, N) or empty)."""
    batch, dim, L = u.shape
    n = A.shape[1]
    nck = triton.cdiv(L, chunk)
    u, delta, A = u.contiguous(), delta.contiguous(), A.contiguous()
    Bk, gb = _bc(B)
    Ck, gc = _bc(C)
    out = torch.empty(batch, dim, L, device=u.device, dtype=torch.float32)
    last = torch.empty(batch, dim, n, device=u.device, dtype=torch.float32)
    ckpt = torch.empty((batch, dim, nck, n) if need_ckpt else (0,), device=u.device, dtype=torch.float32)
    block_d, block_n = _blocks(dim, n)
    grid = (batch, triton.cdiv(dim, block_d))
    dm = _dummy(u)
    _ss_fwd_kernel[grid](
        u, delta, A, Bk, Ck, D.contiguous() if D is not None else dm, z.contiguous() if z is not None else dm,
        delta_bias.contiguous() if delta_bias is not None else dm, out, last, ckpt if need_ckpt else dm,
        dim, L, n, nck, gb, gc,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus),
        VAR_B=gb > 0, VAR_C=gc > 0, SAVE_CKPT=need_ckpt, CHUNK=chunk, BLOCK_D=block_d, BLOCK_N=block_n)
    return out.to(u.dtype), last, ckpt


def selective_scan_bwd(dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, softplus: bool, chunk: int):
    """fp32 gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias) in the inputs' shapes (None if absent)."""
    batch, dim, L = u.shape
    n = A.shape[1]
    nck = triton.cdiv(L, chunk)
    dev = u.device
    u, delta, A, dout = u.contiguous(), delta.contiguous(), A.contiguous(), dout.contiguous()
    Bk, gb = _bc(B)
    Ck, gc = _bc(C)
    block_d, block_n = _blocks(dim, n)
    nblk = triton.cdiv(dim, block_d)
    f32 = dict(device=dev, dtype=torch.float32)
    scratch = torch.empty(batch * nblk * (chunk + 1) * block_d * block_n, **f32)
    du = torch.empty(batch, dim, L, **f32)
    ddt = torch.empty(batch, dim, L, **f32)
    dz = torch.empty(batch, dim, L, **f32) if z is not None else None
    dA = torch.empty(batch, dim, n, **f32)
    dB = torch.zeros(Bk.shape, **f32) if gb else torch.empty(batch, dim, n, **f32)
    dC = torch.zeros(Ck.shape, **f32) if gc else torch.empty(batch, dim, n, **f32)
    dD = torch.empty(batch, dim, **f32)
    dbias = torch.empty(batch, dim, **f32)
    dm = _dummy(u)
    _ss_bwd_kernel[(batch, nblk)](
        dout, dlast.contiguous() if dlast is not None else dm, u, delta, A, Bk, Ck,
        D.contiguous() if D is not None else dm, z.contiguous() if z is not None else dm,
        delta_bias.contiguous() if delta_bias is not None else dm, ckpt.contiguous(), scratch,
        du, ddt, dz if dz is not None else dm, dA, dB, dC, dD, dbias,
        dim, L, n, nck, gb, gc,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=bool(softplus),
        VAR_B=gb > 0, VAR_C=gc > 0, HAS_DLAST=dlast is not None,
        B_ONE_GROUP=gb > 0 and (dim // gb) % block_d == 0, C_ONE_GROUP=gc > 0 and (dim // gc) % block_d == 0,
        CHUNK=chunk, BLOCK_D=block_d, BLOCK_N=block_n)

    def back(g, M):
        if M.dim() == 2:
            return g.sum(0)
        g = g.transpose(-1, -2)
        return g[:, 0] if M.dim() == 3 else g

    return (du, ddt, dA.sum(0), back(dB, B), back(dC, C), dD.sum(0) if D is not None else None, dz,
            dbias.sum(0) if delta_bias is not None else None)


# -- selective_state_update: one decode step --------------------------------------------------------------
@triton.jit
def _ssu_kernel(state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, idx_ptr, out_ptr,
                nheads, P, N, GB, GC,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                HAS_IDX: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Program (batch * nheads + head, channel block): the (BLOCK_P, BLOCK_N) state tile is read, updated and
    # written back once; every array is contiguous in the heads form (see the launcher).
    bh = tl.program_id(0)
    b = bh // nheads
    h = bh % nheads
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    m2 = mp[:, None] & mn[None, :]
    hp = h * P + offs_p  # (head, channel) index into A / D / dt_bias
    row = bh * P + offs_p  # (batch, head, channel) index into x / dt / z / out
    # With state_batch_indices the state row is state[idx[b]]; a negative index is a padding row (out 0).
    sb = tl.load(idx_ptr + b) if HAS_IDX else b
    live = (offs_p * 0 + sb) >= 0  # (BLOCK_P,), all equal
    m2 = m2 & live[:, None]
    st_ptrs = state_ptr + ((sb * nheads + h) * P + offs_p)[:, None] * N + offs_n[None, :]
    st = tl.load(st_ptrs, mask=m2, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + hp[:, None] * N + offs_n[None, :], mask=m2, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + (b * GB + h // (nheads // GB)) * N + offs_n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + (b * GC + h // (nheads // GC)) * N + offs_n, mask=mn, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + row, mask=mp, other=0.0).to(tl.float32)
    dv = tl.load(dt_ptr + row, mask=mp, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dv += tl.load(bias_ptr + hp, mask=mp, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dv = _softplus(dv)
    st = st * tl.exp(dv[:, None] * A) + (dv * xv)[:, None] * Bv[None, :]
    tl.store(st_ptrs, st, mask=m2)
    y = tl.sum(st * Cv[None, :], axis=1)
    if HAS_D:
        y += xv * tl.load(D_ptr + hp, mask=mp, other=0.0).to(tl.float32)
    if HAS_Z:
        zv = tl.load(z_ptr + row, mask=mp, other=0.0).to(tl.float32)
        y = y * zv * _sigmoid(zv)
    tl.store(out_ptr + row, tl.where(live, y, 0.0), mask=mp)


def selective_state_update_fwd(state, x, dt, A, B, C, D, z, dt_bias, softplus: bool,
                               state_batch_indices=None) -> torch.Tensor:
    """Heads form, contiguous: state (batch_state, H, P, N) updated in place; x/dt/z (batch, H, P); A (H, P, N);
    B/C (batch, G, N); D/dt_bias (H, P); state_batch_indices (batch,) int64 or None (validated by the caller).
    Returns out (batch, H, P) fp32."""
    batch, nheads, P = x.shape
    N = state.shape[-1]
    out = torch.empty(batch, nheads, P, device=state.device, dtype=torch.float32)
    block_n = max(triton.next_power_of_2(N), 2)
    block_p = max(2, min(triton.next_power_of_2(P), max(2, 4096 // block_n)))
    dm = _dummy(state)
    grid = (batch * nheads, triton.cdiv(P, block_p))
    _ssu_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else dm, z if z is not None else dm,
        dt_bias if dt_bias is not None else dm, state_batch_indices if state_batch_indices is not None else dm,
        out, nheads, P, N, B.shape[1], C.shape[1],
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(softplus),
        HAS_IDX=state_batch_indices is not None,
        BLOCK_P=block_p, BLOCK_N=block_n)
    return out
