"""One rank of ``fastarch train`` (run in-process for ``--parallel none``, else by torch.distributed.run)."""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..models import create_model
from ..optim import SGD, AdamW, Momentum
from ..train.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from ..train.schedules import CosineAnnealingWarmup
from ..train.trainer import progress_bar
from .options import build_parser

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _is_lm(model: nn.Module) -> int | None:
    """Vocabulary size when ``model`` maps token ids (B, L) to logits (B, L, V), else None."""
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, 4, dtype=torch.long))
    except Exception:
        return None
    out = out[0] if isinstance(out, (tuple, list)) else out
    return int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[1] == 4 else None


def _classifier_input(model: nn.Module) -> tuple[tuple[int, ...], int] | None:
    """(input shape without batch, number of classes) for a classifier, probed on common shapes."""
    first_linear = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    shapes = [(3, 32, 32), (1, 28, 28), (3, 64, 64), (3, 224, 224)]
    if first_linear is not None:
        shapes.insert(0, (first_linear.in_features,))
    for shape in shapes:
        try:
            with torch.no_grad():
                out = model(torch.zeros(2, *shape))
        except Exception:
            continue
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            return shape, int(out.shape[1])
    return None


def make_task(model: nn.Module, args: argparse.Namespace) -> tuple[Batch, Callable]:
    """A deterministic synthetic task: ``batch(step) -> (inputs, targets)`` for the global batch."""
    vocab = _is_lm(model)
    if vocab is not None:
        # A sparse random Markov chain: each token has 4 likely successors, so the loss can fall well below log V.
        g = torch.Generator().manual_seed(args.seed + 7)
        succ = torch.randint(0, vocab, (vocab, 4), generator=g)
        L = min(args.seq_len, getattr(model, "max_seq_len", args.seq_len) or args.seq_len)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            gs = torch.Generator().manual_seed(args.seed * 100_003 + step)
            toks = torch.empty(args.batch_size, L + 1, dtype=torch.long)
            toks[:, 0] = torch.randint(0, vocab, (args.batch_size,), generator=gs)
            choice = torch.randint(0, 4, (args.batch_size, L), generator=gs)
            for t in range(L):
                toks[:, t + 1] = succ[toks[:, t], choice[:, t]]
            return toks[:, :-1], toks[:, 1:]

        def loss_fn(out, y):
            out = out[0] if isinstance(out, (tuple, list)) else out
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        return batch, loss_fn
    probe = _classifier_input(model)
    if probe is None:
        raise ValueError(f"fastarch train: cannot tell how to feed model {args.model!r} (not a token-id language "
                         f"model nor a classifier on a common input shape)")
    shape, classes = probe
    g = torch.Generator().manual_seed(args.seed + 11)
    protos = torch.randn(classes, *shape, generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gs = torch.Generator().manual_seed(args.seed * 100_003 + step)
        y = torch.randint(0, classes, (args.batch_size,), generator=gs)
        return protos[y] + 0.5 * torch.randn(args.batch_size, *shape, generator=gs), y

    return batch, lambda out, y: F.cross_entropy(out, y)


def _make_optimizer(args: argparse.Namespace, params) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return SGD(params, lr=args.lr)
    if args.optimizer == "momentum":
        return Momentum(params, lr=args.lr, momentum=0.9)
    return AdamW(params, lr=args.lr, weight_decay=0.01)


def run(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if args.parallel != "none":
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    model = create_model(args.model).to(device)
    batch_fn, loss_fn = make_task(model, args)
    base_opt = _make_optimizer(args, model.parameters())

    from . import DDP, FSDP, ZeRO

    fsdp = None
    if args.parallel == "ddp":
        net: nn.Module = DDP(model, rank, world).model
        opt = base_opt
    elif args.parallel == "fsdp":
        fsdp = FSDP(model, rank, world)
        net = fsdp.model
        opt = _make_optimizer(args, net.parameters())
    elif args.parallel == "zero":
        z = ZeRO(model, base_opt, rank, world, stage=args.zero_stage)
        net, opt = z.model, z.optimizer
        fsdp = z if args.zero_stage > 1 else None
    else:
        net, opt = model, base_opt
    sched = CosineAnnealingWarmup(opt, warmup_steps=max(1, args.steps // 10), max_steps=args.steps + 1,
                                  lr_max=args.lr, lr_min=args.lr * 0.1)
    sched.step(0)
    out = Path(args.out)
    start = 0
    if args.resume:
        ck = latest_checkpoint(out)
        if ck is not None:
            state = load_checkpoint(ck)
            _load_state(net, opt, state, fsdp is not None)
            sched.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            start = state["step"]
            if rank == 0:
                print(f"resumed from {ck} at step {start}", flush=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(out / "metrics.csv", start)
    enabled = None if args.progress == "auto" else args.progress == "on"
    bar = progress_bar(args.steps, enabled, f"train {args.model}", start) if rank == 0 else None
    local = args.batch_size // world
    for step in range(start, args.steps):
        x, y = batch_fn(step)
        x, y = x[rank * local:(rank + 1) * local].to(device), y[rank * local:(rank + 1) * local].to(device)
        lr = opt.param_groups[0]["lr"]
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        if rank == 0:
            _append_metrics(out / "metrics.csv", step + 1, float(reported), lr)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(reported):.4f}")
            elif (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
                print(f"step {step + 1}/{args.steps} loss {float(reported):.4f} lr {lr:.2e}", flush=True)
        stop = args.stop_at is not None and step + 1 >= args.stop_at
        if (args.ckpt_every and (step + 1) % args.ckpt_every == 0) or step + 1 == args.steps or stop:
            _checkpoint(out, step + 1, net, opt, sched, fsdp is not None, rank)
        if stop:
            break
    if bar is not None:
        bar.close()
    if args.parallel != "none":
        # Free the wrapped model and optimizer (and the collectives they hold) while the group lives.
        del net, opt, sched, model, base_opt, fsdp
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _append_metrics(path: Path, step: int, loss: float, lr: float) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["step", "loss", "lr"])
        w.writerow([step, repr(loss), repr(lr)])


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    keep = [rows[0]] + [r for r in rows[1:] if int(r[0]) <= step]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(keep)


def _full_states(net: nn.Module, opt, sharded: bool):
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model_sd = (net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net).state_dict()
    if hasattr(opt, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather the shards on rank 0
        opt.consolidate_state_dict(to=0)
        opt_sd = opt.state_dict() if dist.get_rank() == 0 else None
    else:
        opt_sd = opt.state_dict()
    return model_sd, opt_sd


def _checkpoint(out: Path, step: int, net, opt, sched, sharded: bool, rank: int) -> None:
    model_sd, opt_sd = _full_states(net, opt, sharded)
    if rank == 0:
        save_checkpoint({"model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict(),
                         "rng": rng_state(), "step": step}, out / f"ckpt-{step}.pt")
    if dist.is_initialized():
        dist.barrier()


def _load_state(net, opt, state, sharded: bool) -> None:
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
        return
    (net.module if isinstance(net, nn.parallel.DistributedDataParallel) else net).load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def main() -> None:
    args = build_parser().parse_args(json.loads(os.environ["FASTARCH_TRAIN_ARGS"]))
    run(args)
    if args.parallel != "none":
        # The work is done and the process group destroyed; skip interpreter finalization, where
        # gloo's worker threads can be torn down unjoined and abort the process (std::terminate).
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
