"""BERT uncased parity: a vocab.txt written by the test, encoded by fastarch and, when installed, by the
`tokenizers` / `transformers` BERT tokenizers; otherwise against ids derived by hand from BERT's rules."""

import string

import pytest

from fastarch.tokenizers import BasicTokenizer, TokenizerFileError, WordPieceTokenizer

WORDS = ["the", "quick", "brown", "fox", "jump", "over", "lazy", "dog", "hello", "world", "cafe", "naive",
         "resume", "un", "token", "don", "t", "100", "50", "fun", "a", "is", "中", "国", "人", "日"]
PIECES = ["##s", "##ed", "##believ", "##able", "##izer", "##ization", "##iz", "##ation", "##0", "##5"]


def _vocab():
    toks = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    toks += list(string.punctuation)
    toks += list(string.ascii_lowercase) + ["##" + c for c in string.ascii_lowercase]
    toks += list(string.digits)
    toks += WORDS + PIECES
    seen, out = set(), []
    for t in toks:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


@pytest.fixture()
def vocab_file(tmp_path):
    p = tmp_path / "vocab.txt"
    p.write_text("".join(t + "\n" for t in _vocab()), encoding="utf-8")
    return p


TEXTS = [
    "Hello, World!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve RÉSUMÉ",
    "中国人 hello日本",
    "unbelievable tokenization tokenizer",
    "$100 + 50% = ~fun~ (a|b) [x] {y} <z> ^_^ `q` @home #tag",
    "x" * 101 + " ok",
    "qzx1 unknownword",
    "\thello\nworld\r\n  spaced\u3000out",
    "\x00hello\u200bworld\ufffd",
    "[CLS] hello [SEP] world [MASK]",
    "don't jump!!!",
    "hello 😀 world",
    "Ünïcödé àccents ñ",
    "",
]


def test_hand_derived_ids(vocab_file):
    tok = WordPieceTokenizer.from_vocab_file(vocab_file, lowercase=True)
    v = {t: i for i, t in enumerate(_vocab())}

    def ids(*toks):
        return [v["[CLS]"]] + [v[t] for t in toks] + [v["[SEP]"]]

    assert tok.encode("Hello, World!") == ids("hello", ",", "world", "!")
    # accents stripped after lowercasing: cafe naive resume
    assert tok.encode("Café naïve RÉSUMÉ") == ids("cafe", "naive", "resume")
    # CJK characters become words of their own; 本 is not in the vocab -> [UNK]
    assert tok.encode("中国人 hello日本") == ids("中", "国", "人", "hello", "日", "[UNK]")
    # greedy longest match first: un ##believ ##able; token ##ization; token ##izer
    assert tok.encode("unbelievable tokenization tokenizer") == ids(
        "un", "##believ", "##able", "token", "##ization", "token", "##izer")
    # ASCII symbols split as punctuation
    assert tok.encode("$100 + 50%") == ids("$", "100", "+", "50", "%")
    # a word over 100 characters is one [UNK]
    assert tok.encode("x" * 101 + " ok") == ids("[UNK]", "o", "##k")
    # q z x then "1" has no ##1 piece -> the whole word is [UNK]
    assert tok.encode("qzx1") == ids("[UNK]")
    assert tok.encode("qzx") == ids("q", "##z", "##x")
    # whitespace normalisation, control/format characters dropped (U+200B is Cf)
    assert tok.encode("\thello\nworld\r\n") == ids("hello", "world")
    # -> "helloworld": longest prefix "hello", then no "##world" piece, so letter pieces
    assert tok.encode("\x00hello\u200bworld\ufffd") == ids("hello", "##w", "##o", "##r", "##l", "##d")
    # special tokens written in the text keep their ids
    assert tok.encode("[CLS] hello [SEP]", add_special_tokens=False) == [v["[CLS]"], v["hello"], v["[SEP]"]]
    assert tok.encode("don't", add_special_tokens=False) == [v["don"], v["'"], v["t"]]
    assert tok.encode("", add_special_tokens=True) == ids()
    assert tok.tokenize("jumps") == ["jump", "##s"]


def test_basic_tokenizer_rules():
    b = BasicTokenizer(do_lower_case=True)
    assert b.tokenize("Héllo,wörld! 中文") == ["hello", ",", "world", "!", "中", "文"]
    assert b.tokenize("a\u00a0b\u2003c") == ["a", "b", "c"]  # Zs spaces
    assert BasicTokenizer(do_lower_case=False).tokenize("Héllo") == ["Héllo"]


def test_decode_inverts_encode(vocab_file):
    tok = WordPieceTokenizer.from_vocab_file(vocab_file)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    # the WordPiece decoder removes the space before punctuation, as transformers' BERT tokenizer does
    assert tok.decode(ids) == "the quick brown fox jumps over the lazy dog."
    tok.decoder = {**tok.decoder, "cleanup": False}
    assert tok.decode(ids) == "the quick brown fox jumps over the lazy dog ."
    assert tok.decode(ids, clean_up_tokenization_spaces=True) == "the quick brown fox jumps over the lazy dog."
    assert tok.decode(ids, skip_special_tokens=False).startswith("[CLS] the")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        if tok.vocab["[UNK]"] in ids:
            continue
        # decode gives BERT's normalised text, which encodes to the same ids
        assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids


def test_parity_with_huggingface_tokenizers(vocab_file):
    hf = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    ref = hf.BertWordPieceTokenizer(str(vocab_file), lowercase=True)
    tok = WordPieceTokenizer.from_vocab_file(vocab_file, lowercase=True)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text).ids, text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False).ids, text
    assert tok.encode_pair("hello world", "the dog") == ref.encode("hello world", "the dog").ids


def test_parity_with_transformers(vocab_file):
    tr = pytest.importorskip("transformers", reason="the `transformers` package is not installed")
    ref = tr.BertTokenizer(str(vocab_file), do_lower_case=True)
    tok = WordPieceTokenizer.from_vocab_file(vocab_file, lowercase=True)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text


def test_malformed_vocab_files(tmp_path):
    p = tmp_path / "v.txt"
    with pytest.raises(TokenizerFileError, match="no such vocab file"):
        WordPieceTokenizer.from_vocab_file(tmp_path / "missing.txt")
    p.write_text("[UNK]\nhello\n\nworld\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="line 3"):
        WordPieceTokenizer.from_vocab_file(p)
    p.write_text("[UNK]\nhello\nhello\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="appears on lines 2 and 3"):
        WordPieceTokenizer.from_vocab_file(p)
    p.write_text("hello\nworld\n", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="unknown token"):
        WordPieceTokenizer.from_vocab_file(p)
    p.write_bytes(b"[UNK]\n\xff\xfe\n")
    with pytest.raises(TokenizerFileError, match="UTF-8"):
        WordPieceTokenizer.from_vocab_file(p)
    p.write_text("", encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="empty"):
        WordPieceTokenizer.from_vocab_file(p)


def test_vocab_file_round_trip(vocab_file, tmp_path):
    tok = WordPieceTokenizer.from_vocab_file(vocab_file)
    out = tmp_path / "out.txt"
    tok.save_vocab_file(out)
    assert out.read_text(encoding="utf-8") == vocab_file.read_text(encoding="utf-8")
    js = tmp_path / "wp.json"
    tok.save(js)
    back = WordPieceTokenizer.load(js)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)


def _random_texts(n, seed=0):
    import random

    rng = random.Random(seed)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") * 4
                + list(string.punctuation) + list("éèêëàâäïîôöùûüçñÉÀÖÜß") + list("中国人日本語") + list("😀€£¥§©°±")
                + [" "] * 20 + ["\t", "\n", "\r", "\u00a0", "\u3000", "\u200b", "\x00", "\x07", "\ufffd", "\u0301"])
    words = WORDS + [p[2:] for p in PIECES] + ["Hello", "WORLD", "Café", "unbelievable", "tokenization"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.5:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))))
        out.append(rng.choice(["", " ", "  "]).join(parts) if rng.random() < 0.3 else " ".join(parts))
    return out


@pytest.mark.parametrize("lib", ["tokenizers", "transformers"])
def test_parity_fuzz(vocab_file, lib):
    mod = pytest.importorskip(lib, reason=f"the `{lib}` package is not installed")
    tok = WordPieceTokenizer.from_vocab_file(vocab_file, lowercase=True)
    if lib == "tokenizers":
        ref = mod.BertWordPieceTokenizer(str(vocab_file), lowercase=True)

        def ref_ids(t):
            return ref.encode(t).ids
    else:
        ref = mod.BertTokenizer(str(vocab_file), do_lower_case=True)
        ref_ids = ref.encode
    for text in _random_texts(300):
        assert tok.encode(text) == ref_ids(text), repr(text)
