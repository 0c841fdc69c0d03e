"""Data parallelism on PyTorch's own engine, behind the seed guide 003's class names.

- ``DDP(model, rank, world_size)`` wraps ``torch.nn.parallel.DistributedDataParallel``; gradients are
  averaged by its bucketed all-reduce during ``backward``. ``forward``, ``backward_and_sync`` and ``step``
  keep the guide's calling pattern.
- ``FSDP(model, rank, world_size)`` shards parameters, gradients and optimizer state with FSDP2's
  ``fully_shard`` (each child with parameters is a unit, then the root).
- ``ZeRO(model, optimizer, rank, world_size, stage=1)`` (also ``SimpleZeRO``): stage 1 is
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` over a DDP model; stages 2 and 3 are FSDP2 with
  ``reshard_after_forward=False`` (gradients and optimizer state sharded) and ``True`` (parameters too).

The process group must be initialised first (``torch.distributed.init_process_group``, gloo on CPU, nccl
on GPU); ``fastarch train`` does that through ``torch.distributed.run``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["DDP", "FSDP", "ZeRO", "SimpleZeRO", "fsdp_available"]


def fsdp_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _check_group(rank: int, world_size: int, who: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}: torch.distributed is not initialised; call init_process_group first "
                           f"(or use `fastarch train --parallel ...`)")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"{who}: rank/world_size ({rank}/{world_size}) disagree with the process group "
                         f"({dist.get_rank()}/{dist.get_world_size()})")


class DDP:
    """Guide-003 ``DDP`` on ``DistributedDataParallel``. ``self.model`` is the wrapped module."""

    def __init__(self, model: nn.Module, rank: int, world_size: int, **ddp_kwargs: Any) -> None:
        _check_group(rank, world_size, "DDP")
        self.rank, self.world_size = rank, world_size
        device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
        self.model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)

    @property
    def module(self) -> nn.Module:
        return self.model.module

    def forward(self, x: Any) -> Any:
        return self.model(x)

    __call__ = forward

    def backward_and_sync(self, loss: torch.Tensor) -> None:
        # DDP's hooks all-reduce and average gradient buckets while backward runs.
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


def _shard(model: nn.Module, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    # Units: every block of a ModuleList/ModuleDict (transformer layers and the like), else each direct
    # child that has a forward of its own; the root takes whatever is left (embeddings, heads).
    units = [m for c in model.modules() if isinstance(c, (nn.ModuleList, nn.ModuleDict))
             for m in (c.values() if isinstance(c, nn.ModuleDict) else c)]
    if not units:
        units = [c for c in model.children() if not isinstance(c, (nn.ModuleList, nn.ModuleDict))]
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


class FSDP:
    """Guide-003 ``FSDP`` on FSDP2 ``fully_shard``: parameters live as sharded DTensors and are gathered
    per unit for forward/backward; gradients are reduce-scattered (averaged) automatically."""

    def __init__(self, model: nn.Module, rank: int, world_size: int, reshard_after_forward: bool = True) -> None:
        _check_group(rank, world_size, "FSDP")
        if not fsdp_available():
            raise RuntimeError("FSDP: this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
        self.rank, self.world_size = rank, world_size
        self.model = _shard(model, reshard_after_forward)

    @property
    def module(self) -> nn.Module:
        return self.model

    def forward(self, x: Any, layer: nn.Module | None = None) -> Any:
        return (layer or self.model)(x)

    __call__ = forward

    def reduce_scatter_gradients(self) -> None:
        """Kept for the guide's API: FSDP2 reduce-scatters during backward, so nothing is left to do."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class ZeRO:
    """Guide-003 ``SimpleZeRO`` on PyTorch: stage 1 = ZeroRedundancyOptimizer (optimizer state
    partitioned) over DDP; stage 2/3 = FSDP2 without/with parameter resharding after forward.

    ``optimizer`` gives the optimizer class and hyper-parameters (its first param group's settings).
    ``self.model`` is the wrapped model and ``self.optimizer`` the distributed optimizer to step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int,
                 stage: int = 1) -> None:
        _check_group(rank, world_size, "ZeRO")
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO: stage must be 1, 2 or 3, got {stage}")
        self.rank, self.world_size, self.stage = rank, world_size, stage
        defaults = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        cls = type(optimizer)
        if stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.model = DDP(model, rank, world_size).model
            self.optimizer = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=cls, **defaults)
        else:
            self.model = _shard(model, reshard_after_forward=stage == 3)
            self.optimizer = cls(self.model.parameters(), **defaults)

    def forward(self, x: Any) -> Any:
        return self.model(x)

    __call__ = forward

    def step(self) -> None:
        self.optimizer.step()


SimpleZeRO = ZeRO
