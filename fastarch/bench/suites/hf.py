"""Hugging Face transformers models on fastarch (:mod:`fastarch.integrations.transformers`) against the same models
on transformers' own paths; random weights from configs, nothing downloaded.

Cases and providers:

- ``mistral fwd L``: a Mistral-style model (hidden 256, 4 heads of 64, 2 KV heads, sliding window 256, 2 layers),
  one forward over ``L`` tokens: ``attn_implementation="fastarch"`` against ``"sdpa"`` (the reference);
- ``llama fwd L``: the same model without a window (Llama-style), ``fastarch`` against ``sdpa``;
- ``mamba fwd L``: HF's ``MambaForCausalLM`` (d_model 768, 4 layers), one forward: after
  :func:`~fastarch.integrations.transformers.register` (fastarch's scan and conv kernels) against its own
  PyTorch path (the reference);
- ``mamba generate``: the same model, greedy generation of 64 tokens after a 512-token prompt; a third
  provider, ``fastarch-MambaLM``, is fastarch's own ``MambaLM`` loaded from it (``from_hf``) and its
  ``generate``; a fourth, ``mamba-ssm-compat``, is the same weights in mamba-ssm's format loaded by
  ``fastarch.compat.mamba_ssm``'s ``MambaLMHeadModel.from_pretrained`` and its ``generate`` (mamba-ssm's decode
  loop, greedy);
- ``gpt2 generate``: GPT-2 124M-shaped (``GPT2Config()`` defaults, random weights), greedy generation of 64
  tokens after a 128-token prompt with a KV cache: fastarch's ``GPTModel`` loaded from it (``from_hf``) and
  its ``generate`` against transformers' ``generate`` (``transformers``, the reference);
- ``bert encoder``: a BERT-base-shaped encoder (``BertConfig()`` defaults), batch 8, L 512, an all-ones
  attention mask: fastarch's ``BERT`` loaded from it (``from_hf``) against transformers' ``BertModel`` with
  ``sdpa`` (the reference);
- ``mamba2 fwd L``: HF's ``Mamba2ForCausalLM`` (d_model 768, 4 layers, 24 heads of 64, d_state 128, one group,
  chunk 256), one forward: fastarch's kernels (SSD scan, conv, norms, and the mixers' projections on
  ``fastarch.ops.linear``) against its own PyTorch chunked path. Slow on CPU: only in ``--full`` runs
  (L=1024) and in the case set ``hf-mamba2`` (L=2048, ``fastarch bench --case hf-mamba2``), whose bar is 3x.
  Three more providers time parts of the forward, so that the report explains itself: ``projections``, the
  mixers' ``in_proj`` and ``out_proj`` GEMMs alone as fastarch runs them (``fastarch.ops.linear``; on CPU in
  fp32, oneDNN's GEMM), so ``fastarch`` over it is fastarch's time per GEMM time; ``projections-blas``, the
  same GEMMs as ``nn.Linear`` runs them in transformers' path (PyTorch's BLAS); and ``projections+ssd_scan``,
  fastarch's GEMMs plus its SSD scan of every layer (so ``fastarch`` over it is the cost of the convolution,
  the norms and the model's glue). All three are of kind ``reference``, so none counts as a peer or as
  fastarch's headline.
- ``generate small`` (case set ``hf-generate-small``, ``fastarch bench --case hf-generate-small``): Llama,
  Qwen2, Mistral, Phi-3, GPT-2, Mamba and Mamba-2 with hidden 256 and 4 layers (8 heads with 2 key/value
  heads), batch 1, greedy generation of 32 tokens after a 16-token prompt: ``fastarch`` (``register()`` and
  ``attn_implementation="fastarch"``) against plain transformers (``transformers``: nothing registered,
  ``sdpa``); the bar is 1.3x. Decode steps of this size are dozens of tiny calls, so this is the per-call cost
  benchmark at the model level. ``--dtype bfloat16`` runs it in bf16.
- ``hybrids`` (case set ``hf-hybrids``, ``fastarch bench --case hf-hybrids``): Bamba-, Jamba-, FalconH1-,
  GraniteMoeHybrid-, Zamba2- and NemotronH-style models (hidden 768, 4 layers, each family's own layer pattern:
  Mamba-2 mixers of 24 heads of 64 with d_state 128, attention of 12 heads of 64 with 3 key/value heads, the
  family's experts or MLPs), one forward over 2048 tokens (bar 3x) and greedy generation of 64 tokens after a
  512-token prompt (bar 2x); FalconMamba's generation (bar 2x); and a gpt-oss-style model (attention sinks, a
  128-token window on every other layer, 4 experts) forward over 4096 tokens (bar 3x). ``fastarch``
  (``register()`` and its attention) against plain transformers (``transformers``: nothing registered, ``sdpa``,
  or ``eager`` for gpt-oss, whose sinks sdpa cannot take).

Thread counts are the run's (``--threads``).

Needs transformers (``pip install 'fastarch[hf]'``); without it every provider is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..core import BenchConfig, Case, Provider, Ratio, Skip, Suite
from ..helpers import require_package

VOCAB = 1024


def _hf():
    """(transformers, fastarch.integrations.transformers), or Skip."""
    tf = require_package("transformers")
    try:
        from fastarch.integrations import transformers as fh
    except ImportError as exc:
        raise Skip(str(exc)) from None
    return tf, fh


def _tokens(cfg: BenchConfig, L: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed * 1000003 + L)
    return torch.randint(0, VOCAB, (1, L), generator=g).to(cfg.device)


def _attention_model(cfg: BenchConfig, window: int | None, impl: str):
    tf, fh = _hf()
    fh.register()
    torch.manual_seed(cfg.seed)
    conf = tf.MistralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=window,
                            max_position_embeddings=32768)
    model = tf.MistralForCausalLM(conf).to(device=cfg.device, dtype=cfg.dtype).eval()
    model.set_attn_implementation(impl)
    return model, fh


def _attention_case(cfg: BenchConfig, name: str, window: int | None, L: int) -> Case:
    def provider(impl: str) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            model, fh = _attention_model(cfg, window, impl)
            ids = _tokens(cfg, L)

            def run() -> Any:
                # sdpa is plain transformers: none of register()'s norm, rotary or Mamba patches
                if impl == "fastarch":
                    fh.register()
                else:
                    fh.unregister()
                with torch.no_grad():
                    return model(input_ids=ids, logits_to_keep=1).logits
            return run
        return setup

    return Case(
        name=f"{name} fwd L={L}",
        params={"L": L, "window": window or 0, "model": name},
        flops=None,
        providers=[Provider("fastarch", "fastarch", provider("fastarch")), Provider("sdpa", "torch", provider("sdpa"))],
        reference="sdpa",
        group=f"{name} fwd",
        x="L",
    )


def _mamba_model(cfg: BenchConfig):
    tf, fh = _hf()
    torch.manual_seed(cfg.seed)
    conf = tf.MambaConfig(vocab_size=VOCAB, hidden_size=768, state_size=16, num_hidden_layers=4, conv_kernel=4,
                          expand=2)
    return tf.MambaForCausalLM(conf).to(device=cfg.device, dtype=cfg.dtype).eval(), fh


def _mamba2_model(cfg: BenchConfig):
    tf, fh = _hf()
    torch.manual_seed(cfg.seed)
    conf = tf.Mamba2Config(vocab_size=VOCAB, hidden_size=768, num_heads=24, head_dim=64, state_size=128,
                           num_hidden_layers=4, n_groups=1, conv_kernel=4, expand=2, chunk_size=256)
    return tf.Mamba2ForCausalLM(conf).to(device=cfg.device, dtype=cfg.dtype).eval(), fh


def _mamba_provider(cfg: BenchConfig, fastarch: bool, make_run, build=_mamba_model
                    ) -> Callable[[], Callable[[], Any]]:
    def setup() -> Callable[[], Any]:
        model, fh = build(cfg)
        body = make_run(model)

        def run() -> Any:
            if fastarch:
                fh.register()
            else:
                fh.unregister()
            with torch.no_grad():
                return body()
        return run
    return setup


def _mamba_case(cfg: BenchConfig, group: str, name: str, params: dict, make_run, model: str = "mamba",
                build=_mamba_model, ratios: tuple[Ratio, ...] = (), own: Provider | None = None) -> Case:
    return Case(
        name=name,
        params={**params, "model": model},
        flops=None,
        providers=[Provider("fastarch", "fastarch", _mamba_provider(cfg, True, make_run, build)),
                   Provider("hf-pytorch", "reference", _mamba_provider(cfg, False, make_run, build))]
        + ([own] if own is not None else []),
        reference="hf-pytorch",
        group=group,
        x="L",
        ratios=ratios,
    )


def _mamba_forward_case(cfg: BenchConfig, L: int) -> Case:
    ids = _tokens(cfg, L)
    return _mamba_case(cfg, "mamba fwd", f"mamba fwd L={L}", {"L": L},
                       lambda model: lambda: model(input_ids=ids, logits_to_keep=1).logits)


def _mamba_generate_case(cfg: BenchConfig, prompt: int, new: int) -> Case:
    ids = _tokens(cfg, prompt)

    def make_run(model):
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)

    def own_setup() -> Callable[[], Any]:
        from fastarch.models import from_hf

        model = from_hf(_mamba_model(cfg)[0]).eval()
        return lambda: model.generate(ids, max_new_tokens=new)

    def compat_setup() -> Callable[[], Any]:
        import tempfile

        from fastarch.compat.mamba_ssm import MambaLMHeadModel
        from fastarch.models import from_hf, to_hf

        with tempfile.TemporaryDirectory() as tmp:
            to_hf(from_hf(_mamba_model(cfg)[0]), tmp, format="mamba_ssm")
            model = MambaLMHeadModel.from_pretrained(tmp).to(device=cfg.device, dtype=cfg.dtype).eval()
        return lambda: model.generate(ids, max_length=prompt + new)

    case = _mamba_case(cfg, "mamba generate", f"mamba generate prompt={prompt},new={new}",
                       {"L": prompt, "new_tokens": new}, make_run,
                       own=Provider("fastarch-MambaLM", "fastarch", own_setup))
    case.providers.append(Provider("mamba-ssm-compat", "fastarch", compat_setup))
    return case


def _own_model_case(name: str, params: dict, model: str, provider, reference: Provider) -> Case:
    """A fastarch model loaded with ``from_hf`` (``provider(True)``) against the transformers model it came from."""
    return Case(name=name, params={**params, "model": model}, flops=None,
                providers=[Provider("fastarch", "fastarch", provider(True)), reference],
                reference=reference.name, group=" ".join(name.split()[:2]), x="L")


def _gpt2_case(cfg: BenchConfig, prompt: int, new: int, toy: bool) -> Case:
    def model():
        tf, _ = _hf()
        torch.manual_seed(cfg.seed)
        conf = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB) if toy else tf.GPT2Config()
        return tf.GPT2LMHeadModel(conf).to(device=cfg.device, dtype=cfg.dtype).eval(), conf.vocab_size

    def provider(fastarch: bool) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            hf, vocab = model()
            g = torch.Generator().manual_seed(cfg.seed)
            ids = torch.randint(0, vocab, (1, prompt), generator=g).to(cfg.device)
            if fastarch:
                from fastarch.models import from_hf

                fa = from_hf(hf).eval()
                return lambda: fa.generate(ids, max_new_tokens=new, do_sample=False)

            def run() -> Any:
                with torch.no_grad():
                    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, pad_token_id=0)
            return run
        return setup

    return _own_model_case(f"gpt2 generate prompt={prompt},new={new}", {"L": prompt, "new_tokens": new},
                           "gpt2", provider, Provider("transformers", "reference", provider(False)))


def _bert_case(cfg: BenchConfig, batch: int, L: int, toy: bool) -> Case:
    def provider(fastarch: bool) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            tf, _ = _hf()
            torch.manual_seed(cfg.seed)
            conf = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                 vocab_size=VOCAB) if toy else tf.BertConfig()
            hf = tf.BertModel(conf).to(device=cfg.device, dtype=cfg.dtype).eval()
            hf.set_attn_implementation("sdpa")
            g = torch.Generator().manual_seed(cfg.seed)
            ids = torch.randint(0, conf.vocab_size, (batch, L), generator=g).to(cfg.device)
            mask = torch.ones_like(ids)
            if fastarch:
                from fastarch.models import from_hf

                fa = from_hf(hf).eval()

                def run() -> Any:
                    with torch.no_grad():
                        return fa(ids, attention_mask=mask)
                return run

            def run_hf() -> Any:
                with torch.no_grad():
                    return hf(input_ids=ids, attention_mask=mask).last_hidden_state
            return run_hf
        return setup

    return _own_model_case(f"bert encoder B={batch},L={L}", {"L": L, "batch": batch}, "bert", provider,
                           Provider("sdpa", "torch", provider(False)))


def _mamba2_floor(cfg: BenchConfig, L: int, scan: bool, blas: bool = False) -> Callable[[], Callable[[], Any]]:
    """Parts of the Mamba-2 forward, timed alone: every mixer's ``in_proj`` and ``out_proj`` on random
    ``(1, L, .)`` inputs (the rest of the model's GEMMs, the head on one token, is negligible), on
    ``fastarch.ops.linear`` as fastarch's path runs them, or with ``blas`` as the model's ``nn.Linear`` modules
    (transformers' path); with ``scan``, each layer's SSD scan too (``fastarch.ops.ssd_scan``, on the layer's
    parameters and on the strided views of its convolution output that the mixer passes)."""

    def setup() -> Callable[[], Any]:
        from fastarch.ops import causal_conv1d, linear, ssd_scan

        model, _ = _mamba2_model(cfg)
        mixers = [layer.mixer for layer in model.backbone.layers]
        g = torch.Generator().manual_seed(cfg.seed)
        u = torch.randn(1, L, model.config.hidden_size, generator=g).to(cfg.device, cfg.dtype)
        v = torch.randn(1, L, mixers[0].intermediate_size, generator=g).to(cfg.device, cfg.dtype)
        scans = []
        with torch.no_grad():
            for m in mixers:
                _, xbc, dt = m.in_proj(u).split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
                xbc = causal_conv1d(xbc.transpose(1, 2), m.conv1d.weight.squeeze(1), m.conv1d.bias,
                                    "silu").transpose(1, 2)
                x, B, C = xbc.split([m.intermediate_size, m.n_groups * m.ssm_state_size,
                                     m.n_groups * m.ssm_state_size], dim=-1)
                scans.append(dict(x=x.view(1, L, m.num_heads, m.head_dim), dt=dt, A=-torch.exp(m.A_log.float()),
                                  B=B.view(1, L, m.n_groups, -1), C=C.view(1, L, m.n_groups, -1),
                                  chunk_size=m.chunk_size, D=m.D, dt_bias=m.dt_bias, dt_softplus=True,
                                  dt_limit=m.time_step_limit))

        def project(proj: torch.nn.Linear, t: torch.Tensor) -> torch.Tensor:
            return proj(t) if blas else linear(t, proj.weight, proj.bias)

        def run() -> Any:
            with torch.no_grad():
                for m, kw in zip(mixers, scans):
                    project(m.in_proj, u)
                    if scan:
                        ssd_scan(**kw)
                    out = project(m.out_proj, v)
            return out
        return run
    return setup


def _mamba2_forward_case(cfg: BenchConfig, L: int) -> Case:
    ids = _tokens(cfg, L)
    case = _mamba_case(cfg, "mamba2 fwd", f"mamba2 fwd L={L}", {"L": L},
                       lambda model: lambda: model(input_ids=ids, logits_to_keep=1).logits, model="mamba2",
                       build=_mamba2_model)
    # The parts: "projections vs fastarch" is fastarch's time over its GEMM time, "projections vs
    # projections-blas" what the GEMM backend alone brings, "projections-blas vs hf-pytorch" what kernel work
    # besides the GEMMs could bring at most. Kind "reference": a part is neither a peer to beat nor fastarch's
    # headline.
    floors = [Provider("projections", "reference", _mamba2_floor(cfg, L, scan=False)),
              Provider("projections-blas", "reference", _mamba2_floor(cfg, L, scan=False, blas=True)),
              Provider("projections+ssd_scan", "reference", _mamba2_floor(cfg, L, scan=True))]
    return replace(case, providers=case.providers + floors,
                   ratios=(Ratio("fastarch", "hf-pytorch", target=3.0), Ratio("projections", "fastarch"),
                           Ratio("projections+ssd_scan", "fastarch"), Ratio("projections", "projections-blas"),
                           Ratio("projections-blas", "hf-pytorch")))


# Decode-bound generation: small models (hidden 256, 4 layers, 8 heads with 2 key/value heads), batch 1, a
# 16-token prompt and 32 new tokens, where per-call costs dominate.
_SMALL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0)


def _small_config(tf, family: str):
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=8), tf.GPT2LMHeadModel
    if family == "mamba":
        return tf.MambaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, state_size=16), \
            tf.MambaForCausalLM
    if family == "mamba2":
        return tf.Mamba2Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64,
                               n_groups=1, state_size=16, expand=2, chunk_size=64), tf.Mamba2ForCausalLM
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "phi3": "Phi3"}[family]
    return getattr(tf, f"{name}Config")(**_SMALL), getattr(tf, f"{name}ForCausalLM")


def _small_generate_case(cfg: BenchConfig, family: str, prompt: int, new: int) -> Case:
    def provider(fastarch: bool) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            tf, fh = _hf()
            conf, cls = _small_config(tf, family)
            torch.manual_seed(cfg.seed)
            model = cls(conf).to(device=cfg.device, dtype=cfg.dtype).eval()
            ids = _tokens(cfg, prompt)

            def run() -> Any:
                # transformers alone: none of register()'s patches; fastarch: register() and its attention
                if fastarch:
                    fh.register()
                else:
                    fh.unregister()
                impl = "fastarch" if fastarch else "sdpa"
                # models without attention (Mamba) take no implementation; switching costs, so only on change
                if family not in ("mamba", "mamba2") and model.config._attn_implementation != impl:
                    model.set_attn_implementation(impl)
                with torch.no_grad():
                    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False, pad_token_id=0)
            return run
        return setup

    return Case(name=f"{family} generate small prompt={prompt},new={new}",
                params={"L": prompt, "new_tokens": new, "model": family}, flops=None,
                providers=[Provider("fastarch", "fastarch", provider(True)),
                           Provider("transformers", "reference", provider(False))],
                reference="transformers", group="generate small", x="L",
                ratios=(Ratio("fastarch", "transformers", target=1.3),))


def generate_small_cases(cfg: BenchConfig) -> list[Case]:
    prompt, new = (4, 4) if cfg.toy else (16, 32)
    return [_small_generate_case(cfg, family, prompt, new)
            for family in ("llama", "qwen2", "mistral", "phi3", "gpt2", "mamba", "mamba2")]


# Hybrid families (attention beside Mamba-2 mixers), FalconMamba and gpt-oss: hidden 768, 4 layers, each family's
# own layer pattern; fastarch (register() and its attention) against plain transformers.
def _hybrid_config(tf, family: str, toy: bool):
    """(config, model class) of a ``family``-style model: hidden 768 (64 when ``toy``), 4 layers."""
    d = 64 if toy else 768
    heads, hd = (4, 16) if toy else (12, 64)
    mh, mhd, ns = (4, 32, 16) if toy else (24, 64, 128)  # Mamba-2 heads (d_inner = 2 d), head dim, state
    base = dict(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    attn = dict(num_attention_heads=heads, num_key_value_heads=heads // 4 or 1, intermediate_size=2 * d)
    chunk = 64 if toy else 256
    if family == "bamba":
        return tf.BambaConfig(**base, **attn, attn_layer_indices=[2], mamba_n_heads=mh, mamba_d_head=mhd,
                              mamba_n_groups=1, mamba_d_state=ns, mamba_d_conv=4, mamba_expand=2,
                              mamba_chunk_size=chunk), tf.BambaForCausalLM
    if family == "jamba":  # Mamba-1 mixers, attention at layer 2, experts every other layer
        return tf.JambaConfig(**base, **attn, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16,
                              mamba_d_conv=4, mamba_expand=2), tf.JambaForCausalLM
    if family == "falcon_h1":  # attention and a Mamba-2 mixer side by side in every layer
        return tf.FalconH1Config(**base, **attn, head_dim=hd, mamba_d_ssm=2 * d, mamba_n_heads=mh, mamba_d_head=mhd,
                                 mamba_n_groups=1, mamba_d_state=ns, mamba_d_conv=4, mamba_expand=2,
                                 mamba_chunk_size=chunk), tf.FalconH1ForCausalLM
    if family == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**base, **attn, layer_types=["mamba", "mamba", "attention", "mamba"],
                                         num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=2 * d,
                                         mamba_n_heads=mh, mamba_n_groups=1, mamba_d_state=ns, mamba_d_head=mhd,
                                         mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=chunk), \
            tf.GraniteMoeHybridForCausalLM
    if family == "zamba2":
        return tf.Zamba2Config(**base, **attn, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                               mamba_d_state=ns, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=mh,
                               chunk_size=chunk, num_mem_blocks=1), tf.Zamba2ForCausalLM
    if family == "nemotron_h":
        return tf.NemotronHConfig(**base, **attn, head_dim=hd, layers_block_type=["mamba", "attention", "mamba", "mlp"],
                                  ssm_state_size=ns, mamba_num_heads=mh, mamba_head_dim=mhd, n_groups=1,
                                  conv_kernel=4, expand=2, chunk_size=chunk), tf.NemotronHForCausalLM
    if family == "falcon_mamba":
        return tf.FalconMambaConfig(**base, state_size=16, expand=2, conv_kernel=4), tf.FalconMambaForCausalLM
    if family == "gpt_oss":  # attention sinks, sliding window 128 on every other layer
        return tf.GptOssConfig(**base, **attn, head_dim=hd, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16 if toy else 128,
                               layer_types=["sliding_attention", "full_attention"] * 2), tf.GptOssForCausalLM
    raise ValueError(f"unknown family {family!r}")


def _hybrid_case(cfg: BenchConfig, family: str, mode: str, L: int, new: int, target: float) -> Case:
    """``mode`` 'fwd': one forward over ``L`` tokens; 'generate': greedy generation of ``new`` tokens after an
    ``L``-token prompt. Plain transformers runs its CPU path: sdpa, or eager where sdpa cannot (sinks)."""
    plain_impl = "eager" if family == "gpt_oss" else "sdpa"

    def provider(fastarch: bool) -> Callable[[], Callable[[], Any]]:
        def setup() -> Callable[[], Any]:
            tf, fh = _hf()
            if not hasattr(tf, _hybrid_class_name(family)):
                raise Skip(f"transformers {tf.__version__} has no {_hybrid_class_name(family)}")
            conf, cls = _hybrid_config(tf, family, cfg.toy)
            torch.manual_seed(cfg.seed)
            model = cls(conf).to(device=cfg.device, dtype=cfg.dtype).eval()
            ids = _tokens(cfg, L)
            has_attention = family != "falcon_mamba"

            def run() -> Any:
                if fastarch:
                    fh.register()
                else:
                    fh.unregister()
                impl = "fastarch" if fastarch else plain_impl
                if has_attention and model.config._attn_implementation != impl:
                    model.set_attn_implementation(impl)
                with torch.no_grad():
                    if mode == "fwd":
                        return model(input_ids=ids, logits_to_keep=1).logits
                    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False, pad_token_id=0)
            return run
        return setup

    what = f"fwd L={L}" if mode == "fwd" else f"generate prompt={L},new={new}"
    return Case(name=f"{family} {what}", params={"L": L, "new_tokens": new, "model": family}, flops=None,
                providers=[Provider("fastarch", "fastarch", provider(True)),
                           Provider("transformers", "reference", provider(False))],
                reference="transformers", group=f"hybrid {mode}", x="L",
                ratios=(Ratio("fastarch", "transformers", target=target),))


def _hybrid_class_name(family: str) -> str:
    return {"bamba": "BambaForCausalLM", "jamba": "JambaForCausalLM", "falcon_h1": "FalconH1ForCausalLM",
            "granitemoehybrid": "GraniteMoeHybridForCausalLM", "zamba2": "Zamba2ForCausalLM",
            "nemotron_h": "NemotronHForCausalLM", "falcon_mamba": "FalconMambaForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}[family]


HYBRIDS = ("bamba", "jamba", "falcon_h1", "granitemoehybrid", "zamba2", "nemotron_h")


def hybrid_cases(cfg: BenchConfig) -> list[Case]:
    """Forward at L=2048 (bar 3x) and greedy generation of 64 tokens after 512 (bar 2x) for each hybrid family;
    FalconMamba's generation (bar 2x); gpt-oss-style forward at L=4096 (bar 3x)."""
    L, prompt, new, L_oss = (64, 16, 4, 64) if cfg.toy else (2048, 512, 64, 4096)
    out = [_hybrid_case(cfg, f, "fwd", L, 0, 3.0) for f in HYBRIDS]
    out += [_hybrid_case(cfg, f, "generate", prompt, new, 2.0) for f in HYBRIDS]
    out.append(_hybrid_case(cfg, "falcon_mamba", "generate", prompt, new, 2.0))
    out.append(_hybrid_case(cfg, "gpt_oss", "fwd", L_oss, 0, 3.0))
    return out


def mamba2_cases(cfg: BenchConfig) -> list[Case]:
    return [_mamba2_forward_case(cfg, 64 if cfg.toy else 2048)]


def cases(cfg: BenchConfig) -> list[Case]:
    if cfg.toy:
        return [_attention_case(cfg, "mistral", 16, 64), _mamba_forward_case(cfg, 32),
                _gpt2_case(cfg, 8, 4, toy=True), _bert_case(cfg, 2, 16, toy=True)]
    out = [_attention_case(cfg, "mistral", 256, 4096), _attention_case(cfg, "llama", None, 2048),
           _mamba_forward_case(cfg, 1024), _mamba_generate_case(cfg, 512, 64), _gpt2_case(cfg, 128, 64, toy=False),
           _bert_case(cfg, 8, 512, toy=False)]
    if not cfg.quick:
        out.insert(1, _attention_case(cfg, "mistral", 256, 16384))
        out.append(_mamba2_forward_case(cfg, 1024))
    return out


SUITE = Suite(
    name="hf",
    description="Hugging Face models with fastarch registered (attn_implementation='fastarch', Mamba and Mamba-2 "
                "kernels) vs sdpa and HF's PyTorch Mamba paths",
    cases=cases,
    case_sets={"hf-mamba2": mamba2_cases, "hf-generate-small": generate_small_cases, "hf-hybrids": hybrid_cases},
)
