"""Model utilities from guide 000: parameter counts, freezing, gradient norm and early stopping."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["count_parameters", "freeze_layers", "get_gradient_norm", "EarlyStopping"]


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def freeze_layers(model: nn.Module, freeze_up_to: str | None = None, verbose: bool = True) -> int:
    """Freeze every parameter before the first whose name contains ``freeze_up_to`` (all if None).

    Returns the number of trainable parameters left, and prints the guide's summary when ``verbose``.
    """
    names = [n for n, _ in model.named_parameters()]
    if freeze_up_to is not None and not any(freeze_up_to in n for n in names):
        raise ValueError(f"freeze_layers: no parameter name contains {freeze_up_to!r}")
    freeze = True
    for name, p in model.named_parameters():
        if freeze_up_to and freeze_up_to in name:
            freeze = False
        p.requires_grad = not freeze
    trainable = count_parameters(model)
    total = sum(p.numel() for p in model.parameters())
    if verbose:
        print(f"Trainable: {trainable:,} / {total:,} ({100 * trainable / max(total, 1):.1f}%)")
    return trainable


def get_gradient_norm(model: nn.Module) -> float:
    """Global L2 norm of all gradients (one reduction, no per-tensor host syncs)."""
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


class EarlyStopping:
    """Stop after ``patience`` calls without improving by more than ``min_delta`` (mode 'min' or 'max')."""

    def __init__(self, patience: int = 7, min_delta: float = 0, mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.patience, self.min_delta, self.mode = patience, min_delta, mode
        self.counter = 0
        self.best_score: float | None = None
        self.early_stop = False

    def __call__(self, val_loss: float) -> bool:
        score = -val_loss if self.mode == "min" else val_loss
        if self.best_score is None:
            self.best_score = score
        elif score < self.best_score + self.min_delta:
            self.counter += 1
            if self.counter >= self.patience:
                self.early_stop = True
        else:
            self.best_score = score
            self.counter = 0
        return self.early_stop

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
