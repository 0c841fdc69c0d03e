"""flash-linear-attention's delta-rule test grid, transcribed: odd lengths, several head dims, gates near 0 and
strongly negative, with and without l2norm, initial and final states, GQA/GVA head ratios, packed sequences
with sequences of length 1; and the checks every backend of ``gated_delta_rule`` and ``kda`` passes against the
fp32 recurrence."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

LENGTHS = (1, 63, 100, 300)
HEAD_DIMS = ((16, 16), (60, 36), (32, 64))  # (K, V)
GATES = {"near0": 0.02, "mid": 1.0, "strong": 8.0}  # log decays logsigmoid(x) * scale
HEADS = ((1, 1), (2, 4), (1, 3))  # (Hk, Hv)
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def grid() -> list[dict]:
    """A covering subset of lengths x head dims x gates x heads x flags: every value appears with each other
    value of the next factor at least once, and each case keeps its tensors small."""
    cases = []
    for i, (T, (K, V), gate, (hk, hv)) in enumerate(
            itertools.islice(zip(itertools.cycle(LENGTHS), itertools.cycle(HEAD_DIMS), itertools.cycle(GATES),
                                 itertools.cycle(HEADS)), 12)):
        cases.append(dict(B=2 if T < 300 else 1, T=T, K=K, V=V, gate=gate, Hk=hk, Hv=hv, l2=(i + i // 4) % 2 == 0,
                          init=(i + i // 4) % 3 != 1))
    return cases


def case_id(c: dict) -> str:
    return (f"T{c['T']}-K{c['K']}V{c['V']}-{c['gate']}-H{c['Hk']}x{c['Hv']}"
            f"{'-l2' if c['l2'] else ''}{'-h0' if c['init'] else ''}")


def make(c: dict, per_key: bool, dtype: torch.dtype = torch.float32, seed: int = 0,
         cu_seqlens: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """Inputs as the models pass them: q, k, v, beta in ``dtype``; the log decay fp32; keys unit-norm when
    the op does not normalise them (fla's tests do the same: the delta rule needs ``|k| <= 1``)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, hk, hv, K, V = c["B"], c["T"], c["Hk"], c["Hv"], c["K"], c["V"]

    def rn(*shape):
        return torch.randn(*shape, generator=gen)

    k = rn(B, T, hk, K)
    if not c["l2"]:
        k = F.normalize(k, dim=-1)
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    gate_shape = (B, T, hv, K) if per_key else (B, T, hv)
    return dict(q=rn(B, T, hk, K).to(dtype), k=k.to(dtype), v=rn(B, T, hv, V).to(dtype),
                g=F.logsigmoid(rn(*gate_shape)) * GATES[c["gate"]],
                beta=torch.rand(B, T, hv, generator=gen).to(dtype),
                initial_state=rn(n, hv, K, V) if c["init"] else None)


def run(fn: Callable, x: dict, seed: int = 1, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(o, final_state, gradients of every input) for a random upstream gradient of both outputs."""
    leaves = {k: (None if t is None else t.detach().clone().requires_grad_()) for k, t in x.items()}
    o, S = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
              initial_state=leaves["initial_state"], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    ((o.float() * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()
     ).backward()
    return o, S, {k: None if t is None else t.grad for k, t in leaves.items()}


def assert_matches(got, want, rtol: float = 1e-4, atol: float = 1e-4, grad_factor: float = 10.0) -> None:
    o, S, grads = got
    ro, rS, rgrads = want
    torch.testing.assert_close(o.float(), ro.float(), rtol=rtol, atol=atol, msg=lambda m: f"o: {m}")
    torch.testing.assert_close(S, rS, rtol=rtol, atol=atol, msg=lambda m: f"final_state: {m}")
    for name in GRAD_NAMES:
        a, r = grads.get(name), rgrads.get(name)
        assert (a is None) == (r is None), f"d{name}: {'missing' if a is None else 'unexpected'}"
        if r is None:
            continue
        scale = max(r.abs().max().item(), 1.0)  # sums over T of products: relative to the magnitude
        torch.testing.assert_close(a.float(), r.float(), rtol=rtol * grad_factor, atol=atol * grad_factor * scale,
                                   msg=lambda m, name=name: f"d{name}: {m}")


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (the memory bound's check)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out
