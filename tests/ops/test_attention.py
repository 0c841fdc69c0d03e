"""fastarch.ops.attention: every available backend against the dense fp32 reference, outputs and gradients.

fp32 tolerances: atol 5e-5 / rtol 1e-4 for the kernels — they sum up to ~1000 terms in a different order
(blockwise online softmax, exp2 polynomial with ~2e-7 relative error) than the dense reference, which puts
their error around 1e-6..1e-5 on O(1) values. fp16/bf16 use FlashAttention's criterion
(tests/_tolerance.py).
"""

from __future__ import annotations

import pytest
import torch

from fastarch.backend import BackendUnavailableError, Call, select
from fastarch.ops.attention import attention, attention_ref, dropout_keep_mask
from tests._backends import require_backend
from tests._tolerance import assert_fa_close

# The Triton interpreter is slow: Triton runs the small cases in test_triton_interpreter instead.
FAST = pytest.mark.op("attention", exclude=("triton",))
# aten takes plain full/causal attention only (it declares so; tests/test_backend.py checks the refusals):
# the window, padding, bias, dropout and alignment tests run on the kernels that implement those.
FEATURES = pytest.mark.op("attention", exclude=("triton", "aten"))
TOL = {"rtol": 1e-4, "atol": 5e-5}


def _inputs(B, H, Hk, Lq, Lk, D, dtype=torch.float32, grad=True):
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k = torch.randn(B, Hk, Lk, D, dtype=dtype)
    v = torch.randn(B, Hk, Lk, D, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _compare(backend, B, H, Hk, Lq, Lk, D, bias_shape=None, **kw):
    q, k, v = _inputs(B, H, Hk, Lq, Lk, D)
    ins = [q, k, v]
    if bias_shape is not None:
        bias = torch.randn(*bias_shape, requires_grad=True)
        kw["attn_bias"] = bias
        ins.append(bias)
    o, lse = attention(q, k, v, backend=backend, return_lse=True, **kw)
    o_r, lse_r = attention_ref(q, k, v, return_lse=True, **kw)
    torch.testing.assert_close(o, o_r, **TOL)
    torch.testing.assert_close(lse, lse_r, **TOL)
    g = torch.randn_like(o)
    grads = torch.autograd.grad(o, ins, g)
    grads_r = torch.autograd.grad(o_r, ins, g)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, grads_r):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return o


# -- shapes x head dims x causal ---------------------------------------------------------------------------
SHAPES = [(1, 239), (97, 97), (113, 203), (127, 513)]


# Every (shape, D) pair except the largest shape with the largest head dims (kept out for time).
SHAPE_D = [(lq, lk, d) for lq, lk in SHAPES for d in (16, 40, 64, 72, 128) if not (d in (64, 128) and lk > 300)]


@FAST
@pytest.mark.parametrize("Lq,Lk,D", SHAPE_D)
@pytest.mark.parametrize("causal", [False, True])
def test_shapes_headdims(backend, Lq, Lk, D, causal):
    if backend == "aten" and causal and Lq != Lk:  # PyTorch aligns causal masks top-left: declined
        with pytest.raises(BackendUnavailableError, match="aten"):
            attention(*_inputs(1, 2, 2, Lq, Lk, D, grad=False), causal=True, backend=backend)
        return
    _compare(backend, 1, 2, 2, Lq, Lk, D, causal=causal)


@FEATURES
def test_long_pair(backend):
    # (1023, 1024): bands longer than one tile and more than one key chunk on the C++ path.
    _compare(backend, 1, 1, 1, 1023, 1024, 16, causal=True)
    _compare(backend, 1, 1, 1, 1023, 1024, 16, window=(300, 100))


# -- windows, GQA, padding, bias ----------------------------------------------------------------------------
@FEATURES
@pytest.mark.parametrize("window", [(7, 3), (0, 5), (-1, 4), (12, -1), (0, 0), (500, 500)])
def test_windows(backend, window):
    _compare(backend, 2, 2, 2, 61, 83, 16, window=window)


@FEATURES
def test_window_and_causal_combined(backend):
    # causal folds right = 0 into the window
    o = _compare(backend, 1, 2, 2, 50, 50, 16, window=(5, 9), causal=True)
    o2 = attention(*_inputs(1, 2, 2, 50, 50, 16, grad=False), window=(5, 0))
    assert o.shape == o2.shape


@FAST
@pytest.mark.parametrize("Hk", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_plain(backend, Hk, causal):
    _compare(backend, 2, 4, Hk, 51, 51, 40, causal=causal)


@FEATURES
@pytest.mark.parametrize("Hk", [1, 2])
def test_gqa(backend, Hk):
    _compare(backend, 2, 4, Hk, 37, 51, 40, window=(9, 2))


@FEATURES
def test_padding_with_fully_padded_row(backend):
    kpm = torch.rand(3, 70) > 0.3
    kpm[1] = False  # batch row 1 has no real key: its output must be 0 with finite gradients
    o = _compare(backend, 3, 2, 1, 45, 70, 16, key_padding_mask=kpm, window=(20, 20))
    assert torch.all(o[1] == 0)


@FEATURES
def test_fully_masked_rows_by_alignment(backend):
    # Lq > Lk with causal, bottom-right aligned: the first Lq - Lk rows see no key at all.
    o = _compare(backend, 1, 2, 2, 30, 12, 16, causal=True)
    assert torch.all(o[:, :, :18] == 0)
    _, lse = attention(*_inputs(1, 2, 2, 30, 12, 16, grad=False), causal=True, backend=backend,
                       return_lse=True)
    assert torch.isneginf(lse[:, :, :18]).all()


@FEATURES
@pytest.mark.parametrize("bias_shape", [(2, 2, 33, 47), (1, 2, 33, 47), (2, 1, 1, 47), (33, 47), (47,)])
def test_bias_and_its_gradient(backend, bias_shape):
    _compare(backend, 2, 2, 2, 33, 47, 16, bias_shape=bias_shape, window=(10, 10))


@FEATURES
def test_lse_gradient(backend):
    q, k, v = _inputs(1, 2, 2, 29, 41, 16)
    o, lse = attention(q, k, v, window=(6, 6), return_lse=True, backend=backend)
    o_r, lse_r = attention_ref(q, k, v, window=(6, 6), return_lse=True)
    g = torch.autograd.grad((o.square().sum() + lse.sin().sum()), (q, k, v))
    g_r = torch.autograd.grad((o_r.square().sum() + lse_r.sin().sum()), (q, k, v))
    for a, b in zip(g, g_r):
        torch.testing.assert_close(a, b, **TOL)


# -- dropout ----------------------------------------------------------------------------------------------
def _hash_keep_scalar(seed, b, h, i, j, H, p):
    M = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        x ^= x >> 16
        return x

    key = mix((seed & M) ^ mix(b * H + h))
    r = mix(key ^ mix((i * 0x9E3779B1 + j) & M))
    return (r >> 8) * 2.0**-24 >= p


def test_dropout_mask_is_the_shared_hash():
    m = dropout_keep_mask(12345, 2, 3, 40, 50, 0.3)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 39, 49), (1, 0, 17, 3), (0, 2, 5, 44)]:
        assert bool(m[b, h, i, j]) == _hash_keep_scalar(12345, b, h, i, j, 3, 0.3)
    assert abs(m.float().mean().item() - 0.7) < 0.02


@FEATURES
def test_dropout_against_reference_and_reproducible(backend):
    _compare(backend, 2, 2, 1, 40, 56, 16, window=(11, 4), dropout_p=0.25, dropout_seed=77)
    q, k, v = _inputs(1, 2, 2, 40, 56, 16, grad=False)
    a = attention(q, k, v, dropout_p=0.25, dropout_seed=5, backend=backend)
    b = attention(q, k, v, dropout_p=0.25, dropout_seed=5, backend=backend)
    c = attention(q, k, v, dropout_p=0.25, dropout_seed=6, backend=backend)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(3)
    d = attention(q, k, v, dropout_p=0.25, backend=backend)
    torch.manual_seed(3)
    e = attention(q, k, v, dropout_p=0.25, backend=backend)
    assert torch.equal(d, e)  # the seed is drawn from torch's generator


def test_dropout_same_mask_across_backends():
    require_backend("attention", "cpp")
    q, k, v = _inputs(1, 2, 2, 33, 33, 16, grad=False)
    a = attention(q, k, v, dropout_p=0.4, dropout_seed=9, backend="torch")
    b = attention(q, k, v, dropout_p=0.4, dropout_seed=9, backend="cpp")
    torch.testing.assert_close(a, b, **TOL)


# -- low precision (FlashAttention's criterion) ------------------------------------------------------------
def _dense_same_dtype(q, k, v, causal):
    s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        Lq, Lk = s.shape[-2:]
        ok = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
        s = s.masked_fill(~ok, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_cpp(dtype, causal):
    require_backend("attention", "cpp")
    q32, k32, v32 = _inputs(1, 2, 2, 77, 90, 40)
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q32, k32, v32))
    o = attention(q, k, v, causal=causal, backend="cpp")
    assert o.dtype == dtype
    qr = q.detach().float().requires_grad_(True)
    kr, vr = (t.detach().float().requires_grad_(True) for t in (k, v))
    o_ref = attention_ref(qr, kr, vr, causal=causal)
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o_t = _dense_same_dtype(qt, kt, vt, causal)
    assert_fa_close(o, o_ref, o_t, 2.0)
    g = torch.randn_like(o_ref)
    grads = torch.autograd.grad(o, (q, k, v), g.to(dtype))
    grads_r = torch.autograd.grad(o_ref, (qr, kr, vr), g)
    grads_t = torch.autograd.grad(o_t, (qt, kt, vt), g.to(dtype))
    for name, a, r, t in zip(("dq", "dk", "dv"), grads, grads_r, grads_t):
        assert_fa_close(a, r, t, 3.0, what=name)


# -- Triton under the interpreter: small shapes only ----------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        dict(B=1, H=2, Hk=2, Lq=1, Lk=37, D=16),
        dict(B=1, H=2, Hk=1, Lq=29, Lk=29, D=40, causal=True),
        dict(B=1, H=2, Hk=2, Lq=21, Lk=45, D=16, window=(7, 3)),
        dict(B=2, H=2, Hk=2, Lq=17, Lk=33, D=16, padded=True, bias_shape=(2, 1, 17, 33)),
        dict(B=1, H=2, Hk=2, Lq=19, Lk=19, D=16, dropout_p=0.2, dropout_seed=4),
    ],
)
def test_triton_interpreter(case):
    require_backend("attention", "triton")
    case = dict(case)
    B, H, Hk, Lq, Lk, D = (case.pop(n) for n in ("B", "H", "Hk", "Lq", "Lk", "D"))
    if case.pop("padded", False):
        kpm = torch.rand(B, Lk) > 0.3
        kpm[-1] = False
        case["key_padding_mask"] = kpm
    _compare("triton", B, H, Hk, Lq, Lk, D, **case)


def test_triton_fp16_interpreter():
    require_backend("attention", "triton")
    q32, k32, v32 = _inputs(1, 2, 2, 24, 24, 16, grad=False)
    q, k, v = (t.half() for t in (q32, k32, v32))
    o = attention(q, k, v, causal=True, backend="triton")
    ref = attention_ref(q.float(), k.float(), v.float(), causal=True)
    assert_fa_close(o, ref, _dense_same_dtype(q, k, v, True), 2.0)


def test_triton_refuses_head_dim_over_256_and_auto_falls_back():
    require_backend("attention", "triton")
    q, k, v = _inputs(1, 1, 1, 5, 7, 272, grad=False)
    with pytest.raises(BackendUnavailableError, match="head dim 272 > 256"):
        attention(q, k, v, backend="triton")
    torch.testing.assert_close(attention(q, k, v), attention_ref(q, k, v), **TOL)


# -- selection, compile, empty inputs ---------------------------------------------------------------------
def test_auto_selects_a_kernel_on_cpu():
    require_backend("attention", "cpp")
    plain = {"head_dim": 64, "window": (-1, 0), "Lq": 64, "Lk": 64}
    assert select("attention", Call(torch.device("cpu"), torch.float32, plain)).backend in ("cpp", "aten")
    windowed = dict(plain, window=(8, 0))
    assert select("attention", Call(torch.device("cpu"), torch.float32, windowed)).backend == "cpp"


def test_torch_compile_fullgraph():
    q, k, v = _inputs(1, 2, 2, 20, 20, 16, grad=False)
    f = torch.compile(lambda a, b, c: attention(a, b, c, window=(3, 3)), fullgraph=True, backend="eager")
    torch.testing.assert_close(f(q, k, v), attention_ref(q, k, v, window=(3, 3)), **TOL)


def test_empty_key_sequence_gives_zeros():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8)
    o, lse = attention(q, k, v, return_lse=True)
    assert torch.all(o == 0) and torch.isneginf(lse).all()


# -- bad inputs -------------------------------------------------------------------------------------------
def test_bad_inputs():
    q, k, v = _inputs(2, 4, 2, 8, 9, 16, grad=False)
    with pytest.raises(ValueError, match="'k' and 'v' must have the same shape"):
        attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="batch"):
        attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="head dim"):
        attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=(-2, 3))
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=(1, 2, 3))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match="attn_bias"):
        attention(q, k, v, attn_bias=torch.zeros(3, 8, 9))
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="'scale'"):
        attention(q, k, v, scale=True)  # a bool is not a scale
    with pytest.raises(ValueError, match="4 dimensions"):
        attention(q[0], k, v)
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k.double(), v.double())
    with pytest.raises(ValueError, match="meta"):
        attention(q, k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="unknown backend"):
        attention(q, k, v, backend="nope")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["cpp", "aten"])
def test_plain_calls_with_lse_gradient(causal, backend):
    """Plain full/causal calls on ATen's flash CPU kernel and on the banded C++ kernel."""
    require_backend("attention", backend)
    q, k, v = (torch.randn(2, 3, 97, 40, requires_grad=True) for _ in range(3))
    out, lse = attention(q, k, v, causal=causal, return_lse=True, backend=backend)
    ref, lse_ref = attention_ref(q, k, v, causal=causal, return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=1e-4)
    do = torch.randn_like(out)
    g = torch.autograd.grad((out * do).sum() + lse.sum(), (q, k, v))
    gr = torch.autograd.grad((ref * do).sum() + lse_ref.sum(), (q, k, v))
    for a, b in zip(g, gr):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
