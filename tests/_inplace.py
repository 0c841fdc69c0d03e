"""Bit-level comparison of in-place state: a rejected call must leave every byte as it was, NaN payloads too
(``torch.equal`` calls two NaNs different and two different NaN payloads nothing at all)."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements reinterpreted as integers of the same width (a copy, so later writes to ``t``
    do not show)."""
    c = t.detach().clone()
    if c.is_complex():
        c = torch.view_as_real(c)
    return c.view(_INT_OF_SIZE[c.element_size()]) if c.dtype != torch.bool else c


def nan_poisoned(t: torch.Tensor, every: int = 5) -> torch.Tensor:
    """``t`` with every ``every``-th element set to a NaN carrying a non-default payload (float32 only)."""
    out = t.clone()
    if out.dtype == torch.float32:
        flat = out.view(-1).view(torch.int32)
        flat[::every] = 0x7FC01234
    return out


def assert_bits_equal(before: torch.Tensor, after: torch.Tensor, name: str = "state") -> None:
    assert torch.equal(before, bits(after)), f"{name} changed"
