"""The gated delta rule (:func:`fastarch.ops.gated_delta_rule`, fla's ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule``): the chunked forward (prefill) and the recurrent decode step.

Providers: ``fastarch-cpp`` / ``fastarch-torch`` (the op forced to a backend; torch is the chunked WY/UT
composition), ``transformers`` (transformers' own PyTorch path, ``torch_chunk_gated_delta_rule`` or
``torch_recurrent_gated_delta_rule`` of Qwen3-Next, when transformers is importable) and ``reference``
(:func:`fastarch.ops.gated_delta_rule_ref`, the step recurrence, only at the small sizes). Qwen3-Next's call:
``use_qk_l2norm_in_kernel=True``, ``g = logsigmoid(.)`` fp32, ``beta`` in (0, 1), no initial state for the
prefill, an fp32 state for the decode step.

The headline (case set ``delta-rule-headline``, also in ``--full``): the chunked forward at B=1, T=4096,
Hk=Hv=16, K=V=128 fp32, ``fastarch-cpp`` against ``transformers`` (target 5x), and the decode step (one
token, B=1, Hv=16 against an existing state). ``--quick`` runs T=256, H=4, K=V=64 with the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import randn, require_backend, timed_call

BACKENDS = ("cpp", "torch")
REFERENCE_MAX_T = 512  # the oracle loops over T in Python


def _inputs(cfg: BenchConfig, B: int, T: int, hk: int, hv: int, K: int, V: int, state: bool) -> list[torch.Tensor]:
    ts = [randn(B, T, hk, K, cfg=cfg, seed=1), randn(B, T, hk, K, cfg=cfg, seed=2), randn(B, T, hv, V, cfg=cfg, seed=3),
          F.logsigmoid(randn(B, T, hv, cfg=cfg, seed=4).float()), torch.sigmoid(randn(B, T, hv, cfg=cfg, seed=5))]
    if state:
        ts.append(randn(B, hv, K, V, cfg=cfg, seed=6).float() * 0.1)
    return ts


def _transformers(recurrent: bool) -> Callable[..., Any]:
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        raise Skip("transformers (with Qwen3-Next) is not importable") from None
    fn = m.torch_recurrent_gated_delta_rule if recurrent else m.torch_chunk_gated_delta_rule
    fn = getattr(fn, "__fastarch_original__", fn)
    # transformers' own PyTorch function: unwrapped from its kernel wrapper, or (with Hugging Face's kernels
    # package, transformers 5.25) the kernels layer around it, which sends CPU inputs to that function
    return getattr(fn, "__wrapped__", fn)


def _case(cfg: BenchConfig, shape: tuple[int, int, int, int, int, int], recurrent: bool, reference: bool,
          target: float | None = None) -> Case:
    B, T, hk, hv, K, V = shape
    mode = "decode" if recurrent else "prefill"

    def call(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        def run(q, k, v, g, beta, h0=None):
            return fn(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **kw)
        return run

    def ours(backend: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            require_backend("gated_delta_rule", backend, cfg.device, cfg.dtype, head_dim=K, v_dim=V, per_key=False,
                            recurrent=recurrent, varlen=False)
            from fastarch.ops import gated_delta_rule

            run = timed_call(call(gated_delta_rule, mode="recurrent" if recurrent else "chunk", backend=backend),
                             _inputs(cfg, *shape, state=recurrent), False)
            run()  # warm-up outside the timed region (extension load)
            return run
        return setup

    def hf() -> Callable[[], Any]:
        return timed_call(call(_transformers(recurrent)), _inputs(cfg, *shape, state=recurrent), False)

    def oracle() -> Callable[[], Any]:
        if not reference:
            raise Skip(f"the step recurrence runs only up to T={REFERENCE_MAX_T}")
        from fastarch.ops import gated_delta_rule_ref

        return timed_call(call(gated_delta_rule_ref), _inputs(cfg, *shape, state=recurrent), False)

    providers = [Provider(f"fastarch-{be}", "fastarch", ours(be)) for be in BACKENDS]
    providers.append(Provider("transformers", "peer", hf, peer_package="transformers"))
    if reference:
        providers.append(Provider("reference", "reference", oracle))
    # per step: decay, read S^T k, write k u^T, read S^T q on the (K, V) state (the chunked form does more)
    flops = 2.0 * B * T * hv * 4 * K * V
    return Case(name=f"{mode} B={B},T={T},Hk={hk},Hv={hv},K={K},V={V}",
                params={"B": B, "T": T, "Hk": hk, "Hv": hv, "K": K, "V": V, "mode": mode},
                flops=flops, providers=providers, reference="reference" if reference else "fastarch-torch",
                group=mode, x="T", ratios=(Ratio("fastarch-cpp", "transformers", target=target),))


HEADLINE = (1, 4096, 16, 16, 128, 128)
DECODE = (1, 1, 16, 16, 128, 128)


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """The chunked forward at B=1, T=4096, Hk=Hv=16, K=V=128 (fastarch-cpp vs transformers' PyTorch path,
    target 5x) and the one-token decode step at the same heads (target 3x)."""
    if cfg.toy:
        return [_case(cfg, (1, 40, 2, 2, 8, 8), False, True, target=5.0), _case(cfg, (1, 1, 2, 2, 8, 8), True, True, target=3.0)]
    return [_case(cfg, HEADLINE, False, False, target=5.0), _case(cfg, DECODE, True, True, target=3.0)]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_case(cfg, (1, 40, 1, 2, 8, 8), False, True), _case(cfg, (1, 1, 1, 2, 8, 8), True, True)]
    if cfg.quick:
        return [_case(cfg, (1, 256, 4, 4, 64, 64), False, True), _case(cfg, (1, 1, 4, 4, 64, 64), True, True)]
    return [_case(cfg, (1, 512, 8, 8, 64, 64), False, True), _case(cfg, (2, 1024, 4, 8, 128, 128), False, False)
            ] + headline_cases(cfg)


SUITE = Suite(name="delta_rule", description="the gated delta rule of Gated DeltaNet (fla chunk/fused_recurrent "
                                             "semantics): chunked prefill and the decode step",
              cases=cases, case_sets={"delta-rule-headline": headline_cases})
