"""Whole models, forward + backward on the same weights: fastarch's drop-in modules against the seed guides'
own code (copied below as the references, with only the fixes the guides need to run; see docs/models.md).

Cases (``--full`` sizes are the issue's headline; ``--quick`` shrinks them so the suite takes seconds):

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
import torch.nn.functional as F

from ..core import BenchConfig, Case, Provider, Suite

# ================================ guide reference code (guide 000) ======================================
# ruff: noqa: N803, N806


class _GuideSDPA(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        scores = torch.matmul(q, k.transpose(-2, -1)) / q.size(-1) ** 0.5
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(F.softmax(scores, dim=-1))
        return torch.matmul(attention, v), attention


class _GuideMHA(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.attention = _GuideSDPA(dropout)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, q, k, v, mask=None):
        b = q.size(0)
        residual = q
        q = self.w_q(q).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        k = self.w_k(k).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        out, attn = self.attention(q, k, v, mask)
        out = out.transpose(1, 2).contiguous().view(b, -1, self.d_model)
        return self.layer_norm(self.dropout(self.w_o(out)) + residual), attn


class _GuideFFN(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1, activation="relu"):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x):
        return self.dropout(self.w_2(self.dropout(self.activation(self.w_1(x)))))


class _GuideEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = _GuideMHA(d_model, n_heads, dropout)
        self.ffn = _GuideFFN(d_model, d_ff, dropout)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, mask)  # the guide's .mha(...)
        x = self.norm1(self.dropout(x) + residual)
        return self.norm2(self.ffn(x) + x)


class _GuideGPTLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout=0.1):
        super().__init__()
        self.self_attn = _GuideMHA(d_model, n_heads, dropout)
        self.ffn = _GuideFFN(d_model, d_ff, dropout, activation="gelu")
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        residual = x
        x, _ = self.self_attn(x, x, x, mask)
        x = self.norm1(self.dropout(x) + residual)
        return self.norm2(self.ffn(x) + x)


class _GuideGPT(nn.Module):
    def __init__(self, vocab_size, d_model, n_heads, num_layers, d_ff, max_len, dropout):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.layers = nn.ModuleList(_GuideGPTLayer(d_model, n_heads, d_ff, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids):
        b, n = input_ids.shape
        pos = torch.arange(n, device=input_ids.device).unsqueeze(0).expand(b, -1)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(pos))
        mask = torch.tril(torch.ones(n, n, device=input_ids.device))  # the guide's causal intent (1 = keep)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(self.norm(x))


class _GuideViT(nn.Module):
    def __init__(self, img_size, patch_size, num_classes, embed_dim, depth, num_heads, dropout):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        n = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_GuideEncoderLayer(embed_dim, num_heads, 4 * embed_dim, dropout)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class _GuideLongformerAttention(nn.Module):
    def __init__(self, d_model, n_heads, window_size=512, dropout=0.1):
        super().__init__()
        self.d_model, self.n_heads, self.d_k, self.window_size = d_model, n_heads, d_model // n_heads, window_size
        self.global_tokens: list[int] = []
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_q_global = nn.Linear(d_model, d_model)
        self.w_k_global = nn.Linear(d_model, d_model)
        self.w_v_global = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, global_mask=None):
        b, n, _ = x.shape
        q = self.w_q(x).view(b, n, self.n_heads, self.d_k).transpose(1, 2)
        k = self.w_k(x).view(b, n, self.n_heads, self.d_k).transpose(1, 2)
        v = self.w_v(x).view(b, n, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_k**0.5)
        pos = torch.arange(n, device=x.device)
        mask = ((pos.unsqueeze(0) - pos.unsqueeze(1)).abs() <= self.window_size).float()[None, None]
        scores = scores.masked_fill(mask == 0, -1e9)
        out = torch.matmul(self.dropout(F.softmax(scores, dim=-1)), v)
        out = out.transpose(1, 2).contiguous().view(b, n, self.d_model)
        return self.dropout(self.w_o(out))


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


class _GuideLSTMCell(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size).uniform_(-0.1, 0.1))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size).uniform_(-0.1, 0.1))
        self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size).uniform_(-0.1, 0.1))
        self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size).uniform_(-0.1, 0.1))

    def forward(self, x, hidden):
        h, c = hidden
        gates = torch.mm(x, self.weight_ih.t()) + self.bias_ih + torch.mm(h, self.weight_hh.t()) + self.bias_hh
        f, i, o, g = gates.chunk(4, 1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new


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
          make_input: Callable[[], Any], extra: list[Provider] | None = None) -> Case:
    ours, ref = ours_ref
    providers = [Provider("fastarch", "fastarch", _train_step(ours, make_input)),
                 Provider("reference", "reference", _train_step(ref, make_input))]
    return Case(name=name, params=params, flops=flops, providers=providers + (extra or []), reference="reference",
                group=name.split(",")[0], x="L")


def _gpt_case(quick: bool) -> Case:
    from ...nn.gpt import GPTTransformer

    d, layers, heads, n, vocab = (128, 2, 4, 256, 512) if quick else (512, 8, 8, 1024, 2048)
    pair = _pair(lambda: GPTTransformer(vocab, d, heads, layers, 4 * d, n, dropout=0.0),
                 lambda: _GuideGPT(vocab, d, heads, layers, 4 * d, n, dropout=0.0))
    ids = torch.randint(0, vocab, (1, n))
    flops = 3 * layers * (2 * n * 12 * d * d + 2 * n * n * d)  # fwd+bwd = 3x fwd; causal counted as full
    return _case(f"gpt,d={d},layers={layers},L={n}", {"L": n, "d_model": d, "layers": layers}, flops, pair,
                 lambda: ids)


def _vit_case(quick: bool) -> Case:
    from ...nn.vision import VisionTransformer

    img, depth, batch = (64, 2, 2) if quick else (224, 12, 8)
    pair = _pair(lambda: VisionTransformer(img, 16, 3, 1000, 384, depth, 6, dropout=0.0),
                 lambda: _GuideViT(img, 16, 1000, 384, depth, 6, dropout=0.0))
    x = torch.randn(batch, 3, img, img)
    n = (img // 16) ** 2 + 1
    return _case(f"vit_s16,img={img},depth={depth},B={batch}", {"L": n, "B": batch, "depth": depth}, None, pair,
                 lambda: x)


def _longformer_case(quick: bool) -> Case:
    from ...nn.attention import LongformerAttention

    n, d, heads, w = (1024, 128, 4, 64) if quick else (8192, 256, 4, 256)
    pair = _pair(lambda: _LongformerEncoderLayer(LongformerAttention(d, heads, window_size=w, dropout=0.0), d, 4 * d),
                 lambda: _LongformerEncoderLayer(_GuideLongformerAttention(d, heads, w, dropout=0.0), d, 4 * d))
    x = torch.randn(1, n, d)
    return _case(f"longformer,L={n},w={w}", {"L": n, "d_model": d, "window": w}, None, pair, lambda: x)


def _lstm_case(quick: bool) -> Case:
    from ...nn.recurrent import LSTM, LSTMCell

    n, hidden, layers, batch = (64, 64, 2, 4) if quick else (512, 256, 4, 8)
    torch.manual_seed(0)
    ref_cells = [_GuideLSTMCell(hidden, hidden) for _ in range(layers)]
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
    out = [_gpt_case(quick), _vit_case(quick), _lstm_case(quick)]
    try:
        out.insert(2, _longformer_case(quick))
    except ImportError:  # fastarch.nn.LongformerAttention belongs to the attention issue
        pass
    return out


SUITE = Suite(name="models", description="Whole models, forward+backward: fastarch.nn vs the seed guides' code "
              "(GPT, ViT-S/16, Longformer-style encoder, 4-layer LSTM)", cases=cases)
