"""tokenizer.json both ways against the ``tokenizers`` library, and batch calls against transformers."""

import json

import pytest
import torch

from fastarch.tokenizers import (
    BPETokenizer,
    TokenizerFileError,
    UnigramTokenizer,
    WordPieceTokenizer,
    load_tokenizer_json,
    save_tokenizer_json,
)
from fastarch.tokenizers.batch import truncated_lengths
from tests.tokenizers.library_checks import assert_matches_library

tk = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "A lazy dog sleeps; the quick fox doesn't sleep!",
    "Tokenizers split text into pieces, and pieces into ids.",
    "Café, naïve, résumé: accents appear in borrowed words.",
    "Numbers like 12345 and 3.14 show up too, as do e-mails.",
    "東京 and 北京 are cities; emoji 🙂 are characters too.",
    "She said: \"it's fine\", and he's sure they're right.",
] * 3

# unicode, whitespace runs, tabs/newlines, unseen characters, inline special tokens, empty text
PROBE = [
    "The quick brown fox.",
    "  leading and   internal\twhitespace\nruns   ",
    "Unseen letters: ζωή, Ω, ß, and symbols ⊕ ∑ ★",
    "CAFÉ NAÏVE Résumé",
    "東京タワー 🙂🙃 ok",
    "it's, they're, we've; don't!",
    "[CLS] inline [MASK] specials <unk> <pad>",
    "glued<unk>to<pad>specials[SEP]here",
    "",
    "xyzzy qqqq zzz",
    "e\u0301 combining accent",
]


def _wordpiece_hf():
    t = tk.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.train_from_iterator(TRAIN, trainers.WordPieceTrainer(
        vocab_size=220, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls_id, sep_id = t.token_to_id("[CLS]"), t.token_to_id("[SEP]")
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    t.decoder = decoders.WordPiece()
    return t


def _bpe_hf(suffix: bool):
    if suffix:
        t = tk.Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
        t.normalizer = normalizers.Lowercase()
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        t.decoder = decoders.BPEDecoder(suffix="</w>")
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                      end_of_word_suffix="</w>")
    else:
        t = tk.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        t.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Strip()])
        t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    t.train_from_iterator(TRAIN, trainer)
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
    return t


def _unigram_hf(scheme="always"):
    t = tk.Tokenizer(models.Unigram())
    t.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    t.decoder = decoders.Metaspace(prepend_scheme=scheme)
    t.train_from_iterator(TRAIN, trainers.UnigramTrainer(
        vocab_size=150, unk_token="<unk>", special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    return t


HF_BUILDERS = {"wordpiece": _wordpiece_hf, "bpe_suffix": lambda: _bpe_hf(True), "bpe_plain": lambda: _bpe_hf(False),
               "unigram": _unigram_hf, "unigram_first": lambda: _unigram_hf("first")}


@pytest.mark.parametrize("name", sorted(HF_BUILDERS))
def test_load_files_written_by_tokenizers(tmp_path, name):
    assert_matches_library(HF_BUILDERS[name](), tmp_path, PROBE, (PROBE[0], PROBE[5]))


def _native(kind):
    if kind == "bpe":
        tok = BPETokenizer(150, bos_token="<s>", eos_token="</s>")
    elif kind == "wordpiece":
        tok = WordPieceTokenizer(200)
    else:
        tok = UnigramTokenizer(120, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.train(TRAIN)
    return tok


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "unigram"])
def test_tokenizers_library_reads_fastarch_files(tmp_path, kind):
    tok = _native(kind)
    save_tokenizer_json(tok, tmp_path)  # a folder gets tokenizer.json
    hf = tk.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in PROBE:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, (kind, text, tok.convert_ids_to_tokens(ids))
        assert hf.decode(ids) == tok.decode(ids)
    pair = hf.encode(PROBE[0], PROBE[3])
    assert tok.encode_pair(PROBE[0], PROBE[3]) == pair.ids
    back = load_tokenizer_json(tmp_path / "tokenizer.json")
    assert back.convert_ids_to_tokens(range(len(back))) == tok.convert_ids_to_tokens(range(len(tok)))
    assert [back.encode(t) for t in PROBE] == [tok.encode(t) for t in PROBE]


@pytest.mark.parametrize("source", ["wordpiece_from_tokenizers", "unigram_from_fastarch", "bpe_from_fastarch"])
def test_batch_call_matches_transformers(tmp_path, source):
    transformers = pytest.importorskip("transformers")
    if source == "wordpiece_from_tokenizers":
        _wordpiece_hf().save(str(tmp_path / "tokenizer.json"))
        tok = load_tokenizer_json(tmp_path / "tokenizer.json")
    else:
        tok = _native(source.split("_")[0])
        save_tokenizer_json(tok, tmp_path / "tokenizer.json")
    names = {r: t for r, t in tok.special_tokens.items()}
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), **names)
    assert tok.mask_token_id == ref.mask_token_id and tok.pad_token_id == ref.pad_token_id
    assert sorted(tok.all_special_ids) == sorted(ref.all_special_ids)
    texts = [PROBE[0], PROBE[1], PROBE[5], "short", PROBE[2]]
    pairs = [PROBE[3], "b", PROBE[2], PROBE[4], "tiny"]
    for kwargs in ({"padding": True}, {"padding": True, "truncation": True, "max_length": 9},
                   {"padding": "max_length", "truncation": True, "max_length": 12},
                   {"padding": True, "truncation": "only_first", "max_length": 64}):
        for pair in (None, pairs):
            if pair is None and kwargs.get("truncation") == "only_first":
                continue
            got = tok(texts, pair, return_tensors="pt", **kwargs)
            want = ref(texts, pair, return_tensors="pt", return_token_type_ids=True, **kwargs)
            for key in ("input_ids", "attention_mask", "token_type_ids"):
                assert torch.equal(got[key], want[key]), (kwargs, pair is not None, key)
    ref.padding_side = tok.padding_side = "left"
    got, want = tok(texts, padding=True, return_tensors="pt"), ref(texts, padding=True, return_tensors="pt")
    assert torch.equal(got["input_ids"], want["input_ids"])
    assert torch.equal(got["attention_mask"], want["attention_mask"])
    tok.padding_side = "right"
    with pytest.raises(ValueError, match="cannot fit"):  # as the library: "sequence to truncate too short"
        tok(texts, pairs, truncation="only_first", max_length=6)
    for ids in ref(texts)["input_ids"]:
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_longest_first_lengths_match_the_library():
    t = tk.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for budget in range(1, 10):
        t.enable_truncation(budget, strategy="longest_first")
        for n1 in range(0, 9):
            for n2 in range(0, 9):
                enc = t.encode(" ".join("a" * n1), " ".join("b" * n2))
                want = (enc.ids.count(0), enc.ids.count(1))
                assert truncated_lengths(n1, n2, budget) == want, (n1, n2, budget)


def test_batch_call_shapes_and_errors():
    tok = _native("wordpiece")
    one = tok("the quick fox")
    assert isinstance(one["input_ids"], list) and one.input_ids[0] == tok.cls_token_id
    assert one["attention_mask"] == [1] * len(one["input_ids"])
    pt = tok("the quick fox", return_tensors="pt")
    assert pt["input_ids"].shape == (1, len(one["input_ids"]))
    batch = tok(["a", "the quick brown fox"], padding=True)
    assert batch["input_ids"][0][-1] == tok.pad_token_id and batch["attention_mask"][0][-1] == 0
    with pytest.raises(ValueError, match="padding=True"):
        tok(["a", "the quick brown fox"], return_tensors="pt")
    with pytest.raises(ValueError, match="'padding'"):
        tok(["a"], padding="left")
    with pytest.raises(ValueError, match="'max_length'"):
        tok(["a"], padding="max_length")
    with pytest.raises(ValueError, match="'text_pair' has 1"):
        tok(["a", "b"], ["c"])
    bpe = BPETokenizer(100, pad_token=None)
    bpe.train(TRAIN)
    with pytest.raises(ValueError, match="pad_token"):
        bpe(["a", "the quick"], padding=True)


def test_bad_files_are_refused(tmp_path, refuse):
    hf = _bpe_hf(True)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    data = json.loads(path.read_text(encoding="utf-8"))
    refused = lambda edit, match: refuse(data, edit, match)
    refused(lambda d: d.update(pre_tokenizer={"type": "UnicodeScripts"}), "pre-tokenizer 'UnicodeScripts'")
    refused(lambda d: d.update(pre_tokenizer={"type": "Punctuation", "behavior": "Split"}),
            "Punctuation behavior 'Split' is not supported")
    refused(lambda d: d["model"].update(type="WordLevel"), "model type 'WordLevel'")
    refused(lambda d: d.update(normalizer={"type": "Replace", "pattern": {"Regex": "("}, "content": ""}), "malformed")
    refused(lambda d: d.update(normalizer={"type": "Precompiled"}), "normalizer 'Precompiled' is malformed .*"
            "'precompiled_charsmap' must be a base64 string")
    refused(lambda d: d["model"].update(dropout=1.5), "dropout")
    refused(lambda d: d["model"].update(continuing_subword_prefix=5), "'continuing_subword_prefix' must be null or")
    # with a prefix, a merge drops the right symbol's prefix length: these merges make tokens the file lacks
    refused(lambda d: d["model"].update(continuing_subword_prefix="##"), r"merge 0 .* makes .*, which is not in")
    refused(lambda d: d["model"]["merges"].append("t h"), r"merge \d+ \['t', 'h'\] makes 'th', which is not in")
    refused(lambda d: d["added_tokens"][0].update(special="no"), "field .special. must be a bool")
    refused(lambda d: d["added_tokens"][0].update(content=""), "empty")
    refused(lambda d: d["model"]["vocab"].pop("e"), "without gaps")
    refused(lambda d: d.update(post_processor={"type": "Custom"}), "post_processor 'Custom'")
    (tmp_path / "pickle.json").write_bytes(b"\x80\x04\x95")
    with pytest.raises(TokenizerFileError):
        load_tokenizer_json(tmp_path / "pickle.json")


# ---- BPE continuing_subword_prefix ----------------------------------------------------------------------------
def _prefixed_bpe_hf(prefix: str, suffix: str | None):
    """BPE trained by the library with a continuing-subword prefix (and an end-of-word suffix), decoded by the
    WordPiece decoder (with a suffix, by a Replace of it first)."""
    suffixed = {"end_of_word_suffix": suffix} if suffix else {}
    t = tk.Tokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix=prefix, **suffixed))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece(prefix=prefix) if suffix is None else decoders.Sequence(
        [decoders.Replace(suffix, ""), decoders.WordPiece(prefix=prefix)])
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=260, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                                                     continuing_subword_prefix=prefix, limit_alphabet=60,
                                                     **suffixed))
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
    return t


@pytest.mark.parametrize("prefix,suffix", [("##", None), ("##", "</w>"), ("\u00b7\u00b7", None)])
def test_continuing_subword_prefix_matches_the_library(tmp_path, monkeypatch, prefix, suffix):
    import fastarch.tokenizers.bpe as bpe_module

    hf = _prefixed_bpe_hf(prefix, suffix)
    assert any(t.startswith(prefix) and len(t) > len(prefix) + 1 for t in hf.get_vocab())  # prefixed merges
    tok = assert_matches_library(hf, tmp_path, PROBE, (PROBE[0], PROBE[3]))
    assert tok.continuing_subword_prefix == prefix
    words = PROBE + ["tokenizersplitpiecesaccentsnumbersquicklazy" * 3]  # a long word goes through the queue
    for text in words:
        assert tok.convert_ids_to_tokens(tok.encode(text)) == hf.encode(text).tokens, text
    monkeypatch.setattr(bpe_module, "_SCAN_SYMBOLS", 0)
    tok._cache = {}
    for text in words:
        assert tok.convert_ids_to_tokens(tok.encode(text)) == hf.encode(text).tokens, text
    again = json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))["model"]
    assert again["continuing_subword_prefix"] == prefix and again["end_of_word_suffix"] == suffix


def test_trained_prefixed_bpe_is_read_by_the_library(tmp_path):
    tok = BPETokenizer(150, lowercase=False, continuing_subword_prefix="##")
    tok.pre_tokenizer = {"type": "Whitespace"}
    tok.decoder = {"type": "WordPiece", "prefix": "##", "cleanup": False}
    tok.end_of_word_suffix = ""
    tok.train(TRAIN)
    assert any(t.startswith("##") and len(t) > 3 for t in tok.vocab)
    assert all(b.startswith("##") for _, b in tok.merges)
    save_tokenizer_json(tok, tmp_path / "tokenizer.json")
    hf = tk.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in PROBE:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, text
        assert hf.decode(ids) == tok.decode(ids), text
    with pytest.raises(TypeError, match="continuing_subword_prefix"):
        BPETokenizer(10, continuing_subword_prefix=None)
