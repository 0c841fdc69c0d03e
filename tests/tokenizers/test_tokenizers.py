import itertools
import json
import math
import os
import random
from collections import Counter

import pytest

from fastarch.tokenizers import (
    BPETokenizer,
    TokenizerFileError,
    UnigramTokenizer,
    WordPieceTokenizer,
    load_tokenizer,
)
from fastarch.tokenizers import io as tio


def _corpus(n_lines=60, seed=0):
    rng = random.Random(seed)
    words = ["low", "lower", "lowest", "newer", "newest", "wider", "widest", "the", "a", "tokenizer", "token",
             "hug", "hugs", "pug", "pun", "bun", "sun", "sunny", "funny", "run", "running", "Café", "naïve"]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    return [" ".join(rng.choices(words, weights, k=rng.randint(3, 12))) for _ in range(n_lines)]


def _naive_bpe(texts, num_merges):
    """Recount-every-merge reference with the same tie-breaking (highest count, then smallest pair)."""
    freq = Counter(w for t in texts for w in t.lower().split())
    words = {tuple(list(w[:-1]) + [w[-1] + "</w>"]): c for w, c in freq.items()}
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    return merges


def _apply_in_order(word, merges):
    """The guide's encode: apply every merge in training order, left to right."""
    toks = list(word[:-1]) + [word[-1] + "</w>"]
    for a, b in merges:
        i = 0
        while i < len(toks) - 1:
            if toks[i] == a and toks[i + 1] == b:
                toks = toks[:i] + [a + b] + toks[i + 2:]
            else:
                i += 1
    return toks


@pytest.mark.parametrize("num_merges", [1, 10, 40, 200])
def test_bpe_incremental_matches_full_recount(num_merges):
    texts = _corpus()
    tok = BPETokenizer()
    tok.train(texts, num_merges=num_merges)
    assert tok.merges == _naive_bpe(texts, num_merges)
    for w in set(" ".join(texts).lower().split()) | {"lowly", "newbun"}:
        assert tok._bpe(w) == _apply_in_order(w, tok.merges)


def test_bpe_round_trip_unknown_and_specials():
    texts = _corpus()
    tok = BPETokenizer(120, bos_token="<s>", eos_token="</s>")
    tok.train(texts)
    assert len(tok) <= 120 and tok.vocab_size == 120
    text = "the  Lowest\tsunny token"
    ids = tok.encode(text)
    assert ids[0] == tok.vocab["<s>"] and ids[-1] == tok.vocab["</s>"]
    assert tok.decode(ids) == "the lowest sunny token"
    # the BPE decoder joins specials as the tokenizers library does
    assert tok.decode(ids, skip_special_tokens=False) == "<s>the lowest sunny token </s>"
    assert tok.tokenize("the") == ["the</w>"]
    unk = tok.vocab["<unk>"]
    assert unk in tok.encode("zzz", add_special_tokens=False)
    assert tok.encode("the <s> the", add_special_tokens=False).count(tok.vocab["<s>"]) == 1
    with pytest.raises(ValueError, match="not trained"):
        BPETokenizer().encode("x")
    with pytest.raises(ValueError, match="vocab_size"):
        BPETokenizer(0)


def _best_ratio_pair(texts):
    freq = Counter(w for t in texts for w in WordPieceTokenizer().basic.tokenize(t))
    sym, pairs = Counter(), Counter()
    for w, c in freq.items():
        s = [w[0]] + ["##" + ch for ch in w[1:]]
        for x in s:
            sym[x] += c
        for p in zip(s, s[1:]):
            pairs[p] += c
    return max(pairs, key=lambda p: (pairs[p] / (sym[p[0]] * sym[p[1]]), pairs[p]))


def test_wordpiece_training_uses_likelihood_ratio():
    # "xq" is rare but x and q only ever occur together: ratio-best; the frequent pair "th" is not.
    texts = ["the then them this that those " * 5, "xq"]
    tok = WordPieceTokenizer(vocab_size=1000)
    tok.train(texts)
    first = tok.merges[0]
    assert first == _best_ratio_pair(texts) == ("x", "##q")
    assert "xq" in tok.vocab
    ids = tok.encode("the xq")
    assert tok.decode(ids) == "the xq"
    small = WordPieceTokenizer(vocab_size=60)
    small.train(_corpus())
    assert len(small) == 60


def _segment_brute(word, logp, L):
    best, best_seg = -math.inf, None
    n = len(word)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        seg, s = [], 0
        for i, c in enumerate(cuts, 1):
            if c:
                seg.append(word[s:i])
                s = i
        seg.append(word[s:])
        if all(p in logp and len(p) <= L for p in seg):
            sc = sum(logp[p] for p in seg)
            if sc > best:
                best, best_seg = sc, seg
    return best_seg, best


def test_unigram_training_viterbi_and_round_trip():
    texts = _corpus(80)
    tok = UnigramTokenizer(vocab_size=60)
    tok.train(texts)
    chars = set("".join("\u2581" + w for t in texts for w in t.lower().split()))
    assert chars <= set(tok.vocab)  # every character survives pruning
    assert len(tok) <= 60 + 2
    probs = tok.token_probs
    assert abs(sum(probs.values()) - 1.0) < 1e-6
    for w in ["\u2581lowest", "\u2581sunny", "\u2581tokenizer", "\u2581bunny"]:
        seg, score = tok._viterbi(w, tok._logp)
        ref, ref_score = _segment_brute(w, tok._logp, tok.max_piece_length)
        assert abs(score - ref_score) < 1e-9 and "".join(seg) == w
    text = "the lowest  Running token"
    assert tok.decode(tok.encode(text)) == "the lowest running token"
    unk = tok.vocab["<UNK>"]
    assert tok.encode("the qj").count(unk) == 1  # q, j never seen: adjacent unknowns fuse into one unk
    # EM + pruning beats the seed-frequency model on its own corpus
    seed_model = UnigramTokenizer(vocab_size=60, em_iterations=0)
    seed_model.train(texts)
    assert tok.calculate_loss(texts) <= seed_model.calculate_loss(texts)


def _trained(kind):
    texts = _corpus()
    tok = {"bpe": BPETokenizer(80), "wordpiece": WordPieceTokenizer(80), "unigram": UnigramTokenizer(50)}[kind]
    tok.train(texts)
    return tok, texts


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_save_load_exact_round_trip(kind, tmp_path):
    tok, texts = _trained(kind)
    p = tmp_path / "tok.json"
    tok.save(p)
    back = type(tok).load(p)
    assert back.vocab == tok.vocab and back.special_tokens == tok.special_tokens
    for t in texts[:10] + ["unseen zzz words"]:
        assert back.encode(t) == tok.encode(t)
        assert back.decode(back.encode(t)) == tok.decode(tok.encode(t))
    p2 = tmp_path / "again.json"
    back.save(p2)
    assert p.read_bytes() == p2.read_bytes()
    assert type(load_tokenizer(p)) is type(tok)
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")] == []


def test_atomic_save_keeps_old_file_on_failure(tmp_path, monkeypatch):
    tok, _ = _trained("bpe")
    p = tmp_path / "tok.json"
    tok.save(p)
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tio.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        tok.save(p)
    assert p.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")] == []


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_malformed_files(kind, tmp_path):
    tok, _ = _trained(kind)
    cls = type(tok)
    p = tmp_path / "t.json"
    with pytest.raises(TokenizerFileError, match="no such"):
        cls.load(tmp_path / "missing.json")
    p.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="not valid JSON"):
        cls.load(p)
    p.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="JSON object"):
        cls.load(p)
    tok.save(p)
    good = json.loads(p.read_text(encoding="utf-8"))

    def bad(mutate, match):
        d = json.loads(json.dumps(good))
        mutate(d)
        p.write_text(json.dumps(d), encoding="utf-8")
        with pytest.raises(TokenizerFileError, match=match):
            cls.load(p)

    bad(lambda d: d.pop("vocab"), "missing field 'vocab'")
    bad(lambda d: d.update(vocab="abc"), "'vocab' must be")
    bad(lambda d: d.update(vocab=d["vocab"] + [d["vocab"][0]]), "duplicate")
    bad(lambda d: d.update(version=99), "version 99")
    bad(lambda d: d.update(type="Nope"), "not a " + cls.__name__)
    bad(lambda d: d["special_tokens"].update(unk_token="???"), "not a token of the vocabulary")
    if kind == "bpe":
        bad(lambda d: d["merges"].append(["a"]), "pair of non-empty strings")
        bad(lambda d: d["merges"].append(["zz", "qq"]), "not in the vocab")
    if kind == "unigram":
        bad(lambda d: d["log_probs"].update({next(iter(d["log_probs"])): 1.5}), "number <= 0")
    if kind == "wordpiece":
        bad(lambda d: d.update(lowercase="yes"), "'lowercase' must be a bool")


def test_guide_helper_methods():
    tok = BPETokenizer()
    wf = tok.get_word_frequencies(["low lower low"])
    assert wf == {"low</w>": 2, "lower</w>": 1}
    assert tok.get_character_vocab(wf) == {"l", "o", "w</w>", "w", "e", "r</w>"}
    spaced = {"l o w</w>": 2, "l o w e r</w>": 1, "a aa": 1}
    assert tok.get_pairs(spaced)[("l", "o")] == 3
    # whole symbols only: ("a", "a") must not match inside "aa"
    assert tok.merge_vocab(("a", "a"), {"a aa": 1, "a a a": 2}) == {"a aa": 1, "aa a": 2}
    assert WordPieceTokenizer().get_initial_vocab({"ab": 1}) == {"[UNK]", "a", "##b"}
    assert UnigramTokenizer().get_initial_vocab(["ab"]) == {"\u2581": 1, "a": 1, "b": 1, "\u2581a": 1, "ab": 1,
                                                            "\u2581ab": 1}


def _naive_wordpiece_merges(texts, n_merges):
    """Full rescoring of every pair per merge: the reference for the heap-based trainer."""
    freq = Counter(w for t in texts for w in WordPieceTokenizer().basic.tokenize(t))
    words = {tuple([w[0]] + ["##" + c for c in w[1:]]): c for w, c in freq.items()}
    merges = []
    for _ in range(n_merges):
        sym, pairs = Counter(), Counter()
        for w, c in words.items():
            for x in w:
                sym[x] += c
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-(pairs[p] / (sym[p[0]] * sym[p[1]])), -pairs[p], p))
        merges.append(best)
        a, b = best
        new_sym = a + (b[2:] if b.startswith("##") else b)
        nw = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new_sym)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            nw[tuple(out)] = nw.get(tuple(out), 0) + c
        words = nw
    return merges


def test_wordpiece_heap_training_matches_full_rescoring():
    texts = _corpus(120, seed=4)
    tok = WordPieceTokenizer(vocab_size=10_000)
    tok.train(texts)
    ref = _naive_wordpiece_merges(texts, len(tok.merges) + 5)
    assert tok.merges == ref[:len(tok.merges)]
    assert len(ref) == len(tok.merges)  # both stop when no pair is left
