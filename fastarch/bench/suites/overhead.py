"""Per-call cost at decode sizes: fastarch's op against the PyTorch call it replaces, at 1 and 2 threads.

A decode step is dozens of tiny calls, so what a call costs above its arithmetic (validation, the backend
decision, the custom op's dispatch) decides whether a model is faster with fastarch. Each timed iteration
runs ``CALLS`` calls of the op (inference mode, no autograd: how a decode loop runs them), so the table's
times are ``CALLS`` calls and the ratios are per call. Cases:

- ``rms_norm`` 1x256 and 1x4096 against ``F.rms_norm``; ``layer_norm`` 1x1024 against ``F.layer_norm``;
- ``rotary`` on one token (B=1, H=8, D=64) against the rotate-half composition transformers' Llama runs;
- decode ``attention`` (B=1, H=8, one query over 64 and over 4096 cached keys, D=64) against SDPA;
- ``causal_conv1d_update`` (B=1, D=1536, W=4) against transformers' PyTorch fallback (concatenate, shift
  the state, grouped ``conv1d``, SiLU);
- ``selective_state_update`` (B=1, D=1536, N=16) against transformers' PyTorch fallback formula;
- ``linear`` on one row (1024 -> 1024) against ``F.linear``;
- a whole Mamba-2 mixer decode step (``mamba2_mixer_step``, d_model 768, 24 heads of 64, d_state 128, B=1)
  against the same step as transformers' PyTorch path computes it, call by call;
- a Llama decoder layer's decode step (``decoder_qkv_step`` + ``decoder_out_step``, hidden 256, 8 heads with
  2 key/value heads, 64 cached keys) against the same step as transformers' Llama layer computes it.

Providers: ``fastarch`` (the selector's choice) and ``torch`` (the call it replaces); the ratio
``fastarch`` over ``torch`` has the target 1 (at least as fast). Thread counts are set in each provider's
set-up (``threads`` in the case parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Ratio, Suite
from ..helpers import fastarch_op, randn

CALLS = 200


def _repeat(fn: Callable[[], Any], threads: int) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        torch.set_num_threads(threads)

        def run() -> Any:
            with torch.inference_mode():
                for _ in range(CALLS):
                    out = fn()
            return out

        return run

    return setup


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _calls(cfg: BenchConfig) -> list[tuple[str, dict[str, int], Callable[[], Any], Callable[[], Any]]]:
    """(name, params, fastarch call, torch call) per case, on shared inputs."""
    ops = fastarch_op
    out = []
    for n in (256, 4096):
        x, w = randn(1, n, cfg=cfg, seed=1), randn(n, cfg=cfg, seed=2)
        out.append((f"rms_norm 1x{n}", {"rows": 1, "n": n},
                    lambda x=x, w=w: ops("rms_norm")(x, w, 1e-6),
                    lambda x=x, w=w, n=n: F.rms_norm(x, (n,), w, 1e-6)))
    x, w, b = randn(1, 1024, cfg=cfg, seed=3), randn(1024, cfg=cfg, seed=4), randn(1024, cfg=cfg, seed=5)
    out.append(("layer_norm 1x1024", {"rows": 1, "n": 1024},
                lambda: ops("layer_norm")(x, w, b, 1e-5), lambda: F.layer_norm(x, (1024,), w, b, 1e-5)))

    q = randn(1, 1, 8, 64, cfg=cfg, seed=6)  # (B, L, H, D), one token
    cos, sin = torch.cos(randn(1, 32, cfg=cfg, seed=7)), torch.sin(randn(1, 32, cfg=cfg, seed=7))
    cos_full, sin_full = torch.cat([cos, cos], -1)[None, :, None], torch.cat([sin, sin], -1)[None, :, None]
    out.append(("rotary 1 token", {"L": 1, "H": 8, "D": 64},
                lambda: ops("rotary_embedding")(q, cos, sin),
                lambda: q * cos_full + _rotate_half(q) * sin_full))

    for lk in (64, 4096):
        qd = randn(1, 8, 1, 64, cfg=cfg, seed=8)
        kd, vd = randn(1, 8, lk, 64, cfg=cfg, seed=9), randn(1, 8, lk, 64, cfg=cfg, seed=10)
        out.append((f"decode attention Lk={lk}", {"Lq": 1, "Lk": lk, "H": 8, "D": 64},
                    lambda qd=qd, kd=kd, vd=vd: ops("attention")(qd, kd, vd, causal=True),
                    lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd)))

    D, W, N = 1536, 4, 16
    xc, wc, bc = randn(1, D, cfg=cfg, seed=11), randn(D, W, cfg=cfg, seed=12), randn(D, cfg=cfg, seed=13)
    state_a, state_b = randn(1, D, W, cfg=cfg, seed=14), randn(1, D, W, cfg=cfg, seed=14)

    def conv_torch() -> torch.Tensor:
        full = torch.cat([state_b, xc[..., None]], dim=-1)
        state_b.copy_(full[..., -W:])
        return F.silu(F.conv1d(full, wc[:, None, :], bc, groups=D)[..., -1])

    out.append(("causal_conv1d_update", {"B": 1, "D": D, "W": W},
                lambda: ops("causal_conv1d_update")(xc, state_a, wc, bc, "silu"), conv_torch))

    xs, dt, z = randn(1, D, cfg=cfg, seed=15), randn(1, D, cfg=cfg, seed=16), randn(1, D, cfg=cfg, seed=17)
    A = -torch.exp(randn(D, N, cfg=cfg, seed=18))
    Bm, Cm, Dv, dt_bias = (randn(1, N, cfg=cfg, seed=19), randn(1, N, cfg=cfg, seed=20),
                           randn(D, cfg=cfg, seed=21), randn(D, cfg=cfg, seed=22))
    ssm_a, ssm_b = torch.zeros(1, D, N, device=cfg.device), torch.zeros(1, D, N, device=cfg.device)

    def ssu_torch() -> torch.Tensor:
        delta = F.softplus(dt + dt_bias)
        ssm_b.mul_(torch.exp(delta[..., None] * A)).add_(delta[..., None] * Bm[:, None, :] * xs[..., None])
        y = (ssm_b @ Cm[..., None])[..., 0] + Dv * xs
        return y * F.silu(z)

    out.append(("selective_state_update", {"B": 1, "D": D, "N": N},
                lambda: ops("selective_state_update")(ssm_a, xs, dt, A, Bm, Cm, Dv, z, dt_bias, True),
                ssu_torch))

    xl, wl, bl = randn(1, 1024, cfg=cfg, seed=23), randn(1024, 1024, cfg=cfg, seed=24), randn(1024, cfg=cfg, seed=25)
    out.append(("linear 1 row", {"rows": 1, "K": 1024, "N": 1024},
                lambda: ops("linear")(xl, wl, bl), lambda: F.linear(xl, wl, bl)))
    out.append(_mamba2_step_case(cfg))
    out.append(_decoder_step_case(cfg))
    return out


def _mamba2_step_case(cfg: BenchConfig) -> tuple[str, dict[str, int], Callable[[], Any], Callable[[], Any]]:
    """One Mamba-2 mixer decode step (d_model 768, 24 heads of 64, d_state 128, one group, B=1): the fused
    ``mamba2_mixer_step`` against the step as transformers' PyTorch path computes it, call by call."""
    Dm, H, P, N, G, W = 768, 24, 64, 128, 1, 4
    E, Cd = H * P, H * P + 2 * G * N

    def w(*shape: int, seed: int) -> torch.Tensor:
        return randn(*shape, cfg=cfg, seed=seed) * shape[-1] ** -0.5

    x = randn(1, Dm, cfg=cfg, seed=30)
    in_w, conv_w, conv_b = w(2 * E + 2 * G * N + H, Dm, seed=31), w(Cd, W, seed=32), randn(Cd, cfg=cfg, seed=33)
    dt_bias, A_log, Dv = randn(H, cfg=cfg, seed=34), torch.log(torch.rand(H) + 0.5).to(cfg.device), randn(H, cfg=cfg, seed=35)
    norm_w, out_w = 1 + 0.1 * randn(E, cfg=cfg, seed=36), w(Dm, E, seed=37)
    conv_a, conv_b_state = torch.zeros(1, Cd, W - 1, device=cfg.device), torch.zeros(1, Cd, W, device=cfg.device)
    ssm_a, ssm_b = torch.zeros(1, H, P, N, device=cfg.device), torch.zeros(1, H, P, N, device=cfg.device)
    A = -torch.exp(A_log)

    def fused() -> torch.Tensor:
        return fastarch_op("mamba2_mixer_step")(x, in_w, None, conv_w, conv_b, dt_bias, A_log, Dv, norm_w, out_w,
                                                None, conv_a, ssm_a, G, 1e-5, E // G, False)

    def plain() -> torch.Tensor:
        z, xBC, dt = torch.split(F.linear(x, in_w), [E, Cd, H], dim=-1)
        conv_b_state.copy_(torch.roll(conv_b_state, -1, -1))
        conv_b_state[:, :, -1] = xBC
        xBC = F.silu((conv_b_state * conv_w).sum(-1) + conv_b)
        xs, Bm, Cm = torch.split(xBC, [E, G * N, G * N], dim=-1)
        dt = F.softplus(dt + dt_bias)
        dA = torch.exp(dt * A)
        xh = xs.view(1, H, P)
        ssm_b.mul_(dA[:, :, None, None]).add_((dt[:, :, None] * xh)[..., None] * Bm.view(1, 1, 1, N))
        y = (ssm_b @ Cm.view(1, 1, N, 1))[..., 0] + Dv[:, None] * xh
        y = y.reshape(1, E) * F.silu(z)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
        return F.linear(y, out_w)

    return "mamba2_mixer_step d_model 768", {"B": 1, "d_model": Dm, "H": H, "P": P, "N": N}, fused, plain


def _decoder_step_case(cfg: BenchConfig) -> tuple[str, dict[str, int], Callable[[], Any], Callable[[], Any]]:
    """One Llama decoder layer's decode step (hidden 256, 8 heads of 32 with 2 key/value heads, MLP 512, 64 cached
    keys, B=1): the two fused halves (``decoder_qkv_step``, ``decoder_out_step``) against the step as
    transformers' Llama layer computes it, call by call (the cache write left out of both)."""
    d, H, Hk, D, I, S = 256, 8, 2, 32, 512, 64

    def w(*shape: int, seed: int) -> torch.Tensor:
        return randn(*shape, cfg=cfg, seed=seed) * shape[-1] ** -0.5

    x = randn(1, d, cfg=cfg, seed=40)
    n1, n2 = 1 + 0.1 * randn(d, cfg=cfg, seed=41), 1 + 0.1 * randn(d, cfg=cfg, seed=42)
    q_w, k_w, v_w, o_w = w(H * D, d, seed=43), w(Hk * D, d, seed=44), w(Hk * D, d, seed=45), w(d, H * D, seed=46)
    gate, up, down = w(I, d, seed=47), w(I, d, seed=48), w(d, I, seed=49)
    keys, values = randn(1, Hk, S, D, cfg=cfg, seed=50), randn(1, Hk, S, D, cfg=cfg, seed=51)
    angles = randn(1, D // 2, cfg=cfg, seed=52)
    cos, sin = angles.cos(), angles.sin()
    cos_full, sin_full = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    qkv_op, out_op = fastarch_op("decoder_qkv_step"), fastarch_op("decoder_out_step")

    def fused() -> torch.Tensor:
        q, _, _ = qkv_op(x, n1, q_w, k_w, v_w, None, None, None, cos, sin, H, Hk, 1e-5)
        return out_op(q, keys, values, x, o_w, None, n2, gate, up, down, S, -1, None, 1e-5)

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5))

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos_full + torch.cat([-t[..., D // 2:], t[..., : D // 2]], -1) * sin_full

    def plain() -> torch.Tensor:
        h = rms(x, n1)
        q = rotate(F.linear(h, q_w).view(1, 1, H, D).transpose(1, 2))
        rotate(F.linear(h, k_w).view(1, 1, Hk, D).transpose(1, 2))
        F.linear(h, v_w)
        a = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        h = x + F.linear(a.transpose(1, 2).reshape(1, H * D), o_w)
        m = rms(h, n2)
        return h + F.linear(F.silu(F.linear(m, gate)) * F.linear(m, up), down)

    return "decoder layer step d_model 256", {"B": 1, "d_model": d, "H": H, "Hk": Hk, "S": S}, fused, plain


def cases(cfg: BenchConfig) -> list[Case]:
    out = []
    for threads in (1, 2):
        for name, params, fast, plain in _calls(cfg):
            out.append(Case(
                name=f"{name} threads={threads}", params={**params, "threads": threads, "calls": CALLS},
                flops=None, group=name, x="threads", reference="torch",
                providers=[Provider("fastarch", "fastarch", _repeat(fast, threads)),
                           Provider("torch", "torch", _repeat(plain, threads))],
                ratios=(Ratio("fastarch", "torch", target=1.0),)))
    return out


SUITE = Suite(name="overhead", description="per-call cost at decode sizes against the PyTorch call replaced",
              cases=cases)
