"""Byte-level BPE (GPT-2, RoBERTa, Llama 3 style) tokenizer.json files against the ``tokenizers`` library."""

import json
import random

import pytest
import torch

from fastarch.tokenizers import BPETokenizer, load_tokenizer_json, save_tokenizer_json
from fastarch.tokenizers.byte_level import BYTE_TO_CHAR, bytes_to_text, gpt2_split, text_to_bytes
from fastarch.tokenizers.pipeline import pre_tokenize
from tests.tokenizers.library_checks import assert_matches_library

tk = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "She said: \"it's fine\", and he's sure they're right; we've seen it, I'm sure, we'll see, I'd go.",
    "Numbers like 12345 and 3.14 show up too, as do e-mails and 2026-11-24.",
    "Café, naïve, résumé: accents appear in borrowed words. Ça va?",
    "東京 and 北京 are cities; 日本語のテキスト too. Emoji 🙂🙃🎉 are several bytes.",
    "def f(x):\n\treturn x  +  1\n\n    indented   spaces   here   ",
] * 4

PROBE = [
    "The quick brown fox.",
    "  leading, trailing and   multiple spaces   ",
    "lines\nand\ttabs\n\n\t mixed \r\n end\n",
    "digits 0123456789 and 3.14159, 1,000,000",
    "punctuation!? (brackets) [x] {y} <z> ... --- ''",
    "it's they're we've I'm we'll I'd don't 'S 'RE",
    "Café naïve résumé Ça ÉÀÜ e\u0301",
    "東京タワー 日本語 北京",
    "emoji 🙂🙃🎉👩‍👩‍👧 and ★ ⊕ ∑",
    "",
    " ",
    "\u00a0non-breaking\u3000ideographic\x1cseparator",
    "unseen ζωή Ωμέγα Привет مرحبا",
]


def _byte_level_hf(add_prefix_space: bool, specials=("<|endoftext|>", "<pad>"), ignore_merges=False,
                   all_bytes=True):
    """all_bytes=False: the alphabet is only the bytes of the corpus, so other bytes have no token."""
    t = tk.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if all_bytes else []
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=420, special_tokens=list(specials),
                                                     initial_alphabet=alphabet))
    return t


def _roberta_hf():
    t = _byte_level_hf(True, ("<s>", "<pad>", "</s>", "<unk>", "<mask>"))
    t.post_processor = processors.RobertaProcessing(("</s>", t.token_to_id("</s>")), ("<s>", t.token_to_id("<s>")))
    return t


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _llama3_hf():
    """Llama 3's layout: Split on its pattern, then ByteLevel without the GPT-2 pattern; ignore_merges; a
    Sequence post-processor adding the begin-of-text token."""
    pytest.importorskip("regex")  # the pattern's \p{L} classes need it (Python's re has none)
    t = _byte_level_hf(False, ("<|begin_of_text|>", "<|end_of_text|>", "<pad>"), ignore_merges=True)
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tk.Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bos = t.token_to_id("<|begin_of_text|>")
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return t


HF_BUILDERS = {"gpt2_prefix": lambda: _byte_level_hf(True), "gpt2_no_prefix": lambda: _byte_level_hf(False),
               "roberta": _roberta_hf, "llama3": _llama3_hf,
               "corpus_bytes_only": lambda: _byte_level_hf(True, all_bytes=False)}


def test_gpt2_split_matches_the_library_pattern():
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in PROBE:
        assert [text_to_bytes(w) for w in gpt2_split(text)] == [w for w, _ in pre.pre_tokenize_str(text)], text
    # random strings over the characters the pattern treats differently
    alphabet = list("ab Z1²'s'tre\n\t \u00a0\u3000\x1c.!,é東🙂\u0301-") + ["'ll", "'ve", "  ", "'"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert "".join(gpt2_split(text)) == text
        assert [text_to_bytes(w) for w in gpt2_split(text)] == [w for w, _ in pre.pre_tokenize_str(text)], repr(text)


@pytest.mark.parametrize("behavior", ["removed", "isolated", "merged_with_previous", "merged_with_next",
                                      "contiguous"])
def test_split_pre_tokenizer_matches_the_library(behavior):
    patterns = [tk.Regex(r"\s+"), " ", tk.Regex("a|b")] + ([tk.Regex(LLAMA3_SPLIT)] if _has_regex() else [])
    alphabet = list("ab Z1²'s'tRE\n\r\t \u00a0\u3000\x1c.!,é東🙂\u0301-") + ["'ll", "'VE", "  ", "12345"]
    rng = random.Random(2)
    for pattern in patterns:
        for invert in (False, True):
            hf = pre_tokenizers.Split(pattern, behavior=behavior, invert=invert)
            stage = json.loads(hf.__getstate__())
            for _ in range(300):
                text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
                assert pre_tokenize(stage, text) == [w for w, _ in hf.pre_tokenize_str(text)], (stage, text)


def _has_regex() -> bool:
    try:
        import regex  # noqa: F401
    except ImportError:
        return False
    return True


def test_byte_alphabet_and_round_trip():
    assert sorted(BYTE_TO_CHAR.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert BYTE_TO_CHAR[ord(" ")] == "Ġ" and BYTE_TO_CHAR[ord("\n")] == "Ċ" and BYTE_TO_CHAR[ord("A")] == "A"
    for text in PROBE:
        assert bytes_to_text([text_to_bytes(text)]) == text
    # a lone continuation byte is not UTF-8: replaced as the library does
    assert bytes_to_text([BYTE_TO_CHAR[0xC3]]) == "\ufffd"
    assert bytes_to_text(["<|endoftext|>", "Ġx"]) == "<|endoftext|> x"


@pytest.mark.parametrize("name", sorted(HF_BUILDERS))
def test_load_byte_level_files_written_by_tokenizers(tmp_path, name):
    hf = HF_BUILDERS[name]()
    specials = [t for t in hf.get_vocab() if t.startswith("<")]
    texts = PROBE + [f"{specials[0]}glued{specials[-1]} text {specials[0]}", f"a {specials[0]} b"]
    tok = assert_matches_library(hf, tmp_path, texts, (PROBE[0], PROBE[5]))
    # decoding arbitrary ids, including ones that split a character's bytes
    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(hf.get_vocab_size()) for _ in range(rng.randint(0, 8))]
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), ids
    again = json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))
    original = json.loads(hf.to_str())
    assert again["pre_tokenizer"] == original["pre_tokenizer"] and again["decoder"] == original["decoder"]
    assert again["model"]["ignore_merges"] == (name == "llama3")


@pytest.mark.parametrize("add_prefix_space", [False, True])
def test_fastarch_trained_byte_level_bpe_read_by_the_library(tmp_path, add_prefix_space):
    tok = BPETokenizer(400, lowercase=False, unk_token=None, pad_token="<pad>", eos_token="<|endoftext|>",
                       byte_level=True, add_prefix_space=add_prefix_space)
    tok.train(TRAIN)
    assert set(BYTE_TO_CHAR.values()) <= set(tok.vocab)  # every byte has a token, seen in training or not
    save_tokenizer_json(tok, tmp_path)
    hf = tk.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in PROBE + ["tail<|endoftext|>"]:
        ids = tok.encode(text)
        assert hf.encode(text).ids == ids, (text, tok.convert_ids_to_tokens(ids))
        assert hf.decode(ids) == tok.decode(ids)
        plain = tok.encode(text, add_special_tokens=False)
        assert tok.decode(plain, skip_special_tokens=False) == (" " + text if add_prefix_space and text and text[0] != " " else text)
    with pytest.raises(TypeError, match="'byte_level'"):
        BPETokenizer(100, byte_level="yes")


def test_ignore_merges_keeps_whole_words(tmp_path):
    data = json.loads(_byte_level_hf(True).to_str())
    vocab = data["model"]["vocab"]
    vocab["Ġzebra"] = len(vocab)  # no merges lead to it: only ignore_merges gives it whole
    texts = PROBE + ["a zebra, zebras", "zebra"]
    results = {}
    for flag in (True, False):
        data["model"]["ignore_merges"] = flag
        path = tmp_path / f"{flag}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        hf, tok = tk.Tokenizer.from_file(str(path)), load_tokenizer_json(path)
        results[flag] = [tok.encode(t) for t in texts]
        assert results[flag] == [hf.encode(t).ids for t in texts], flag
    assert results[True] != results[False]
    assert vocab["Ġzebra"] in results[True][-2]


@pytest.mark.parametrize("name", ["gpt2_prefix", "roberta"])
def test_batch_call_matches_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    HF_BUILDERS[name]().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer_json(tmp_path / "tokenizer.json")
    tok.special_tokens.setdefault("pad_token", "<pad>")
    refs = [transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                 **tok.special_tokens)]
    if name == "gpt2_prefix":
        refs.append(transformers.GPT2TokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                   pad_token="<pad>", bos_token="<|endoftext|>",
                                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>"))
    texts = [PROBE[0], PROBE[1], PROBE[8], "", PROBE[2], PROBE[5]]
    pairs = [PROBE[3], "b", PROBE[2], PROBE[7], "", "tiny"]
    for ref in refs:
        assert tok.pad_token_id == ref.pad_token_id
        for text in texts:
            assert tok.encode(text) == ref(text)["input_ids"], text
        for kwargs in ({"padding": True}, {"padding": True, "truncation": True, "max_length": 9},
                       {"padding": "max_length", "truncation": True, "max_length": 40}):
            for pair in (None, pairs):
                got = tok(texts, pair, return_tensors="pt", **kwargs)
                want = ref(texts, pair, return_tensors="pt", return_token_type_ids=True, **kwargs)
                for key in ("input_ids", "attention_mask", "token_type_ids"):
                    assert torch.equal(got[key], want[key]), (kwargs, pair is not None, key)
        for ids in ref(texts)["input_ids"]:
            assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_bad_byte_level_files_are_refused(refuse):
    data = json.loads(_llama3_hf().to_str())
    refused = lambda edit, match: refuse(data, edit, match)
    two = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}}
    refused(lambda d: d["post_processor"]["processors"].extend([two, two]), "one processor besides ByteLevel")
    refused(lambda d: d["model"].update(dropout=1.5), "dropout")
    split = {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Shuffled", "invert": False}
    refused(lambda d: d.update(pre_tokenizer=split), "Split behavior 'Shuffled'")
    split = {"type": "Split", "pattern": {"Regex": "(x"}, "behavior": "Isolated", "invert": False}
    refused(lambda d: d.update(pre_tokenizer=split), "malformed")
    refused(lambda d: d.update(pre_tokenizer={"type": "UnicodeScripts"}), "pre-tokenizer 'UnicodeScripts'")
