"""attn: exact, memory-linear scaled-dot-product attention for PyTorch.

The public names below load their module (and torch) on first use, not at ``import attn``:
the ``attn`` command imports this package before parsing its arguments, and ``attn --help``
or ``attn --version`` should not wait a second or more for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AttentionCall": "attn.api",
    "BackendChoice": "attn.api",
    "attention": "attn.api",
    "scaled_dot_product_attention": "attn.api",
    "select_backend": "attn.api",
    "create_block_mask": "attn.flex",
    "flex_attention": "attn.flex",
    "merge_attention": "attn.merge",
    "varlen_attention": "attn.varlen",
    "AttentionOptions": "attn.nn",
    "MultiHeadAttention": "attn.nn",
    "QKNorm": "attn.nn",
    "QKNormConfig": "attn.nn",
    "RotaryEmbedding": "attn.nn",
    "SdpaPatch": "attn.patch",
    "patch_sdpa": "attn.patch",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from attn.api import (AttentionCall, BackendChoice, attention, scaled_dot_product_attention,
                          select_backend)
    from attn.flex import create_block_mask, flex_attention
    from attn.merge import merge_attention
    from attn.nn import AttentionOptions, MultiHeadAttention, QKNorm, QKNormConfig, \
        RotaryEmbedding
    from attn.patch import SdpaPatch, patch_sdpa
    from attn.varlen import varlen_attention


def __getattr__(name: str):
    """A public name, or a submodule (``attn.tiled`` after a bare ``import attn``), loaded
    on first access and then cached in the package's namespace."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists but something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
