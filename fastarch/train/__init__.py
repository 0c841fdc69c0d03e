"""Training toolkit: schedules, losses, augmentation, utilities, checkpoints and a trainer."""

from .augment import RandomCutmix, RandomMixup
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .losses import ContrastiveLoss, FocalLoss, InfoNCELoss, LabelSmoothingLoss
from .pretraining import BERTPretrainer
from .schedules import (
    CosineAnnealingWarmup,
    CosineDecayLR,
    LinearWarmupLR,
    StepDecayLR,
    cosine_decay_schedule,
    step_decay_schedule,
)
from .trainer import ArchitectureTrainer, Trainer, TransformerTrainer, epoch_permutation
from .utils import EarlyStopping, count_parameters, freeze_layers, get_gradient_norm

__all__ = [
    "BERTPretrainer", "RandomCutmix", "RandomMixup", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "ContrastiveLoss",
    "FocalLoss", "InfoNCELoss", "LabelSmoothingLoss", "CosineAnnealingWarmup", "CosineDecayLR", "LinearWarmupLR",
    "StepDecayLR", "cosine_decay_schedule", "step_decay_schedule", "ArchitectureTrainer", "Trainer",
    "TransformerTrainer", "epoch_permutation", "EarlyStopping", "count_parameters", "freeze_layers",
    "get_gradient_norm",
]
