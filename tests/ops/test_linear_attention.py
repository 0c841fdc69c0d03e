"""linear_attention: every backend against the dense oracle, outputs and gradients; bad inputs."""

import pytest
import torch

from fastarch.ops.linear_attention import _la_causal_fwd, linear_attention, linear_attention_ref
from tests._backends import require_backend
from tests._tolerance import assert_fa_close

pytestmark = pytest.mark.op("linear_attention")


def _inputs(b, h, L, m, d, dtype=torch.float32, lk=None):
    lk = L if lk is None else lk
    # Positive features as a feature map produces them; a spread of magnitudes exercises the normaliser.
    q = (torch.rand(b, h, L, m) * 2).to(dtype)
    k = (torch.rand(b, h, lk, m) * torch.rand(b, h, lk, 1) * 3).to(dtype)
    v = torch.randn(b, h, lk, d).to(dtype)
    return q, k, v


def _grads(fn, q, k, v, g):
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ts)
    out.backward(g)
    return out.detach(), [t.grad for t in ts]


@pytest.mark.parametrize("L,m,d", [(1, 16, 8), (17, 20, 8), (97, 32, 40), (130, 64, 59)])
def test_causal_matches_dense_oracle(backend, L, m, d):
    if backend == "triton" and L > 97:
        L = 70  # the interpreter is slow
    q, k, v = _inputs(2, 2, L, m, d)
    g = torch.randn(2, 2, L, d)
    out, grads = _grads(lambda a, b, c: linear_attention(a, b, c, causal=True, backend=backend), q, k, v, g)
    ref, rgrads = _grads(lambda a, b, c: linear_attention_ref(a, b, c, causal=True), q.double(), k.double(),
                         v.double(), g.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    for name, a, r in zip("qkv", grads, rgrads):
        torch.testing.assert_close(a, r.float(), rtol=1e-4, atol=1e-4, msg=f"d{name} ({backend})")


@pytest.mark.op("linear_attention", exclude=("triton",))  # the interpreter has no bf16
def test_causal_fp16_bf16(backend):
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = _inputs(1, 2, 65, 32, 16, dtype)
        g = torch.randn(1, 2, 65, 16).to(dtype)
        out, grads = _grads(lambda a, b, c: linear_attention(a, b, c, causal=True, backend=backend), q, k, v, g)
        ref, rgrads = _grads(lambda a, b, c: linear_attention_ref(a, b, c, causal=True), q.float(), k.float(),
                             v.float(), g.float())
        same, sgrads = _grads(lambda a, b, c: _dense_same_dtype(a, b, c), q, k, v, g)
        assert out.dtype == dtype
        assert_fa_close(out, ref, same)
        for name, a, r, s in zip("qkv", grads, rgrads, sgrads):
            assert a.dtype == dtype
            assert_fa_close(a, r, s, factor=3.0, what=f"d{name} {dtype}")


def _dense_same_dtype(q, k, v, eps=1e-6):
    a = torch.tril(q @ k.transpose(-1, -2))
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def test_triton_fp16_inputs():
    require_backend("linear_attention", "triton")
    q, k, v = _inputs(1, 1, 40, 16, 16, torch.float16)
    out = linear_attention(q, k, v, causal=True, backend="triton")
    ref = linear_attention_ref(q.float(), k.float(), v.float(), causal=True)
    assert_fa_close(out, ref, _dense_same_dtype(q, k, v))


@pytest.mark.parametrize("lq,lk", [(33, 33), (5, 71)])
def test_non_causal_matches_oracle(lq, lk):
    q, k, v = _inputs(2, 3, lq, 24, 12, lk=lk)
    g = torch.randn(2, 3, lq, 12)
    out, grads = _grads(lambda a, b, c: linear_attention(a, b, c), q, k, v, g)
    ref, rgrads = _grads(lambda a, b, c: linear_attention_ref(a, b, c), q.double(), k.double(), v.double(),
                         g.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    for a, r in zip(grads, rgrads):
        torch.testing.assert_close(a, r.float(), rtol=1e-4, atol=1e-4)


def test_causal_first_row_is_its_own_value():
    # Row 0 sees only key 0, so (up to eps) it returns v_0 exactly, whatever the features.
    q, k, v = _inputs(1, 1, 9, 8, 4)
    out = linear_attention(q, k, v, causal=True, eps=0.0)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])


def test_backends_agree_on_long_sequence():
    require_backend("linear_attention", "cpp")
    q, k, v = _inputs(1, 2, 1000, 32, 16)
    a = linear_attention(q, k, v, causal=True, backend="cpp")
    b = linear_attention(q, k, v, causal=True, backend="torch")
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a, linear_attention_ref(q, k, v, causal=True), rtol=1e-4, atol=1e-5)


def test_opcheck_custom_op():
    q, k, v = _inputs(1, 2, 20, 8, 4)
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(_la_causal_fwd, (q, k, v, 1e-6, "torch"))


def test_compile_no_graph_break():
    q, k, v = _inputs(1, 1, 16, 8, 4)
    fn = torch.compile(lambda a, b, c: linear_attention(a, b, c, causal=True, backend="torch"),
                       fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v), linear_attention_ref(q, k, v, causal=True), rtol=1e-4, atol=1e-5)


def test_bad_inputs():
    q, k, v = _inputs(1, 2, 8, 4, 3)
    with pytest.raises(ValueError, match="'q_features' must have 4 dimensions"):
        linear_attention(q[0], k, v)
    with pytest.raises(ValueError, match="'k_features' must have shape"):
        linear_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="'v' must have shape"):
        linear_attention(q, k, v[:, :, :5])
    with pytest.raises(TypeError, match="'v' must have dtype in"):
        linear_attention(q, k, v.double())
    with pytest.raises(TypeError, match="'k_features' has dtype float16"):
        linear_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        linear_attention(q[:, :, :4], k, v, causal=True)
    with pytest.raises(ValueError, match="'eps' must be >= 0"):
        linear_attention(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match="'q_features' must be a torch.Tensor"):
        linear_attention([1.0], k, v)
