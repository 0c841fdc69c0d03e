"""Whole models, forward + backward on the same weights: fastarch's drop-in modules against the seed guides'
own code (:mod:`fastarch.testing.guides`, with only the fixes the guides need to run; see docs/models.md).

Cases (``--full`` sizes are the headline, also the case set ``models-headline``; ``--quick`` shrinks them
so the suite takes seconds):

- ``gpt``: guide 000's ``GPTTransformer`` (d_model 512, 8 layers, 8 heads, L 1024, batch 1);
- ``vit_s16``: guide 000's ``VisionTransformer`` at ViT-S/16 (384 wide, 12 layers, 6 heads), batch 8;
- ``longformer``: a Longformer-style encoder layer (guide 000's ``LongformerAttention`` + add & norm + FFN),
  L 8192, window 256;
- ``lstm``: a 4-layer LSTM over L 512 built from guide 000's ``LSTMCell`` stepped in Python (the guide's
  recurrence) against fastarch's ``LSTMCell.forward_sequence`` (same weights, one fused kernel per layer);
  the ``torch`` provider is guide 000's ``LSTM`` class, which wraps ``nn.LSTM``.

Providers: ``fastarch`` (fastarch.nn), ``reference`` (the guide's code). Speedups are against ``reference``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fastarch.testing import guides

from ..core import BenchConfig, Case, Provider, Ratio, Suite


class _LongformerEncoderLayer(nn.Module):
    """attention -> add & norm -> FFN -> add & norm; ``attn`` is the guide's or fastarch's module."""

    def __init__(self, attn: nn.Module, d_model: int, d_ff: int):
        super().__init__()
        self.attn = attn
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ffn(x))


class _CellStack(nn.Module):
    """Layers of LSTM cells over a (B, T, I) sequence; ``fused`` uses LSTMCell.forward_sequence."""

    def __init__(self, cells: list[nn.Module], hidden: int, fused: bool):
        super().__init__()
        self.cells = nn.ModuleList(cells)
        self.hidden, self.fused = hidden, fused

    def forward(self, x):
        for cell in self.cells:
            if self.fused:
                x, _ = cell.forward_sequence(x)
                continue
            b = x.shape[0]
            state = (x.new_zeros(b, self.hidden), x.new_zeros(b, self.hidden))
            outs = []
            for t in range(x.shape[1]):
                state = cell(x[:, t], state)
                outs.append(state[0])
            x = torch.stack(outs, 1)
        return x


# ========================================= harness ======================================================
def _train_step(model: nn.Module, make_input: Callable[[], Any]) -> Callable[[], Callable[[], Any]]:
    """setup(): inputs built once; the timed call runs forward + backward of a scalar loss."""

    def setup() -> Callable[[], Any]:
        inp = make_input()
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()

        def step() -> Any:
            for p in params:
                p.grad = None
            out = model(inp)
            out.float().square().mean().backward()
            return out

        step()  # warm-up outside the timed region: builds/loads any extension the op needs
        return step

    return setup


def _pair(build_ours: Callable[[], nn.Module], build_ref: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = build_ref()
    ours = build_ours()
    ours.load_state_dict(ref.state_dict(), strict=True)  # the same weights on both sides
    return ours, ref


def _case(name: str, params: dict[str, Any], flops: float | None, ours_ref: tuple[nn.Module, nn.Module],
          make_input: Callable[[], Any], extra: list[Provider] | None = None, target: float | None = None
          ) -> Case:
    ours, ref = ours_ref
    providers = [Provider("fastarch", "fastarch", _train_step(ours, make_input)),
                 Provider("reference", "reference", _train_step(ref, make_input))]
    return Case(name=name, params=params, flops=flops, providers=providers + (extra or []), reference="reference",
                group=name.split(",")[0], x="L", ratios=(Ratio("fastarch", "reference", target=target),))


def _gpt_case(quick: bool) -> Case:
    from ...nn.gpt import GPTTransformer

    d, layers, heads, n, vocab = (128, 2, 4, 256, 512) if quick else (512, 8, 8, 1024, 2048)
    pair = _pair(lambda: GPTTransformer(vocab, d, heads, layers, 4 * d, n, dropout=0.0),
                 lambda: guides.GPTTransformer(vocab, d, heads, layers, 4 * d, n, dropout=0.0))
    ids = torch.randint(0, vocab, (1, n))
    flops = 3 * layers * (2 * n * 12 * d * d + 2 * n * n * d)  # fwd+bwd = 3x fwd; causal counted as full
    return _case(f"gpt,d={d},layers={layers},L={n}", {"L": n, "d_model": d, "layers": layers}, flops, pair,
                 lambda: ids, target=None if quick else 3.0)


def _vit_case(quick: bool) -> Case:
    from ...nn.vision import VisionTransformer

    img, depth, batch = (64, 2, 2) if quick else (224, 12, 8)
    pair = _pair(lambda: VisionTransformer(img, 16, 3, 1000, 384, depth, 6, dropout=0.0),
                 lambda: guides.VisionTransformer(img, 16, 3, 1000, 384, depth, 6, dropout=0.0))
    x = torch.randn(batch, 3, img, img)
    n = (img // 16) ** 2 + 1
    return _case(f"vit_s16,img={img},depth={depth},B={batch}", {"L": n, "B": batch, "depth": depth}, None, pair,
                 lambda: x)


def _longformer_case(quick: bool) -> Case:
    from ...nn.attention import LongformerAttention

    n, d, heads, w = (1024, 128, 4, 64) if quick else (8192, 256, 4, 256)
    pair = _pair(lambda: _LongformerEncoderLayer(LongformerAttention(d, heads, window_size=w, dropout=0.0), d, 4 * d),
                 lambda: _LongformerEncoderLayer(guides.LongformerAttention(d, heads, w, dropout=0.0), d, 4 * d))
    x = torch.randn(1, n, d)
    return _case(f"longformer,L={n},w={w}", {"L": n, "d_model": d, "window": w}, None, pair, lambda: x)


def _lstm_case(quick: bool) -> Case:
    from ...nn.recurrent import LSTM, LSTMCell

    n, hidden, layers, batch = (64, 64, 2, 4) if quick else (512, 256, 4, 8)
    torch.manual_seed(0)
    ref_cells = [guides.LSTMCell(hidden, hidden) for _ in range(layers)]
    our_cells = [LSTMCell(hidden, hidden) for _ in range(layers)]
    for o, r in zip(our_cells, ref_cells):
        o.load_state_dict(r.state_dict(), strict=True)
    ours, ref = _CellStack(our_cells, hidden, fused=True), _CellStack(ref_cells, hidden, fused=False)
    x = torch.randn(batch, n, hidden)
    guide_lstm = LSTM(hidden, hidden, hidden, layers)  # guide 000's LSTM class: nn.LSTM inside
    extra = [Provider("guide-nn.LSTM", "torch", _train_step(_FirstOutput(guide_lstm), lambda: x))]
    return _case(f"lstm,layers={layers},H={hidden},L={n},B={batch}", {"L": n, "H": hidden, "layers": layers}, None,
                 (ours, ref), lambda: x, extra)


class _FirstOutput(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)[0]


def cases(cfg: BenchConfig) -> list[Case]:
    quick = cfg.quick or cfg.toy
    return [_gpt_case(quick), _vit_case(quick), _longformer_case(quick), _lstm_case(quick)]


def headline_cases(cfg: BenchConfig) -> list[Case]:
    """Forward+backward of whole models on the same weights, fastarch.nn against the guides' code: GPT
    d_model 512 x 8 layers at L=1024 (bar: 3x), ViT-S/16 at batch 8, a Longformer-style encoder layer at
    L=8192 (window 256) and a 4-layer LSTM over L=512."""
    quick = cfg.toy
    return [_gpt_case(quick), _vit_case(quick), _longformer_case(quick), _lstm_case(quick)]


SUITE = Suite(name="models", description="Whole models, forward+backward: fastarch.nn vs the seed guides' code "
              "(GPT, ViT-S/16, Longformer-style encoder, 4-layer LSTM)", cases=cases,
              case_sets={"models-headline": headline_cases})
