"""flash-attn's error convention for every module of :mod:`attn.compat`.

It lives apart so that the compat modules (flash_attn, rotary, bert_padding) share it without
importing one another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["FlashAttnError", "translating"]


class FlashAttnError(ValueError, RuntimeError):
    """Bad input to a flash-attn function: both a ValueError (attn's convention) and a
    RuntimeError (what flash-attn raises)."""


@contextlib.contextmanager
def translating() -> Iterator[None]:
    """attn's own ValueErrors (bad shapes found deeper down) as FlashAttnError."""
    try:
        yield
    except FlashAttnError:
        raise
    except ValueError as exc:
        raise FlashAttnError(str(exc)) from exc
