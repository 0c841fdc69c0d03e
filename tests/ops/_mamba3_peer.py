"""Transcriptions of mamba-ssm's Mamba-3 reference functions (its SISO chunked and step references, its MIMO
step and chunked references), shared by the op and module tests."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TWO_PI = 2 * math.pi


# -- transcriptions of mamba-ssm's reference functions -------------------------------------------------------
def _pair_rotate(t, cos, sin):
    """Rotation of adjacent channel pairs, angles padded with 0 past ``cos.shape[-1]`` pairs."""
    t2 = t.reshape(*t.shape[:-1], -1, 2)
    a, b = t2[..., 0], t2[..., 1]
    if cos.shape[-1] < a.shape[-1]:
        pad = a.shape[-1] - cos.shape[-1]
        cos, sin = F.pad(cos, (0, pad), value=1.0), F.pad(sin, (0, pad), value=0.0)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(t.shape)


def _expand_heads(t, H, dim):
    return t.repeat_interleave(H // t.shape[dim], dim=dim) if t.shape[dim] != H else t


def peer_siso_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, states=None):
    """mamba-ssm's ``mamba3_siso_step_ref``: the recurrence one token at a time."""
    b, L, _, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    Angles = torch.tanh(Angles) * math.pi
    Q, K = _expand_heads(Q, H, 2), _expand_heads(K, H, 2)
    if states is None:
        ang = torch.zeros(b, H, Angles.shape[-1], dtype=Q.dtype)
        S = torch.zeros(b, H, P, N, dtype=Q.dtype)
        ks, vs = torch.zeros(b, H, N, dtype=Q.dtype), torch.zeros(b, H, P, dtype=Q.dtype)
    else:
        ang, S, ks, vs = (s.clone() for s in states)
    outs = []
    for t in range(L):
        q, k, v = Q[:, t] + Q_bias, K[:, t] + K_bias, V[:, t]
        dt = DT[:, :, t]
        ang = ang + Angles[:, t] * dt[..., None]
        ang = ang - TWO_PI * torch.floor(ang / TWO_PI)
        qr, kr = _pair_rotate(q, ang.cos(), ang.sin()), _pair_rotate(k, ang.cos(), ang.sin())
        lam = torch.sigmoid(Trap[:, :, t])
        alpha = torch.exp(ADT[:, :, t])
        beta, gamma = (1 - lam) * dt * alpha, lam * dt
        S = (alpha[..., None, None] * S + beta[..., None, None] * (ks[..., None, :] * vs[..., None])
             + gamma[..., None, None] * (kr[..., None, :] * v[..., None]))
        o = torch.einsum("bhpn,bhn->bhp", S, qr)
        if D is not None:
            o = o + D[None, :, None] * v
        if Z is not None:
            o = o * Z[:, t] * torch.sigmoid(Z[:, t])
        outs.append(o)
        ks, vs = kr, v
    return torch.stack(outs, 1), (ang, S, ks, vs)


def _segsum(x):
    T = x.shape[-1]
    xs = x[..., None].expand(*x.shape, T)
    xs = xs.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), -1), 0).cumsum(-2)
    return xs.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool), 0), -torch.inf)


def peer_siso_fwd_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, states=None):
    """mamba-ssm's ``mamba3_siso_fwd_ref``: per sequence, one quadratic (attention-like) product with the
    shifted trapezoidal weights, the initial state's pending term folded in, and the final states."""
    b, L, _, N = Q.shape
    H = V.shape[2]
    Angles = torch.tanh(Angles) * math.pi
    Q, K = _expand_heads(Q, H, 2), _expand_heads(K, H, 2)
    outs, finals = [], []
    for i in range(b):
        q, k, v, adt, dt = Q[i] + Q_bias, K[i] + K_bias, V[i], ADT[i], DT[i]
        lam = torch.sigmoid(Trap[i])
        cum = torch.cumsum(Angles[i] * dt.T[..., None], 0)
        if states is not None:
            cum = cum + states[0][i][None]
        cum = cum - TWO_PI * torch.floor(cum / TWO_PI)
        if states is not None:
            acc = states[1][i] + states[3][i][:, :, None] * states[2][i][:, None, :] * (dt[:, 0] * (1 - lam[:, 0]))[
                :, None, None]
        else:
            acc = torch.zeros(H, V.shape[3], N, dtype=Q.dtype)
        dt_s, lam_s = F.pad(dt[:, 1:], (0, 1)), F.pad(lam[:, 1:], (0, 1))
        shifted = dt_s * (1 - lam_s)
        scale = dt * lam + shifted
        qk_dot = (k * q).sum(-1) * shifted.T
        qr, kr = _pair_rotate(q, cum.cos(), cum.sin()), _pair_rotate(k, cum.cos(), cum.sin())
        ks = kr * scale.T[..., None]
        att = torch.tril(torch.einsum("thd,shd->hts", qr, ks)) * torch.exp(_segsum(adt))
        o = torch.einsum("hts,shd->thd", att, v)
        if states is not None:
            o = o + torch.einsum("hDd,thd,ht->thD", acc, qr, torch.exp(torch.cumsum(adt, -1)))
        if D is not None:
            o = o + D[None, :, None] * v
        o = o - v * qk_dot[..., None]
        if Z is not None:
            o = o * Z[i] * torch.sigmoid(Z[i])
        outs.append(o)
        rev = torch.exp(adt.sum(-1, keepdim=True) - torch.cumsum(adt, -1))
        S = acc * torch.exp(adt.sum(-1))[:, None, None] + torch.einsum("thd,thD->hDd", ks, v * rev.T[..., None])
        finals.append((cum[-1], S, kr[-1], v[-1]))
    return torch.stack(outs), tuple(torch.stack(f) for f in zip(*finals))


def peer_mimo_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, mimo_v, mimo_o, D=None, Z=None, mimo_z=None,
                       states=None):
    """mamba-ssm's ``mamba3_MIMO_step_ref`` (adjacent-pair rotation, the angle state not wrapped); its V state
    is per rank (``V * mimo_v``)."""
    b, L, R, _, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    Q, K = _expand_heads(Q, H, 3), _expand_heads(K, H, 3)
    qb, kb = Q_bias.transpose(0, 1), K_bias.transpose(0, 1)
    if states is None:
        ang = torch.zeros(b, H, Angles.shape[-1], dtype=Q.dtype)
        S = torch.zeros(b, H, P, N, dtype=Q.dtype)
        ks, vs = torch.zeros(b, H, R, N, dtype=Q.dtype), torch.zeros(b, H, R, P, dtype=Q.dtype)
    else:
        ang, S, ks, vs = (s.clone() for s in states)
    vp = torch.einsum("bthd,hrd->btrhd", V, mimo_v)
    zp = torch.einsum("bthd,hrd->btrhd", Z, mimo_z) if Z is not None else None
    outs = []
    for t in range(L):
        q = (Q[:, t] + qb).permute(0, 2, 1, 3)
        k = (K[:, t] + kb).permute(0, 2, 1, 3)
        v = vp[:, t].permute(0, 2, 1, 3)
        dt = DT[:, :, t]
        lam = torch.sigmoid(Trap[:, :, t])
        ang = ang + torch.tanh(Angles[:, t]) * dt[..., None] * math.pi
        c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
        qr, kr = _pair_rotate(q, c, s), _pair_rotate(k, c, s)
        alpha = torch.exp(ADT[:, :, t])
        beta, gamma = (1 - lam) * dt * alpha, lam * dt
        S = (alpha[..., None, None] * S + beta[..., None, None] * torch.einsum("bhrd,bhrp->bhpd", ks, vs)
             + gamma[..., None, None] * torch.einsum("bhrd,bhrp->bhpd", kr, v))
        o = torch.einsum("bhpd,bhrd->bhrp", S, qr)
        if D is not None:
            o = o + D[None, :, None, None] * v
        if zp is not None:
            z = zp[:, t].permute(0, 2, 1, 3)
            o = o * z * torch.sigmoid(z)
        outs.append(torch.einsum("bhrp,hrp->bhp", o, mimo_o))
        ks, vs = kr, v
    return torch.stack(outs, 1), (ang, S, ks, vs)


def peer_mimo_chunk_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, mimo_v, mimo_o, D, Z, mimo_z, chunk_size,
                        rotary_dim_divisor):
    """mamba-ssm's ``mamba3_MIMO_chunk_ref`` (no initial state): the kernels' rotation, channel i with
    i + N/2 (rotate-half over the first N/4 channels of each half for ``rotary_dim_divisor`` 4), chunked
    quadratic products with a rank-expanded mask."""
    b, L, R, _, N = Q.shape
    H = V.shape[2]
    pad = (chunk_size - L % chunk_size) % chunk_size

    def padded(t, dim):
        shape = list(t.shape)
        shape[dim] = pad
        return torch.cat([t, t.new_zeros(shape)], dim) if pad else t

    theta = torch.cumsum(torch.tanh(Angles) * DT.transpose(1, 2)[..., None] * math.pi, 1)
    dA = ADT
    q, k, v, z, theta = padded(Q, 1), padded(K, 1), padded(V, 1), padded(Z, 1), padded(theta, 1)
    dA, dt, trap = padded(dA, 2), padded(DT, 2), padded(Trap, 2)
    nc = q.shape[1] // chunk_size
    dA_cs = dA.reshape(b, H, nc, chunk_size).cumsum(-1)
    dA_rev = dA_cs[..., -1:] - dA_cs
    q, k = _expand_heads(q, H, 3), _expand_heads(k, H, 3)
    q = q + Q_bias.transpose(0, 1)[None, None]
    k = k + K_bias.transpose(0, 1)[None, None]
    qk_dot = torch.einsum("bsRhd,bsrhd->bsRrh", q, k)
    cos, sin = theta.cos().unsqueeze(2), theta.sin().unsqueeze(2)

    def rot(t):
        if rotary_dim_divisor == 4:
            t4 = t.reshape(*t.shape[:-1], 4, -1)
            a, c = t4[..., 0, :], t4[..., 2, :]
            return torch.stack([a * cos - c * sin, t4[..., 1, :], a * sin + c * cos, t4[..., 3, :]], -2).reshape(
                t.shape)
        t2 = t.reshape(*t.shape[:-1], 2, -1)
        a, c = t2[..., 0, :], t2[..., 1, :]
        return torch.stack([a * cos - c * sin, a * sin + c * cos], -2).reshape(t.shape)

    q, k = rot(q), rot(k)
    lam = torch.sigmoid(trap)
    gamma = dt * lam
    shifted = F.pad(dt[:, :, 1:], (0, 1)) * (1 - F.pad(lam[:, :, 1:], (0, 1)))
    k = torch.einsum("bsrhn,bhs->bsrhn", k, gamma + shifted)
    qk_dot = torch.einsum("bsrRh,bhs->bsrRh", qk_dot, shifted)
    v = torch.einsum("bthd,hrd->btrhd", v, mimo_v)
    seg = dA_cs[..., :, None] - dA_cs[..., None, :]
    seg = seg.masked_fill(~torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool)), -torch.inf)
    mask = torch.kron(seg, torch.ones(R, R, dtype=seg.dtype))

    def rc(t):  # (b, L, r, h, d) -> (b, h, nc, chunk * r, d)
        return t.reshape(b, nc, chunk_size, R, H, -1).permute(0, 4, 1, 2, 3, 5).reshape(b, H, nc, chunk_size * R, -1)

    ksc = rc(k) * torch.exp(dA_rev).repeat_interleave(R, -1)[..., None]
    qq, kk, vv = rc(q), rc(k), rc(v)
    kv = ksc.transpose(-1, -2) @ vv
    cur = torch.zeros_like(kv[:, :, 0])
    for n in range(nc):
        nxt = torch.exp(dA_cs[:, :, n, -1])[..., None, None] * cur + kv[:, :, n]
        kv[:, :, n] = cur
        cur = nxt
    o = (qq * torch.exp(dA_cs.repeat_interleave(R, -1))[..., None]) @ kv + ((qq @ kk.transpose(-1, -2))
                                                                            * torch.exp(mask)) @ vv
    o = o.reshape(b, H, nc * chunk_size, R, -1)
    vt = v.permute(0, 3, 1, 2, 4)  # (b, h, L, r, p)
    o = o - torch.einsum("bhtRr,bhtrp->bhtRp", qk_dot.permute(0, 4, 1, 2, 3), vt)
    o = o + vt * D[None, :, None, None, None]
    zz = torch.einsum("bthd,hrd->bhtrd", z, mimo_z)
    o = o * F.silu(zz)
    out = torch.einsum("bhtrd,hrd->bthd", o, mimo_o)
    return out[:, :L]
