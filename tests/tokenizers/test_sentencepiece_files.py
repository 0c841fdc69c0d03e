"""SentencePiece-converted tokenizer.json files (T5, ALBERT, XLNet layouts and a converted BPE model): the
``Precompiled`` normalizer, ``StripAccents``, and the files against the ``tokenizers`` library. The models are
trained here by ``sentencepiece`` with its default ``nmt_nfkc`` rules and converted by transformers."""

import base64
import io
import json
import random
import struct
import sys
import types
import unicodedata

import pytest

from fastarch.tokenizers import load_tokenizer_json, save_tokenizer_json
from fastarch.tokenizers.pipeline import normalize
from tests.tokenizers.library_checks import assert_matches_library

tk = pytest.importorskip("tokenizers")
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")  # transformers' converters read the model's protobuf
pytest.importorskip("transformers")
pytest.importorskip("regex")  # the Precompiled normalizer's grapheme clusters
from tokenizers import normalizers  # noqa: E402

TRAIN = [
    "SentencePiece learns pieces from raw sentences, spaces included.",
    "The lazy dog and the quick fox share a garden; neither minds the rain!",
    "Accents: café, crème brûlée, señor, naïve, Ångström and résumé.",
    "Numbers such as 2024, 3.14159 and 42 appear between the words.",
    "東京 と 大阪 は 都市 です; emoji 🙂 and symbols © ™ too.",
    "Tokenizers turn text into ids and ids back into text.",
] * 10
CONTROL = ["[CLS]", "[SEP]", "<sep>", "<cls>", "<mask>"]

# full-width forms, ligatures, compatibility characters, accents composed and decomposed (and more marks than
# one cluster of under 6 bytes holds), control characters, emoji, CJK, whitespace runs at either end, empty text,
# special tokens and the unk token's spelling written in the text
PROBE = [
    "The quick brown fox.",
    "Ｆｕｌｌ－ｗｉｄｔｈ ＡＢＣ １２３ ｶﾀｶﾅ",
    "ﬁnance ﬂow ① ㎏ ㈱ ™ ½ Ⅻ ㍻",
    "Cafe\u0301 nai\u0308ve e\u0301\u0302 a\u0300\u0301\u0302 Ａ\u0301 Café naïve",
    "ctrl\x01\x07chars\x7f \u200b\ufeff\u00ad soft",
    "emoji 🙂🎉👩\u200d👩\u200d👧 ❤\ufe0f 1\ufe0f\u20e3",
    "東京 日本語のテキスト",
    "  leading   multiple  trailing   ",
    "",
    " ",
    "a\r\nb\tc\n\nd",
    "inline </s> and <s> x <unk> [CLS]",
    "``quoted'' text",
]


def _train(tmp_path, kind, byte_fallback=False):
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAIN), model_writer=out, model_type=kind, minloglevel=2,
                                   vocab_size=400 if byte_fallback else 120, hard_vocab_limit=False,
                                   control_symbols=CONTROL, pad_id=3, byte_fallback=byte_fallback)
    path = tmp_path / f"{kind}{'_bytes' if byte_fallback else ''}.model"
    path.write_bytes(out.getvalue())
    return str(path)


def _converters():
    import transformers.convert_slow_tokenizer  # noqa: F401  (the module, which its package shadows)

    return sys.modules["transformers.convert_slow_tokenizer"]


def _converted(name, **options):
    """A tokenizer converted from the trained Unigram model by transformers' converter ``name`` (T5Converter,
    AlbertConverter, ...), given the options of the slow tokenizer it would read them from."""

    def build(tmp_path):
        path = _train(tmp_path, "unigram")
        sp = spm.SentencePieceProcessor(model_file=path)
        original = types.SimpleNamespace(vocab_file=path, convert_tokens_to_ids=sp.piece_to_id, **options)
        return getattr(_converters(), name)(original).converted()

    return build


# T5: Precompiled, Strip and Replace(" {2,}", "▁"), a Metaspace pre-tokenizer, ``$A </s>``; the unk token is not
# an added token. ALBERT and XLNet: Replace, NFKD, StripAccents, Lowercase before Precompiled, their templates.
_t5 = _converted("T5Converter", _extra_ids=3)
_albert = _converted("AlbertConverter", keep_accents=False, do_lower_case=True)
_xlnet = _converted("XLNetConverter", keep_accents=False, do_lower_case=False)
# DeBERTa-v2: Lowercase, Strip, Precompiled, a Punctuation pre-tokenizer before Metaspace
_deberta_v2 = _converted("DebertaV2Converter", split_by_punct=True, do_lower_case=True)


def _spm_bpe(tmp_path, byte_fallback=False):
    """A SentencePiece BPE model as transformers converts one without a model-specific converter: Precompiled and
    Replace(" ", "▁"), no pre-tokenizer, fuse_unk; with ``byte_fallback``, the <0xHH> pieces, and ByteFallback and
    Fuse in the decoder."""
    from tokenizers.models import BPE

    conv = _converters()
    extractor = conv.SentencePieceExtractor(_train(tmp_path, "bpe", byte_fallback))
    found = extractor.extract(BPE)
    return conv.SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, found["vocab"], found["merges"])


BUILDERS = {"t5": _t5, "albert": _albert, "xlnet": _xlnet, "deberta_v2": _deberta_v2, "spm_bpe": _spm_bpe,
            "spm_bpe_bytes": lambda tmp_path: _spm_bpe(tmp_path, byte_fallback=True)}


def _charsmap(hf):
    stage = json.loads(hf.to_str())["normalizer"]
    stages = stage["normalizers"] if stage["type"] == "Sequence" else [stage]
    return next(s["precompiled_charsmap"] for s in stages if s["type"] == "Precompiled")


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_sentencepiece_files_match_the_library(tmp_path, name):
    hf = BUILDERS[name](tmp_path)
    assert _charsmap(hf)  # the file carries the trained model's compiled rules
    if name == "spm_bpe_bytes":
        assert any(t.startswith("<0x") for text in PROBE for t in hf.encode(text).tokens)  # bytes reached
    tok = assert_matches_library(hf, tmp_path, PROBE, (PROBE[1], PROBE[3]))
    for text in PROBE:
        ref = hf.encode(text)
        # (the library's Encoding.tokens spells an unknown piece by its text; its id is the unk token's)
        assert tok.convert_ids_to_tokens(tok.encode(text)) == [hf.id_to_token(i) for i in ref.ids], text
        assert tok.decode(ref.ids, skip_special_tokens=False) == hf.decode(ref.ids, skip_special_tokens=False), text
        assert normalize(tok.normalizer, text) == hf.normalizer.normalize_str(text), text
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(hf.get_vocab_size()) for _ in range(rng.randint(0, 8))]
        assert tok.decode(ids) == hf.decode(ids), ids
    # written back, the file keeps the model and pipeline exactly
    original, again = json.loads(hf.to_str()), json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert again[key] == original[key], key
    for key, value in original["model"].items():
        assert again["model"][key] == value, key
    assert again["added_tokens"] == original["added_tokens"]


def test_unk_that_is_not_an_added_token_is_ordinary_text(tmp_path):
    """The T5 converter leaves <unk> out of the added tokens: written in the text it is segmented, and decode
    keeps it, as the library does."""
    hf = _t5(tmp_path)
    hf.save(str(tmp_path / "t5.json"))
    tok = load_tokenizer_json(tmp_path / "t5.json")
    assert tok.not_added == {"<unk>"} and "<unk>" not in tok.all_special_tokens
    ids = hf.encode("x <unk> ㈱").ids
    assert tok.encode("x <unk> ㈱") == ids and tok.unk_token_id in ids
    assert tok.decode(ids) == hf.decode(ids) and "<unk>" in tok.decode(ids)


def test_precompiled_normalizer_matches_the_library_on_every_code_point(tmp_path):
    """Each code point alone, then random runs of bases and marks: the library rewrites a grapheme cluster of
    under 6 bytes as a whole by the shortest rule its bytes start with, any other character by character."""
    encoded = _charsmap(_t5(tmp_path))
    ref = normalizers.Precompiled(base64.b64decode(encoded))
    stage = {"type": "Precompiled", "precompiled_charsmap": encoded}
    changed = 0
    for c in range(0x110000):
        if 0xD800 <= c < 0xE000 or (c > 0xFFFF and c % 7):  # all of the BMP, a sample above it
            continue
        ours = normalize(stage, chr(c))
        assert ours == ref.normalize_str(chr(c)), hex(c)
        changed += ours != chr(c)
    assert changed > 3000  # the rules do rewrite (NFKC and the NMT clean-up)
    rng = random.Random(0)
    bases = list("eaAi1 ©x\r\n") + ["Ａ", "é", "ｶ", "①", "ﬁ", "\u0600", "가", "\u1100", "\u1161", "🙂"]
    marks = [chr(c) for c in (*range(0x300, 0x370), 0x200D, 0x200C, 0xFE0F, 0x20D7, 0x20E3, 0x903, 0x93E, 0x1F3FB,
                              0xFF9E, 0x3099)]
    for _ in range(5000):
        text = "".join(rng.choice(bases + marks) for _ in range(rng.randint(1, 8)))
        assert normalize(stage, text) == ref.normalize_str(text), text


def test_strip_accents_matches_the_library():
    text = unicodedata.normalize("NFKD", "Café naïve résumé Ångström ŽŠČ Ελληνικά Ёжик e\u0301\u0302 हिन्दी ภาษาไทย")
    assert normalize({"type": "StripAccents"}, text) == normalizers.StripAccents().normalize_str(text)
    assert normalize({"type": "StripAccents"}, text).startswith("Cafe naive resume Angstrom ZSC")


def test_punctuation_and_digits_pre_tokenizers_match_the_library():
    """On random strings of letters, ASCII and Unicode punctuation, symbols and numbers of every kind."""
    from tokenizers import pre_tokenizers

    from fastarch.tokenizers.pipeline import pre_tokenize

    stages = [pre_tokenizers.Punctuation(b) for b in ("isolated", "removed", "contiguous", "merged_with_previous",
                                                      "merged_with_next")]
    stages += [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Digits(individual_digits=False)]
    alphabet = list("ab 1٣２½Ⅻ.,!?$+<=>^`|~-_()«»¿、。\u2014\u00a7x")
    rng = random.Random(0)
    for stage in stages:
        spec = json.loads(stage.__getstate__())
        for _ in range(500):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
            assert pre_tokenize(spec, text) == [w for w, _ in stage.pre_tokenize_str(text)], (spec, text)


def test_empty_charsmap_is_the_identity_and_written_back_unchanged(tmp_path):
    hf = _spm_bpe(tmp_path)
    data = json.loads(hf.to_str())
    data["normalizer"]["normalizers"][0]["precompiled_charsmap"] = ""
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    tok = load_tokenizer_json(path)
    assert normalize(tok.normalizer, "Ｆｕｌｌ ﬁ ①") == "Ｆｕｌｌ▁ﬁ▁①"
    save_tokenizer_json(tok, tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))
    assert again["normalizer"] == data["normalizer"]


def test_bad_charsmaps_are_refused(tmp_path, refuse):
    data = json.loads(_spm_bpe(tmp_path).to_str())
    raw = base64.b64decode(data["normalizer"]["normalizers"][0]["precompiled_charsmap"])
    (size,) = struct.unpack_from("<I", raw)

    def with_charsmap(value):
        return lambda d: d["normalizer"]["normalizers"][0].update(precompiled_charsmap=value)

    field = "'precompiled_charsmap'"
    refuse(data, with_charsmap("not base64!"), f"{field} is not valid base64")
    refuse(data, with_charsmap(base64.b64encode(raw[: size // 2]).decode()), f"{field} is truncated")
    refuse(data, with_charsmap(base64.b64encode(raw[:3]).decode()), f"{field} is truncated")
    refuse(data, with_charsmap(base64.b64encode(struct.pack("<I", 0)).decode()), f"{field} has an empty trie")
    refuse(data, with_charsmap(base64.b64encode(raw + b"\xff").decode()), f"{field}: .* not valid UTF-8")
    refuse(data, with_charsmap(5), f"{field} must be a base64 string")
    refuse(data, lambda d: d["normalizer"]["normalizers"][0].pop("precompiled_charsmap"), f"{field} must be a base64 string, got NoneType")


def test_precompiled_without_regex_is_refused(tmp_path, monkeypatch):
    import fastarch.tokenizers.precompiled as precompiled
    from fastarch.tokenizers import TokenizerFileError

    hf = _spm_bpe(tmp_path)
    hf.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "regex", None)
    precompiled._graphemes.cache_clear()
    try:
        with pytest.raises(TokenizerFileError, match="needs the 'regex' package"):
            load_tokenizer_json(tmp_path / "tokenizer.json")
    finally:
        precompiled._graphemes.cache_clear()
