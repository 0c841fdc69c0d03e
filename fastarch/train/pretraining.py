"""BERT pretraining (guide 001's ``BERTPretrainer``): 80/10/10 token masking and the MLM + NSP step.

Deviations from the guide:

- special tokens (``[CLS]``, ``[SEP]``, ...) and padding are never selected for masking (the guide could mask
  them, which teaches the model nothing and corrupts the sentence boundaries);
- the 10% random / 10% unchanged split is drawn from one uniform number per position, so the shares are
  exactly 80/10/10 in expectation;
- ``mask_tokens`` does not modify its argument; a ``seed`` makes masking reproducible;
- with an ``optimizer``, ``train_step`` also runs backward and the update step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BERTPretrainer"]


def _special_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is None:
        raise TypeError(f"BERTPretrainer: argument 'tokenizer' must have 'all_special_ids', "
                        f"got {type(tokenizer).__name__}")
    return [int(i) for i in ids]


class BERTPretrainer:
    """Masked-language-model + next-sentence-prediction training of a BERT with MLM and NSP heads.

    Args:
        model: called as ``model(input_ids (B, L), segment_ids (B, L), attention_mask (B, L) or None)`` and
            returning ``(mlm_logits (B, L, V), nsp_logits (B, 2))``, like ``fastarch.nn.BERTModel``.
        tokenizer: has ``mask_token_id``, ``all_special_ids`` and ``len(tokenizer)`` (fastarch's
            ``WordPieceTokenizer`` or a transformers tokenizer).
        device: where the model and the batches go.
        optimizer: when given, ``train_step`` runs backward and ``optimizer.step()``.
        seed: seeds the generator that draws the masks (reproducible masking).
    """

    def __init__(self, model: nn.Module, tokenizer: Any, device: str | torch.device = "cpu",
                 optimizer: torch.optim.Optimizer | None = None, seed: int | None = None) -> None:
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise ValueError("BERTPretrainer: argument 'tokenizer' must define a mask token (mask_token_id is None)")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.optimizer = optimizer
        self.mask_token_id = int(mask_id)
        self.vocab_size = len(tokenizer)
        self.special_ids = torch.tensor(sorted(set(_special_ids(tokenizer))), dtype=torch.long)
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def mask_tokens(self, inputs: torch.Tensor, mask_prob: float = 0.15,
                    attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Select ``mask_prob`` of the ordinary tokens; of those, 80% become ``[MASK]``, 10% a random token,
        10% stay. Returns ``(masked_inputs, labels)``, both (B, L); labels are -100 where not selected.

        Special tokens and positions where ``attention_mask`` is 0 are never selected.
        """
        if not isinstance(inputs, torch.Tensor) or inputs.dtype not in (torch.long, torch.int, torch.int32):
            raise TypeError(f"BERTPretrainer.mask_tokens: argument 'inputs' must be an integer tensor, got "
                            f"{getattr(inputs, 'dtype', type(inputs).__name__)}")
        if not 0.0 <= mask_prob <= 1.0:
            raise ValueError(f"BERTPretrainer.mask_tokens: argument 'mask_prob' must be in [0, 1], got {mask_prob}")
        if attention_mask is not None and attention_mask.shape != inputs.shape:
            raise ValueError(f"BERTPretrainer.mask_tokens: argument 'attention_mask' must have the shape of "
                             f"inputs {tuple(inputs.shape)}, got {tuple(attention_mask.shape)}")
        g = self.generator
        cpu_inputs = inputs.detach().to("cpu", torch.long)
        eligible = ~torch.isin(cpu_inputs, self.special_ids)
        if attention_mask is not None:
            eligible &= attention_mask.detach().to("cpu") != 0
        selected = (torch.rand(cpu_inputs.shape, generator=g) < mask_prob) & eligible
        action = torch.rand(cpu_inputs.shape, generator=g)
        random_ids = torch.randint(self.vocab_size, cpu_inputs.shape, generator=g)
        labels = torch.where(selected, cpu_inputs, torch.full_like(cpu_inputs, -100))
        out = cpu_inputs.clone()
        out[selected & (action < 0.8)] = self.mask_token_id
        use_random = selected & (action >= 0.8) & (action < 0.9)
        out[use_random] = random_ids[use_random]
        return out.to(inputs.device), labels.to(inputs.device)

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        """One MLM + NSP step on ``batch`` (``input_ids``, ``segment_ids`` or ``token_type_ids``, ``is_next``
        (B,) with 1 = B follows A as in the guide, optional ``attention_mask``).
        Returns ``(loss, mlm_loss, nsp_loss)``; the loss is a tensor (already stepped with an optimizer)."""
        for key in ("input_ids", "is_next"):
            if key not in batch:
                raise KeyError(f"BERTPretrainer.train_step: argument 'batch' has no {key!r} "
                               f"(got keys {sorted(batch)})")
        seg_key = "segment_ids" if "segment_ids" in batch else "token_type_ids"
        if seg_key not in batch:
            raise KeyError(f"BERTPretrainer.train_step: argument 'batch' needs 'segment_ids' or 'token_type_ids' "
                           f"(got keys {sorted(batch)})")
        input_ids = batch["input_ids"].to(self.device)
        segment_ids = batch[seg_key].to(self.device)
        is_next = batch["is_next"].to(self.device).long()
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        masked_input_ids, mlm_labels = self.mask_tokens(input_ids, attention_mask=attention_mask)
        self.model.train()
        mlm_logits, nsp_logits = self.model(masked_input_ids, segment_ids, attention_mask)
        mlm_loss = F.cross_entropy(mlm_logits.reshape(-1, mlm_logits.size(-1)), mlm_labels.reshape(-1),
                                   ignore_index=-100)
        nsp_loss = F.cross_entropy(nsp_logits, is_next)
        loss = mlm_loss + nsp_loss
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        return loss, mlm_loss.item(), nsp_loss.item()

    def train(self, batches: Iterable[Mapping[str, torch.Tensor]]) -> list[float]:
        """``train_step`` over ``batches`` (needs an optimizer); returns the losses."""
        if self.optimizer is None:
            raise ValueError("BERTPretrainer.train: no optimizer (pass optimizer= to the constructor)")
        return [self.train_step(b)[0].item() for b in batches]
