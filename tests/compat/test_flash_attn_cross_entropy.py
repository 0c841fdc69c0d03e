"""flash_attn.losses.cross_entropy.CrossEntropyLoss (fastarch.compat.flash_attn) against torch's cross-entropy
with the z-loss term added, as flash-attn's test does; flash-attn's test grid on small vocabularies."""

import pytest
import torch

from fastarch.compat.flash_attn.losses.cross_entropy import CrossEntropyLoss
from fastarch.compat.flash_attn.ops.triton.cross_entropy import cross_entropy_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("lse_square_scale", [0.0, 1e-2])
@pytest.mark.parametrize("logit_scale", [1.0, 0.7])
@pytest.mark.parametrize("smoothing", [0.0, 0.9])
@pytest.mark.parametrize("vocab_size", [50, 1031])
def test_cross_entropy_loss(vocab_size, smoothing, logit_scale, lse_square_scale, inplace_backward, dtype):
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-3, 1e-4)
    torch.manual_seed(0)
    n = 24
    x_pt = torch.randn(n, vocab_size, dtype=dtype, requires_grad=True)
    x = x_pt.detach().clone().requires_grad_()
    y = torch.randint(0, vocab_size, (n,), dtype=torch.long)
    y[torch.randperm(n)[:5]] = -100
    model_pt = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)
    model = CrossEntropyLoss(label_smoothing=smoothing, logit_scale=logit_scale, lse_square_scale=lse_square_scale,
                             inplace_backward=inplace_backward)
    out = model(x, y)
    out_pt = model_pt(x_pt.float() * logit_scale, y)
    if lse_square_scale > 0.0:
        lse_pt = torch.logsumexp(x_pt.float() * logit_scale, dim=-1)
        out_pt = out_pt + lse_square_scale * (lse_pt[y != -100] ** 2).mean()
    torch.testing.assert_close(out, out_pt, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    out_pt.backward(g)
    out.backward(g)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, x_pt.grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions_z_loss_and_precomputed_lse(reduction):
    torch.manual_seed(1)
    x = torch.randn(6, 11, requires_grad=True)
    y = torch.tensor([1, -100, 3, 10, 0, 7])
    loss_fn = CrossEntropyLoss(reduction=reduction, lse_square_scale=0.1, return_z_loss=True, ignore_index=-100)
    loss, z = loss_fn(x, y)
    lse = torch.logsumexp(x.detach(), -1)
    keep = y != -100
    per_row = torch.nn.functional.cross_entropy(x.detach(), y, reduction="none") + 0.1 * lse**2 * keep
    z_rows = 0.1 * lse**2 * keep
    want = {"none": (per_row, z_rows), "sum": (per_row.sum(), z_rows.sum()),
            "mean": (per_row.sum() / keep.sum(), z_rows.sum() / keep.sum())}[reduction]
    torch.testing.assert_close(loss.detach(), want[0])
    torch.testing.assert_close(z, want[1])
    assert not z.requires_grad  # for logging only, as in flash-attn
    losses, z_losses = cross_entropy_loss(x, y, precomputed_lse=torch.logsumexp(x, -1).detach())
    torch.testing.assert_close(losses, torch.nn.functional.cross_entropy(x, y, reduction="none"))
    assert losses.dtype == torch.float32 and float(losses[1].detach()) == 0.0 and bool((z_losses == 0).all())
    losses.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(
        torch.nn.functional.cross_entropy(x, y, reduction="sum"), x)[0])


def test_cross_entropy_bad_input():
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="'labels'"):
        cross_entropy_loss(torch.randn(3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="'logits'"):
        cross_entropy_loss(torch.randn(3), torch.zeros(3, dtype=torch.long))

    class Group:
        def size(self):
            return 2

    with pytest.raises(ValueError, match="process_group"):
        cross_entropy_loss(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), process_group=Group())
