"""Added tokens with the ``tokenizers`` library's options (``lstrip``, ``rstrip``, ``single_word``,
``normalized``, special or not), read from and written to ``tokenizer.json``, against the library."""

import json

import pytest

from fastarch.tokenizers import WordPieceTokenizer, load_tokenizer, load_tokenizer_json, save_tokenizer_json
from tests.tokenizers.library_checks import assert_matches_library
from tests.tokenizers.test_byte_fallback import PROBE as FALLBACK_PROBE
from tests.tokenizers.test_byte_fallback import _llama2_bpe
from tests.tokenizers.test_byte_level_bpe import _byte_level_hf, _roberta_hf
from tests.tokenizers.test_hf_format import HF_BUILDERS as PLAIN_BUILDERS
from tests.tokenizers.test_hf_format import PROBE

tk = pytest.importorskip("tokenizers")
from tokenizers import AddedToken  # noqa: E402

ADDED_PROBE = [
    "a <xmask> b", "x<xmask>y", "  <xmask>  ", "<xmask><xmask> <xmask>\t\u3000<xmask>",
    "[R]   tail [R]x", "xyzzy axyzzy xyzzy, xyzzyb (xyzzy)", "Hello There hello there hello therefore",
    "qq  qq qqq  aqq qq\tqq", "e e, ee e\u0301 é e", "<xmask>qq [R] xyzzy e", "",
]


def _add_tokens(hf, normalized: bool):
    """Special tokens with lstrip / rstrip, and non-special ones with single_word, all options, and a single
    character the model has too; ``normalized``: also tokens matched on the normalized text."""
    hf.add_special_tokens([AddedToken("<xmask>", lstrip=True, normalized=False),
                           AddedToken("[R]", rstrip=True, normalized=False)])
    hf.add_tokens([AddedToken("xyzzy", single_word=True, normalized=False),
                   AddedToken("e", single_word=True, normalized=False)])
    if normalized:
        hf.add_tokens([AddedToken("hello there", normalized=True),
                       AddedToken("qq", single_word=True, lstrip=True, rstrip=True, normalized=True)])
    return hf


BUILDERS = {**{name: (build, True) for name, build in PLAIN_BUILDERS.items()},
            "gpt2": (lambda: _byte_level_hf(True), True), "roberta": (_roberta_hf, True),
            # the Prepend normalizer changes every text, so Llama 2 files can only have raw-matched tokens
            "llama2_byte_fallback": (_llama2_bpe, False)}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_added_token_options_match_the_library(tmp_path, name):
    build, normalized = BUILDERS[name]
    hf = _add_tokens(build(), normalized)
    texts = PROBE + FALLBACK_PROBE + ADDED_PROBE
    tok = assert_matches_library(hf, tmp_path, texts, (ADDED_PROBE[0], ADDED_PROBE[5]))
    for text in texts:
        assert tok.convert_ids_to_tokens(tok.encode(text)) == [
            hf.id_to_token(i) for i in hf.encode(text).ids], text
    # non-special added tokens are kept by decode(skip_special_tokens=True), special ones dropped
    ids = hf.encode("xyzzy <xmask> e").ids
    assert tok.decode(ids) == hf.decode(ids) and "xyzzy" in tok.decode(ids) and "<xmask>" not in tok.decode(ids)
    assert "<xmask>" in tok.all_special_tokens and "xyzzy" not in tok.all_special_tokens
    # written back: the same added tokens (ids and options) and the same model vocabulary
    original = json.loads(hf.to_str())
    again = json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))
    assert again["added_tokens"] == original["added_tokens"]
    assert again["model"]["vocab"] == original["model"]["vocab"]
    native = load_tokenizer(tmp_path / "fastarch.json")
    assert native.added_token_flags == tok.added_token_flags and native.added_only == tok.added_only


def test_added_only_tokens_are_not_model_pieces(tmp_path):
    """A non-special added token missing from the model's vocabulary is never produced by the model: where its
    single_word rule rejects a match, the model segments the text as if the token did not exist."""
    hf = PLAIN_BUILDERS["wordpiece"]()
    hf.add_tokens([AddedToken("quick", single_word=True, normalized=False)])
    assert json.loads(hf.to_str())["model"]["vocab"].get("quick") is not None  # in the model already
    hf.add_tokens([AddedToken("quickfox", single_word=True, normalized=False)])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer_json(tmp_path / "tokenizer.json")
    assert tok.added_only == {"quickfox"}
    for text in ["quickfox", "the quickfox.", "aquickfox quickfoxb quick quickly"]:
        assert tok.encode(text) == hf.encode(text).ids, text
    assert "quickfox" not in tok.convert_ids_to_tokens(tok.encode("aquickfox"))


def test_added_tokens_refusals(tmp_path, refuse):
    hf = _add_tokens(PLAIN_BUILDERS["bpe_suffix"](), True)
    data = json.loads(hf.to_str())
    refused = lambda edit, match: refuse(data, edit, match)  # noqa: E731
    # lowercased by the normalizer: the library would match "hello there" and return that spelling
    next_id = hf.get_vocab_size()
    refused(lambda d: d["added_tokens"].append({**d["added_tokens"][-1], "content": "Hello", "id": next_id}),
            "normalized=true and the normalizer changes it to 'hello'")
    refused(lambda d: d["added_tokens"][-1].update(rstrip=1), "field 'rstrip' must be a bool")
    tok = WordPieceTokenizer(120)
    tok.train(PROBE)
    save_tokenizer_json(tok, tmp_path / "wp.json")
    tok.save(tmp_path / "native.json")
    native = json.loads((tmp_path / "native.json").read_text(encoding="utf-8"))
    native["added_token_flags"] = {"[MASK]": {"lstrip": "yes"}}
    (tmp_path / "bad.json").write_text(json.dumps(native), encoding="utf-8")
    with pytest.raises(ValueError, match="added_token_flags"):
        load_tokenizer(tmp_path / "bad.json")
