"""attn: exact, memory-linear scaled-dot-product attention for PyTorch.

The public names below load their module (and torch) on first use, not at ``import attn``:
the ``attn`` command imports this package before parsing its arguments, and ``attn --help``
or ``attn --version`` should not wait a second or more for torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# the module that defines each public name
_EXPORTS = {
    "attn.api": ("AttentionCall", "BackendChoice", "attention", "scaled_dot_product_attention",
                 "select_backend"),
    "attn.decoding": ("decode",),
    "attn.flex": ("create_block_mask", "flex_attention"),
    "attn.merge": ("merge_attention",),
    "attn.varlen": ("varlen_attention",),
    "attn.nn": ("AttentionOptions", "MultiHeadAttention", "QKNorm", "QKNormConfig",
                "RotaryEmbedding"),
    "attn.patch": ("SdpaPatch", "patch_sdpa"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)

if TYPE_CHECKING:
    from attn.api import (AttentionCall, BackendChoice, attention, scaled_dot_product_attention,
                          select_backend)
    from attn.decoding import decode
    from attn.flex import create_block_mask, flex_attention
    from attn.merge import merge_attention
    from attn.nn import AttentionOptions, MultiHeadAttention, QKNorm, QKNormConfig, \
        RotaryEmbedding
    from attn.patch import SdpaPatch, patch_sdpa
    from attn.varlen import varlen_attention


def _lazy(package: str, exports: dict[str, tuple[str, ...]]):
    """``__getattr__`` and ``__dir__`` for a package whose public names (``exports``: defining
    module -> names) and submodules load on first access, then stay in its namespace."""
    namespace = sys.modules[package].__dict__
    exports = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise  # the submodule exists but something it imports does not
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
