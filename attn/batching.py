"""``torch.func.vmap`` rules of the backends' autograd.Functions (tiled's, triton's): the
mapped dimension folded into the batch dimension B where that is exact, else one call per
sample (docs/transforms.md, "Inside tiled's rules": why, and which operands fold).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from attn.masks import as_4d

__all__ = ["call_per_sample", "fold", "fold_args", "unfold"]


def call_per_sample(apply: Callable, batch_size: int, in_dims: Sequence[int | None],
                    args: Sequence[object]) -> tuple[tuple, tuple]:
    """``apply`` on each sample's slice of the mapped arguments, outputs stacked on dim 0
    (None outputs stay None): ``(outputs, out_dims)``."""
    results = []
    for x in range(batch_size):
        sliced = [a.select(d, x) if d is not None else a for a, d in zip(args, in_dims)]
        results.append(apply(*sliced))
    outs = tuple(None if r[0] is None else torch.stack(r) for r in zip(*results))
    return outs, tuple(None if o is None else 0 for o in outs)


def fold(x: Tensor | None, dim: int | None, batch_size: int, rows: int) -> Tensor | None:
    """A per-row tensor ``(B or 1, ...)``, mapped at ``dim`` or shared (None), as
    ``(X·B, ...)``: the samples' rows one after another."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(batch_size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.expand(batch_size, rows, *x.shape[2:]).flatten(0, 1)


def fold_mask(mask: Tensor | None, dim: int | None, batch_size: int, rows: int
              ) -> Tensor | None:
    """A mask broadcastable to (B, H, Nq, Nk), mapped at ``dim`` or shared, as
    ``(X·B, H or 1, Nq or 1, Nk or 1)``."""
    if mask is None:
        return None
    if dim is None:
        m = as_4d(mask).unsqueeze(0)
    else:
        m = mask.movedim(dim, 0)
        m = m.reshape((m.shape[0],) + (1,) * (4 - (m.dim() - 1)) + tuple(m.shape[1:]))
    return m.expand(batch_size, rows, *m.shape[2:]).flatten(0, 1)


def fold_args(args: Sequence[object], in_dims: Sequence[int | None], batch_size: int,
              rows: int, mask: int) -> list:
    """A rule's arguments with every tensor folded (:func:`fold`; ``args[mask]``, the mask,
    by :func:`fold_mask`) and the others as they are."""
    return [fold_mask(a, d, batch_size, rows) if i == mask
            else fold(a, d, batch_size, rows) if isinstance(a, Tensor) else a
            for i, (a, d) in enumerate(zip(args, in_dims))]


def rows_of(x: Tensor, dim: int | None) -> int:
    """A sample's batch size B: ``x``'s first dim once the mapped ``dim`` is set aside."""
    return x.shape[1] if dim == 0 else x.shape[0]


def unfold(x: Tensor | None, batch_size: int) -> Tensor | None:
    """``(X·B, ...)`` back to ``(X, B, ...)``."""
    return None if x is None else x.unflatten(0, (batch_size, -1))
