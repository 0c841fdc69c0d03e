"""Norms and rotary embeddings: LayerNorm (forward and forward+backward), RMSNorm, RoPE.

Providers per case:

- ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-torch``: :func:`fastarch.ops.layer_norm`,
  :func:`fastarch.ops.rms_norm`, :func:`fastarch.ops.rotary_embedding` forced to each backend;
- ``reference``: the seed guide's composed module (guide 003: ``LayerNorm`` with the unbiased std and
  ``eps`` outside the square root; the guide's interleaved ``apply_rotary``; a composed RMSNorm);
- ``torch``: ``F.layer_norm`` / ``F.rms_norm`` (fused ATen kernels; note ``F.layer_norm`` computes the
  standard biased-variance LayerNorm, the same amount of work but not the guide's formula);
- ``rms_norm_gated`` (Mamba-2's gated RMSNorm, forward and forward+backward, ``z`` a strided slice of the
  in_proj output): the selector's choice (``fastarch``) and each backend forced, against its fp32 composition
  (``reference``); ``linear`` for decode-sized calls (1 and 8 rows, ``cpp``) and a prefill (2048 rows,
  ``aten``, forward and forward+backward) against ``F.linear``;
- peers (CUDA only): flash-attn's Triton ``layer_norm_fn``/``rms_norm_fn`` and ``apply_rotary_emb``.

The LayerNorm cases use the guide's semantics (``unbiased=True, eps_inside_sqrt=False``) so that fastarch
and the reference compute the same function. ``bytes`` is the minimum memory traffic (read x [and dy],
write y [and dx]), so GB/s shows how close each provider gets to memory bandwidth. The bar is the
``layer_norm fwd+bwd rows=8192,N=1024`` case (case set ``norms-headline``): fastarch-cpp at least 3x
faster than ``reference``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from fastarch.testing import guides

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import fastarch_op, randn, require_backend, require_cuda, require_package, timed_call

EPS = 1e-6
BACKENDS = ("cpp", "triton", "torch")


def _composed_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _guide_layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return guides.layer_norm003(x, gamma, beta, EPS)


def _guide_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Guide 003's apply_rotary (pairs 2r, 2r+1), the (L, D/2) tables broadcast over (B, H).
    return guides.apply_rotary003(x, sin[None, :, None, :], cos[None, :, None, :])


def _sizes(cfg: BenchConfig) -> tuple[list[int], list[int]]:
    """(rows, widths) per mode; quick holds the headline size rows=8192, N=1024."""
    if cfg.toy:
        return [64, 256], [128]
    if cfg.quick:
        return [1024, 8192], [1024]
    return [256, 1024, 4096, 16384, 65536], [1024, 4096]


def _norm_case(kind: str, rows: int, n: int, backward: bool, cfg: BenchConfig) -> Case:
    op_name = "layer_norm" if kind == "layer_norm" else "rms_norm"
    mode = "fwd+bwd" if backward else "fwd"

    def inputs() -> list[torch.Tensor]:
        x = randn(rows, n, cfg=cfg, seed=1, requires_grad=backward)
        w = (1 + 0.1 * randn(n, cfg=cfg, seed=2)).detach().requires_grad_(backward)
        if kind == "layer_norm":
            b = (0.1 * randn(n, cfg=cfg, seed=3)).detach().requires_grad_(backward)
            return [x, w, b]
        return [x, w]

    def fastarch_setup(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op(op_name)
            require_backend(op_name, backend, cfg.device, cfg.dtype, n=n)
            if kind == "layer_norm":
                fn = lambda x, w, b: op(x, w, b, EPS, unbiased=True, eps_inside_sqrt=False, backend=backend)
            else:
                fn = lambda x, w: op(x, w, EPS, backend=backend)
            return timed_call(fn, inputs(), backward)
        return setup

    def reference() -> Callable[[], Any]:
        return timed_call(_guide_layer_norm if kind == "layer_norm" else _composed_rms_norm, inputs(), backward)

    def torch_fused() -> Callable[[], Any]:
        if kind == "layer_norm":
            return timed_call(lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS), inputs(), backward)
        if not hasattr(F, "rms_norm"):
            raise Skip(f"F.rms_norm needs torch >= 2.4 (have {torch.__version__})")
        return timed_call(lambda x, w: F.rms_norm(x, (n,), w, EPS), inputs(), backward)

    def flash_attn_peer() -> Callable[[], Any]:
        require_cuda(cfg)
        mod = require_package("flash_attn.ops.triton.layer_norm")
        if kind == "layer_norm":
            return timed_call(lambda x, w, b: mod.layer_norm_fn(x, w, b, eps=EPS), inputs(), backward)
        return timed_call(lambda x, w: mod.rms_norm_fn(x, w, None, eps=EPS), inputs(), backward)

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_setup(b)) for b in BACKENDS]
    providers += [
        Provider("reference", "reference", reference),
        Provider("torch", "torch", torch_fused),
        Provider("flash-attn", "peer", flash_attn_peer, peer_package="flash_attn"),
    ]
    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    traffic = (5 if backward else 2) * rows * n * elt  # x,y | x,y + dy,x,dx
    return Case(
        name=f"{kind} {mode} rows={rows},N={n}", params={"rows": rows, "N": n, "mode": mode},
        flops=None, bytes=float(traffic), providers=providers, group=f"{kind} {mode} N={n}", x="rows",
        measure_memory=(rows == 8192 or cfg.toy and rows == max(_sizes(cfg)[0])) and backward,
        ratios=(Ratio("fastarch-cpp", "reference"), Ratio("fastarch-cpp", "torch")),
    )


def _rotary_case(batch: int, seq: int, heads: int, dim: int, backward: bool, cfg: BenchConfig) -> Case:
    mode = "fwd+bwd" if backward else "fwd"

    def tables() -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(seq, dtype=torch.float32)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        ang = pos * inv[None, :]
        return ang.cos().to(cfg.device, cfg.dtype), ang.sin().to(cfg.device, cfg.dtype)

    def inputs() -> list[torch.Tensor]:
        return [randn(batch, seq, heads, dim, cfg=cfg, seed=4, requires_grad=backward), *tables()]

    def fastarch_setup(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            op = fastarch_op("rotary_embedding")
            require_backend("rotary", backend, cfg.device, cfg.dtype)
            return timed_call(lambda x, c, s: op(x, c, s, interleaved=True, backend=backend), inputs(), backward)
        return setup

    def flash_attn_peer() -> Callable[[], Any]:
        require_cuda(cfg)
        mod = require_package("flash_attn.layers.rotary")
        return timed_call(lambda x, c, s: mod.apply_rotary_emb(x, c, s, interleaved=True), inputs(), backward)

    providers = [Provider(f"fastarch-{b}", "fastarch", fastarch_setup(b)) for b in BACKENDS]
    providers += [
        Provider("reference", "reference", lambda: timed_call(_guide_rotary, inputs(), backward)),
        Provider("flash-attn", "peer", flash_attn_peer, peer_package="flash_attn"),
    ]
    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    n = batch * seq * heads * dim
    return Case(
        name=f"rotary {mode} B={batch},L={seq},H={heads},D={dim}",
        params={"B": batch, "L": seq, "H": heads, "D": dim, "mode": mode},
        flops=6.0 * n / 2 * (2 if backward else 1),  # per pair: 4 mul + 2 add
        bytes=float((4 if backward else 2) * n * elt), providers=providers, group=f"rotary {mode}", x="L",
    )


def _gated_case(rows: int, n: int, groups: int, backward: bool, cfg: BenchConfig) -> Case:
    """Mamba-2's gated, grouped RMSNorm (``norm_before_gate=False``) against its fp32 composition, with ``z``
    a slice of the in_proj output (row stride ``2n + 280``: 3352 at n=1536, Mamba-2 2.7B's width), as the
    model passes it. ``fastarch`` is the selector's choice, ``fastarch-<backend>`` each backend forced."""
    mode = "fwd+bwd" if backward else "fwd"
    width = 2 * n + 280

    def inputs() -> list[torch.Tensor]:
        return [randn(rows, n, cfg=cfg, seed=5, requires_grad=backward),
                (1 + 0.1 * randn(n, cfg=cfg, seed=6)).detach().requires_grad_(backward),
                randn(rows, width, cfg=cfg, seed=7, requires_grad=backward)]

    def run(fn: Callable[..., Any], **kw: Any) -> Callable[[], Any]:
        return timed_call(lambda x, w, proj: fn(x, w, None, proj[:, n:2 * n], EPS, n // groups, False, **kw),
                          inputs(), backward)

    def forced(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("rms_norm_gated", backend, cfg.device, cfg.dtype, n=n, group_size=n // groups)
            return run(fastarch_op("rms_norm_gated"), backend=backend)
        return setup

    from fastarch.ops import rms_norm_gated_ref

    elt = torch.tensor([], dtype=cfg.dtype).element_size()
    traffic = (7 if backward else 3) * rows * n * elt  # x,z,y | x,z,y + dy,x,z,dx,dz
    providers = [Provider("fastarch", "fastarch", lambda: run(fastarch_op("rms_norm_gated")))]
    providers += [Provider(f"fastarch-{b}", "fastarch", forced(b)) for b in ("cpp", "torch")]
    providers.append(Provider("reference", "reference", lambda: run(rms_norm_gated_ref)))
    return Case(name=f"rms_norm_gated {mode} rows={rows},N={n},groups={groups}",
                params={"rows": rows, "N": n, "groups": groups, "mode": mode}, flops=None, bytes=float(traffic),
                providers=providers, group=f"rms_norm_gated {mode}", x="rows",
                ratios=(Ratio("fastarch", "reference"), Ratio("fastarch-cpp", "reference"),
                        Ratio("fastarch-cpp", "fastarch-torch")))


def _linear_case(rows: int, n_in: int, n_out: int, cfg: BenchConfig, backward: bool = False) -> Case:
    """``ops.linear`` against ``F.linear``: a decode-sized call (a few rows: the weight read dominates) on the
    ``cpp`` kernel, a prefill's rows on ``aten`` (oneDNN's GEMM for fp32 on CPU); forward or forward+backward."""
    from fastarch.ops.linear import CPP_MAX_ROWS

    backend = "cpp" if rows <= CPP_MAX_ROWS else "aten"
    mode = "fwd+bwd" if backward else "fwd"

    def inputs() -> list[torch.Tensor]:
        return [randn(rows, n_in, cfg=cfg, seed=8, requires_grad=backward),
                randn(n_out, n_in, cfg=cfg, seed=9, scale=0.02, requires_grad=backward)]

    def ours() -> Callable[[], Any]:
        require_backend("linear", backend, cfg.device, cfg.dtype)
        op = fastarch_op("linear")
        return timed_call(lambda x, w: op(x, w, backend=backend), inputs(), backward)

    name = f"fastarch-{backend}"
    return Case(name=f"linear {mode} rows={rows},in={n_in},out={n_out}",
                params={"rows": rows, "in": n_in, "out": n_out, "mode": mode},
                flops=(3 if backward else 1) * 2.0 * rows * n_in * n_out, bytes=float(n_in * n_out * 4),
                providers=[Provider(name, "fastarch", ours),
                           Provider("torch", "torch", lambda: timed_call(F.linear, inputs(), backward))],
                reference="torch", group=f"linear {mode}", x="rows", ratios=(Ratio(name, "torch"),))


def cases(cfg: BenchConfig) -> list[Case]:
    rows_list, widths = _sizes(cfg)
    # Quick mode keeps the sweep only for the headline (LayerNorm fwd+bwd) and the largest size
    # elsewhere, to stay inside the 3-minute budget shared by all suites.
    few = rows_list[-1:] if cfg.quick and not cfg.toy else rows_list
    out: list[Case] = []
    for n in widths:
        # Cap inputs at 64M elements (256 MB in fp32): the composed reference's backward holds several copies.
        sweep = [r for r in rows_list if r * n <= 1 << 26]
        small = [r for r in few if r * n <= 1 << 26]
        out.extend(_norm_case("layer_norm", rows, n, True, cfg) for rows in sweep)
        out.extend(_norm_case("layer_norm", rows, n, False, cfg) for rows in small)
        out.extend(_norm_case("rms_norm", rows, n, True, cfg) for rows in small)
        if not cfg.quick:
            out.extend(_norm_case("rms_norm", rows, n, False, cfg) for rows in sweep)
    if cfg.toy:
        seqs = [32, 64]
    elif cfg.quick:
        seqs = [2048]
    else:
        seqs = [256, 1024, 4096, 16384]
    for backward in ((False,) if cfg.quick else (False, True)):
        for seq in seqs:
            out.append(_rotary_case(2, seq, 8, 64, backward, cfg))
    out.extend(_gated_case(64 if cfg.toy else 2048, 128 if cfg.toy else 1536, 1, backward, cfg)
               for backward in (False, True))
    n_in, n_out = (128, 256) if cfg.toy else (768, 3352)
    out.extend(_linear_case(rows, n_in, n_out, cfg) for rows in (1, 8))
    prefill = 64 if cfg.toy else 2048  # a prefill's rows: oneDNN's GEMM against PyTorch's BLAS
    out.extend(_linear_case(prefill, n_in, n_out, cfg, backward) for backward in (False, True))
    return out


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """The fused C++ LayerNorm forward+backward against guide 003's composed LayerNorm, rows=8192,
    N=1024 (bar: 3x)."""
    rows, n = (256, 128) if cfg.toy else (8192, 1024)
    c = _norm_case("layer_norm", rows, n, True, cfg)
    return [replace(c, ratios=(Ratio("fastarch-cpp", "reference", target=3.0), *c.ratios[1:]))]


SUITE = Suite(
    name="norms",
    description="LayerNorm (guide-003 semantics) fwd and fwd+bwd, RMSNorm, rotary embedding",
    cases=cases,
    case_sets={"norms-headline": headline_cases},
)
