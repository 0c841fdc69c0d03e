"""fastarch as a backend of Hugging Face transformers (5.x): attention through ``attn_implementation`` and the
Mamba mixers' kernel functions.

::

    from fastarch.integrations import transformers as fa_hf
    fa_hf.register()                                   # name="fastarch"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fastarch")
    model.set_attn_implementation("fastarch")          # or switch a loaded model
    fa_hf.unregister()                                 # undoes everything register() did

**Attention.** :func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`attention_mask` to its ``AttentionMaskInterface`` under one name. transformers' mask builders
(``create_causal_mask``, ``create_sliding_window_causal_mask``, ``create_bidirectional_mask``, ...) then call
:func:`attention_mask`, which recognises their patterns and returns a :class:`CompactMask` (the window and
a ``(B, Lk)`` key padding mask, or no padding mask at all when no key is padded), so no ``L x L`` mask is
built. Patterns it does not recognise (``or_mask_function``/``and_mask_function`` overlays, packed
sequences, block-wise image tokens, a bidirectional mask over misaligned cache offsets) get transformers'
own dense boolean mask, exactly as ``sdpa`` would, and :func:`attention_forward` applies it as an additive
bias. A 4-D mask a model or user passes in (boolean, True = attend, or additive float) is used as given.

HF's ``sliding_window=w`` is ``window=(w - 1, 0)`` for causal models (a token sees itself and the ``w - 1``
before it: ``q - w < k <= q``) and ``window=(w, w)`` for bidirectional sliding masks (``|q - k| <= w``).

**Patches.** Everything else :func:`register` changes is one entry of :data:`PATCHES` (a :class:`Patch`: a
modeling module, a class or the module itself, an attribute, the function that makes the replacement from
the original, and what then runs on fastarch); :func:`unregister` undoes them all. Patches apply to the
modeling modules already imported and, through an import hook, to those imported later.

**Kernel functions.** transformers' state-space, convolution and delta-rule layers call module-level kernel
functions that ``use_kernel_func_from_hub_with_fallback(kernel_name, package)`` resolved when the modeling
module was imported: a hub kernel when ``kernels`` is enabled, else the original package (``mamba_ssm``,
``causal_conv1d``, ``fla``) when it imports (from 5.25, only for inputs on the devices the package runs on),
else transformers' PyTorch function. Their global names are the same in every family (:data:`KERNEL_GLOBALS`);
:func:`register` replaces each one transformers made (:func:`~.kernels.is_kernel_function`: a wrapper with
``__wrapped__``, or the ``kernels`` package's layer around it) in every modeling module (Mamba, Mamba-2,
Jamba, Bamba, FalconMamba, Zamba, NemotronH, LFM2, Qwen3-Next, Kimi-Linear, ...) with a dispatcher onto
:mod:`fastarch.compat` (the packages' signatures on fastarch's ops). Where the real package is installed,
tensors on an accelerator still go to it; CPU tensors, and every call where the package is absent, go to
fastarch.

**Mamba's decode step, the mixers' projections, the norms.** ``MambaMixer``'s single-token decode step on
CPU in fp32 runs as one :func:`fastarch.nn.mamba.mixer_step`; ``Mamba2Mixer``'s forward and
``MambaMixer``'s other CPU calls run inside a :class:`torch.overrides.TorchFunctionMode` that sends
``torch.nn.functional.linear`` on fp32 CPU tensors to :func:`fastarch.ops.linear` (oneDNN's GEMM);
``MambaRMSNorm``, ``Mamba2RMSNorm`` and the gated ``MambaRMSNormGated`` run :func:`fastarch.ops.rms_norm`
and :func:`fastarch.ops.rms_norm_gated` (CPU; fp32, bf16 and fp16).

**Llama-family norms, rotary embedding and MLPs.** With ``llama=True``, for the modules of
:data:`LLAMA_MODULES` (whose norm, ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's): the norm on
:func:`fastarch.ops.rms_norm`, ``apply_rotary_pos_emb`` on :func:`fastarch.ops.rotary_embedding` (CPU; fp32,
bf16, fp16; constant ``(1 or B, L, D)`` cos/sin whose halves repeat), and the MLPs of :data:`LLAMA_MLPS`
with the SiLU and the product in place when autograd is off.

**Llama-family decode steps.** With ``llama=True`` and fastarch's attention, the decoder layers of
:data:`DECODER_LAYERS` (Llama, Mistral, Qwen2, Qwen3, Phi-3) run a single-token CPU fp32 step without autograd
as two fused calls, :func:`fastarch.ops.decoder_qkv_step` and :func:`fastarch.ops.decoder_out_step`, around the
``DynamicCache``'s own ``update`` (conditions: :mod:`.decoder`).

:func:`report` lists, for a model, what runs on fastarch and why anything does not.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "fastarch.integrations.transformers needs Hugging Face transformers >=5.21,<6: "
        "pip install 'fastarch[hf]' (or pip install 'transformers>=5.21,<6')"
    ) from exc

#: The transformers releases this integration is tested on (the ``hf`` extra's range).
SUPPORTED_TRANSFORMERS = ((5, 21), (6, 0))
_tf_version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
if not SUPPORTED_TRANSFORMERS[0] <= _tf_version < SUPPORTED_TRANSFORMERS[1]:
    raise ImportError(
        f"fastarch.integrations.transformers supports transformers >=5.21,<6, found {transformers.__version__}: "
        "pip install 'fastarch[hf]' (or pip install 'transformers>=5.21,<6')"
    )

from . import attention, decoder, kernels, llama, mamba, norms, patches, registry  # noqa: E402
from .attention import CompactMask, attention_forward, attention_mask, hf_window  # noqa: E402
from .decoder import DECODER_LAYERS  # noqa: E402
from .kernels import KERNEL_EXCEPTIONS, KERNEL_GLOBALS  # noqa: E402
from .llama import LLAMA_MLPS, LLAMA_MODULES  # noqa: E402
from .norms import NORM_MODULES  # noqa: E402
from .patches import PATCHES, Patch  # noqa: E402
from .registry import register, registered, report, unregister  # noqa: E402

__all__ = [
    "CompactMask",
    "DECODER_LAYERS",
    "KERNEL_EXCEPTIONS",
    "KERNEL_GLOBALS",
    "LLAMA_MLPS",
    "LLAMA_MODULES",
    "NORM_MODULES",
    "PATCHES",
    "Patch",
    "SUPPORTED_TRANSFORMERS",
    "attention",
    "attention_forward",
    "attention_mask",
    "decoder",
    "hf_window",
    "kernels",
    "llama",
    "mamba",
    "norms",
    "patches",
    "register",
    "registered",
    "registry",
    "report",
    "unregister",
]
