"""FlashAttention's low-precision criterion: the kernel's error against an fp32 reference may be
at most ``factor`` times PyTorch's own error in the same dtype, plus a small absolute slack."""

from __future__ import annotations

import torch


def assert_fa_close(out: torch.Tensor, ref32: torch.Tensor, torch_same_dtype: torch.Tensor,
                    factor: float = 2.0, atol: float = 1e-5, what: str = "output") -> None:
    err = (out.float() - ref32.float()).abs().max().item()
    base = (torch_same_dtype.float() - ref32.float()).abs().max().item()
    assert err == err, f"{what}: NaN in result"
    assert err <= factor * base + atol, f"{what}: max error {err:.3e} > {factor} x torch's {base:.3e} + {atol}"
