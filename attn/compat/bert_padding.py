"""flash-attn's ``flash_attn.bert_padding``: padded ``(B, N, ...)`` ↔ packed ``(total, ...)``.

Signatures and return tuples of flash-attn 2.8.3 (``unpad_input`` returns five values since
2.7). Plain indexing, differentiable through autograd. attn's own converters are
:func:`attn.varlen.pack` / :func:`attn.varlen.unpack`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def index_first_axis(input: Tensor, indices: Tensor) -> Tensor:
    """``input[indices]`` along the first axis: ``(N, ...)`` → ``(len(indices), ...)``."""
    return input[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """Zeros ``(first_axis_dim, ...)`` with ``values`` written at ``indices``."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Padded → packed.

    hidden_states ``(B, N, ...)``; attention_mask ``(B, N)`` bool / int, 1 = a real token;
    unused_mask ``(B, N)``, 1 = allocated but unused (kept in the packed tensor, not counted
    as used). Returns ``(hidden_states (total, ...), indices (total,), cu_seqlens (B + 1,)
    int32, max_seqlen_in_batch: int, seqused (B,) int32)``.
    """
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])  # (B, N, ...) -> (B·N, ...)
    return (index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch,
            used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    """Packed → padded: ``(total, ...)`` at ``indices`` of a ``(batch · seqlen)`` grid →
    ``(batch, seqlen, ...)``, zeros elsewhere."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *hidden_states.shape[1:])
