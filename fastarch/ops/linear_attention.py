"""Kernelised ("linear") attention on feature maps, as in Performer / FAVOR+ and "Transformers are RNNs".

``linear_attention(q_features, k_features, v, causal, eps)`` takes feature-mapped queries and keys
``phi(q)``, ``phi(k)`` (``(B, H, L, m)``, normally positive) and values ``v`` (``(B, H, L, D)``):

- non-causal: ``out = phi_q (phi_k^T v) / (phi_q . sum_j phi_k_j + eps)``: two matmuls, O(L m D);
- causal: ``out_i = (phi_q_i . S_i) / (phi_q_i . z_i + eps)`` with the prefix sums
  ``S_i = sum_{j<=i} phi_k_j v_j^T`` (``(m, D)``) and ``z_i = sum_{j<=i} phi_k_j`` (``(m,)``).

The causal case is a custom op with chunked kernels (C++ and Triton, forward and backward): the sequence
is cut into chunks of C rows; inside a chunk a masked ``C x C`` matmul handles the local terms, and a
running ``(m, D)`` state carries the earlier chunks, so time is O(L m D) and state memory O(m D) per
(batch, head) -- the (L, m, D) tensor of the naive cumsum formulation is never formed.

The normaliser rides along as one extra value column of ones: with ``v' = [v, 1]`` the kernels compute
the unnormalised causal product ``y = tril(phi_q phi_k^T) v'``, whose last column is the denominator. The
backward is the unnormalised backward with the upstream gradient ``g' = [g / den, -(g . out) / den]``.
Backward of the kernels, chunked the same way: dQ runs the state forward, dK/dV run a state
``R = sum_{i in later chunks} phi_q_i g'_i^T`` in reverse.
"""

from __future__ import annotations

import torch

from ..backend import Call, register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_same_dtype, check_tensor, fail
from ._dispatch import call_of, resolve, run, run_backward

__all__ = ["linear_attention", "linear_attention_ref"]

OP = "linear_attention"


def linear_attention_ref(
    q_features: torch.Tensor, k_features: torch.Tensor, v: torch.Tensor, causal: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """The oracle: the dense (L x L) kernel matrix in fp32, ``tril`` when causal, divided by its row sums.

    Shapes: ``q_features`` (B, H, Lq, m), ``k_features`` (B, H, Lk, m), ``v`` (B, H, Lk, D) -> (B, H, Lq, D).
    """
    a = q_features.float() @ k_features.float().transpose(-1, -2)
    if causal:
        a = torch.tril(a)
    out = (a @ v.float()) / (a.sum(-1, keepdim=True) + eps)
    return out.to(v.dtype)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, eps: float) -> None:
    check_tensor(OP, "q_features", q, ndim=4)
    check_tensor(OP, "k_features", k, ndim=4)
    check_tensor(OP, "v", v, ndim=4)
    check_same_device(OP, "q_features", q, k_features=k, v=v)
    check_same_dtype(OP, "q_features", q, k_features=k, v=v)
    b, h, lq, m = q.shape
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != m:
        fail(OP, f"argument 'k_features' must have shape ({b}, {h}, Lk, {m}) to match 'q_features' "
                 f"{tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[0] != b or v.shape[1] != h or v.shape[2] != k.shape[2]:
        fail(OP, f"argument 'v' must have shape ({b}, {h}, {k.shape[2]}, D) to match 'k_features' "
                 f"{tuple(k.shape)}, got {tuple(v.shape)}")
    if causal and lq != k.shape[2]:
        fail(OP, f"causal=True needs as many queries as keys, got Lq={lq} and Lk={k.shape[2]}")
    if not eps >= 0:
        fail(OP, f"argument 'eps' must be >= 0, got {eps}")


# -- the custom ops (causal) --------------------------------------------------------------------------------
def _augment(v: torch.Tensor) -> torch.Tensor:
    """(BH, L, D) -> (BH, L, D + 1) fp32 with a trailing column of ones (the normaliser's values)."""
    ones = torch.ones(*v.shape[:-1], 1, dtype=torch.float32, device=v.device)
    return torch.cat([v.float(), ones], dim=-1).contiguous()


def _call(q: torch.Tensor, v: torch.Tensor) -> Call:
    return call_of(q, m=q.shape[-1], d=v.shape[-1], L=q.shape[2])


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1]).float().contiguous()


@torch.library.custom_op("fastarch::linear_attention_causal_fwd", mutates_args=())
def _la_causal_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, L, m = q.shape
    d = v.shape[-1]
    y = run(OP, "forward", _call(q, v), backend, _flat(q), _flat(k), _augment(_flat(v)))
    den = y[..., d] + eps
    out = y[..., :d] / den[..., None]
    return out.reshape(b, h, L, d).to(v.dtype).contiguous(), den.reshape(b, h, L).contiguous()


@_la_causal_fwd.register_fake
def _(q, k, v, eps, backend):
    return v.new_empty(v.shape), q.new_empty(q.shape[:3], dtype=torch.float32)  # contiguous


@torch.library.custom_op("fastarch::linear_attention_causal_bwd", mutates_args=())
def _la_causal_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    den: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, L, m = q.shape
    d = v.shape[-1]
    g = _flat(dout)
    den3 = den.reshape(-1, L, 1)
    # Upstream gradient of the unnormalised product y = [num, den - eps]: d/dnum = g/den,
    # d/dden = -(g . out)/den.
    ga = torch.cat([g / den3, -(g * _flat(out)).sum(-1, keepdim=True) / den3], dim=-1).contiguous()
    dq, dk, dva = run_backward(OP, _call(q, v), backend, _flat(q), _flat(k),
                               _augment(_flat(v)), ga)
    return (dq.reshape(q.shape).to(q.dtype).contiguous(), dk.reshape(k.shape).to(k.dtype).contiguous(),
            dva[..., :d].reshape(v.shape).to(v.dtype).contiguous())


@_la_causal_bwd.register_fake
def _(dout, q, k, v, out, den, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, eps, backend = inputs
    out, den = output
    ctx.save_for_backward(q, k, v, out, den)
    ctx.backend = backend


def _backward(ctx, dout, _dden):
    q, k, v, out, den = ctx.saved_tensors
    dq, dk, dv = _la_causal_bwd(dout.contiguous(), q, k, v, out, den, ctx.backend)
    return dq, dk, dv, None, None


_la_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_attention(
    q_features: torch.Tensor,
    k_features: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    eps: float = 1e-6,
    backend: str | None = None,
) -> torch.Tensor:
    """Linear attention on feature-mapped queries/keys.

    Args:
        q_features: ``(B, H, Lq, m)`` feature map of the queries (non-negative for a proper normaliser).
        k_features: ``(B, H, Lk, m)`` feature map of the keys.
        v: ``(B, H, Lk, D)`` values.
        causal: position i sees keys j <= i (needs Lq == Lk).
        eps: added to the normaliser ``phi_q . z``.
        backend: force 'cpp', 'triton' or 'torch' for the causal kernels (the non-causal case is two
            matmuls on whatever device the tensors are).

    Returns:
        The output in ``v``'s dtype. Differentiable in all three inputs.

    Shapes:
        q_features: ``(B, H, Lq, m)``; k_features: ``(B, H, Lk, m)``; v: ``(B, H, Lk, D)``;
        output: ``(B, H, Lq, D)``.
    """
    _validate(q_features, k_features, v, causal, eps)
    if not causal:
        # Two matmuls in fp32 accumulation; autograd is torch's own.
        qf, kf, vf = q_features.float(), k_features.float(), v.float()
        kv = kf.transpose(-1, -2) @ vf                      # (B, H, m, D)
        z = kf.sum(-2)                                      # (B, H, m)
        den = (qf @ z.unsqueeze(-1)) + eps                  # (B, H, Lq, 1)
        return ((qf @ kv) / den).to(v.dtype)
    if q_features.numel() == 0 or v.numel() == 0:
        return linear_attention_ref(q_features, k_features, v, causal, eps)
    name = resolve(OP, lambda: _call(q_features, v), backend)
    out, _ = _la_causal_fwd(q_features, k_features, v, float(eps), name)
    return out


# -- backends: the unnormalised causal product y = tril(q k^T) va and its backward --------------------------
# Every implementation takes fp32 contiguous (N, L, m), (N, L, m), (N, L, Da) [and the upstream (N, L, Da)].
def _chunked_fwd_torch(q: torch.Tensor, k: torch.Tensor, va: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    n, L, m = q.shape
    y = torch.empty(n, L, va.shape[-1], dtype=torch.float32, device=q.device)
    state = torch.zeros(n, m, va.shape[-1], dtype=torch.float32, device=q.device)
    for s in range(0, L, chunk):
        e = min(s + chunk, L)
        qc, kc, vc = q[:, s:e], k[:, s:e], va[:, s:e]
        a = torch.tril(qc @ kc.transpose(1, 2))
        y[:, s:e] = a @ vc + qc @ state
        state += kc.transpose(1, 2) @ vc
    return y


def _chunked_bwd_torch(q, k, va, ga, chunk: int = 64):
    n, L, m = q.shape
    da = va.shape[-1]
    dq, dk, dva = torch.empty_like(q), torch.empty_like(k), torch.empty_like(va)
    state = torch.zeros(n, m, da, dtype=torch.float32, device=q.device)
    for s in range(0, L, chunk):
        e = min(s + chunk, L)
        kc, vc, gc = k[:, s:e], va[:, s:e], ga[:, s:e]
        p = torch.tril(gc @ vc.transpose(1, 2))
        dq[:, s:e] = p @ kc + gc @ state.transpose(1, 2)
        state += kc.transpose(1, 2) @ vc
    rstate = torch.zeros(n, m, da, dtype=torch.float32, device=q.device)
    starts = list(range(0, L, chunk))
    for s in reversed(starts):
        e = min(s + chunk, L)
        qc, kc, vc, gc = q[:, s:e], k[:, s:e], va[:, s:e], ga[:, s:e]
        p = torch.tril(gc @ vc.transpose(1, 2))
        a = torch.tril(qc @ kc.transpose(1, 2))
        dk[:, s:e] = p.transpose(1, 2) @ qc + vc @ rstate.transpose(1, 2)
        dva[:, s:e] = a.transpose(1, 2) @ gc + kc @ rstate
        rstate += qc.transpose(1, 2) @ gc
    return dq, dk, dva


class TorchLinearAttention(TorchImplementation):
    op = OP
    description = "chunked PyTorch (masked chunk matmuls + running (m, D) state), fp32"

    forward = staticmethod(_chunked_fwd_torch)
    backward = staticmethod(_chunked_bwd_torch)


class CppLinearAttention(CppImplementation):
    op, extension = OP, "linear_attention"
    description = "C++ chunked kernel, OpenMP over (batch, head), BLAS chunk matmuls, fp32"

    def forward(self, q, k, va):
        return self.lib.linear_attention_causal_fwd(q, k, va, 64)

    def backward(self, q, k, va, ga):
        return tuple(self.lib.linear_attention_causal_bwd(q, k, va, ga, 64))


class TritonLinearAttention(TritonImplementation):
    op, kernel_module = OP, "linear_attention"
    description = "Triton chunked kernels; programs over (batch*head, m-block, D-block), fp32 accumulation"

    def forward(self, q, k, va):
        return self.lib.linear_attention_causal_fwd(q, k, va)

    def backward(self, q, k, va, ga):
        return self.lib.linear_attention_causal_bwd(q, k, va, ga)


for _impl in (TorchLinearAttention, CppLinearAttention, TritonLinearAttention):
    register(_impl)
