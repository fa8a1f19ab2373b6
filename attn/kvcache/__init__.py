"""A paged KV cache: fixed-size pages of keys and values, a block table per sequence, lengths.

Storage is flash-attn's (and vLLM's) paged layout, the documented exception to attn's
``(B, H, N, D)``: sequence b's position t lives in page ``block_table[b, t // page_size]``
at offset ``t % page_size``, and b holds the keys ``[starts[b], lengths[b])``; reads stop at
each sequence's length, so unused slots may hold anything, NaN included. :class:`PagedKVCache`
ties this package's modules together (docs/design.md, "The layers", names each); the cache,
its formats and how attention reads it: docs/kvcache.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor

from attn import kvquant
from attn.kvcache import checks, pages, read, write
from attn.kvcache.checks import check_block_table, check_pages, host_ints, seq_rows, shown
from attn.kvcache.pages import PageAllocator
from attn.kvcache.quantized import QuantizedPages
from attn.kvquant import KVQuant

__all__ = ["KVQuant", "PagedKVCache", "host_ints"]

# the argument names a message uses unless the caller passes its own (a name mapped to None
# is not the caller's argument and is left out of the shape lists)
_NAMES = {n: n for n in ("k_pages", "v_pages", "block_table", "lengths", "starts")}


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
        check_pages(self._name("k_pages"), k_pages, self._name("v_pages"), v_pages)
        self.k_pages, self.v_pages = k_pages, v_pages
        self._table = check_block_table(self._name("block_table"), block_table,
                                        self._name("k_pages"), k_pages)  # host int64 copy
        self.block_table = block_table
        self._lengths = self._host_lengths("lengths", lengths)
        self.starts = (torch.zeros_like(self._lengths) if starts is None
                       else self._host_lengths("starts", starts))
        self._check_fit(self._lengths, 0)
        if bool((self.starts > self._lengths).any()):
            raise ValueError(f"{self._name('starts')} {shown(self.starts)} must lie in "
                             f"[0, {self._name('lengths')}] = {shown(self._lengths)}")
        # the pages this cache hands out (allocate), None when they are the caller's
        self._pages: PageAllocator | None = None
        # free_outside_window moved these sequences' starts past keys a wider window needs
        self._trimmed = torch.zeros(self.batch, dtype=torch.bool)
        # free() emptied these sequences and nothing was appended since: reading one is a slip
        self._freed = torch.zeros(self.batch, dtype=torch.bool)
        # a quantized cache (allocate(quant=...)): its format, scales and full-precision ring
        # (attn.kvcache.quantized), the same tensors also named here
        self.quantized: QuantizedPages | None = None
        self.quant: KVQuant | None = None
        self.k_scales: Tensor | None = None
        self.v_scales: Tensor | None = None
        self.recent_k: Tensor | None = None
        self.recent_v: Tensor | None = None
        self._dims = (k_pages.shape[-1], v_pages.shape[-1])
        self.storage_dtype = k_pages.dtype  # of the values (a quantized cache: its recent pages)

    @classmethod
    def over(cls, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths: Tensor, *,
             starts: Tensor, trimmed: Tensor, quant: KVQuant | None = None,
             dims: tuple[int, int] | None = None, k_scales: Tensor | None = None,
             v_scales: Tensor | None = None, recent_k: Tensor | None = None,
             recent_v: Tensor | None = None) -> "PagedKVCache":
        """A cache reading the tensors another cache holds (``trimmed``: its sequences whose
        starts :meth:`free_outside_window` moved; a quantized one's format, head dims ``(D,
        Dv)``, scales and recent ring): a reader that owns no page, as
        ``attn::paged_decode`` rebuilds one from the tensors a compiled graph passes it."""
        cache = cls(k_pages, v_pages, block_table, lengths, starts=starts)
        cache._trimmed = trimmed
        if quant is not None:
            dtype = recent_k.dtype if recent_k is not None else cache.storage_dtype
            cache._set_quantized(QuantizedPages(quant, k_scales, v_scales, recent_k, recent_v,
                                                dims, dtype))
        return cache

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, heads_kv: int, head_dim: int, *,
                 max_seqs: int, max_pages: int | None = None, head_dim_v: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quant: KVQuant | str | None = None,
                 fp8_scales: tuple[float | Tensor, float | Tensor] = (1.0, 1.0)
                 ) -> "PagedKVCache":
        """An empty cache of ``max_seqs`` sequences that owns ``num_blocks`` pages of
        ``page_size`` positions, stored in ``dtype``; a sequence holds at most ``max_pages``
        pages (default all). ``quant``: an :class:`attn.kvquant.KVQuant` or its kind (the
        pages hold codes and scales, ``dtype`` is then the recent pages' storage);
        ``fp8_scales``: fp8's fixed scales ``(k, v)``, each a float or an ``(Hkv,)`` tensor.
        The page order, the formats and the window: docs/kvcache.md."""
        quant = checks.check_allocate(dict(
            num_blocks=num_blocks, page_size=page_size, heads_kv=heads_kv, head_dim=head_dim,
            max_seqs=max_seqs, max_pages=max_pages or 1, head_dim_v=head_dim_v or 1), dtype,
            quant)
        dims = (head_dim, head_dim_v or head_dim)
        codes, stored = dtype, dims
        if quant is not None:
            quant.check_dims(*dims)
            codes = torch.int8 if quant.kind == "int8" else torch.uint8
            stored = (quant.code_dim(dims[0]), quant.code_dim(dims[1]))
        k, v = (torch.zeros(num_blocks, page_size, heads_kv, d, dtype=codes, device=device)
                for d in stored)
        table = torch.zeros(max_seqs, max_pages or num_blocks, dtype=torch.int32, device=device)
        cache = cls(k, v, table, 0)
        cache._pages = PageAllocator(num_blocks, max_seqs)
        if quant is not None:
            cache._set_quantized(QuantizedPages.empty(quant, k, max_seqs, dims, dtype,
                                                      fp8_scales))
        return cache

    def _set_quantized(self, q: QuantizedPages) -> None:
        self.quantized, self.quant, self._dims, self.storage_dtype = q, q.quant, q.dims, q.dtype
        self.k_scales, self.v_scales, self.recent_k, self.recent_v = (
            q.k_scales, q.v_scales, q.recent_k, q.recent_v)

    def select(self, rows: Tensor) -> "PagedKVCache":
        """Sequences ``rows`` (host int64) as a cache of their own over the same pages and
        scales (it shares them, and owns none)."""
        sub = copy.copy(self)
        sub._table = self._table[rows]
        sub.block_table = self.block_table[rows.to(self.block_table.device)]
        sub._lengths, sub.starts = self._lengths[rows], self.starts[rows]
        sub._trimmed, sub._freed = self._trimmed[rows], self._freed[rows]
        sub._pages = None
        return sub

    def __repr__(self) -> str:
        """Sizes, lengths and, for a cache that owns its pages, how many pages are free."""
        parts = [f"batch={self.batch}", f"page_size={self.page_size}",
                 f"heads_kv={self.heads_kv}", f"head_dim={self.head_dim}"]
        if self.head_dim_v != self.head_dim:
            parts.append(f"head_dim_v={self.head_dim_v}")
        parts.append(f"dtype={self.storage_dtype}".replace("torch.", ""))
        if self.quant is not None:
            parts.append(f"quant={self.quant}")
        parts += [f"device={self.k_pages.device}", f"capacity={self.capacity}",
                  f"lengths={shown(self._lengths)}{'...' if self.batch > 16 else ''}"]
        if bool(self.starts.any()):
            parts.append(f"starts={shown(self.starts)}")
        n = self.k_pages.shape[0]
        parts.append(f"free_pages={self.free_pages} of {n}" if self._pages is not None
                     else f"pages={n} (the caller's block table)")
        return f"PagedKVCache({', '.join(parts)})"

    # -- sizes and state --

    @property
    def batch(self) -> int:
        """The number of sequences (rows of the block table)."""
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def heads_kv(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        """D of the keys (a quantized cache's codes may be narrower: int4's two per byte)."""
        return self._dims[0]

    @property
    def head_dim_v(self) -> int:
        return self._dims[1]

    @property
    def capacity(self) -> int:
        """Positions per sequence: its pages times the page size."""
        return self.block_table.shape[1] * self.page_size

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` int64 on the host: where each sequence's next token goes."""
        return self._lengths

    @property
    def host_table(self) -> Tensor:
        """The block table as an int64 host tensor ``(B, max_pages)``."""
        return self._table

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence (an :meth:`allocate`-d cache only)."""
        return 0 if self._pages is None else self._pages.free_pages

    @property
    def equal_lengths(self) -> bool:
        """Every sequence holds the same positions ``[start, length)``."""
        return self.batch == 0 or bool((self.starts == self.starts[0]).all()
                                       and (self._lengths == self._lengths[0]).all())

    def recent_from(self, rows: Tensor | None = None) -> Tensor:
        """``(B,)`` host int64 (of ``rows``, default all): each sequence's first page in
        full precision; the pages before it hold codes (all of its pages when the cache is
        not quantized: then its number of pages)."""
        lengths = self._lengths if rows is None else self._lengths[rows]
        if self.quantized is None:
            return -(-lengths // self.page_size)
        return self.quantized.recent_from(lengths, self.page_size)

    def bytes_per_token(self, n_tokens: int | None = None) -> float:
        """Bytes one cached token costs, keys and values of every kv head, scales included
        (:func:`attn.kvquant.bytes_per_token`; with a full-precision window and ``n_tokens``,
        the average over a sequence of that many)."""
        return kvquant.bytes_per_token(self.quant, self.heads_kv, *self._dims,
                                       page_size=self.page_size, n_tokens=n_tokens,
                                       storage_bytes=self.storage_dtype.itemsize)

    # -- reads (attn.kvcache.read): the keys [starts[b], lengths[b]) of each sequence --

    sequence_kv = read.sequence_kv
    batch_kv = read.batch_kv
    packed_kv = read.packed_kv

    @property
    def batch_is_view(self) -> bool:
        """With equal lengths, :meth:`batch_kv` is a view: every sequence's keys lie in one
        page and those pages are consecutive (a contiguous cache read in order)."""
        return read.view_page(self) is not None

    # -- checks --

    def _name(self, key: str) -> str:
        return self.names[key] or key

    def _shapes(self) -> str:
        """The caller's storage arguments with their shapes (``k_cache (…), block_table (…)``)."""
        shown_ = [(self.names["k_pages"], self.k_pages),
                  (self.names["block_table"], self.block_table)]
        return ", ".join(f"{n} {tuple(t.shape)}" for n, t in shown_ if n)

    def _host_lengths(self, key: str, x: object) -> Tensor:
        """An int or a ``(B,)`` integer tensor as a ``(B,)`` int64 host tensor, ``>= 0``."""
        host = host_ints(self._name(key), x, self.batch)
        if bool((host < 0).any()):
            raise ValueError(f"{self._name(key)} {shown(host)} must not be negative")
        return host

    def _check_fit(self, lengths: Tensor, new: int) -> None:
        if lengths.numel() and int(lengths.max()) + new > self.capacity:
            more = f" + {new} new tokens" if new else ""
            raise ValueError(f"the cache holds {self.capacity} positions per sequence; "
                             f"{self._name('lengths')} {shown(lengths)}{more} do not fit "
                             f"({self._shapes()})")

    def check_room(self, new: int) -> None:
        """ValueError unless every sequence has room for ``new`` more tokens."""
        self._check_fit(self.lengths, new)

    check_not_freed = checks.check_not_freed
    check_reach = checks.check_reach

    # -- writes --

    def append(self, k: Tensor, v: Tensor, *, seq_ids: Tensor | list[int] | None = None
               ) -> None:
        """Write ``k (B', Hkv, Nnew, D)`` and ``v (B', Hkv, Nnew, Dv)`` (cast to the pages'
        dtype) at positions ``lengths[s] + t`` of sequences ``s = seq_ids`` (default every
        sequence, B' = B), in place (under inference_mode too), then advance their lengths
        by Nnew. An :meth:`allocate`-d cache first takes the pages they need. Refused before
        anything is written when a sequence has no room or the cache too few free pages (a
        quantized cache: or k / v holds non-finite values)."""
        rows = seq_rows("seq_ids", seq_ids, self.batch)
        checks.check_tokens(self, len(rows), k, v)
        n = k.shape[2]
        self._check_fit(self._lengths[rows], n)
        write.append(self, rows, k, v)

    def _advance(self, rows: Tensor, n: int) -> None:
        lengths = self._lengths.clone()
        lengths[rows] += n
        self._lengths = lengths
        if n:
            self._freed[rows] = False

    def _edit_table(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """For each ``(row, j0, ids)``: row's pages ``j0, j0 + 1, ...`` become ``ids`` (host
        and device tables, one copy each)."""
        table = self._table.clone()  # edited as a copy: valid in and out of inference mode
        for row, j0, ids in updates:
            table[row, j0:j0 + len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self._table = table
        self.block_table = table.to(self.block_table.device, self.block_table.dtype)

    # -- sequences of an allocate()-d cache (attn.kvcache.pages) --

    free = pages.free
    free_outside_window = pages.free_outside_window
    fork = pages.fork
