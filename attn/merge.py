"""Combine attention over disjoint key sets through their log-sum-exp.

This is the online-softmax step exposed as a function: split-KV decoding and ring attention
compute attention over chunks of keys separately and merge the partial results here.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def _state_dtype(dtypes) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def merge_attention(*args) -> tuple[Tensor, Tensor]:
    """Merge partial attentions over disjoint key sets into attention over their union.

    Two forms::

        out, lse = merge_attention(out_a, lse_a, out_b, lse_b)   # a pair
        out, lse = merge_attention(outs, lses)                   # any number of partials

    out_* (B, H, Nq, Dv), lse_* (B, H, Nq) as returned by ``attention(..., return_lse=True)``
    (any shapes with ``lse.shape == out.shape[:-1]`` work). Returns ``(out, lse)``: out in the
    first partial's dtype, lse in float32 (float64 if any input is float64). The state is kept
    in that dtype and the output cast once at the end, so merging P partials rounds once, not
    P - 1 times. A row that saw no key in one part (lse = -inf) takes the others unchanged; a
    row that saw no key anywhere stays zeros with lse = -inf, never NaN. Sinks belong to the
    softmax denominator once: pass ``sinks`` to only one of the partial calls.
    """
    if len(args) == 4:
        outs, lses = [args[0], args[2]], [args[1], args[3]]
        names = ("out_a", "out_b"), ("lse_a", "lse_b")
    elif len(args) == 2:
        outs, lses = list(args[0]), list(args[1])
        names = (tuple(f"outs[{i}]" for i in range(len(outs))),
                 tuple(f"lses[{i}]" for i in range(len(lses))))
    else:
        raise TypeError(f"merge_attention takes (out_a, lse_a, out_b, lse_b) or (outs, lses), "
                        f"got {len(args)} arguments")
    return _merge(outs, lses, names)


def _merge(outs: Sequence[Tensor], lses: Sequence[Tensor], names) -> tuple[Tensor, Tensor]:
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need as many lses as outs, and at least one, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    for name, t in zip(names[0] + names[1], list(outs) + list(lses)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shape = outs[0].shape
    for name, o, lname, lse in zip(names[0], outs, names[1], lses):
        if o.shape != shape:
            raise ValueError(f"{name} has shape {tuple(o.shape)}, {names[0][0]} has "
                             f"{tuple(shape)}: partials must have the same shape")
        if lse.shape != shape[:-1]:
            raise ValueError(f"{lname} has shape {tuple(lse.shape)}, expected out.shape[:-1] = "
                             f"{tuple(shape[:-1])}")
    acc = _state_dtype([t.dtype for t in list(outs) + list(lses)])
    lse_all = torch.stack([lse.to(acc) for lse in lses])  # (P, ...)
    lse = torch.logsumexp(lse_all, dim=0)  # -inf only where every part is -inf
    lse_safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    out = torch.zeros(shape, dtype=acc, device=outs[0].device)
    for o, lse_p in zip(outs, lse_all):
        out = out + torch.exp(lse_p - lse_safe).unsqueeze(-1) * o.to(acc)  # weight 0 at -inf
    return out.to(outs[0].dtype), lse
