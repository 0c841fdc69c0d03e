"""rotary_embedding: every backend against the reference, forward and backward, and bad input."""

import pytest
import torch

from fastarch import ops
from tests._tolerance import assert_fa_close

pytestmark = pytest.mark.op("rotary")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,rot", [((2, 7, 3, 16), 16), ((1, 1, 2, 40), 24), ((2, 5, 1, 64), 64)])
def test_rotary_matches_reference(backend, interleaved, shape, rot):
    x = torch.randn(*shape, requires_grad=True)
    cos, sin = ops.rotary_cos_sin(shape[1] + 3, rot)
    ref = ops.rotary_embedding_ref(x, cos, sin, interleaved, seqlen_offset=3)
    y = ops.rotary_embedding(x, cos, sin, interleaved, seqlen_offset=3, backend=backend)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, dy)
    (gr,) = torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(g, gr, atol=1e-6, rtol=1e-5)


def test_rotary_fp16(backend):
    x = torch.randn(2, 9, 2, 32).half()
    cos, sin = ops.rotary_cos_sin(9, 32)
    ref32 = ops.rotary_embedding_ref(x.float(), cos, sin)
    torch_fp16 = ops.rotary_embedding_ref(x, cos.half(), sin.half())
    assert_fa_close(ops.rotary_embedding(x, cos, sin, backend=backend), ref32, torch_fp16, 2, 1e-3)


def test_rotary_is_a_rotation():
    # Norms of each rotated pair are preserved and the inverse rotation restores x.
    x = torch.randn(1, 6, 2, 8)
    cos, sin = ops.rotary_cos_sin(6, 8)
    y = ops.rotary_embedding(x, cos, sin, interleaved=True)
    pair_norm = lambda t: t.reshape(*t.shape[:-1], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    back = ops.rotary_embedding(y, cos, -sin, interleaved=True)
    torch.testing.assert_close(back, x, atol=1e-6, rtol=1e-5)


def test_rotary_rejects_bad_input():
    cos, sin = ops.rotary_cos_sin(8, 8)
    with pytest.raises(ValueError, match="even"):
        ops.rotary_embedding(torch.randn(1, 4, 2, 7), cos, sin)
    with pytest.raises(ValueError, match="4 dimensions"):
        ops.rotary_embedding(torch.randn(4, 2, 8), cos, sin)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(torch.randn(1, 6, 2, 8), cos, sin, seqlen_offset=4)
    with pytest.raises(ValueError, match="rotated features"):
        ops.rotary_embedding(torch.randn(1, 4, 2, 4), cos, sin)
    with pytest.raises(ValueError, match="same shape"):
        ops.rotary_embedding(torch.randn(1, 4, 2, 8), cos, sin[:, :2])
    for offset in (1.5, 1.0, True, "1"):  # an offset is a position: an int, never truncated
        with pytest.raises(TypeError, match="'seqlen_offset' must be an int"):
            ops.rotary_embedding(torch.randn(1, 4, 2, 8), cos, sin, seqlen_offset=offset)
