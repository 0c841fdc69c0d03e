import pytest
import torch

from fastarch.generation import (
    RepetitionPenaltyController,
    apply_penalties,
    min_p_filter,
    process_logits,
    sample_from_logits,
    token_counts,
    top_k_filter,
    top_p_decode,
    top_p_filter,
)


class GuideController:
    """The guide-003 RepetitionPenaltyController, verbatim semantics, as the oracle."""

    def __init__(self):
        self.token_counts, self.token_presence = {}, set()

    def update(self, t):
        self.token_counts[t] = self.token_counts.get(t, 0) + 1
        self.token_presence.add(t)

    def apply_penalties(self, logits, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0):
        m = logits.clone()
        if frequency_penalty != 0.0:
            for t, c in self.token_counts.items():
                m[t] -= frequency_penalty * c
        if presence_penalty != 0.0:
            for t in self.token_presence:
                m[t] -= presence_penalty
        if repetition_penalty != 1.0:
            for t in self.token_presence:
                if m[t] > 0:
                    m[t] /= repetition_penalty
                else:
                    m[t] *= repetition_penalty
        return m


@pytest.mark.parametrize("fp,pp,rp", [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (0.3, 0.4, 1.5),
                                      (0.2, -0.1, 0.8)])
def test_penalties_match_guide_semantics(fp, pp, rp):
    V, B = 12, 3
    logits = torch.randn(B, V) * 3
    hist = torch.randint(0, V, (B, 9))
    counts = token_counts(hist, V)
    out = apply_penalties(logits, counts, repetition_penalty=rp, frequency_penalty=fp, presence_penalty=pp)
    for b in range(B):
        g = GuideController()
        ours = RepetitionPenaltyController(V)
        for t in hist[b].tolist():
            g.update(t)
            ours.update(t)
        ref = g.apply_penalties(logits[b], fp, pp, rp)
        torch.testing.assert_close(out[b], ref)
        torch.testing.assert_close(ours.apply_penalties(logits[b], fp, pp, rp), ref)
        assert ours.token_counts == g.token_counts and ours.token_presence == g.token_presence


def test_token_counts_ignores_negative_padding():
    c = token_counts(torch.tensor([[1, 1, -1, 3]]), 5)
    assert c.tolist() == [[0, 2, 0, 1, 0]]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_never_samples_outside_top_k(k):
    torch.manual_seed(0)
    logits = torch.randn(16, 30)
    filt = top_k_filter(logits, k)
    assert ((filt > float("-inf")).sum(-1) == k).all()
    g = torch.Generator().manual_seed(1)
    topk = logits.topk(k).indices
    for _ in range(50):
        s = sample_from_logits(filt, g)
        assert (s[:, None] == topk).any(-1).all()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_kept_mass_at_least_p_and_minimal(p):
    torch.manual_seed(1)
    logits = torch.randn(32, 40) * 2
    probs = logits.softmax(-1)
    keep = top_p_filter(logits, p) > float("-inf")
    kept_mass = (probs * keep).sum(-1)
    assert (kept_mass >= p - 1e-6).all()
    # minimal: dropping the least likely kept token would fall below p
    smallest_kept = torch.where(keep, probs, torch.full_like(probs, 2.0)).min(-1).values
    assert (kept_mass - smallest_kept < p + 1e-6).all()
    # kept tokens are the most likely ones
    largest_dropped = torch.where(keep, torch.full_like(probs, -1.0), probs).max(-1).values
    assert (largest_dropped <= smallest_kept).all()
    g = torch.Generator().manual_seed(2)
    filt = top_p_filter(logits, p)
    for _ in range(20):
        s = sample_from_logits(filt, g)
        assert keep.gather(1, s[:, None]).all()


def test_top_p_fixes_guide_cutoff():
    # Two equally likely tokens and p=0.9: the guide keeps one (mass 0.5 < p); we keep both.
    logits = torch.tensor([[0.0, 0.0, -30.0]])
    assert (top_p_filter(logits, 0.9) > float("-inf")).sum() == 2
    g = torch.Generator().manual_seed(0)
    seen = {top_p_decode(logits[0], p=0.9, generator=g) for _ in range(40)}
    assert seen == {0, 1}


def test_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = min_p_filter(logits, 0.2) > float("-inf")  # threshold 0.1
    assert keep.tolist() == [[True, True, True, False]]


def test_process_logits_order_and_validation():
    logits = torch.randn(2, 10)
    out = process_logits(logits, temperature=0.5, top_k=3)
    ref = top_k_filter(logits / 0.5, 3)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(logits, 0)
    with pytest.raises(ValueError, match="min_p"):
        min_p_filter(logits, 1.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        apply_penalties(logits, torch.zeros(2, 10, dtype=torch.long), repetition_penalty=0.0)


def test_sampling_distribution_follows_temperature():
    # A chi-square-free check: empirical frequencies within 4 sigma of softmax(logits / T).
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    g = torch.Generator().manual_seed(3)
    T = 0.7
    n = 4000
    draws = sample_from_logits(process_logits(logits.expand(n, -1), temperature=T), g)
    freq = torch.bincount(draws, minlength=4).float() / n
    p = (logits[0] / T).softmax(-1)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 4 * sigma).all()
