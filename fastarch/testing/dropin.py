"""Checks for drop-in modules: the same ``state_dict`` and outputs as a guide class (:mod:`fastarch.testing.guides`),
and that a model trains on a toy batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def assert_dropin(ours: nn.Module, ref: nn.Module, *inputs, atol: float = 1e-5, rtol: float = 1e-4,
                  pick: Callable | None = None) -> None:
    """Same state_dict keys/shapes; the reference's weights load into ours with strict=True (and back);
    eval outputs equal."""
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert sorted(sd_ref) == sorted(sd_ours), (sorted(set(sd_ref) ^ set(sd_ours)))
    for k in sd_ref:
        assert sd_ref[k].shape == sd_ours[k].shape, k
    ours.load_state_dict(sd_ref, strict=True)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours.eval()
    ref.eval()
    with torch.no_grad():
        a, b = ours(*inputs), ref(*inputs)
    if pick is not None:
        a, b = pick(a), pick(b)
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
    else:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def assert_trains(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], steps: int = 8,
                  lr: float = 1e-2) -> None:
    """A few Adam steps on a fixed toy batch must lower the loss; gradients must be finite."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    first = None
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model)
        loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                assert torch.isfinite(p.grad).all(), n
        opt.step()
        first = loss.item() if first is None else first
    model.eval()
    with torch.no_grad():
        final = loss_fn(model).item()
    assert final < first, f"loss did not decrease: {first:.4f} -> {final:.4f}"
