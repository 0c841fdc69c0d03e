"""One decode step of a pre-norm decoder layer, in two halves around the caller's KV-cache write:

- :func:`decoder_qkv_step`: the norm (RMS, or a layer norm when it has a bias) -> the q, k and v projections ->
  (optional per-head RMS norm of q and k, as in Qwen3) -> (optional) the rotary embedding (rotate-half pairs
  over the first ``2R`` channels of each head);
- :func:`decoder_out_step`: attention of the one new query over the cache (causal, optionally a sliding window;
  grouped-query heads) -> ``o_proj`` + residual -> (optionally) the norm -> the MLP + residual: SwiGLU
  ``down(silu(gate(m)) * up(m))`` with a gate, GPT-2's ``down(gelu_tanh(up(m)))`` without.

The cache itself stays the caller's (transformers' ``Cache.update``, or fastarch's ``KVCache``): it is written
between the two halves. Llama, Mistral, Qwen2, Qwen3, Phi-3 (whose fused ``qkv_proj`` and ``gate_up_proj`` are
passed as row slices) and GPT-2 (whose ``Conv1D`` weights are passed transposed: a weight may be row- or
column-major) share this layer.

A decode step of a small model is dozens of calls each shorter than its own dispatch; the ``cpp`` backend runs
each half as one C++ call that reads every weight once. Backends: ``cpp`` (fp32, contiguous, without autograd)
and ``torch`` (op by op on fastarch's ``rms_norm``, ``linear``, ``rotary_embedding`` and ``attention``,
differentiable).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backend import Call, choose, register
from ._backends import CppImplementation, TorchImplementation
from ._checks import check_tensor, fail
from ._dispatch import call_of, dispatch
from .attention import attention
from .layer_norm import layer_norm
from .linear import linear
from .mamba_mixer_step import fused_step_reasons
from .rms_norm import rms_norm
from .rotary import rotary_embedding, rotary_embedding_ref

__all__ = ["decoder_out_step", "decoder_out_step_ref", "decoder_qkv_step", "decoder_qkv_step_ref"]

QKV, OUT = "decoder_qkv_step", "decoder_out_step"
_QKV_NAMES = ("x", "norm_weight", "q_weight", "k_weight", "v_weight", "q_bias", "k_bias", "v_bias", "cos", "sin",
              "q_norm_weight", "k_norm_weight", "norm_bias")
_OUT_NAMES = ("q", "key", "value", "residual", "o_weight", "o_bias", "norm_weight", "gate_weight", "up_weight",
              "down_weight", "norm_bias", "up_bias", "down_bias")


# -- the step, composed from functions (fastarch's ops or their plain references) ----------------------------
def _qkv(x, norm_w, q_w, k_w, v_w, q_b, k_b, v_b, cos, sin, q_norm_w, k_norm_w, norm_b, H, Hk, eps, head_eps, *,
         norm, lin, rotate):
    B = x.shape[0]
    h = norm(x, norm_w, norm_b, eps)
    q, k, v = lin(h, q_w, q_b), lin(h, k_w, k_b), lin(h, v_w, v_b)
    D = q_w.shape[0] // H
    q, k, v = q.reshape(B, 1, H, D), k.reshape(B, 1, Hk, D), v.reshape(B, Hk, D)
    if q_norm_w is not None:
        q = norm(q, q_norm_w, None, head_eps)
    if k_norm_w is not None:
        k = norm(k, k_norm_w, None, head_eps)
    if cos is None:
        pass
    elif cos.shape[0] == 1:
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    else:  # one angle row per sequence (left-padded batches)
        q = torch.cat([rotate(q[b:b + 1], cos[b:b + 1], sin[b:b + 1]) for b in range(B)])
        k = torch.cat([rotate(k[b:b + 1], cos[b:b + 1], sin[b:b + 1]) for b in range(B)])
    return q.reshape(B, H, D), k.reshape(B, Hk, D), v


def _out(q, key, value, residual, o_w, o_b, norm_w, gate_w, up_w, down_w, norm_b, up_b, down_b, n, left, scale,
         eps, *, attend, norm, lin):
    B, H, D = q.shape
    a = attend(q[:, :, None], key[:, :, :n], value[:, :, :n], left, scale)  # (B, H, D)
    h = residual + lin(a.reshape(B, H * D), o_w, o_b)
    if up_w is None:
        return h
    m = norm(h, norm_w, norm_b, eps)
    u = lin(m, up_w, up_b)
    act = F.silu(lin(m, gate_w, None)) * u if gate_w is not None else F.gelu(u, approximate="tanh")
    return h + lin(act, down_w, down_b)


def _norm_ref(x, w, b, eps):
    xf = x.float()
    if b is None:
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return F.layer_norm(xf, xf.shape[-1:], w.float(), b.float(), eps)


def _norm(x, w, b, eps):
    return rms_norm(x, w, eps) if b is None else layer_norm(x, w, b, eps)


def _lin_ref(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _rotate_ref(x, cos, sin):
    """x (1, 1, heads, D); cos, sin (1, R)."""
    return rotary_embedding_ref(x.float(), cos.float(), sin.float())


def _attend_ref(q, key, value, left, scale):
    """q (B, H, 1, D); key, value (B, Hk, n, D) -> (B, H, D): the last query position over keys [n-1-left, n)."""
    H, Hk, n = q.shape[1], key.shape[1], key.shape[2]
    k = key.float().repeat_interleave(H // Hk, dim=1)
    v = value.float().repeat_interleave(H // Hk, dim=1)
    s = (q.float() @ k.transpose(-1, -2)) * scale
    if left >= 0:
        s[..., : max(0, n - 1 - left)] = float("-inf")
    return (s.softmax(-1) @ v)[:, :, 0]


def _attend(q, key, value, left, scale):
    out = attention(q, key, value, window=(left, 0), scale=scale)  # (B, H, 1, D), bottom-right aligned
    return out[:, :, 0]


def decoder_qkv_step_ref(x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin,
                         num_heads: int, num_kv_heads: int, norm_eps: float = 1e-6, q_norm_weight=None,
                         k_norm_weight=None, head_norm_eps: float = 1e-6, norm_bias=None):
    """The oracle of :func:`decoder_qkv_step`, in fp32."""
    return _qkv(x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, q_norm_weight,
                k_norm_weight, norm_bias, num_heads, num_kv_heads, norm_eps, head_norm_eps, norm=_norm_ref,
                lin=_lin_ref, rotate=_rotate_ref)


def decoder_out_step_ref(q, key, value, residual, o_weight, o_bias, norm_weight, gate_weight, up_weight,
                         down_weight, key_length: int, window_left: int = -1, scale: float | None = None,
                         norm_eps: float = 1e-6, norm_bias=None, up_bias=None, down_bias=None):
    """The oracle of :func:`decoder_out_step`, in fp32."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _out(q, key, value, residual.float(), o_weight, o_bias, norm_weight, gate_weight, up_weight, down_weight,
                norm_bias, up_bias, down_bias, key_length, window_left, scale, norm_eps, attend=_attend_ref,
                norm=_norm_ref, lin=_lin_ref)


# -- validation ------------------------------------------------------------------------------------------------
def _tensor(op: str, name: str, t, ndim: int, like: torch.Tensor, shape: tuple | None = None,
            optional: bool = False) -> None:
    """``check_tensor`` with the step's rule: every tensor in the input's dtype and on its device."""
    if t is None and optional:
        return
    check_tensor(op, name, t, ndim=ndim, dtypes=(like.dtype,), device=like.device, shape=shape)


def _positive_int(op: str, name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        fail(op, f"argument '{name}' must be a positive int, got {v!r}")
    return v


def _eps(op: str, name: str, v) -> float:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
        fail(op, f"argument '{name}' must be a finite number >= 0, got {v!r}")
    return float(v)


def _validate_qkv(t: dict, H, Hk, eps, head_eps) -> None:
    x = t["x"]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        fail(QKV, f"argument 'x' must be a floating-point (batch, d_model) tensor, got "
                  f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    H, Hk = _positive_int(QKV, "num_heads", H), _positive_int(QKV, "num_kv_heads", Hk)
    if H % Hk:
        fail(QKV, f"argument 'num_kv_heads' must divide num_heads={H}, got {Hk}")
    B, d = x.shape
    qw = t["q_weight"]
    _tensor(QKV, "q_weight", qw, 2, x)
    if qw.shape[1] != d or qw.shape[0] % H:
        fail(QKV, f"argument 'q_weight' must be (num_heads * head_dim, d_model) with num_heads={H}, d_model={d}, "
                  f"got {tuple(qw.shape)}")
    D = qw.shape[0] // H
    _tensor(QKV, "norm_weight", t["norm_weight"], 1, x, (d,))
    _tensor(QKV, "norm_bias", t["norm_bias"], 1, x, (d,), optional=True)
    for name in ("k_weight", "v_weight"):
        _tensor(QKV, name, t[name], 2, x, (Hk * D, d))
    for name, rows in (("q_bias", H * D), ("k_bias", Hk * D), ("v_bias", Hk * D)):
        _tensor(QKV, name, t[name], 1, x, (rows,), optional=True)
    for name in ("q_norm_weight", "k_norm_weight"):
        _tensor(QKV, name, t[name], 1, x, (D,), optional=True)
    cos, sin = t["cos"], t["sin"]
    if (cos is None) != (sin is None):
        fail(QKV, "arguments 'cos' and 'sin' must both be given (the rotary embedding) or both be None")
    if cos is not None:
        _tensor(QKV, "cos", cos, 2, x)
        if cos.shape[0] not in (1, B) or not 1 <= cos.shape[1] <= D // 2:
            fail(QKV, f"argument 'cos' must be (1 or batch={B}, R) with 1 <= R <= head_dim/2 = {D // 2}, got "
                      f"{tuple(cos.shape)}")
        _tensor(QKV, "sin", sin, 2, x, tuple(cos.shape))
    _eps(QKV, "norm_eps", eps)
    _eps(QKV, "head_norm_eps", head_eps)


def _validate_out(t: dict, n, left, scale, eps) -> None:
    q = t["q"]
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        fail(OUT, f"argument 'q' must be a floating-point (batch, num_heads, head_dim) tensor, got "
                  f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    B, H, D = q.shape
    key = t["key"]
    _tensor(OUT, "key", key, 4, q)
    Hk, S = key.shape[1], key.shape[2]
    if key.shape[0] != B or key.shape[3] != D or Hk < 1 or H % Hk:
        fail(OUT, f"argument 'key' must be (batch={B}, num_kv_heads dividing {H}, S, head_dim={D}), got "
                 f"{tuple(key.shape)}")
    _tensor(OUT, "value", t["value"], 4, q, tuple(key.shape))
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= S:
        fail(OUT, f"argument 'key_length' must be an int in [1, {S}] (the cache's valid keys), got {n!r}")
    if not isinstance(left, int) or isinstance(left, bool) or left < -1:
        fail(OUT, f"argument 'window_left' must be an int >= -1 (-1: no window), got {left!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        fail(OUT, f"argument 'scale' must be a finite number > 0 or None, got {scale!r}")
    res = t["residual"]
    _tensor(OUT, "residual", res, 2, q)
    if res.shape[0] != B:
        fail(OUT, f"argument 'residual' must be (batch={B}, d_model), got {tuple(res.shape)}")
    d = res.shape[1]
    _tensor(OUT, "o_weight", t["o_weight"], 2, q, (d, H * D))
    _tensor(OUT, "o_bias", t["o_bias"], 1, q, (d,), optional=True)
    if (t["up_weight"] is None) != (t["down_weight"] is None):
        fail(OUT, "arguments 'up_weight' and 'down_weight' must be given together (the MLP) or both be None")
    if t["up_weight"] is None:
        for name in ("gate_weight", "up_bias", "down_bias"):
            if t[name] is not None:
                fail(OUT, f"argument '{name}' is given without the MLP ('up_weight' and 'down_weight')")
    else:
        uw = t["up_weight"]
        _tensor(OUT, "up_weight", uw, 2, q)
        if uw.shape[1] != d:
            fail(OUT, f"argument 'up_weight' must be (intermediate, d_model={d}), got {tuple(uw.shape)}")
        I = uw.shape[0]
        _tensor(OUT, "gate_weight", t["gate_weight"], 2, q, (I, d), optional=True)
        _tensor(OUT, "down_weight", t["down_weight"], 2, q, (d, I))
        _tensor(OUT, "up_bias", t["up_bias"], 1, q, (I,), optional=True)
        _tensor(OUT, "down_bias", t["down_bias"], 1, q, (d,), optional=True)
        _tensor(OUT, "norm_weight", t["norm_weight"], 1, q, (d,))
        _tensor(OUT, "norm_bias", t["norm_bias"], 1, q, (d,), optional=True)
    _eps(OUT, "norm_eps", eps)


def _unit_stride(t: torch.Tensor | None) -> bool:
    """A layout the C++ kernels read in place: contiguous vectors, row- or column-major matrices."""
    if t is None:
        return True
    if t.dim() != 2:
        return t.is_contiguous()
    return (t.stride(1) == 1 and t.stride(0) >= t.shape[1]) or (t.stride(0) == 1 and t.stride(1) >= t.shape[0])


def _call(tensors: tuple, grad: bool) -> Call:
    x = tensors[0]
    # x, cos and sin are copied when strided (a row of a longer sequence); the weights are read in place
    return call_of(x, batch=x.shape[0], contiguous=all(_unit_stride(t) for t in tensors[1:8] + tensors[10:]),
                   grad=grad)


def _out_call(tensors: tuple, grad: bool) -> Call:
    key, value = tensors[1:3]
    # q and the residual are copied when strided; the cache may be any view with unit stride over head_dim (a
    # static cache's prefix); the weights are read in place
    return call_of(tensors[0], batch=key.shape[0],
                   contiguous=all(_unit_stride(t) for t in tensors[4:]) and key.stride(-1) == 1
                   and value.stride(-1) == 1, grad=grad)


def _grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- custom ops (torch.compile and export see one node per half) -------------------------------------------------
@torch.library.custom_op("fastarch::decoder_qkv_step", mutates_args=())
def _qkv_op(x: torch.Tensor, norm_w: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor,
            q_b: torch.Tensor | None, k_b: torch.Tensor | None, v_b: torch.Tensor | None, cos: torch.Tensor | None,
            sin: torch.Tensor | None, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
            norm_b: torch.Tensor | None, H: int, Hk: int, eps: float, head_eps: float,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (x, norm_w, q_w, k_w, v_w, q_b, k_b, v_b, cos, sin, q_norm_w, k_norm_w, norm_b)
    return choose(QKV, _call(args, False), backend).forward(*args, H, Hk, eps, head_eps)


@_qkv_op.register_fake
def _(x, norm_w, q_w, k_w, v_w, q_b, k_b, v_b, cos, sin, q_norm_w, k_norm_w, norm_b, H, Hk, eps, head_eps, backend):
    D = q_w.shape[0] // H
    B = x.shape[0]
    return x.new_empty(B, H, D), x.new_empty(B, Hk, D), x.new_empty(B, Hk, D)


@torch.library.custom_op("fastarch::decoder_out_step", mutates_args=())
def _out_op(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, residual: torch.Tensor, o_w: torch.Tensor,
            o_b: torch.Tensor | None, norm_w: torch.Tensor | None, gate_w: torch.Tensor | None,
            up_w: torch.Tensor | None, down_w: torch.Tensor | None, norm_b: torch.Tensor | None,
            up_b: torch.Tensor | None, down_b: torch.Tensor | None, n: int, left: int, scale: float, eps: float,
            backend: str) -> torch.Tensor:
    args = (q, key, value, residual, o_w, o_b, norm_w, gate_w, up_w, down_w, norm_b, up_b, down_b)
    return choose(OUT, _out_call(args, False), backend).forward(*args, n, left, scale, eps)


@_out_op.register_fake
def _(q, key, value, residual, o_w, o_b, norm_w, gate_w, up_w, down_w, norm_b, up_b, down_b, n, left, scale, eps,
      backend):
    return residual.new_empty(residual.shape)


# -- the public ops ---------------------------------------------------------------------------------------------
def decoder_qkv_step(x: torch.Tensor, norm_weight: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     v_weight: torch.Tensor, q_bias: torch.Tensor | None, k_bias: torch.Tensor | None,
                     v_bias: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     num_heads: int, num_kv_heads: int, norm_eps: float = 1e-6,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     head_norm_eps: float = 1e-6, norm_bias: torch.Tensor | None = None, *,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of a pre-norm decoder layer's decode step: q, k and v of one new token per sequence.

    Args:
        x: the layer's input ``(batch, d_model)`` (one token per sequence).
        norm_weight, norm_bias: ``(d_model,)``, the input norm (epsilon ``norm_eps``): RMS when ``norm_bias`` is
            None, else a layer norm.
        q_weight, k_weight, v_weight: ``(num_heads * head_dim, d_model)``, ``(num_kv_heads * head_dim, d_model)``
            twice, as ``nn.Linear`` keeps them (a transposed view of a ``(d_model, rows)`` matrix is read in
            place); q_bias, k_bias, v_bias: the matching biases or None.
        cos, sin: ``(1 or batch, R)``, the rotation angles of the token's position (``R <= head_dim / 2``
            pairs ``(i, i + R)``: rotate-half over the first ``2R`` channels, the rest unrotated), or None for
            no rotary embedding.
        num_heads, num_kv_heads: the query and key/value heads (``num_kv_heads`` divides ``num_heads``).
        q_norm_weight, k_norm_weight: ``(head_dim,)``, a per-head RMS norm of q and k before the rotation
            (epsilon ``head_norm_eps``; Qwen3), or None.
        backend: force 'cpp' or 'torch' (default: ``cpp`` for fp32 calls without autograd).

    Returns:
        ``q (batch, num_heads, head_dim)``, ``k`` and ``v`` ``(batch, num_kv_heads, head_dim)``, in x's dtype.
    """
    tensors = (x, norm_weight, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos, sin, q_norm_weight,
               k_norm_weight, norm_bias)
    _validate_qkv(dict(zip(_QKV_NAMES, tensors)), num_heads, num_kv_heads, norm_eps, head_norm_eps)
    grad = _grad(tensors)
    impl, name = dispatch(QKV, lambda: _call(tensors, grad), backend, *tensors)
    extra = (num_heads, num_kv_heads, float(norm_eps), float(head_norm_eps))
    if impl is not None:
        return impl.forward(*tensors, *extra)
    if grad and not torch.compiler.is_compiling():  # autograd through the torch backend's ops
        return choose(QKV, _call(tensors, grad), name).forward(*tensors, *extra)
    return _qkv_op(*tensors, *extra, name)


def decoder_out_step(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, residual: torch.Tensor,
                     o_weight: torch.Tensor, o_bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                     gate_weight: torch.Tensor | None, up_weight: torch.Tensor | None,
                     down_weight: torch.Tensor | None, key_length: int, window_left: int = -1,
                     scale: float | None = None, norm_eps: float = 1e-6, norm_bias: torch.Tensor | None = None,
                     up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None, *,
                     backend: str | None = None) -> torch.Tensor:
    """The second half of a pre-norm decoder layer's decode step: attention, ``o_proj``, the MLP.

    Args:
        q: ``(batch, num_heads, head_dim)`` from :func:`decoder_qkv_step`.
        key, value: the cache ``(batch, num_kv_heads, S, head_dim)`` after this token's write (unit stride over
            head_dim; any other strides); keys ``[0, key_length)`` are valid, the new token's is the last.
        residual: the layer's input ``(batch, d_model)``.
        o_weight, o_bias: ``(d_model, num_heads * head_dim)``, ``(d_model,)`` or None.
        norm_weight, norm_bias: the post-attention norm ``(d_model,)`` (epsilon ``norm_eps``; RMS when
            ``norm_bias`` is None, else a layer norm).
        gate_weight, up_weight, down_weight, up_bias, down_bias: the MLP: ``up_weight`` ``(intermediate,
            d_model)`` and ``down_weight`` ``(d_model, intermediate)`` with optional biases; with ``gate_weight``
            (``up_weight``'s shape) it is SwiGLU ``down(silu(gate(m)) * up(m))``, without it GPT-2's
            ``down(gelu_tanh(up(m)))``. ``up_weight`` and ``down_weight`` None: the attention half alone.
        key_length: the valid keys.
        window_left: the query sees keys ``key_length - 1 - window_left ..`` (a sliding window of
            ``window_left + 1`` keys), -1 for all.
        scale: the scores' scale (default ``head_dim ** -0.5``).
        backend: force 'cpp' or 'torch' (default: ``cpp`` for fp32 calls without autograd).

    Returns:
        ``(batch, d_model)``: ``h = residual + o_proj(attention)``, then ``h + mlp(norm(h))`` with the MLP.
    """
    tensors = (q, key, value, residual, o_weight, o_bias, norm_weight, gate_weight, up_weight, down_weight,
               norm_bias, up_bias, down_bias)
    _validate_out(dict(zip(_OUT_NAMES, tensors)), key_length, window_left, scale, norm_eps)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if up_weight is None:
        tensors = tensors[:6] + (None,) * 7
    grad = _grad(tensors)
    impl, name = dispatch(OUT, lambda: _out_call(tensors, grad), backend, *tensors)
    extra = (key_length, window_left, scale, float(norm_eps))
    if impl is not None:
        return impl.forward(*tensors, *extra)
    if grad and not torch.compiler.is_compiling():
        return choose(OUT, _out_call(tensors, grad), name).forward(*tensors, *extra)
    return _out_op(*tensors, *extra, name)


# -- backends -----------------------------------------------------------------------------------------------------
class TorchDecoderQkvStep(TorchImplementation):
    op = QKV
    description = "op by op on fastarch's rms_norm or layer_norm, linear and rotary_embedding"

    def forward(self, *args):
        *tensors, H, Hk, eps, head_eps = args
        return _qkv(*tensors, H, Hk, eps, head_eps, norm=_norm, lin=linear,
                    rotate=lambda t, c, s: rotary_embedding(t, c, s))


class TorchDecoderOutStep(TorchImplementation):
    op = OUT
    description = "op by op on fastarch's attention, linear and rms_norm or layer_norm"

    def forward(self, *args):
        *tensors, n, left, scale, eps = args
        return _out(*tensors, n, left, scale, eps, attend=_attend, norm=_norm, lin=linear)


class CppDecoderQkvStep(CppImplementation):
    op, extension = QKV, "decode_step"
    dtypes = (torch.float32, torch.bfloat16)
    description = ("one fused C++ call (weights read once, in place; bf16 read into fp32 arithmetic); fp32 or "
                   "bf16, without autograd")

    def check(self, call):
        return fused_step_reasons(call, "the weights must be row- or column-major, the vectors contiguous")

    def forward(self, x, norm_w, q_w, k_w, v_w, q_b, k_b, v_b, cos, sin, q_norm_w, k_norm_w, norm_b, H, Hk, eps,
                head_eps):
        rot = cos is not None
        q, k, v = self.lib.decoder_qkv_step(x.contiguous(), norm_w, norm_b, eps, q_w, q_b, k_w, k_b, v_w, v_b,
                                            q_norm_w, k_norm_w, head_eps, cos.contiguous() if rot else None,
                                            sin.contiguous() if rot else None, H, Hk, True)
        return q, k, v


class CppDecoderOutStep(CppImplementation):
    op, extension = OUT, "decode_step"
    dtypes = (torch.float32, torch.bfloat16)
    description = ("one fused C++ call (weights read once, in place; bf16 read into fp32 arithmetic); fp32 or "
                   "bf16, without autograd")

    def check(self, call):
        return fused_step_reasons(call, "the weights must be row- or column-major, the vectors contiguous, the cache "
                                    "unit-stride over head_dim")

    def forward(self, q, key, value, residual, o_w, o_b, norm_w, gate_w, up_w, down_w, norm_b, up_b, down_b, n,
                left, scale, eps):
        return self.lib.decoder_out_step(q.contiguous(), key, value, n, left, scale, residual.contiguous(), o_w, o_b,
                                         norm_w, norm_b, eps, gate_w, up_w, up_b, down_w, down_b, True)


for _impl in (TorchDecoderQkvStep, TorchDecoderOutStep, CppDecoderQkvStep, CppDecoderOutStep):
    register(_impl)
