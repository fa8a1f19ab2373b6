"""Swap attn into code that calls ``torch.nn.functional.scaled_dot_product_attention``.

Libraries such as timm and x-transformers look the function up on ``torch.nn.functional`` at
each call, so replacing that attribute routes them to :func:`attn.scaled_dot_product_attention`
(the same arguments) without editing their code. Code that bound torch's function to a name of
its own before the patch keeps it, except with one of torch's causal biases as ``attn_mask``:
the bias routes the call itself, from its ``__torch_function__``, by asking whether the
function called *is* the one on ``torch.nn.functional``. Under a patch that would answer no and
torch would read the bias as a dense tensor of garbage, so the patch hooks the bias class too
(docs/variants.md, "The drop-in"). attn's own callers of torch's kernels still reach them
(:data:`attn.sdpa.torch_sdpa`).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from attn.api import BACKENDS, scaled_dot_product_attention
from attn.sdpa import torch_sdpa  # captured before any patch can be installed


class SdpaPatch:
    """An installed :func:`patch_sdpa`. ``restore()`` puts back the function that was there
    before (a second call does nothing); used as a context manager it restores on exit.
    ``calls`` counts the calls routed to attn, so a test can see that a model went through it.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.calls = 0
        self._previous = F.scaled_dot_product_attention
        self._active = True

        def routed(*args: Any, **kwargs: Any):
            self.calls += 1
            return scaled_dot_product_attention(*args, backend=self.backend, **kwargs)

        routed.__name__ = routed.__qualname__ = "scaled_dot_product_attention"
        routed.__doc__ = (f"torch.nn.functional.scaled_dot_product_attention routed to "
                          f"attn.scaled_dot_product_attention (backend={backend!r}) by "
                          f"attn.patch_sdpa")
        self._routed = routed
        self._previous_hook = CausalBias.__dict__.get("__torch_function__")
        previous_hook = CausalBias.__torch_function__.__func__

        def bias_hook(cls, func, types, args=(), kwargs=None):
            if func is torch_sdpa:  # torch's function, bound before the patch went on
                return routed(*args, **(kwargs or {}))
            return previous_hook(cls, func, types, args, kwargs)

        self._hook = classmethod(bias_hook)
        F.scaled_dot_product_attention = routed
        CausalBias.__torch_function__ = self._hook

    @property
    def active(self) -> bool:
        return self._active

    def restore(self) -> None:
        if not self._active:
            return
        if F.scaled_dot_product_attention is not self._routed \
                or CausalBias.__dict__.get("__torch_function__") is not self._hook:
            # another patch went on after this one and is still on: putting ours back would
            # silently drop it, or leave it pointing at a function that is gone
            raise RuntimeError("attn.patch_sdpa: torch.nn.functional.scaled_dot_product_"
                               "attention was replaced again after this patch; restore "
                               "patches in the reverse order of installing them")
        F.scaled_dot_product_attention = self._previous
        if self._previous_hook is None:
            del CausalBias.__torch_function__
        else:
            CausalBias.__torch_function__ = self._previous_hook
        self._active = False

    def __enter__(self) -> SdpaPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self._active else "restored"
        return f"SdpaPatch(backend={self.backend!r}, calls={self.calls}, {state})"


def patch_sdpa(backend: str = "auto") -> SdpaPatch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to attn's drop-in,
    :func:`attn.scaled_dot_product_attention` with ``backend``, until restored::

        with attn.patch_sdpa():              # a context manager ...
            out = model(x)                   # model's F.scaled_dot_product_attention is attn's

        patch = attn.patch_sdpa("tiled")     # ... or a plain call
        out = model(x)
        patch.restore()

    Semantics and known differences are the drop-in's (docs/variants.md, "The drop-in"); a
    call attn cannot run raises, as the drop-in does: nothing falls back to torch silently.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return SdpaPatch(backend)
