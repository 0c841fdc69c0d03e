"""flash_attn.layers.rotary and flash_attn.ops.triton.rotary (fastarch.compat.flash_attn) against a plain
PyTorch rotary transcribed from flash-attn's test reference; flash-attn's test grid on small shapes."""

import pytest
import torch

from fastarch.compat.flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_func,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
    apply_rotary_emb_torch,
)
from fastarch.compat.flash_attn.ops.triton.rotary import apply_rotary


def rotary_reference(x, cos, sin, interleaved=False):
    """x (B, L, H, D); cos/sin (L, R) or (B, L, R); rotates the first 2R features, in x's dtype."""
    ro = 2 * cos.shape[-1]
    if interleaved:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        a, b = x[..., :ro:2], x[..., 1:ro:2]
        rot = torch.stack((-b, a), -1).flatten(-2)
    else:
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        a, b = x[..., : ro // 2], x[..., ro // 2: ro]
        rot = torch.cat((-b, a), -1)
    c, s = c.unsqueeze(-2).to(x.dtype), s.unsqueeze(-2).to(x.dtype)
    return torch.cat([x[..., :ro] * c + rot * s, x[..., ro:]], -1)


def _tables(n, rotary_dim, dtype):
    angle = torch.randn(n, rotary_dim // 2)
    return angle.cos().to(dtype), angle.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_single_tensor(inplace, rotary_fraction, dtype, interleaved):
    torch.manual_seed(0)
    batch, nheads, seqlen, headdim = 3, 2, 37, 32
    x = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, requires_grad=True)
    x_pt = x.detach().clone().requires_grad_()
    rotary_dim = int(rotary_fraction * headdim)
    cos, sin = _tables(seqlen, rotary_dim, dtype)
    out = apply_rotary_emb_func(x, cos, sin, interleaved, inplace)
    out_pt = rotary_reference(x_pt.float(), cos.float(), sin.float(), interleaved).to(dtype)
    tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_pt, **tol)
    g = torch.randn_like(out)
    out.backward(g)
    out_pt.backward(g.clone())
    torch.testing.assert_close(x.grad, x_pt.grad, **tol)
    if inplace:
        torch.testing.assert_close(x.detach(), out.detach())  # x was rotated in place


@pytest.mark.parametrize("interleaved", [False, True])
def test_seqlen_offsets_tensor_and_varlen(interleaved):
    torch.manual_seed(1)
    batch, seqlen, nheads, headdim, rotary_dim = 3, 5, 2, 16, 8
    cos, sin = _tables(12, rotary_dim, torch.float32)
    x = torch.randn(batch, seqlen, nheads, headdim, requires_grad=True)
    offsets = torch.tensor([0, 4, 9], dtype=torch.int32)  # the last runs past the 12 table rows
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    rows = []
    for b, off in enumerate(offsets.tolist()):
        n = min(seqlen, 12 - off)  # positions past the tables stay unrotated, as in flash-attn
        rot = rotary_reference(x[b:b + 1, :n].detach(), cos[off:off + n], sin[off:off + n], interleaved)
        rows.append(torch.cat([rot, x[b:b + 1, n:].detach()], 1))
    torch.testing.assert_close(out.detach(), torch.cat(rows))
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    # packed sequences with an int offset
    cu = torch.tensor([0, 2, 7, 8], dtype=torch.int32)
    xv = torch.randn(8, nheads, headdim)
    out = apply_rotary_emb(xv, cos, sin, interleaved, seqlen_offsets=3, cu_seqlens=cu, max_seqlen=5)
    want = torch.cat([rotary_reference(xv[None, s:e], cos[3:3 + e - s], sin[3:3 + e - s], interleaved)[0]
                      for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, want)
    # per-sequence offsets with packed sequences
    offs = torch.tensor([1, 0, 4])
    out = apply_rotary(xv, cos, sin, seqlen_offsets=offs, cu_seqlens=cu, max_seqlen=5, interleaved=interleaved)
    want = torch.cat([rotary_reference(xv[None, s:e], cos[o:o + e - s], sin[o:o + e - s], interleaved)[0]
                      for s, e, o in zip(cu[:-1].tolist(), cu[1:].tolist(), offs.tolist())])
    torch.testing.assert_close(out, want)


def test_conjugate_is_inverse_and_torch_reference():
    torch.manual_seed(2)
    cos, sin = _tables(6, 8, torch.float32)
    x = torch.randn(2, 6, 3, 12)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(apply_rotary(y, cos, sin, conjugate=True), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary_emb_torch(x, cos, sin), rotary_reference(x, cos, sin))
    per_batch = torch.stack([cos, cos.flip(0)]), torch.stack([sin, sin.flip(0)])
    torch.testing.assert_close(apply_rotary_emb_torch(x, *per_batch), rotary_reference(x, *per_batch))


@pytest.mark.parametrize("gqa", [False, True])
def test_qkv_and_kv_inplace(gqa):
    torch.manual_seed(3)
    B, L, H, D, R = 2, 6, 4, 16, 16
    cos, sin = _tables(L + 2, R, torch.float32)
    if gqa:
        Hk = 2
        qkv = torch.randn(B, L, H + 2 * Hk, D)
        base = qkv.clone()
        out = apply_rotary_emb_qkv_(qkv, cos, sin, seqlen_offsets=2, num_heads_q=H)
        assert out.data_ptr() == qkv.data_ptr()
        torch.testing.assert_close(qkv[:, :, :H], rotary_reference(base[:, :, :H], cos[2:], sin[2:]))
        torch.testing.assert_close(qkv[:, :, H:H + Hk], rotary_reference(base[:, :, H:H + Hk], cos[2:], sin[2:]))
        torch.testing.assert_close(qkv[:, :, H + Hk:], base[:, :, H + Hk:])
        return
    qkv = torch.randn(B, L, 3, H, D, requires_grad=True)
    leaf = qkv.detach().clone()
    work = qkv * 1.0
    cos_k, sin_k = _tables(L, R, torch.float32)
    out = apply_rotary_emb_qkv_(work, cos[:L], sin[:L], cos_k, sin_k)
    torch.testing.assert_close(out[:, :, 0], rotary_reference(leaf[:, :, 0], cos[:L], sin[:L]))
    torch.testing.assert_close(out[:, :, 1], rotary_reference(leaf[:, :, 1], cos_k, sin_k))
    torch.testing.assert_close(out[:, :, 2], leaf[:, :, 2])
    g = torch.randn_like(out)
    out.backward(g)
    ref = leaf.clone().requires_grad_()
    rq = rotary_reference(ref[:, :, 0], cos[:L], sin[:L])
    rk = rotary_reference(ref[:, :, 1], cos_k, sin_k)
    torch.stack([rq, rk, ref[:, :, 2]], 2).backward(g)
    torch.testing.assert_close(qkv.grad, ref.grad)
    kv = torch.randn(B, L, 2, H, D)
    base = kv.clone()
    assert apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=1).data_ptr() == kv.data_ptr()
    torch.testing.assert_close(kv[:, :, 0], rotary_reference(base[:, :, 0], cos[1:L + 1], sin[1:L + 1]))
    torch.testing.assert_close(kv[:, :, 1], base[:, :, 1])


@pytest.mark.parametrize("scale_base", [None, 16.0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_module(scale_base, interleaved):
    torch.manual_seed(4)
    B, L, H, D, R = 2, 5, 2, 16, 8
    emb = RotaryEmbedding(R, base=500.0, interleaved=interleaved, scale_base=scale_base)
    assert set(emb.state_dict()) == set()  # inv_freq and scale are non-persistent, as in flash-attn
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, R, 2).float() / R))
    torch.testing.assert_close(emb.inv_freq, inv_freq)
    qkv = torch.randn(B, L, 3, H, D)
    base = qkv.clone()
    out = emb(qkv, seqlen_offset=3)
    pos = torch.arange(L + 3).float()
    ang = torch.outer(pos, inv_freq)
    cos, sin = ang.cos(), ang.sin()
    if scale_base is None:
        cos_k, sin_k = cos, sin
    else:
        scale = ((torch.arange(0, R, 2).float() + 0.4 * R) / (1.4 * R)) ** ((pos - (L + 3) // 2) / scale_base)[:, None]
        cos, sin, cos_k, sin_k = cos * scale, sin * scale, cos / scale, sin / scale
    torch.testing.assert_close(out[:, :, 0], rotary_reference(base[:, :, 0], cos[3:], sin[3:], interleaved))
    torch.testing.assert_close(out[:, :, 1], rotary_reference(base[:, :, 1], cos_k[3:], sin_k[3:], interleaved))
    # q and kv separately, per-batch offsets with max_seqlen
    q, kv = torch.randn(B, L, H, D), torch.randn(B, L, 2, 1, D)
    q0, kv0 = q.clone(), kv.clone()
    emb2 = RotaryEmbedding(R, interleaved=interleaved)
    offs = torch.tensor([0, 2])
    q1, kv1 = emb2(q, kv, seqlen_offset=offs, max_seqlen=L + 2)
    c, s = emb2._cos_cached, emb2._sin_cached
    assert c.shape == (L + 2, R // 2)
    for b, o in enumerate(offs.tolist()):
        torch.testing.assert_close(q1[b:b + 1], rotary_reference(q0[b:b + 1], c[o:o + L], s[o:o + L], interleaved))
        torch.testing.assert_close(kv1[b:b + 1, :, 0],
                                   rotary_reference(kv0[b:b + 1, :, 0], c[o:o + L], s[o:o + L], interleaved))


def test_rotary_bad_input():
    cos, sin = _tables(4, 8, torch.float32)
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary(torch.randn(1, 4, 1, 8), cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(torch.randn(1, 4, 1, 4), cos, sin)
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary(torch.randn(4, 1, 8), cos, sin, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
