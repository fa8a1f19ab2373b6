"""Combine attention over disjoint key sets through their log-sum-exp.

This is the online-softmax step exposed as a function: split-KV decoding and ring attention
compute attention over chunks of keys separately and merge the partial results here.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def merge_attention(*args) -> tuple[Tensor, Tensor]:
    """Merge partial attentions over disjoint key sets into attention over their union.

    Two forms::

        out, lse = merge_attention(out_a, lse_a, out_b, lse_b)   # a pair
        out, lse = merge_attention(outs, lses)                   # any number of partials

    out_* (B, H, Nq, Dv), lse_* (B, H, Nq) as returned by ``attention(..., return_lse=True)``
    (any shapes with ``lse.shape == out.shape[:-1]`` work), floating, on one device. Returns
    ``(out, lse)``: out in the first partial's dtype, lse in float32 (float64 if any input is
    float64); the state's dtype, rows with no key and why an lse of +inf raises:
    docs/design.md, "Merging partial attentions". Map flash-attn's +inf first, e.g.
    ``lse.masked_fill(lse == float("inf"), float("-inf"))``; the check costs one host sync per
    call (skipped while torch.compile traces). Sinks belong to the softmax denominator once:
    pass ``sinks`` to only one of the partial calls.
    """
    if len(args) == 4:
        outs, lses = [args[0], args[2]], [args[1], args[3]]
        names = ("out_a", "out_b"), ("lse_a", "lse_b")
    elif len(args) == 2:
        outs, lses, names = list(args[0]), list(args[1]), None
    else:
        raise TypeError(f"merge_attention takes (out_a, lse_a, out_b, lse_b) or (outs, lses), "
                        f"got {len(args)} arguments")
    return _merge(outs, lses, names)


def _merge_trusted(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`merge_attention` of partials attn's own launchers computed (their lse is never
    +inf): the same merge without the value check and its host sync, for loops that merge
    every step (ring attention)."""
    return _merge(outs, lses, None, check_values=False)


def _merge(outs: Sequence[Tensor], lses: Sequence[Tensor], names, check_values: bool = True
           ) -> tuple[Tensor, Tensor]:
    """The merge; ``names``: the partials' names for messages (None: ``outs[i]`` /
    ``lses[i]``)."""
    if names is None:
        names = (tuple(f"outs[{i}]" for i in range(len(outs))),
                 tuple(f"lses[{i}]" for i in range(len(lses))))
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need as many lses as outs, and at least one, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    everything = list(zip(names[0] + names[1], list(outs) + list(lses)))
    for name, t in everything:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating (float16, bfloat16, float32 or float64), "
                            f"got {t.dtype}")
    first, device = names[0][0], outs[0].device
    for name, t in everything:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, {first} on {device}: partials must be "
                             f"on one device")
    shape = outs[0].shape
    for name, o, lname, lse in zip(names[0], outs, names[1], lses):
        if o.dim() == 0:
            raise ValueError(f"{name} must have at least 1 dim (..., Dv), got shape ()")
        if o.shape != shape:
            raise ValueError(f"{name} has shape {tuple(o.shape)}, {first} has "
                             f"{tuple(shape)}: partials must have the same shape")
        if lse.shape != shape[:-1]:
            raise ValueError(f"{lname} has shape {tuple(lse.shape)}, expected out.shape[:-1] = "
                             f"{tuple(shape[:-1])}")
    acc = torch.float64 if any(t.dtype == torch.float64 for _, t in everything) else torch.float32
    lse_all = torch.stack([lse.to(acc) for lse in lses])  # (P, ...)
    if check_values and not torch.compiler.is_compiling():
        pos = torch.isposinf(lse_all).flatten(1).any(1)  # (P,): one sync below, not P
        if bool(pos.any()):
            lname = names[1][int(pos.nonzero()[0])]
            raise ValueError(f"{lname} has +inf entries: attn's lse for a row with no key is "
                             f"-inf (flash-attn's +inf, which attn.compat returns, must be "
                             f"mapped to -inf before merging)")
    lse = torch.logsumexp(lse_all, dim=0)  # -inf only where every part is -inf
    # each partial's weight, 0 at -inf; one product, then one fused update per partial
    w = torch.exp(lse_all - lse.masked_fill(lse == float("-inf"), 0.0)).unsqueeze(-1)
    out = outs[0].to(acc) * w[0]
    for o, w_p in zip(outs[1:], w[1:]):
        out.addcmul_(o.to(acc), w_p)
    return out.to(outs[0].dtype), lse
