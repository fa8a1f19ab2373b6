"""The writes of a paged cache's :meth:`~attn.kvcache.PagedKVCache.append`: tokens into their
slots (a cache that owns its pages first takes the pages they need), quantized on the way in
when the cache is (:class:`attn.kvcache.quantized.QuantizedPages`: every token into its slot,
or, with a full-precision window, into the sequence's ring and whole pages as they leave it).

Everything that can refuse (room, free pages, values a format cannot hold) is checked or
computed before the first page is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attn import kvquant
from attn.kvcache.pages import take_pages

if TYPE_CHECKING:
    from attn.kvcache import PagedKVCache

__all__ = ["append"]


def append(cache: PagedKVCache, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """Write ``k (B', Hkv, Nnew, D)`` and ``v (B', Hkv, Nnew, Dv)`` (checked) at the lengths
    of sequences ``rows`` (host int64 ``(B',)``), then advance those lengths by Nnew."""
    n = k.shape[2]
    # (B', Hkv, Nnew, D) -> (B'·Nnew, Hkv, D): token-major, as the pages store them
    kt, vt = (t.transpose(1, 2).reshape(-1, *t.shape[1::2]) for t in (k, v))
    stored = (cache.k_pages, cache.v_pages)
    why = f"appending {n} tokens to sequences {rows.tolist()[:16]}"
    if cache.quantized is not None and cache.quant.recent_pages:
        for name, t in (("k", k), ("v", v)):  # the window's tokens are quantized later
            kvquant.check_finite(name, t)
        take = lambda m: cache._pages.take(m, why, cache.page_size)  # noqa: E731
        edits = cache.quantized.append_windowed(stored, rows, cache.lengths[rows], kt, vt,
                                                take)
        cache._edit_table(edits)
        for r, a, ids in edits[:len(edits) - len(rows)]:  # the quantized pages held
            cache._pages.held[r] = a + len(ids)
        cache._advance(rows, n)
        return
    codes = None if cache.quantized is None else cache.quantized.quantize(kt, vt)
    if cache._pages is not None:
        take_pages(cache, rows, n, why)
    dev, page = cache.k_pages.device, cache.page_size
    pos = (cache.lengths[rows].view(-1, 1) + torch.arange(n).view(1, n)).flatten()
    blk = cache.host_table[rows.repeat_interleave(n), pos // page].to(dev)
    off = (pos % page).to(dev)
    if codes is not None:
        cache.quantized.write(stored, blk, off, codes)
    else:
        with torch.no_grad():
            for p, t in zip(stored, (kt, vt)):
                p[blk, off] = t.to(p.dtype)
    cache._advance(rows, n)
