"""Learning-rate schedules from the guides, as plain functions and as ``torch.optim`` schedulers.

- ``step_decay_schedule`` / ``cosine_decay_schedule`` (guide 004) return ``schedule(epoch) -> lr``, the
  same contract as the guide's Keras callbacks, without TensorFlow. ``StepDecayLR``, ``CosineDecayLR`` and
  ``LinearWarmupLR`` are the same rules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.
- ``CosineAnnealingWarmup`` keeps guide 000's API (``get_lr(step)``, ``step(step)`` returning the lr) and
  adds ``state_dict``/``load_state_dict`` for exact resume; it uses ``math.pi`` where the guide wrote 3.14159.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["step_decay_schedule", "cosine_decay_schedule", "StepDecayLR", "CosineDecayLR", "LinearWarmupLR",
           "CosineAnnealingWarmup"]


def step_decay_schedule(initial_lr: float = 1e-3, decay_factor: float = 0.75, step_size: int = 10
                        ) -> Callable[[int], float]:
    """``lr(epoch) = initial_lr * decay_factor ** (epoch // step_size)``."""
    if step_size < 1:
        raise ValueError(f"step_size must be >= 1, got {step_size}")
    return lambda epoch: initial_lr * (decay_factor ** (epoch // step_size))


def cosine_decay_schedule(initial_lr: float = 1e-3, total_epochs: int = 100) -> Callable[[int], float]:
    """``lr(epoch) = initial_lr * (1 + cos(pi * epoch / total_epochs)) / 2``."""
    if total_epochs < 1:
        raise ValueError(f"total_epochs must be >= 1, got {total_epochs}")
    return lambda epoch: initial_lr * (1 + math.cos(epoch * math.pi / total_epochs)) / 2


class StepDecayLR(LRScheduler):
    """Multiply each group's base lr by ``decay_factor ** (epoch // step_size)``."""

    def __init__(self, optimizer: torch.optim.Optimizer, decay_factor: float = 0.75, step_size: int = 10,
                 last_epoch: int = -1) -> None:
        if step_size < 1:
            raise ValueError(f"step_size must be >= 1, got {step_size}")
        self.decay_factor, self.step_size = decay_factor, step_size
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [b * self.decay_factor ** (self.last_epoch // self.step_size) for b in self.base_lrs]


class CosineDecayLR(LRScheduler):
    """``base_lr * (1 + cos(pi * t / total)) / 2``, held at 0 after ``total`` steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_epochs: int = 100, last_epoch: int = -1) -> None:
        if total_epochs < 1:
            raise ValueError(f"total_epochs must be >= 1, got {total_epochs}")
        self.total_epochs = total_epochs
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        t = min(self.last_epoch, self.total_epochs)
        return [b * (1 + math.cos(math.pi * t / self.total_epochs)) / 2 for b in self.base_lrs]


class LinearWarmupLR(LRScheduler):
    """Linear warm-up from 0 to the base lr over ``warmup_steps``, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, last_epoch: int = -1) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        f = 1.0 if self.warmup_steps == 0 else min(1.0, self.last_epoch / self.warmup_steps)
        return [b * f for b in self.base_lrs]


class CosineAnnealingWarmup:
    """Guide 000: linear warm-up to ``lr_max`` over ``warmup_steps``, then cosine to ``lr_min`` at ``max_steps``.

    ``step(step)`` sets every group's lr and returns it; ``step()`` with no argument advances by one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, lr_max: float,
                 lr_min: float = 0, last_epoch: int = -1) -> None:
        if warmup_steps < 0 or max_steps <= warmup_steps:
            raise ValueError(f"need 0 <= warmup_steps < max_steps, got warmup_steps={warmup_steps}, "
                             f"max_steps={max_steps}")
        self.optimizer = optimizer
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.lr_max, self.lr_min = lr_max, lr_min
        self.last_epoch = last_epoch

    def get_lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr_max * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.max_steps - self.warmup_steps))
        return self.lr_min + 0.5 * (self.lr_max - self.lr_min) * (1 + math.cos(progress * math.pi))

    def step(self, step: int | None = None) -> float:
        self.last_epoch = self.last_epoch + 1 if step is None else step
        lr = self.get_lr(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
