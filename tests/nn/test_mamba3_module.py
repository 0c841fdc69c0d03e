"""fastarch.nn.Mamba3 against mamba-ssm's Mamba3: state_dict keys and shapes, a state dict with the peer's keys
loads and gives the peer's forward (composed here from transcriptions of its module and reference functions),
prefill + decode steps equal one forward, packed sequences, the compat path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch.nn import InferenceParams, Mamba3
from fastarch.ops import mamba3_scan_ref
from tests.ops._mamba3_peer import peer_mimo_chunk_ref, peer_siso_fwd_ref


def peer_keys(d_model, d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, is_mimo=False, mimo_rank=4,
              is_outproj_norm=False):
    """mamba-ssm's Mamba3 parameters: name -> shape."""
    d_inner = expand * d_model
    H, R = d_inner // headdim, (mimo_rank if is_mimo else 1)
    split = int(d_state * rope_fraction)
    split -= split % 2
    S = split // 2
    keys = {"in_proj.weight": (2 * d_inner + 2 * d_state * ngroups * R + 3 * H + S, d_model), "dt_bias": (H,),
            "B_bias": (H, R, d_state), "C_bias": (H, R, d_state), "B_norm.weight": (d_state,),
            "C_norm.weight": (d_state,), "D": (H,), "out_proj.weight": (d_model, d_inner)}
    if is_mimo:
        keys.update({"mimo_x": (H, R, headdim), "mimo_z": (H, R, headdim), "mimo_o": (H, R, headdim)})
    if is_outproj_norm:
        keys["norm.weight"] = (d_inner,)
    return keys


def _rms(x, w, eps=1e-5, group=None):
    if group is not None:
        xs = x.unflatten(-1, (-1, group))
        return (xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + eps)).flatten(-2) * w
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def peer_forward(sd, cfg, u):
    """mamba-ssm's ``Mamba3.forward`` (no cache) with the parameters ``sd``, on the transcribed references."""
    d_inner = cfg["expand"] * cfg["d_model"]
    P, N, G = cfg["headdim"], cfg["d_state"], cfg["ngroups"]
    H = d_inner // P
    mimo = cfg.get("is_mimo", False)
    R = cfg.get("mimo_rank", 4) if mimo else 1
    S = sd["in_proj.weight"].shape[0] - (2 * d_inner + 2 * N * G * R + 3 * H)
    b, L, _ = u.shape
    z, x, B, C, dd_dt, dd_A, trap, ang = torch.split(u @ sd["in_proj.weight"].T,
                                                     [d_inner, d_inner, N * G * R, N * G * R, H, H, H, S], -1)
    z, x = z.unflatten(-1, (H, P)), x.unflatten(-1, (H, P))
    B = _rms(B.reshape(b, L, R, G, N), sd["B_norm.weight"])
    C = _rms(C.reshape(b, L, R, G, N), sd["C_norm.weight"])
    A = torch.clamp(-F.softplus(dd_A), max=-1e-4)
    DT = F.softplus(dd_dt + sd["dt_bias"])
    ADT, DT, trap = (A * DT).transpose(1, 2), DT.transpose(1, 2), trap.transpose(1, 2)
    ang = ang.unsqueeze(-2).expand(-1, -1, H, -1)
    outproj_norm = cfg.get("is_outproj_norm", False)
    if mimo:
        y = peer_mimo_chunk_ref(C, B, x, ADT, DT, trap, sd["C_bias"], sd["B_bias"], ang, sd["mimo_x"], sd["mimo_o"],
                                sd["D"], z, sd["mimo_z"], chunk_size=cfg.get("chunk_size", 64) // R or 1,
                                rotary_dim_divisor=int(2 / cfg.get("rope_fraction", 0.5)))
        y = y.flatten(-2)
    else:
        y, _ = peer_siso_fwd_ref(C[:, :, 0], B[:, :, 0], x, ADT, DT, trap, sd["C_bias"][:, 0], sd["B_bias"][:, 0], ang,
                                 sd["D"], None if outproj_norm else z)
        y = y.flatten(-2)
        if outproj_norm:
            y = _rms(y, sd["norm.weight"], group=P) * F.silu(z.flatten(-2))
    return y @ sd["out_proj.weight"].T


def random_state_dict(keys, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in keys.items():
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * t
        elif name in ("in_proj.weight", "out_proj.weight"):
            t = t / math.sqrt(shape[1])
        elif name == "dt_bias":
            t = t - 3
        sd[name] = t
    return sd


CONFIGS = [
    dict(d_model=16, d_state=16, expand=2, headdim=8, ngroups=1),
    dict(d_model=16, d_state=16, expand=2, headdim=8, ngroups=2, rope_fraction=1.0),
    dict(d_model=16, d_state=16, expand=2, headdim=8, ngroups=1, is_outproj_norm=True),
    dict(d_model=16, d_state=16, expand=2, headdim=8, ngroups=1, is_mimo=True, mimo_rank=2, chunk_size=8),
    dict(d_model=16, d_state=32, expand=2, headdim=8, ngroups=1, is_mimo=True, mimo_rank=4, chunk_size=16,
         rope_fraction=1.0),
]
IDS = ["siso", "siso-g2-rope1", "siso-outnorm", "mimo-r2", "mimo-r4-rope1"]


@pytest.mark.parametrize("cfg", CONFIGS + [dict(d_model=16, d_state=16, headdim=8, is_mimo=True, is_outproj_norm=True)],
                         ids=IDS + ["mimo-outnorm"])
def test_state_dict_keys_and_shapes_are_the_peers(cfg):
    m = Mamba3(**cfg)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = peer_keys(**{k: v for k, v in cfg.items() if k != "chunk_size"})
    assert got == want
    assert m.dt_bias.dtype == m.B_bias.dtype == m.D.dtype == torch.float32
    # the peer's initialisation: biases and D ones, softplus(dt_bias) in [dt_init_floor, dt_max]
    assert torch.equal(m.B_bias, torch.ones_like(m.B_bias)) and torch.equal(m.D, torch.ones_like(m.D))
    assert (F.softplus(m.dt_bias) <= 0.1 + 1e-6).all() and (F.softplus(m.dt_bias) >= 1e-4 - 1e-6).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_peer_state_dict_loads_and_forward_matches(cfg):
    sd = random_state_dict(peer_keys(**{k: v for k, v in cfg.items() if k != "chunk_size"}))
    m = Mamba3(**cfg, dtype=torch.float32)
    m.load_state_dict(sd, strict=True)
    u = torch.randn(2, 19, cfg["d_model"], dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(u), peer_forward(sd, cfg, u), rtol=2e-4, atol=2e-5)


def _prefill_decode(m, u, prefix):
    params = InferenceParams(max_seqlen=u.shape[1], max_batch_size=u.shape[0])
    outs = [m(u[:, :prefix], inference_params=params)]
    params.seqlen_offset = prefix
    for t in range(prefix, u.shape[1]):
        outs.append(m(u[:, t:t + 1], inference_params=params))
        params.seqlen_offset += 1
    return torch.cat(outs, 1), params.key_value_memory_dict[m.layer_idx]


@pytest.mark.parametrize("cfg", CONFIGS + [dict(d_model=16, d_state=16, headdim=8, is_mimo=True, mimo_rank=2,
                                                is_outproj_norm=True, chunk_size=4)], ids=IDS + ["mimo-outnorm"])
def test_prefill_then_decode_matches_one_forward(cfg):
    torch.manual_seed(0)
    m = Mamba3(**cfg, layer_idx=0, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    u = torch.randn(2, 11, cfg["d_model"], dtype=torch.float32)
    with torch.no_grad():
        full = m(u)
        got, states = _prefill_decode(m, u, 6)
    torch.testing.assert_close(got, full, rtol=2e-4, atol=2e-5)
    # the cache ends where one prefill of the whole sequence ends
    params = InferenceParams(max_seqlen=11, max_batch_size=2)
    with torch.no_grad():
        m(u, inference_params=params)
    for a, b in zip(states, params.key_value_memory_dict[0]):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


def test_step_takes_both_shapes_and_advances_states_in_place():
    m = Mamba3(16, d_state=16, headdim=8, layer_idx=0)
    states = m.allocate_inference_cache(3, 8)
    assert [tuple(s.shape) for s in states] == [(3, 4, 4), (3, 4, 8, 16), (3, 1, 4, 16), (3, 4, 8)]
    assert [s.dtype for s in states] == [torch.float32, torch.float32, torch.float32, torch.float32]
    u = torch.randn(3, 16)
    with torch.no_grad():
        out2, *ret = m.step(u, *states)
        assert out2.shape == (3, 16) and all(r is s for r, s in zip(ret, states))
        assert states[1].abs().sum() > 0 and torch.equal(states[3], m._split(m.in_proj(u))[1].view(3, 4, 8))
        fresh = m.allocate_inference_cache(3, 8)
        out3, *_ = m.step(u[:, None], *fresh)
    torch.testing.assert_close(out3[:, 0], out2)
    with pytest.raises(ValueError, match="'u'"):
        m.step(torch.randn(3, 2, 16), *states)


def test_cu_seqlens_runs_each_sequence_from_zero_state():
    torch.manual_seed(0)
    m = Mamba3(16, d_state=16, headdim=8, layer_idx=0, dtype=torch.float32)
    lengths = [4, 0, 7]
    u = torch.randn(1, sum(lengths), 16, dtype=torch.float32)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    params = InferenceParams(max_seqlen=11, max_batch_size=3)
    with torch.no_grad():
        packed = m(u, cu_seqlens=cu, inference_params=params)
        parts = [m(u[:, 0:4]), m(u[:, 4:11])]
    torch.testing.assert_close(packed, torch.cat(parts, 1), rtol=2e-4, atol=2e-5)
    angle, ssm, k, v = params.key_value_memory_dict[0]
    assert ssm.shape[0] == 3 and torch.equal(ssm[1], torch.zeros_like(ssm[1]))
    with pytest.raises(ValueError, match="batch 1"):
        m(torch.randn(2, 11, 16, dtype=torch.float32), cu_seqlens=cu)


def test_training_gradients_match_the_oracle_composition():
    torch.manual_seed(0)
    m = Mamba3(16, d_state=16, headdim=8, is_mimo=True, mimo_rank=2, chunk_size=4)
    u = torch.randn(2, 9, 16, requires_grad=True)
    m(u).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    # the same layer with the scan replaced by its step-by-step oracle
    import fastarch.nn.mamba3 as mod

    m.zero_grad()
    orig = mod.mamba3_scan
    mod.mamba3_scan = lambda *a, **k: mamba3_scan_ref(*a, **k)
    try:
        m(u.detach()).square().sum().backward()
    finally:
        mod.mamba3_scan = orig
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5, msg=lambda e, n=n: f"{n}: {e}")


def test_constructor_errors_and_absorbed_kwargs():
    Mamba3(16, d_state=16, headdim=8, dropout=0.1, n_layer=4, some_other_kwarg=1)
    with pytest.raises(ValueError, match="rope_fraction"):
        Mamba3(16, d_state=16, headdim=8, rope_fraction=0.25)
    with pytest.raises(ValueError, match="headdim"):
        Mamba3(16, d_state=16, headdim=7)
    with pytest.raises(ValueError, match="'u'"):
        Mamba3(16, d_state=16, headdim=8)(torch.randn(2, 16))


def test_compat_path_is_the_module():
    from fastarch.compat.mamba_ssm.modules.mamba3 import Mamba3 as CompatMamba3

    assert CompatMamba3 is Mamba3


@pytest.mark.parametrize("kw", [dict(), dict(is_mimo=True, mimo_rank=2, is_outproj_norm=True)], ids=["siso", "mimo"])
def test_bf16_layer_forward_backward_and_decode(kw):
    torch.manual_seed(0)
    m = Mamba3(32, d_state=16, headdim=8, layer_idx=0, dtype=torch.bfloat16, **kw)
    u = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)
    y = m(u)
    assert y.dtype == torch.bfloat16 and y.shape == u.shape
    y.float().square().sum().backward()
    assert torch.isfinite(u.grad.float()).all() and m.dt_bias.grad.dtype == torch.float32
    with torch.no_grad():
        got, _ = _prefill_decode(m, u.detach(), 5)
    torch.testing.assert_close(got.float(), y.detach().float(), rtol=0.05, atol=0.05)


def test_compile_fullgraph_forward_backward():
    torch.manual_seed(0)
    m = Mamba3(32, d_state=16, headdim=8)
    u = torch.randn(2, 9, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(u)
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    ref = m(u)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref)
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
