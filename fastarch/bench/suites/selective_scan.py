"""Mamba's selective scan: forward and forward+backward, every fastarch backend against the reference.

Providers: ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-cuda`` / ``fastarch-torch`` (the op forced to a
backend), ``reference`` (:func:`fastarch.ops.selective_scan_ref`, mamba-ssm's ``selective_scan_ref``
semantics: it builds B x D x L x N tensors and loops over L), and the peer ``mamba-ssm`` (its CUDA
``selective_scan_fn``, GPU only). Variable B/C, D, z, delta_bias and softplus (Mamba's configuration).
The issue-5 headline is ``fwd B=2,D=1536,L=2048,N=16`` (``--full``); ``--quick`` uses L=256.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Skip, Suite
from ..helpers import require_backend, require_cuda, require_package

BACKENDS = ("cpp", "cuda", "triton", "torch")


def _inputs(cfg: BenchConfig, b: int, d: int, L: int, n: int, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    dev, dt = cfg.device, cfg.dtype

    def r(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dtype)

    ts = [r(b, d, L), r(b, d, L, scale=0.5), (-torch.rand(d, n, generator=g) - 0.5).to(dev), r(b, n, L),
          r(b, n, L), r(d, dtype=torch.float32), r(b, d, L), r(d, scale=0.1, dtype=torch.float32)]
    return [t.requires_grad_(grad) for t in ts]


def _runner(fn: Callable[..., Any], cfg: BenchConfig, shape: tuple[int, int, int, int], backward: bool
            ) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        ins = _inputs(cfg, *shape, grad=backward)
        if not backward:
            def fwd() -> Any:
                with torch.no_grad():
                    return fn(*ins)
            return fwd

        def fwd_bwd() -> Any:
            out = fn(*ins)
            return torch.autograd.grad(out, ins, torch.ones_like(out))
        return fwd_bwd
    return setup


def _fastarch(backend: str, cfg: BenchConfig, shape, backward: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        require_backend("selective_scan", backend, cfg.device, cfg.dtype, dstate=shape[3], seqlen=shape[2],
                        b_dim=3, c_dim=3)
        from fastarch.ops.selective_scan import selective_scan

        def fn(*a):
            return selective_scan(*a, delta_softplus=True, backend=backend)
        return _runner(fn, cfg, shape, backward)()
    return setup


def _reference(cfg: BenchConfig, shape, backward: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from fastarch.ops.selective_scan import selective_scan_ref

        def fn(*a):
            return selective_scan_ref(*a, delta_softplus=True)
        return _runner(fn, cfg, shape, backward)()
    return setup


def _mamba_ssm(cfg: BenchConfig, shape, backward: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        require_cuda(cfg)
        require_package("mamba_ssm")
        try:
            import mamba_ssm.ops.selective_scan_interface as mod
        except Exception as exc:  # installed but built for another torch / without its CUDA extension
            raise Skip(f"mamba_ssm failed to import: {type(exc).__name__}") from None

        def fn(*a):
            return mod.selective_scan_fn(*a, delta_softplus=True)
        return _runner(fn, cfg, shape, backward)()
    return setup


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.quick:
        shapes = [(2, 256, 256, 16)]
    else:
        shapes = [(2, 1536, 512, 16), (2, 1536, 2048, 16)]
    out = []
    for backward in (False, True):
        for shape in shapes:
            b, d, L, n = shape
            flops = 9.0 * b * d * L * n * (3 if backward else 1)  # exp + recurrence + C-contraction per element
            provs = [Provider(name=f"fastarch-{be}", kind="fastarch", setup=_fastarch(be, cfg, shape, backward))
                     for be in BACKENDS]
            provs.append(Provider(name="reference", kind="reference", setup=_reference(cfg, shape, backward)))
            provs.append(Provider(name="mamba-ssm", kind="peer", setup=_mamba_ssm(cfg, shape, backward),
                                  peer_package="mamba_ssm"))
            out.append(Case(name=f"{'fwd+bwd' if backward else 'fwd'} B={b},D={d},L={L},N={n}",
                            params={"B": b, "D": d, "L": L, "N": n}, flops=flops, providers=provs,
                            group="fwd+bwd" if backward else "fwd", x="L", measure_memory=backward))
    return out


SUITE = Suite(name="selective_scan", description="Mamba selective scan (mamba-ssm selective_scan_fn semantics)",
              cases=cases)
