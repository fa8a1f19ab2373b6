"""Where a call runs under torch's function transforms (``torch.func``'s vmap, grad, jvp,
and forward-mode AD through ``torch.autograd.forward_ad``), asked by the entry points and the
backends: which transform is active (:func:`active`: a backend with no rule for it is not
chosen), and a tensor's values seen through its wrappers (:func:`physical`: data checks under
vmap read every sample at once, docs/transforms.md).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch._C import _functorch

__all__ = ["active", "below", "forward_ad", "graph_needed", "in_vmap", "levels", "lowered",
           "physical", "rewrap", "wrapped"]


def _stack() -> list:
    """functorch's interpreters, outermost first; none while torch.compile traces (dynamo
    cannot read the stack, and a traced call runs under no transform of its own)."""
    return [] if torch.compiler.is_compiling() else list(_functorch.get_interpreter_stack() or ())


def levels() -> list[str]:
    """functorch's transforms now active, outermost first: "vmap", "grad", "jvp", ..."""
    return [str(i.key()).rsplit(".", 1)[-1].lower() for i in _stack()]


def active(*tensors: object) -> str | None:
    """The transforms a call runs under, innermost last, as ``"vmap+jvp"``-style text, or
    None: functorch's interpreter stack, and forward-mode AD where one of ``tensors`` carries
    a tangent at the current dual level."""
    names = levels()
    if forward_ad(*tensors):
        names.append("forward AD")
    return "+".join(names) if names else None


def in_vmap() -> bool:
    """Whether a ``torch.func.vmap`` is active (its tensors cannot be read by the host)."""
    return "vmap" in levels()


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


def wrapped(x: object) -> bool:
    """Whether ``x`` is a tensor some transform wraps: functorch's (vmap, grad, jvp) or the
    legacy vmap of ``torch._vmap_internals`` (gradcheck's batched checks)."""
    return isinstance(x, Tensor) and (_functorch.is_functorch_wrapped_tensor(x)
                                      or "Batched" in str(torch._C._dispatch_keys(x)))


def graph_needed(*tensors: Tensor | None) -> bool:
    """Whether a rule (a backward, a forward-mode rule) must give results that are
    differentiable again: grad mode is on and something tracks ``tensors`` beyond the rule's
    own transform level. torch.func.grad and jvp turn grad mode on inside their level
    whatever comes next, so there only an outer grad or jvp level, or autograd outside every
    transform (``create_graph=True``), can differentiate the results."""
    if not torch.is_grad_enabled():
        return False
    stack = _stack()
    level = None
    if stack:
        if not str(stack[-1].key()).endswith(("Grad", "Jvp")):
            return True  # (a rule runs at a grad or jvp level: a safe answer elsewhere)
        level = stack[-1].level()
    for t in tensors:
        while isinstance(t, Tensor) and _functorch.is_functorch_wrapped_tensor(t):
            if _functorch.is_gradtrackingtensor(t) and _functorch.maybe_get_level(t) != level:
                return True  # tracked by an outer grad or jvp level
            t = _functorch.get_unwrapped(t)
        if isinstance(t, Tensor) and t.requires_grad:
            return True  # tracked outside every transform
    return False


def physical(t: Tensor) -> Tensor:
    """``t`` with every functorch wrapper taken off: under vmap the values of every sample at
    once (for checks that hold for each sample iff they hold for all), else ``t``'s own."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t.detach()


def lowered(*tensors: object) -> tuple[int, list] | None:
    """``tensors`` seen one transform level down, for a rule (a ``jvp`` staticmethod) that
    functorch calls with tensors wrapped at its own, innermost grad / jvp level: ``(level,
    plain)`` where every tensor is plain or a grad wrapper of that level around a plain
    tensor, else None (nothing wrapped, or another transform's wrapper underneath: vmap, an
    outer level). The rule may then compute on the plain tensors under :func:`below` (on
    worker threads too, which have no functorch state) and wrap its outputs back with
    :func:`rewrap`: functorch's own forward of an autograd.Function does the same."""
    if torch.compiler.is_compiling():
        return None
    level, out = None, []
    for t in tensors:
        if isinstance(t, Tensor) and _functorch.is_functorch_wrapped_tensor(t):
            if not _functorch.is_gradtrackingtensor(t):
                return None
            lv = _functorch.maybe_get_level(t)
            if level is not None and lv != level:
                return None
            level, t = lv, _functorch._unwrap_for_grad(t, lv)
            if _functorch.is_functorch_wrapped_tensor(t):
                return None
        out.append(t)
    stack = _stack()
    if level is None or not stack or stack[-1].level() != level:
        return None
    return level, out


def below() -> contextlib.AbstractContextManager:
    """The innermost transform set aside (see :func:`lowered`)."""
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    return retrieve_current_functorch_interpreter().lower()


def rewrap(t: Tensor | None, level: int) -> Tensor | None:
    """A rule's output computed on :func:`lowered`'s tensors, wrapped back at ``level``."""
    return None if t is None else _functorch._wrap_for_grad(t, level)
