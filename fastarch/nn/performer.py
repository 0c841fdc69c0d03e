"""Performer: FAVOR+ attention (positive orthogonal random features) on ``fastarch.ops.linear_attention``.

Drop-in for the seed guide's ``Performer(d_model, n_heads, nb_features=256, dropout=0.1)``: the same
constructor, the same ``state_dict`` keys (``w_q``, ``w_k``, ``w_v``, ``w_o``) and ``forward(x, mask=None)``.

Deviations from the guide, which is wrong in three places (see docs/efficient.md):

- the guide draws a new random projection on every call, so the same input gives a different output each
  time, even in eval mode. Here the projection is a buffer, redrawn only in training mode every
  ``feature_redraw_interval`` forward calls (``None`` = never) or on :meth:`redraw_projection_matrix`; it
  is fixed in eval mode. It is a non-persistent buffer so that the ``state_dict`` keys are the guide's;
  pass ``persistent_features=True`` to save it with the weights.
- the guide's feature map ``exp(x w^T - |x|/2) / sqrt(m)`` subtracts the norm instead of half the squared
  norm and omits the ``d^-1/4`` scaling, so it does not estimate the softmax kernel. FAVOR+ is
  ``phi(x) = exp(w . x' - |x'|^2 / 2 - c) / sqrt(m)`` with ``x' = x d^-1/4``, ``w`` rows of a block-orthogonal
  Gaussian matrix with chi-distributed norms, and ``c`` the stabiliser (per-row max for queries, a max over
  the whole sequence for keys when not causal; both cancel in the normalised ratio). In causal mode keys
  get no sequence-wide stabiliser: with the kernel eps it would leak the future into the past.
- the guide ignores ``mask``; here a key padding mask ``(B, L)`` (non-zero = keep) removes those keys.

Extra keyword options: ``causal`` (prefix-sum causal attention through the op's chunked kernels),
``feature_redraw_interval``, ``persistent_features``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import ops
from ._models_common import key_padding_mask
from .attention import Attention

__all__ = ["Performer", "orthogonal_random_features", "favor_plus_features"]


def orthogonal_random_features(nb_features: int, dim: int, *, device=None,
                               generator: torch.Generator | None = None) -> torch.Tensor:
    """``(nb_features, dim)`` block-orthogonal Gaussian projection (FAVOR+ "ORF", scaling by chi norms).

    Rows come in blocks of ``dim`` mutually orthogonal unit vectors (QR of a Gaussian matrix), each row
    rescaled by the norm of an independent Gaussian vector so its length is distributed like a Gaussian
    row's; the estimator stays unbiased and its variance drops.
    """
    if nb_features < 1 or dim < 1:
        raise ValueError(f"orthogonal_random_features: need nb_features >= 1 and dim >= 1, got {nb_features}, {dim}")
    blocks = []
    for _ in range(math.ceil(nb_features / dim)):
        g = torch.randn(dim, dim, device=device, generator=generator)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # make the factorisation unique (Haar)
        blocks.append(q.T)
    w = torch.cat(blocks, 0)[:nb_features]
    norms = torch.randn(nb_features, dim, device=device, generator=generator).norm(dim=1, keepdim=True)
    return w * norms


def favor_plus_features(x: torch.Tensor, projection: torch.Tensor, *, is_query: bool,
                        kernel_eps: float = 1e-4, key_mask: torch.Tensor | None = None,
                        causal: bool = False) -> torch.Tensor:
    """Positive random features of the softmax kernel: ``E[phi(q) . phi(k)] = exp(q . k / sqrt(d))``.

    Args:
        x: ``(B, H, L, d)`` queries or keys (unscaled; the ``d^-1/4`` scaling is applied here).
        projection: ``(m, d)`` random projection.
        is_query: queries subtract their per-row max (stabiliser); keys subtract one max over the sequence
            and features, per (batch, head), so every query sees keys on the same scale.
        causal: keys get no cross-position stabiliser, because with ``kernel_eps`` (and the op's eps) a
            max over the whole sequence would let future keys change past outputs. Nothing overflows
            without it: ``w . k' - |k'|^2 / 2 <= |w|^2 / 2``, about 50 for d = 64, far below fp32's 88.
        kernel_eps: added to the features so the normaliser stays positive.
        key_mask: ``(B, L)`` bool, True = keep (keys only); masked rows get zero features.

    Returns:
        ``(B, H, L, m)`` in fp32.
    """
    d = x.shape[-1]
    m = projection.shape[0]
    xf = x.float() * d ** -0.25
    proj = xf @ projection.float().T                                   # (B, H, L, m)
    half_sq = 0.5 * (xf * xf).sum(-1, keepdim=True)
    # The stabiliser is a constant shift (detached, as usual): it cancels in the normalised ratio.
    if is_query:
        stab = proj.detach().amax(-1, keepdim=True)
    elif causal:
        stab = torch.zeros((), device=proj.device)
    else:
        pm = proj.detach()
        if key_mask is not None:
            pm = pm.masked_fill(~key_mask[:, None, :, None], float("-inf"))
        stab = pm.amax(dim=(-1, -2), keepdim=True).clamp_min(-1e30)   # all-masked rows stay finite
    if torch.is_grad_enabled() and proj.requires_grad:
        feats = (torch.exp(proj - half_sq - stab) + kernel_eps) * m ** -0.5
    else:  # inference: one buffer, in place (the map is memory-bound)
        feats = proj.sub_(half_sq).sub_(stab).exp_().add_(kernel_eps).mul_(m ** -0.5)
    if key_mask is not None:
        feats = feats * key_mask[:, None, :, None]
    return feats


class Performer(Attention):
    """FAVOR+ multi-head self-attention.

    Args:
        d_model: model width; ``d_model % n_heads == 0``.
        n_heads: number of heads.
        nb_features: random features per head (m).
        dropout: on the output, as in the guide.
        causal: autoregressive attention (prefix sums), keyword only.
        feature_redraw_interval: in training mode, redraw the projection every this many forward calls;
            ``None`` never redraws automatically. Eval mode never redraws.
        persistent_features: save the projection in ``state_dict`` (off by default: the guide's keys).

    Shapes: ``forward(x (B, L, d_model), mask=None (B, L)) -> (B, L, d_model)``.
    """

    def __init__(self, d_model: int, n_heads: int, nb_features: int = 256, dropout: float = 0.1, *,
                 causal: bool = False, feature_redraw_interval: int | None = 1000,
                 persistent_features: bool = False, kernel_eps: float = 1e-4) -> None:
        super().__init__(d_model, n_heads, names=("w_q", "w_k", "w_v", "w_o"))
        if nb_features < 1:
            raise ValueError(f"Performer: nb_features must be >= 1, got {nb_features}")
        if feature_redraw_interval is not None and feature_redraw_interval < 1:
            raise ValueError(f"Performer: feature_redraw_interval must be >= 1 or None, got {feature_redraw_interval}")
        self.nb_features = nb_features
        self.causal = causal
        self.feature_redraw_interval = feature_redraw_interval
        self.kernel_eps = kernel_eps
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("projection_matrix", orthogonal_random_features(nb_features, self.d_k),
                             persistent=persistent_features)
        self.register_buffer("calls_since_last_redraw", torch.zeros((), dtype=torch.long), persistent=False)

    def create_projection_matrix(self, m: int, d: int, device) -> torch.Tensor:
        """The guide's method name; returns a fresh FAVOR+ projection ``(m, d)``."""
        return orthogonal_random_features(m, d, device=device)

    @torch.no_grad()
    def redraw_projection_matrix(self) -> None:
        """Draw a new projection in place (same device and dtype) and reset the redraw counter."""
        self.projection_matrix.copy_(orthogonal_random_features(self.nb_features, self.d_k,
                                                                device=self.projection_matrix.device))
        self.calls_since_last_redraw.zero_()

    def kernel_feature_map(self, x: torch.Tensor, projection_matrix: torch.Tensor, is_query: bool = True,
                           key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """FAVOR+ features of ``x`` ``(B, H, L, d_k)`` -> ``(B, H, L, nb_features)`` fp32."""
        return favor_plus_features(x, projection_matrix, is_query=is_query, kernel_eps=self.kernel_eps,
                                   key_mask=key_mask, causal=self.causal)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"Performer: argument 'x' must have shape (batch, seq_len, {self.d_model}), "
                             f"got {tuple(x.shape)}")
        b, L, _ = x.shape
        key_mask = key_padding_mask(mask, b, L, "Performer")
        if self.training and self.feature_redraw_interval is not None:
            if int(self.calls_since_last_redraw) >= self.feature_redraw_interval:
                self.redraw_projection_matrix()
            self.calls_since_last_redraw += 1
        q, k, v = (t.transpose(1, 2) for t in self.project(x, x, x))
        qf = self.kernel_feature_map(q, self.projection_matrix, is_query=True)
        kf = self.kernel_feature_map(k, self.projection_matrix, is_query=False, key_mask=key_mask)
        out = ops.linear_attention(qf, kf, v.float(), causal=self.causal)
        out = out.to(x.dtype).transpose(1, 2).reshape(b, L, self.d_model)
        return self.dropout(self.w_o(out))
