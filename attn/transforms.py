"""Where a call runs under torch's function transforms (``torch.func``'s vmap, grad, jvp,
and forward-mode AD through ``torch.autograd.forward_ad``), asked by the entry points and the
backends: which transform is active, and a tensor's values seen through its wrappers.

Data-dependent checks (``bool(tensor)``, ``.item()``) cannot run on a tensor that vmap
batches; the entry points read such values through :func:`physical` (every sample at once)
or skip an optional rewrite, and backends whose autograd.Function has no rule for a
transform are not chosen under it (:func:`active`).

The backends' ``torch.func.vmap`` rules share the helpers below: fold the mapped dimension
into the batch dimension B (:func:`fold`, :func:`fold_mask`, back with :func:`unfold`) where
every operand is per batch row or shared, else call once per sample (:func:`call_per_sample`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch._C import _functorch

from attn.masks import as_4d

__all__ = ["active", "forward_ad", "physical", "in_vmap", "call_per_sample", "fold",
           "fold_mask", "rows_of", "unfold"]


def _stack() -> list:
    """functorch's interpreters, outermost first; none while torch.compile traces (dynamo
    cannot read the stack, and a traced call runs under no transform of its own)."""
    if torch.compiler.is_compiling():
        return []
    return list(_functorch.get_interpreter_stack() or ())


def active(*tensors: object) -> str | None:
    """The transforms a call runs under, innermost last, as ``"vmap+jvp"``-style text, or
    None: functorch's interpreter stack, and forward-mode AD where one of ``tensors`` carries
    a tangent at the current dual level."""
    names = [str(i.key()).rsplit(".", 1)[-1].lower() for i in _stack()]
    if forward_ad(*tensors):
        names.append("forward AD")
    return "+".join(names) if names else None


def in_vmap() -> bool:
    """Whether a ``torch.func.vmap`` is active (its tensors cannot be read by the host)."""
    return any(str(i.key()).endswith("Vmap") for i in _stack())


def forward_ad(*tensors: object) -> bool:
    """Whether one of ``tensors`` is a dual tensor of ``torch.autograd.forward_ad``."""
    from torch.autograd import forward_ad as fwad

    # no dual level open (the common case): nothing to look at
    if torch.compiler.is_compiling() or getattr(fwad, "_current_level", 0) < 0:
        return False
    for t in tensors:
        if isinstance(t, Tensor) and not _functorch.is_functorch_wrapped_tensor(t):
            try:
                if fwad.unpack_dual(t).tangent is not None:
                    return True
            except RuntimeError:  # no dual level is open
                return False
    return False


def physical(t: Tensor) -> Tensor:
    """``t`` with every functorch wrapper taken off: under vmap the values of every sample at
    once (for checks that hold for each sample iff they hold for all), else ``t``'s own."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t.detach()


# -- vmap rules: fold the mapped dim into B, or loop -----------------------------------------

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
    if dim is None:
        x = x.unsqueeze(0).expand(batch_size, *x.shape)
    else:
        x = x.movedim(dim, 0)
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


def rows_of(x: Tensor, dim: int | None) -> int:
    """A sample's batch size B: ``x``'s first dim once the mapped ``dim`` is set aside."""
    return x.shape[1] if dim == 0 else x.shape[0]


def unfold(x: Tensor | None, batch_size: int) -> Tensor | None:
    """``(X·B, ...)`` back to ``(X, B, ...)``."""
    return None if x is None else x.unflatten(0, (batch_size, -1))
