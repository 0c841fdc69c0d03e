"""Reformer modules: LSHAttention drop-in, reversible backward == ordinary backward, memory flat in depth."""

from __future__ import annotations

import pytest
import torch

from fastarch.models.registry import create_model
from fastarch.nn import LSHAttention, Reformer, ReformerLM
from fastarch.ops.lsh_attention import lsh_attention, lsh_attention_ref


def test_lsh_attention_module_matches_op_and_keeps_guide_keys():
    torch.manual_seed(0)
    m = LSHAttention(d_model=32, n_heads=4, n_hashes=2, bucket_size=8, dropout=0.1, seed=3).eval()
    assert set(m.state_dict()) == {
        f"{n}.{p}" for n in ("w_q", "w_k", "w_v", "w_o") for p in ("weight", "bias")
    }
    x = torch.randn(2, 37, 32)
    mask = torch.rand(2, 37) > 0.2
    out = m(x, mask.float())
    B, L = 2, 37
    qk = m.w_q(x).view(B, L, 4, 8).transpose(1, 2)
    v = m.w_v(x).view(B, L, 4, 8).transpose(1, 2)
    o = lsh_attention_ref(qk, v, n_hashes=2, bucket_size=8, seed=3, key_padding_mask=mask)
    want = m.w_o(o.transpose(1, 2).reshape(B, L, 32))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    # the 4-d guide-style key mask is the same mask
    torch.testing.assert_close(m(x, mask[:, None, None, :]), out)


def test_lsh_attention_module_causal_and_errors():
    m = LSHAttention(16, 2, n_hashes=2, bucket_size=4, dropout=0.0, causal=True, seed=0)
    x = torch.randn(1, 12, 16)
    y = m(x)
    # causal: changing the last token leaves the first outputs alone
    x2 = x.clone()
    x2[:, -1] += 1.0
    y2 = m(x2)
    # buckets may move with the last token; position 0 sees only itself, position 1 only 0 and itself
    torch.testing.assert_close(y[:, :1], y2[:, :1])
    with pytest.raises(ValueError, match="mask"):
        m(x, torch.ones(1, 12, 12))
    with pytest.raises(ValueError, match="divisible"):
        LSHAttention(10, 3)
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(12, 16))


def test_lsh_attention_module_hash_vectors():
    # the guide's hashing method: one round of the op's hash, same rotations for the same seed
    m = LSHAttention(32, 4, n_hashes=1, bucket_size=8, dropout=0.0, seed=9)
    x = torch.randn(2, 40, 32)
    qk = m.w_q(x).view(2, 40, 4, 8).transpose(1, 2).detach()
    h = m.hash_vectors(qk, 6)
    assert h.shape == (2, 4, 40) and h.dtype == torch.long
    assert int(h.min()) >= 0 and int(h.max()) < 6 and len(h.unique()) > 1
    _, buckets = lsh_attention(qk, qk, n_hashes=1, bucket_size=8, seed=9, return_buckets=True)
    assert torch.equal(h, buckets[:, :, 0])  # lsh_n_buckets(40, 8) == 6
    for bad in (0, 5, 1.0):
        with pytest.raises(ValueError, match="num_buckets"):
            m.hash_vectors(qk, bad)
    with pytest.raises(ValueError, match="vecs"):
        m.hash_vectors(qk[..., :4], 6)


def _grads(model, x, seed):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("causal", [False, True])
def test_reversible_backward_equals_ordinary(causal):
    torch.manual_seed(0)
    model = Reformer(
        d_model=16, n_heads=2, depth=3, n_hashes=2, bucket_size=8, dropout=0.1, causal=causal, ff_chunks=3
    )
    model.train()  # dropout and fresh rotations on: the replayed random state must match
    x = torch.randn(2, 29, 16)
    model.reversible = True
    out_r, dx_r, g_r = _grads(model, x, seed=5)
    model.reversible = False
    out_o, dx_o, g_o = _grads(model, x, seed=5)
    torch.testing.assert_close(out_r, out_o)
    torch.testing.assert_close(dx_r, dx_o, atol=1e-5, rtol=1e-4)
    assert set(g_r) == set(g_o) and len(g_r) > 0
    for name in g_o:
        torch.testing.assert_close(g_r[name], g_o[name], atol=1e-5, rtol=1e-4, msg=name)


def test_reversible_two_calls_before_one_backward():
    # each call replays its own random state (rotations, dropout), not the last call's
    torch.manual_seed(0)
    model = Reformer(d_model=16, n_heads=2, depth=2, n_hashes=2, bucket_size=8, dropout=0.1).train()
    xa, xb = torch.randn(2, 29, 16), torch.randn(2, 29, 16)

    def run(reversible: bool):
        model.reversible = reversible
        torch.manual_seed(5)
        a, b = xa.clone().requires_grad_(True), xb.clone().requires_grad_(True)
        (model(a) + 2.0 * model(b)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return a.grad, b.grad, grads

    da_r, db_r, g_r = run(True)
    da_o, db_o, g_o = run(False)
    torch.testing.assert_close(da_r, da_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(db_r, db_o, atol=1e-5, rtol=1e-4)
    for name in g_o:
        torch.testing.assert_close(g_r[name], g_o[name], atol=1e-5, rtol=1e-4, msg=name)


def _saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.requires_grad_(True)).sum()
    return total


def test_reversible_activation_memory_flat_in_depth():
    torch.manual_seed(0)
    x = torch.randn(1, 64, 16)
    kw = dict(d_model=16, n_heads=2, n_hashes=2, bucket_size=8, dropout=0.0)
    rev = [_saved_bytes(Reformer(depth=d, **kw), x.clone()) for d in (1, 4)]
    ordinary = [_saved_bytes(Reformer(depth=d, reversible=False, **kw), x.clone()) for d in (1, 4)]
    assert rev[0] == rev[1], rev
    assert ordinary[1] > 3 * ordinary[0] and ordinary[1] > 4 * rev[1], (ordinary, rev)


def test_reformer_lm_registry_and_training_step():
    model = create_model("reformer_tiny")
    assert isinstance(model, ReformerLM)
    ids = torch.randint(0, 256, (2, 40))
    logits = model(ids)
    assert logits.shape == (2, 40, 256)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    loss.backward()
    assert model.tok.weight.grad is not None and torch.isfinite(model.tok.weight.grad).all()
    assert all(p.grad is not None for p in model.reformer.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 600, dtype=torch.long))
