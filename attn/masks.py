"""Mask predicates shared by every backend.

Causal masks and sliding windows are both a *band* around a diagonal: query ``i`` may see
key ``j`` iff ``-left <= j - (i + offset) <= right`` (``None`` = unbounded side).

* ``attn.attention`` uses the bottom-right diagonal, ``offset = Nk - Nq`` (the KV-cache
  convention: the last query sees the last key), and ``causal=True`` sets ``right = 0``.
* ``attn.scaled_dot_product_attention`` mirrors torch's top-left ``is_causal``: ``offset = 0``.

Dropout keep-masks also live here, a hash that any tile regenerates (:func:`dropout_keep`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class Band(NamedTuple):
    """Allowed region ``-left <= j - (i + offset) <= right``; ``None`` leaves a side open.

    A NamedTuple (immutable, hashable) rather than a dataclass: torch.compile traces a
    default ``Band()`` on every torch version the project supports."""

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


# -- window conventions: one meaning each, translated here ---------------------------------

def window_pair(window: object, *, name: str = "window") -> tuple[int, int] | None:
    """``attention(window=...)``: a pair ``(left, right)``, -1 for an unbounded side; an int
    is a TypeError there (its meaning depends on causality, see :func:`module_window`)."""
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool) and window >= 0:
        raise TypeError(f"{name} must be a pair of ints (left, right), -1 for unbounded, "
                        f"got the int {window}: ({window}, 0) for each query and the {window} "
                        f"keys before it (a causal sliding window), ({window}, {window}) for "
                        f"{window} on each side")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"{name} must be a pair of ints (left, right), -1 for unbounded, "
                        f"got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"{name} sides must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return int(window[0]), int(window[1])


def module_window(window: object, *, causal: bool) -> tuple[int, int] | None:
    """``MultiHeadAttention(window=w)``: an int ``w`` means ``(w, 0)`` when causal and
    ``(w, w)`` when not — the query itself plus w neighbours on each open side; a pair
    ``(left, right)`` passes through (-1 = unbounded). A config error is a ValueError."""
    if window is None:
        return None
    if isinstance(window, int) and not isinstance(window, bool):
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        return (window, 0 if causal else window)
    if (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        return int(window[0]), int(window[1])
    raise ValueError(f"window must be an int or a pair (left, right) of ints >= -1, "
                     f"got {window!r}")


def hf_sliding_window(w: int) -> tuple[int, int]:
    """Hugging Face's ``sliding_window=W`` (key j visible iff ``j > i - W``): ``(W - 1, 0)``."""
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"sliding_window must be a positive int, got {w!r}")
    return (w - 1, 0)


def key_padding_mask(lengths: Tensor, n_k: int) -> Tensor:
    """Bool ``(B, 1, 1, n_k)``, True for the first ``lengths[b]`` keys of each batch row (a
    right-padded batch): the form ``attn_mask`` reads per key block, never N x N."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-d (B,), got shape {tuple(lengths.shape)}")
    return (torch.arange(n_k, device=lengths.device) < lengths[:, None])[:, None, None, :]


# -- block classification: which (query block, key block) tiles to visit, and how ----------

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Blocks:
    """For each query block ``[m0, m0 + block_m)``: the key tiles a backend visits, each
    ``(n0, n1, full)``. Tiles not listed are empty (skipped); ``full`` tiles need no mask
    work at all; the others are partial (the backend applies the mask inside the tile).
    """

    block_m: int
    block_n: int
    n_q: int
    n_k: int
    tiles: tuple[tuple[tuple[int, int, bool], ...], ...]

    def query_blocks(self):
        """``(m0, m1, key_tiles)`` for every query block, in order."""
        for i, row in enumerate(self.tiles):
            m0 = i * self.block_m
            yield m0, min(m0 + self.block_m, self.n_q), row

    def counts(self) -> dict[str, int]:
        """How many tiles are full, partial and empty (skipped), over the whole grid."""
        full = sum(f for row in self.tiles for _, _, f in row)
        visited = sum(len(row) for row in self.tiles)
        total = sum(-(-(self.n_k) // self.block_n) for _ in self.tiles)
        return {"full": full, "partial": visited - full, "empty": max(total - visited, 0)}

    def kinds(self) -> Tensor:
        """int8 ``(query blocks, key blocks)`` grid of EMPTY / PARTIAL / FULL for aligned
        key blocks (tiles that start off the grid are attributed to the block they start in)."""
        nb = -(-self.n_k // self.block_n)
        out = torch.zeros(len(self.tiles), nb, dtype=torch.int8)
        for i, row in enumerate(self.tiles):
            for n0, _, full in row:
                out[i, n0 // self.block_n] = max(int(out[i, n0 // self.block_n]),
                                                  FULL if full else PARTIAL)
        return out


def classify_band(band: Band, n_q: int, n_k: int, block_m: int, block_n: int) -> Blocks:
    """Tiles of a band: for each query block, the keys it may see (:meth:`Band.key_range`)
    cut into ``block_n`` tiles from the first visible key; a tile is full when every pair
    in it lies inside the band."""
    rows = []
    for m0 in range(0, n_q, block_m):
        m1 = min(m0 + block_m, n_q)
        n_lo, n_hi = band.key_range(m0, m1, n_k)
        tiles = ((n0, min(n0 + block_n, n_hi)) for n0 in range(n_lo, n_hi, block_n))
        rows.append(tuple((n0, n1, band.tile_is_full(m0, m1, n0, n1)) for n0, n1 in tiles))
    return Blocks(block_m, block_n, n_q, n_k, tuple(rows))


def classify_grid(kinds: Tensor, n_q: int, n_k: int, block_m: int, block_n: int) -> Blocks:
    """Blocks from an EMPTY / PARTIAL / FULL grid over aligned ``block_m x block_n`` tiles."""
    rows = []
    for row in kinds.tolist():  # one host copy of the grid
        rows.append(tuple((jb * block_n, min((jb + 1) * block_n, n_k), k == FULL)
                          for jb, k in enumerate(row) if k != EMPTY))
    return Blocks(block_m, block_n, n_q, n_k, tuple(rows))


def band_kinds(band: Band, n_q: int, n_k: int, block_m: int, block_n: int) -> Tensor:
    """EMPTY / PARTIAL / FULL grid of a band over aligned ``block_m x block_n`` tiles (the
    form a block mask is combined with: a tile is visited when both visit it)."""
    m0 = torch.arange(0, n_q, block_m)[:, None]
    n0 = torch.arange(0, n_k, block_n)[None, :]
    m1, n1 = (m0 + block_m).clamp(max=n_q), (n0 + block_n).clamp(max=n_k)
    rel_lo = n0 - (m1 - 1 + band.offset)  # the smallest j - (i + offset) in the tile
    rel_hi = (n1 - 1) - (m0 + band.offset)  # the largest
    left = n_k + n_q if band.left is None else band.left
    right = n_k + n_q if band.right is None else band.right
    empty = (rel_hi < -left) | (rel_lo > right)
    full = (rel_lo >= -left) & (rel_hi <= right)
    return torch.where(full, FULL, torch.where(empty, EMPTY, PARTIAL)).to(torch.int8)


def combine_kinds(*grids: Tensor) -> Tensor:
    """Tiles visited by every grid (AND of masks): EMPTY < PARTIAL < FULL, so the minimum."""
    return functools.reduce(torch.minimum, grids)


def classify_predicate(keep: Tensor, block_m: int, block_n: int) -> Blocks:
    """Blocks of a dense bool ``(..., Nq, Nk)`` mask (True = attend), over every leading
    index: a tile is empty when no pair is kept for any leading index, full when all are."""
    n_q, n_k = keep.shape[-2:]
    k2 = keep.reshape(-1, n_q, n_k)
    pad_q, pad_k = -n_q % block_m, -n_k % block_n
    any_ = torch.nn.functional.pad(k2, (0, pad_k, 0, pad_q), value=False)
    all_ = torch.nn.functional.pad(k2, (0, pad_k, 0, pad_q), value=True)
    qb, kb = (n_q + pad_q) // block_m, (n_k + pad_k) // block_n
    any_t = any_.view(-1, qb, block_m, kb, block_n).any(dim=(0, 2, 4))
    all_t = all_.view(-1, qb, block_m, kb, block_n).all(dim=(0, 2, 4))
    kinds = torch.where(all_t, FULL, torch.where(any_t, PARTIAL, EMPTY)).to(torch.int8)
    return classify_grid(kinds, n_q, n_k, block_m, block_n)


def classify_documents(doc_q: Tensor, doc_k: Tensor, block_m: int, block_n: int) -> Blocks:
    """Blocks of a document mask (query i sees key j iff ``doc_q[i] == doc_k[j]``), from
    sorted document ids ``(Nq,)`` / ``(Nk,)`` (packed sequences): a tile is empty when its
    query and key id ranges do not overlap, full when both hold one and the same document."""
    if doc_q.dim() != 1 or doc_k.dim() != 1:
        raise ValueError(f"document ids must be 1-d, got {tuple(doc_q.shape)} and "
                         f"{tuple(doc_k.shape)}")
    n_q, n_k = doc_q.numel(), doc_k.numel()
    q_lo = doc_q[::block_m]
    q_hi = torch.stack([doc_q[min(m + block_m, n_q) - 1] for m in range(0, n_q, block_m)])
    k_lo = doc_k[::block_n]
    k_hi = torch.stack([doc_k[min(n + block_n, n_k) - 1] for n in range(0, n_k, block_n)])
    overlap = (q_lo[:, None] <= k_hi[None, :]) & (k_lo[None, :] <= q_hi[:, None])
    one_doc = (q_lo[:, None] == q_hi[:, None]) & (k_lo[None, :] == k_hi[None, :]) \
        & (q_lo[:, None] == k_lo[None, :])
    kinds = torch.where(one_doc, FULL, torch.where(overlap, PARTIAL, EMPTY)).to(torch.int8)
    return classify_grid(kinds.cpu(), n_q, n_k, block_m, block_n)


def as_bool_mask(mask: Tensor) -> Tensor | None:
    """``mask`` as bool (True = attend) when that is exact: a bool mask as is, a float mask
    holding only 0 and -inf; None for a float mask with any other value (a real bias)."""
    if mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    return keep if bool((keep | (mask == float("-inf"))).all()) else None


def as_4d(mask: Tensor) -> Tensor:
    """A mask broadcastable to (B, H, Nq, Nk) viewed with leading 1s up to 4 dims (no copy)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def make_band(
    n_q: int, n_k: int, *, causal: bool, window: tuple[int, int] | None, top_left: bool = False
) -> Band:
    """The band for ``attn.attention``'s ``causal``/``window`` (bottom-right unless top_left)."""
    offset = 0 if top_left else n_k - n_q
    left, right = (-1, -1) if window is None else window
    left, right = (None if w < 0 else w for w in (left, right))  # -1: an unbounded side
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(offset, left, right)


def dense_keep(n_q: int, n_k: int, *, causal: bool = False,
               window: tuple[int, int] | None = None, attn_mask: Tensor | None = None,
               top_left: bool = False, device: torch.device | str | None = None
               ) -> Tensor | None:
    """``causal``, ``window`` and a bool ``attn_mask`` as one bool mask (True = attend),
    broadcastable to (B, H, Nq, Nk); None when nothing masks. A float mask is the caller's."""
    band = make_band(n_q, n_k, causal=causal, window=window, top_left=top_left)
    keep = band.mask(torch.arange(n_q, device=device), torch.arange(n_k, device=device))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    return keep


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
    the reference see the same mask, and no backend stores N x N bits.
    """
    return dropout_keep_rows(seed, bh[..., None], offs_m, offs_n, p)


def dropout_keep_rows(
    seed: int, bh_rows: Tensor, offs_m: Tensor, offs_n: Tensor, p: float
) -> Tensor:
    """:func:`dropout_keep` with the flat ``b * H + h`` index given per row, ``bh_rows``
    ``(..., M)`` (or ``(..., 1)``): packed sequences draw, row by row, the mask their padded
    batch would (b = the row's sequence, positions inside it). Shape ``(..., M, N)``."""
    s = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=bh_rows.device))
    h_bh = _mix32((bh_rows.to(torch.int64) ^ s) & _M32)  # (..., M or 1)
    h_m = _mix32(h_bh ^ (offs_m.to(torch.int64) & _M32))[..., None]  # (..., M, 1)
    bits = _mix32(h_m ^ _mix32(offs_n.to(torch.int64) & _M32))  # (..., M, N)
    return bits >= int(p * 2**32)


# -- recognising "band AND key padding" in a materialized mask --------------------------------

def split_band_padding(mask: Tensor, band: Band) -> Tensor | None:
    """Key padding ``(B, 1, 1, Nk)`` such that ``mask == band & key_padding``, or None.

    ``mask`` is a bool mask (True = attend) broadcastable to ``(B, H, Nq, Nk)``; its own last
    two dims are the query and key grid the band is laid on (expand a broadcast query dim
    first, ``expand`` is a view). What it is for: :func:`simplify_mask`.

    A key that no query of the band may see can take either padding value; it is reported as
    masked. Vectorized passes over the mask, no loop over rows; a few sampled rows first,
    so that a mask of another kind costs a few rows' test.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"mask must have 1 to 4 dims, broadcastable to (B, H, Nq, Nk), got "
                         f"shape {tuple(mask.shape)}")
    m = as_4d(mask)  # (B, H, Nq, Nk), any of them possibly 1
    n_q = m.shape[-2]
    if n_q > 2 * _SAMPLE_ROWS:  # most masks that are no band and padding fail on a few rows:
        # the test on them is necessary for the whole one (each row's keys are the band's
        # row AND the padding), at a few rows' cost instead of the whole grid's passes
        rows = torch.linspace(0, n_q - 1, _SAMPLE_ROWS, device=m.device).round().long()
        if _band_padding(m.index_select(2, rows), band, rows) is None:
            return None
    return _band_padding(m, band, torch.arange(n_q, device=m.device))


_SAMPLE_ROWS = 8


def _band_padding(m: Tensor, band: Band, rows: Tensor) -> Tensor | None:
    """:func:`split_band_padding` of the 4-d ``m`` whose query dim holds the grid's ``rows``."""
    allowed = band.mask(rows, torch.arange(m.shape[-1], device=m.device))
    if allowed is None:  # no band: the mask must not vary over heads or queries
        key_padding = m[:, :1, :1, :]
        return key_padding if bool((m == key_padding).all()) else None
    # A key counts as present when some allowed (query, key) pair of it attends.
    key_padding = (m & allowed).any(dim=2, keepdim=True).any(dim=1, keepdim=True)
    return key_padding if bool((m == (allowed & key_padding)).all()) else None


def simplify_mask(mask: Tensor, band: Band) -> tuple[Band, Tensor | None] | None:
    """An N x N mask that is only "causal (or the call's own band) + key padding", as a band
    and a ``(B, 1, 1, Nk)`` padding mask (None when no key is padded), or None.

    ``mask`` is bool, or float holding only 0 and -inf (a bias with other values is not a
    mask); ``band`` is the call's own band, and the causal band on its diagonal is tried
    too. Backends then skip the tiles the band rules out and read Nk entries per key tile
    instead of Nq x Nk: what Hugging Face's (B, 1, Nq, Nk) causal-plus-padding masks need.
    """
    n_q, n_k = mask.shape[-2:] if mask.dim() >= 2 else (1, mask.shape[-1])
    if mask.dim() < 2 or n_q < 2 or n_k < 2 or mask.requires_grad:
        return None
    keep = as_bool_mask(mask)
    if keep is None:
        return None
    causal = Band(band.offset, band.left, 0 if band.right is None else min(band.right, 0))
    for candidate in (band, causal):
        padding = split_band_padding(keep, candidate)
        if padding is not None:
            return candidate, None if bool(padding.all()) else padding
    return None
