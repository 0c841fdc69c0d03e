"""Mamba's selective scan: forward and forward+backward, every fastarch backend against the reference.

Providers: ``fastarch-cpp`` / ``fastarch-triton`` / ``fastarch-cuda`` / ``fastarch-torch`` (the op forced to a
backend), ``reference`` (:func:`fastarch.ops.selective_scan_ref`, mamba-ssm's ``selective_scan_ref``
semantics: it builds B x D x L x N tensors and loops over L), ``guide`` (forward cases only: the guide's
``MambaBlock.selective_scan`` loop, :class:`fastarch.testing.guides.MambaBlock`, with the softplus, D skip and
SiLU gate its ``forward`` wraps around it, on the same inputs; target: fastarch-cpp at least 50x faster), and
the peer ``mamba-ssm`` (its CUDA ``selective_scan_fn``, GPU only). Variable B/C, D, z, delta_bias and softplus
(Mamba's configuration).
The headline is ``fwd B=2,D=1536,L=2048,N=16`` (``--full`` and the case set ``selective-scan-headline``);
``--quick`` uses small sizes.

``--full`` also has: forward+backward at L=256 with the reference's autograd (it is too slow to time at
L=2048, where the case runs without it), an N=64 forward+backward at the same B*D*L as the N=16 one (peak
memory has no N factor beyond the N/64 checkpoints), and the guide's ``MambaBlock`` (d_model=768, L=2048,
batch 1, forward+backward; :class:`fastarch.testing.guides.MambaBlock`) against :class:`fastarch.nn.MambaBlock`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fastarch.testing import guides

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import require_backend, require_cuda, require_package, timed_call

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
    return lambda: timed_call(fn, _inputs(cfg, *shape, grad=backward), backward)


def _fastarch(backend: str, cfg: BenchConfig, shape, backward: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        require_backend("selective_scan", backend, cfg.device, cfg.dtype, dstate=shape[3], seqlen=shape[2],
                        b_dim=3, c_dim=3)
        from fastarch.ops.selective_scan import selective_scan

        def fn(*a):
            return selective_scan(*a, delta_softplus=True, backend=backend)
        run = _runner(fn, cfg, shape, backward)()
        run()  # warm-up outside the timed region (extension load, first custom-op call)
        return run
    return setup


REF_FWD_BWD_MAX_L = 512  # the reference's autograd beyond this takes minutes on a CPU


def _reference(cfg: BenchConfig, shape, backward: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from fastarch.ops.selective_scan import selective_scan_ref

        if backward and not cfg.is_cuda and shape[2] > REF_FWD_BWD_MAX_L:
            raise Skip(f"reference autograd too slow on CPU at L={shape[2]}; see the L=256 case")

        def fn(*a):
            return selective_scan_ref(*a, delta_softplus=True)
        return _runner(fn, cfg, shape, backward)()
    return setup


GUIDE_SCAN_TARGET = 50.0  # fastarch-cpp's forward against the guide's loop


def guide_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor) -> torch.Tensor:
    """The guide's ``MambaBlock.selective_scan`` on mamba-ssm-layout inputs, with what the guide's ``forward``
    does around it (softplus of delta, the D skip, the SiLU gate of z).

    Shapes: u, delta, z and the result ``(B, D, L)``; A ``(D, N)``; B, C ``(B, N, L)``; D, delta_bias ``(D,)``.
    The loop works in ``(B, L, D)``, so inputs are transposed in and the result out."""
    x = u.transpose(1, 2)
    dt = F.softplus(delta + delta_bias[:, None]).transpose(1, 2)
    y = guides.MambaBlock.selective_scan(None, x, dt, A, B.transpose(1, 2), C.transpose(1, 2))
    return ((y + x * D) * F.silu(z.transpose(1, 2))).transpose(1, 2)


def _guide(cfg: BenchConfig, shape) -> Callable[[], Callable[[], Any]]:
    return _runner(guide_scan, cfg, shape, False)


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


GuideMambaBlock = guides.MambaBlock


def _block(cfg: BenchConfig, d_model: int, L: int, fastarch: bool) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        from fastarch.nn import MambaBlock

        torch.manual_seed(cfg.seed)
        guide = guides.MambaBlock(d_model).eval()
        m = guide
        if fastarch:
            m = MambaBlock(d_model).eval()
            m.load_state_dict(guide.state_dict())
        m = m.to(cfg.device)
        x = torch.randn(1, L, d_model, device=cfg.device, requires_grad=True)

        def run() -> Any:
            m.zero_grad(set_to_none=True)
            return torch.autograd.grad(m(x).sum(), [x, *m.parameters()])
        run()  # warm-up outside the timed region (extension load)
        return run
    return setup


def _scan_case(cfg: BenchConfig, shape: tuple[int, int, int, int], backward: bool, tag: str = "") -> Case:
    b, d, L, n = shape
    flops = 9.0 * b * d * L * n * (3 if backward else 1)  # exp + recurrence + C-contraction per element
    provs = [Provider(name=f"fastarch-{be}", kind="fastarch", setup=_fastarch(be, cfg, shape, backward))
             for be in BACKENDS]
    provs.append(Provider(name="reference", kind="reference", setup=_reference(cfg, shape, backward)))
    ratios = [Ratio("fastarch-cpp", "reference")]
    if not backward:
        provs.append(Provider(name="guide", kind="reference", setup=_guide(cfg, shape)))
        ratios.append(Ratio("fastarch-cpp", "guide", target=GUIDE_SCAN_TARGET))
    provs.append(Provider(name="mamba-ssm", kind="peer", setup=_mamba_ssm(cfg, shape, backward),
                          peer_package="mamba_ssm"))
    return Case(name=f"{'fwd+bwd' if backward else 'fwd'}{tag} B={b},D={d},L={L},N={n}",
                params={"B": b, "D": d, "L": L, "N": n}, flops=flops, providers=provs,
                group=("fwd+bwd" if backward else "fwd") + tag, x="L", measure_memory=backward,
                ratios=tuple(ratios))


def _aux_case(cfg: BenchConfig, name: str, op: str, make_inputs: Callable[[], list[torch.Tensor]],
              call: Callable[..., Any], ref: Callable[..., Any], backward: bool, features: dict) -> Case:
    """A case for the scan's companion ops (causal conv, decode steps): each backend vs the reference."""

    def timed(fn: Callable[..., Any]) -> Callable[[], Any]:
        ins = [t.requires_grad_(backward and t.is_floating_point()) for t in make_inputs()]
        return timed_call(fn, ins, backward)

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend(op, backend, cfg.device, cfg.dtype, **features)
            return timed(lambda *a: call(*a, backend=backend))
        return setup

    providers = [Provider(f"fastarch-{b}", "fastarch", ours(b)) for b in ("cpp", "triton", "torch")]
    providers.append(Provider("reference", "reference", lambda: timed(ref)))
    return Case(name=name, params=dict(features), flops=None, providers=providers, group=name.split(" ")[0],
                ratios=(Ratio("fastarch-cpp", "fastarch-torch"), Ratio("fastarch-cpp", "reference")))


def _aux_cases(cfg: BenchConfig, sizes: tuple[int, int, int, int, int] | None = None) -> list[Case]:
    from fastarch.ops import (
        causal_conv1d,
        causal_conv1d_ref,
        causal_conv1d_update,
        causal_conv1d_update_ref,
        selective_state_update,
        selective_state_update_ref,
    )

    b, d, L, w, n = sizes or ((2, 256, 512, 4, 16) if cfg.quick else (2, 1536, 2048, 4, 16))
    g = torch.Generator().manual_seed(cfg.seed)

    def r(*shape, dtype=cfg.dtype):
        return torch.randn(*shape, generator=g).to(device=cfg.device, dtype=dtype)

    conv = lambda: [r(b, d, L), r(d, w), r(d)]  # noqa: E731
    step = lambda: [r(b, d), r(b, d, w), r(d, w), r(d)]  # noqa: E731
    ssu = lambda: [r(b, d, n), r(b, d), r(b, d), -torch.rand(d, n, generator=g).to(cfg.device) - 0.5,  # noqa: E731
                   r(b, n), r(b, n), r(d, dtype=torch.float32)]
    feats = {"B": b, "D": d}
    return [
        _aux_case(cfg, f"causal_conv1d fwd+bwd B={b},D={d},L={L},W={w}", "causal_conv1d", conv,
                  lambda x, wt, bias, backend: causal_conv1d(x, wt, bias, "silu", backend=backend),
                  lambda x, wt, bias: causal_conv1d_ref(x, wt, bias, "silu"), True, {**feats, "L": L, "W": w}),
        _aux_case(cfg, f"causal_conv1d_update step B={b},D={d},W={w}", "causal_conv1d_update", step,
                  lambda x, st, wt, bias, backend: causal_conv1d_update(x, st, wt, bias, "silu", backend=backend),
                  lambda x, st, wt, bias: causal_conv1d_update_ref(x, st, wt, bias, "silu"), False,
                  {**feats, "W": w}),
        _aux_case(cfg, f"selective_state_update step B={b},D={d},N={n}", "selective_state_update", ssu,
                  lambda st, x, dt, A, B_, C, D_, backend: selective_state_update(st, x, dt, A, B_, C, D_,
                                                                                 dt_softplus=True, backend=backend),
                  lambda st, x, dt, A, B_, C, D_: selective_state_update_ref(st, x, dt, A, B_, C, D_,
                                                                             dt_softplus=True), False,
                  {**feats, "N": n}),
    ]


def cases(cfg: BenchConfig) -> list[Case]:
    out = _scan_cases(cfg)
    out += _aux_cases(cfg)
    return out


def _scan_cases(cfg: BenchConfig) -> list[Case]:
    if cfg.quick:
        # The reference's autograd is quadratic in L (each step's select-backward writes a full B*D*L*N
        # gradient), so the quick fwd+bwd and block cases are short.
        out = [_scan_case(cfg, (2, 256, 256, 16), False), _scan_case(cfg, (1, 64, 32, 16), True)]
        block = (64, 64)
    else:
        out = [_scan_case(cfg, (2, 1536, 512, 16), False), _scan_case(cfg, (2, 1536, 2048, 16), False),
               _scan_case(cfg, (2, 1536, 256, 16), True), _scan_case(cfg, (2, 1536, 2048, 16), True),
               _scan_case(cfg, (2, 1536, 2048, 64), True, tag=" N=64")]
        block = (768, 2048)
    return out + [_block_case(cfg, *block)]


def _block_case(cfg: BenchConfig, dm: int, L: int) -> Case:
    return Case(name=f"MambaBlock fwd+bwd d_model={dm},L={L},B=1", params={"d_model": dm, "L": L},
                flops=None, group="MambaBlock fwd+bwd", x="L",
                providers=[Provider(name="fastarch", kind="fastarch", setup=_block(cfg, dm, L, True)),
                           Provider(name="reference", kind="reference", setup=_block(cfg, dm, L, False))],
                ratios=(Ratio("fastarch", "reference"),))


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """CPU selective scan at B=2, D=1536, L=2048, N=16 (variable B/C, D, z, delta_bias, softplus): the C++
    backend against the reference loop, forward and forward+backward (the reference's autograd at L=256),
    the forward+backward peak memory at N=16 and N=64, the guide's MambaBlock (d_model=768, L=2048), and
    one decode step of the two decode ops at B=1, D=1536."""
    if cfg.toy:
        scan = [_scan_case(cfg, (1, 32, 64, 8), False), _scan_case(cfg, (1, 32, 64, 8), True)]
        return scan + [_block_case(cfg, 32, 32)] + _aux_cases(cfg, (1, 32, 64, 4, 8))[1:]
    scan = [_scan_case(cfg, (2, 1536, 2048, 16), False), _scan_case(cfg, (2, 1536, 256, 16), True),
            _scan_case(cfg, (2, 1536, 2048, 16), True), _scan_case(cfg, (2, 1536, 2048, 64), True, tag=" N=64"),
            _scan_case(cfg, (1, 256, 512, 16), True, tag=" small")]
    return scan + [_block_case(cfg, 768, 2048)] + _aux_cases(cfg, (1, 1536, 2048, 4, 16))[1:]


SUITE = Suite(name="selective_scan", description="Mamba selective scan (mamba-ssm selective_scan_fn semantics)",
              cases=cases, case_sets={"selective-scan-headline": headline_cases})
