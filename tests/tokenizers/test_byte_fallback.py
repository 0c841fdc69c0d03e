"""SentencePiece-style tokenizer.json files (Llama 2, Mistral, Gemma layouts: ``byte_fallback``, ``fuse_unk``,
``<0xHH>`` byte tokens, the Replace/ByteFallback/Fuse/Strip decoder) and BPE-dropout, against the
``tokenizers`` library."""

import json
import random
from collections import Counter

import pytest

from fastarch.tokenizers import BPETokenizer, TokenizerFileError, load_tokenizer, load_tokenizer_json
from fastarch.tokenizers.pipeline import byte_token, decode_tokens
from tests.tokenizers.library_checks import assert_matches_library

tk = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

SPACE = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]

TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "A lazy dog sleeps; the quick fox doesn't sleep!",
    "Tokenizers split text into pieces, and pieces into ids.",
    "Café, naïve, résumé: accents appear in borrowed words.",
    "東京 and 北京 are cities; emoji 🙂 are characters too.",
    "Numbers like 12345 and 3.14 show up too.",
] * 3

# characters absent from the vocabulary (byte fallback), emoji, CJK, whitespace runs at either end, empty text,
# special tokens and byte-token spellings written in the text, the meta-space character itself
PROBE = [
    "The quick brown fox.",
    "Unseen letters: ζωή, Ω, ß, and symbols ⊕ ∑ ★",
    "emoji 🙂🙃🎉👩‍👩‍👧 and 日本語のテキスト 東京タワー",
    "  leading, trailing and   multiple spaces   ",
    " ",
    "   ",
    "",
    "lines\nand\ttabs\n\n\n<table>x</table>",
    "inline <s> specials </s>glued<unk>",
    "literal <0x41> and <0xZZ> and ▁ and ▁▁x",
    "CAFÉ naïve e\u0301 Привет مرحبا",
]

LLAMA_DECODER = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])


def _with_byte_tokens(hf, byte_fallback=True):
    """The library tokenizer ``hf`` rebuilt with the 256 ``<0xHH>`` tokens right after the special tokens, as
    SentencePiece-converted files have them (in the model's vocabulary, not added tokens)."""
    data = json.loads(hf.to_str())
    model = data["model"]
    bytes_ = [byte_token(b) for b in range(256)]
    if model["type"] == "Unigram":
        n = len(SPECIALS)
        model["vocab"] = model["vocab"][:n] + [[t, 0.0] for t in bytes_] + model["vocab"][n:]
    else:
        vocab = model["vocab"]
        shift = {t: (i if i < len(SPECIALS) else i + 256) for t, i in vocab.items()}
        shift.update({t: len(SPECIALS) + b for b, t in enumerate(bytes_)})
        model["vocab"] = shift
    model["byte_fallback"] = byte_fallback
    return tk.Tokenizer.from_str(json.dumps(data))


def _template(t):
    from tokenizers import processors

    t.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", t.token_to_id("<s>"))])
    return t


def _llama2_bpe(limit_alphabet=40):
    """Llama 2's layout: normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE with fuse_unk and
    byte_fallback. ``limit_alphabet`` keeps rare characters out of the vocabulary."""
    t = tk.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    t.decoder = LLAMA_DECODER
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=260, special_tokens=SPECIALS,
                                                     limit_alphabet=limit_alphabet))
    return _template(_with_byte_tokens(t))


def _mistral_bpe():
    """The newer layout (Mistral, Llama 2 files written by recent transformers): no normalizer, a Metaspace
    pre-tokenizer prepending "▁" to the first piece only and not splitting."""
    t = tk.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement=SPACE,
                                                                               prepend_scheme="first", split=False)])
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=260, special_tokens=SPECIALS, limit_alphabet=40))
    return _template(_with_byte_tokens(t))


def _gemma_bpe():
    """Gemma's layout: the normalizer only replaces spaces (no "▁" prepended), the decoder has no Strip, and
    non-special added tokens (HTML tags, whitespace runs) are matched on the raw text."""
    from tokenizers import AddedToken

    t = tk.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    t.normalizer = normalizers.Replace(" ", SPACE)
    t.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=260, special_tokens=SPECIALS, limit_alphabet=40))
    t = _template(_with_byte_tokens(t))
    t.add_tokens([AddedToken("<table>", normalized=False), AddedToken("\n\n", normalized=False),
                  AddedToken(SPACE * 2, normalized=False)])
    return t


def _sentencepiece_implementations(kind):
    """The library's own SentencePiece-style builders (NFKC, Metaspace), given byte tokens and byte_fallback."""
    from tokenizers.implementations import SentencePieceBPETokenizer, SentencePieceUnigramTokenizer

    if kind == "bpe":
        t = SentencePieceBPETokenizer(fuse_unk=True)
        t.train_from_iterator(TRAIN, vocab_size=260, special_tokens=SPECIALS, limit_alphabet=40, show_progress=False)
    else:
        t = SentencePieceUnigramTokenizer()
        t.train_from_iterator(TRAIN, vocab_size=150, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    t = _with_byte_tokens(t)
    t.decoder = decoders.Sequence([decoders.ByteFallback(), json_decoder(t)])
    return _template(t)


def json_decoder(t):
    """The library decoder ``t`` has now, rebuilt (to put it in a Sequence)."""
    spec = json.loads(t.to_str())["decoder"]
    assert spec["type"] == "Metaspace"
    return decoders.Metaspace(replacement=spec["replacement"], prepend_scheme=spec["prepend_scheme"],
                              split=spec["split"])


def _unigram_fallback():
    t = tk.Tokenizer(models.Unigram())
    t.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    t.decoder = LLAMA_DECODER
    t.train_from_iterator(TRAIN, trainers.UnigramTrainer(vocab_size=150, unk_token="<unk>", special_tokens=SPECIALS))
    return _template(_with_byte_tokens(t))


def _partial_bytes():
    """Byte fallback with only some byte tokens: a character with a byte lacking becomes <unk> instead."""
    hf = _llama2_bpe()
    data = json.loads(hf.to_str())
    vocab = data["model"]["vocab"]
    dropped = [byte_token(b) for b in range(0x80, 0x100, 3)]
    keep = sorted((i, t) for t, i in vocab.items() if t not in dropped)
    data["model"]["vocab"] = {t: j for j, (_, t) in enumerate(keep)}
    return tk.Tokenizer.from_str(json.dumps(data))


HF_BUILDERS = {"llama2_bpe": _llama2_bpe, "mistral_bpe": _mistral_bpe, "gemma_bpe": _gemma_bpe,
               "unigram": _unigram_fallback, "partial_bytes": _partial_bytes,
               "sp_bpe_builder": lambda: _sentencepiece_implementations("bpe"),
               "sp_unigram_builder": lambda: _sentencepiece_implementations("unigram")}


@pytest.mark.parametrize("name", sorted(HF_BUILDERS))
def test_byte_fallback_files_match_the_library(tmp_path, name):
    hf = HF_BUILDERS[name]()
    tok = assert_matches_library(hf, tmp_path, PROBE, (PROBE[0], PROBE[2]))
    fell_back = False
    for text in PROBE:
        ref = hf.encode(text)
        assert tok.convert_ids_to_tokens(tok.encode(text)) == ref.tokens, text
        fell_back |= any(t.startswith("<0x") for t in ref.tokens)
    assert fell_back  # the probe reaches the byte tokens
    # decoding arbitrary ids, including runs of byte tokens that are not valid UTF-8
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(hf.get_vocab_size()) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    # written back, the file keeps the model and pipeline exactly
    original, again = json.loads(hf.to_str()), json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert again[key] == original[key], key
    for key, value in original["model"].items():
        assert again["model"][key] == value, key
    # fastarch's own format keeps byte_fallback
    assert load_tokenizer(tmp_path / "fastarch.json").byte_fallback


def test_byte_fallback_off_gives_unk(tmp_path):
    """The same vocabulary with byte_fallback false: a run of unknown characters is one <unk>, as the library."""
    data = json.loads(_llama2_bpe().to_str())
    data["model"]["byte_fallback"] = False
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    hf, tok = tk.Tokenizer.from_file(str(path)), load_tokenizer_json(path)
    assert not tok.byte_fallback
    for text in PROBE:
        assert tok.encode(text) == hf.encode(text).ids, text
    assert tok.convert_ids_to_tokens(tok.encode("ζωή", add_special_tokens=False)) == [SPACE, "<unk>"]


def test_sentencepiece_decoders_match_the_library():
    stages = [LLAMA_DECODER, decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 2, 1),
              decoders.Strip("x", 0, 3), decoders.Replace(tk.Regex("[ab]+"), "-"),
              decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()]), decoders.Sequence([]),
              decoders.Metaspace(prepend_scheme="first"), decoders.Metaspace(prepend_scheme="never")]
    pieces = ["<0xE6>", "<0x97>", "<0xA5>", "<0xF0>", "<0x9F>", "a", "<0x0a>", "<0x+F>", "<0xzz>", "<0x41>", "<0X41>",
              "<0x4>", "▁ab", "  b  ", "xx", "x", " ", "▁", "▁▁hello▁", "aab", ""]
    rng = random.Random(0)
    for stage in stages:
        spec = json.loads(stage.__getstate__())
        for _ in range(300):
            tokens = [rng.choice(pieces) for _ in range(rng.randint(0, 7))]
            if spec.get("type") == "Strip" and any(len(t) < spec["start"] + spec["stop"] for t in tokens):
                continue  # the library panics when the cuts overlap or pass the token's end
            assert decode_tokens(spec, tokens) == stage.decode(tokens), (spec, tokens)


def test_nmt_normalizer_matches_the_library():
    """Every code point, alone (the rules are per character) and in a text."""
    from fastarch.tokenizers.pipeline import normalize

    nmt = normalizers.Nmt()
    chars = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert normalize({"type": "Nmt"}, chars) == nmt.normalize_str(chars)
    for text in PROBE + ["a\tb\x01c\u2581d\u200b\ufeffe\r\n"]:
        assert normalize({"type": "Nmt"}, text) == nmt.normalize_str(text), text


def test_bad_byte_fallback_files_are_refused(refuse):
    data = json.loads(_llama2_bpe().to_str())
    refused = lambda edit, match: refuse(data, edit, match)  # noqa: E731
    refused(lambda d: d.update(decoder={"type": "CTC"}), "decoder 'CTC'")
    refused(lambda d: d.update(decoder={"type": "Strip", "content": " ", "start": "x", "stop": 0}), "malformed")
    refused(lambda d: d["model"].update(dropout=-0.1), "dropout")
    refused(lambda d: d["model"].update(dropout="0.1"), "dropout")
    refused(lambda d: d["added_tokens"][1].update(normalized=True), "normalized=true and the normalizer changes it")


# ---- BPE-dropout ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_json():
    # one trained file for all the dropout tests: the library's training may break ties differently per run
    return _llama2_bpe().to_str()


def _dropout_pair(tmp_path, llama_json, dropout):
    """The Llama-layout file with ``dropout`` set, loaded by the library and by fastarch."""
    data = json.loads(llama_json)
    data["model"]["dropout"] = dropout
    path = tmp_path / "dropout.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return tk.Tokenizer.from_file(str(path)), load_tokenizer_json(path)


def test_dropout_zero_and_one_are_deterministic(tmp_path, llama_json):
    hf_none, deterministic = _dropout_pair(tmp_path, llama_json, None)
    for p in (0.0, 1.0):
        hf, tok = _dropout_pair(tmp_path, llama_json, p)
        assert tok.dropout == p
        for text in PROBE:
            assert tok.encode(text) == hf.encode(text).ids, (p, text)  # 1.0: no merge at all
            if p == 0.0:
                assert tok.encode(text) == deterministic.encode(text) == hf_none.encode(text).ids
    assert tok.convert_ids_to_tokens(tok.encode("ab", add_special_tokens=False)) == [SPACE, "a", "b"]


def test_dropout_bypasses_the_cache(tmp_path, llama_json):
    """As the library: a word encoded (and cached) without dropout is re-merged once dropout is on."""
    _, tok = _dropout_pair(tmp_path, llama_json, None)
    merged = tok.tokenize("the quick brown fox")
    tok.set_dropout(1.0)
    assert tok.tokenize("the quick brown fox") == list(SPACE + "the" + (SPACE + "quick") + SPACE + "brown"
                                                       + SPACE + "fox")
    tok.set_dropout(None)
    assert tok.tokenize("the quick brown fox") == merged


def test_dropout_ignores_ignore_merges_as_the_library():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}
    hf = tk.Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "c")], dropout=1.0, ignore_merges=True))
    data = json.loads(hf.to_str())
    assert data["model"]["ignore_merges"] and data["model"]["dropout"] == 1.0
    tok = BPETokenizer(10, lowercase=False, unk_token=None, pad_token=None, dropout=1.0)
    tok._set_vocab(list(vocab))
    tok.merges = [("a", "b"), ("ab", "c")]
    tok._ranks = {m: r for r, m in enumerate(tok.merges)}
    tok.end_of_word_suffix, tok.ignore_merges, tok.pre_tokenizer = "", True, None
    assert tok.tokenize("abc") == hf.encode("abc").tokens == ["a", "b", "c"]
    tok.set_dropout(None)
    assert tok.tokenize("abc") == ["abc"]


def _total_variation(encode, hf_encode, words, n):
    """Total variation distance between the distributions of (word, segmentation) under the two encoders."""
    ours = Counter((w, tuple(encode(w))) for w in words for _ in range(n))
    ref = Counter((w, tuple(hf_encode(w))) for w in words for _ in range(n))
    return 0.5 * sum(abs(ours[k] - ref[k]) for k in set(ours) | set(ref)) / (len(words) * n), ours


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_match_the_library(tmp_path, llama_json, p):
    """The distribution of segmentations of a few words (each merge the queue offers dropped with probability
    p, the dropped ones offered again after the next merge) matches the library's within sampling noise: about
    0.02-0.05 in total variation here, where dropping merges for good instead gives over 0.2."""
    hf, tok = _dropout_pair(tmp_path, llama_json, p)
    tok.set_dropout(p, seed=0)
    words = ["quick", "the lazy dog", "sleeps"]
    tv, ours = _total_variation(lambda w: tok.encode(w, add_special_tokens=False),
                                lambda w: hf.encode(w, add_special_tokens=False).ids, words, 3000)
    assert tv < 0.1, (tv, ours.most_common(5))
    assert len(ours) > 3 * len(words)  # segmentations vary


def test_dropout_is_reproducible_with_a_seed(tmp_path, llama_json):
    _, tok = _dropout_pair(tmp_path, llama_json, 0.3)
    draws = []
    for seed in (7, 7, 8):
        tok.set_dropout(0.3, seed=seed)
        draws.append([tok.encode(t) for t in PROBE * 5])
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]
    with pytest.raises(ValueError, match="'dropout'"):
        tok.set_dropout(1.5)
    with pytest.raises(ValueError, match="'dropout'"):
        BPETokenizer(10, dropout=True)
    tok.set_dropout(0.25, seed=1)
    tok.save(tmp_path / "native.json")
    assert load_tokenizer(tmp_path / "native.json").dropout == 0.25
    with pytest.raises(TokenizerFileError, match="dropout"):
        native = json.loads((tmp_path / "native.json").read_text(encoding="utf-8"))
        native["dropout"] = 2
        (tmp_path / "bad.json").write_text(json.dumps(native), encoding="utf-8")
        load_tokenizer(tmp_path / "bad.json")


# ---- merge order --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_merge_order_matches_the_library_on_random_merge_lists(tmp_path, monkeypatch, seed):
    """Random merge lists over a small alphabet, in random order (a merge may use a token that a later merge
    makes, as in SentencePiece-converted files), on random words short and long: the library's queue order
    (lowest rank, then leftmost) is reproduced by both the rescanning path for short words and the queue."""
    import fastarch.tokenizers.bpe as bpe_module

    rng = random.Random(seed)
    tokens, merges = list("abcd"), []
    while len(merges) < 40:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if (a, b) not in merges and len(a + b) <= 6:
            merges.append((a, b))
            if a + b not in tokens:
                tokens.append(a + b)
    rng.shuffle(merges)
    hf = tk.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer_json(tmp_path / "tokenizer.json")
    words = ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for scan in (bpe_module._SCAN_SYMBOLS, 0):  # 0: every word through the queue
        monkeypatch.setattr(bpe_module, "_SCAN_SYMBOLS", scan)
        tok._cache = {}
        for w in words:
            assert tok.tokenize(w) == hf.encode(w).tokens, (scan, w)
