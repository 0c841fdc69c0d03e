"""A fastarch tokenizer loaded from a file of the ``tokenizers`` library, checked against the library."""

from fastarch.tokenizers import BaseTokenizer, load_tokenizer, load_tokenizer_json, save_tokenizer_json


def assert_matches_library(hf, tmp_path, texts, pair: tuple[str, str]) -> BaseTokenizer:
    """Save the library tokenizer ``hf``, load it with fastarch and compare ids, type ids and decoded text on
    ``texts`` and the sequence ``pair``; then the same through fastarch's own format, and through the
    ``tokenizer.json`` fastarch writes back, read by the library. Returns the loaded tokenizer."""
    import tokenizers

    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = load_tokenizer_json(path)
    for text in texts:
        ref = hf.encode(text)
        assert tok.encode(text) == ref.ids, (text, ref.tokens)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False).ids, text
        for skip in (True, False):
            assert tok.decode(ref.ids, skip_special_tokens=skip) == hf.decode(ref.ids, skip_special_tokens=skip)
    ref = hf.encode(*pair)
    assert tok.encode_pair(*pair) == ref.ids
    enc = tok(*pair)
    assert enc["input_ids"] == ref.ids and enc["token_type_ids"] == ref.type_ids
    # fastarch's own format keeps the pipeline
    tok.save(tmp_path / "fastarch.json")
    native = load_tokenizer(tmp_path / "fastarch.json")
    assert [native.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert native.decode(ref.ids, skip_special_tokens=False) == tok.decode(ref.ids, skip_special_tokens=False)
    # written back, the library reads it to the same ids, type ids and text
    save_tokenizer_json(tok, tmp_path / "again.json")
    hf2 = tokenizers.Tokenizer.from_file(str(tmp_path / "again.json"))
    for text in texts:
        ids = hf.encode(text).ids
        assert hf2.encode(text).ids == ids, text
        assert hf2.decode(ids) == hf.decode(ids), text
        assert hf2.encode(text, pair[1]).type_ids == hf.encode(text, pair[1]).type_ids, text
    return tok
