"""Rotary position embedding (RoPE) applied to queries or keys.

``rotary_embedding(x, cos, sin, interleaved=False)`` with ``x`` of shape ``(B, L, H, D)`` and ``cos``/``sin``
of shape ``(L_max, R)``, ``2R <= D``: the first ``2R`` features of each head are rotated by the angle of the
token's position (``seqlen_offset + l``), the rest pass through, as in FlashAttention's
``apply_rotary_emb``. ``interleaved=True`` rotates pairs ``(2r, 2r+1)`` (GPT-J, the seed guide's RoPE);
``False`` rotates halves ``(r, r+R)`` (GPT-NeoX). ``cos``/``sin`` are treated as constants (no gradient).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..backend import choose, register
from ._backends import CppImplementation, TorchImplementation, TritonImplementation
from ._checks import check_same_device, check_tensor, fail
from ._dispatch import call_of, dispatch

__all__ = ["rotary_embedding", "rotary_embedding_ref", "rotary_cos_sin"]

OP = "rotary"


def rotary_cos_sin(seq_len: int, rotary_dim: int, base: float = 10000.0, device=None,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``(seq_len, rotary_dim // 2)`` with frequencies ``base^(-2r/rotary_dim)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    ang = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offset: int = 0) -> torch.Tensor:
    """The oracle in fp32."""
    L, R = x.shape[1], cos.shape[1]
    c = cos[seqlen_offset:seqlen_offset + L].float()[None, :, None, :]
    s = sin[seqlen_offset:seqlen_offset + L].float()[None, :, None, :]
    xf = x.float()
    rot, rest = xf[..., : 2 * R], xf[..., 2 * R:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :R], rot[..., R:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([out, rest], dim=-1).to(x.dtype)


def _validate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlen_offset: int) -> None:
    check_tensor(OP, "x", x, ndim=4)
    check_tensor(OP, "cos", cos, ndim=2)
    check_tensor(OP, "sin", sin, ndim=2)
    check_same_device(OP, "x", x, cos=cos, sin=sin)
    D = x.shape[-1]
    if D % 2:
        fail(OP, f"head dim of 'x' must be even for rotary embedding, got {D}")
    if cos.shape != sin.shape:
        fail(OP, f"'cos' and 'sin' must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    R = cos.shape[1]
    if R < 1 or 2 * R > D:
        fail(OP, f"'cos' has {R} frequencies, so 2*{R} rotated features, but the head dim of 'x' is {D}")
    if isinstance(seqlen_offset, bool) or not isinstance(seqlen_offset, (numbers.Integral, torch.SymInt)):
        # A float offset would slice the tables at a truncated position.
        fail(OP, f"argument 'seqlen_offset' must be an int, got {type(seqlen_offset).__name__} {seqlen_offset!r}",
             TypeError)
    if seqlen_offset < 0:
        fail(OP, f"argument 'seqlen_offset' must be >= 0, got {seqlen_offset}")
    if cos.shape[0] < seqlen_offset + x.shape[1]:
        fail(OP, f"'cos'/'sin' cover {cos.shape[0]} positions but positions up to "
                 f"{seqlen_offset + x.shape[1]} are needed (seqlen_offset={seqlen_offset}, L={x.shape[1]})")


@torch.library.custom_op("fastarch::rotary", mutates_args=())
def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conj: bool, offset: int,
            backend: str) -> torch.Tensor:
    return choose(OP, call_of(x), backend).forward(x.contiguous(), cos, sin, interleaved, conj, offset)


@_rotary.register_fake
def _(x, cos, sin, interleaved, conj, offset, backend):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin, interleaved, conj, offset, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.args = (interleaved, conj, offset, backend)


def _backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    interleaved, conj, offset, backend = ctx.args
    # A rotation's adjoint is the opposite rotation.
    return _rotary(dy, cos, sin, interleaved, not conj, offset, backend), None, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, *,
                     seqlen_offset: int = 0, backend: str | None = None) -> torch.Tensor:
    """Rotary position embedding: rotate the first ``2R`` features of each head by its position's angle.

    Args:
        x: queries or keys.
        cos: cosines of the angles, one row per position (e.g. from :func:`rotary_cos_sin`); no gradient.
        sin: sines of the same angles; no gradient.
        interleaved: rotate pairs ``(2r, 2r+1)`` (GPT-J) instead of halves ``(r, r+R)`` (GPT-NeoX).
        seqlen_offset: the position of ``x``'s first token in the tables.
        backend: force 'cpp', 'triton' or 'torch' (default: the selector's choice).

    Returns:
        The rotated tensor, in ``x``'s shape and dtype; differentiable in ``x``.

    Shapes:
        x, output: ``(B, L, H, D)``; cos, sin: ``(L_max, R)`` with ``2R <= D`` and
        ``L_max >= seqlen_offset + L``.
    """
    _validate(x, cos, sin, seqlen_offset)
    if x.numel() == 0:
        return x.clone()
    impl, name = dispatch(OP, lambda: call_of(x), backend, x, cos, sin)
    if impl is not None:
        return impl.forward(x.contiguous(), cos, sin, bool(interleaved), False, int(seqlen_offset))
    return _rotary(x, cos, sin, bool(interleaved), False, int(seqlen_offset), name)


class TorchRotary(TorchImplementation):
    op = OP
    description = "composed PyTorch in fp32"

    def forward(self, x, cos, sin, interleaved, conj, offset):
        return rotary_embedding_ref(x, cos, -sin if conj else sin, interleaved, offset)


class _CompiledRotary:
    """Shared glue: the C++ extension and the Triton module expose ``rotary_apply`` alike."""

    lib: Any

    def forward(self, x, cos, sin, interleaved, conj, offset):
        return self.lib.rotary_apply(x, cos, sin, interleaved, conj, offset)


class CppRotary(CppImplementation, _CompiledRotary):
    op, extension = OP, "rotary"
    description = "fused C++ kernel"


class TritonRotary(TritonImplementation, _CompiledRotary):
    op, kernel_module = OP, "rotary"
    description = "Triton kernel, one program per (token, head)"


for _impl in (TorchRotary, CppRotary, TritonRotary):
    register(_impl)
