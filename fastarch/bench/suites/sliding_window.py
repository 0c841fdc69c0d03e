"""Sliding-window attention, ``window=(w, w)``: fastarch against ``flex_attention`` with a sliding-window
block mask (compiled), dense masked SDPA, the seed guide's Longformer attention and local-attention.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton``: :func:`fastarch.ops.attention` with ``window=(w, w)``;
- ``reference``: the guide-000 ``LongformerAttention._sliding_window_attention`` computation (dense
  L x L scores, ``masked_fill(mask == 0, -1e9)``, softmax, matmul) on the same q, k, v;
- ``sdpa-dense-mask``: ``F.scaled_dot_product_attention`` with a dense boolean band mask;
- ``flex_attention``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the band, timed
  after compilation (compilation takes minutes on CPU, so only in ``--full`` there);
- ``local-attention`` (peer, if installed): lucidrains' ``LocalAttention`` with window w, one window of
  look-back and look-ahead (bucketed windows: a superset of the exact band, so not the same function).

The issue-3 bar is the ``fwd L=8192,w=256`` case on CPU: fastarch-cpp at least 2x faster than
flex_attention. Memory is measured in ``--full`` and for the quick long case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Skip, Suite
from ..flops import attention_flops
from ..helpers import fastarch_op, randn, require_backend, require_package


def _inputs(cfg: BenchConfig, B: int, H: int, L: int, D: int, grad: bool):
    return tuple(randn(B, H, L, D, cfg=cfg, seed=s, requires_grad=grad) for s in (1, 2, 3))


def _runner(fn: Callable[..., torch.Tensor], q, k, v, grad: bool) -> Callable[[], Any]:
    if not grad:
        def run() -> Any:
            with torch.no_grad():
                return fn(q, k, v)
        return run

    def run_bwd() -> Any:
        o = fn(q, k, v)
        o.sum().backward()
        q.grad = k.grad = v.grad = None
        return o
    return run_bwd


def _guide_sliding_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int) -> torch.Tensor:
    # The seed guide's LongformerAttention._sliding_window_attention (dropout off).
    L, d_k = q.shape[2], q.shape[3]
    scores = torch.matmul(q, k.transpose(-2, -1)) / (d_k**0.5)
    pos = torch.arange(L, device=q.device)
    mask = ((pos.unsqueeze(0) - pos.unsqueeze(1)).abs() <= w).float().unsqueeze(0).unsqueeze(0)
    scores = scores.masked_fill(mask == 0, -1e9)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def _case(cfg: BenchConfig, B: int, H: int, L: int, D: int, w: int, grad: bool, memory: bool = False) -> Case:
    mode = "fwd_bwd" if grad else "fwd"

    def fastarch_provider(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            require_backend("attention", backend, cfg.device, cfg.dtype, head_dim=D, Lq=L, Lk=L, window=(w, w))
            q, k, v = _inputs(cfg, B, H, L, D, grad)
            return _runner(lambda a, b, c: attention(a, b, c, window=(w, w), backend=backend), q, k, v, grad)
        return setup

    def dense_bytes_ok() -> None:
        if B * H * L * L * 4 * 3 > 12 * 2**30:
            raise Skip(f"dense L x L scores need {B * H * L * L * 12 / 2**30:.0f} GiB")

    def ref_setup() -> Callable[[], Any]:
        dense_bytes_ok()
        q, k, v = _inputs(cfg, B, H, L, D, grad)
        return _runner(lambda a, b, c: _guide_sliding_window(a, b, c, w), q, k, v, grad)

    def sdpa_setup() -> Callable[[], Any]:
        dense_bytes_ok()
        q, k, v = _inputs(cfg, B, H, L, D, grad)
        pos = torch.arange(L, device=cfg.device)
        band = (pos[:, None] - pos[None, :]).abs() <= w
        return _runner(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=band), q, k, v, grad)

    def flex_setup() -> Callable[[], Any]:
        if cfg.quick and not cfg.is_cuda:
            raise Skip("compiling flex_attention takes minutes on CPU: --full only")
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            raise Skip(f"flex_attention unavailable: {exc}") from None

        def band(b, h, qi, kj):
            return (qi - kj <= w) & (kj - qi <= w)

        bm = create_block_mask(band, None, None, L, L, device=str(cfg.device))
        flex = torch.compile(flex_attention)
        q, k, v = _inputs(cfg, B, H, L, D, grad)
        run = _runner(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, grad)
        run()  # compile outside the timed calls
        return run

    def local_setup() -> Callable[[], Any]:
        la = require_package("local_attention")
        mod = la.LocalAttention(window_size=w, causal=False, look_backward=1, look_forward=1,
                                dim=D).to(cfg.device)
        if L % w:
            raise Skip(f"local-attention needs L divisible by the window ({L} % {w})")
        q, k, v = _inputs(cfg, B, H, L, D, grad)
        return _runner(lambda a, b, c: mod(a, b, c), q, k, v, grad)

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_provider(b)) for b in ("cpp", "triton")]
    providers += [
        Provider("reference", "reference", ref_setup),
        Provider("sdpa-dense-mask", "torch", sdpa_setup),
        Provider("flex_attention", "torch", flex_setup),
        Provider("local-attention", "peer", local_setup, peer_package="local_attention"),
    ]
    return Case(
        name=f"{mode} B={B},H={H},L={L},D={D},w={w}",
        params={"B": B, "H": H, "L": L, "D": D, "w": w, "mode": mode},
        flops=attention_flops(B, H, L, L, D, window=(w, w), mode=mode),
        providers=providers,
        reference="reference",
        group=f"{mode} w={w}",
        x="L",
        measure_memory=memory,
    )


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case(cfg, 1, 2, 128, 32, 16, g) for g in (False, True)]
    if cfg.quick:
        return [
            _case(cfg, 1, 2, 1024, 64, 64, False, memory=True),
            _case(cfg, 1, 2, 256, 64, 32, True),
        ]
    H = 8
    out = [_case(cfg, 1, H, L, 64, 256, False, memory=True) for L in (2048, 4096, 8192)]
    out += [_case(cfg, 1, H, 8192, 64, w, False) for w in (64, 128, 512)]
    out += [_case(cfg, 1, H, L, 64, 256, True) for L in (2048, 8192)]
    return out


SUITE = Suite(
    name="sliding_window",
    description="sliding-window attention (w, w): fastarch vs flex_attention (compiled), dense masked SDPA, "
                "the guide's Longformer attention, local-attention",
    cases=cases,
)
