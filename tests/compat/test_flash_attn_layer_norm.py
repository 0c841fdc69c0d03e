"""flash_attn.ops.triton.layer_norm, flash_attn.ops.layer_norm and flash_attn.ops.rms_norm
(fastarch.compat.flash_attn) against references transcribed from flash-attn's layer-norm tests: outputs,
residual streams and gradients over flash-attn's test grid (small shapes)."""

import pytest
import torch
import torch.nn.functional as F

from fastarch.compat.flash_attn.ops.layer_norm import (
    DropoutAddLayerNorm,
    dropout_add_layer_norm,
    dropout_add_layer_norm_parallel_residual,
    layer_norm,
)
from fastarch.compat.flash_attn.ops.rms_norm import DropoutAddRMSNorm, dropout_add_rms_norm, rms_norm
from fastarch.compat.flash_attn.ops.rms_norm import RMSNorm as OpsRMSNorm
from fastarch.compat.flash_attn.ops.triton.layer_norm import (
    LayerNorm,
    RMSNorm,
    layer_norm_fn,
    layer_norm_linear_fn,
    layer_norm_ref,
    rms_norm_fn,
)


def norm_reference(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, dropout_mask=None, dropout_mask1=None, upcast=False,
                   is_rms_norm=False):
    """flash-attn's test reference (layer_norm_ref / rms_norm_ref), with explicit keep masks."""
    dtype = x.dtype
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
        residual = residual.float() if residual is not None else None
        x1 = x1.float() if x1 is not None else None
        weight1 = weight1.float() if weight1 is not None else None
        bias1 = bias1.float() if bias1 is not None else None
    if rowscale is not None:
        x = x * rowscale[..., None]
    if dropout_p > 0.0:
        x = x.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
        if x1 is not None:
            x1 = x1.masked_fill(~dropout_mask1, 0.0) / (1.0 - dropout_p)
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)

    def norm(w, b):
        if is_rms_norm:
            rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
            y = x * rstd * w
            return (y + b if b is not None else y).to(dtype)
        return F.layer_norm(x.to(w.dtype), x.shape[-1:], weight=w, bias=b, eps=eps).to(dtype)

    outs = [norm(weight, bias)] + ([norm(weight1, bias1)] if weight1 is not None else [])
    return tuple(outs + [x]) if prenorm else (outs[0] if len(outs) == 1 else tuple(outs))


def _allclose(x, x_pt, x_ref, atol):
    """flash-attn's criterion: no further from the fp32 reference than twice the same-precision reference."""
    return (x - x_ref).abs().max() <= 2 * (x_pt - x_ref).abs().max() + atol


@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("input_dtype,residual_dtype", [(torch.float32, torch.float32),
                                                        (torch.bfloat16, torch.bfloat16),
                                                        (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("hidden_size", [97])
def test_layer_norm(hidden_size, input_dtype, residual_dtype, weight_dtype, has_residual, is_rms_norm, prenorm):
    low = torch.bfloat16 in (input_dtype, residual_dtype, weight_dtype)
    atol = 5e-2 if low else 1e-4
    torch.manual_seed(0)
    x0 = torch.randn(2, 7, hidden_size, dtype=input_dtype, requires_grad=True)
    x0_pt = x0.detach().clone().requires_grad_()
    x0_ref = x0.detach().clone().requires_grad_()
    res = res_pt = res_ref = None
    if has_residual:
        res = torch.randn_like(x0, dtype=residual_dtype, requires_grad=True)
        res_pt = res.detach().clone().requires_grad_()
        res_ref = res.detach().clone().requires_grad_()
    weight = torch.randn(hidden_size, dtype=weight_dtype, requires_grad=True)
    bias = None if is_rms_norm else torch.randn(hidden_size, dtype=weight_dtype, requires_grad=True)
    weight_pt, weight_ref = (weight.detach().clone().requires_grad_() for _ in range(2))
    bias_pt, bias_ref = ((bias.detach().clone().requires_grad_() if bias is not None else None) for _ in range(2))
    residual_in_fp32 = (not has_residual) and residual_dtype == torch.float32
    def run(fn, *args, **kw):
        got = fn(*args, **kw)
        return got if isinstance(got, tuple) else (got,)

    out, *rest = run(layer_norm_fn, x0, weight, bias, residual=res, eps=1e-6, prenorm=prenorm,
                     residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
    out_pt, *rest_pt = run(norm_reference, x0_pt, weight_pt, bias_pt, residual=res_pt, prenorm=prenorm,
                           is_rms_norm=is_rms_norm)
    out_ref, *rest_ref = run(norm_reference, x0_ref, weight_ref, bias_ref, residual=res_ref, prenorm=prenorm,
                             upcast=True, is_rms_norm=is_rms_norm)
    assert out.dtype == input_dtype
    if prenorm:
        residual, residual_pt, residual_ref = rest[0], rest_pt[0], rest_ref[0]
        assert residual.dtype == residual_dtype
        assert _allclose(residual, residual_pt, residual_ref, atol)
    assert _allclose(out, out_pt, out_ref, atol)
    g = torch.randn_like(out) / 2
    if not prenorm:
        out.backward(g)
        out_pt.backward(g)
        out_ref.backward(g)
    else:
        (out * torch.sigmoid(residual)).backward(g)
        (out_pt * torch.sigmoid(residual_pt)).backward(g)
        (out_ref * torch.sigmoid(residual_ref.to(dtype=residual_dtype))).backward(g)
    assert _allclose(x0.grad, x0_pt.grad, x0_ref.grad, atol)
    if has_residual:
        assert _allclose(res.grad, res_pt.grad, res_ref.grad, atol)
    assert _allclose(weight.grad, weight_pt.grad, weight_ref.grad, atol)
    if bias is not None:
        assert _allclose(bias.grad, bias_pt.grad, bias_ref.grad, atol)


@pytest.mark.parametrize("has_x1,has_weight1,has_rowscale", [  # rowscale with x1 is refused (bad-input test)
    (False, False, False), (True, False, False), (True, True, False), (False, True, False), (False, False, True),
    (False, True, True)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.27])
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_layer_norm_dropout_x1_weight1_rowscale(has_x1, has_weight1, has_rowscale, dropout_p, is_rms_norm):
    torch.manual_seed(1)
    N = 48
    leaves = {"x0": torch.randn(3, 5, N), "res": torch.randn(3, 5, N), "weight": torch.randn(N),
              "bias": torch.randn(N)}
    if has_x1:
        leaves["x1"] = torch.randn(3, 5, N)
    if has_weight1:
        leaves["weight1"], leaves["bias1"] = torch.randn(N), torch.randn(N)
    ours = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    refs = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    rowscale = torch.rand(3, 5) + 0.5 if has_rowscale else None
    outs = layer_norm_fn(ours["x0"], ours["weight"], ours["bias"], residual=ours["res"], x1=ours.get("x1"),
                         weight1=ours.get("weight1"), bias1=ours.get("bias1"), eps=1e-5, dropout_p=dropout_p,
                         rowscale=rowscale, prenorm=True, is_rms_norm=is_rms_norm, return_dropout_mask=True)
    *ys, residual, mask, mask1 = outs
    assert len(ys) == (2 if has_weight1 else 1)
    assert (mask is None) == (dropout_p == 0.0) and (mask1 is None) == (dropout_p == 0.0 or not has_x1)
    if mask is not None:
        assert mask.dtype == torch.bool and 0.5 < mask.float().mean() < 0.95
    *ys_ref, residual_ref = norm_reference(refs["x0"], refs["weight"], refs["bias"], residual=refs["res"],
                                           x1=refs.get("x1"), weight1=refs.get("weight1"), bias1=refs.get("bias1"),
                                           eps=1e-5, dropout_p=dropout_p, rowscale=rowscale, prenorm=True,
                                           dropout_mask=mask, dropout_mask1=mask1, is_rms_norm=is_rms_norm)
    for y, y_ref in zip(ys + [residual], ys_ref + [residual_ref]):
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    sum(y.sum() for y in ys).add((residual * residual).sum()).backward()
    sum(y.sum() for y in ys_ref).add((residual_ref * residual_ref).sum()).backward()
    for k in ours:
        torch.testing.assert_close(ours[k].grad, refs[k].grad, rtol=1e-4, atol=1e-4, msg=k)
    # the exported reference agrees with the transcribed one
    again = layer_norm_ref(leaves["x0"], leaves["weight"], leaves["bias"], residual=leaves["res"],
                           x1=leaves.get("x1"), weight1=leaves.get("weight1"), bias1=leaves.get("bias1"), eps=1e-5,
                           dropout_p=dropout_p, rowscale=rowscale, prenorm=True, dropout_mask=mask,
                           dropout_mask1=mask1) if not is_rms_norm else None
    if again is not None:
        torch.testing.assert_close(again[0], ys_ref[0].detach(), rtol=1e-4, atol=1e-4)


def test_residual_passthrough_out_buffers_and_modules():
    torch.manual_seed(2)
    x = torch.randn(4, 32)
    w, b = torch.randn(32), torch.randn(32)
    y, res = layer_norm_fn(x, w, b, prenorm=True)
    assert res is x  # nothing added, cast or dropped: the input itself, as in flash-attn
    _, res32 = layer_norm_fn(x.bfloat16(), w, b, prenorm=True, residual_in_fp32=True)
    assert res32.dtype == torch.float32
    out, res_out = torch.empty(4, 32), torch.empty(4, 32)
    r = torch.randn(4, 32)
    y2, res2 = layer_norm_fn(x, w, b, residual=r, prenorm=True, out=out, residual_out=res_out)
    assert y2.data_ptr() == out.data_ptr() and res2.data_ptr() == res_out.data_ptr()
    torch.testing.assert_close(res_out, x + r)
    torch.testing.assert_close(rms_norm_fn(x, w, None), norm_reference(x, w, None, is_rms_norm=True))
    lin_w, lin_b = torch.randn(16, 32), torch.randn(16)
    torch.testing.assert_close(layer_norm_linear_fn(x, w, b, lin_w, lin_b, eps=1e-5),
                               F.linear(F.layer_norm(x, (32,), w, b, 1e-5), lin_w, lin_b), rtol=1e-5, atol=1e-5)
    rn = RMSNorm(32, eps=1e-5)
    assert list(rn.state_dict()) == ["weight"] and rn.bias is None
    torch.testing.assert_close(rn(x), norm_reference(x, rn.weight, None, eps=1e-5, is_rms_norm=True))
    ln = LayerNorm(32)
    assert sorted(ln.state_dict()) == ["bias", "weight"]
    torch.testing.assert_close(ln(x, residual=r), F.layer_norm(x + r, (32,), eps=1e-5))


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("prenorm", [False, True])
def test_dropout_add_norm_functions(is_rms_norm, dropout_p, prenorm):
    """flash_attn.ops.layer_norm / rms_norm: z, x and the uint8 keep mask (ones without dropout)."""
    torch.manual_seed(3)
    N = 40
    x0 = torch.randn(2, 3, N, requires_grad=True)
    res = torch.randn(2, 3, N, requires_grad=True)
    w = torch.randn(N, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    rowscale, colscale = torch.rand(2, 3) + 0.5, torch.rand(N) + 0.5
    fn = dropout_add_rms_norm if is_rms_norm else dropout_add_layer_norm
    outs = fn(x0, res, w, b, dropout_p, 1e-5, rowscale=rowscale, layerscale=colscale, prenorm=prenorm,
              return_dropout_mask=True)
    z, x, dmask = outs if prenorm else (outs[0], None, outs[1])
    assert dmask.dtype == torch.uint8 and dmask.shape == x0.shape
    if dropout_p == 0.0:
        assert bool((dmask == 1).all())
    scaled = x0 * rowscale[..., None] * colscale
    want_z, want_x = norm_reference(scaled, w, b, residual=res, eps=1e-5, dropout_p=dropout_p, prenorm=True,
                                    dropout_mask=dmask.bool(), is_rms_norm=is_rms_norm)
    torch.testing.assert_close(z, want_z, rtol=1e-4, atol=1e-4)
    if prenorm:
        torch.testing.assert_close(x, want_x, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(z.sum(), (x0, res, w, b))
    want = torch.autograd.grad(want_z.sum(), (x0, res, w, b))
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)


def test_old_api_simple_functions_and_modules():
    torch.manual_seed(4)
    x, w, b = torch.randn(3, 24), torch.randn(24), torch.randn(24)
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (24,), w, b, 1e-5))
    torch.testing.assert_close(rms_norm(x, w, 1e-5), norm_reference(x, w, None, eps=1e-5, is_rms_norm=True))
    z0, z1, xs = dropout_add_layer_norm_parallel_residual(x, x * 2, None, w, b, w * 2, None, 0.0, 1e-5,
                                                          prenorm=True)
    torch.testing.assert_close(xs, 3 * x)
    torch.testing.assert_close(z1, F.layer_norm(3 * x, (24,), w * 2, None, 1e-5))
    assert dropout_add_layer_norm_parallel_residual(x, None, None, w, b, None, None, 0.0, 1e-5)[1] is None
    m = DropoutAddLayerNorm(24, prenorm=True, p=0.1)
    assert sorted(m.state_dict()) == ["bias", "weight"]
    m.eval()
    z, xo = m(x, residual=x)
    torch.testing.assert_close(xo, 2 * x)
    r = DropoutAddRMSNorm(24)
    assert list(r.state_dict()) == ["weight"]
    assert list(OpsRMSNorm(24).state_dict()) == ["weight"]
    torch.testing.assert_close(OpsRMSNorm(24, eps=1e-5)(x), norm_reference(x, torch.ones(24), None, eps=1e-5,
                                                                          is_rms_norm=True))


def test_layer_norm_bad_input():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="'weight' must have shape"):
        layer_norm_fn(x, torch.randn(7), None)
    with pytest.raises(ValueError, match="'residual' must have shape"):
        layer_norm_fn(x, w, None, residual=torch.randn(2, 9))
    with pytest.raises(ValueError, match="rowscale"):
        layer_norm_fn(x, w, None, x1=torch.randn(2, 8), rowscale=torch.ones(2))
    with pytest.raises(ValueError, match="dropout_p"):
        layer_norm_fn(x, w, None, dropout_p=1.5)
