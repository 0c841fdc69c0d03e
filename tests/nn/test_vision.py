"""ViT (guides 000/001), Swin (guide 001 + relative position bias and shifted-window mask through the
attention op's attn_bias), CLIP and the multi-modal transformer."""

import pytest
import torch
import torch.nn.functional as F

import fastarch.nn as fnn
from fastarch.nn.swin import _shift_mask
from fastarch.testing import guides as G
from fastarch.testing.dropin import assert_dropin, assert_trains

IMG = torch.randn(2, 3, 32, 32)


def test_vit_dropin_both_guides():
    assert_dropin(fnn.VisionTransformer(32, 8, 3, 5, 32, 2, 4), G.VisionTransformer(32, 8, 3, 5, 32, 2, 4), IMG)
    assert_dropin(fnn.VisionTransformer001(32, 8, 3, 5, 32, 4, 2, 64), G.VisionTransformer001(32, 8, 3, 5, 32, 4, 2, 64),
                  IMG)


@pytest.mark.parametrize("shift", [0, 2])
def test_swin_block_guide_defaults_dropin(shift):
    x = torch.randn(2, 64, 16)
    assert_dropin(fnn.SwinTransformerBlock(16, 2, 4, shift), G.SwinTransformerBlock001(16, 2, 4, shift), x, 8, 8)
    assert_dropin(fnn.WindowAttention(16, 4, 2), G.WindowAttention001(16, 4, 2), torch.randn(3, 16, 16))


def _window_attention_reference(m: fnn.WindowAttention, x: torch.Tensor, mask: torch.Tensor | None):
    """The official Swin formula with an explicit softmax."""
    bw, n, c = x.shape
    h = m.num_heads
    qkv = m.qkv(x).reshape(bw, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * m.scale, qkv[1], qkv[2]
    attn = q @ k.transpose(-2, -1)
    idx = m.relative_position_index.reshape(-1)
    bias = m.relative_position_bias_table[idx].view(n, n, -1).permute(2, 0, 1)
    attn = attn + bias.unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        attn = attn.view(bw // nw, nw, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, h, n, n)
    attn = attn.softmax(-1)
    return m.proj((attn @ v).transpose(1, 2).reshape(bw, n, c))


def test_window_attention_bias_and_mask_through_op_equal_reference():
    m = fnn.WindowAttention(16, 4, 2, relative_position_bias=True)
    with torch.no_grad():
        m.relative_position_bias_table.normal_(0, 1)
    mask = _shift_mask(8, 8, 4, 2, torch.device("cpu"))  # 4 windows
    x = torch.randn(2 * 4, 16, 16, requires_grad=True)
    for msk in (None, mask):
        out, ref = m(x, msk), _window_attention_reference(m, x, msk)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        g1 = torch.autograd.grad(out.square().sum(), [x, m.relative_position_bias_table])
        g2 = torch.autograd.grad(ref.square().sum(), [x, m.relative_position_bias_table])
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_shifted_windows_do_not_mix_regions():
    # With the mask, a token's output must not depend on tokens that were wrapped around by the roll.
    blk = fnn.SwinTransformerBlock(8, 2, 4, 2, relative_position_bias=True, shift_mask=True).eval()
    x = torch.randn(1, 64, 8)
    y = blk(x, 8, 8)
    x2 = x.clone().view(1, 8, 8, 8)
    x2[:, 0, 0] += 5.0  # top-left token; after the shift it shares a window with the bottom-right corner
    y2 = blk(x2.view(1, 64, 8), 8, 8).view(1, 8, 8, 8)
    assert torch.allclose(y.view(1, 8, 8, 8)[:, 7, 7], y2[:, 7, 7], atol=1e-6)


def test_swin_model_shapes_padding_and_training():
    m = fnn.SwinTransformer(patch_size=2, num_classes=3, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4)
    assert m(torch.randn(1, 3, 20, 28)).shape == (1, 3)  # not a multiple of the window: padded
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    assert_trains(m, lambda mod: F.cross_entropy(mod(x), y), steps=6)


def test_patch_merging():
    pm = fnn.PatchMerging(4)
    out, h, w = pm(torch.randn(2, 35, 4), 5, 7)
    assert (h, w) == (3, 4) and out.shape == (2, 12, 8)


def test_vit_training_and_errors():
    m = fnn.VisionTransformer(32, 8, 3, 3, 32, 1, 4, dropout=0.0)
    y = torch.tensor([0, 2])
    assert_trains(m, lambda mod: F.cross_entropy(mod(IMG), y), steps=6)
    with pytest.raises(ValueError, match="'x'"):
        m(torch.randn(1, 3, 16, 16))


def test_clip_dropin_and_loss():
    ours = fnn.CLIPVisionEncoder(32, 8, 32, 1, 4)
    assert_dropin(ours, G.CLIPVisionEncoder(32, 8, 32, 1, 4), IMG)
    assert_dropin(fnn.CLIPTextEncoder(64, 32, 10, 1, 4), G.CLIPTextEncoder(64, 32, 10, 1, 4),
                  torch.randint(0, 64, (2, 10)))
    clip = fnn.CLIP(32, 1, 1, 4, 4, 64, img_size=32, patch_size=8, context_length=10)
    img, txt = torch.randn(4, 3, 32, 32), torch.randint(0, 64, (4, 10))
    li, lt = clip(img, txt)
    assert li.shape == (4, 4) and torch.equal(li, lt.t())
    labels = torch.arange(4)
    expect = (F.cross_entropy(li, labels) + F.cross_entropy(lt, labels)) / 2
    torch.testing.assert_close(clip.contrastive_loss(li, lt), expect)
    assert_trains(clip, lambda mod: mod.contrastive_loss(*mod(img, txt)), steps=6, lr=3e-3)


def test_multimodal_dropin_and_training():
    v, t = torch.randn(2, 5, 24), torch.randint(0, 40, (2, 7))
    assert_dropin(fnn.MultiModalTransformer(24, 40, 32, 4, 1, 3), G.MultiModalTransformer(24, 40, 32, 4, 1, 3), v, t)
    assert_dropin(fnn.CrossModalAttention(32, 4), G.CrossModalAttention(32, 4), torch.randn(2, 5, 32),
                  torch.randn(2, 7, 32))
    m = fnn.MultiModalTransformer(24, 40, 32, 4, 1, 3)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    y = torch.tensor([0, 2])
    assert_trains(m, lambda mod: F.cross_entropy(mod(v, t), y), steps=6, lr=3e-3)
