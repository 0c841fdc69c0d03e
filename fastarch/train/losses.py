"""Losses from guide 000: InfoNCE contrastive loss, focal loss and label smoothing (same APIs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ContrastiveLoss", "InfoNCELoss", "FocalLoss", "LabelSmoothingLoss"]


class ContrastiveLoss(nn.Module):
    """InfoNCE over two views ``(B, dim)``: each sample's positive is its other view, every other of the
    ``2B - 1`` samples is a negative; cosine similarity over ``temperature``."""

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    def forward(self, features_1: torch.Tensor, features_2: torch.Tensor) -> torch.Tensor:
        if features_1.shape != features_2.shape or features_1.dim() != 2:
            raise ValueError(f"ContrastiveLoss: expected two (batch, dim) tensors of one shape, got "
                             f"{tuple(features_1.shape)} and {tuple(features_2.shape)}")
        b = features_1.shape[0]
        z = F.normalize(torch.cat([features_1, features_2], 0), dim=1)
        sim = (z @ z.T) / self.temperature
        # The guide masks self-similarity with -1e9; -inf is the exact limit and equal in practice.
        sim = sim.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
        labels = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(z.device)
        return F.cross_entropy(sim, labels)


InfoNCELoss = ContrastiveLoss


class FocalLoss(nn.Module):
    """``alpha * (1 - p_t)^gamma * CE`` on logits ``(B, C)`` and labels ``(B,)``."""

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0, reduction: str = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.alpha, self.gamma, self.reduction = alpha, gamma, reduction

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(inputs, targets, reduction="none")
        p_t = torch.exp(-ce)
        loss = self.alpha * (1 - p_t) ** self.gamma * ce
        if self.reduction == "mean":
            return loss.mean()
        if self.reduction == "sum":
            return loss.sum()
        return loss


class LabelSmoothingLoss(nn.Module):
    """Cross-entropy against ``confidence`` on the target and ``smoothing / (K - 1)`` elsewhere (guide 000;
    note ``torch.nn.CrossEntropyLoss(label_smoothing=)`` spreads ``smoothing / K`` over all classes)."""

    def __init__(self, num_classes: int, smoothing: float = 0.1) -> None:
        super().__init__()
        if num_classes < 2 or not 0 <= smoothing < 1:
            raise ValueError(f"need num_classes >= 2 and 0 <= smoothing < 1, got {num_classes}, {smoothing}")
        self.num_classes, self.smoothing, self.confidence = num_classes, smoothing, 1.0 - smoothing

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if pred.shape[-1] != self.num_classes:
            raise ValueError(f"LabelSmoothingLoss: pred has {pred.shape[-1]} classes, expected {self.num_classes}")
        logp = pred.log_softmax(dim=-1)
        with torch.no_grad():
            true_dist = torch.full_like(logp, self.smoothing / (self.num_classes - 1))
            true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        return torch.mean(torch.sum(-true_dist * logp, dim=-1))
