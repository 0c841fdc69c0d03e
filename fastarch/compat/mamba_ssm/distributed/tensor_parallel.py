"""``mamba_ssm.distributed.tensor_parallel``: tensor-parallel layers on ``torch.distributed`` (mamba-ssm's
signatures and ``state_dict`` keys): ``ColumnParallelLinear`` (output features split over ranks; with
``sequence_parallel`` the input's rows are gathered first), ``RowParallelLinear`` (input features split; the
outputs are summed over ranks, reduce-scattered along rows with ``sequence_parallel``; only rank 0 has the bias),
``VocabParallelEmbedding``, ``ColumnParallelEmbedding``, ``ParallelEmbeddings`` and ``parallel_linear_func``.
The split of ``n`` features in units of ``multiple_of`` gives the first ``units % world`` ranks one unit more.

With ``process_group=None`` and ``torch.distributed`` not initialised every layer is its plain single-process
counterpart (``torch.nn.Linear`` / ``Embedding`` math on :func:`fastarch.ops.linear`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from fastarch.ops.linear import linear

from ..._missing import missing_attribute
from .distributed_utils import (
    all_gather,
    all_reduce,
    get_dim_for_local_rank,
    rank,
    reduce_scatter,
    world_size,
)

__all__ = ["ColumnParallelEmbedding", "ColumnParallelLinear", "ParallelEmbeddings", "RowParallelLinear",
           "VocabParallelEmbedding", "parallel_linear_func"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.distributed.tensor_parallel")


def parallel_linear_func(x: Tensor, weight: Tensor, bias: Tensor | None = None, process_group=None,
                         sequence_parallel: bool = True) -> Tensor:
    """``linear(all_gather(x), weight, bias)`` (the gather only with a group and ``sequence_parallel``); x
    ``(n, ..., in)`` -> ``(world * n or n, ..., out)``. Its input gradient is reduce-scattered (all-reduced
    without ``sequence_parallel``) over the group."""
    if process_group is not None and world_size(process_group) > 1:
        x = all_gather(x, process_group) if sequence_parallel else _CopyToGroup.apply(x, process_group)
    return linear(x, weight, bias)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (every rank used the whole input)."""

    @staticmethod
    def forward(ctx, x: Tensor, process_group) -> Tensor:
        ctx.process_group = process_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce(grad.contiguous(), ctx.process_group), None


class ColumnParallelLinear(nn.Linear):
    """``ColumnParallelLinear(in_features, out_features, process_group, bias=True, sequence_parallel=True,
    multiple_of=1)``: this rank's rows of the weight, ``forward(x (..., in)) -> (..., local out)``."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        if out_features % multiple_of:
            raise ValueError(f"ColumnParallelLinear: out_features ({out_features}) must be a multiple of {multiple_of}")
        local = get_dim_for_local_rank(out_features, world_size(process_group), rank(process_group), multiple_of)
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group, self.sequence_parallel = process_group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        return parallel_linear_func(x, self.weight, self.bias, process_group=self.process_group,
                                    sequence_parallel=self.sequence_parallel)


class RowParallelLinear(nn.Linear):
    """``RowParallelLinear(in_features, out_features, process_group, bias=True, sequence_parallel=True,
    multiple_of=1)``: this rank's columns of the weight; ``forward(x (..., local in)) -> (..., out)`` summed over
    ranks (reduce-scattered along dimension 0 with ``sequence_parallel``)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None) -> None:
        if in_features % multiple_of:
            raise ValueError(f"RowParallelLinear: in_features ({in_features}) must be a multiple of {multiple_of}")
        r = rank(process_group)
        local = get_dim_for_local_rank(in_features, world_size(process_group), r, multiple_of)
        super().__init__(local, out_features, bias=bias and r == 0, device=device, dtype=dtype)
        self.process_group, self.sequence_parallel = process_group, sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        out = linear(x, self.weight, self.bias)
        if world_size(self.process_group) == 1:
            return out
        return (reduce_scatter if self.sequence_parallel else all_reduce)(out, self.process_group)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (the vocabulary) are split evenly over ranks; ids outside this rank's range
    embed to zeros (the sum over ranks is the full lookup)."""

    def __init__(self, num_embeddings: int, *args, process_group=None, padding_idx=None, **kwargs):
        self.process_group = process_group
        world = world_size(process_group) if process_group is not None else 1
        if num_embeddings % world != 0:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings ({num_embeddings}) must be divisible by the "
                             f"world size ({world})")
        if world > 1 and padding_idx is not None:
            raise RuntimeError("VocabParallelEmbedding: padding_idx is not supported across several ranks")
        super().__init__(num_embeddings // world, *args, padding_idx=padding_idx, **kwargs)

    def forward(self, input: Tensor) -> Tensor:
        if self.process_group is None or world_size(self.process_group) == 1:
            return super().forward(input)
        start = rank(self.process_group) * self.num_embeddings
        outside = (input < start) | (input >= start + self.num_embeddings)
        emb = super().forward((input - start).masked_fill(outside, 0))
        return emb.masked_fill(outside[..., None], 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """An embedding whose columns (the embedding dimension) are split evenly over ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args, process_group=None, **kwargs):
        self.process_group = process_group
        world = world_size(process_group) if process_group is not None else 1
        if embedding_dim % world != 0:
            raise ValueError(f"ColumnParallelEmbedding: embedding_dim ({embedding_dim}) must be divisible by the "
                             f"world size ({world})")
        super().__init__(num_embeddings, embedding_dim // world, *args, **kwargs)


class ParallelEmbeddings(nn.Module):
    """Word embeddings (vocabulary-parallel) plus, when ``max_position_embeddings > 0``, position embeddings
    (column-parallel); ``forward(input_ids (B, L), position_ids=None, combine_batch_seqlen_dim=False) -> (B, L,
    embed_dim)`` (or ``(B * L, embed_dim)``), summed over ranks (reduce-scattered with ``sequence_parallel``).
    Keys: ``word_embeddings.weight``, ``position_embeddings.weight``."""

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int, process_group,
                 padding_idx=None, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.process_group, self.sequence_parallel = process_group, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                      process_group=process_group, **fk)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(max_position_embeddings, embed_dim,
                                                               process_group=process_group, **fk)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                combine_batch_seqlen_dim: bool = False) -> Tensor:
        seqlen = input_ids.shape[1]
        world = world_size(self.process_group)
        emb = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            if position_ids is None:
                position_ids = torch.arange(seqlen, dtype=torch.long, device=input_ids.device)
            pos = self.position_embeddings(position_ids)
            if world <= 1:
                emb = emb + pos
            else:
                width = self.position_embeddings.embedding_dim
                r = rank(self.process_group)
                emb = torch.cat([emb[..., :r * width], emb[..., r * width:(r + 1) * width] + pos,
                                 emb[..., (r + 1) * width:]], dim=-1)
        if combine_batch_seqlen_dim:
            emb = emb.reshape(-1, emb.shape[-1])
        if world <= 1:
            return emb
        return (reduce_scatter if self.sequence_parallel else all_reduce)(emb, self.process_group)
