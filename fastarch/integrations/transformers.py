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

**Kernel functions.** transformers' state-space and convolution layers call module-level kernel functions
that ``use_kernel_func_from_hub_with_fallback(kernel_name, package)`` resolved when the modeling module was
imported: a hub kernel when ``kernels`` is enabled, else the original package (``mamba_ssm``,
``causal_conv1d``) when it imports, else transformers' PyTorch function. Their global names are the same in
every family (:data:`KERNEL_GLOBALS`); :func:`register` replaces each one transformers made (it has
``__wrapped__``) in every modeling module (Mamba, Mamba-2, Jamba, Bamba, FalconMamba, Zamba, NemotronH,
LFM2, ...) with a dispatcher onto :mod:`fastarch.compat` (the packages' signatures on fastarch's ops). Where
the real package is installed, tensors on an accelerator still go to it; CPU tensors, and every call where
the package is absent, go to fastarch. The gated delta rule and KDA (fla) are not provided yet:
:func:`report` says so.

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

:func:`report` lists, for a model, what runs on fastarch and why anything does not.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

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

from transformers import activations as _activations  # noqa: E402
from transformers import masking_utils  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402
from transformers.utils.import_utils import is_torchdynamo_exporting  # noqa: E402

from ..compat.causal_conv1d import causal_conv1d_fn, causal_conv1d_update  # noqa: E402
from ..compat.mamba_ssm.ops.selective_scan_interface import mamba_inner_fn, selective_scan_fn  # noqa: E402
from ..compat.mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa: E402
from ..compat.mamba_ssm.ops.triton.ssd_combined import (  # noqa: E402
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
)
from ..nn.mamba import mixer_step as _mixer_step  # noqa: E402
from ..ops import attention as _attention  # noqa: E402
from ..ops.linear import linear as _linear  # noqa: E402
from ..ops.rms_norm import rms_norm as _rms_norm  # noqa: E402
from ..ops.rms_norm_gated import rms_norm_gated as _rms_norm_gated  # noqa: E402
from ..ops.rotary import rotary_embedding as _rotary_embedding  # noqa: E402

__all__ = [
    "CompactMask",
    "LLAMA_MLPS",
    "LLAMA_MODULES",
    "KERNEL_EXCEPTIONS",
    "KERNEL_GLOBALS",
    "NORM_MODULES",
    "PATCHES",
    "Patch",
    "attention_forward",
    "attention_mask",
    "hf_window",
    "register",
    "registered",
    "report",
    "unregister",
]

# (modeling module, norm class) whose forward register() runs on fastarch's norm ops.
NORM_MODULES: tuple[tuple[str, str], ...] = (("transformers.models.mamba2.modeling_mamba2", "MambaRMSNormGated"),
                                            ("transformers.models.mamba2.modeling_mamba2", "Mamba2RMSNorm"))

# transformers' kernel name -> fastarch's function with the original package's signature.
_KERNELS: dict[str, Callable] = {
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
    "selective_scan_fn": selective_scan_fn,
    "selective_state_update": selective_state_update,
    "mamba_inner_fn": mamba_inner_fn,
    "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
    "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
}

_OP_PARAMS = frozenset(inspect.signature(_attention).parameters)


# -- the mask ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class CompactMask:
    """What :func:`attention_mask` hands to :func:`attention_forward` instead of an ``L x L`` mask.

    ``window``: ``(left, right)`` as in :func:`fastarch.ops.attention` (bottom-right aligned, -1 unlimited);
    ``key_padding_mask``: ``(B, key_length)`` bool, True = a real token, or None when no key is padded;
    ``key_length``: how many keys the queries can see; keys past it (the unused tail of a static cache) are
    dropped before the op runs.
    """

    window: tuple[int, int]
    key_padding_mask: torch.Tensor | None
    key_length: int

    # transformers' generation code builds the masks of compileable caches before the forward and calls
    # these on them; the model's mask builder then takes a mask with ndim 4 as already prepared and passes it
    # back to attention_mask(), which returns it unchanged.
    ndim = 4

    def contiguous(self) -> CompactMask:
        return self

    def to(self, *args, **kwargs) -> CompactMask:
        kpm = self.key_padding_mask
        if kpm is None:
            return self
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), kpm.device))
        return CompactMask(self.window, kpm.to(device=device), self.key_length)


def hf_window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` convention as fastarch's inclusive ``window=(left, right)``."""
    if sliding_window is None:
        return (-1, 0) if causal else (-1, -1)
    if causal:
        return (sliding_window - 1, 0)
    return (sliding_window, sliding_window)


# Query positions the mask functions are probed at: dense rows of keys ``0 .. 2q + 1`` for the short ones,
# a binary search of the first visible key for the long one (windows longer than the dense probes).
_DENSE_PROBES = (0, 1, 5, 97, 1030)
_LONG_PROBE = (1 << 24) + 3


def _row(mask_function: Callable, b: int, q: int, kv: torch.Tensor) -> torch.Tensor:
    out = mask_function(torch.tensor(b), torch.tensor(0), torch.tensor(q), kv)
    return torch.as_tensor(out, dtype=torch.bool).expand(kv.shape)


def _long_window(mask_function: Callable, b: int) -> tuple[int, int] | None:
    """The window ``(left, right)`` seen from query ``q = _LONG_PROBE`` (-1: unlimited, up to ``q`` keys
    either side), or None when the visible keys near it are not one interval around it. A k-ary search
    brackets the first and the last visible key together, 64 keys a side per call of the mask function."""
    q = _LONG_PROBE
    # first visible key in (lo_out, lo_in], last in [hi_in, hi_out): *_out not visible, *_in visible
    lo_out, lo_in, hi_in, hi_out = -1, q, q, 2 * q + 1
    while lo_in - lo_out > 1 or hi_out - hi_in > 1:
        left = torch.linspace(lo_out + 1, lo_in, min(64, lo_in - lo_out), dtype=torch.float64).round().long().unique()
        right = torch.linspace(hi_in, hi_out - 1, min(64, hi_out - hi_in), dtype=torch.float64).round().long().unique()
        kv = torch.cat([left, right, torch.tensor([q])])
        seen = _row(mask_function, b, q, kv)
        if not bool(seen[-1]):
            return None
        seen_left, seen_right = seen[: left.numel()], seen[left.numel(): -1]
        first = int(seen_left.nonzero()[0]) if bool(seen_left.any()) else None
        if first is None or not bool(seen_left[first:].all()):
            return None
        lo_in = int(left[first])
        lo_out = int(left[first - 1]) if first > 0 else lo_out
        if not bool(seen_right[0]):
            return None
        gone = (~seen_right).nonzero()
        stop = int(gone[0]) if gone.numel() else seen_right.numel()
        if bool(seen_right[stop:].any()):
            return None
        hi_in = int(right[stop - 1])
        hi_out = int(right[stop]) if stop < right.numel() else hi_out
    return (-1 if lo_in == 0 else q - lo_in), (-1 if hi_in == 2 * q else hi_in - q)


def _band(q: torch.Tensor, kv: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """The visible keys of the band ``window`` for queries ``q`` (Q, 1) over keys ``kv`` (1, K)."""
    left, right = window
    want = kv <= q + right if right >= 0 else torch.ones_like(kv, dtype=torch.bool).expand(q.shape[0], -1)
    return want & (kv >= q - left) if left >= 0 else want & (kv >= 0)


def _matches(mask_function: Callable, b: int, window: tuple[int, int]) -> bool:
    """Does ``mask_function`` give the band ``window`` on every short probe row (keys ``0 .. 2q + 1``, one
    broadcast call) and at the band's edges seen from the long probe (one call)?"""
    qs = torch.tensor(_DENSE_PROBES)[:, None]
    kv = torch.arange(2 * _DENSE_PROBES[-1] + 2)[None, :]
    got = torch.as_tensor(mask_function(torch.tensor(b), torch.tensor(0), qs, kv), dtype=torch.bool)
    row = kv <= 2 * qs + 1
    if not torch.equal(got.expand(qs.shape[0], kv.shape[1]) & row, _band(qs, kv, window) & row):
        return False
    q, (left, right) = _LONG_PROBE, window
    edges = [q, 0 if left < 0 else q - left, 2 * q if right < 0 else q + right]
    outside = ([q - left - 1] if left >= 0 else []) + ([q + right + 1] if right >= 0 else [])
    row = _row(mask_function, b, q, torch.tensor(edges + outside))
    return bool(row[: len(edges)].all()) and not bool(row[len(edges):].any())


# Windows recognised so far, most recent first: a new mask function (transformers builds one per forward) is
# first checked against them, two calls each, before the k-ary search.
_KNOWN_WINDOWS: list[tuple[int, int]] = []


def _pattern(mask_function: Callable, batch_size: int = 1) -> tuple[tuple[int, int], bool] | None:
    """``(window, causal)`` when ``mask_function`` is a banded pattern (each query sees the keys
    ``q - left .. q + right``, the same for every query and batch row), found by evaluating it on probe
    positions, else None (the caller then builds transformers' dense mask). Nothing about the function but
    its values is read, so any release's causal, sliding-window and bidirectional builders are recognised,
    and anything else (chunked, block-wise, token-type overlays) is not."""
    if mask_function is masking_utils.causal_mask_function:
        return hf_window(None, True), True
    if mask_function is masking_utils.bidirectional_mask_function:
        return hf_window(None, False), False
    try:
        window = next((w for w in _KNOWN_WINDOWS if _matches(mask_function, 0, w)), None)
        if window is None:
            window = _long_window(mask_function, 0)
            if window is None or not _matches(mask_function, 0, window):
                return None
            _KNOWN_WINDOWS.insert(0, window)
            del _KNOWN_WINDOWS[8:]
        if batch_size > 1 and not _matches(mask_function, batch_size - 1, window):
            return None
    except Exception:  # noqa: BLE001 - a mask function that cannot be probed gets the dense mask
        return None
    return window, window[1] == 0


def _offset(x) -> int | None:
    # Static cache layers give tensor offsets (so that a compiled decode step does not specialise on them):
    # those calls get the dense mask, whose shape does not change from step to step.
    return None if isinstance(x, torch.Tensor) else int(x)


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> CompactMask | torch.Tensor:
    """transformers' mask-interface function for fastarch: a :class:`CompactMask` for the causal, sliding-window
    and bidirectional patterns, else transformers' dense ``(B, 1, q_length, kv_length)`` boolean mask.

    ``attention_mask`` is the 2-D padding mask ``(B, >= kv_offset + kv_length)`` (True/1 = real token) or
    None; query ``i`` sits at position ``q_offset + i`` and key ``j`` at ``kv_offset + j``.
    """
    if isinstance(attention_mask, CompactMask):  # prepared before the forward (generation, static caches)
        return attention_mask
    found = _pattern(mask_function, batch_size)
    q0, k0 = _offset(q_offset), _offset(kv_offset)
    compact = found is not None and q0 is not None and k0 is not None and not is_torchdynamo_exporting()
    if compact:
        window, causal = found
        # Queries see no key past the last query's position; the op aligns the last query with the last key.
        key_length = q0 + q_length - k0 if window != (-1, -1) else kv_length
        compact = 0 < key_length <= kv_length and (causal or key_length == kv_length)
    if not compact:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        return masking_utils.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                       attention_mask, **kwargs)
    padding = None
    if attention_mask is not None:
        padding = masking_utils.prepare_padding_mask(attention_mask.bool(), kv_length, k0)
        padding = padding[:, k0:k0 + key_length].expand(batch_size, key_length)
        padding = None if bool(padding.all()) else padding.contiguous()
    return CompactMask(window=window, key_padding_mask=padding, key_length=key_length)


# -- the attention function ----------------------------------------------------------------------------------
def _dense_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 4-D boolean (True = attend) or additive mask as an additive bias."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: CompactMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function on :func:`fastarch.ops.attention`.

    ``query`` ``(B, H, Lq, D)``, ``key``/``value`` ``(B, Hk, Lk, D)`` with ``Hk`` dividing ``H`` (GQA runs on
    the ``Hk`` heads, no repeated copies) -> ``((B, Lq, H, D), None)``. ``attention_mask``: a
    :class:`CompactMask`, a 4-D mask broadcastable to ``(B, H, Lq, Lk)`` (boolean, True = attend, or additive),
    a 2-D key padding mask, or None (then ``is_causal``, else ``module.is_causal``, and ``sliding_window`` set
    the window). ``position_bias`` is added to the scores; ``dropout`` is the probability dropout;
    ``scaling`` defaults to ``D ** -0.5``; ``s_aux`` (gpt-oss's attention sinks, one logit per query head)
    joins every row's softmax denominator.
    """
    if kwargs.get("cache") is not None:
        raise NotImplementedError("fastarch attention: paged caches (continuous batching) are not supported; "
                                  "use attn_implementation='sdpa' for continuous batching")
    extra = {}
    if softcap is not None:
        if "softcap" not in _OP_PARAMS:
            raise NotImplementedError(
                f"fastarch attention: argument 'softcap' ({softcap}) is not supported by this fastarch's "
                "ops.attention; use attn_implementation='eager' for this model")
        extra["softcap"] = softcap
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"fastarch attention: query/key/value must be (B, heads, L, D), got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")

    bias = position_bias
    kpm = None
    if isinstance(attention_mask, CompactMask):
        window = attention_mask.window
        kpm = attention_mask.key_padding_mask
        n = attention_mask.key_length
        if key.shape[2] < n:
            raise ValueError(f"fastarch attention: the mask covers {n} keys but key has {key.shape[2]}")
        if key.shape[2] > n:
            key, value = key[:, :, :n], value[:, :, :n]
            if bias is not None and bias.shape[-1] > n:
                bias = bias[..., :n]
    elif attention_mask is None or attention_mask.dim() == 2:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = hf_window(sliding_window, bool(causal))
        if attention_mask is not None:
            kpm = attention_mask.bool()
            kpm = None if bool(kpm.all()) else kpm
    elif attention_mask.dim() == 4:
        window = (-1, -1)
        mask_bias = _dense_bias(attention_mask[..., : key.shape[2]], query.dtype)
        bias = mask_bias if bias is None else bias + mask_bias
    else:
        raise ValueError(f"fastarch attention: argument 'attention_mask' must be a CompactMask, a 2-D key "
                         f"padding mask or a 4-D mask, got shape {tuple(attention_mask.shape)}")

    sinks = kwargs.get("s_aux")
    if sinks is not None:  # gpt-oss: one logit per query head in every row's softmax denominator
        extra["sinks"] = sinks.reshape(-1)
    out = _attention(query, key, value, window=window, key_padding_mask=kpm, attn_bias=bias,
                     dropout_p=float(dropout), scale=scaling, **extra)
    return out.transpose(1, 2).contiguous(), None


# -- Mamba kernel functions -------------------------------------------------------------------------------
# transformers' modeling modules bind each kernel function, made by
# ``use_kernel_func_from_hub_with_fallback(kernel, package)``, to a module global whose name is the same in
# every family: global name -> (kernel name, package). Only globals that transformers made that way (a
# ``functools.wraps`` wrapper with ``__wrapped__``) are replaced.
KERNEL_GLOBALS: dict[str, tuple[str, str]] = {
    "causal_conv1d_fn": ("causal_conv1d_fn", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d_update", "causal_conv1d"),
    "mamba_inner_fn": ("mamba_inner_fn", "mamba_ssm"),
    "mamba_selective_scan": ("selective_scan_fn", "mamba_ssm"),
    "mamba_selective_state_update": ("selective_state_update", "mamba_ssm"),
    "mamba2_chunk_scan": ("mamba_chunk_scan_combined", "mamba_ssm"),
    "mamba2_selective_state_update": ("selective_state_update", "mamba_ssm"),
    "mamba2_split_conv1d_scan_combined": ("mamba_split_conv1d_scan_combined", "mamba_ssm"),
}


# (modeling module, global) kernel functions left to transformers, and why (report() gives the reason).
KERNEL_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("transformers.models.falcon_mamba.modeling_falcon_mamba", "mamba_inner_fn"):
        "FalconMamba's PyTorch path normalises dt over dt_rank before dt_proj, mamba-ssm's fused mamba_inner_fn "
        "(and fastarch's) over d_inner after it; training keeps transformers' unfused path, whose scan and "
        "convolution run on fastarch",
}


def _real_package(package: str) -> bool:
    """Is the original package (not fastarch's alias of it, :func:`fastarch.compat.install`) importable?
    transformers resolved its kernel functions to it then."""
    import sys

    loaded = sys.modules.get(package)
    if loaded is not None:
        return not getattr(loaded, "__name__", package).startswith("fastarch.") and not getattr(
            loaded, "__fastarch_alias__", False)
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _dispatcher(original: Callable, name: str, real_package: bool) -> Callable:
    """``original`` (transformers' kernel function ``name``) with CPU calls, and every call when the real
    package is absent, on fastarch's function of the package's signature, given the keywords it takes (as
    transformers' wrapper calls the real package: the PyTorch path's own switches are dropped)."""
    target = _KERNELS[name]
    params = frozenset(inspect.signature(target).parameters)

    @functools.wraps(original)
    def run(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if is_torchdynamo_exporting() or (real_package and first.device.type != "cpu"):
            return original(*args, **kwargs)
        return target(*args, **{k: v for k, v in kwargs.items() if k in params})

    run.__fastarch_original__ = original
    return run


# -- Mamba-2's norms -----------------------------------------------------------------------------------------
def _gated_norm(module: torch.nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``MambaRMSNormGated``: ``weight * norm(x * silu(gate))``, one RMS per group of ``group_size`` channels."""
    return _rms_norm_gated(hidden_states, module.weight, z=gate, eps=module.variance_epsilon,
                           group_size=getattr(module, "group_size", hidden_states.shape[-1]),
                           norm_before_gate=False)


def _norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Mamba2RMSNorm``: ``weight * norm(x)`` over the last dimension."""
    return _rms_norm(hidden_states, module.weight, module.variance_epsilon)


_NORMS: dict[str, Callable[..., torch.Tensor]] = {"MambaRMSNormGated": _gated_norm, "Mamba2RMSNorm": _norm}


def _norm_forward(original: Callable, fast: Callable[..., torch.Tensor]) -> Callable:
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        gate = args[0] if args else kwargs.get("gate")
        # Mixed dtypes (an fp32 residual stream into a bf16 norm) stay on transformers' forward: fastarch's
        # norm ops take one dtype.
        if (is_torchdynamo_exporting() or hidden_states.dtype != self.weight.dtype
                or (gate is not None and gate.dtype != hidden_states.dtype)):
            return original(self, hidden_states, *args, **kwargs)
        out = fast(self, hidden_states, *args, **kwargs)
        # transformers' forwards return weight * x.to(input dtype), in the promoted dtype
        return out.to(torch.promote_types(self.weight.dtype, hidden_states.dtype))

    forward.__fastarch_original__ = original
    return forward


# -- the mixers' projections ----------------------------------------------------------------------------------
_F_LINEAR = torch.nn.functional.linear


def _linear_arguments(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``torch.nn.functional.linear``'s arguments, however they were passed."""
    return input, weight, bias


class _LinearOnFastarch(TorchFunctionMode):
    """While active: ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) on fp32 CPU tensors runs
    :func:`fastarch.ops.linear`, whose selector takes the C++ kernel for a decode step's few rows and oneDNN's
    GEMM beyond; every other call runs as it would. A mode is scoped to the thread and the ``with`` block,
    so nothing of the model or of torch is modified."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_LINEAR:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.device.type == "cpu"
                    and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)):
                return _linear(x, weight, bias)
        return func(*args, **kwargs)


def _projections_on_fastarch(original: Callable) -> Callable:
    """A mixer ``forward`` whose ``nn.Linear`` projections (in_proj, out_proj, ...) run on
    :func:`fastarch.ops.linear` when the input is on the CPU (see :class:`_LinearOnFastarch`); on other devices
    and under export it is transformers' forward untouched."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.device.type != "cpu" or is_torchdynamo_exporting() or torch.compiler.is_compiling():
            return original(self, hidden_states, *args, **kwargs)
        with _LinearOnFastarch():
            return original(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


# -- Mamba's decode step and norm ------------------------------------------------------------------------------
def _argument_reader(original: Callable, *names: str) -> Callable[[tuple, dict], tuple]:
    """A reader of ``original``'s arguments ``names`` (each a tuple of accepted spellings, the first the one
    the signature has, later ones deprecated aliases) from a call's ``(args, kwargs)`` that exclude ``self``
    and the first tensor argument: transformers renames keywords between releases (``cache_params`` became
    ``cache``), so positions and spellings are read off the signature once, not assumed."""
    params = list(inspect.signature(original).parameters)[2:]
    slots = []
    for spellings in names:
        found = next((n for n in spellings if n in params), spellings[0])
        slots.append((params.index(found) if found in params else None, (found, *spellings)))

    def read(args: tuple, kwargs: dict) -> tuple:
        values = []
        for index, spellings in slots:
            if index is not None and index < len(args):
                values.append(args[index])
            else:
                values.append(next((kwargs[n] for n in spellings if n in kwargs), None))
        return tuple(values)

    return read


def _mamba_mixer_forward(original: Callable) -> Callable:
    """``MambaMixer.forward`` whose single-token decode step on CPU in fp32 (a cache holding both states, no
    padding mask) runs as one :func:`fastarch.nn.mamba.mixer_step` on the module's own weights; every other call
    (prefill, autograd, accelerators, other dtypes, offloaded weights, export) runs transformers' forward, with
    its projections on :func:`fastarch.ops.linear` for CPU input (:func:`_projections_on_fastarch`). The cache
    argument is found by the signature (``cache`` from transformers 5.24, ``cache_params`` before)."""
    rest = _projections_on_fastarch(original)
    read = _argument_reader(original, ("cache", "cache_params"), ("attention_mask",))

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        cache, attention_mask = read(args, kwargs)
        if (cache is not None and attention_mask is None and hidden_states.dim() == 3
                and hidden_states.shape[1] == 1 and hidden_states.device.type == "cpu"
                and hidden_states.dtype == torch.float32 and self.in_proj.weight.dtype == torch.float32
                and self.in_proj.weight.device.type == "cpu" and not hasattr(self, "_hf_hook")
                and not (torch.is_grad_enabled() and (hidden_states.requires_grad or self.in_proj.weight.requires_grad))
                and not is_torchdynamo_exporting()):
            conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
            ssm_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
            if (conv_state is not None and ssm_state is not None and conv_state.device.type == "cpu"
                    and not cache.is_recording_past(self.layer_idx)):
                out = _mixer_step(hidden_states[:, 0], self.in_proj, self.conv1d, self.x_proj, self.dt_proj,
                                  self.A_log, self.D, self.out_proj, conv_state, ssm_state)
                return out.unsqueeze(1)
        return rest(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


# The dtypes fastarch's norm and rotary ops read and write natively on the CPU (fp32 accumulation).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _on_cpu(original: Callable, fast: Callable) -> Callable:
    """A forward that runs ``fast`` when the input and the module's weight are CPU tensors of one dtype among
    fp32, bf16 and fp16, else ``original`` (other devices; other or mixed dtypes, e.g. an fp32 residual
    stream into a bf16 norm)."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        native = (hidden_states.device.type == "cpu" and hidden_states.dtype in _NATIVE_DTYPES
                  and self.weight.dtype == hidden_states.dtype)
        return (fast if native else original)(self, hidden_states, *args, **kwargs)

    forward.__fastarch_original__ = original
    return forward


def _cpu_rms_norm_forward(original: Callable) -> Callable:
    """An RMSNorm forward (``weight * norm(x)``, one ``weight`` and ``variance_epsilon``) on
    :func:`fastarch.ops.rms_norm` for CPU input and weight of one dtype (fp32, bf16, fp16), else ``original``.
    In bf16 and fp16 the result is rounded once (transformers rounds the normalised input, then the
    product), so the two differ by at most a unit in the last place."""
    return _on_cpu(original, _norm_forward(original, _norm))


# -- Llama-family norms and rotary embedding ----------------------------------------------------------------
# (modeling module, RMSNorm class) of the models whose norm forward is Llama's (``weight * x * rsqrt(mean(x^2) +
# eps)``, computed in fp32) and whose module-level ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` and
# ``rotate_half`` are Llama's (non-interleaved halves over the whole head). Models with a ``(1 + weight)`` norm
# (Gemma) or a partial or interleaved rotary (Phi-3, GLM, ...) are not listed.
LLAMA_MODULES: tuple[tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3RMSNorm"),
)


# transformers' "silu" activation (ACT2FN) and torch's.
_SILU_TYPES = tuple({torch.nn.SiLU, getattr(_activations, "SiLUActivation", torch.nn.SiLU)})
# (modeling module, MLP class) of the same models whose MLP forward is Llama's: ``down(act(gate(x)) * up(x))``.
LLAMA_MLPS: tuple[tuple[str, str], ...] = (
    ("transformers.models.llama.modeling_llama", "LlamaMLP"),
    ("transformers.models.mistral.modeling_mistral", "MistralMLP"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
)


def _swiglu_mlp_forward(original: Callable) -> Callable:
    """Llama's MLP with the SiLU and the product done in place in the gate projection's output, for CPU input
    with autograd off: two fewer ``(..., intermediate)`` temporaries per call, the same values. Other
    activations, autograd, other devices and tracing run ``original``."""

    @functools.wraps(original)
    def forward(self, x):
        if (torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.device.type != "cpu"
                or not isinstance(self.act_fn, _SILU_TYPES) or torch.compiler.is_compiling()):
            return original(self, x)
        h = self.gate_proj(x)
        torch.nn.functional.silu(h, inplace=True)
        h.mul_(self.up_proj(x))
        return self.down_proj(h)

    forward.__fastarch_original__ = original
    return forward


def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' ``(B, L, D)`` cos/sin as fastarch's ``(B, L, D/2)`` tables, contiguous (made once for q
    and k), or None when the two halves of the last dimension differ (then they are not one angle per rotated
    pair)."""
    R = cos.shape[-1] // 2
    c, s = cos[..., :R], sin[..., :R]
    if not (torch.equal(c, cos[..., R:]) and torch.equal(s, sin[..., R:])):
        return None
    return c.contiguous(), s.contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, L, D)`` rotated by per-batch tables ``(1 or B, L, D/2)`` -> ``(B, H, L, D)``.
    transformers' projections are ``(B, L, H, D)`` transposed, so the op reads them without a copy."""
    xt = x.transpose(1, 2)
    if cos.shape[0] == 1:
        out = _rotary_embedding(xt, cos[0], sin[0])
    else:  # per-sequence positions (left padding): one call per sequence
        out = torch.cat([_rotary_embedding(xt[b:b + 1], cos[b], sin[b]) for b in range(x.shape[0])])
    return out.transpose(1, 2)


def _apply_rotary_pos_emb(original: Callable) -> Callable:
    """Llama's ``apply_rotary_pos_emb`` on :func:`fastarch.ops.rotary_embedding` for CPU ``q``/``k``
    ``(B, H, L, D)`` (fp32, bf16 or fp16, cos/sin of the same dtype; computed in fp32, rounded once) and
    constant cos/sin ``(1 or B, L, D)`` broadcast over the heads (``unsqueeze_dim=1``) whose
    halves repeat; every other call (other devices or dtypes, other layouts, cos/sin with a gradient, tracing
    by dynamo) runs ``original``."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        tensors = (q, k, cos, sin)
        if (unsqueeze_dim == 1 and all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                       and t.dtype == q.dtype for t in tensors) and q.dtype in _NATIVE_DTYPES
                and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape
                and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
                and q.shape[2] == k.shape[2] == cos.shape[1] and q.shape[3] == k.shape[3] == cos.shape[2]
                and cos.shape[2] % 2 == 0 and not (cos.requires_grad or sin.requires_grad)
                and not torch.compiler.is_compiling()):
            tables = _rotary_tables(cos, sin)
            if tables is not None:
                return _rotate(q, *tables), _rotate(k, *tables)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__fastarch_original__ = original
    return apply_rotary_pos_emb


# -- the patches: one registry, one undo ---------------------------------------------------------------------
@dataclass(frozen=True)
class Patch:
    """One replacement :func:`register` makes: attribute ``attr`` of class ``owner`` (None: of the modeling
    module itself) in modeling module ``module`` becomes ``make(original)``. ``module="*"`` applies to every
    modeling module that has the attribute as a transformers kernel function (``kernel``). ``group`` is the
    :func:`register` keyword that enables it; ``what`` says what runs on fastarch, for :func:`report`."""

    group: str
    module: str
    owner: str | None
    attr: str
    make: Callable[[Callable], Callable]
    what: str
    kernel: bool = False


def _kernel_patch(attr: str, name: str, package: str) -> Patch:
    def make(original: Callable) -> Callable:
        return _dispatcher(original, name, _real_package(package))

    return Patch("mamba", "*", None, attr, make, f"{name} on fastarch.compat's {package} (CPU tensors; every "
                 f"device when {package} is not installed)", kernel=True)


def _norm_patch(module: str, cls: str) -> Patch:
    return Patch("mamba", module, cls, "forward", functools.partial(_norm_forward, fast=_NORMS[cls]),
                 f"{cls}.forward on fastarch.ops.{'rms_norm_gated' if 'Gated' in cls else 'rms_norm'}")


PATCHES: tuple[Patch, ...] = (
    *(_kernel_patch(attr, name, package) for attr, (name, package) in KERNEL_GLOBALS.items()),
    *(_norm_patch(modname, clsname) for modname, clsname in NORM_MODULES),
    Patch("mamba", "transformers.models.mamba.modeling_mamba", "MambaMixer", "forward", _mamba_mixer_forward,
          "MambaMixer: the CPU fp32 decode step as one fused mixer step, projections on fastarch.ops.linear"),
    Patch("mamba", "transformers.models.mamba.modeling_mamba", "MambaRMSNorm", "forward",
          _cpu_rms_norm_forward, "MambaRMSNorm.forward on fastarch.ops.rms_norm (CPU; fp32, bf16, fp16)"),
    Patch("mamba", "transformers.models.mamba2.modeling_mamba2", "Mamba2Mixer", "forward", _projections_on_fastarch,
          "Mamba2Mixer: projections on fastarch.ops.linear (CPU fp32)"),
    *(Patch("llama", modname, None, "apply_rotary_pos_emb", _apply_rotary_pos_emb,
            "apply_rotary_pos_emb on fastarch.ops.rotary_embedding (CPU; fp32, bf16, fp16)") for modname, _ in LLAMA_MODULES),
    *(Patch("llama", modname, clsname, "forward", _cpu_rms_norm_forward,
            f"{clsname}.forward on fastarch.ops.rms_norm (CPU; fp32, bf16, fp16)") for modname, clsname in LLAMA_MODULES),
    *(Patch("llama", modname, clsname, "forward", _swiglu_mlp_forward,
            f"{clsname}: SiLU and product in place without autograd") for modname, clsname in LLAMA_MLPS),
)

# (group, owner object, attribute) -> the original value, for every patch in place.
_SAVED: dict[tuple[str, object, str], Callable] = {}
_ACTIVE_GROUPS: set[str] = set()


def _is_modeling_module(name: str) -> bool:
    return name.startswith("transformers.models.") and name.rsplit(".", 1)[-1].startswith("modeling_")


def _apply(module: types.ModuleType) -> None:
    """Apply every active patch that concerns ``module`` (a transformers modeling module)."""
    for p in PATCHES:
        if p.group not in _ACTIVE_GROUPS or p.module not in (module.__name__, "*"):
            continue
        owner = module if p.owner is None else getattr(module, p.owner, None)
        if owner is None:
            continue
        original = vars(owner).get(p.attr)
        if original is None or hasattr(original, "__fastarch_original__"):
            continue
        if p.kernel and (not hasattr(original, "__wrapped__")  # not a kernel function transformers made
                         or (module.__name__, p.attr) in KERNEL_EXCEPTIONS):
            continue
        _SAVED[(p.group, owner, p.attr)] = original
        setattr(owner, p.attr, p.make(original))


def _undo(groups: set[str]) -> None:
    for key in [k for k in _SAVED if k[0] in groups]:
        _, owner, attr = key
        setattr(owner, attr, _SAVED.pop(key))


class _WrappedLoader(importlib.abc.Loader):
    """A modeling module's loader that applies the active patches once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _apply(module)

    def __getattr__(self, name: str):  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._inner, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Python's import hook: modeling modules imported after :func:`register` get its patches as they load,
    so registering before or after importing a model's module gives the same result."""

    def find_spec(self, fullname, path, target=None):
        if not _is_modeling_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappedLoader(spec.loader)
                return spec
        return None


_IMPORT_HOOK = _PatchOnImport()


def _activate(groups: set[str]) -> None:
    _ACTIVE_GROUPS.update(groups)
    if _IMPORT_HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _IMPORT_HOOK)
    # The modules named by a patch are imported now (cheap next to a model); the kernel functions of every
    # other modeling module are patched when it is (or was already) imported.
    for modname in sorted({p.module for p in PATCHES if p.group in groups and p.module != "*"}):
        if importlib.util.find_spec(modname) is not None:
            importlib.import_module(modname)
    for name, module in list(sys.modules.items()):
        if module is not None and _is_modeling_module(name):
            _apply(module)


# -- register / unregister ----------------------------------------------------------------------------------
_MISSING = object()
_LOG = logging.getLogger("fastarch.integrations.transformers")
# name -> the previous attention and mask entries register() replaced, and the patch groups it asked for.
_STATE: dict[str, dict] = {}


def register(name: str = "fastarch", *, mamba: bool = True, llama: bool = True) -> None:
    """Register fastarch's attention and mask functions with transformers as ``name`` and apply the patches
    of :data:`PATCHES`: with ``mamba=True`` every kernel function transformers resolves from ``mamba_ssm`` and
    ``causal_conv1d`` (in every modeling module, imported before or after this call) and the Mamba norms and
    mixers; with ``llama=True`` the Llama-family norms, rotary embedding and MLPs. Idempotent; undone by
    :func:`unregister`."""
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(f"register: argument 'name' must be a non-empty string other than 'eager', got {name!r}")
    if name in _STATE:
        return
    masks = masking_utils.AttentionMaskInterface
    groups = {g for g, on in (("mamba", mamba), ("llama", llama)) if on}
    state = {
        "attention": AttentionInterface._global_mapping.get(name, _MISSING),
        "mask": masks._global_mapping.get(name, _MISSING),
        "groups": groups,
    }
    _activate(groups)
    AttentionInterface.register(name, attention_forward)
    masks.register(name, attention_mask)
    _STATE[name] = state
    _LOG.info("fastarch: registered %r with transformers %s; patches: %s", name, transformers.__version__,
              ", ".join(sorted(groups)) or "none")


def unregister(name: str | None = None) -> None:
    """Undo :func:`register` for ``name`` (every registered name when None): the interface entries go back to
    what they were (removed, or the function a name shadowed), and the patches no remaining name asks for
    are undone (each attribute gets its original back).
    Models still set to ``name`` must be switched (``model.set_attn_implementation("sdpa")``) before use."""
    for key in list(_STATE) if name is None else [name]:
        state = _STATE.pop(key, None)
        if state is None:
            continue
        for mapping, previous in ((AttentionInterface._global_mapping, state["attention"]),
                                  (masking_utils.AttentionMaskInterface._global_mapping, state["mask"])):
            if previous is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = previous
    still = set().union(*(s["groups"] for s in _STATE.values())) if _STATE else set()
    _undo(_ACTIVE_GROUPS - still)
    _ACTIVE_GROUPS.intersection_update(still)
    if not _STATE and _IMPORT_HOOK in sys.meta_path:
        sys.meta_path.remove(_IMPORT_HOOK)


# Kernel functions transformers resolves from fla, which fastarch does not provide yet: global name -> kernel.
_MISSING_KERNELS: dict[str, str] = {
    "torch_chunk_gated_delta_rule": "fla's chunk_gated_delta_rule (Gated DeltaNet)",
    "torch_recurrent_gated_delta_rule": "fla's fused_recurrent_gated_delta_rule (Gated DeltaNet)",
    "chunk_kimi_delta_attention": "fla's chunk_kda (KDA)",
    "recurrent_kimi_delta_attention": "fla's fused_recurrent_kda (KDA)",
}
_REPORTED: set[type] = set()


def report(model: torch.nn.Module) -> str:
    """What of ``model`` runs on fastarch, module by module, and where something does not, why.

    One line for the attention implementation, one per class whose forward :func:`register` replaced (with
    the conditions under which the replacement runs), and one per kernel function of the model's modeling
    modules: on fastarch, or transformers' PyTorch path and the reason. Logged once per model class on the
    ``fastarch.integrations.transformers`` logger (INFO) as well.
    """
    lines = []
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in _STATE:
        lines.append(f"attention: fastarch ({impl!r}: fastarch.ops.attention, compact masks)")
    else:
        lines.append(f"attention: transformers' {impl!r}, not fastarch (model.set_attn_implementation("
                     f"{(registered() or ['fastarch'])[0]!r}) after register() runs it on fastarch)")
    by_owner = {(p.module, p.owner, p.attr): p for p in PATCHES}
    seen_classes: dict[type, list[str]] = {}
    modules: dict[str, types.ModuleType] = {}
    for name, sub in model.named_modules():
        cls = type(sub)
        seen_classes.setdefault(cls, []).append(name or "(model)")
        mod = sys.modules.get(cls.__module__)
        if mod is not None and _is_modeling_module(mod.__name__):
            modules[mod.__name__] = mod
    for cls, names in seen_classes.items():
        forward = vars(cls).get("forward")
        if hasattr(forward, "__fastarch_original__"):
            p = by_owner.get((cls.__module__, cls.__name__, "forward"))
            what = p.what if p is not None else "forward replaced by fastarch"
            lines.append(f"{cls.__name__} x{len(names)}: {what}")
    for modname, mod in sorted(modules.items()):
        for attr, fn in sorted(vars(mod).items()):
            if not callable(fn):
                continue
            if hasattr(fn, "__fastarch_original__") and attr in KERNEL_GLOBALS:
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: fastarch ({KERNEL_GLOBALS[attr][0]})")
            elif attr in KERNEL_GLOBALS and hasattr(fn, "__wrapped__"):
                why = KERNEL_EXCEPTIONS.get((modname, attr)) or (
                    "register(mamba=False)" if _STATE else "register() has not been called")
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: transformers' resolution, not fastarch ({why})")
            elif attr in _MISSING_KERNELS and hasattr(fn, "__wrapped__"):
                lines.append(f"{modname.rsplit('.', 1)[-1]}.{attr}: transformers' PyTorch path: fastarch has no "
                             f"{_MISSING_KERNELS[attr]} yet")
    text = "\n".join(lines)
    if type(model) not in _REPORTED:
        _REPORTED.add(type(model))
        _LOG.info("fastarch: %s\n%s", type(model).__name__, text)
    return text


def registered() -> list[str]:
    """The names currently registered by :func:`register`."""
    return sorted(_STATE)

