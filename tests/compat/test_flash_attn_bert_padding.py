"""flash_attn.bert_padding (fastarch.compat.flash_attn): flash-attn 2.7's five-value ``unpad_input`` with
``unused_mask``, ``pad_input``, the differentiable index functions and the padded/varlen attention equivalence
flash-attn's tests rely on."""

import torch

from fastarch.compat.flash_attn import flash_attn_func, flash_attn_varlen_func
from fastarch.compat.flash_attn.bert_padding import (
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def _mask(lengths, seqlen):
    return torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]


def test_unpad_pad_roundtrip_and_returns():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = _mask([5, 2, 3], 5)
    out, indices, cu, max_seqlen, used = unpad_input(x, mask)
    assert out.shape == (10, 2, 4)
    assert indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 7, 10]
    assert isinstance(max_seqlen, int) and max_seqlen == 5
    assert used.dtype == torch.int32 and used.tolist() == [5, 2, 3]
    back = pad_input(out, indices, 3, 5)
    torch.testing.assert_close(back, x * mask[..., None, None])
    g = torch.randn_like(back)
    back.backward(g)
    torch.testing.assert_close(x.grad, g * mask[..., None, None])  # gradients reach only the kept tokens


def test_unused_mask():
    x = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)
    attn = _mask([2, 1], 4)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    out, indices, cu, max_seqlen, used = unpad_input(x, attn, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.tolist() == [0, 3, 6] and max_seqlen == 3 and used.tolist() == [2, 1]
    torch.testing.assert_close(out[:, 0], torch.tensor([0.0, 1.0, 2.0, 4.0, 5.0, 6.0]))


def test_index_functions_gradients():
    torch.manual_seed(1)
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    y = index_first_axis(x, idx)
    g = torch.randn_like(y)
    y.backward(g)
    want = torch.zeros(6, 3)
    want[idx] = g
    torch.testing.assert_close(x.grad, want)
    v = torch.randn(3, 3, requires_grad=True)
    put = index_put_first_axis(v, idx, 6)
    torch.testing.assert_close(put[idx], v.detach())
    assert float(put.detach()[[1, 3, 5]].abs().sum()) == 0.0
    put.sum().backward()
    torch.testing.assert_close(v.grad, torch.ones(3, 3))
    x2 = torch.randn(6, 3, requires_grad=True)
    sel, full = index_first_axis_residual(x2, idx)
    (sel.sum() * 2 + full.sum()).backward()
    want = torch.ones(6, 3)
    want[idx] += 2
    torch.testing.assert_close(x2.grad, want)


def test_concatenated_sequences():
    x = torch.randn(3, 6, 2)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    out, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    torch.testing.assert_close(out, x.reshape(18, 2)[indices])


def test_varlen_attention_matches_padded():
    """The pattern of flash-attn's tests: unpad, run the varlen kernel, pad back == the padded kernel on the
    valid rows."""
    torch.manual_seed(2)
    B, L, H, D = 3, 7, 2, 16
    q, k, v = (torch.randn(B, L, H, D, requires_grad=True) for _ in range(3))
    lengths = [7, 3, 5]
    mask = _mask(lengths, L)
    q_u, idx, cu, max_s, _ = unpad_input(q, mask)
    k_u, _, _, _, _ = unpad_input(k, mask)
    v_u, _, _, _, _ = unpad_input(v, mask)
    out = pad_input(flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True), idx, B, L)
    for b, n in enumerate(lengths):
        want = flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        torch.testing.assert_close(out[b:b + 1, :n], want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert float(q.grad[1, 3:].abs().sum()) == 0.0 and float(q.grad[1, :3].abs().sum()) > 0
