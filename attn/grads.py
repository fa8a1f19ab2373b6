"""Backward helpers every backend shares (below the backends, which do not import one another:
docs/design.md, "The layers"): the gradient tuple a launcher returns, the row term Δ, the
sinks' gradient, and summing a broadcast gradient back to its operand's shape."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Grads", "call_sink_grad", "reduce_to", "row_delta", "sink_grad"]


class Grads(NamedTuple):
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dmask: Tensor | None
    dsinks: Tensor | None
    dsoftcap: Tensor | None
    dcaptured: tuple[Tensor | None, ...] = ()  # the score_mod's captured tensors


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """dsinks (H,): the sink is a key with value 0, so ``dsink_h = −Σ_{b,i} P_sink · Δ_i``
    with ``P_sink = exp(sink_h − lse_i)`` (shared by every backend's backward)."""
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse)
    return -(p_sink * delta.to(lse.dtype)).sum(dim=(0, 2))


def row_delta(do: Tensor, out: Tensor, dlse: Tensor | None, acc: torch.dtype) -> Tensor:
    """``Δ = rowsum(dO ∘ O) − dlse`` (B, H, Nq) in ``acc``: the lse output's gradient joins
    dS as dlse_i · P_ij."""
    delta = (do.to(acc) * out.to(acc)).sum(-1)
    return delta if dlse is None else delta - dlse.to(acc)


def call_sink_grad(sinks: Tensor | None, do: Tensor, dlse: Tensor | None, out: Tensor,
                   lse: Tensor, acc: torch.dtype) -> Tensor | None:
    """dsinks (H,) of a whole call in one pass over its rows (:func:`row_delta`, then
    :func:`sink_grad`), or None without sinks."""
    return None if sinks is None else sink_grad(sinks, lse.to(acc), row_delta(do, out, dlse, acc))


def reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a broadcast gradient back to ``shape`` (the shape of the tensor that broadcast)."""
    lead = grad.dim() - len(shape)
    if lead > 0:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


# Query blocks with a row whose denominator l (relative to its max) is within this many log2
# units of 1 take Δ = Σ_j P_ij dP_ij from their tiles (docs/design.md, "Saturated rows")
SATURATED_LOG2L = 2.0 ** -12
