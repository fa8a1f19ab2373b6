"""The page allocator of a cache that owns its pages: reference counts, the free list, and
which of its block table's slots each sequence holds.

Plain Python lists, no tensor: the allocator is edited in and out of inference mode, and
every decision it makes (how many pages an append needs, which pages a window no longer
reaches) is host arithmetic on a few ints. The block table itself stays with the cache
(:class:`attn.kvcache.PagedKVCache`); the functions below (the cache's :meth:`free`,
:meth:`free_outside_window`, :meth:`fork`, and append's :func:`take_pages`) edit it together
with the allocator's counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attn.kvcache.checks import seq_rows
from attn.masks import window_pair

if TYPE_CHECKING:
    from attn.kvcache import PagedKVCache

__all__ = ["PageAllocator", "fork", "free", "free_outside_window", "take_pages"]


class PageAllocator:
    """``num_blocks`` pages shared by ``rows`` sequences.

    ``refs[p]``: how many sequences hold page p (a fork shares full pages); ``held[r]``:
    sequence r holds table slots ``[first[r], held[r])`` (those before ``first[r]`` were
    given back by a sliding window); ``free``: pages nobody holds, popped from the end so
    they are handed out in increasing order (a sequence appended in one piece lies in
    consecutive pages).
    """

    def __init__(self, num_blocks: int, rows: int) -> None:
        self.refs = [0] * num_blocks
        self.held = [0] * rows
        self.first = [0] * rows
        self.free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...

    @property
    def free_pages(self) -> int:
        return len(self.free)

    def take(self, n: int, why: str, page_size: int) -> list[int]:
        """``n`` free pages, each now held once; ValueError (naming ``why``) and nothing
        taken when fewer are free."""
        if n > len(self.free):
            raise ValueError(f"out of pages: {why} needs {n} more pages of {page_size} "
                             f"positions, {len(self.free)} of {len(self.refs)} are free; "
                             f"free finished sequences or allocate more pages")
        taken = [self.free.pop() for _ in range(n)]
        self.share(taken)
        return taken

    def share(self, ids: list[int]) -> None:
        """One more holder for each of ``ids``."""
        for p in ids:
            self.refs[p] += 1

    def release(self, ids: list[int]) -> None:
        """One holder less for each of ``ids``; a page nobody holds goes back to the pool."""
        for p in ids:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def needed(self, rows: list[int], lengths: list[int], n: int, page_size: int) -> list[int]:
        """Pages each of ``rows`` (``lengths``: theirs) must take to hold ``n`` more tokens
        (0 where the pages it holds have room)."""
        return [max(0, -(-(length + n) // page_size) - self.held[r])
                for r, length in zip(rows, lengths)]

    def outside_window(self, starts: list[int], lengths: list[int], left: int,
                       page_size: int) -> list[tuple[int, int]]:
        """``(row, j)`` for each sequence whose slots ``[first, j)`` no query still to come
        sees through a window reaching ``left`` keys back (queries to come sit at positions
        ``>= lengths[r]``): every page wholly before ``max(starts[r], lengths[r] - left)``."""
        cut = []
        for r, (start, length) in enumerate(zip(starts, lengths)):
            j = min(max(start, length - left) // page_size, self.held[r])
            if j > self.first[r]:
                cut.append((r, j))
        return cut

    def empty_row(self, lengths: list[int], but: int) -> int | None:
        """The first sequence other than ``but`` that holds no page and no token, or None."""
        return next((r for r, length in enumerate(lengths)
                     if r != but and self.held[r] == 0 and length == 0), None)


# -- a cache's sequences: the block table edits that go with the allocator's counts --------
# :class:`attn.kvcache.PagedKVCache`'s methods free, free_outside_window and fork (``cache``
# is self); take_pages is append's


def _owned(cache: PagedKVCache, what: str) -> PageAllocator:
    if cache._pages is None:
        raise ValueError(f"{what} needs a cache that owns its pages (PagedKVCache.allocate); "
                         f"this one reads the caller's block table ({cache._shapes()})")
    return cache._pages


def _set_pages(cache: PagedKVCache, row: int, j0: int, ids: list[int]) -> None:
    """Row ``row``'s table slots ``j0, j0 + 1, ...`` become ``ids``, the last it holds."""
    cache._edit_table([(row, j0, ids)])
    cache._pages.held[row] = j0 + len(ids)


def take_pages(cache: PagedKVCache, rows: Tensor, n: int, why: str) -> None:
    """The pages sequences ``rows`` need for ``n`` more tokens, taken and tabled."""
    alloc = cache._pages
    need = alloc.needed(rows.tolist(), cache.lengths[rows].tolist(), n, cache.page_size)
    ids = alloc.take(sum(need), why, cache.page_size)
    for r, x in zip(rows.tolist(), need):
        if x > 0:
            _set_pages(cache, r, alloc.held[r], ids[:x])
            ids = ids[x:]


def free(cache: PagedKVCache, seq_ids: Tensor | list[int] | int) -> None:
    """Give back the pages of sequences ``seq_ids`` (a page shared with a fork stays until
    its last holder is freed); they become empty (length 0)."""
    alloc = _owned(cache, "free")
    rows = seq_rows("seq_ids", seq_ids, cache.batch)
    used = -(-cache.lengths // cache.page_size)  # table slots in use, ring pages included
    for r in rows.tolist():
        alloc.release(cache.host_table[r, alloc.first[r]:alloc.held[r]].tolist())
        _set_pages(cache, r, 0, [0] * max(alloc.held[r], int(used[r])))
        alloc.held[r] = alloc.first[r] = 0
    lengths, starts = cache.lengths.clone(), cache.starts.clone()
    lengths[rows], starts[rows] = 0, 0
    cache._lengths, cache.starts = lengths, starts
    cache._trimmed[rows] = False
    cache._freed[rows] = True


def free_outside_window(cache: PagedKVCache, window: tuple[int, int]) -> int:
    """Give back every page wholly before key ``lengths[s] - left`` of each sequence, which
    no query still to come sees through ``window = (left, right)`` (``left >= 0``; call it
    after a step's attention), and move ``starts[s]`` to the first page kept. Returns the
    number of pages given back. Forks, the ring and later reads: docs/kvcache.md."""
    alloc = _owned(cache, "free_outside_window")
    left = window_pair(window)[0] if window is not None else -1
    if left < 0:
        raise ValueError(f"window {window}: an unbounded left (-1) keeps every key; pass "
                         f"left >= 0")
    before = alloc.free_pages
    starts = cache.starts.clone()
    for r, j in alloc.outside_window(starts.tolist(), cache.lengths.tolist(), left,
                                     cache.page_size):
        alloc.release(cache.host_table[r, alloc.first[r]:j].tolist())
        alloc.first[r] = j
        starts[r] = max(int(starts[r]), j * cache.page_size)
        cache._trimmed[r] = True
    cache.starts = starts
    return alloc.free_pages - before


def fork(cache: PagedKVCache, src: int, dst: int | None = None) -> int:
    """Sequence ``dst`` (default: the first empty sequence, no pages and length 0) becomes
    a copy of ``src``: its full pages shared (reference counted), its last partial page
    copied into a page of its own (no page is ever written while shared), or with a
    full-precision window its ring of recent pages copied. Returns ``dst``."""
    alloc = _owned(cache, "fork")
    (src,) = seq_rows("src", src, cache.batch).tolist()
    if dst is None:
        dst = alloc.empty_row(cache.lengths.tolist(), but=src)
        if dst is None:
            raise ValueError(f"fork: no empty sequence left of {cache.batch}; free one or "
                             f"pass dst")
    (dst,) = seq_rows("dst", dst, cache.batch).tolist()
    if dst == src or alloc.held[dst] or int(cache.lengths[dst]):
        raise ValueError(f"fork: dst {dst} must be an empty sequence other than src {src} "
                         f"(it holds {alloc.held[dst]} pages, length "
                         f"{int(cache.lengths[dst])})")
    length, page = int(cache.lengths[src]), cache.page_size
    W = cache.quant.recent_pages if cache.quant is not None else 0
    table, first = cache.host_table, alloc.first[src]
    # pages [first, full) are shared; a partial last page is copied (no window), or the
    # ring of recent pages is (with one)
    full = alloc.held[src] if W else length // page
    new = alloc.take(1, f"forking sequence {src}", page) if length % page and not W else []
    shared = table[src, first:full].tolist()
    alloc.share(shared)
    ring = [dst * W + x % W for x in range(full, -(-length // page))] if W else []
    with torch.no_grad():
        if new:
            for t in (cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales):
                if t is not None and t.dim() == 4:
                    t[new[0]] = t[int(table[src, full])]
        for t in (cache.recent_k, cache.recent_v) if ring else ():
            t[ring] = t[table[src, full:full + len(ring)].to(t.device)]
    _set_pages(cache, dst, 0, [0] * first + shared + new)
    alloc.first[dst] = first
    if ring:
        cache._edit_table([(dst, full, ring)])
    lengths, starts = cache.lengths.clone(), cache.starts.clone()
    lengths[dst], starts[dst] = length, starts[src]
    cache._lengths, cache.starts = lengths, starts
    cache._trimmed[dst], cache._freed[dst] = cache._trimmed[src], cache._freed[src]
    return dst
