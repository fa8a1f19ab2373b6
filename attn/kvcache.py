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
        # every sequence holds the same positions [start, length); appends keep it so
        self.equal_lengths = self.batch == 0 or bool(
            (self.starts == self.starts[0]).all() and (self._lengths == self._lengths[0]).all())

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

    def append(self, k: Tensor, v: Tensor) -> None:
        """Write ``k (B, Hkv, Nnew, D)`` and ``v (B, Hkv, Nnew, Dv)`` (cast to the pages'
        dtype) at positions ``lengths[b] + t`` of each sequence, in place, then advance
        ``lengths`` by Nnew. Refused before anything is written when a sequence has no room."""
        for name, t, pages in (("k", k, self.k_pages), ("v", v, self.v_pages)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if (t.dim() != 4 or t.shape[0] != self.batch or t.shape[1] != pages.shape[2]
                    or t.shape[3] != pages.shape[3] or t.shape[2] != k.shape[2]):
                raise ValueError(f"{name} must be (B, Hkv, Nnew, D) = ({self.batch}, "
                                 f"{pages.shape[2]}, Nnew, {pages.shape[3]}) for "
                                 f"{self._shapes()}, got k {tuple(k.shape)}, v "
                                 f"{tuple(v.shape)}")
            if t.device != pages.device:
                raise ValueError(f"{name} is on {t.device}, the pages on {pages.device}")
        n = k.shape[2]
        self.check_room(n)
        dev, page = self.k_pages.device, self.page_size
        pos = (self.lengths.view(-1, 1) + torch.arange(n).view(1, n)).flatten().to(dev)
        seq = torch.arange(self.batch, device=dev).repeat_interleave(n)
        blk, off = self.block_table[seq, pos // page].long(), pos % page
        with torch.no_grad():
            for pages, t in ((self.k_pages, k), (self.v_pages, v)):
                # (B, Hkv, Nnew, D) -> (B·Nnew, Hkv, D): token-major, as the pages store it
                pages[blk, off] = t.transpose(1, 2).reshape(-1, *t.shape[1::2]).to(pages.dtype)
        self._lengths = self._lengths + n

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
