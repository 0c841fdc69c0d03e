"""S4 as the state-spaces papers define it (diagonal form, S4D), with convolution and recurrent modes.

Drop-in names and constructors for the seed guide's ``S4Layer(d_model, d_state=64, dropout=0.1)`` and
``S4Block(d_model, d_state=64, d_ff=None, dropout=0.1)``. The guide's S4Layer is not S4: it learns a dense
random ``A`` (d_state x d_state), discretises with one Euler step at the *mean* dt, shares one state
across all channels, and runs a Python loop over time. Its parameters (``A``, ``B``, ``C``, ``D``,
``log_dt``) therefore have no counterpart here and its ``state_dict`` cannot be loaded (documented
deviation, see docs/efficient.md). What this module is:

- H = d_model independent single-input single-output SSMs, each with N/2 complex diagonal states
  (N = d_state; the conjugate half is implicit, hence ``2 Re(.)``);
- ``A`` from HiPPO-LegS: ``init="legs"`` takes the eigenvalues of the normal part of the LegS matrix
  (S4D-LegS) and projects LegS' ``B`` onto its eigenvectors; ``init="lin"`` (default) is S4D-Lin,
  ``A_n = -1/2 + i pi n``, ``B = 1``, its closed-form approximation;
- ``A`` is kept stable as ``-exp(log_A_real) + i A_imag``; a learnable ``log_dt`` per channel is drawn
  log-uniformly from ``[dt_min, dt_max]``;
- zero-order hold: ``A_bar = exp(dt A)``, ``B_bar = (exp(dt A) - 1) / A * B``;
- convolution mode (``forward``): :func:`fastarch.ops.ssm_convolution`, the kernel
  ``K[h, l] = 2 Re(sum_n C B_bar A_bar^l)`` from :func:`fastarch.ops.s4_kernel` (a fused Vandermonde
  product), then an FFT convolution, O(L log L);
- recurrent mode: ``allocate_state(batch)`` and ``step(x_t, state) -> (y_t, new_state)``, x_t ``(B, d_model)``;
- after the SSM and the skip ``D``: GELU, dropout, and the S4D output map ``Linear(H, 2H)`` + GLU.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from .linear import Linear

__all__ = ["S4Layer", "S4Block", "hippo_legs_diagonal"]


def hippo_legs_diagonal(d_state: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S4D-LegS: eigenvalues (with positive imaginary part) of the normal part of HiPPO-LegS and LegS'
    ``B`` in that eigenbasis. Returns ``(A, B)``, each ``(d_state // 2,)`` complex64.

    LegS: ``A[n, k] = -sqrt(2n+1) sqrt(2k+1)`` (n > k), ``-(n+1)`` (n = k), 0 (n < k); ``B[n] = sqrt(2n+1)``.
    With ``P[n] = sqrt(n + 1/2)``, ``A + P P^T = -I/2 + S`` where ``S`` is skew-symmetric.
    """
    n = torch.arange(d_state, dtype=torch.float64)
    r = torch.sqrt(2 * n + 1)
    s = 0.5 * torch.outer(r, r)
    skew = torch.tril(-s, -1) + torch.triu(s, 1)                 # the skew-symmetric part
    w, v = torch.linalg.eigh(-1j * skew.to(torch.complex128))    # skew = V (i w) V^*
    keep = w > 0
    a = (-0.5 + 1j * w[keep]).to(torch.complex64)
    b = (v.conj().T @ r.to(torch.complex128))[keep].to(torch.complex64)
    order = torch.argsort(a.imag)
    return a[order], b[order]


class S4Layer(nn.Module):
    """S4D layer: (B, L, d_model) -> (B, L, d_model).

    Args:
        d_model: channels H.
        d_state: state size N (even; N/2 complex states per channel).
        dropout: after the activation, as in S4D.
        init: 'lin' (S4D-Lin) or 'legs' (S4D-LegS).
        dt_min, dt_max: range of the initial step sizes (log-uniform).
        backend: forwarded to :func:`fastarch.ops.s4_kernel`.
    """

    def __init__(self, d_model: int, d_state: int = 64, dropout: float = 0.1, *, init: str = "lin",
                 dt_min: float = 1e-3, dt_max: float = 1e-1, backend: str | None = None) -> None:
        super().__init__()
        if d_state < 2 or d_state % 2:
            raise ValueError(f"S4Layer: d_state must be an even number >= 2, got {d_state}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"S4Layer: need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        if init not in ("lin", "legs"):
            raise ValueError(f"S4Layer: init must be 'lin' or 'legs', got {init!r}")
        self.d_model, self.d_state, self.init, self.backend = d_model, d_state, init, backend
        h, n2 = d_model, d_state // 2
        log_dt = torch.rand(h) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        if init == "lin":
            a = torch.complex(-0.5 * torch.ones(n2), math.pi * torch.arange(n2, dtype=torch.float32))
            b = torch.ones(n2, dtype=torch.complex64)
        else:
            a, b = hippo_legs_diagonal(d_state)
        self.log_dt = nn.Parameter(log_dt)
        self.log_A_real = nn.Parameter(torch.log(-a.real).repeat(h, 1))
        self.A_imag = nn.Parameter(a.imag.repeat(h, 1).clone())
        self.B = nn.Parameter(torch.view_as_real(b.repeat(h, 1)).clone())
        self.C = nn.Parameter(torch.view_as_real(torch.randn(h, n2, dtype=torch.complex64)).clone())
        self.D = nn.Parameter(torch.randn(h))
        self.activation = nn.GELU()
        self.dropout = nn.Dropout(dropout)
        self.output_linear = Linear(d_model, 2 * d_model)

    # -- the discretised system ---------------------------------------------------------------------------
    def discretize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """ZOH. Returns ``(dtA, A_bar, B_bar, C)``, each ``(H, N/2)`` complex64."""
        dt = torch.exp(self.log_dt.float()).unsqueeze(-1)
        a = torch.complex(-torch.exp(self.log_A_real.float()), self.A_imag.float())
        dta = a * dt
        a_bar = torch.exp(dta)
        b_bar = (a_bar - 1) / a * torch.view_as_complex(self.B.float())
        return dta, a_bar, b_bar, torch.view_as_complex(self.C.float())

    def kernel(self, L: int) -> torch.Tensor:
        """The SSM convolution kernel ``(H, L)`` fp32."""
        dta, _, b_bar, c = self.discretize()
        return ops.s4_kernel(dta, c * b_bar, L, backend=self.backend)

    def _post(self, y: torch.Tensor) -> torch.Tensor:
        # (..., H) -> (..., H): activation, dropout, Linear(H, 2H) + GLU.
        return F.glu(self.output_linear(self.dropout(self.activation(y))), dim=-1)

    def ssm(self, x: torch.Tensor) -> torch.Tensor:
        """The state-space part alone in convolution mode: ``K * x + D x``, (B, L, H) -> (B, L, H) fp32."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"S4Layer: argument 'x' must have shape (batch, seq_len, {self.d_model}), "
                             f"got {tuple(x.shape)}")
        u = x.float().transpose(1, 2)                                   # (B, H, L)
        dta, _, b_bar, c = self.discretize()
        y = ops.ssm_convolution(u, dta, c * b_bar, backend=self.backend)
        y = torch.addcmul(y, self.D.float().unsqueeze(-1), u)
        return y.transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._post(self.ssm(x).to(x.dtype))

    # -- recurrent mode -----------------------------------------------------------------------------------
    def allocate_state(self, batch: int, device=None) -> torch.Tensor:
        """Zero state ``(batch, H, N/2)`` complex64."""
        return torch.zeros(batch, self.d_model, self.d_state // 2, dtype=torch.complex64,
                           device=device if device is not None else self.log_dt.device)

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One time step: ``x_t`` ``(B, d_model)`` -> ``(y_t (B, d_model), new_state)``; state unchanged in place."""
        if x_t.dim() != 2 or x_t.shape[-1] != self.d_model:
            raise ValueError(f"S4Layer.step: argument 'x_t' must have shape (batch, {self.d_model}), "
                             f"got {tuple(x_t.shape)}")
        want = (x_t.shape[0], self.d_model, self.d_state // 2)
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != want or not state.is_complex():
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"S4Layer.step: argument 'state' must be a complex tensor of shape {want} "
                             f"(see allocate_state), got {got}")
        a_bar, b_bar, c = self._step_matrices()
        u = x_t.float()
        new = a_bar * state + b_bar * u.unsqueeze(-1)
        y = 2 * (c * new).sum(-1).real + self.D.float() * u
        return self._post(y.to(x_t.dtype)), new

    def _step_matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Generation calls step thousands of times: reuse the discretisation while no parameter changed
        # (tensor version counters) and no graph is being built.
        params = (self.log_dt, self.log_A_real, self.A_imag, self.B, self.C)
        key = tuple((p.data_ptr(), p._version) for p in params)
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            _, a_bar, b_bar, c = self.discretize()
            return a_bar, b_bar, c
        cached = getattr(self, "_step_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                _, a_bar, b_bar, c = self.discretize()
            cached = (key, (a_bar, b_bar, c))
            self._step_cache = cached
        return cached[1]

    def forward_recurrent(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as :meth:`forward`, one step at a time (for checking and streaming)."""
        state = self.allocate_state(x.shape[0], x.device)
        ys = []
        for t in range(x.shape[1]):
            y, state = self.step(x[:, t], state)
            ys.append(y)
        return torch.stack(ys, 1)


class S4Block(nn.Module):
    """The guide's block: ``x + S4(LN(x))``, then ``x + FF(LN(x))``; (B, L, d_model) -> (B, L, d_model).

    Same submodule names as the guide (``s4``, ``ff``, ``norm1``, ``norm2``); the ``s4`` parameters are
    S4D's (see :class:`S4Layer`). Recurrent mode: ``allocate_state`` / ``step``.
    """

    def __init__(self, d_model: int, d_state: int = 64, d_ff: int | None = None, dropout: float = 0.1,
                 **s4_kwargs) -> None:
        super().__init__()
        if d_ff is None:
            d_ff = 4 * d_model
        self.s4 = S4Layer(d_model, d_state, dropout, **s4_kwargs)
        self.ff = nn.Sequential(
            Linear(d_model, d_ff),
            nn.GELU(),
            nn.Dropout(dropout),
            Linear(d_ff, d_model),
            nn.Dropout(dropout),
        )
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.s4(self.norm1(x))
        return x + self.ff(self.norm2(x))

    def allocate_state(self, batch: int, device=None) -> torch.Tensor:
        return self.s4.allocate_state(batch, device)

    def step(self, x_t: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x_t`` ``(B, d_model)`` -> ``(y_t, new_state)``."""
        y, state = self.s4.step(self.norm1(x_t), state)
        x_t = x_t + y
        return x_t + self.ff(self.norm2(x_t)), state
