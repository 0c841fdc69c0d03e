"""flash-attn's ``flash_attn.utils.distributed`` for a single process (world size 1), which is all that the
flash-attn modules fastarch provides need: the collectives return their input (the ``_raw`` ones with a None
handle) and refuse a process group of more than one rank; ``get_dim_for_local_rank`` is flash-attn's split
arithmetic for any world size."""

from __future__ import annotations

import torch
from torch import Tensor

from .._missing import missing_attribute

__all__ = [
    "all_gather",
    "all_gather_raw",
    "all_reduce",
    "all_reduce_raw",
    "allreduce_sequence_parallel_grad",
    "get_dim_for_local_rank",
    "reduce_scatter",
    "reduce_scatter_raw",
    "sync_shared_params",
]

__getattr__ = missing_attribute("flash_attn.utils.distributed")


def _single(process_group, what: str) -> None:
    size = 1 if process_group is None else process_group.size()
    if size != 1:
        raise ValueError(f"flash_attn.utils.distributed.{what}: fastarch supports a process group of size 1 only, "
                         f"got size {size}")


def all_gather_raw(input_: Tensor, process_group, async_op: bool = False) -> tuple[Tensor, None]:
    """World size 1: ``(input_, None)``."""
    _single(process_group, "all_gather_raw")
    return input_.contiguous(), None


def reduce_scatter_raw(input_: Tensor, process_group, async_op: bool = False) -> tuple[Tensor, None]:
    """World size 1: ``(input_, None)``."""
    _single(process_group, "reduce_scatter_raw")
    return input_.contiguous(), None


def all_reduce_raw(input_: Tensor, process_group, async_op: bool = False) -> tuple[Tensor, None]:
    """World size 1: ``(input_, None)``."""
    _single(process_group, "all_reduce_raw")
    return input_.contiguous(), None


def all_gather(input_: Tensor, process_group) -> Tensor:
    """World size 1: the input (differentiable)."""
    _single(process_group, "all_gather")
    return input_


def reduce_scatter(input_: Tensor, process_group) -> Tensor:
    """World size 1: the input (differentiable)."""
    _single(process_group, "reduce_scatter")
    return input_


def all_reduce(input_: Tensor, process_group) -> Tensor:
    """World size 1: the input (differentiable)."""
    _single(process_group, "all_reduce")
    return input_


def sync_shared_params(model: torch.nn.Module, process_group) -> None:
    """World size 1: nothing to synchronise."""
    _single(process_group, "sync_shared_params")


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group) -> None:
    """World size 1: nothing to reduce."""
    _single(process_group, "allreduce_sequence_parallel_grad")


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """The share of ``dim`` (in units of ``multiple_of``) that rank ``local_rank`` of ``world_size`` holds; the
    first ``(dim // multiple_of) % world_size`` ranks hold one unit more."""
    units = dim // multiple_of
    return (units // world_size + int(local_rank < units % world_size)) * multiple_of
