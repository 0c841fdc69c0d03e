"""Sliding-window attention, ``window=(w, w)``: fastarch against ``flex_attention`` with a sliding-window
block mask (compiled), dense masked SDPA, the seed guide's Longformer attention and local-attention.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton``: :func:`fastarch.ops.attention` with ``window=(w, w)``;
- ``reference``: guide 000's ``LongformerAttention._sliding_window_attention`` (dense L x L scores,
  ``masked_fill(mask == 0, -1e9)``, softmax, matmul) on the same q, k, v;
- ``sdpa-dense-mask``: ``F.scaled_dot_product_attention`` with a dense boolean band mask;
- ``flex_attention``: ``torch.compile(flex_attention)`` with ``create_block_mask`` of the band, timed
  after compilation (compilation takes minutes on CPU, so only in ``--full`` there);
- ``local-attention`` (peer, if installed): lucidrains' ``LocalAttention`` with window w, one window of
  look-back and look-ahead (bucketed windows: a superset of the exact band, so not the same function).

The bar is the ``fwd L=8192,w=256`` case on CPU: fastarch-cpp at least 2x faster than flex_attention
(case set ``attention-headline``, with full/causal attention against SDPA and the long-sequence memory).
Memory is measured in ``--full`` and for the quick long case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..flops import attention_flops
from ..helpers import fastarch_op, qkv, require_backend, require_package, timed_call
from . import attention


def _case(cfg: BenchConfig, B: int, H: int, L: int, D: int, w: int, grad: bool, memory: bool = False,
          flex_on_cpu: bool = False) -> Case:
    mode = "fwd_bwd" if grad else "fwd"

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        return timed_call(fn, qkv(cfg, B, H, L, D, grad), grad)

    def fastarch_provider(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            require_backend("attention", backend, cfg.device, cfg.dtype, head_dim=D, Lq=L, Lk=L, window=(w, w))
            return timed(lambda a, b, c: attention(a, b, c, window=(w, w), backend=backend))
        return setup

    def dense_bytes_ok() -> None:
        if B * H * L * L * 4 * 3 > 12 * 2**30:
            raise Skip(f"dense L x L scores need {B * H * L * L * 12 / 2**30:.0f} GiB")

    def ref_setup() -> Callable[[], Any]:
        dense_bytes_ok()
        from fastarch.testing.guides import LongformerAttention

        guide = LongformerAttention(D * H, H, window_size=w, dropout=0.0).to(cfg.device)
        return timed(lambda a, b, c: guide._sliding_window_attention(a, b, c, w))

    def sdpa_setup() -> Callable[[], Any]:
        dense_bytes_ok()
        pos = torch.arange(L, device=cfg.device)
        band = (pos[:, None] - pos[None, :]).abs() <= w
        return timed(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=band))

    def flex_setup() -> Callable[[], Any]:
        if cfg.quick and not cfg.is_cuda and not flex_on_cpu:
            raise Skip("compiling flex_attention takes minutes on CPU: --full only")
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            raise Skip(f"flex_attention unavailable: {exc}") from None

        def band(b, h, qi, kj):
            return (qi - kj <= w) & (kj - qi <= w)

        bm = create_block_mask(band, None, None, L, L, device=str(cfg.device))
        flex = torch.compile(flex_attention)
        run = timed(lambda a, b, c: flex(a, b, c, block_mask=bm))
        run()  # compile outside the timed calls
        return run

    def local_setup() -> Callable[[], Any]:
        la = require_package("local_attention")
        mod = la.LocalAttention(window_size=w, causal=False, look_backward=1, look_forward=1,
                                dim=D).to(cfg.device)
        if L % w:
            raise Skip(f"local-attention needs L divisible by the window ({L} % {w})")
        return timed(mod)

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
        ratios=(Ratio("fastarch-cpp", "flex_attention"), Ratio("fastarch-cpp", "sdpa-dense-mask"),
                Ratio("fastarch-cpp", "local-attention")),
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


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """CPU attention headline, B=1, H=8, D=64, fp32: the sliding window (256, 256) at L=8192 against
    compiled flex_attention (bar: 2x), dense masked SDPA and local-attention; full and causal attention at
    L=4096 against SDPA; the window's forward+backward at L=8192; and the peak memory of a window-128
    forward at L=65536."""
    L, L_full, L_mem = (256, 128, 512) if cfg.toy else (8192, 4096, 65536)
    w, w_mem = (16, 8) if cfg.toy else (256, 128)
    window = _case(cfg, 1, 8, L, 64, w, False, flex_on_cpu=True)
    window = window.only("fastarch-cpp", "fastarch-triton", "flex_attention", "sdpa-dense-mask", "local-attention")
    window = replace(window, ratios=(Ratio("fastarch-cpp", "flex_attention", target=2.0), *window.ratios[1:]))
    full = [attention.case(cfg, 1, 8, L_full, 64, causal, False).only("fastarch-cpp", "sdpa")
            for causal in (False, True)]
    bwd = _case(cfg, 1, 8, L, 64, w, True).only("fastarch-cpp")
    mem = replace(_case(cfg, 1, 8, L_mem, 64, w_mem, False).only("fastarch-cpp"), measure_memory=True)
    return [window, *full, bwd, mem]


SUITE = Suite(
    name="sliding_window",
    description="sliding-window attention (w, w): fastarch vs flex_attention (compiled), dense masked SDPA, "
                "the guide's Longformer attention, local-attention",
    cases=cases,
    case_sets={"attention-headline": headline_cases},
)
