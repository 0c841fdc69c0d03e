"""``mamba_ssm.distributed.distributed_utils``: the collectives tensor parallelism uses, on
``torch.distributed``: ``all_gather_raw``, ``reduce_scatter_raw``, ``all_reduce_raw`` (no autograd; ``async_op``
returns a handle) and ``all_gather``, ``reduce_scatter``, ``all_reduce`` (autograd: each one's backward is the
dual collective), plus ``sync_shared_params``, ``allreduce_sequence_parallel_grad`` and
``get_dim_for_local_rank``. All gathers and scatters are along dimension 0.

A ``process_group`` of None is the default group when ``torch.distributed`` is initialised, and one process
otherwise: every collective is then the identity (a returned handle is None).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..._missing import missing_attribute

__all__ = ["all_gather", "all_gather_raw", "all_reduce", "all_reduce_raw", "allreduce_sequence_parallel_grad",
           "get_dim_for_local_rank", "reduce_scatter", "reduce_scatter_raw", "sync_shared_params", "world_size"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.distributed.distributed_utils")


def world_size(process_group=None) -> int:
    """The size of ``process_group``; 1 for None when ``torch.distributed`` is not initialised."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def rank(process_group=None) -> int:
    """This process's rank in ``process_group``; 0 for None when ``torch.distributed`` is not initialised."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


def all_gather_raw(input_: Tensor, process_group, async_op: bool = False):
    """``(n, ...)`` on each rank -> ``(world * n, ...)``, rank order; returns ``(output, handle)``."""
    world = world_size(process_group)
    if world == 1:
        return input_.contiguous(), None
    output = torch.empty(world * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = dist.all_gather_into_tensor(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group, async_op: bool = False):
    """``(world * n, ...)`` summed over ranks, rank ``r`` keeping rows ``[r n, (r + 1) n)``; ``(output,
    handle)``."""
    world = world_size(process_group)
    if input_.shape[0] % world != 0:
        raise ValueError(f"reduce_scatter: dimension 0 ({input_.shape[0]}) must be divisible by the world size "
                         f"({world})")
    if world == 1:
        return input_.contiguous(), None
    output = torch.empty(input_.shape[0] // world, *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = dist.reduce_scatter_tensor(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group, async_op: bool = False):
    """The sum over ranks, in place in a contiguous ``input_``; ``(output, handle)``."""
    input_ = input_.contiguous()
    if world_size(process_group) == 1:
        return input_, None
    return input_, dist.all_reduce(input_, group=process_group, async_op=async_op)


def _collective(forward_raw, backward_raw) -> type[torch.autograd.Function]:
    """An autograd function running ``forward_raw`` forward and ``backward_raw`` on the gradient (None: the
    gradient passes through)."""

    class _Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_: Tensor, process_group) -> Tensor:
            ctx.process_group = process_group
            return forward_raw(input_, process_group)[0]

        @staticmethod
        def backward(ctx, grad_output: Tensor):
            if backward_raw is None:
                return grad_output, None
            return backward_raw(grad_output, ctx.process_group)[0], None

    return _Collective


_AllGather = _collective(all_gather_raw, reduce_scatter_raw)
_ReduceScatter = _collective(reduce_scatter_raw, all_gather_raw)
_AllReduce = _collective(all_reduce_raw, None)


def all_gather(input_: Tensor, process_group) -> Tensor:
    """:func:`all_gather_raw` with autograd (backward: reduce-scatter)."""
    return _AllGather.apply(input_, process_group)


def reduce_scatter(input_: Tensor, process_group) -> Tensor:
    """:func:`reduce_scatter_raw` with autograd (backward: all-gather)."""
    return _ReduceScatter.apply(input_, process_group)


def all_reduce(input_: Tensor, process_group) -> Tensor:
    """:func:`all_reduce_raw` with autograd (backward: identity)."""
    return _AllReduce.apply(input_, process_group)


def sync_shared_params(model: torch.nn.Module, process_group) -> None:
    """Broadcast every parameter marked ``_shared_params`` from the group's rank 0, in name order."""
    if world_size(process_group) == 1:
        return
    shared = {n: p for n, p in model.named_parameters() if getattr(p, "_shared_params", False)}
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    with torch.no_grad():
        for _, p in sorted(shared.items()):
            dist.broadcast(p, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group) -> None:
    """Sum over ranks the gradients of the parameters marked ``_sequence_parallel`` (one flat all-reduce)."""
    grads = [p.grad for _, p in sorted(model.named_parameters()) if getattr(p, "_sequence_parallel", False)
             and p.grad is not None]
    if not grads or world_size(process_group) == 1:
        return
    with torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=process_group)
        for buf, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            buf.copy_(synced)


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of ``dim`` split in units of ``multiple_of`` over ``world_size`` ranks (the first
    ``units % world_size`` ranks get one unit more)."""
    units = dim // multiple_of
    div, mod = divmod(units, world_size)
    return (div + int(local_rank < mod)) * multiple_of
