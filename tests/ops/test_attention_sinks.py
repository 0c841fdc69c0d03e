"""Attention sinks (gpt-oss's ``s_aux``): one logit per head in every row's softmax denominator, on every
backend and path (plain, GQA, window, padding, 'blhd', varlen, the decode cache kernel), outputs and gradients
(q, k, v and the sinks) against an fp64 composition of gpt-oss's eager formula."""

from __future__ import annotations

import pytest
import torch

from fastarch import BackendUnavailableError
from fastarch.ops import attention
from tests._backends import backend_cases, case_id, require_backend


def _reference(q, k, v, sinks, *, window=(-1, -1), key_padding_mask=None, scale=None):
    """gpt-oss's eager attention in fp64: scores, the sink as an extra column, softmax, drop the column."""
    q, k, v, s = (t.double() for t in (q, k, v, sinks))
    B, H, Lq, D = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    Lk = k.shape[2]
    i = torch.arange(Lq)[:, None] + Lk - Lq
    j = torch.arange(Lk)[None, :]
    left, right = window
    keep = torch.ones(Lq, Lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    keep = keep[None, None]
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    combined = torch.cat([scores, s[None, :, None, None].expand(B, H, Lq, 1)], -1)
    probs = torch.softmax(combined, -1)[..., :-1]
    return probs @ v


def _inputs(B=2, H=4, Hk=2, Lq=9, Lk=9, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g)
    k = torch.randn(B, Hk, Lk, D, generator=g)
    v = torch.randn(B, Hk, Lk, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("case", backend_cases("attention"), ids=case_id)
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "padding"])
def test_sinks_match_gpt_oss_formula(case, feature):
    _, backend, device = case
    require_backend("attention", backend, device)
    q, k, v, sinks = _inputs()
    kw: dict = {}
    ref_kw: dict = {}
    if feature == "causal":
        kw["causal"] = True
        ref_kw["window"] = (-1, 0)
    elif feature == "window":
        kw["window"] = ref_kw["window"] = (3, 0)
    elif feature == "padding":
        kpm = torch.ones(2, 9, dtype=torch.bool)
        kpm[1, :4] = False
        kw["key_padding_mask"] = ref_kw["key_padding_mask"] = kpm
    if backend == "aten" and feature in ("window", "padding"):
        # aten declares no windows or masks: forced, it refuses with the reasons (auto sends them elsewhere)
        with pytest.raises(BackendUnavailableError, match="aten"):
            attention(q, k, v, sinks=sinks, backend=backend, **kw)
        return
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attention(*leaves[:3], sinks=leaves[3], backend=backend, **kw)
    want_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, sinks)]
    want = _reference(*want_leaves, **ref_kw)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    dout = torch.randn_like(want)
    out.backward(dout.float())
    want.backward(dout)
    for name, got_leaf, want_leaf in zip(("q", "k", "v", "sinks"), leaves, want_leaves):
        torch.testing.assert_close(got_leaf.grad.double(), want_leaf.grad, atol=5e-5, rtol=5e-5, msg=name)


def test_sinks_in_every_layout_and_path():
    """'blhd', varlen and the decode cache kernel give what 'bhld' gives; lse includes the sink."""
    q, k, v, sinks = _inputs(B=2, H=4, Hk=2, Lq=1, Lk=12)
    want, lse = attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend="torch")
    with torch.no_grad():  # the cpp backend's cache kernel serves this decode-sized call
        got = attention(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, lse_plain = attention(q, k, v, causal=True, return_lse=True, backend="torch")
    torch.testing.assert_close(lse, torch.logaddexp(lse_plain, sinks[None, :, None]))
    blhd = attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, sinks=sinks, layout="blhd")
    torch.testing.assert_close(blhd.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 24], dtype=torch.int32)
    packed = attention(q.transpose(1, 2).reshape(2, 4, 16), k.transpose(1, 2).reshape(24, 2, 16),
                       v.transpose(1, 2).reshape(24, 2, 16), causal=True, sinks=sinks, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=12)
    torch.testing.assert_close(packed, want.transpose(1, 2).reshape(2, 4, 16), atol=1e-5, rtol=1e-5)


def test_a_row_without_keys_gives_zero_and_bad_sinks_raise():
    q, k, v, sinks = _inputs(B=1, H=4, Hk=2, Lq=3, Lk=3)
    kpm = torch.zeros(1, 3, dtype=torch.bool)
    out = attention(q, k, v, key_padding_mask=kpm, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="argument 'sinks' must have one logit per query head"):
        attention(q, k, v, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="argument 'sinks' must have 1 dimensions"):
        attention(q, k, v, sinks=torch.zeros(4, 1))
    with pytest.raises(TypeError, match="argument 'sinks'"):
        attention(q, k, v, sinks=[0.0] * 4)
