import itertools

import pytest
import torch
import torch.nn.functional as F

from fastarch.generation import BeamSearch, beam_search, generate

from ._models import TableLM, TinyGPT, TinyRecurrentLM


def _seq_logprob(model, prompt, toks):
    ids = torch.tensor([prompt + list(toks)])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).double(), -1)[0]
    L = len(prompt)
    return sum(float(logp[L - 1 + i, t]) for i, t in enumerate(toks))


def _brute_force(model, prompt, V, n, eos, lp):
    """Best complete hypothesis: ends in EOS at any length <= n, or has n tokens without EOS."""
    best, best_seq = float("-inf"), None
    for length in range(1, n + 1):
        for toks in itertools.product(range(V), repeat=length):
            if eos in toks[:-1]:
                continue
            if length < n and toks[-1] != eos:
                continue
            s = _seq_logprob(model, prompt, toks) / (length ** lp)
            if s > best + 1e-12:
                best, best_seq = s, list(toks)
    return best_seq, best


@pytest.mark.parametrize("lp", [0.0, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_beam_search_matches_brute_force(lp, seed):
    V, n, eos = 4, 3, 3
    model = TableLM(V, seed=seed).eval()
    prompts = [[0, 1], [2, 2]]
    out, scores = beam_search(model, torch.tensor(prompts), n, num_beams=V ** n, eos_token_id=eos,
                              length_penalty=lp, early_stopping="never", use_cache=False, return_scores=True)
    for b, prompt in enumerate(prompts):
        seq, best = _brute_force(model, prompt, V, n, eos, lp)
        got = out[b, 2:].tolist()
        assert got[:len(seq)] == seq and all(t == eos for t in got[len(seq):])
        assert abs(float(scores[b]) - best) < 1e-9


def test_beam_width_one_is_greedy_and_cache_agrees():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    ids = torch.randint(0, 13, (3, 4))
    assert torch.equal(beam_search(model, ids, 8, num_beams=1), generate(model, ids, 8))
    a = generate(model, ids, 8, strategy="beam", num_beams=4)
    b = generate(model, ids, 8, strategy="beam", num_beams=4, use_cache=False)
    assert torch.equal(a, b)
    rec = TinyRecurrentLM().eval()
    ids = torch.randint(0, 11, (2, 3))
    assert torch.equal(generate(rec, ids, 6, strategy="beam", num_beams=3),
                       generate(rec, ids, 6, strategy="beam", num_beams=3, use_cache=False))


def test_beam_score_not_worse_than_greedy():
    torch.manual_seed(1)
    model = TinyGPT().eval()
    ids = torch.randint(0, 13, (4, 3))
    greedy = generate(model, ids, 5)
    beams, scores = beam_search(model, ids, 5, num_beams=5, length_penalty=0.0, return_scores=True)
    for b in range(4):
        g = _seq_logprob(model, ids[b].tolist(), greedy[b, 3:].tolist())
        assert float(scores[b]) >= g - 1e-9
        assert abs(_seq_logprob(model, ids[b].tolist(), beams[b, 3:].tolist()) - float(scores[b])) < 1e-6


def test_num_return_sequences_sorted_and_early_stopping():
    model = TableLM(5, seed=3).eval()
    ids = torch.tensor([[0, 1]])
    out, scores = beam_search(model, ids, 4, num_beams=4, eos_token_id=2, num_return_sequences=3,
                              return_scores=True)
    assert out.shape[0] == 3 and (scores[:-1] >= scores[1:]).all()
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(model, ids, 4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="num_return_sequences"):
        beam_search(model, ids, 4, num_beams=2, num_return_sequences=3)


def _guide_search(initial_logits, fn, beam_width, max_length, start_token, end_token):
    """The guide-003 loop, as the oracle for the vectorised search()."""
    completed = []
    log_probs = F.log_softmax(initial_logits.double(), dim=-1)
    top_lp, top_i = torch.topk(log_probs, beam_width)
    beams = [([start_token, int(top_i[i])], float(top_lp[i])) for i in range(beam_width)]
    for _ in range(max_length - 1):
        if not beams:
            break
        cands = []
        for seq, sc in beams:
            if seq[-1] == end_token:
                completed.append((seq, sc))
                continue
            nl = F.log_softmax(fn(seq).double(), dim=-1)
            for t in range(nl.size(0)):
                cands.append((seq + [t], sc + float(nl[t])))
        cands.sort(key=lambda x: x[1], reverse=True)
        beams = cands[:beam_width]
        nb = []
        for seq, sc in beams:
            (completed if seq[-1] == end_token else nb).append((seq, sc))
        beams = nb
    completed.extend(beams)
    completed.sort(key=lambda x: x[1], reverse=True)
    return completed


@pytest.mark.parametrize("width,max_len", [(1, 4), (3, 4), (5, 3)])
def test_guide_search_api_matches_guide(width, max_len):
    g = torch.Generator().manual_seed(width)
    table = torch.randn(6, 6, generator=g) * 2

    def fn(seq):
        return table[seq[-1]]

    ours = BeamSearch(width, max_len).search(table[0], fn, start_token=0, end_token=1)
    ref = _guide_search(table[0], fn, width, max_len, 0, 1)
    assert [s for s, _ in ours] == [s for s, _ in ref]
    for (_, a), (_, b) in zip(ours, ref):
        assert abs(a - b) < 1e-9


def test_guide_search_exhaustive_equals_brute_force():
    V, max_len = 3, 3
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=g)

    def fn(seq):
        return table[seq[-1]]

    res = BeamSearch(V ** max_len, max_len).search(table[0], fn, start_token=0, end_token=1)
    best_seq, best = None, float("-inf")
    for toks in itertools.product(range(V), repeat=max_len):
        if 1 in toks[:-1]:
            k = toks.index(1) + 1
            toks = toks[:k]
        seq = [0, *toks]
        s = sum(float(F.log_softmax(table[seq[i]].double(), -1)[seq[i + 1]]) for i in range(len(seq) - 1))
        if s > best:
            best, best_seq = s, seq
    assert res[0][0] == best_seq and abs(res[0][1] - best) < 1e-9


def test_beam_rejects_sampling_arguments():
    model = TableLM(4).eval()
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(model, torch.tensor([[0, 1]]), 3, strategy="beam", num_beams=2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="streamer"):
        generate(model, torch.tensor([[0, 1]]), 3, strategy="beam", num_beams=2, streamer=print)
