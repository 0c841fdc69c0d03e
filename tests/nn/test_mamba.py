"""MambaBlock (guide drop-in), Mamba (mamba-ssm's init) and MambaLM (decode == full forward)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.nn import Mamba, MambaBlock, MambaLM
from fastarch.testing.guides import MambaBlock as GuideMambaBlock


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_mamba_block_matches_guide(backend):
    from fastarch.backend import use_backend

    guide = GuideMambaBlock(16, d_state=4, d_conv=3, expand=2).eval()
    fast = MambaBlock(16, d_state=4, d_conv=3, expand=2).eval()
    assert set(fast.state_dict()) == set(guide.state_dict())
    fast.load_state_dict(guide.state_dict(), strict=True)
    x = torch.randn(2, 23, 16)
    xg = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    ref = guide(xg)
    with use_backend(selective_scan=backend, causal_conv1d=backend):
        out = fast(xf)
        out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xf.grad, xg.grad, rtol=1e-4, atol=1e-4)
    for (n, p), (_, q) in zip(fast.named_parameters(), guide.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_mamba_block_step_matches_forward(backend):
    from fastarch.backend import use_backend

    blk = MambaBlock(8, d_state=4).eval()
    x = torch.randn(2, 9, 8)
    full = blk(x)
    cache = blk.allocate_inference_cache(2)
    with use_backend(selective_state_update=backend, causal_conv1d_update=backend):
        outs = [blk.step(x[:, t], cache) for t in range(9)]
    torch.testing.assert_close(torch.stack(outs, 1), full, rtol=1e-4, atol=1e-5)


def test_mamba_init_follows_mamba_ssm():
    m = Mamba(32, d_state=8, dt_min=0.01, dt_max=0.05)
    assert m.dt_rank == math.ceil(32 / 16) and m.d_inner == 64
    assert m.x_proj.weight.shape == (m.dt_rank + 16, 64) and m.x_proj.bias is None
    assert m.in_proj.bias is None and m.conv1d.bias is not None
    torch.testing.assert_close(m.A_log, torch.log(torch.arange(1, 9.0)).repeat(64, 1))
    dt = F.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.01 * 0.999 and dt.max() <= 0.05 * 1.001
    assert m.A_log._no_weight_decay and m.D._no_weight_decay
    bound = m.dt_rank ** -0.5
    assert m.dt_proj.weight.abs().max() <= bound
    with pytest.raises(NotImplementedError, match="dt_init"):
        Mamba(8, dt_init="bogus")


def test_mamba_prefill_then_step_matches_forward():
    m = Mamba(16, d_state=4, d_conv=4).eval()
    x = torch.randn(2, 12, 16)
    full = m(x)
    cache = m.allocate_inference_cache(2)
    pre = m(x[:, :5], cache=cache)
    torch.testing.assert_close(pre, full[:, :5], rtol=1e-4, atol=1e-5)
    steps = [m.step(x[:, t:t + 1], cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], rtol=1e-4, atol=1e-5)


def test_mamba_lm_step_decode_equals_forward():
    torch.manual_seed(0)
    lm = MambaLM(vocab_size=50, d_model=16, n_layers=2, d_state=4).eval()
    assert lm.lm_head.weight is lm.embedding.weight
    ids = torch.randint(0, 50, (2, 10))
    full = lm(ids)
    assert full.shape == (2, 10, 50)
    cache = lm.allocate_inference_cache(2)
    steps = torch.stack([lm.step(ids[:, t], cache) for t in range(10)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    assert cache.seqlen_offset == 10


def test_mamba_lm_generate_greedy_is_consistent():
    lm = MambaLM(vocab_size=30, d_model=16, n_layers=1, d_state=4).eval()
    ids = torch.randint(0, 30, (1, 4))
    out = lm.generate(ids, max_new_tokens=5)
    assert out.shape == (1, 9) and torch.equal(out[:, :4], ids)
    # Greedy: every generated token is the argmax of a full forward over the prefix.
    for t in range(4, 9):
        assert out[0, t] == lm(out[:, :t])[0, -1].argmax()


def test_mamba_lm_trains():
    lm = MambaLM(vocab_size=20, d_model=16, n_layers=1, d_state=4)
    ids = torch.randint(0, 20, (2, 8))
    loss = F.cross_entropy(lm(ids)[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters())


def _step_pair(module, batch: int, seed: int = 0):
    """Two identical random (conv_state, ssm_state) caches for ``module``."""
    g = torch.Generator().manual_seed(seed)
    a = module.allocate_inference_cache(batch)
    a.conv_state.copy_(torch.randn(a.conv_state.shape, generator=g))
    a.ssm_state.copy_(torch.randn(a.ssm_state.shape, generator=g))
    b = module.allocate_inference_cache(batch)
    b.conv_state.copy_(a.conv_state)
    b.ssm_state.copy_(a.ssm_state)
    return a, b


@pytest.mark.parametrize("make", [lambda: Mamba(24, d_state=8, d_conv=4, bias=True),
                                  lambda: Mamba(16, d_state=4, d_conv=3, conv_bias=False, dt_rank=3),
                                  lambda: MambaBlock(8, d_state=4, d_conv=2)],
                         ids=["mamba-bias", "mamba-no-conv-bias", "guide-block"])
def test_fused_mixer_step_matches_op_by_op(make):
    """The fused C++ decode step (the cpp backend of ops.mamba_mixer_step) gives the op-by-op step's output and
    states (batch 3, several steps)."""
    from fastarch.backend import log_decisions, use_backend

    torch.manual_seed(0)
    m = make().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fused, ops = _step_pair(m, 3)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, m.d_model)
            with log_decisions() as log:
                got = m.step(x, fused)
            assert [(op, backend) for op, _, _, backend, _ in log] == [("mamba_mixer_step", "cpp")]
            with use_backend(mamba_mixer_step="torch"):
                want = m.step(x, ops)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused.conv_state, ops.conv_state, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused.ssm_state, ops.ssm_state, rtol=1e-5, atol=1e-5)


def test_mixer_step_falls_back_to_ops_where_the_kernel_does_not_apply():
    """Autograd and a non-contiguous state run op by op (the selector refuses cpp for them, saying why)."""
    from fastarch.backend import log_decisions

    m = Mamba(16, d_state=4).eval()
    cache = m.allocate_inference_cache(2)
    x = torch.randn(2, 16)
    with log_decisions() as log:
        out = m.step(x, cache)  # grad enabled, parameters require grad
    assert out.requires_grad and log[0][3] == "torch"
    with torch.no_grad():
        conv = cache.conv_state.clone()
        cache.conv_state = conv.transpose(1, 2).contiguous().transpose(1, 2)
        with log_decisions() as log:
            m.step(x, cache)
        assert log[0][:1] == ("mamba_mixer_step",) and log[0][3] == "torch"
        torch.testing.assert_close(cache.conv_state[..., :-1], conv[..., 1:])
    import fastarch

    text = fastarch.explain("mamba_mixer_step", x, batch=2, all_fp32=True, contiguous=False, grad=False)
    assert "every tensor must be contiguous" in text


def test_mixer_step_rejects_bad_input_before_touching_the_states():
    m = Mamba(16, d_state=4).eval()
    cache, _ = _step_pair(m, 2)
    conv, ssm = cache.conv_state.clone(), cache.ssm_state.clone()
    args = (m.in_proj, m.conv1d, m.x_proj, m.dt_proj, m.A_log, m.D, m.out_proj)
    from fastarch.nn.mamba import mixer_step

    with torch.no_grad():
        with pytest.raises(ValueError, match="argument 'x' must be \\(batch, 16\\)"):
            mixer_step(torch.randn(2, 15), *args, cache.conv_state, cache.ssm_state)
        with pytest.raises(ValueError, match="argument 'ssm_state' must be \\(2, 32, 4\\)"):
            mixer_step(torch.randn(2, 16), *args, cache.conv_state, cache.ssm_state[:, :, :3].contiguous())
        with pytest.raises(ValueError, match="argument 'conv_state' must be \\(3, 32, width\\)"):
            mixer_step(torch.randn(3, 16), *args, cache.conv_state, cache.ssm_state)
    assert torch.equal(cache.conv_state, conv) and torch.equal(cache.ssm_state, ssm)


def test_fused_lm_step_with_norm_and_residual_matches_op_by_op():
    """MambaLM's step (norm, mixer and residual in one fused call per layer) against the op-by-op step."""
    from fastarch.backend import use_backend

    torch.manual_seed(0)
    lm = MambaLM(vocab_size=40, d_model=24, n_layers=2, d_state=8, norm_eps=1e-3).eval()
    with torch.no_grad():
        for layer in lm.layers:
            layer.norm.weight.normal_()
    fused, ops = lm.allocate_inference_cache(2), lm.allocate_inference_cache(2)
    for _ in range(3):
        ids = torch.randint(0, 40, (2,))
        got = lm.step(ids, fused)
        with use_backend(mamba_mixer_step="torch"):
            want = lm.step(ids, ops)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused.layers, ops.layers):
        torch.testing.assert_close(a.ssm_state, b.ssm_state, rtol=1e-5, atol=1e-5)


