"""Mask predicates shared by every backend.

Causal masks and sliding windows are both a *band* around a diagonal: query ``i`` may see
key ``j`` iff ``-left <= j - (i + offset) <= right`` (``None`` = unbounded side).

* ``attn.attention`` uses the bottom-right diagonal, ``offset = Nk - Nq`` (the KV-cache
  convention: the last query sees the last key), and ``causal=True`` sets ``right = 0``.
* ``attn.scaled_dot_product_attention`` mirrors torch's top-left ``is_causal``: ``offset = 0``.

Dropout keep-masks also live here: a counter-based hash of ``(seed, b, h, i, j)`` so that
any tile of the mask can be regenerated on demand (forward and backward agree, and the
reference reproduces the exact same mask without any backend storing N x N bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Band:
    """Allowed region ``-left <= j - (i + offset) <= right``; ``None`` leaves a side open."""

    offset: int = 0
    left: int | None = None
    right: int | None = None

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None

    def mask(self, offs_m: Tensor, offs_n: Tensor) -> Tensor | None:
        """Bool ``(len(offs_m), len(offs_n))``, True = attend; ``None`` when nothing is masked."""
        if self.is_full:
            return None
        rel = offs_n[None, :] - (offs_m[:, None] + self.offset)
        keep = torch.ones_like(rel, dtype=torch.bool)
        if self.left is not None:
            keep &= rel >= -self.left
        if self.right is not None:
            keep &= rel <= self.right
        return keep

    def key_range(self, m0: int, m1: int, n_keys: int) -> tuple[int, int]:
        """Keys ``[n0, n1)`` that any query in ``[m0, m1)`` may see (empty when n0 >= n1)."""
        n0 = 0 if self.left is None else max(0, m0 + self.offset - self.left)
        n1 = n_keys if self.right is None else min(n_keys, m1 - 1 + self.offset + self.right + 1)
        return n0, n1

    def tile_is_full(self, m0: int, m1: int, n0: int, n1: int) -> bool:
        """True when every (query, key) pair of the tile lies inside the band (no masking)."""
        ok_left = self.left is None or n0 - (m1 - 1 + self.offset) >= -self.left
        ok_right = self.right is None or (n1 - 1) - (m0 + self.offset) <= self.right
        return ok_left and ok_right


def as_4d(mask: Tensor) -> Tensor:
    """A mask broadcastable to (B, H, Nq, Nk) viewed with leading 1s up to 4 dims (no copy)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def make_band(
    n_q: int, n_k: int, *, causal: bool, window: tuple[int, int] | None, top_left: bool = False
) -> Band:
    """The band for ``attn.attention``'s ``causal``/``window`` (bottom-right unless top_left)."""
    offset = 0 if top_left else n_k - n_q
    left = right = None
    if window is not None:
        wl, wr = window
        left = None if wl < 0 else wl
        right = None if wr < 0 else wr
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(offset, left, right)


# -- dropout: a counter-based hash, identical in every backend --------------------------------

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # multipliers of the "lowbias32" integer mixer


def _mul32(x: Tensor, c: int) -> Tensor:
    # (x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c in 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def dropout_keep(
    seed: int, bh: Tensor, offs_m: Tensor, offs_n: Tensor, p: float
) -> Tensor:
    """Keep-mask of dropout, True = keep, shape ``bh.shape + (len(offs_m), len(offs_n))``.

    ``bh`` holds flat ``b * H + h`` indices (int64, any shape). Each element's bit depends
    only on ``(seed, bh, i, j)``, so any tile regenerates exactly: forward, backward and
    the reference see the same mask.
    """
    s = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=bh.device))
    h_bh = _mix32((bh.to(torch.int64) ^ s) & _M32)[..., None]  # (..., 1)
    h_m = _mix32(h_bh ^ (offs_m.to(torch.int64) & _M32))[..., None]  # (..., M, 1)
    bits = _mix32(h_m ^ _mix32(offs_n.to(torch.int64) & _M32))  # (..., M, N)
    threshold = int(p * 2**32)
    return bits >= threshold


# -- recognising "band AND key padding" in a materialized mask --------------------------------

def split_band_padding(mask: Tensor, band: Band) -> Tensor | None:
    """Key padding ``(B, 1, 1, Nk)`` such that ``mask == band & key_padding``, or None.

    ``mask`` is a bool mask (True = attend) broadcastable to ``(B, H, Nq, Nk)``; its own last
    two dims are the query and key grid the band is laid on (expand a broadcast query dim
    first, ``expand`` is a view). Frameworks hand over masks such as Hugging Face's
    ``(B, 1, Nq, Nk)`` causal-plus-padding mask; when one is exactly a band (causal, window)
    AND a per-key padding vector, a backend can apply the band from indices and read only the
    ``(B, 1, 1, Nk)`` vector per tile instead of ``Nq x Nk`` mask entries.

    A key that no query of the band may see can take either padding value; it is reported as
    masked. One vectorized pass over the mask, no loop over rows.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"mask must have 1 to 4 dims, broadcastable to (B, H, Nq, Nk), got "
                         f"shape {tuple(mask.shape)}")
    m = as_4d(mask)  # (B, H, Nq, Nk), any of them possibly 1
    n_q, n_k = m.shape[-2:]
    allowed = band.mask(torch.arange(n_q, device=m.device), torch.arange(n_k, device=m.device))
    if allowed is None:  # no band: the mask must not vary over heads or queries
        key_padding = m[:, :1, :1, :]
        return key_padding if bool((m == key_padding).all()) else None
    # A key counts as present when some allowed (query, key) pair of it attends.
    key_padding = (m & allowed).any(dim=2, keepdim=True).any(dim=1, keepdim=True)
    return key_padding if bool((m == (allowed & key_padding)).all()) else None
