"""``mamba_ssm.ops.selective_scan_interface`` on fastarch's ops.

- ``selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
  return_last_state=False)`` and ``selective_scan_ref`` (same signature): :mod:`fastarch.ops.selective_scan`.
- ``mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
  out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
  delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
  b_c_dt_rms_eps=1e-6)``: Mamba's inner block, ``xz`` ``(batch, 2 * d_inner, L)`` -> ``(batch, L, d_model)``:

  1. ``x, z = xz.chunk(2, dim=1)``; ``u = silu(causal_conv1d(x, conv1d_weight (d_inner, 1, W), conv1d_bias))``;
  2. ``x_dbl = u^T @ x_proj_weight^T`` ``(batch, L, dt_rank + 2N)``; ``delta = x_dbl[:dt_rank] @
     delta_proj_weight^T``; B and C (when not given) are the next N and the last N columns, plus
     ``B_proj_bias`` / ``C_proj_bias``; B, C and delta are RMS-normalised with ``b_rms_weight``,
     ``c_rms_weight`` and ``dt_rms_weight`` when given;
  3. ``y = selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)``;
  4. ``out = y^T @ out_proj_weight^T + out_proj_bias``.

  One autograd function: the forward keeps the scan's chunk checkpoints and ``y``; ``checkpoint_lvl=1``
  recomputes the conv output in the backward instead of keeping it (``0`` keeps it). The projections to
  delta/B/C are recomputed in the backward at either level (a rank-``dt_rank`` product). Differentiable in
  every tensor argument.
- ``mamba_inner_ref``: the same in composed PyTorch (the references of the conv and the scan), the oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ....backend import AUTO
from ....ops._checks import fail
from ....ops.causal_conv1d import _conv_bwd, causal_conv1d, causal_conv1d_ref
from ....ops.rms_norm import rms_norm, rms_norm_ref
from ....ops.selective_scan import (
    _selective_scan_bwd,
    _selective_scan_fwd,
    selective_scan_fn,
    selective_scan_ref,
)
from ....ops.selective_scan import (
    _validate as _validate_scan,
)

__all__ = ["mamba_inner_fn", "mamba_inner_ref", "selective_scan_fn", "selective_scan_ref"]

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _norm_with(norm: Norm, t: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return t if weight is None else norm(t, weight.to(t.dtype), eps)


def _projections(u, x_proj_weight, delta_proj_weight, B, C, B_proj_bias, C_proj_bias, b_rms_weight,
                 c_rms_weight, dt_rms_weight, eps, d_state, norm: Norm):
    """From the conv output ``u`` ``(batch, d_inner, L)``: delta ``(batch, d_inner, L)`` and B, C (given, or
    ``(batch, 1, N, L)`` from ``x_proj``)."""
    rank = delta_proj_weight.shape[1]
    x_dbl = F.linear(u.transpose(1, 2), x_proj_weight)  # (batch, L, rank + 2N)
    delta = _norm_with(norm, F.linear(x_dbl[..., :rank], delta_proj_weight), dt_rms_weight, eps).transpose(1, 2)

    def from_x(cols, bias, rms_weight):
        t = x_dbl[..., cols]
        if bias is not None:
            t = t + bias.to(t.dtype)
        return _norm_with(norm, t, rms_weight, eps).transpose(1, 2).unsqueeze(1)  # (batch, 1, N, L)

    if B is None:
        B = from_x(slice(rank, rank + d_state), B_proj_bias, b_rms_weight)
    if C is None:
        C = from_x(slice(x_dbl.shape[-1] - d_state, None), C_proj_bias, c_rms_weight)
    return delta.contiguous(), B.contiguous(), C.contiguous()


def _check_inner(xz, conv1d_weight, x_proj_weight, delta_proj_weight, A, checkpoint_lvl) -> None:
    op = "mamba_inner_fn"
    if checkpoint_lvl not in (0, 1):
        fail(op, f"argument 'checkpoint_lvl' must be 0 or 1, got {checkpoint_lvl!r}")
    if xz.dim() != 3 or xz.shape[1] % 2:
        fail(op, f"argument 'xz' must have shape (batch, 2 * d_inner, L), got {tuple(xz.shape)}")
    d_inner = xz.shape[1] // 2
    if conv1d_weight.dim() != 3 or conv1d_weight.shape[:2] != (d_inner, 1):
        fail(op, f"argument 'conv1d_weight' must have shape ({d_inner}, 1, width), got "
                 f"{tuple(conv1d_weight.shape)}")
    if A.is_complex():
        fail(op, "argument 'A' is complex; only real A is supported", NotImplementedError)
    rank = delta_proj_weight.shape[1]
    if delta_proj_weight.shape[0] != d_inner or x_proj_weight.shape[1] != d_inner or x_proj_weight.shape[0] < rank:
        fail(op, f"x_proj_weight {tuple(x_proj_weight.shape)} and delta_proj_weight "
                 f"{tuple(delta_proj_weight.shape)} do not fit d_inner={d_inner}")


class MambaInnerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, delta_softplus, checkpoint_lvl,
                b_rms_weight, c_rms_weight, dt_rms_weight, eps):
        d_state = A.shape[-1]
        x, z = xz.chunk(2, dim=1)
        conv_w = conv1d_weight.squeeze(1)
        u = causal_conv1d(x, conv_w, conv1d_bias, "silu")
        delta, Bs, Cs = _projections(u, x_proj_weight, delta_proj_weight, B, C, B_proj_bias, C_proj_bias,
                                     b_rms_weight, c_rms_weight, dt_rms_weight, eps, d_state, rms_norm)
        z = z.contiguous()
        _validate_scan(u, delta, A, Bs, Cs, D, z, delta_bias)
        y, _, ckpt = _selective_scan_fwd(u, delta, A, Bs, Cs, D, z, delta_bias, bool(delta_softplus), True, AUTO)
        ctx.save_for_backward(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                              out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, b_rms_weight,
                              c_rms_weight, dt_rms_weight, ckpt, y, u if checkpoint_lvl == 0 else None)
        ctx.delta_softplus, ctx.eps = bool(delta_softplus), eps
        return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)

    @staticmethod
    def backward(ctx, dout):
        (xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, out_proj_bias, A,
         B, C, D, delta_bias, B_proj_bias, C_proj_bias, b_rms_weight, c_rms_weight, dt_rms_weight, ckpt, y,
         u) = ctx.saved_tensors
        d_state = A.shape[-1]
        x, z = xz.chunk(2, dim=1)
        conv_w = conv1d_weight.squeeze(1)
        if u is None:  # checkpoint_lvl 1: recompute the conv output
            u = causal_conv1d(x, conv_w, conv1d_bias, "silu")
        # The projections again, this time recorded, so autograd carries their gradients to the weights.
        leaves = [t.detach().requires_grad_() if t is not None else None
                  for t in (u, x_proj_weight, delta_proj_weight, B, C, B_proj_bias, C_proj_bias, b_rms_weight,
                            c_rms_weight, dt_rms_weight)]
        with torch.enable_grad():
            delta, Bs, Cs = _projections(*leaves, ctx.eps, d_state, rms_norm)
        dout2 = dout.reshape(-1, dout.shape[-1])
        dy = (dout @ out_proj_weight).transpose(1, 2).contiguous()  # (batch, d_inner, L)
        dout_proj_weight = dout2.t() @ y.transpose(1, 2).reshape(-1, y.shape[1]).to(dout.dtype)
        dout_proj_bias = dout2.sum(0) if out_proj_bias is not None else None
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = _selective_scan_bwd(
            dy, None, u, delta.detach(), A, Bs.detach(), Cs.detach(), D, z.contiguous(), delta_bias, ckpt,
            ctx.delta_softplus, AUTO)
        outs, grads = [delta], [ddelta.to(delta.dtype)]
        for t, g, given in ((Bs, dB, B), (Cs, dC, C)):
            if given is None or given.requires_grad:
                outs.append(t)
                grads.append(g.to(t.dtype))
        torch.autograd.backward(outs, grads)
        u_leaf = leaves[0]
        du = du + (u_leaf.grad if u_leaf.grad is not None else 0)
        dx, dconv_w, dconv_b, _ = _conv_bwd(du.contiguous(), x.contiguous(), conv_w, conv1d_bias, None, None,
                                            True, AUTO)

        def grad_of(i, like):
            t = leaves[i]
            return None if t is None or t.grad is None else t.grad.to(like.dtype)

        dxz = torch.cat([dx.to(xz.dtype), dz.to(xz.dtype)], dim=1)
        return (dxz, dconv_w.to(conv1d_weight.dtype).unsqueeze(1),
                None if conv1d_bias is None else dconv_b.to(conv1d_bias.dtype),
                grad_of(1, x_proj_weight), grad_of(2, delta_proj_weight), dout_proj_weight.to(out_proj_weight.dtype),
                dout_proj_bias, dA.to(A.dtype),
                None if B is None else grad_of(3, B), None if C is None else grad_of(4, C),
                None if D is None else dD.to(D.dtype), None if delta_bias is None else ddelta_bias.to(delta_bias.dtype),
                None if B_proj_bias is None else grad_of(5, B_proj_bias),
                None if C_proj_bias is None else grad_of(6, C_proj_bias), None, None,
                None if b_rms_weight is None else grad_of(7, b_rms_weight),
                None if c_rms_weight is None else grad_of(8, c_rms_weight),
                None if dt_rms_weight is None else grad_of(9, dt_rms_weight), None)


def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                   delta_softplus=True, checkpoint_lvl=1, b_rms_weight=None, c_rms_weight=None,
                   dt_rms_weight=None, b_c_dt_rms_eps=1e-6):
    """mamba-ssm's ``mamba_inner_fn`` (see the module docstring): ``(batch, L, d_model)``."""
    _check_inner(xz, conv1d_weight, x_proj_weight, delta_proj_weight, A, checkpoint_lvl)
    return MambaInnerFn.apply(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                              out_proj_bias, A, B, C, D, delta_bias, B_proj_bias, C_proj_bias, delta_softplus,
                              checkpoint_lvl, b_rms_weight, c_rms_weight, dt_rms_weight, float(b_c_dt_rms_eps))


def mamba_inner_ref(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, B_proj_bias=None, C_proj_bias=None,
                    delta_softplus=True, b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None,
                    b_c_dt_rms_eps=1e-6):
    """The oracle: the same computation from the conv and scan references, differentiable by autograd."""
    x, z = xz.chunk(2, dim=1)
    u = causal_conv1d_ref(x, conv1d_weight.squeeze(1), conv1d_bias, "silu")
    delta, Bs, Cs = _projections(u, x_proj_weight, delta_proj_weight, B, C, B_proj_bias, C_proj_bias,
                                 b_rms_weight, c_rms_weight, dt_rms_weight, b_c_dt_rms_eps, A.shape[-1],
                                 rms_norm_ref)
    y = selective_scan_ref(u, delta, A, Bs, Cs, D, z, delta_bias, delta_softplus)
    return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)
