import json

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # The models here are tiny: intra-op threads only add synchronisation (and spin badly on a shared CPU).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def refuse(tmp_path):
    """``refuse(data, edit, match)``: the tokenizer.json object ``data``, changed by ``edit`` on a copy, fails
    to load with a TokenizerFileError matching ``match``."""
    from fastarch.tokenizers import TokenizerFileError, load_tokenizer_json

    def check(data, edit, match):
        bad_data = json.loads(json.dumps(data))
        edit(bad_data)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(bad_data), encoding="utf-8")
        with pytest.raises(TokenizerFileError, match=match):
            load_tokenizer_json(bad)

    return check
