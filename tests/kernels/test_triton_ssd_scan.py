"""The Triton SSD scan launchers (kernels/ssd_scan.py) against the sequential fp32 oracle, under the interpreter.

The launchers are called directly (the op layer is tested in tests/ops). The cases aim at the kernels' tile
edges: chunk sizes that are not powers of two, chunks of more than one step tile, sequence ends inside a tile,
head and state sizes that are not powers of two, restarts at and between chunk boundaries, a first sequence
other than 0 (the initial states then feed nothing), groups, fp16 inputs, and the gradient of the final states
present or absent.
"""

from __future__ import annotations

import pytest
import torch

from fastarch.ops.ssd_scan import ssd_chunked, ssd_scan_ref
from tests._backends import import_triton

triton = import_triton()

from fastarch.kernels import ssd_scan as K  # noqa: E402

# (batch, L, H, G, P, N, chunk_size, dtype, initial states, seq_idx restarts (None: no seq_idx), dfinal)
CASES = {
    "odd_chunk_groups": (1, 53, 4, 2, 20, 12, 24, torch.float32, True, [0, 5, 24, 30], True),
    "two_tiles_per_chunk": (1, 170, 2, 1, 16, 16, 160, torch.float32, True, [0, 100, 160], True),
    "first_sequence_not_0": (2, 37, 2, 2, 16, 16, 16, torch.float16, True, [1, 16, 20], True),
    "plain": (2, 21, 2, 1, 16, 16, 16, torch.float32, False, None, False),
    "one_step": (1, 1, 2, 1, 16, 16, 64, torch.float32, True, None, True),
}


def _seq_idx(batch: int, L: int, restarts: list[int]) -> torch.Tensor:
    """``restarts[0]`` is the first sequence number; every later entry starts the next sequence there."""
    sid = torch.full((batch, L), restarts[0], dtype=torch.int32)
    for pos in restarts[1:]:
        sid[:, pos:] += 1
    return sid


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_match_the_oracle(name):
    batch, L, H, G, P, N, cs, dtype, with_init, restarts, with_dfinal = CASES[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, L, H, P, generator=g).to(dtype)
    dt = torch.rand(batch, L, H, generator=g) * 0.5 + 0.05
    A = -torch.rand(H, generator=g) - 0.3
    B = torch.randn(batch, L, G, N, generator=g).to(dtype)
    C = torch.randn(batch, L, G, N, generator=g).to(dtype)
    init = torch.randn(batch, H, P, N, generator=g) if with_init else None
    sid = _seq_idx(batch, L, restarts) if restarts is not None else None
    dy = torch.randn(batch, L, H, P, generator=g)
    dfinal = torch.randn(batch, H, P, N, generator=g) if with_dfinal else None

    y, final, chunk_states = K.ssd_scan_fwd(x, dt, A, B, C, init, sid, cs)
    grads = K.ssd_scan_bwd(dy, dfinal, x, dt, A, B, C, init, sid, chunk_states, cs)
    again = K.ssd_scan_bwd(dy, dfinal, x, dt, A, B, C, init, sid, chunk_states, cs)

    prim = [t.float().requires_grad_() for t in (x, dt, A, B, C)] + ([init.clone().requires_grad_()]
                                                                      if with_init else [])
    yr, finalr = ssd_scan_ref(*prim[:5], cs, initial_states=prim[5] if with_init else None, seq_idx=sid,
                              return_final_states=True)
    loss = (yr * dy).sum() + ((finalr * dfinal).sum() if with_dfinal else 0.0)
    refs = torch.autograd.grad(loss, prim)
    _, _, states_ref = ssd_chunked(*(t.detach() for t in prim[:5]), init, sid, cs)

    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(y, yr.detach(), **tol)
    torch.testing.assert_close(final, finalr.detach(), **tol)
    torch.testing.assert_close(chunk_states, states_ref, **tol)
    names = ("dx", "ddt", "dA", "dB", "dC", "dinitial_states")
    assert (grads[5] is None) == (not with_init)
    for what, got, ref in zip(names, grads, refs):
        assert got.shape == ref.shape and got.dtype == torch.float32, what
        scale = ref.abs().max().item() + 1.0
        torch.testing.assert_close(got / scale, ref / scale, **tol, msg=lambda m, w=what: f"{w}: {m}")
    for what, a, b in zip(names, grads, again):
        if a is not None:
            assert torch.equal(a, b), f"{what} differs between two runs"


def test_strided_and_expanded_arguments():
    """The launchers take any strides: ``final_states.sum()`` sends an expanded (stride 0) gradient."""
    g = torch.Generator().manual_seed(2)
    batch, L, H, G, P, N, cs = 1, 20, 2, 1, 16, 16, 16
    x = torch.randn(batch, H, L, P, generator=g).transpose(1, 2)
    dt = torch.rand(batch, L, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.3
    B, C = (torch.randn(batch, L, G, N, generator=g) for _ in range(2))
    init = torch.randn(batch, H, P, N, generator=g)
    dy = torch.zeros(1, 1, 1, 1).expand(batch, L, H, P)
    dfinal = torch.ones(1, 1, 1, 1).expand(batch, H, P, N)
    y, final, states = K.ssd_scan_fwd(x, dt, A, B, C, init, None, cs)
    grads = K.ssd_scan_bwd(dy, dfinal, x, dt, A, B, C, init, None, states, cs)
    dense = K.ssd_scan_bwd(dy.contiguous(), dfinal.contiguous(), x.contiguous(), dt, A, B, C, init, None, states, cs)
    torch.testing.assert_close(y, K.ssd_scan_fwd(x.contiguous(), dt, A, B, C, init, None, cs)[0])
    for a, b in zip(grads, dense):
        torch.testing.assert_close(a, b)
    assert grads[0].abs().max() > 0
