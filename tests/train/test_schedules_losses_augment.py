"""Schedules against their formulas, losses against the guide's definitions, and mixup/cutmix label mixing."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastarch import train as T


def test_step_and_cosine_decay_functions():
    f = T.step_decay_schedule(1e-3, 0.75, 10)
    assert [f(e) for e in (0, 9, 10, 25)] == pytest.approx([1e-3, 1e-3, 7.5e-4, 1e-3 * 0.75**2])
    c = T.cosine_decay_schedule(2.0, 100)
    assert c(0) == pytest.approx(2.0) and c(50) == pytest.approx(1.0) and c(100) == pytest.approx(0.0, abs=1e-12)


def test_torch_scheduler_versions_follow_the_same_formulas():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = T.StepDecayLR(opt, 0.5, 3)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert lrs == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25])
    opt = torch.optim.SGD([p], lr=1.0)
    s = T.CosineDecayLR(opt, 10)
    for t in range(12):
        assert opt.param_groups[0]["lr"] == pytest.approx((1 + math.cos(math.pi * min(t, 10) / 10)) / 2, abs=1e-12)
        opt.step()
        s.step()
    opt = torch.optim.SGD([p], lr=2.0)
    s = T.LinearWarmupLR(opt, 4)
    for t in range(6):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * min(1, t / 4))
        opt.step()
        s.step()


def test_cosine_annealing_warmup_guide_api():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    s = T.CosineAnnealingWarmup(opt, warmup_steps=10, max_steps=110, lr_max=1e-3, lr_min=1e-5)
    assert s.step(5) == pytest.approx(5e-4) and opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert s.get_lr(10) == pytest.approx(1e-3)
    assert s.get_lr(60) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert s.get_lr(110) == pytest.approx(1e-5)
    st = s.state_dict()
    s2 = T.CosineAnnealingWarmup(opt, 1, 2, 1.0)
    s2.load_state_dict(st)
    assert s2.step() == pytest.approx(s.get_lr(6))
    with pytest.raises(ValueError):
        T.CosineAnnealingWarmup(opt, warmup_steps=10, max_steps=5, lr_max=1.0)


def _guide_contrastive(f1, f2, t):
    b = f1.shape[0]
    f = torch.cat([F.normalize(f1, dim=1), F.normalize(f2, dim=1)], 0)
    sim = f @ f.T / t
    labels = torch.cat([torch.arange(b) + b, torch.arange(b)])
    sim = sim.masked_fill(torch.eye(2 * b, dtype=torch.bool), -1e9)
    return F.cross_entropy(sim, labels)


def test_losses_match_guide():
    f1, f2 = torch.randn(6, 8), torch.randn(6, 8)
    torch.testing.assert_close(T.ContrastiveLoss(0.1)(f1, f2), _guide_contrastive(f1, f2, 0.1))
    logits, y = torch.randn(10, 5), torch.randint(0, 5, (10,))
    ce = F.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(T.FocalLoss(0.25, 2.0)(logits, y), (0.25 * (1 - torch.exp(-ce)) ** 2 * ce).mean())
    assert T.FocalLoss(reduction="none")(logits, y).shape == (10,)
    smooth = torch.full((10, 5), 0.1 / 4).scatter_(1, y[:, None], 0.9)
    torch.testing.assert_close(T.LabelSmoothingLoss(5, 0.1)(logits, y),
                               (-(smooth * logits.log_softmax(-1)).sum(-1)).mean())
    with pytest.raises(ValueError):
        T.FocalLoss(reduction="avg")
    with pytest.raises(ValueError):
        T.ContrastiveLoss()(torch.randn(3, 4), torch.randn(4, 4))


def test_mixup_labels_mix_with_the_inputs():
    # Each input row is its class index repeated, so the mixed input reveals lam and the partner.
    x = torch.arange(8.0)[:, None].repeat(1, 3)
    y = F.one_hot(torch.arange(8), 8).float()
    mix = T.RandomMixup(alpha=0.4, generator=torch.Generator().manual_seed(3))
    mx, my = mix(x, y)
    lam = mix.last_lam
    assert 0 <= lam <= 1
    torch.testing.assert_close(my.sum(1), torch.ones(8))
    # Recover the partner index j of each row from the labels and check the input used the same j and lam.
    for i in range(8):
        others = [j for j in range(8) if j != i and my[i, j] > 0]
        j = others[0] if others else i
        torch.testing.assert_close(mx[i], lam * x[i] + (1 - lam) * x[j])
        if j != i:
            assert my[i, i].item() == pytest.approx(lam, abs=1e-6)


def test_cutmix_label_weight_equals_pasted_area():
    x = torch.arange(4.0)[:, None, None, None].expand(4, 1, 16, 16).contiguous()
    y = F.one_hot(torch.arange(4), 4).float()
    cut = T.RandomCutmix(alpha=1.0, generator=torch.Generator().manual_seed(5))
    for _ in range(5):
        mx, my = cut(x, y)
        for i in range(4):
            own = (mx[i] == i).float().mean().item()
            if my[i].max() < 1:  # the pasted partner is a different image
                assert my[i, i].item() == pytest.approx(own, abs=1e-6)
            torch.testing.assert_close(my[i].sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"\(batch, C, H, W\)"):
        cut(torch.randn(4, 16), y)


def test_utils():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert T.count_parameters(m) == 3 * 4 + 4 + 4 * 2 + 2
    assert T.freeze_layers(m, "1.weight", verbose=False) == 4 * 2 + 2
    assert not m[0].weight.requires_grad and m[1].weight.requires_grad
    with pytest.raises(ValueError):
        T.freeze_layers(m, "nope", verbose=False)
    for p in m.parameters():
        p.requires_grad_(True)
    m(torch.randn(5, 3)).sum().backward()
    ref = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in m.parameters()))
    assert T.get_gradient_norm(m) == pytest.approx(ref, rel=1e-5)
    es = T.EarlyStopping(patience=2)
    assert [es(v) for v in (1.0, 0.9, 0.95, 0.92)] == [False, False, False, True]
