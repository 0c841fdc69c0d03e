"""Triton kernel for rotary embedding: one program rotates one (token, head). The same kernel serves the
forward and, rotating backwards, the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, Out, Cos, Sin, L, H, D, R, offset, sign,
                   INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # flattened (b, l)
    h = tl.program_id(1).to(tl.int64)
    pos = t % L + offset
    r = tl.arange(0, BLOCK_R)
    m = r < R
    c = tl.load(Cos + pos * R + r, mask=m, other=1.0).to(tl.float32)
    s = tl.load(Sin + pos * R + r, mask=m, other=0.0).to(tl.float32) * sign
    base = (t * H + h) * D
    if INTERLEAVED:
        i0 = 2 * r
        i1 = 2 * r + 1
    else:
        i0 = r
        i1 = r + R
    a = tl.load(X + base + i0, mask=m, other=0.0).to(tl.float32)
    b = tl.load(X + base + i1, mask=m, other=0.0).to(tl.float32)
    tl.store(Out + base + i0, (a * c - b * s).to(Out.dtype.element_ty), mask=m)
    tl.store(Out + base + i1, (a * s + b * c).to(Out.dtype.element_ty), mask=m)


def rotary_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conj: bool,
                 offset: int) -> torch.Tensor:
    """x (B, L, H, D) contiguous; cos/sin (>= offset+L, R) with 2R <= D. conj rotates backwards."""
    B, L, H, D = x.shape
    R = cos.shape[1]
    out = torch.empty_like(x)
    if 2 * R < D:
        out[..., 2 * R:] = x[..., 2 * R:]
    cos = cos.contiguous()
    sin = sin.contiguous()
    _rotary_kernel[(B * L, H)](x, out, cos, sin, L, H, D, R, offset, -1.0 if conj else 1.0,
                               INTERLEAVED=interleaved, BLOCK_R=max(16, triton.next_power_of_2(R)))
    return out
