"""flash-attn's ``flash_attn.bert_padding``: padded ``(B, N, ...)`` ↔ packed ``(total, ...)``.

Signatures and return tuples of flash-attn 2.8.3 (``unpad_input`` returns five values since
2.7). Plain indexing, differentiable through autograd. attn's own converters are
:func:`attn.varlen.pack` / :func:`attn.varlen.unpack`.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from attn.compat.errors import FlashAttnError

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def _check_indices(indices: object, size: int, data: str) -> Tensor:
    """A 1-d integer index tensor into an axis of ``size`` rows (``data`` names it), every
    value in ``[0, size)``: torch indexing would wrap a negative one around to another row.
    The range is read on the host (one small copy)."""
    if not isinstance(indices, Tensor):
        raise TypeError(f"indices must be a tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise FlashAttnError(f"indices must be a 1-d int64 tensor into the {size} rows of "
                             f"{data}, got {indices.dtype} {tuple(indices.shape)}")
    if indices.numel():
        lo, hi = torch.aminmax(indices)
        if int(lo) < 0 or int(hi) >= size:
            raise FlashAttnError(f"indices must lie in [0, {size}) (the rows of {data}), got "
                                 f"values from {int(lo)} to {int(hi)}")
    return indices


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """``input[indices]`` along the first axis: ``(N, ...)`` → ``(len(indices), ...)``."""
    if not isinstance(input, Tensor) or input.dim() < 1:
        raise TypeError(f"input must be a tensor of at least 1 dim, got "
                        f"{getattr(input, 'shape', type(input).__name__)}")
    _check_indices(indices, input.shape[0], f"input {tuple(input.shape)}")
    return input[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Zeros ``(first_axis_dim, ...)`` with ``values`` written at ``indices``."""
    if not isinstance(values, Tensor) or values.dim() < 1:
        raise TypeError(f"values must be a tensor of at least 1 dim, got "
                        f"{getattr(values, 'shape', type(values).__name__)}")
    _check_indices(indices, first_axis_dim, f"the output's first axis ({first_axis_dim})")
    if indices.shape[0] != values.shape[0]:
        raise FlashAttnError(f"indices {tuple(indices.shape)} must hold one row index per row of "
                             f"values {tuple(values.shape)}")
    return _put(values, indices, first_axis_dim)


def _put(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Padded → packed.

    hidden_states ``(B, N, ...)``; attention_mask ``(B, N)`` bool / int, 1 = a real token;
    unused_mask ``(B, N)``, 1 = allocated but unused (kept in the packed tensor, not counted
    as used). Returns ``(hidden_states (total, ...), indices (total,), cu_seqlens (B + 1,)
    int32, max_seqlen_in_batch: int, seqused (B,) int32)``.
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 2:
        raise FlashAttnError(f"hidden_states must be a tensor (batch_size, seqlen, ...), got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is None and name == "unused_mask":
            continue
        if not isinstance(m, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(m).__name__}")
        if tuple(m.shape) != tuple(hidden_states.shape[:2]):
            raise FlashAttnError(f"{name} must be (batch_size, seqlen) = "
                                 f"{tuple(hidden_states.shape[:2])} for hidden_states "
                                 f"{tuple(hidden_states.shape)}, got {tuple(m.shape)}")
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # (B, N, ...) -> (B·N, ...)
    return (flat[indices], indices, cu_seqlens, max_seqlen_in_batch,  # indices in range
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """Packed → padded: ``(total, ...)`` at ``indices`` of a ``(batch · seqlen)`` grid →
    ``(batch, seqlen, ...)``, zeros elsewhere."""
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() < 1:
        raise TypeError(f"hidden_states must be a tensor (total, ...), got "
                        f"{type(hidden_states).__name__}")
    for name, n in (("batch", batch), ("seqlen", seqlen)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise TypeError(f"{name} must be a non-negative int, got {n!r}")
    batch, seqlen = int(batch), int(seqlen)
    _check_indices(indices, batch * seqlen, f"the (batch, seqlen) = ({batch}, {seqlen}) grid")
    if indices.shape[0] != hidden_states.shape[0]:
        raise FlashAttnError(f"indices {tuple(indices.shape)} must hold one position per row of "
                             f"hidden_states {tuple(hidden_states.shape)}")
    output = _put(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
