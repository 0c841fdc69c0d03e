import threading

import pytest
import torch

import fastarch.nn
from fastarch.generation import CallbackStreamer, TokenIteratorStreamer, generate, generate_stream

from ._models import TinyGPT, TinyRecurrentLM, op_attention


def _greedy_reference(model, ids, n, eos=None):
    """Plain loop: full forward, argmax of the last position."""
    out = ids
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(n):
            tok = model(out)[:, -1].argmax(-1)
            if eos is not None:
                tok = torch.where(finished, torch.full_like(tok, eos), tok)
                finished |= tok == eos
            out = torch.cat([out, tok[:, None]], 1)
            if eos is not None and finished.all():
                break
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_cached_greedy_equals_uncached_gpt(window):
    torch.manual_seed(1)
    model = TinyGPT(window=window).eval()
    ids = torch.randint(0, 13, (3, 5))
    cached = generate(model, ids, 12, use_cache=True)
    calls = model.forward_calls
    uncached = generate(model, ids, 12, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, _greedy_reference(model, ids, 12))
    assert cached.shape == (3, 17) and torch.equal(cached[:, :5], ids)
    assert calls == 12  # one prefill + 11 single-token steps (the last token needs no forward)


def test_cached_greedy_equals_uncached_with_op_attention():
    torch.manual_seed(2)
    model = TinyGPT(attn=op_attention).eval()
    ids = torch.randint(0, 13, (2, 4))
    assert torch.equal(generate(model, ids, 12), generate(model, ids, 12, use_cache=False))


def test_cached_greedy_equals_uncached_recurrent():
    torch.manual_seed(3)
    model = TinyRecurrentLM().eval()
    ids = torch.randint(0, 11, (2, 6))
    cached = generate(model, ids, 15)
    assert torch.equal(cached, generate(model, ids, 15, use_cache=False))
    assert torch.equal(cached, _greedy_reference(model, ids, 15))


GPT_CONFIGS = {
    "GPTTransformer": dict(vocab_size=31, d_model=32, n_heads=4, num_layers=2, d_ff=64, max_len=32, dropout=0.0),
    "GPTModel": dict(vocab_size=31, embed_dim=32, num_heads=4, num_layers=2, ff_dim=64, max_len=32, dropout=0.0),
}


@pytest.mark.parametrize("name", sorted(GPT_CONFIGS))
def test_cached_equals_uncached_real_gpt(name):
    cls = getattr(fastarch.nn, name)
    torch.manual_seed(0)
    model = cls(**GPT_CONFIGS[name]).eval()
    ids = torch.randint(0, 31, (2, 5))
    cached = generate(model, ids, 10)
    assert torch.equal(cached, generate(model, ids, 10, use_cache=False))
    assert torch.equal(cached, _greedy_reference(model, ids, 10))
    beams = generate(model, ids, 6, strategy="beam", num_beams=3)
    assert torch.equal(beams, generate(model, ids, 6, strategy="beam", num_beams=3, use_cache=False))


def test_cached_equals_uncached_real_mamba():
    torch.manual_seed(0)
    model = fastarch.nn.MambaLM(vocab_size=29, d_model=16, n_layers=2).eval()
    ids = torch.randint(0, 29, (2, 5))
    cached = generate(model, ids, 8)
    assert torch.equal(cached, generate(model, ids, 8, use_cache=False))
    assert torch.equal(cached, _greedy_reference(model, ids, 8))
    beams = generate(model, ids, 5, strategy="beam", num_beams=3)
    assert torch.equal(beams, generate(model, ids, 5, strategy="beam", num_beams=3, use_cache=False))


def test_eos_stops_and_pads():
    torch.manual_seed(4)
    model = TinyGPT().eval()
    ids = torch.randint(0, 13, (4, 3))
    free = generate(model, ids, 12)
    eos = int(free[0, 5])  # a token that row 0 emits
    out = generate(model, ids, 12, eos_token_id=eos, pad_token_id=12)
    ref = _greedy_reference(model, ids, 12, eos=eos)
    for b in range(4):
        new = out[b, 3:].tolist()
        gen_ref = free[b, 3:].tolist()
        if eos in gen_ref:
            j = gen_ref.index(eos)
            assert new[:j + 1] == gen_ref[:j + 1] and all(t == 12 for t in new[j + 1:])
        else:
            assert new == gen_ref[:len(new)]
    assert out.shape[1] == ref.shape[1]
    all_eos = generate(model, ids[:1], 12, eos_token_id=int(free[0, 3]))
    assert all_eos.shape == (1, 4)  # stopped right after the first token


def test_sampling_is_seeded_and_streams():
    torch.manual_seed(5)
    model = TinyGPT().eval()
    ids = torch.randint(0, 13, (2, 3))
    kw = dict(strategy="sample", temperature=0.9, top_k=5, top_p=0.9, min_p=0.05)
    a = generate(model, ids, 10, generator=torch.Generator().manual_seed(7), **kw)
    seen = []
    b = generate(model, ids, 10, generator=torch.Generator().manual_seed(7), streamer=seen.append, **kw)
    assert torch.equal(a, b)
    assert torch.equal(torch.stack(seen, 1), a[:, 3:])
    ended = []
    generate(model, ids, 4, streamer=CallbackStreamer(lambda t: None, lambda: ended.append(True)))
    assert ended == [True]
    # iterator streaming from a background thread
    streamer = TokenIteratorStreamer(timeout=30)
    th = threading.Thread(target=generate, args=(model, ids, 6), kwargs={"streamer": streamer})
    th.start()
    toks = list(streamer)
    th.join()
    assert torch.equal(torch.stack(toks, 1), generate(model, ids, 6)[:, 3:])
    assert torch.equal(torch.stack(list(generate_stream(model, ids, 6)), 1), generate(model, ids, 6)[:, 3:])


def test_sampled_tokens_respect_top_k():
    torch.manual_seed(6)
    model = TinyGPT().eval()
    ids = torch.randint(0, 13, (64, 3))
    out = generate(model, ids, 1, strategy="sample", top_k=2, temperature=3.0,
                   generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        top2 = model(ids)[:, -1].topk(2).indices
    assert (out[:, -1:] == top2).any(-1).all()


def test_repetition_penalty_changes_greedy():
    torch.manual_seed(8)
    model = TinyGPT(vocab_size=7).eval()
    ids = torch.randint(0, 7, (2, 3))
    out = generate(model, ids, 6, presence_penalty=1e4)
    # with a huge presence penalty, no generated token repeats while unused tokens remain
    for row in out.tolist():
        new = row[3:]
        used = set(row[:3])
        for t in new:
            if len(used) < 7:
                assert t not in used
            used.add(t)


def test_bad_arguments():
    model = TinyGPT().eval()
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="strategy"):
        generate(model, ids, 3, strategy="nucleus")
    with pytest.raises(ValueError, match="input_ids"):
        generate(model, ids.float(), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, ids, 3, strategy="sample", temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, ids, 3, strategy="sample", top_p=1.5)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(model, ids, 3, eos_token_id="x")
    assert torch.equal(generate(model, ids, 0), ids)


def test_text_streamer_decodes_incrementally():
    from fastarch.generation import TextStreamer
    from fastarch.tokenizers import BPETokenizer

    tok = BPETokenizer(40)
    tok.train(["low lower lowest new newer newest"] * 3)
    pieces = []
    streamer = TextStreamer(tok, pieces.append)
    ids = tok.encode("lower newest low", add_special_tokens=False)
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert "".join(pieces) == tok.decode(ids) == "lower newest low"
    assert len(pieces) >= 2  # emitted word by word, not only at the end
    with pytest.raises(ValueError, match="one sequence"):
        streamer.put(torch.tensor([1, 2]))
