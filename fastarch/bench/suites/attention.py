"""Full and causal attention: fastarch's backends against ``F.scaled_dot_product_attention`` and the dense
fp32 reference.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-torch``: :func:`fastarch.ops.attention` forced to each
  backend (Triton only on CUDA; the torch backend is the dense masked fp32 implementation);
- ``fastarch``: the automatic choice;
- ``sdpa``: ``F.scaled_dot_product_attention`` (the bar for CPU full/causal attention is "no slower than
  SDPA");
- ``reference``: :func:`fastarch.ops.attention_ref` (dense, fp32, materialises L x L).

Forward cases, and forward+backward cases (``fwd_bwd``: one forward and the input gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Ratio, Suite
from ..flops import attention_flops
from ..helpers import fastarch_op, qkv, require_backend, require_cuda, timed_call

BACKENDS = ("cpp", "triton", "torch")


def case(cfg: BenchConfig, B: int, H: int, L: int, D: int, causal: bool, grad: bool) -> Case:
    """One full or causal attention case with every provider; SDPA is the bar ``fastarch-cpp`` is held to."""
    mode = "fwd_bwd" if grad else "fwd"

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        return timed_call(fn, qkv(cfg, B, H, L, D, grad), grad)

    def fastarch_provider(backend: str | None) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            attention = fastarch_op("attention")
            if backend is not None:
                require_backend("attention", backend, cfg.device, cfg.dtype, head_dim=D, Lq=L, Lk=L)
            return timed(lambda a, b, c: attention(a, b, c, causal=causal, backend=backend))
        return setup

    def ref_setup() -> Callable[[], Any]:
        from fastarch.ops.attention import attention_ref

        return timed(lambda a, b, c: attention_ref(a, b, c, causal=causal))

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_provider(b)) for b in BACKENDS]
    providers += [
        Provider("fastarch", "fastarch", fastarch_provider(None)),
        Provider("sdpa", "torch", lambda: timed(lambda a, b, c: F.scaled_dot_product_attention(a, b, c,
                                                                                             is_causal=causal))),
        Provider("reference", "reference", ref_setup),
    ]
    kind = "causal" if causal else "full"
    return Case(
        name=f"{kind} {mode} B={B},H={H},L={L},D={D}",
        params={"B": B, "H": H, "L": L, "D": D, "causal": causal, "mode": mode},
        flops=attention_flops(B, H, L, L, D, causal=causal, mode=mode),
        providers=providers,
        reference="reference",
        group=f"{kind} {mode}",
        x="L",
        ratios=(Ratio("fastarch-cpp", "sdpa", target=1.0), Ratio("fastarch", "sdpa", target=1.0)),
    )


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [case(cfg, 1, 2, 64, 32, c, g) for c in (False, True) for g in (False, True)]
    if cfg.quick:
        out = [case(cfg, 1, 4, 1024, 64, c, False) for c in (False, True)]
        out += [case(cfg, 1, 4, 512, 64, True, True)]
        return out
    lengths = (1024, 2048, 4096) if not cfg.is_cuda else (2048, 4096, 8192)
    out = []
    for grad in (False, True):
        for causal in (False, True):
            for L in lengths:
                for D in ((64,) if not cfg.is_cuda else (64, 128)):
                    out.append(case(cfg, 1 if not cfg.is_cuda else 4, 8, L, D, causal, grad))
    return out


# ---- triton-attention-gpu: the Triton kernels themselves against SDPA's flash backend ----------------------
def _kernel_inputs(cfg: BenchConfig, B: int, H: int, L: int, D: int, window: tuple[int, int]):
    """q, k, v on the GPU, the kernels' keyword arguments, and the forward's (o, lse) for the backward."""
    from fastarch.kernels.attention import attention_fwd

    q, k, v = qkv(cfg, B, H, L, D)
    kw = dict(window_left=window[0], window_right=window[1], key_padding_mask=None, attn_bias=None,
              dropout_p=0.0, seed=0, scale=D ** -0.5)
    o, lse = attention_fwd(q, k, v, **kw)
    return q, k, v, kw, o, lse


def _triton(cfg: BenchConfig, B: int, H: int, L: int, D: int, window: tuple[int, int], bwd: bool
            ) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        q, k, v, kw, o, lse = _kernel_inputs(cfg, B, H, L, D, window)
        from fastarch.kernels.attention import attention_bwd, attention_fwd

        if not bwd:
            return lambda: attention_fwd(q, k, v, **kw)
        do = torch.randn_like(o)
        return lambda: attention_bwd(do, q, k, v, o, lse, need_dbias=False, **kw)
    return setup


def _sdpa_flash(cfg: BenchConfig, B: int, H: int, L: int, D: int, causal: bool, bwd: bool
                ) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(a, b, c):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal)
        q, k, v = qkv(cfg, B, H, L, D, requires_grad=bwd)
        if not bwd:
            return timed_call(flash, (q, k, v), False)
        out = flash(q, k, v)
        do = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return setup


def _kernel_cases(cfg: BenchConfig) -> list[Case]:
    """CUDA only: the Triton kernels' forward and backward (``fastarch.kernels.attention``) against SDPA's
    flash backend at B=4, H=16, L 2048-8192, D 64 and 128, full and causal (bars: forward at least 1.0x,
    backward at least 0.8x of SDPA flash), and sliding windows w = 128 ... 2048 at L=16384, whose time
    should grow with w, not L."""
    require_cuda(cfg)
    B, H = (1, 2) if cfg.toy else (4, 16)
    lengths = (256,) if cfg.toy else (2048, 4096, 8192)
    out = []
    for D in (64, 128):
        for L in lengths:
            for causal in (False, True):
                window = (-1, 0 if causal else -1)
                for bwd, target in ((False, 1.0), (True, 0.8)):
                    mode = "bwd" if bwd else "fwd"
                    kind = "causal" if causal else "full"
                    out.append(Case(
                        name=f"{kind} {mode} B={B},H={H},L={L},D={D}",
                        params={"B": B, "H": H, "L": L, "D": D, "causal": causal, "mode": mode},
                        flops=attention_flops(B, H, L, L, D, causal=causal, mode=mode),
                        providers=[Provider("fastarch-triton", "fastarch", _triton(cfg, B, H, L, D, window, bwd)),
                                   Provider("sdpa-flash", "torch", _sdpa_flash(cfg, B, H, L, D, causal, bwd))],
                        reference="sdpa-flash", group=f"{kind} {mode} D={D}", x="L",
                        ratios=(Ratio("fastarch-triton", "sdpa-flash", target=target),)))
    L, D = (512, 64) if cfg.toy else (16384, 64)
    for w in ((16,) if cfg.toy else (128, 256, 512, 1024, 2048)):
        for bwd in (False, True):
            mode = "bwd" if bwd else "fwd"
            out.append(Case(
                name=f"window {mode} B=1,H={H},L={L},D={D},w={w}",
                params={"B": 1, "H": H, "L": L, "D": D, "w": w, "mode": mode},
                flops=attention_flops(1, H, L, L, D, window=(w, w), mode=mode),
                providers=[Provider("fastarch-triton", "fastarch", _triton(cfg, 1, H, L, D, (w, w), bwd))],
                reference="fastarch-triton", group=f"window {mode}", x="w"))
    return out


SUITE = Suite(
    name="attention",
    description="full and causal attention, fwd and fwd+bwd: fastarch backends vs SDPA and the dense reference",
    cases=cases,
    case_sets={"triton-attention-gpu": _kernel_cases},
)
