"""A trainer with gradient clipping and accumulation, AMP, progress, CSV/JSON metrics, atomic checkpoints
and exact resume; plus the guides' ``TransformerTrainer`` and ``ArchitectureTrainer`` APIs on top of it.

Exact resume: a checkpoint holds the model, optimizer, scheduler, RNG states and the data position
(epoch, batch in epoch). Batches come from a permutation seeded by ``(seed, epoch)`` and are assembled
without a DataLoader iterator (whose creation draws from the global RNG), so an interrupted run that
resumes reaches the same final weights as an uninterrupted one.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import Dataset, default_collate

from .checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state

__all__ = ["Trainer", "TransformerTrainer", "ArchitectureTrainer", "epoch_permutation", "validate_trainer_state"]


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of ``epoch``: a permutation of ``range(n)`` fixed by ``(seed, epoch)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def progress_bar(total: int | None, enabled: bool | None, desc: str, initial: int = 0) -> Any:
    """A tqdm bar on stderr, or None when disabled (``enabled=None``: when stderr is a terminal) or when the
    optional tqdm is not installed."""
    use = sys.stderr.isatty() if enabled is None else enabled
    if not use:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)


_STATE_KEYS = {"model", "optimizer", "scheduler", "scaler", "rng", "position"}
_REQUIRED_KEYS = ("model", "optimizer", "rng", "position")
# Optimizer state entries that torch.optim and fastarch.optim keep in the shape of their parameter.
_PARAM_SHAPED = {"m", "v", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                 "sum", "ax", "prev"}


def _bad(field: str, expected: str, got: Any, exc: type[Exception] = ValueError) -> Exception:
    shown = repr(got) if isinstance(got, (int, float, str, bool, type(None))) else type(got).__name__
    return exc(f"Trainer.load_checkpoint: field '{field}' must be {expected}, got {shown}")


def _check_model_state(state: Any, model: nn.Module) -> None:
    if not isinstance(state, dict):
        raise _bad("model", "a state_dict (dict)", state, TypeError)
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"Trainer.load_checkpoint: field 'model' does not match the model: missing keys "
                         f"{missing[:8]}, unexpected keys {extra[:8]}")
    for key, ref in want.items():
        got = state[key]
        if isinstance(ref, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                raise _bad(f"model.{key}", f"a tensor of shape {tuple(ref.shape)}", got, TypeError)
            if got.shape != ref.shape:
                raise ValueError(f"Trainer.load_checkpoint: field 'model.{key}' must have shape "
                                 f"{tuple(ref.shape)}, got {tuple(got.shape)}")
            if got.is_complex() != ref.is_complex():  # copy_ would fail (or drop the imaginary part)
                raise _bad(f"model.{key}", f"a tensor of a dtype convertible to {ref.dtype}", str(got.dtype),
                           TypeError)


def _check_optimizer_state(state: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list) \
            or not isinstance(state.get("state"), dict):
        raise _bad("optimizer", "an optimizer state_dict (a dict with 'state' and 'param_groups')", state,
                   TypeError)
    groups, saved = optimizer.param_groups, state["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"Trainer.load_checkpoint: field 'optimizer.param_groups' has {len(saved)} groups but "
                         f"the optimizer has {len(groups)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (g, ref) in enumerate(zip(saved, groups)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise _bad(f"optimizer.param_groups[{i}]", "a dict with a 'params' list", g, TypeError)
        if len(g["params"]) != len(ref["params"]):
            raise ValueError(f"Trainer.load_checkpoint: field 'optimizer.param_groups[{i}].params' has "
                             f"{len(g['params'])} parameters but the optimizer's group has {len(ref['params'])}")
        params.update(zip(g["params"], ref["params"]))
    for pid, entry in state["state"].items():
        if pid not in params:
            raise ValueError(f"Trainer.load_checkpoint: field 'optimizer.state' holds an entry for parameter "
                             f"{pid!r}, which no param group lists")
        if not isinstance(entry, dict):
            raise _bad(f"optimizer.state[{pid!r}]", "a dict", entry, TypeError)
        p = params[pid]
        current = optimizer.state.get(p, {})
        for name, value in entry.items():
            # The shape this entry has now, else the parameter's for the entries known to take it.
            now = current.get(name)
            want = tuple(now.shape) if isinstance(now, torch.Tensor) and now.dim() > 0 else (
                tuple(p.shape) if name in _PARAM_SHAPED else None)
            if want is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != want):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"Trainer.load_checkpoint: field 'optimizer.state[{pid!r}].{name}' must have "
                                 f"shape {want}, got {got}")


def _check_rng_state(st: Any) -> None:
    if not isinstance(st, dict) or "torch" not in st or "python" not in st:
        raise _bad("rng", "a dict with 'torch' and 'python' states", st, TypeError)
    t = st["torch"]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _bad("rng.torch", "a 1-D uint8 tensor (torch.get_rng_state())", t, TypeError)
    try:  # on a private generator and a private Random: the global states stay as they are
        torch.Generator().set_state(t.cpu())
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"Trainer.load_checkpoint: field 'rng.torch' is not a CPU generator state: {e}") from None
    py = st["python"]
    try:
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
    except (TypeError, ValueError, IndexError, KeyError, OverflowError) as e:
        raise ValueError(f"Trainer.load_checkpoint: field 'rng.python' is not a random.getstate() value: "
                         f"{e}") from None
    if "cuda" in st and torch.cuda.is_available():
        cuda = st["cuda"]
        if not isinstance(cuda, (list, tuple)) or len(cuda) != torch.cuda.device_count() or not all(
                isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda):
            raise _bad("rng.cuda", f"a list of {torch.cuda.device_count()} uint8 tensors", cuda, TypeError)


def validate_trainer_state(state: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                           scaler: Any = None) -> None:
    """Check a :meth:`Trainer.state_dict` against the objects it would be loaded into, changing nothing."""
    if not isinstance(state, dict):
        raise _bad("<checkpoint>", "a dict", state, TypeError)
    missing = [k for k in _REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"Trainer.load_checkpoint: the checkpoint lacks the fields {missing}")
    extra = sorted(str(k) for k in set(state) - _STATE_KEYS)
    if extra:
        raise ValueError(f"Trainer.load_checkpoint: the checkpoint has unknown fields {extra}")
    _check_model_state(state["model"], model)
    _check_optimizer_state(state["optimizer"], optimizer)
    for name, obj in (("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and state.get(name) is not None and not isinstance(state[name], dict):
            raise _bad(name, "a state_dict (dict) or None", state[name], TypeError)
    _check_rng_state(state["rng"])
    pos = state["position"]
    if not isinstance(pos, dict):
        raise _bad("position", "a dict with 'step', 'epoch' and 'batch_in_epoch'", pos, TypeError)
    for key in ("step", "epoch", "batch_in_epoch"):
        if key not in pos:
            raise ValueError(f"Trainer.load_checkpoint: field 'position.{key}' is missing")
        v = pos[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise _bad(f"position.{key}", "an int >= 0", v, TypeError if not isinstance(v, int) else ValueError)
    extra = sorted(str(k) for k in set(pos) - {"step", "epoch", "batch_in_epoch"})
    if extra:
        raise ValueError(f"Trainer.load_checkpoint: field 'position' has unknown keys {extra}")


class MetricsLogger:
    """Appends rows to ``metrics.csv`` and ``metrics.jsonl`` in ``folder``."""

    def __init__(self, folder: str | Path | None, fields: Iterable[str]) -> None:
        self.folder = Path(folder) if folder else None
        self.fields = list(fields)
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)

    def log(self, row: dict[str, Any]) -> None:
        if not self.folder:
            return
        path = self.folder / "metrics.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)
        with open(self.folder / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop rows past ``step`` (after resuming from an earlier checkpoint)."""
        if not self.folder or not (self.folder / "metrics.csv").exists():
            return
        with open(self.folder / "metrics.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        with open(self.folder / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        jl = self.folder / "metrics.jsonl"
        if jl.exists():
            keep = [ln for ln in jl.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            jl.write_text("".join(k + "\n" for k in keep))


class Trainer:
    """Train ``model`` with ``optimizer`` on a map-style dataset.

    ``loss_fn(model, batch) -> loss`` computes the loss of a batch (default: ``batch = (x, y)`` and
    cross-entropy on ``model(x)``). ``accumulation_steps`` micro-batches make one optimizer step;
    ``grad_clip`` clips the global norm (None disables); ``amp`` runs the forward under autocast
    (bf16 on CPU, fp16 with a GradScaler on CUDA). Checkpoints go to ``checkpoint_dir`` every
    ``checkpoint_every`` optimizer steps as ``ckpt-<step>.pt``; metrics to ``log_dir``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None, scheduler: Any = None, *,
                 device: str | torch.device = "cpu", grad_clip: float | None = 1.0, accumulation_steps: int = 1,
                 amp: bool = False, amp_dtype: torch.dtype | None = None, log_dir: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, seed: int = 0,
                 progress: bool | None = None) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.loss_fn = loss_fn or self._default_loss
        self.grad_clip, self.accumulation_steps = grad_clip, accumulation_steps
        self.amp = amp
        self.amp_dtype = amp_dtype or (torch.float16 if self.device.type == "cuda" else torch.bfloat16)
        self.scaler = torch.amp.GradScaler("cuda") if amp and self.device.type == "cuda" and \
            self.amp_dtype == torch.float16 else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.seed, self.progress = seed, progress
        self.logger = MetricsLogger(log_dir, ["step", "epoch", "loss", "lr", "grad_norm", "time"])
        self.step = 0  # optimizer steps taken
        self.epoch = 0
        self.batch_in_epoch = 0

    @staticmethod
    def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch

    def compute_loss(self, batch: Any) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp):
            return self.loss_fn(self.model, self._to_device(batch))

    def optimizer_step(self) -> float:
        """Unscale, clip, step the optimizer and scheduler, zero grads; return the pre-clip grad norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in params]))) \
                if params else 0.0
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_state(),
            "position": {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. All or nothing: the whole state is checked against the model,
        optimizer, scheduler, scaler, RNG and position first (a ``ValueError`` or ``TypeError`` naming the
        field), and should applying still fail, the optimizer, scheduler and scaler are put back as they were
        (the model is loaded last of them, and RNG and position only after it)."""
        validate_trainer_state(state, self.model, self.optimizer, self.scheduler, self.scaler)
        saved = (self.optimizer.state_dict(),
                 None if self.scheduler is None else copy.deepcopy(self.scheduler.state_dict()),
                 None if self.scaler is None else self.scaler.state_dict())
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scheduler is not None and state.get("scheduler") is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and state.get("scaler") is not None:
                self.scaler.load_state_dict(state["scaler"])
            self.model.load_state_dict(state["model"])
        except BaseException:
            self.optimizer.load_state_dict(saved[0])
            if self.scheduler is not None:
                self.scheduler.load_state_dict(saved[1])
            if self.scaler is not None:
                self.scaler.load_state_dict(saved[2])
            raise
        set_rng_state(state["rng"])
        pos = state["position"]
        self.step, self.epoch, self.batch_in_epoch = pos["step"], pos["epoch"], pos["batch_in_epoch"]

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("save_checkpoint: no path given and no checkpoint_dir set")
            path = self.checkpoint_dir / f"ckpt-{self.step}.pt"
        return save_checkpoint(self.state_dict(), path)

    def load_checkpoint(self, path: str | Path | None = None) -> bool:
        """Load ``path`` or the latest checkpoint in ``checkpoint_dir``; False when there is none."""
        if path is None:
            path = latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
            if path is None:
                return False
        self.load_state_dict(load_checkpoint(path, map_location=self.device))
        self.logger.truncate_after(self.step)
        return True

    # -- training -----------------------------------------------------------------------------------
    def fit(self, dataset: Dataset, *, batch_size: int = 32, epochs: int = 1, max_steps: int | None = None,
            resume: bool = False, collate: Callable[[list[Any]], Any] = default_collate) -> list[float]:
        """Train for ``epochs`` (or until ``max_steps`` optimizer steps); return the per-step losses."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if resume:
            self.load_checkpoint()
        n = len(dataset)  # type: ignore[arg-type]
        per_epoch = n // batch_size
        if per_epoch == 0:
            raise ValueError(f"dataset of {n} samples gives no full batch of {batch_size}")
        total = max_steps if max_steps is not None else epochs * per_epoch // self.accumulation_steps
        bar = progress_bar(total, self.progress, "train")
        if bar is not None:
            bar.update(self.step)
        losses: list[float] = []
        self.model.train()
        micro, acc_loss, t0 = 0, 0.0, time.perf_counter()
        while self.epoch < epochs and (max_steps is None or self.step < max_steps):
            order = epoch_permutation(n, self.seed, self.epoch)
            while self.batch_in_epoch < per_epoch and (max_steps is None or self.step < max_steps):
                idx = order[self.batch_in_epoch * batch_size:(self.batch_in_epoch + 1) * batch_size]
                batch = collate([dataset[int(i)] for i in idx])
                loss = self.compute_loss(batch) / self.accumulation_steps
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                acc_loss += float(loss)
                micro += 1
                self.batch_in_epoch += 1
                if micro == self.accumulation_steps:
                    lr = self.optimizer.param_groups[0]["lr"]
                    norm = self.optimizer_step()
                    if not math.isfinite(acc_loss):
                        raise FloatingPointError(f"loss became {acc_loss} at step {self.step}")
                    losses.append(acc_loss)
                    self.logger.log({"step": self.step, "epoch": self.epoch, "loss": acc_loss, "lr": lr,
                                     "grad_norm": norm, "time": time.perf_counter() - t0})
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{acc_loss:.4f}")
                    micro, acc_loss = 0, 0.0
                    if self.checkpoint_every and self.step % self.checkpoint_every == 0:
                        self.save_checkpoint()
            if self.batch_in_epoch >= per_epoch:
                self.epoch += 1
                self.batch_in_epoch = 0
        if bar is not None:
            bar.close()
        return losses

    @torch.no_grad()
    def evaluate(self, dataset: Dataset, batch_size: int = 64,
                 collate: Callable[[list[Any]], Any] = default_collate) -> float:
        self.model.eval()
        total, count = 0.0, 0
        n = len(dataset)  # type: ignore[arg-type]
        for s in range(0, n, batch_size):
            batch = collate([dataset[i] for i in range(s, min(n, s + batch_size))])
            total += float(self.compute_loss(batch)) * (min(n, s + batch_size) - s)
            count += min(n, s + batch_size) - s
        self.model.train()
        return total / max(count, 1)


class TransformerTrainer:
    """Guide 004's API: ``create_mask(src, tgt)``, ``train_step(src, tgt)``, ``train_epoch(loader)``.

    ``train_step`` runs ``model(src, src_mask)``, cross-entropy against ``tgt`` ignoring padding id 0,
    clips the gradient norm at 1 and steps the optimizer and scheduler, as the guide does.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 accumulation_steps: int = 1, amp: bool = False) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.criterion = nn.CrossEntropyLoss(ignore_index=0)
        device = next(model.parameters()).device
        self._trainer = Trainer(model, optimizer, scheduler=scheduler, device=device, grad_clip=1.0,
                                accumulation_steps=accumulation_steps, amp=amp, progress=False)
        self._micro = 0

    @staticmethod
    def create_mask(src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src_mask = (src != 0).unsqueeze(1).unsqueeze(2)
        tgt_mask = (tgt != 0).unsqueeze(1).unsqueeze(3)
        L = tgt.size(1)
        nopeak = torch.ones(1, L, L, device=tgt.device).triu(diagonal=1) == 0
        return src_mask, tgt_mask & nopeak

    def train_step(self, src: torch.Tensor, tgt: torch.Tensor) -> float:
        self.model.train()
        src_mask, _ = self.create_mask(src, tgt)

        def loss_fn(model, batch):
            s, t = batch
            out = model(s, src_mask)
            return self.criterion(out.reshape(-1, out.size(-1)), t.reshape(-1))

        self._trainer.loss_fn = loss_fn
        loss = self._trainer.compute_loss((src, tgt))
        (loss / self._trainer.accumulation_steps).backward()
        self._micro += 1
        if self._micro == self._trainer.accumulation_steps:
            self._trainer.optimizer_step()
            self._micro = 0
        return float(loss)

    def train_epoch(self, data_loader: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        losses = [self.train_step(src, tgt) for src, tgt in data_loader]
        return sum(losses) / max(len(losses), 1)


class ArchitectureTrainer:
    """Guide 001's API: ``train_epoch(loader) -> (loss, acc%)``, ``evaluate(loader)``, ``train(train, val,
    epochs)`` with AdamW(1e-3, wd 0.01), cosine annealing and gradient clipping at 1. The best model is
    saved atomically to ``best_model.pth`` in ``checkpoint_dir`` (the guide writes the working directory).
    ``device`` defaults to CUDA when available (the guide's 'cuda' fails on machines without a GPU).
    """

    def __init__(self, model: nn.Module, device: str | None = None, checkpoint_dir: str | Path = ".",
                 epochs_hint: int = 100) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=epochs_hint)
        self.checkpoint_dir = Path(checkpoint_dir)

    def _run(self, loader, train: bool) -> tuple[float, float]:
        self.model.train(train)
        total_loss, correct, total, nb = 0.0, 0, 0, 0
        for data, target in loader:
            data, target = data.to(self.device), target.to(self.device)
            with torch.set_grad_enabled(train):
                output = self.model(data)
                loss = self.criterion(output, target)
            if train:
                self.optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
                self.optimizer.step()
            total_loss += float(loss)
            correct += int((output.argmax(1) == target).sum())
            total += target.size(0)
            nb += 1
        return total_loss / max(nb, 1), 100.0 * correct / max(total, 1)

    def train_epoch(self, train_loader) -> tuple[float, float]:
        return self._run(train_loader, True)

    def evaluate(self, val_loader) -> tuple[float, float]:
        return self._run(val_loader, False)

    def train(self, train_loader, val_loader, epochs: int = 100, verbose: bool = True) -> float:
        best_acc = -1.0
        for epoch in range(epochs):
            train_loss, train_acc = self.train_epoch(train_loader)
            val_loss, val_acc = self.evaluate(val_loader)
            self.scheduler.step()
            if val_acc > best_acc:
                best_acc = val_acc
                save_checkpoint(self.model.state_dict(), self.checkpoint_dir / "best_model.pth")
            if verbose:
                print(f"Epoch {epoch + 1}/{epochs}: train loss {train_loss:.4f} acc {train_acc:.2f}% | "
                      f"val loss {val_loss:.4f} acc {val_acc:.2f}% | lr {self.scheduler.get_last_lr()[0]:.6f}")
        return best_acc
