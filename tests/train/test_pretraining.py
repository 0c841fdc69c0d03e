"""BERTPretrainer: 80/10/10 masking statistics, special tokens and padding never masked, MLM + NSP steps."""

import pytest
import torch

from fastarch.nn import BERTModel
from fastarch.tokenizers import WordPieceTokenizer
from fastarch.train import BERTPretrainer

TEXTS = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps while the fox runs",
         "pieces of text become ids", "masked language models predict hidden words"] * 4


@pytest.fixture(scope="module")
def tokenizer():
    tok = WordPieceTokenizer(120)
    tok.train(TEXTS)
    return tok


def _model(tok, seed=0):
    torch.manual_seed(seed)
    return BERTModel(len(tok), embed_dim=32, num_heads=2, num_layers=1, ff_dim=64, max_len=64, dropout=0.0)


def _batch(tok):
    enc = tok(TEXTS[:4], TEXTS[1:5], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "segment_ids": enc["token_type_ids"],
            "attention_mask": enc["attention_mask"], "is_next": torch.tensor([1, 0, 1, 0])}


def test_mask_statistics_and_specials(tokenizer):
    tok = tokenizer
    pre = BERTPretrainer(_model(tok), tok, seed=0)
    gen = torch.Generator().manual_seed(1)
    ordinary = torch.tensor([i for i in range(len(tok)) if i not in tok.all_special_ids])
    inputs = ordinary[torch.randint(len(ordinary), (400, 256), generator=gen)]
    inputs[:, 0] = tok.cls_token_id
    inputs[:, -1] = tok.sep_token_id
    attention = torch.ones_like(inputs)
    attention[:, 200:255] = 0  # padded positions (ordinary ids, so only the mask keeps them out)
    before = inputs.clone()
    masked, labels = pre.mask_tokens(inputs, attention_mask=attention)
    assert torch.equal(inputs, before)  # the argument is left alone
    selected = labels != -100
    assert torch.equal(labels[selected], inputs[selected])
    assert not selected[:, 0].any() and not selected[:, -1].any() and not selected[:, 200:255].any()
    eligible = attention.bool()
    eligible[:, 0] = eligible[:, -1] = False
    n_sel, n_elig = selected.sum().item(), eligible.sum().item()
    assert abs(n_sel / n_elig - 0.15) < 0.005
    as_mask = (masked == tok.mask_token_id) & selected
    unchanged = (masked == inputs) & selected
    changed_random = selected & ~as_mask & ~unchanged
    assert abs(as_mask.sum().item() / n_sel - 0.8) < 0.01
    # a random draw can hit the original token (1 / vocab of the time), so "unchanged" is a bit over 10%
    assert abs(unchanged.sum().item() / n_sel - 0.1 - 0.1 / len(tok)) < 0.01
    assert abs(changed_random.sum().item() / n_sel - 0.1 * (1 - 1 / len(tok))) < 0.01
    assert torch.equal(masked[~selected], inputs[~selected])
    # special tokens never masked, even without an attention mask
    specials = torch.tensor(tok.all_special_ids).repeat(50, 1)
    m, lab = pre.mask_tokens(specials, mask_prob=1.0)
    assert torch.equal(m, specials) and (lab == -100).all()


def test_deterministic_with_seed(tokenizer):
    batch = _batch(tokenizer)
    a = BERTPretrainer(_model(tokenizer), tokenizer, seed=3).mask_tokens(batch["input_ids"])
    b = BERTPretrainer(_model(tokenizer), tokenizer, seed=3).mask_tokens(batch["input_ids"])
    c = BERTPretrainer(_model(tokenizer), tokenizer, seed=4).mask_tokens(batch["input_ids"])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    losses = []
    for _ in range(2):
        model = _model(tokenizer)
        pre = BERTPretrainer(model, tokenizer, optimizer=torch.optim.Adam(model.parameters(), 1e-2), seed=5)
        losses.append(pre.train([batch] * 3))
    assert losses[0] == losses[1]


def test_training_reduces_loss(tokenizer):
    model = _model(tokenizer)
    pre = BERTPretrainer(model, tokenizer, optimizer=torch.optim.Adam(model.parameters(), 3e-3), seed=0)
    batch = _batch(tokenizer)
    losses = [pre.train_step(batch) for _ in range(40)]
    total = [loss.item() for loss, _, _ in losses]
    # the masks are redrawn every step, so compare averages
    assert sum(total[-5:]) / 5 < 0.75 * sum(total[:3]) / 3
    assert sum(n for _, _, n in losses[-5:]) / 5 < sum(n for _, _, n in losses[:3]) / 3  # NSP learns too
    assert all(abs(loss.item() - m - n) < 1e-5 for loss, m, n in losses)


def test_bad_input(tokenizer):
    pre = BERTPretrainer(_model(tokenizer), tokenizer, seed=0)
    with pytest.raises(TypeError, match="'inputs'"):
        pre.mask_tokens(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'mask_prob'"):
        pre.mask_tokens(torch.zeros(2, 3, dtype=torch.long), mask_prob=1.5)
    with pytest.raises(KeyError, match="is_next"):
        pre.train_step({"input_ids": torch.zeros(2, 3, dtype=torch.long), "segment_ids": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="no optimizer"):
        pre.train([])
    no_mask = WordPieceTokenizer(50, mask_token=None)
    no_mask.train(TEXTS)
    with pytest.raises(ValueError, match="mask token"):
        BERTPretrainer(_model(no_mask), no_mask)
