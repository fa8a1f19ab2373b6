"""A paged KV cache: fixed-size pages of keys and values, a block table per sequence, lengths.

Storage is flash-attn's (and vLLM's) paged layout, the documented exception to attn's
``(B, H, N, D)``: ``k_pages (num_blocks, page_size, Hkv, D)`` and ``v_pages (num_blocks,
page_size, Hkv, Dv)``; sequence b's logical position t lives in page ``block_table[b, t //
page_size]`` at offset ``t % page_size``. Pages are read through their strides where one view
covers what is asked for, and gathered otherwise (copies of the pages in use only).

Sequence b holds the keys ``[starts[b], lengths[b])``: ``lengths`` is where its next token
goes, ``starts`` (default 0) its first key still in use (a left pad). Reads stop at each
sequence's length: the tail of its last page, and pages no sequence uses, may hold anything,
NaN included, without reaching anyone's output.

A contiguous cache ``(rows, L, Hkv, D)`` is the paged one whose pages are whole rows:
``page_size = L`` and ``block_table = rows_in_use[:, None]`` (:mod:`attn.compat.flash_attn`
reads flash-attn's plain caches that way, so both kinds share every read below).

A cache made by :meth:`PagedKVCache.allocate` owns its pages: it hands them out as
sequences grow (:meth:`append`), takes them back (:meth:`free`) and shares them between
sequences (:meth:`fork`: full pages by reference count, the last partial page copied, so
no page is ever written while shared: appends go past a sequence's length, which lies in
its own last page or a new one). Running out of pages raises before anything is written.
A cache built on the caller's own block table (flash-attn's) leaves the pages to the caller.

Bad input raises ValueError (TypeError for a wrong type) naming the argument as the caller
passed it (``names``) and the shapes seen; every page id is checked, unused slots included,
before any page is read or written (torch indexing would wrap a negative id around to another
sequence's page).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["PagedKVCache", "host_ints"]

# the argument names a message uses unless the caller passes its own (a name mapped to None
# is not the caller's argument and is left out of the shape lists)
_NAMES = {"k_pages": "k_pages", "v_pages": "v_pages", "block_table": "block_table",
          "lengths": "lengths", "starts": "starts"}


def _shown(t: Tensor) -> list[int]:
    return t.tolist()[:16]


def host_ints(name: str, x: object, n: int, dim: str = "sequences") -> Tensor:
    """An int, or an ``(n,)`` int32 / int64 tensor (``dim`` names that axis in messages),
    as an ``(n,)`` int64 host tensor: one small copy, for host-side checks and plans."""
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((n,), x, dtype=torch.int64)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be an int or a ({dim},) int32 tensor, got "
                        f"{type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64) or tuple(x.shape) != (n,):
        raise ValueError(f"{name} must be ({dim},) = ({n},) int32 (or int64), got {x.dtype} "
                         f"{tuple(x.shape)}")
    return x.cpu().long()


def _head_major(pages: Tensor, blk: Tensor, off) -> Tensor:
    """``pages[blk, off]`` as ``(..., Hkv, D)`` copied head-major (a transposed view of a
    contiguous ``(Hkv, ..., D)``): attention reads ``(Hkv, n, D)`` slabs, and the tiled
    backend on CPU reads strided keys several times slower."""
    return pages.permute(2, 0, 1, 3)[:, blk, off].transpose(0, 1)


class PagedKVCache:
    """Keys and values of ``B`` sequences in pages, read without touching foreign slots.

    ``k_pages (num_blocks, page_size, Hkv, D)``, ``v_pages (num_blocks, page_size, Hkv, Dv)``
    (same device and dtype); ``block_table (B, max_pages)`` int32 or int64 page ids;
    ``lengths`` and ``starts`` ints or ``(B,)`` integer tensors (read on the host, one small
    copy), ``0 <= starts <= lengths <= capacity = max_pages · page_size``. ``names`` maps
    these parameter names to the caller's own (a wrapper's arguments) for error messages.
    """

    def __init__(self, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                 lengths: int | Tensor, *, starts: int | Tensor | None = None,
                 names: Mapping[str, str | None] | None = None) -> None:
        self.names = {**_NAMES, **(names or {})}
        self._check_pages(k_pages, v_pages)
        self.k_pages, self.v_pages = k_pages, v_pages
        self._table = self._check_block_table(block_table)  # host int64 copy
        self.block_table = block_table
        self._lengths = self._host_lengths("lengths", lengths)
        self.starts = (torch.zeros_like(self._lengths) if starts is None
                       else self._host_lengths("starts", starts))
        self._check_fit(self._lengths, 0)
        if bool((self.starts > self._lengths).any()):
            raise ValueError(f"{self._name('starts')} {_shown(self.starts)} must lie in "
                             f"[0, {self._name('lengths')}] = {_shown(self._lengths)}")
        # pages handed out by this cache (allocate): references per page, pages held per
        # sequence, free page ids (plain Python: no tensor edited in and out of inference mode)
        self._refs: list[int] | None = None
        self._held: list[int] = []
        self._free: list[int] = []

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, heads_kv: int, head_dim: int, *,
                 max_seqs: int, max_pages: int | None = None, head_dim_v: int | None = None,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> "PagedKVCache":
        """An empty cache of ``max_seqs`` sequences that owns ``num_blocks`` pages of
        ``page_size`` positions, stored in ``dtype`` (attention reads them in q's dtype,
        converted range by range); a sequence holds at most ``max_pages`` pages (default
        all). Pages are handed out in increasing order as sequences grow, so a sequence
        appended in one piece lies in consecutive pages (read as one view)."""
        for name, x in (("num_blocks", num_blocks), ("page_size", page_size),
                        ("heads_kv", heads_kv), ("head_dim", head_dim), ("max_seqs", max_seqs),
                        ("max_pages", max_pages or 1), ("head_dim_v", head_dim_v or 1)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        k = torch.zeros(num_blocks, page_size, heads_kv, head_dim, dtype=dtype, device=device)
        v = torch.zeros(num_blocks, page_size, heads_kv, head_dim_v or head_dim, dtype=dtype,
                        device=device)
        table = torch.zeros(max_seqs, max_pages or num_blocks, dtype=torch.int32, device=device)
        cache = cls(k, v, table, 0)
        cache._refs = [0] * num_blocks
        cache._held = [0] * max_seqs
        cache._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        return cache

    @property
    def equal_lengths(self) -> bool:
        """Every sequence holds the same positions ``[start, length)``."""
        return self.batch == 0 or bool((self.starts == self.starts[0]).all()
                                       and (self._lengths == self._lengths[0]).all())

    @property
    def host_table(self) -> Tensor:
        """The block table as an int64 host tensor ``(B, max_pages)``."""
        return self._table

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence (an :meth:`allocate`-d cache only)."""
        return len(self._free)

    def select(self, rows: Tensor) -> "PagedKVCache":
        """Sequences ``rows`` (host int64) as a cache of their own over the same pages (it
        shares them, and owns none)."""
        return PagedKVCache(self.k_pages, self.v_pages, self.block_table[rows.to(
            self.block_table.device)], self._lengths[rows], starts=self.starts[rows],
            names=self.names)

    # -- sizes --

    @property
    def batch(self) -> int:
        """The number of sequences (rows of the block table)."""
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def capacity(self) -> int:
        """Positions per sequence: its pages times the page size."""
        return self.block_table.shape[1] * self.page_size

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` int64 on the host: where each sequence's next token goes."""
        return self._lengths

    # -- checks --

    def _name(self, key: str) -> str:
        return self.names[key] or key

    def _shapes(self) -> str:
        """The caller's storage arguments with their shapes (``k_cache (…), block_table (…)``)."""
        shown = [(self.names["k_pages"], self.k_pages),
                 (self.names["block_table"], self.block_table)]
        return ", ".join(f"{n} {tuple(t.shape)}" for n, t in shown if n)

    def _check_pages(self, k_pages: object, v_pages: object) -> None:
        kn, vn = self._name("k_pages"), self._name("v_pages")
        for name, t in ((kn, k_pages), (vn, v_pages)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(f"{name} must have 4 dims (num_blocks, page_size, Hkv, D), "
                                 f"got shape {tuple(t.shape)}")
        if k_pages.shape[:-1] != v_pages.shape[:-1] or 0 in k_pages.shape[:3]:
            raise ValueError(f"{kn} {tuple(k_pages.shape)} and {vn} {tuple(v_pages.shape)} "
                             f"must agree, non-empty, in every dim but the head dim")
        if k_pages.device != v_pages.device or k_pages.dtype != v_pages.dtype:
            raise ValueError(f"{kn} and {vn} must share a device and dtype, got "
                             f"{k_pages.device} {k_pages.dtype} and {v_pages.device} "
                             f"{v_pages.dtype}")

    def _check_block_table(self, table: object) -> Tensor:
        name = self._name("block_table")
        if not isinstance(table, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
        if table.dim() != 2:
            raise ValueError(f"{name} must be 2-d (sequences, max_pages), got shape "
                             f"{tuple(table.shape)}")
        if table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {table.dtype}")
        num_blocks = self.k_pages.shape[0]
        host = table.cpu().long()
        bad = ((host < 0) | (host >= num_blocks)).nonzero()
        if bad.numel():
            b, j = bad[0].tolist()
            raise ValueError(f"{name}[{b}, {j}] = {int(host[b, j])} is not a page of "
                             f"{self._name('k_pages')} {tuple(self.k_pages.shape)}: page ids "
                             f"must lie in [0, num_blocks) = [0, {num_blocks}) "
                             f"({bad.shape[0]} bad ids in {name} {tuple(table.shape)})")
        return host

    def _host_lengths(self, key: str, x: object) -> Tensor:
        """An int or a ``(B,)`` integer tensor as a ``(B,)`` int64 host tensor, ``>= 0``."""
        host = host_ints(self._name(key), x, self.batch)
        if bool((host < 0).any()):
            raise ValueError(f"{self._name(key)} {_shown(host)} must not be negative")
        return host

    def _check_fit(self, lengths: Tensor, new: int) -> None:
        if lengths.numel() and int(lengths.max()) + new > self.capacity:
            more = f" + {new} new tokens" if new else ""
            raise ValueError(f"the cache holds {self.capacity} positions per sequence; "
                             f"{self._name('lengths')} {_shown(lengths)}{more} do not fit "
                             f"({self._shapes()})")

    def check_room(self, new: int) -> None:
        """ValueError unless every sequence has room for ``new`` more tokens."""
        self._check_fit(self.lengths, new)

    # -- writes --

    def append(self, k: Tensor, v: Tensor, *, seq_ids: Tensor | list[int] | None = None
               ) -> None:
        """Write ``k (B', Hkv, Nnew, D)`` and ``v (B', Hkv, Nnew, Dv)`` (cast to the pages'
        dtype) at positions ``lengths[s] + t`` of sequences ``s = seq_ids`` (default every
        sequence, B' = B), in place (under inference_mode too), then advance their lengths
        by Nnew. An :meth:`allocate`-d cache first takes the pages they need. Refused before
        anything is written when a sequence has no room or the cache too few free pages."""
        rows = self._rows("seq_ids", seq_ids)
        for name, t, pages in (("k", k, self.k_pages), ("v", v, self.v_pages)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if (t.dim() != 4 or t.shape[0] != len(rows) or t.shape[1] != pages.shape[2]
                    or t.shape[3] != pages.shape[3] or t.shape[2] != k.shape[2]):
                raise ValueError(f"{name} must be (B, Hkv, Nnew, D) = ({len(rows)}, "
                                 f"{pages.shape[2]}, Nnew, {pages.shape[3]}) for "
                                 f"{self._shapes()}, got k {tuple(k.shape)}, v "
                                 f"{tuple(v.shape)}")
            if t.device != pages.device:
                raise ValueError(f"{name} is on {t.device}, the pages on {pages.device}")
        n = k.shape[2]
        self._check_fit(self._lengths[rows], n)
        if self._refs is not None:
            self._take_pages(rows, n)
        dev, page = self.k_pages.device, self.page_size
        pos = (self._lengths[rows].view(-1, 1) + torch.arange(n).view(1, n)).flatten()
        seq = rows.repeat_interleave(n)
        blk = self._table[seq, pos // page].to(dev)
        off = (pos % page).to(dev)
        with torch.no_grad():
            for pages, t in ((self.k_pages, k), (self.v_pages, v)):
                # (B', Hkv, Nnew, D) -> (B'·Nnew, Hkv, D): token-major, as the pages store it
                pages[blk, off] = t.transpose(1, 2).reshape(-1, *t.shape[1::2]).to(pages.dtype)
        lengths = self._lengths.clone()
        lengths[rows] += n
        self._lengths = lengths

    # -- sequences of an allocate()-d cache --

    def _rows(self, name: str, seq_ids: object) -> Tensor:
        """``seq_ids`` (None: every sequence) as distinct host int64 row indices."""
        if seq_ids is None:
            return torch.arange(self.batch)
        if isinstance(seq_ids, int) and not isinstance(seq_ids, bool):
            seq_ids = [seq_ids]
        if isinstance(seq_ids, (list, tuple)):
            seq_ids = torch.tensor(seq_ids, dtype=torch.int64)
        if not isinstance(seq_ids, Tensor) or seq_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int, a list of ints or an int tensor, got "
                            f"{type(seq_ids).__name__}")
        rows = seq_ids.cpu().long().reshape(-1)
        if bool(((rows < 0) | (rows >= self.batch)).any()) or len(set(rows.tolist())) != len(rows):
            raise ValueError(f"{name} {rows.tolist()[:16]} must be distinct sequences of "
                             f"[0, {self.batch})")
        return rows

    def _owned(self, what: str) -> None:
        if self._refs is None:
            raise ValueError(f"{what} needs a cache that owns its pages "
                             f"(PagedKVCache.allocate); this one reads the caller's block table "
                             f"({self._shapes()})")

    def _pop_pages(self, n: int, why: str) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"out of pages: {why} needs {n} more pages of {self.page_size} "
                             f"positions, {len(self._free)} of {len(self._refs)} are free; "
                             f"free finished sequences or allocate more pages")
        taken = [self._free.pop() for _ in range(n)]
        for p in taken:
            self._refs[p] += 1
        return taken

    def _set_pages(self, row: int, j0: int, ids: list[int]) -> None:
        """Row ``row``'s pages ``j0, j0 + 1, ...`` become ``ids`` (host and device tables)."""
        table = self._table.clone()  # edited as a copy: valid in and out of inference mode
        table[row, j0:j0 + len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self._table = table
        self.block_table = table.to(self.block_table.device, self.block_table.dtype)
        self._held[row] = j0 + len(ids)

    def _take_pages(self, rows: Tensor, n: int) -> None:
        page = self.page_size
        need = [-(-(int(self._lengths[r]) + n) // page) - self._held[r] for r in rows.tolist()]
        total = sum(max(0, x) for x in need)
        pages = self._pop_pages(total, f"appending {n} tokens to sequences {rows.tolist()[:16]}")
        for r, x in zip(rows.tolist(), need):
            if x > 0:
                self._set_pages(r, self._held[r], pages[:x])
                pages = pages[x:]

    def free(self, seq_ids: Tensor | list[int] | int) -> None:
        """Give back the pages of sequences ``seq_ids`` (a page shared with a fork stays
        until its last holder is freed); they become empty (length 0)."""
        self._owned("free")
        rows = self._rows("seq_ids", seq_ids)
        for r in rows.tolist():
            held = self._table[r, :self._held[r]].tolist()
            for p in held:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    self._free.append(p)
            self._set_pages(r, 0, [0] * len(held))
            self._held[r] = 0
        lengths, starts = self._lengths.clone(), self.starts.clone()
        lengths[rows], starts[rows] = 0, 0
        self._lengths, self.starts = lengths, starts

    def fork(self, src: int, dst: int | None = None) -> int:
        """Sequence ``dst`` (default: the first empty sequence, no pages and length 0)
        becomes a copy of ``src``: its full pages shared (reference counted), its last
        partial page copied into a page of its own. Returns ``dst``."""
        self._owned("fork")
        (src,) = self._rows("src", src).tolist()
        if dst is None:
            empty = [r for r in range(self.batch) if r != src and self._held[r] == 0
                     and int(self._lengths[r]) == 0]
            if not empty:
                raise ValueError(f"fork: no empty sequence left of {self.batch}; free one or "
                                 f"pass dst")
            dst = empty[0]
        (dst,) = self._rows("dst", dst).tolist()
        if dst == src or self._held[dst] or int(self._lengths[dst]):
            raise ValueError(f"fork: dst {dst} must be an empty sequence other than src {src} "
                             f"(it holds {self._held[dst]} pages, length "
                             f"{int(self._lengths[dst])})")
        length, page = int(self._lengths[src]), self.page_size
        full = length // page
        new = self._pop_pages(1, f"forking sequence {src}") if length % page else []
        shared = self._table[src, :full].tolist()
        for p in shared:
            self._refs[p] += 1
        if new:
            with torch.no_grad():
                for pages in (self.k_pages, self.v_pages):
                    pages[new[0]] = pages[int(self._table[src, full])]
        self._set_pages(dst, 0, shared + new)
        lengths, starts = self._lengths.clone(), self.starts.clone()
        lengths[dst], starts[dst] = length, starts[src]
        self._lengths, self.starts = lengths, starts
        return dst

    # -- reads: the keys [starts[b], lengths[b]) of each sequence --

    def _span(self, start: int, stop: int) -> tuple[int, int, int, int]:
        """Pages ``[p0, p1)`` holding positions ``[start, stop)``, and those positions
        counted from page p0's first slot."""
        page = self.page_size
        p0, p1 = start // page, -(-stop // page)
        return p0, p1, start - p0 * page, stop - p0 * page

    def sequence_kv(self, b: int) -> tuple[Tensor, Tensor]:
        """Sequence b's keys and values ``(N_b, Hkv, D)``: a view of its page when they lie
        in one, else a copy of the pages in use."""
        p0, p1, a, z = self._span(int(self.starts[b]), int(self.lengths[b]))
        if p1 - p0 <= 1:
            blk = int(self._table[b, p0]) if p1 > p0 else 0
            return self.k_pages[blk, a:z], self.v_pages[blk, a:z]  # views
        blocks = self.block_table[b, p0:p1].long()
        return tuple(pages[blocks].flatten(0, 1)[a:z] for pages in (self.k_pages, self.v_pages))

    @property
    def batch_is_view(self) -> bool:
        """With equal lengths, :meth:`batch_kv` is a view: every sequence's keys lie in one
        page and those pages are consecutive (a contiguous cache read in order)."""
        return self._view_page() is not None

    def _view_page(self) -> int | None:
        """The first sequence's page when :meth:`batch_kv` is a view, else None."""
        if self.batch == 0 or not self.equal_lengths:
            return None
        p0, p1, _, _ = self._span(int(self.starts[0]), int(self._lengths[0]))
        ids = self._table[:, p0] if p1 - p0 == 1 else None
        if ids is None or not bool((ids == ids[0] + torch.arange(self.batch)).all()):
            return None
        return int(ids[0])

    def batch_kv(self) -> tuple[Tensor, Tensor]:
        """Keys and values ``(B, Hkv, N, D)`` of sequences of equal lengths: a view when
        :attr:`batch_is_view`, else copied head-major (only the pages in use)."""
        if not self.equal_lengths:
            raise ValueError(f"batch_kv reads sequences of equal lengths, got starts "
                             f"{_shown(self.starts)} and lengths {_shown(self.lengths)}")
        p0, p1, a, z = self._span(int(self.starts[0]), int(self.lengths[0]))
        pair = (self.k_pages, self.v_pages)
        b0 = self._view_page()
        if b0 is not None:
            # (B, N, Hkv, D) -> (B, Hkv, N, D): views, no copy
            return tuple(c[b0:b0 + self.batch, a:z].transpose(1, 2) for c in pair)
        if p1 - p0 == 1:  # one page each: only the positions in use
            blk = self.block_table[:, p0].long()
            return tuple(_head_major(c, blk, slice(a, z)) for c in pair)
        blocks = self.block_table[:, p0:p1].long()  # (B, pages): only the pages in use
        # (Hkv, B, pages, page, D) -> (B, Hkv, pages·page, D), copied head-major
        return tuple(_head_major(c, blocks, slice(None)).flatten(2, 3)[:, :, a:z] for c in pair)

    def packed_kv(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every sequence's keys and values laid end to end, ``(total, Hkv, D)`` copied
        head-major, and their offsets ``cu_seqlens (B + 1,)`` int64 on the host (the packed
        layout of :func:`attn.varlen_attention`)."""
        n = self.lengths - self.starts
        total = int(n.sum())
        seq = torch.repeat_interleave(torch.arange(self.batch), n)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
        dev, page = self.k_pages.device, self.page_size
        pos = (torch.arange(total) - cu[:-1][seq] + self.starts[seq]).to(dev)
        blk = self.block_table[seq.to(dev), pos // page].long()
        k, v = (_head_major(c, blk, pos % page) for c in (self.k_pages, self.v_pages))
        return k, v, cu
