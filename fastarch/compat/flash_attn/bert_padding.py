"""flash-attn's ``bert_padding``: move between padded ``(batch, seqlen, ...)`` tensors and the packed
``(total_nnz, ...)`` layout of the varlen attention functions.

Same names, signatures and return values as flash-attn 2.7: ``unpad_input`` returns five values
``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)`` and takes ``unused_mask``;
``index_first_axis``, ``index_put_first_axis`` and ``index_first_axis_residual`` are differentiable in their tensor
argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._missing import missing_attribute

__all__ = [
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]

__getattr__ = missing_attribute("flash_attn.bert_padding")


def _check_rows(name: str, t: torch.Tensor, indices: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim < 2:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"flash_attn.bert_padding: '{name}' must be a tensor with at least 2 dims, got {got}")
    if not isinstance(indices, torch.Tensor) or indices.ndim != 1 or indices.dtype.is_floating_point:
        got = f"{indices.dtype} of shape {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) \
            else type(indices).__name__
        raise ValueError(f"flash_attn.bert_padding: 'indices' must be a 1-D integer tensor, got {got}")


class _IndexFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices]

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        grad[indices] = grad_output
        return grad, None


class _IndexPutFirstAxis(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        out[indices] = values
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


class _IndexFirstAxisResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad = grad_residual.clone()
        grad.index_add_(0, indices, grad_output)
        return grad, None


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along the first axis, differentiable in ``input``.

    Shapes: input ``(N, ...)``, indices ``(n,)`` -> ``(n, ...)``.
    """
    _check_rows("input", input, indices)
    return _IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros of ``(first_axis_dim, ...)`` with ``values`` written at rows ``indices``; differentiable in ``values``.

    Shapes: values ``(n, ...)``, indices ``(n,)`` -> ``(first_axis_dim, ...)``.
    """
    _check_rows("values", values, indices)
    return _IndexPutFirstAxis.apply(values, indices, int(first_axis_dim))


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input[indices], input.detach())``: the gradient reaching the second output is added to the gradient of
    the selected rows.

    Shapes: input ``(N, ...)``, indices ``(n,)`` -> ``(n, ...)``, ``(N, ...)``.
    """
    _check_rows("input", input, indices)
    return _IndexFirstAxisResidual.apply(input, indices)


def _flat_rows(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states.reshape(hidden_states.shape[0] * hidden_states.shape[1], *hidden_states.shape[2:])


def _check_mask(name: str, mask: torch.Tensor, hidden_states: torch.Tensor) -> None:
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim < 2:
        raise ValueError("flash_attn.bert_padding: 'hidden_states' must be (batch, seqlen, ...)")
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"flash_attn.bert_padding: '{name}' must be (batch, seqlen) = "
                         f"{tuple(hidden_states.shape[:2])}, got {got}")


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Pack the tokens of ``attention_mask`` (and of ``unused_mask``: allocated, but not attended to).

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or int; 1 marks a valid token.
        unused_mask: ``(batch, seqlen)``, bool or int, or None; 1 marks a token that is kept in the packed tensor
            but not counted as used.

    Returns:
        ``hidden_states`` ``(total_nnz, ...)`` (differentiable), ``indices`` ``(total_nnz,)`` int64 into the
        flattened ``(batch * seqlen)`` axis, ``cu_seqlens`` ``(batch + 1,)`` int32, ``max_seqlen_in_batch`` (a
        Python int) and ``used_seqlens_in_batch`` ``(batch,)`` int32 (the ``attention_mask`` tokens per row).
    """
    _check_mask("attention_mask", attention_mask, hidden_states)
    all_masks = attention_mask
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, hidden_states)
        all_masks = attention_mask + unused_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    return index_first_axis(_flat_rows(hidden_states), indices), indices, cu_seqlens, max_seqlen, used


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Pack rows that each hold several concatenated samples.

    Args:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask_in_length: ``(batch, seqlen)`` int; row ``b`` lists the lengths of the samples packed into
            row ``b`` of ``hidden_states`` (from its start, in order), then zeros.

    Returns:
        ``hidden_states`` ``(total_nnz, ...)``, ``indices`` ``(total_nnz,)``, ``cu_seqlens`` ``(num_samples + 1,)``
        int32 with one entry per sample, and ``max_seqlen_in_batch`` (a Python int).
    """
    _check_mask("attention_mask_in_length", attention_mask_in_length, hidden_states)
    seqlen = attention_mask_in_length.shape[-1]
    total = attention_mask_in_length.sum(dim=-1)
    keep = torch.arange(seqlen, device=total.device, dtype=total.dtype)[None, :] < total[:, None]
    flat = attention_mask_in_length.flatten()
    seqlens = flat[flat != 0]
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    return index_first_axis(_flat_rows(hidden_states), indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Scatter packed rows back to a zero-padded ``(batch, seqlen, ...)`` tensor; differentiable.

    Shapes: hidden_states ``(total_nnz, ...)``, indices ``(total_nnz,)`` -> ``(batch, seqlen, ...)``.
    """
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *out.shape[1:])
