"""Combine attention over disjoint key sets through their log-sum-exp.

This is the online-softmax step exposed as a function: split-KV decoding and ring attention
compute attention over chunks of keys separately and merge the partial results here.
"""

from __future__ import annotations

import torch
from torch import Tensor


def merge_attention(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets into attention over their union.

    out_* (B, H, Nq, Dv), lse_* (B, H, Nq) as returned by ``attention(..., return_lse=True)``.
    Returns ``(out, lse)``: out in out_a's dtype, lse in float32 (float64 if an input is).
    A row that saw no key in one part (lse = -inf) takes the other part unchanged; a row
    that saw no key in either stays zeros with lse = -inf. Sinks belong to the softmax
    denominator once: pass ``sinks`` to only one of the two partial calls.
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must have the same shape, got {tuple(out_a.shape)} "
                         f"and {tuple(out_b.shape)}")
    if lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
        raise ValueError(f"lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} must both "
                         f"be out.shape[:-1] = {tuple(out_a.shape[:-1])}")
    acc = torch.float64 if torch.float64 in (lse_a.dtype, lse_b.dtype, out_a.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)  # -inf only where both are -inf
    lse_safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe).unsqueeze(-1)  # 0 where lse_a = -inf
    w_b = torch.exp(lse_b - lse_safe).unsqueeze(-1)
    out = w_a * out_a.to(acc) + w_b * out_b.to(acc)
    return out.to(out_a.dtype), lse
