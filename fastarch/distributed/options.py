"""The options of ``fastarch train``, shared by the launcher and every worker process.

``--batch-size`` is the global batch: every rank takes an equal slice of the same global batch, so for a
given seed ``--nproc 1`` and ``--nproc 2`` follow the same loss curve. Rank 0 prints the loss, writes
``OUT/metrics.csv`` (``step,loss,lr``) and atomic checkpoints ``OUT/ckpt-<step>.pt``; ``--resume``
continues from the latest one.
"""

from __future__ import annotations

import argparse
import difflib

DESCRIPTION = ("train a registered model on a deterministic synthetic task, alone or with DDP / FSDP / "
               "ZeRO across processes")
PARALLEL = ("none", "ddp", "fsdp", "zero")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastarch train", description=DESCRIPTION)
    p.add_argument("--model", required=True, help="a name from fastarch.models.list_models()")
    p.add_argument("--parallel", default="none", help=f"one of {', '.join(PARALLEL)}")
    p.add_argument("--nproc", type=int, default=1, help="processes (ranks)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size")
    p.add_argument("--seq-len", type=int, default=32, help="sequence length for language models")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["adamw", "sgd", "momentum"], default="adamw",
                   help="fastarch.optim optimizer (weight decay 0.01 for adamw)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="train_out")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--zero-stage", type=int, default=1, choices=[1, 2, 3])
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step as if interrupted (checkpointing first); for testing resume")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    return p


def validate(args: argparse.Namespace) -> None:
    """Raise ValueError with a clear message for a bad configuration (before any process starts)."""
    from ..models import list_models

    if args.parallel not in PARALLEL:
        raise ValueError(f"unknown --parallel {args.parallel!r}; expected one of {', '.join(PARALLEL)}")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.parallel == "none" and args.nproc != 1:
        raise ValueError("--parallel none runs one process; use --parallel ddp/fsdp/zero with --nproc > 1")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1 or args.batch_size % args.nproc:
        raise ValueError(f"--batch-size {args.batch_size} must be a positive multiple of --nproc {args.nproc}")
    if args.model not in list_models():
        close = difflib.get_close_matches(args.model, list_models(), n=4, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown --model {args.model!r}{hint}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
    if args.parallel == "fsdp" or (args.parallel == "zero" and args.zero_stage > 1):
        from . import fsdp_available

        if not fsdp_available():
            raise ValueError("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
