"""Reformer LSH attention with shared query/key: hashing, sorting, chunked attention, multi-round combination.

``lsh_attention(qk, v, n_hashes=4, bucket_size=64, causal=False, ...)`` on ``(B, H, L, D)`` tensors follows
the rule that trax, Hugging Face's Reformer and reformer-pytorch implement:

1. ``n_buckets = max(2, ceil(L / bucket_size))`` rounded up to even; rotations ``R`` are ``(D, n_hashes,
   n_buckets/2)``; in round r, ``bucket = argmax(concat[x R_r, -x R_r])`` with ``x`` the raw qk vector.
2. L is padded to ``Lp`` (a multiple of ``bucket_size``); padded positions get bucket ``n_buckets`` so they
   sort last. Each round sorts positions stably by (bucket, position).
3. The sorted rounds are concatenated (round 0 first) and cut into chunks of ``bucket_size``. A query
   attends the keys of its chunk and of the chunk before it (chunk 0 wraps to the last chunk); duplicates
   are kept. Keys are the unit-normalised qk vectors, scores ``q . k_hat / sqrt(D)``.
4. Masks: causal (key position > query position), padded keys, ``key_padding_mask`` False keys, and the
   query itself unless it has no other valid key in that round.
5. Each round gives ``o_r``, ``lse_r`` per query; the result is ``sum_r o_r softmax_r(lse_r)``. A round
   with no valid key but the query itself weighs nothing; if every round is like that the output is the
   query's own ``v`` (the limit of the large negative self score the reference implementations use).

Backends: ``torch`` (gathers and dense chunk matmuls, as the reference), ``cpp`` (OpenMP, one task per
(batch, head, chunk), reading through the permutation), ``triton`` (one program per (chunk, batch*head)).
All of them return the output and the combined log-sum-exp ``LSE`` (``(B, H, L)`` fp32, ``-inf`` where the
output fell back to the query's own value). The backward only needs ``LSE``: with ``P_ij = exp(s_ij - LSE_i)``
summed over every round's chunk pair, ``ds_ij = P_ij (g_i . v_j - g_i . o_i)`` exactly as in flash attention.
Memory is O(n_hashes * L * bucket_size) for the reference and O(n_hashes * L * D) for the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import choose, register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward

__all__ = ["lsh_attention", "lsh_attention_ref", "lsh_n_buckets", "lsh_hash", "lsh_rotations"]

OP = "lsh_attention"
_NORM_EPS = 1e-12  # as F.normalize


# -- hashing and sorting (shared by every backend; not differentiable) ------------------------------------
# The most hashing rounds a call takes: memory and time grow with n_hashes * L; Reformer uses 1 to 8.
MAX_N_HASHES = 1024


def effective_bucket_size(seq_len: int, bucket_size: int) -> int:
    """``bucket_size`` clamped to ``[1, seq_len]``: every bucket size >= L gives the same two buckets and one
    chunk per round (the same result), and a larger one would only pad L up to it (2**40 asked for terabytes)."""
    return max(1, min(bucket_size, seq_len))


def lsh_n_buckets(seq_len: int, bucket_size: int) -> int:
    """``max(2, ceil(L / bucket_size))`` rounded up to an even number."""
    nb = max(2, -(-seq_len // bucket_size))
    return nb + (nb % 2)


def lsh_rotations(
    head_dim: int, n_hashes: int, n_buckets: int, seed: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Random rotations ``(head_dim, n_hashes, n_buckets // 2)`` fp32, drawn on the CPU from ``seed`` (or from
    torch's default generator when ``seed`` is None) so that every device gets the same numbers."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed))
    r = torch.randn(head_dim, n_hashes, n_buckets // 2, generator=gen, dtype=torch.float32)
    return r.to(device) if device is not None else r


def lsh_hash(qk: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Buckets ``(B, H, n_hashes, L)`` int64: ``argmax(concat[x R, -x R])`` per round, first maximum on ties.

    The projections are computed in fp64 (so near-ties are decided the same way by every backend; the C++
    one computes in fp32 and redoes near-ties in fp64) and without materialising the concatenation:
    ``argmax(p)`` when ``max(p) >= -min(p)``, else ``R2 + argmin(p)``. Rows go in blocks so that memory
    stays bounded.
    """
    B, H, L, D = qk.shape
    NH, R2 = rotations.shape[1], rotations.shape[2]
    x = qk.detach().reshape(B * H * L, D).double()
    rm = rotations.detach().double().reshape(D, NH * R2)
    out = torch.empty(B * H * L, NH, dtype=torch.long, device=qk.device)
    step = max(1, (1 << 22) // (NH * R2))
    for s in range(0, B * H * L, step):
        p = (x[s : s + step] @ rm).view(-1, NH, R2)
        mx, imx = p.max(-1)
        mn, imn = p.min(-1)
        out[s : s + step] = torch.where(mx >= -mn, imx, imn + R2)
    return out.view(B, H, L, NH).permute(0, 1, 3, 2).contiguous()


def _sort(
    buckets: torch.Tensor, seq_len: int, bucket_size: int, n_buckets: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort every round by (bucket, position) after padding to Lp with bucket ``n_buckets``.

    Returns ``perm`` ``(B, H, n_hashes * Lp)`` int64, the original position in each slot of the concatenated
    rounds (positions >= L are padding), and ``inv`` ``(B, H, n_hashes, L)`` int64, the slot of every real
    position in each round.
    """
    B, H, NH, L = buckets.shape
    Lp = -(-L // bucket_size) * bucket_size
    if Lp > L:
        buckets = F.pad(buckets, (0, Lp - L), value=n_buckets)
    pos = torch.arange(Lp, device=buckets.device)
    # (bucket, position) keys are unique, so any sort is the stable one.
    perm = torch.argsort(buckets * Lp + pos, dim=-1)
    inv = torch.empty_like(perm)
    inv.scatter_(-1, perm, pos.expand_as(perm).contiguous())
    inv = inv[..., :L] + (torch.arange(NH, device=buckets.device) * Lp)[:, None]
    return perm.reshape(B, H, NH * Lp), inv


# -- the reference ------------------------------------------------------------------------------------------
def _chunked_ref(
    qk: torch.Tensor,
    v: torch.Tensor,
    perm: torch.Tensor,
    inv: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    bucket_size: int,
    n_hashes: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked attention over the sorted rounds and the combination, in ``dtype`` (fp32 for the reference)
    with torch autograd.

    qk, v ``(B, H, L, D)``; perm ``(B, H, NH*Lp)``; inv ``(B, H, NH, L)``. Returns out ``(B, H, L, D)`` and
    LSE ``(B, H, L)`` in ``dtype`` (``-inf`` where out is the query's own v).
    Memory: the scores are ``(B, H, NH*Lp/bs, bs, 2 bs)``.
    """
    B, H, L, D = qk.shape
    bs = bucket_size
    S = perm.shape[-1]
    C = S // bs
    Lp = S // n_hashes
    q = F.pad(qk.to(dtype), (0, 0, 0, Lp - L))
    vv = F.pad(v.to(dtype), (0, 0, 0, Lp - L))
    # normalised in fp32 (eps 1e-12 is 0 in half precision), then rounded, as the kernels do
    kn = F.normalize(q.float(), p=2.0, dim=-1, eps=_NORM_EPS).to(dtype)
    idx = perm[..., None].expand(B, H, S, D)
    qs = q.gather(2, idx).view(B, H, C, bs, D)
    ks = kn.gather(2, idx).view(B, H, C, bs, D)
    vs = vv.gather(2, idx).view(B, H, C, bs, D)
    qpos = perm.view(B, H, C, bs)

    def look_one_back(x: torch.Tensor) -> torch.Tensor:
        # the previous chunk first (chunk 0 takes the last), then the chunk itself
        return torch.cat([x.roll(1, dims=2), x], dim=3)

    kk, vk, kpos = look_one_back(ks), look_one_back(vs), look_one_back(qpos)
    s = torch.einsum("bhcid,bhcjd->bhcij", qs, kk) * (D**-0.5)
    valid = kpos[:, :, :, None, :] < L
    if key_padding_mask is not None:
        kpm = F.pad(key_padding_mask, (0, Lp - L), value=False)
        kval = kpm[:, None, :].expand(B, H, Lp).gather(2, kpos.reshape(B, H, -1)).view(kpos.shape)
        valid = valid & kval[:, :, :, None, :]
    if causal:
        valid = valid & (kpos[:, :, :, None, :] <= qpos[..., None])
    valid = valid & (kpos[:, :, :, None, :] != qpos[..., None])
    has = valid.any(-1)
    s = s.masked_fill(~valid, float("-inf"))
    m = torch.where(has, s.amax(-1), torch.zeros_like(s[..., 0])).detach()
    e = torch.exp(s - m[..., None])
    z = e.sum(-1)
    zs = torch.where(has, z, torch.ones_like(z))
    o = torch.einsum("bhcij,bhcjd->bhcid", e / zs[..., None], vk)
    lse = torch.where(has, torch.log(zs) + m, torch.full_like(m, float("-inf")))
    # unsort: round r of position i sits in slot inv[r, i]
    flat = inv.reshape(B, H, n_hashes * L)
    o_r = (
        o.reshape(B, H, S, D)
        .gather(2, flat[..., None].expand(B, H, n_hashes * L, D))
        .view(B, H, n_hashes, L, D)
    )
    lse_r = lse.reshape(B, H, S).gather(2, flat).view(B, H, n_hashes, L)
    return _combine_rounds(o_r, lse_r, v.to(dtype))


def _combine_rounds(
    o_r: torch.Tensor, lse_r: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_r o_r softmax_r(lse_r)``; the query's own v where every round is empty.

    o_r ``(B, H, NH, L, D)``, lse_r ``(B, H, NH, L)`` (``-inf`` = empty round), v ``(B, H, L, D)``; fp32.
    """
    anyr = torch.isfinite(lse_r).any(2)
    mx = torch.where(anyr, lse_r.amax(2), torch.zeros_like(lse_r[:, :, 0])).detach()
    ew = torch.exp(lse_r - mx[:, :, None])
    zr = torch.where(anyr, ew.sum(2), torch.ones_like(mx))
    out = ((ew / zr[:, :, None])[..., None] * o_r).sum(2)
    out = torch.where(anyr[..., None], out, v)
    lse = torch.where(anyr, torch.log(zr) + mx, torch.full_like(mx, float("-inf")))
    return out, lse


def lsh_attention_ref(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    n_hashes: int = 4,
    bucket_size: int = 64,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    seed: int | None = None,
    rotations: torch.Tensor | None = None,
    return_buckets: bool = False,
    upcast: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the whole rule in composed PyTorch (fp32), differentiable by torch autograd.

    Same arguments and results as :func:`lsh_attention`. Pass the same ``seed`` or ``rotations`` to get the
    same buckets. ``upcast=False`` computes in the input dtype instead: PyTorch's own low-precision error,
    the baseline of the FlashAttention test criterion (the buckets are the same either way).
    """
    _validate(qk, v, n_hashes, bucket_size, key_padding_mask, rotations)
    bucket_size = effective_bucket_size(qk.shape[-2], bucket_size)
    rotations, buckets, perm, inv = _prepare(qk, n_hashes, bucket_size, seed, rotations)
    dtype = torch.float32 if upcast else qk.dtype
    out, _ = _chunked_ref(qk, v, perm, inv, key_padding_mask, causal, bucket_size, n_hashes, dtype)
    out = out.to(qk.dtype)
    return (out, buckets) if return_buckets else out


# -- validation and preparation ---------------------------------------------------------------------------
def _validate(
    qk: torch.Tensor,
    v: torch.Tensor,
    n_hashes: int,
    bucket_size: int,
    key_padding_mask: torch.Tensor | None,
    rotations: torch.Tensor | None,
) -> None:
    check_tensor(OP, "qk", qk, ndim=4)
    check_tensor(OP, "v", v, ndim=4)
    check_same_device(OP, "qk", qk, v=v)
    check_same_dtype(OP, "qk", qk, v=v)
    if v.shape != qk.shape:
        fail(
            OP,
            f"argument 'v' must have the shape of 'qk' {tuple(qk.shape)} (B, H, L, D), got {tuple(v.shape)}",
        )
    if isinstance(n_hashes, bool) or not isinstance(n_hashes, int) or not 1 <= n_hashes <= MAX_N_HASHES:
        fail(OP, f"argument 'n_hashes' must be an integer in [1, {MAX_N_HASHES}], got {n_hashes!r}")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        fail(OP, f"argument 'bucket_size' must be an integer >= 1, got {bucket_size!r}")
    B, H, L, D = qk.shape
    if key_padding_mask is not None:
        check_tensor(OP, "key_padding_mask", key_padding_mask, dtypes=(torch.bool,), shape=(B, L))
        check_same_device(OP, "qk", qk, key_padding_mask=key_padding_mask)
    if rotations is not None:
        nb = lsh_n_buckets(L, bucket_size)
        check_tensor(OP, "rotations", rotations, dtypes=None, shape=(D, n_hashes, nb // 2))
        if not rotations.is_floating_point():
            fail(OP, f"argument 'rotations' must be floating point, got {rotations.dtype}", TypeError)
        check_same_device(OP, "qk", qk, rotations=rotations)


def _prepare(
    qk: torch.Tensor,
    n_hashes: int,
    bucket_size: int,
    seed: int | None,
    rotations: torch.Tensor | None,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotations, buckets ``(B, H, NH, L)``, perm, inv) — hashing and sorting, not differentiable.

    Every backend gives identical buckets (fp64-exact projections, see :func:`lsh_hash`) and the sort by
    unique (bucket, position) keys has one result, so the backend only changes the speed.
    """
    L, D = qk.shape[-2], qk.shape[-1]
    nb = lsh_n_buckets(L, bucket_size)
    if rotations is None:
        rotations = _draw_rotations(D, n_hashes, nb, None if seed is None else int(seed), qk.device)
    buckets, perm, inv = _lsh_prepare(qk.detach(), rotations.detach(), int(bucket_size), backend)
    return rotations, buckets, perm, inv


# A custom op so that torch.compile traces calls with a seed (a torch.Generator cannot be created inside a
# graph) and keeps unseeded draws apart (tagged nondeterministic: never merged or reordered).
@torch.library.custom_op(
    "fastarch::lsh_rotations", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _draw_rotations(
    head_dim: int, n_hashes: int, n_buckets: int, seed: int | None, device: torch.device
) -> torch.Tensor:
    return lsh_rotations(head_dim, n_hashes, n_buckets, seed, device)


@_draw_rotations.register_fake
def _(head_dim, n_hashes, n_buckets, seed, device):
    return torch.empty(head_dim, n_hashes, n_buckets // 2, dtype=torch.float32, device=device)


@torch.library.custom_op("fastarch::lsh_attention_prepare", mutates_args=())
def _lsh_prepare(
    qk: torch.Tensor, rotations: torch.Tensor, bucket_size: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    L = qk.shape[-2]
    impl = choose(OP, _call(qk, bucket_size, False), backend)
    buckets = impl.hash(qk, rotations)
    perm, inv = impl.sort(buckets, L, bucket_size, lsh_n_buckets(L, bucket_size))
    return buckets, perm, inv


@_lsh_prepare.register_fake
def _(qk, rotations, bucket_size, backend):
    B, H, L, _ = qk.shape
    NH = rotations.shape[1]
    Lp = -(-L // bucket_size) * bucket_size
    long = dict(dtype=torch.long, device=qk.device)
    return (
        qk.new_empty(B, H, NH, L, **long),
        qk.new_empty(B, H, NH * Lp, **long),
        qk.new_empty(B, H, NH, L, **long),
    )


# -- the custom ops ---------------------------------------------------------------------------------------
def _call(qk: torch.Tensor, bucket_size: int, causal: bool):
    return call_of(qk, head_dim=qk.shape[-1], bucket_size=bucket_size, causal=causal)


@torch.library.custom_op("fastarch::lsh_attention_fwd", mutates_args=())
def _lsh_fwd(
    qk: torch.Tensor, v: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor,
    key_padding_mask: torch.Tensor | None, causal: bool, bucket_size: int, n_hashes: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = run(OP, "forward", _call(qk, bucket_size, causal), backend, qk.contiguous(), v.contiguous(), perm,
                   inv, key_padding_mask, causal, bucket_size, n_hashes)
    return out.to(qk.dtype), lse


@_lsh_fwd.register_fake
def _(qk, v, perm, inv, key_padding_mask, causal, bucket_size, n_hashes, backend):
    return torch.empty_like(qk), qk.new_empty(qk.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fastarch::lsh_attention_bwd", mutates_args=())
def _lsh_bwd(
    dout: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    perm: torch.Tensor, inv: torch.Tensor, key_padding_mask: torch.Tensor | None, causal: bool,
    bucket_size: int, n_hashes: int, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    dqk, dv = run_backward(OP, _call(qk, bucket_size, causal), backend, dout.contiguous(), qk.contiguous(),
                           v.contiguous(), out.contiguous(), lse, perm, inv, key_padding_mask, causal,
                           bucket_size, n_hashes)
    return dqk.to(qk.dtype), dv.to(v.dtype)


@_lsh_bwd.register_fake
def _(dout, qk, v, out, lse, perm, inv, key_padding_mask, causal, bucket_size, n_hashes, backend):
    return torch.empty_like(qk), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    qk, v, perm, inv, kpm, causal, bucket_size, n_hashes, backend = inputs
    out, lse = output
    ctx.save_for_backward(qk, v, out, lse, perm, inv, kpm)
    ctx.args = (causal, bucket_size, n_hashes, backend)


def _backward(ctx, dout, _dlse):
    qk, v, out, lse, perm, inv, kpm = ctx.saved_tensors
    dqk, dv = _lsh_bwd(dout, qk, v, out, lse, perm, inv, kpm, *ctx.args)
    return dqk, dv, None, None, None, None, None, None, None


_lsh_fwd.register_autograd(_backward, setup_context=_setup_context)


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    n_hashes: int = 4,
    bucket_size: int = 64,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    seed: int | None = None,
    rotations: torch.Tensor | None = None,
    return_buckets: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reformer LSH attention with shared query/key (see the module docstring for the exact rule).

    Args:
        qk: ``(B, H, L, D)`` shared queries/keys (keys are ``qk`` normalised to unit length).
        v: ``(B, H, L, D)`` values.
        n_hashes: hashing rounds (1 to :data:`MAX_N_HASHES`). bucket_size: chunk length (>= 1; clamped to L,
            which leaves the result unchanged).
        causal: mask keys at later positions. key_padding_mask: ``(B, L)`` bool, True = real key.
        seed: draws the rotations ``(D, n_hashes, n_buckets/2)``; ``rotations`` passes them instead.
        return_buckets: also return the buckets ``(B, H, n_hashes, L)`` int64 of the real positions.
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The output in qk's dtype, or ``(output, buckets)``. Differentiable w.r.t. ``qk`` and ``v``.

    Shapes:
        qk, v, output: ``(B, H, L, D)``; key_padding_mask: ``(B, L)``;
        rotations: ``(D, n_hashes, n_buckets // 2)``; buckets: ``(B, H, n_hashes, L)``.
    """
    _validate(qk, v, n_hashes, bucket_size, key_padding_mask, rotations)
    bucket_size = effective_bucket_size(qk.shape[-2], bucket_size)
    name = resolve(OP, lambda: _call(qk, bucket_size, bool(causal)), backend)
    _, buckets, perm, inv = _prepare(qk, n_hashes, bucket_size, seed, rotations, name)
    if qk.numel() == 0:
        out = torch.zeros_like(qk) + 0 * v
    else:
        kpm = key_padding_mask.contiguous() if key_padding_mask is not None else None
        out, _ = _lsh_fwd(
            qk, v, perm, inv, kpm, bool(causal), int(bucket_size), int(n_hashes), name
        )
    return (out, buckets) if return_buckets else out


# -- backends ---------------------------------------------------------------------------------------------
class TorchLSHAttention(TorchImplementation):
    op = OP
    description = "gathers and dense chunk matmuls in fp32; analytic backward on the recomputed chunks"

    def hash(self, qk, rotations):
        return lsh_hash(qk, rotations)

    def sort(self, buckets, seq_len, bucket_size, n_buckets):
        return _sort(buckets, seq_len, bucket_size, n_buckets)

    def forward(self, qk, v, perm, inv, kpm, causal, bucket_size, n_hashes):
        out, lse = _chunked_ref(qk, v, perm, inv, kpm, causal, bucket_size, n_hashes)
        return out.to(qk.dtype), lse

    def backward(self, dout, qk, v, out, lse, perm, inv, kpm, causal, bucket_size, n_hashes):
        # Autograd is off inside a custom op, so this is the analytic backward on the dense chunks.
        B, H, L, D = qk.shape
        bs, S = bucket_size, perm.shape[-1]
        C, Lp = S // bs, S // n_hashes
        q, vf = qk.float(), v.float()
        kn = F.normalize(q, p=2.0, dim=-1, eps=_NORM_EPS)
        g = dout.float()
        pad = (0, 0, 0, Lp - L)
        idx = perm[..., None].expand(B, H, S, D)

        def gather(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, pad).gather(2, idx).view(B, H, C, bs, D)

        qs, ks, vs, gs = gather(q), gather(kn), gather(vf), gather(g)
        qpos = perm.view(B, H, C, bs)
        lse_s = F.pad(lse, (0, Lp - L), value=float("-inf")).gather(2, perm).view(B, H, C, bs)
        delta = F.pad((g * out.float()).sum(-1), (0, Lp - L)).gather(2, perm).view(B, H, C, bs)

        def look_one_back(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.roll(1, dims=2), x], dim=3)

        kk, vk, kpos = look_one_back(ks), look_one_back(vs), look_one_back(qpos)
        scale = D**-0.5
        s = torch.einsum("bhcid,bhcjd->bhcij", qs, kk) * scale
        valid = (kpos[:, :, :, None, :] < L) & (kpos[:, :, :, None, :] != qpos[..., None])
        if kpm is not None:
            kp = F.pad(kpm, (0, Lp - L), value=False)[:, None, :].expand(B, H, Lp)
            valid = valid & kp.gather(2, kpos.reshape(B, H, -1)).view(kpos.shape)[:, :, :, None, :]
        if causal:
            valid = valid & (kpos[:, :, :, None, :] <= qpos[..., None])
        valid = valid & torch.isfinite(lse_s)[..., None]
        p = torch.where(valid, torch.exp(s - torch.where(torch.isfinite(lse_s), lse_s, 0.0)[..., None]), 0.0)
        dvk = torch.einsum("bhcij,bhcid->bhcjd", p, gs)
        ds = p * (torch.einsum("bhcid,bhcjd->bhcij", gs, vk) - delta[..., None]) * scale
        dq_s = torch.einsum("bhcij,bhcjd->bhcid", ds, kk)
        dkk = torch.einsum("bhcij,bhcid->bhcjd", ds, qs)

        def fold(x: torch.Tensor) -> torch.Tensor:
            # keys [0, bs) of chunk c belong to chunk c-1, keys [bs, 2bs) to chunk c
            return (x[:, :, :, bs:] + x[:, :, :, :bs].roll(-1, dims=2)).reshape(B, H, S, D)

        def unsort(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(B, H, Lp, D).scatter_add_(2, idx, x.reshape(B, H, S, D))[:, :, :L]

        dq, dkn, dv = unsort(dq_s), unsort(fold(dkk)), unsort(fold(dvk))
        # every round fell back to the query's own value: out_i = v_i
        dv = dv + torch.where(torch.isinf(lse)[..., None], g, 0.0)
        return dq + _normalize_bwd(q, dkn), dv


def _normalize_bwd(qk: torch.Tensor, dkn: torch.Tensor) -> torch.Tensor:
    """Gradient through ``k_hat = x / max(|x|, eps)``: ``(dk - k_hat (k_hat . dk)) / |x|`` (fp32)."""
    x = qk.float()
    n = x.norm(dim=-1, keepdim=True)
    ns = n.clamp_min(_NORM_EPS)
    kh = x / ns
    proj = torch.where(n > _NORM_EPS, (kh * dkn).sum(-1, keepdim=True), torch.zeros_like(n))
    return (dkn - kh * proj) / ns


class CppLSHAttention(CppImplementation):
    op, extension = OP, "lsh_attention"
    description = "C++ OpenMP kernel per (batch, head, chunk), reading through the permutation, fp32"

    def hash(self, qk, rotations):
        return self.lib.lsh_hash(qk.detach().float().contiguous(), rotations.float().contiguous())

    def sort(self, buckets, seq_len, bucket_size, n_buckets):
        # a stable counting sort by bucket, O(L) per round
        return tuple(self.lib.lsh_sort(buckets.contiguous(), bucket_size, n_buckets))

    def forward(self, qk, v, perm, inv, kpm, causal, bucket_size, n_hashes):
        # the kernel normalises the keys itself (as F.normalize) while it packs them
        out, lse = self.lib.lsh_attention_fwd(
            qk.float().contiguous(),
            v.float().contiguous(),
            perm.contiguous(),
            inv.contiguous(),
            kpm,
            causal,
            bucket_size,
        )
        return out.to(qk.dtype), lse

    def backward(self, dout, qk, v, out, lse, perm, inv, kpm, causal, bucket_size, n_hashes):
        q, vf = qk.float().contiguous(), v.float().contiguous()
        dq, dkn, dv = self.lib.lsh_attention_bwd(
            dout.float().contiguous(),
            q,
            vf,
            out.float().contiguous(),
            lse,
            perm.contiguous(),
            inv.contiguous(),
            kpm,
            causal,
            bucket_size,
        )
        return dq + _normalize_bwd(q, dkn), dv


class TritonLSHAttention(TritonImplementation):
    op, kernel_module = OP, "lsh_attention"
    max_head_dim = 256  # a tile row holds the whole head dim; any bucket size fits
    description = (
        "Triton flash-style chunk kernels through the permutation (online softmax over key blocks; "
        "dQ and dK/dV kernels), fp32 accumulation"
    )

    def hash(self, qk, rotations):
        return lsh_hash(qk, rotations)

    def sort(self, buckets, seq_len, bucket_size, n_buckets):
        return _sort(buckets, seq_len, bucket_size, n_buckets)

    def forward(self, qk, v, perm, inv, kpm, causal, bucket_size, n_hashes):
        # the kernels read qk/v in their own dtype and normalise the keys as they load them
        o_s, lse_s = self.lib.lsh_attention_chunk_fwd(qk, v, perm, kpm, causal, bucket_size)
        B, H, L, D = qk.shape
        flat = inv.reshape(B, H, n_hashes * L)
        o_r = o_s.gather(2, flat[..., None].expand(B, H, n_hashes * L, D)).view(B, H, n_hashes, L, D)
        lse_r = lse_s.gather(2, flat).view(B, H, n_hashes, L)
        out, lse = _combine_rounds(o_r, lse_r, v.float())
        return out.to(qk.dtype), lse

    def backward(self, dout, qk, v, out, lse, perm, inv, kpm, causal, bucket_size, n_hashes):
        delta = (dout.float() * out.float()).sum(-1).contiguous()
        g = dout.to(qk.dtype).contiguous()
        dq, dkn, dv = self.lib.lsh_attention_chunk_bwd(
            g, qk, v, lse.contiguous(), delta, perm, inv, kpm, causal, bucket_size
        )
        # every round fell back to the query's own value: out_i = v_i
        dv = dv + torch.where(torch.isinf(lse)[..., None], dout.float(), 0.0)
        return dq + _normalize_bwd(qk, dkn), dv


for _impl in (TorchLSHAttention, CppLSHAttention, TritonLSHAttention):
    register(_impl)
