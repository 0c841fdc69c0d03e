"""fastarch.compat.mamba_ssm's program namespace: mamba-ssm's layer-norm test grid (``layer_norm_fn`` /
``rms_norm_fn`` against ``layer_norm_ref`` / ``rms_norm_ref``), its generation semantics against a step-by-step
reference, a mamba-ssm-format checkpoint written here and loaded with ``from_pretrained``, state dicts with each
mamba-ssm class's keys, tensor-parallel layers at world size 1, and the ImportError for names not provided."""

import dataclasses
import inspect
import itertools
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastarch import ops
from fastarch.compat import mamba_ssm
from fastarch.compat._missing import NotProvidedError
from fastarch.compat.mamba_ssm.distributed import distributed_utils as du
from fastarch.compat.mamba_ssm.distributed import tensor_parallel as tp
from fastarch.compat.mamba_ssm.models.config_mamba import MambaConfig
from fastarch.compat.mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel, create_block
from fastarch.compat.mamba_ssm.modules.block import Block
from fastarch.compat.mamba_ssm.modules.mamba2 import Mamba2
from fastarch.compat.mamba_ssm.modules.mamba2_simple import Mamba2Simple
from fastarch.compat.mamba_ssm.modules.mamba_simple import Mamba
from fastarch.compat.mamba_ssm.modules.mha import MHA
from fastarch.compat.mamba_ssm.modules.mlp import GatedMLP
from fastarch.compat.mamba_ssm.ops.triton import layer_norm as ln
from fastarch.compat.mamba_ssm.utils import generation as gen
from fastarch.compat.mamba_ssm.utils.hf import load_config_hf, load_state_dict_hf

E = inspect.Parameter.empty


# -- ops.triton.layer_norm: mamba-ssm's grid (small sizes) ----------------------------------------------------
LN_GRID = list(itertools.product(
    [False, True],  # is_rms_norm
    [False, True],  # has_residual
    [False, True],  # prenorm
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    [64, 97],  # hidden_size
))


@pytest.mark.parametrize("is_rms_norm,has_residual,prenorm,dtypes,hidden", LN_GRID)
def test_layer_norm_fn_against_ref(is_rms_norm, has_residual, prenorm, dtypes, hidden):
    input_dtype, residual_dtype = dtypes
    torch.manual_seed(hidden)
    residual_in_fp32 = not has_residual and residual_dtype == torch.float32
    atol = 1e-4 if input_dtype == torch.float32 else 2e-2
    x0 = torch.randn(3, 5, hidden, dtype=input_dtype, requires_grad=True)
    res0 = torch.randn(3, 5, hidden, dtype=residual_dtype, requires_grad=True) if has_residual else None
    w0 = (torch.randn(hidden) * 0.3 + 1).requires_grad_()
    b0 = None if is_rms_norm else (torch.randn(hidden) * 0.1).requires_grad_()
    fn, ref = (ln.rms_norm_fn, ln.rms_norm_ref) if is_rms_norm else (ln.layer_norm_fn, ln.layer_norm_ref)
    args = {} if is_rms_norm else {"is_rms_norm": False}
    out = fn(x0, w0, b0, residual=res0, eps=1e-6, prenorm=prenorm, residual_in_fp32=residual_in_fp32, **args)
    leaves = [t for t in (x0, res0, w0, b0) if t is not None]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    xr, rest = ref_leaves[0], ref_leaves[1:]
    rr = rest.pop(0) if has_residual else None
    wr = rest.pop(0)
    br = rest.pop(0) if rest else None
    out_ref = ref(xr, wr, br, residual=rr, eps=1e-6, prenorm=prenorm, upcast=True)
    y, resid = out if prenorm else (out, None)
    y_ref, resid_ref = out_ref if prenorm else (out_ref, None)
    assert y.dtype == input_dtype and y.shape == x0.shape
    torch.testing.assert_close(y.float(), y_ref.float(), atol=atol, rtol=atol)
    if prenorm:
        want = residual_dtype if (has_residual or residual_in_fp32) else input_dtype
        assert resid.dtype == want
        torch.testing.assert_close(resid.float(), resid_ref.float(), atol=atol, rtol=atol)
    g = torch.randn_like(y)
    loss = (y.float() * g.float()).sum() + ((resid.float() * 0.5).sum() if prenorm else 0)
    loss_ref = (y_ref.float() * g.float()).sum() + ((resid_ref.float() * 0.5).sum() if prenorm else 0)
    grads = torch.autograd.grad(loss, leaves)
    grads_ref = torch.autograd.grad(loss_ref, ref_leaves)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=atol * 4, rtol=atol * 4)


@pytest.mark.parametrize("has_x1,has_weight1,has_rowscale", [(False, False, True), (True, True, False),
                                                              (True, False, False), (False, True, True)])
def test_layer_norm_fn_dropout_x1_weight1_rowscale(has_x1, has_weight1, has_rowscale):
    torch.manual_seed(1)
    h, p = 48, 0.27
    x = torch.randn(4, h)
    res = torch.randn(4, h)
    x1 = torch.randn(4, h) if has_x1 else None
    w, b = torch.randn(h), torch.randn(h)
    w1, b1 = (torch.randn(h), torch.randn(h)) if has_weight1 else (None, None)
    rowscale = torch.rand(4) + 0.5 if has_rowscale else None
    out = ln.layer_norm_fn(x, w, b, residual=res, x1=x1, weight1=w1, bias1=b1, eps=1e-5, dropout_p=p,
                           rowscale=rowscale, prenorm=True, return_dropout_mask=True)
    *ys, resid, mask, mask1 = out
    assert len(ys) == (2 if has_weight1 else 1)
    assert mask.dtype == torch.bool and mask.shape == x.shape and (mask1 is not None) == has_x1
    assert 0.5 < mask.float().mean() < 0.95
    ref = ln.layer_norm_ref(x, w, b, residual=res, x1=x1, weight1=w1, bias1=b1, eps=1e-5, dropout_p=p,
                            rowscale=rowscale, prenorm=True, dropout_mask=mask, dropout_mask1=mask1)
    for a, r in zip([*ys, resid], ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # without dropout, residual or scaling, the residual stream is x itself
    y, same = ln.layer_norm_fn(x, w, b, prenorm=True)
    assert same is x


def test_layer_norm_signatures_modules_and_errors():
    names = ["x", "weight", "bias", "residual", "x1", "weight1", "bias1", "eps", "dropout_p", "rowscale", "prenorm",
             "residual_in_fp32", "is_rms_norm", "return_dropout_mask"]
    assert [p.name for p in inspect.signature(ln.layer_norm_fn).parameters.values()] == names
    assert [p.name for p in inspect.signature(ln.rms_norm_fn).parameters.values()] == \
        [n for n in names if n != "is_rms_norm"]
    norm = ln.RMSNorm(16, eps=1e-5)
    assert list(norm.state_dict()) == ["weight"] and norm.bias is None
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    y, resid = norm(x, residual=r, prenorm=True, residual_in_fp32=True)
    torch.testing.assert_close(y, ops.rms_norm_ref(x + r, norm.weight.detach(), 1e-5))
    lnorm = ln.LayerNorm(16)
    torch.testing.assert_close(lnorm(x), F.layer_norm(x, (16,), lnorm.weight, lnorm.bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'residual'"):
        ln.layer_norm_fn(x, norm.weight, None, residual=torch.randn(2, 16))
    with pytest.raises(ValueError, match="'weight'"):
        ln.layer_norm_fn(x, torch.ones(15), None)


# -- utils.generation: mamba-ssm's decode against a step-by-step reference ---------------------------------
def _tiny_config(**kw):
    base = dict(d_model=32, n_layer=2, vocab_size=61, ssm_cfg={"d_state": 8}, pad_vocab_size_multiple=8)
    base.update(kw)
    return MambaConfig(**base)


def _reference_filter(logits, top_k, top_p, min_p, temperature):
    """mamba-ssm's sampling, step by step on the full-sequence logits (plain torch)."""
    if top_k > 0:
        top, idx = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
        top = top / temperature
        if 0.0 < top_p < 1.0:
            srt, order = torch.sort(top, descending=False)
            drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
            top = top.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        pick = torch.multinomial(top.softmax(-1), 1).squeeze(-1)
        return idx[torch.arange(idx.shape[0]), pick]
    lg = logits / temperature
    if 0.0 < top_p < 1.0:
        srt, order = torch.sort(lg, descending=False)
        drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
        lg = lg.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if 0.0 < min_p < 1.0:
        probs = lg.softmax(-1)
        lg = lg.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return torch.multinomial(lg.softmax(-1), 1).squeeze(-1)


@torch.no_grad()
def _reference_decode(model, ids, max_length, top_k=1, top_p=0.0, min_p=0.0, temperature=1.0,
                      repetition_penalty=1.0, eos_token_id=None, vocab_size=None):
    seq, scores = ids, []
    while True:
        logits = model(seq).logits[:, -1]
        logits = logits[..., :vocab_size] if vocab_size is not None else logits
        scores.append(logits)
        lg = logits.clone()
        if repetition_penalty != 1.0:
            s = lg.gather(1, seq)
            lg.scatter_(1, seq, torch.where(s < 0, s * repetition_penalty, s / repetition_penalty))
        tok = lg.argmax(-1) if top_k == 1 else _reference_filter(lg, top_k, top_p, min_p, temperature)
        seq = torch.cat([seq, tok[:, None]], dim=1)
        if (eos_token_id is not None and bool((tok == eos_token_id).all())) or seq.shape[1] >= max_length:
            return seq, scores


GEN_CASES = [dict(), dict(top_k=5, temperature=0.7), dict(top_k=0, top_p=0.8), dict(top_k=4, top_p=0.6),
             dict(top_k=0, min_p=0.2, temperature=1.3), dict(repetition_penalty=1.5), dict(vocab_size=61)]


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
@pytest.mark.parametrize("case", range(len(GEN_CASES)))
def test_generate_matches_step_by_step_reference(layer, case):
    kw = GEN_CASES[case]
    ssm = {"d_state": 8} if layer == "Mamba1" else {"layer": "Mamba2", "d_state": 8, "headdim": 16, "chunk_size": 4}
    torch.manual_seed(0)
    model = MambaLMHeadModel(_tiny_config(ssm_cfg=ssm)).eval()
    ids = torch.randint(0, 61, (2, 6))
    torch.manual_seed(123)
    out = model.generate(ids, max_length=13, return_dict_in_generate=True, output_scores=True, **kw)
    torch.manual_seed(123)
    seq_ref, scores_ref = _reference_decode(model, ids, 13, **kw)
    assert out.sequences.shape == (2, 13)
    assert torch.equal(out.sequences, seq_ref)
    assert isinstance(out, gen.GreedySearchDecoderOnlyOutput if kw.get("top_k", 1) == 1
                      else gen.SampleDecoderOnlyOutput)
    assert len(out.scores) == 7
    torch.testing.assert_close(torch.stack(out.scores, 1), torch.stack(scores_ref, 1), atol=1e-4, rtol=1e-4)


def test_generate_options():
    torch.manual_seed(0)
    model = MambaLMHeadModel(_tiny_config()).eval()
    ids = torch.randint(0, 61, (1, 4))
    greedy = model.generate(ids, max_length=10)
    assert isinstance(greedy, torch.Tensor) and greedy.shape == (1, 10)
    assert model.generate(ids, max_length=10, return_dict_in_generate=True).scores is None
    eos = int(greedy[0, 6])  # the first new token equal to it stops the loop
    first = int((greedy[0, 4:] == eos).nonzero()[0]) + 4
    stopped = model.generate(ids, max_length=10, eos_token_id=eos)
    assert torch.equal(stopped, greedy[:, :first + 1])
    teacher = torch.randint(0, 61, (1, 8))
    forced = model.generate(ids, max_length=10, teacher_outputs=teacher)
    assert torch.equal(forced[:, 4:8], teacher[:, 4:8])

    class Streamer:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, t):
            self.chunks.append(t)

        def end(self):
            self.ended = True

    s = Streamer()
    out = model.generate(ids, max_length=10, streamer=s)
    assert s.ended and torch.equal(torch.cat([c.reshape(1, -1) for c in s.chunks], 1), out)
    with pytest.warns(UserWarning, match="cg=True"):
        gen._CG_WARNED = False
        assert torch.equal(model.generate(ids, max_length=10, cg=True), greedy)
    with pytest.raises(ValueError, match="max_length"):
        model.generate(ids, max_length=4)
    assert [p.name for p in inspect.signature(gen.decode).parameters.values()][:10] == [
        "input_ids", "model", "max_length", "top_k", "top_p", "min_p", "temperature", "repetition_penalty",
        "eos_token_id", "teacher_outputs"]


def test_logit_filters_in_place():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    a = logits.clone()
    gen.modify_logits_for_top_k_filtering(a, 2)
    assert torch.isinf(a).tolist() == [[True, False, False, True, True]]
    b = logits.clone()
    gen.modify_logits_for_top_p_filtering(b, 0.5)
    assert torch.isfinite(b).tolist() == [[False, True, False, False, False]]
    c = logits.clone()
    gen.modify_logits_for_top_p_filtering(c, 1.0)
    assert torch.equal(c, logits)
    d = logits.clone()
    gen.modify_logits_for_min_p_filtering(d, 0.3)  # p >= 0.3 p_max  <=>  logit >= 3 + log(0.3)
    assert torch.isfinite(d).tolist() == [[False, True, True, False, False]]
    assert gen.sample(logits, top_k=1).tolist() == [1]


# -- models: a mamba-ssm-format checkpoint written here ---------------------------------------------------
def _write_checkpoint(path, config: dict, state_dict: dict) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    torch.save(state_dict, os.path.join(path, "pytorch_model.bin"))


def _mamba1_checkpoint_keys(n_layer):
    keys = ["backbone.embedding.weight", "backbone.norm_f.weight", "lm_head.weight"]
    for i in range(n_layer):
        keys += [f"backbone.layers.{i}.norm.weight"] + [f"backbone.layers.{i}.mixer.{k}" for k in (
            "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
            "dt_proj.bias", "out_proj.weight")]
    return keys


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_loads_and_generates_like_reference(tmp_path, tied):
    config = {"d_model": 32, "n_layer": 2, "vocab_size": 50, "ssm_cfg": {"d_state": 8}, "rms_norm": True,
              "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
              "tie_embeddings": tied}
    torch.manual_seed(3)
    shapes = {"embedding.weight": (56, 32), "norm_f.weight": (32,), "norm.weight": (32,), "A_log": (64, 8),
              "D": (64,), "in_proj.weight": (128, 32), "conv1d.weight": (64, 1, 4), "conv1d.bias": (64,),
              "x_proj.weight": (18, 64), "dt_proj.weight": (64, 2), "dt_proj.bias": (64,),
              "out_proj.weight": (32, 64), "lm_head.weight": (56, 32)}
    sd = {}
    for k in _mamba1_checkpoint_keys(2):
        leaf = next(s for s in shapes if k.endswith(s))
        sd[k] = torch.randn(shapes[leaf]) * (0.3 if "weight" in k else 0.1)
    if tied:
        del sd["lm_head.weight"]  # as in mamba-ssm checkpoints saved tied: the head is the embedding
    _write_checkpoint(tmp_path / "ckpt", config, sd)
    model = MambaLMHeadModel.from_pretrained(str(tmp_path / "ckpt")).eval()
    assert model.config == MambaConfig(**config)
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v)
    if tied:
        assert model.lm_head.weight is model.backbone.embedding.weight
    ids = torch.randint(0, 50, (2, 5))
    out = model.generate(ids, max_length=11, return_dict_in_generate=True, output_scores=True)
    seq_ref, scores_ref = _reference_decode(model, ids, 11)
    assert torch.equal(out.sequences, seq_ref)
    torch.testing.assert_close(torch.stack(out.scores, 1), torch.stack(scores_ref, 1), atol=1e-4, rtol=1e-4)
    # save_pretrained round trip
    model.save_pretrained(tmp_path / "again")
    back = MambaLMHeadModel.from_pretrained(tmp_path / "again").eval()
    assert torch.equal(back.generate(ids, max_length=11), out.sequences)
    assert load_config_hf(tmp_path / "again") == dataclasses.asdict(model.config)
    assert set(load_state_dict_hf(tmp_path / "again", dtype=torch.float64)) == set(model.state_dict())


def test_checkpoint_errors_never_load_half(tmp_path):
    torch.manual_seed(0)
    model = MambaLMHeadModel(_tiny_config())
    model.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    sd = torch.load(tmp_path / "ok" / "pytorch_model.bin", weights_only=True)
    _write_checkpoint(tmp_path / "unknown", {**cfg, "hidden_act": "gelu"}, sd)
    with pytest.raises(ValueError, match="hidden_act"):
        MambaLMHeadModel.from_pretrained(tmp_path / "unknown")
    _write_checkpoint(tmp_path / "missing", cfg, {k: v for k, v in sd.items() if "layers.1.mixer.D" not in k})
    with pytest.raises(ValueError, match="layers.1.mixer.D"):
        MambaLMHeadModel.from_pretrained(tmp_path / "missing")
    _write_checkpoint(tmp_path / "extra", cfg, {**sd, "backbone.layers.9.norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match="layers.9"):
        MambaLMHeadModel.from_pretrained(tmp_path / "extra")
    _write_checkpoint(tmp_path / "shape", {**cfg, "ssm_cfg": {"d_state": 4}}, sd)
    with pytest.raises(ValueError, match="wrong shape"):
        MambaLMHeadModel.from_pretrained(tmp_path / "shape")
    _write_checkpoint(tmp_path / "badcfg", {**cfg, "ssm_cfg": {"d_state": 8, "bogus": 1}}, sd)
    with pytest.raises(TypeError, match="bogus"):
        MambaLMHeadModel.from_pretrained(tmp_path / "badcfg")
    with pytest.raises(FileNotFoundError, match="no hub downloads"):
        MambaLMHeadModel.from_pretrained("state-spaces/mamba-130m-definitely-not-local")


def test_hybrid_model_keys_and_cache_allocation():
    cfg = _tiny_config(d_model=64, ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 16, "chunk_size": 4},
                       d_intermediate=40, attn_layer_idx=[1], n_layer=3,
                       attn_cfg={"num_heads": 4, "num_heads_kv": 2, "causal": True, "rotary_emb_dim": 8, "d_conv": 3,
                                 "mlp_dim": 20}, fused_add_norm=False, rms_norm=False, residual_in_fp32=False,
                       tie_embeddings=False)
    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg).eval()
    keys = set(model.state_dict())
    assert {"backbone.layers.1.mixer.in_proj.weight", "backbone.layers.1.mixer.conv1d.weight",
            "backbone.layers.1.mixer.out_proj.bias", "backbone.layers.0.mlp.fc1.weight",
            "backbone.layers.0.norm2.bias", "backbone.layers.2.mixer.dt_bias", "lm_head.weight"} <= keys
    assert model.backbone.layers[0].mlp.fc1.weight.shape == (256, 64)  # 40 rounded up to 128, times 2
    cache = model.allocate_inference_cache(2, 20)
    assert set(cache) == {0, 1, 2} and cache[1][0].shape == (2, 20, 2, 2, 16)
    ids = torch.randint(0, 61, (2, 6))
    out = model.generate(ids, max_length=12, return_dict_in_generate=True, output_scores=True)
    seq_ref, scores_ref = _reference_decode(model, ids, 12)
    assert torch.equal(out.sequences, seq_ref)
    torch.testing.assert_close(torch.stack(out.scores, 1), torch.stack(scores_ref, 1), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="Mamba3"):
        create_block(32, 0, ssm_cfg={"layer": "Mamba3"}, layer_idx=0)


# -- modules: state dicts with mamba-ssm's keys load and compute mamba-ssm's math ---------------------------
def _load_random(module, keys, scale=0.3):
    sd = {k: torch.randn_like(v) * scale for k, v in module.state_dict().items()}
    assert sorted(sd) == sorted(keys)
    if "A_log" in sd:
        sd["A_log"] = torch.rand_like(sd["A_log"]).add(0.5).log()
    if "D" in sd:
        sd["D"] = sd["D"].abs()
    module.load_state_dict(sd)
    return module.eval()


def test_mamba_simple_keys_and_math():
    torch.manual_seed(0)
    m = _load_random(Mamba(32, d_state=8, layer_idx=0), [
        "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight",
        "dt_proj.bias", "out_proj.weight"])
    from fastarch.compat.mamba_ssm.ops.selective_scan_interface import mamba_inner_ref

    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        y = m(x)
        ref = mamba_inner_ref(m.in_proj(x).transpose(1, 2), m.conv1d.weight, m.conv1d.bias, m.x_proj.weight,
                              m.dt_proj.weight, m.out_proj.weight, m.out_proj.bias, -torch.exp(m.A_log.float()),
                              D=m.D.float(), delta_bias=m.dt_proj.bias.float(), delta_softplus=True)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        ip = gen.InferenceParams(max_seqlen=12, max_batch_size=2)
        first = m(x[:, :6], inference_params=ip)
        ip.seqlen_offset = 6
        steps = []
        for t in range(6, 9):
            steps.append(m(x[:, t:t + 1], inference_params=ip))
            ip.seqlen_offset += 1
        torch.testing.assert_close(torch.cat([first, *steps], 1), y, atol=1e-4, rtol=1e-4)
    assert [(p.name, p.default) for p in inspect.signature(Mamba).parameters.values()][:6] == [
        ("d_model", E), ("d_state", 16), ("d_conv", 4), ("expand", 2), ("dt_rank", "auto"), ("dt_min", 0.001)]


def test_mamba2_and_mamba2_simple_keys_and_math():
    torch.manual_seed(0)
    m2 = _load_random(Mamba2(32, d_state=8, headdim=16, ngroups=2, chunk_size=4, layer_idx=0), [
        "dt_bias", "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "norm.weight", "out_proj.weight"])
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        ref = ops.mamba_split_conv1d_scan_ref(
            m2.in_proj(x), m2.conv1d.weight.squeeze(1), m2.conv1d.bias, m2.dt_bias, -torch.exp(m2.A_log), m2.D, 4,
            rmsnorm_weight=m2.norm.weight, rmsnorm_eps=m2.norm.eps, outproj_weight=m2.out_proj.weight,
            outproj_bias=None, headdim=16, ngroups=2, norm_before_gate=False)
        torch.testing.assert_close(m2(x), ref, atol=1e-4, rtol=1e-4)
    # the fused path's norm is grouped, the unfused path's (self.norm) is not, as in mamba-ssm: equal at ngroups=1
    for mem_eff, ngroups in ((True, 2), (True, 1), (False, 1)):
        torch.manual_seed(1)
        ms = _load_random(Mamba2Simple(32, d_state=8, headdim=16, ngroups=ngroups, chunk_size=4, use_mem_eff_path=mem_eff,
                                       learnable_init_states=True), [
            "dt_bias", "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "init_states", "norm.weight",
            "out_proj.weight"])
        with torch.no_grad():
            ref = ops.mamba_split_conv1d_scan_ref(
                ms.in_proj(x), ms.conv1d.weight.squeeze(1), ms.conv1d.bias, ms.dt_bias, -torch.exp(ms.A_log), ms.D, 4,
                initial_states=ms.init_states.expand(2, -1, -1, -1), rmsnorm_weight=ms.norm.weight,
                rmsnorm_eps=ms.norm.eps, outproj_weight=ms.out_proj.weight, outproj_bias=None, headdim=16, ngroups=ngroups,
                norm_before_gate=False)
            torch.testing.assert_close(ms(x), ref, atol=1e-4, rtol=1e-4)


def _rope_ref(t, offset, dim, base=10000.0):
    cos, sin = ops.rotary_cos_sin(offset + t.shape[1], dim, base)
    return ops.rotary_embedding_ref(t, cos, sin, seqlen_offset=offset)


@pytest.mark.parametrize("causal,d_conv,rotary,mlp_dim", [(True, 0, 0, 0), (True, 3, 8, 20), (False, 0, 4, 0)])
def test_mha_keys_math_and_cache(causal, d_conv, rotary, mlp_dim):
    torch.manual_seed(0)
    keys = ["in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"]
    keys += ["conv1d.weight", "conv1d.bias"] if d_conv else []
    m = _load_random(MHA(32, 4, num_heads_kv=2, causal=causal, layer_idx=3, d_conv=d_conv, rotary_emb_dim=rotary,
                         mlp_dim=mlp_dim), keys)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        qkv = m.in_proj(x)
        if m.mlp_dim:
            qkv, xm = qkv.split([qkv.shape[-1] - m.mlp_dim, m.mlp_dim], -1)
            up, gate = xm.chunk(2, -1)
            xm = up * F.silu(gate)
        if d_conv:
            qkv = F.conv1d(qkv.transpose(1, 2), m.conv1d.weight, m.conv1d.bias, padding=d_conv - 1,
                           groups=qkv.shape[-1])[..., :7].transpose(1, 2)
        q, k, v = qkv.split([32, 16, 16], -1)
        q, k, v = q.reshape(2, 7, 4, 8), k.reshape(2, 7, 2, 8), v.reshape(2, 7, 2, 8)
        if rotary:
            q, k = _rope_ref(q, 0, rotary), _rope_ref(k, 0, rotary)
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                             v.repeat_interleave(2, 2).transpose(1, 2), is_causal=causal)
        ctx = ctx.transpose(1, 2).reshape(2, 7, 32)
        ref = m.out_proj(torch.cat([ctx, xm], -1) if m.mlp_dim else ctx)
        torch.testing.assert_close(m(x), ref, atol=1e-4, rtol=1e-4)
        if causal:  # prefill then one token at a time equals the full forward
            ip = gen.InferenceParams(max_seqlen=10, max_batch_size=2)
            outs = [m(x[:, :4], inference_params=ip)]
            for t in range(4, 7):
                ip.seqlen_offset = t
                outs.append(m(x[:, t:t + 1], inference_params=ip))
            torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-4, rtol=1e-4)
            assert ip.key_value_memory_dict[3][0].shape == (2, 10, 2, 2, 8)


def test_gated_mlp_and_block_semantics():
    torch.manual_seed(0)
    mlp = _load_random(GatedMLP(16, hidden_features=20, multiple_of=8), ["fc1.weight", "fc2.weight"])
    x = torch.randn(3, 16)
    h, g = F.linear(x, mlp.fc1.weight).chunk(2, -1)
    torch.testing.assert_close(mlp(x), F.linear(h * F.silu(g), mlp.fc2.weight))
    assert mlp.fc1.weight.shape == (48, 16)
    outs = {}
    for fused in (False, True):
        torch.manual_seed(5)
        blk = create_block(32, 24, ssm_cfg={"d_state": 8}, rms_norm=True, residual_in_fp32=True,
                           fused_add_norm=fused, layer_idx=0).eval()
        assert isinstance(blk, Block) and blk.layer_idx == 0
        torch.manual_seed(6)
        hs, res = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
        with torch.no_grad():
            out, resid = blk(hs, res)
            s = hs + res
            mixed = blk.mixer(ops.rms_norm_ref(s, blk.norm.weight, blk.norm.eps))
            s2 = mixed + s
            ref = blk.mlp(ops.rms_norm_ref(s2, blk.norm2.weight, blk.norm2.eps))
        assert resid.dtype == torch.float32
        torch.testing.assert_close(resid, s2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        outs[fused] = out
    torch.testing.assert_close(outs[False], outs[True], atol=1e-5, rtol=1e-5)


# -- distributed: one process (no group, and a gloo group of size 1) -----------------------------------------
def _check_tensor_parallel(group):
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear(8, 12, group, bias=True)
    row = tp.RowParallelLinear(12, 8, group, bias=True, sequence_parallel=False)
    x = torch.randn(4, 8, requires_grad=True)
    y = row(col(x))
    torch.testing.assert_close(y, F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias))
    y.sum().backward()
    assert x.grad is not None and col.weight.grad is not None
    emb = tp.ParallelEmbeddings(8, 10, 6, group)
    ids = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(emb(ids), emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:5])
    assert set(emb.state_dict()) == {"word_embeddings.weight", "position_embeddings.weight"}
    t = torch.randn(4, 3)
    assert torch.equal(du.all_gather(t, group), t) and torch.equal(du.reduce_scatter(t, group), t)
    assert torch.equal(du.all_reduce(t.clone(), group), t)
    assert du.get_dim_for_local_rank(10, 3, 0) == 4 and du.get_dim_for_local_rank(10, 3, 2) == 3
    assert du.get_dim_for_local_rank(12, 2, 1, multiple_of=4) == 4


def test_tensor_parallel_single_process(tmp_path):
    assert not dist.is_initialized()
    _check_tensor_parallel(None)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        _check_tensor_parallel(group)
        m = Mamba2(32, d_state=8, headdim=16, chunk_size=4, process_group=group)
        assert m.process_group is group and m(torch.randn(1, 3, 32)).shape == (1, 3, 32)
    finally:
        dist.destroy_process_group()


# -- the namespace --------------------------------------------------------------------------------------------
def test_root_names_and_not_provided():
    assert mamba_ssm.Mamba is Mamba and mamba_ssm.Mamba2 is Mamba2 and mamba_ssm.MambaLMHeadModel is MambaLMHeadModel
    assert mamba_ssm.selective_scan_fn is ops.selective_scan_fn
    with pytest.raises(NotProvidedError, match=r"mamba_ssm\.modules\.mha\.FlashSelfAttention.*mamba_ssm\.modules\.mha\.MHA"):
        from fastarch.compat.mamba_ssm.modules.mha import FlashSelfAttention  # noqa: F401
    with pytest.raises(ImportError, match="mamba_ssm.utils.generation.update_graph_cache"):
        gen.update_graph_cache  # noqa: B018
    assert [f.name for f in dataclasses.fields(MambaConfig)] == [
        "d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg", "rms_norm",
        "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"]
    assert math.isclose(MambaConfig().d_model, 2560) and MambaConfig().tie_embeddings


# -- fastarch.models.from_hf / to_hf: mamba-ssm's format both ways ----------------------------------------------
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
@pytest.mark.parametrize("tie", [True, False])
def test_from_hf_to_hf_mamba_ssm_format(tmp_path, layer, tie):
    from fastarch.models import from_hf, to_hf
    from fastarch.nn import Mamba2LM, MambaLM

    ssm = {"d_state": 8} if layer == "Mamba1" else {"layer": "Mamba2", "d_state": 8, "headdim": 16, "chunk_size": 4}
    torch.manual_seed(0)
    ref = MambaLMHeadModel(_tiny_config(ssm_cfg=ssm, tie_embeddings=tie)).eval()
    ref.save_pretrained(tmp_path / "ssm")
    ours = from_hf(tmp_path / "ssm")
    assert isinstance(ours, MambaLM if layer == "Mamba1" else Mamba2LM)
    assert (ours.lm_head.weight is ours.embedding.weight) == tie
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(ours(ids), want, atol=1e-5, rtol=1e-5)
    to_hf(ours, tmp_path / "back", format="mamba_ssm")
    again = MambaLMHeadModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(again.generate(ids, max_length=14), ref.generate(ids, max_length=14))


def test_from_hf_mamba_ssm_refusals(tmp_path):
    from fastarch.models import from_hf, to_hf
    from fastarch.nn import MambaLM

    torch.manual_seed(0)
    MambaLMHeadModel(_tiny_config(d_intermediate=32)).save_pretrained(tmp_path / "mlp")
    with pytest.raises(ValueError, match="d_intermediate=32"):
        from_hf(tmp_path / "mlp")
    model = MambaLMHeadModel(_tiny_config())
    model.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    sd = torch.load(tmp_path / "ok" / "pytorch_model.bin", weights_only=True)
    _write_checkpoint(tmp_path / "odd", {**cfg, "ssm_cfg": {"d_state": 8, "bogus": 3}}, sd)
    with pytest.raises(TypeError, match="bogus"):
        from_hf(tmp_path / "odd")
    _write_checkpoint(tmp_path / "extra", cfg, {**sd, "backbone.layers.0.mixer.extra": torch.ones(2)})
    with pytest.raises(KeyError, match="mixer.extra"):
        from_hf(tmp_path / "extra")
    with pytest.raises(ValueError, match="eps"):
        to_hf(MambaLM(61, 32, 1, norm_eps=1e-6), tmp_path / "eps", format="mamba_ssm")
    with pytest.raises(ValueError, match="format"):
        to_hf(MambaLM(61, 32, 1), tmp_path / "x", format="onnx")


def test_mamba3_at_the_root_when_fastarch_has_it():
    from fastarch import nn as fnn

    if hasattr(fnn, "Mamba3"):
        assert mamba_ssm.Mamba3 is fnn.Mamba3
    else:
        with pytest.raises(NotProvidedError, match="Mamba3"):
            mamba_ssm.Mamba3  # noqa: B018


@pytest.fixture
def installed():
    import importlib.util
    import sys

    from fastarch import compat

    if importlib.util.find_spec("mamba_ssm") is not None and not compat.installed():
        pytest.skip("the real mamba_ssm is installed here")
    compat.install()
    yield
    compat.uninstall()
    for n in [n for n in sys.modules if n.partition(".")[0] == "mamba_ssm"]:
        del sys.modules[n]


def test_mamba_ssm_2x_import_paths_after_install(installed):
    """The imports mamba-ssm 2.x's own modules and user code make, through ``import mamba_ssm``."""
    from mamba_ssm import Mamba as M1
    from mamba_ssm import Mamba2 as M2
    from mamba_ssm import MambaLMHeadModel as LM
    from mamba_ssm.distributed.distributed_utils import all_reduce, reduce_scatter  # noqa: F401
    from mamba_ssm.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: F401
    from mamba_ssm.models.config_mamba import MambaConfig as Cfg
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from mamba_ssm.modules.block import Block as B
    from mamba_ssm.modules.mamba2_simple import Mamba2Simple  # noqa: F401
    from mamba_ssm.modules.mha import MHA as A
    from mamba_ssm.modules.mlp import GatedMLP as G
    from mamba_ssm.ops.triton.layer_norm import RMSNorm, layer_norm_fn, rms_norm_fn  # noqa: F401
    from mamba_ssm.utils.generation import GenerationMixin, InferenceParams  # noqa: F401
    from mamba_ssm.utils.hf import load_config_hf, load_state_dict_hf  # noqa: F401

    assert M1 is Mamba and M2 is Mamba2 and LM is MambaLMHeadModel is MambaLMHeadModel and Cfg is MambaConfig
    assert B is Block and A is MHA and G is GatedMLP
    with pytest.raises(ImportError):  # mamba-ssm 1.x's module name: code probing for it falls back
        from mamba_ssm.ops.triton.layernorm import RMSNorm as _old  # noqa: F401
    torch.manual_seed(0)
    model = MambaLMHeadModel(Cfg(d_model=32, n_layer=1, vocab_size=40, ssm_cfg={"d_state": 8}))
    assert model.generate(torch.zeros(1, 3, dtype=torch.long), max_length=6).shape == (1, 6)


# -- Mamba2 sharded over two gloo processes equals the unsharded layer ---------------------------------------
def _shard_mamba2(full: dict, rank: int, world: int, H: int, P: int, G: int, N: int) -> dict:
    """Rank ``rank``'s part of an unsharded Mamba2's state dict: its heads of z, x, dt, D, A_log, dt_bias, the
    norm and out_proj's columns, its groups of B and C (in_proj rows and conv channels)."""
    d = H * P
    heads, groups = slice(rank * H // world, (rank + 1) * H // world), slice(rank * G // world, (rank + 1) * G // world)
    chans = slice(heads.start * P, heads.stop * P)

    def xbc(t, with_z_dt=False):
        parts = torch.split(t, [d, d, G * N, G * N, H] if with_z_dt else [d, G * N, G * N])
        if with_z_dt:
            z, x, b, c, dt = parts
        else:
            x, b, c = parts
        rest = t.shape[1:]
        mid = [x[chans], b.view(G, N, *rest)[groups].reshape(-1, *rest), c.view(G, N, *rest)[groups].reshape(-1, *rest)]
        return torch.cat([z[chans], *mid, dt[heads]] if with_z_dt else mid)

    return {"in_proj.weight": xbc(full["in_proj.weight"], True), "conv1d.weight": xbc(full["conv1d.weight"]),
            "conv1d.bias": xbc(full["conv1d.bias"]), "dt_bias": full["dt_bias"][heads], "A_log": full["A_log"][heads],
            "D": full["D"][heads], "norm.weight": full["norm.weight"][chans],
            "out_proj.weight": full["out_proj.weight"][:, chans]}


def _tp_worker(rank: int, world: int, store_path: str, queue) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ref = Mamba2(16, d_state=8, headdim=8, ngroups=2, chunk_size=4).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(2, 6, 16)
        errors = {}
        for sp in (False, True):
            m = Mamba2(16, d_state=8, headdim=8, ngroups=2, chunk_size=4, process_group=dist.group.WORLD,
                       sequence_parallel=sp).eval()
            m.load_state_dict(_shard_mamba2(ref.state_dict(), rank, world, H=4, P=8, G=2, N=8))
            with torch.no_grad():
                want = ref(x)
                if sp:  # each rank holds its rows of (batch * seqlen) and gets them back
                    rows = slice(rank * 6, (rank + 1) * 6)
                    errors[sp] = (m(x.reshape(12, 16)[rows], seqlen=6) - want.reshape(12, 16)[rows]).abs().max().item()
                else:
                    errors[sp] = (m(x) - want).abs().max().item()
        queue.put((rank, errors))
    finally:
        dist.destroy_process_group()


def test_mamba2_tensor_parallel_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, 2, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(results) == [0, 1]
    for errors in results.values():
        assert errors[False] < 1e-5 and errors[True] < 1e-5, errors


def test_package_imports_a_submodule_not_yet_loaded(monkeypatch):
    """``from mamba_ssm.utils import hf`` imports the submodule when the package does not hold it yet (a module
    __getattr__ that raised for it would break that import)."""
    import sys

    from fastarch.compat.mamba_ssm import utils

    monkeypatch.delitem(sys.modules, "fastarch.compat.mamba_ssm.utils.hf")
    monkeypatch.delattr(utils, "hf")
    from fastarch.compat.mamba_ssm.utils import hf as fresh

    assert fresh.__name__ == "fastarch.compat.mamba_ssm.utils.hf" and callable(fresh.load_config_hf)
    with pytest.raises(NotProvidedError, match=r"mamba_ssm\.utils\.nope"):
        from fastarch.compat.mamba_ssm.utils import nope  # noqa: F401
