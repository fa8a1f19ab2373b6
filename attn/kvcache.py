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
Pages wholly before every sliding window can be given back as a sequence grows
(:meth:`free_outside_window`).

An :meth:`allocate`-d cache may store its pages quantized (``quant=``, formats in
:mod:`attn.kvquant`): ``k_pages`` / ``v_pages`` then hold codes (int8, or uint8 for int4's
two-per-byte and fp8's bytes) and ``k_scales`` / ``v_scales`` their fp16 scales, indexed by
page like the codes (per token or group: ``(num_blocks, page_size, Hkv, D / group)``; keys
per channel: ``(num_blocks, 1, Hkv, D)``; fp8: ``(Hkv,)`` for the whole cache). With
``recent_pages = W``, each sequence's last W pages stay in full precision in a ring of W
pages of its own (``recent_k`` / ``recent_v``, slot ``b · W + j % W`` for its page j, named
by the block table like any page); a page is quantized, whole, when it leaves that window.
Appends quantize; attention dequantizes as it reads (range by range on CPU).

Bad input raises ValueError (TypeError for a wrong type) naming the argument as the caller
passed it (``names``) and the shapes seen; every page id is checked, unused slots included,
before any page is read or written (torch indexing would wrap a negative id around to another
sequence's page).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor

from attn import kvquant
from attn.kvquant import KVQuant
from attn.masks import window_pair

__all__ = ["KVQuant", "PagedKVCache", "host_ints"]

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
        # sequence (table slots [0, held)), the first of them still held (those before it were
        # given back by free_outside_window), free page ids (plain Python: no tensor edited in
        # and out of inference mode)
        self._refs: list[int] | None = None
        self._held: list[int] = []
        self._first: list[int] = []
        self._free: list[int] = []
        # free_outside_window moved these sequences' starts past keys a wider window needs
        self._trimmed = torch.zeros(self.batch, dtype=torch.bool)
        # free() emptied these sequences and nothing was appended since: reading one is a slip
        self._freed = torch.zeros(self.batch, dtype=torch.bool)
        # a quantized cache (allocate(quant=...)): the format, scales, full-precision ring
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
            cache.quant, cache._dims = quant, dims
            cache.k_scales, cache.v_scales = k_scales, v_scales
            cache.recent_k, cache.recent_v = recent_k, recent_v
            if recent_k is not None:
                cache.storage_dtype = recent_k.dtype
        return cache

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, heads_kv: int, head_dim: int, *,
                 max_seqs: int, max_pages: int | None = None, head_dim_v: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quant: KVQuant | str | None = None,
                 fp8_scales: tuple[float | Tensor, float | Tensor] = (1.0, 1.0)
                 ) -> "PagedKVCache":
        """An empty cache of ``max_seqs`` sequences that owns ``num_blocks`` pages of
        ``page_size`` positions, stored in ``dtype`` (attention reads them in q's dtype,
        converted range by range); a sequence holds at most ``max_pages`` pages (default
        all). Pages are handed out in increasing order as sequences grow, so a sequence
        appended in one piece lies in consecutive pages (read as one view).

        ``quant``: an :class:`attn.kvquant.KVQuant` (or its kind, ``"int8"``, ``"int4"``,
        ``"fp8_e4m3"``): the pages hold codes and scales, ``dtype`` is then the storage of
        the full-precision recent pages. ``fp8_scales``: fp8's fixed scales ``(k, v)``, each
        a float or an ``(Hkv,)`` tensor (per kv head), stored fp16; values past ``448 ·
        scale`` saturate."""
        for name, x in (("num_blocks", num_blocks), ("page_size", page_size),
                        ("heads_kv", heads_kv), ("head_dim", head_dim), ("max_seqs", max_seqs),
                        ("max_pages", max_pages or 1), ("head_dim_v", head_dim_v or 1)):
            if not isinstance(x, int) or isinstance(x, bool) or x < 1:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if isinstance(quant, str):
            quant = KVQuant(quant)
        if quant is not None and not isinstance(quant, KVQuant):
            raise TypeError(f"quant must be an attn.kvquant.KVQuant, a kind name or None, got "
                            f"{type(quant).__name__}")
        Dv = head_dim_v or head_dim
        codes = dtype
        if quant is not None:
            quant.check_dims(head_dim, Dv)
            codes = torch.int8 if quant.kind == "int8" else torch.uint8
        dims = (head_dim, Dv) if quant is None else (quant.code_dim(head_dim),
                                                    quant.code_dim(Dv))
        k = torch.zeros(num_blocks, page_size, heads_kv, dims[0], dtype=codes, device=device)
        v = torch.zeros(num_blocks, page_size, heads_kv, dims[1], dtype=codes, device=device)
        table = torch.zeros(max_seqs, max_pages or num_blocks, dtype=torch.int32, device=device)
        cache = cls(k, v, table, 0)
        cache._refs = [0] * num_blocks
        cache._held = [0] * max_seqs
        cache._first = [0] * max_seqs
        cache._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, 2, ...
        if quant is not None:
            cache._quantized(quant, (head_dim, Dv), dtype, fp8_scales)
        return cache

    def _quantized(self, quant: KVQuant, dims: tuple[int, int], dtype: torch.dtype,
                   fp8_scales) -> None:
        """Turn an empty allocated cache of codes into a quantized one: scales and the ring
        of full-precision recent pages."""
        num_blocks, page, Hkv, _ = self.k_pages.shape
        dev = self.k_pages.device
        self.quant, self._dims, self.storage_dtype = quant, dims, dtype
        if quant.kind == "fp8_e4m3":
            self.k_scales, self.v_scales = (self._head_scales(name, x, Hkv) for name, x in
                                            zip(("fp8_scales[0]", "fp8_scales[1]"), fp8_scales))
        else:
            D, Dv = dims
            k_shape = ((num_blocks, 1, Hkv, D) if quant.k_per_channel
                       else (num_blocks, page, Hkv, D // quant.group_of(D)))
            self.k_scales = torch.zeros(k_shape, dtype=torch.float16, device=dev)
            self.v_scales = torch.zeros(num_blocks, page, Hkv, Dv // quant.group_of(Dv),
                                        dtype=torch.float16, device=dev)
        W = quant.recent_pages
        if W:
            ring = (self.batch * W, page, Hkv)
            self.recent_k = torch.zeros(*ring, dims[0], dtype=dtype, device=dev)
            self.recent_v = torch.zeros(*ring, dims[1], dtype=dtype, device=dev)

    def _head_scales(self, name: str, x: object, Hkv: int) -> Tensor:
        t = torch.as_tensor(x, dtype=torch.float32).reshape(-1).expand(Hkv) if (
            isinstance(x, (int, float)) or (isinstance(x, Tensor) and x.numel() == 1)) else x
        if not isinstance(t, Tensor) or tuple(t.shape) != (Hkv,):
            shown = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float or an (Hkv,) = ({Hkv},) tensor, got "
                             f"{shown}")
        h = t.detach().to(torch.float16)
        if not bool((torch.isfinite(h) & (h > 0)).all()):
            raise ValueError(f"{name} {t.tolist()[:16]} must be positive and finite in fp16")
        return h.to(self.k_pages.device)

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
        """Sequences ``rows`` (host int64) as a cache of their own over the same pages and
        scales (it shares them, and owns none)."""
        sub = copy.copy(self)
        sub._table = self._table[rows]
        sub.block_table = self.block_table[rows.to(self.block_table.device)]
        sub._lengths, sub.starts = self._lengths[rows], self.starts[rows]
        sub._trimmed, sub._freed = self._trimmed[rows], self._freed[rows]
        sub._refs, sub._held, sub._first, sub._free = None, [], [], []
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
                  f"lengths={_shown(self._lengths)}{'...' if self.batch > 16 else ''}"]
        if bool(self.starts.any()):
            parts.append(f"starts={_shown(self.starts)}")
        n = self.k_pages.shape[0]
        parts.append(f"free_pages={self.free_pages} of {n}" if self._refs is not None
                     else f"pages={n} (the caller's block table)")
        return f"PagedKVCache({', '.join(parts)})"

    # -- sizes --

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

    def recent_from(self, rows: Tensor | None = None) -> Tensor:
        """``(B,)`` host int64 (of ``rows``, default all): each sequence's first page in
        full precision; the pages before it hold codes (all of its pages when the cache is
        not quantized: then its number of pages)."""
        lengths = self._lengths if rows is None else self._lengths[rows]
        pages = -(-lengths // self.page_size)
        W = self.quant.recent_pages if self.quant is not None else 0
        return (pages - W).clamp(min=0) if self.quant is not None else pages

    def bytes_per_token(self, n_tokens: int | None = None) -> float:
        """Bytes one cached token costs, keys and values of every kv head, scales included
        (:func:`attn.kvquant.bytes_per_token`; with a full-precision window and ``n_tokens``,
        the average over a sequence of that many)."""
        return kvquant.bytes_per_token(self.quant, self.heads_kv, *self._dims,
                                       page_size=self.page_size, n_tokens=n_tokens,
                                       storage_bytes=self.storage_dtype.itemsize)

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
        anything is written when a sequence has no room or the cache too few free pages (a
        quantized cache: or k / v holds non-finite values)."""
        rows = self._rows("seq_ids", seq_ids)
        for name, t, dim in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if (t.dim() != 4 or t.shape[0] != len(rows) or t.shape[1] != self.heads_kv
                    or t.shape[3] != dim or t.shape[2] != k.shape[2]):
                raise ValueError(f"{name} must be (B, Hkv, Nnew, D) = ({len(rows)}, "
                                 f"{self.heads_kv}, Nnew, {dim}) for "
                                 f"{self._shapes()}, got k {tuple(k.shape)}, v "
                                 f"{tuple(v.shape)}")
            if t.device != self.k_pages.device:
                raise ValueError(f"{name} is on {t.device}, the pages on {self.k_pages.device}")
        n = k.shape[2]
        self._check_fit(self._lengths[rows], n)
        if self.quant is not None:
            self._append_quantized(rows, k, v)
            return
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
        self._advance(rows, n)

    def _advance(self, rows: Tensor, n: int) -> None:
        lengths = self._lengths.clone()
        lengths[rows] += n
        self._lengths = lengths
        if n:
            self._freed[rows] = False

    # -- quantized writes --

    def _quantize(self, k: Tensor, v: Tensor, *, k_pages: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Codes and scales of tokens ``k (…, Hkv, D)``, ``v (…, Hkv, Dv)`` (``k_pages``:
        k is whole pages ``(pages, page, Hkv, D)``, scaled per channel when the format
        says so). The values are first rounded to the storage dtype, so a token gets the
        same codes whether or not it passed through the full-precision window."""
        quant, kind = self.quant, self.quant.kind
        k, v = k.to(self.storage_dtype), v.to(self.storage_dtype)
        kn, vn = ("k (pages)", "v (pages)") if k_pages else ("k (tokens)", "v (tokens)")
        if kind == "fp8_e4m3":
            return (kvquant.quantize_fp8(k, self.k_scales, name=kn),
                    kvquant.quantize_fp8(v, self.v_scales, name=vn), None, None)
        if quant.k_per_channel:
            assert k_pages, "keys scaled per channel are quantized a whole page at a time"
            kc, ks = kvquant.quantize_channels(k, kind, name=kn)
        else:
            kc, ks = kvquant.quantize(k, kind, quant.group, name=kn)
        vc, vs = kvquant.quantize(v, kind, quant.group, name=vn)
        return kc, vc, ks, vs

    def _write_codes(self, blk: Tensor, off: Tensor | None, codes) -> None:
        """Codes and scales (:meth:`_quantize`) into pages ``blk`` at slots ``off`` (None:
        whole pages)."""
        kc, vc, ks, vs = codes
        at = blk if off is None else (blk, off)
        with torch.no_grad():
            self.k_pages[at], self.v_pages[at] = kc, vc
            if ks is not None:
                self.k_scales[at] = ks
                self.v_scales[at] = vs

    def _append_quantized(self, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """append's writes for a quantized cache: every token quantized into its slot when
        there is no full-precision window; else tokens land in the sequence's ring of recent
        pages, and the pages that leave the window are quantized whole into pages taken from
        the pool (refused, before anything is written, when it has too few)."""
        n, page, W = k.shape[2], self.page_size, self.quant.recent_pages
        dev = self.k_pages.device
        # (B', Hkv, Nnew, D) -> (B'·Nnew, Hkv, D): token-major, as the pages store them
        kt, vt = (t.transpose(1, 2).reshape(-1, *t.shape[1::2]) for t in (k, v))
        old = self._lengths[rows]
        pos = (old.view(-1, 1) + torch.arange(n).view(1, n)).flatten()
        seq = rows.repeat_interleave(n)
        j = pos // page
        if W == 0:
            codes = self._quantize(kt, vt)
            if self._refs is not None:
                self._take_pages(rows, n)
            self._write_codes(self._table[seq, j].to(dev), (pos % page).to(dev), codes)
            self._advance(rows, n)
            return
        for name, t in (("k", k), ("v", v)):  # the window's tokens are quantized later
            kvquant.check_finite(name, t)
        new = old + n
        f_old, f_new = self.recent_from(rows), (-(-new // page) - W).clamp(min=0)
        # pages leaving the window: the ring's content plus the new tokens, quantized whole
        # (all of them before a page is taken or written: quantizing may refuse the values)
        leaving = j < f_new[torch.arange(len(rows)).repeat_interleave(n)]
        coded = []
        for i, r in enumerate(rows.tolist()):
            a, z = int(f_old[i]), int(f_new[i])
            if z == a:
                continue
            stage = [torch.empty(z - a, page, self.heads_kv, d, dtype=self.storage_dtype,
                                 device=dev) for d in self._dims]
            in_ring = torch.arange(a, min(z, -(-int(old[i]) // page)))
            ring = (r * W + in_ring % W).to(dev)
            mine = leaving & (seq == r)
            for st, t, rec in zip(stage, (kt, vt), (self.recent_k, self.recent_v)):
                st[:len(in_ring)] = rec[ring]
                st[(j[mine] - a).to(dev), (pos[mine] % page).to(dev)] = t[mine.to(dev)].to(
                    st.dtype)
            coded.append((r, a, self._quantize(*stage, k_pages=True)))
        taken = self._pop_pages(int((f_new - f_old).sum()),
                                f"appending {n} tokens to sequences {rows.tolist()[:16]}")
        quantized: list[tuple[int, int, list[int]]] = []
        for r, a, codes in coded:
            ids, taken = taken[:len(codes[0])], taken[len(codes[0]):]
            self._write_codes(torch.tensor(ids, device=dev), None, codes)
            quantized.append((r, a, ids))
        # the tokens still in the window go to the ring, slot r·W + j % W for page j
        stay = ~leaving
        slot = (seq[stay] * W + j[stay] % W).to(dev)
        with torch.no_grad():
            for rec, t in ((self.recent_k, kt), (self.recent_v, vt)):
                rec[slot, (pos[stay] % page).to(dev)] = t[stay.to(dev)].to(rec.dtype)
        ring_ids = [(r, int(a), [r * W + x % W for x in range(int(a), -(-int(e) // page))])
                    for r, a, e in zip(rows.tolist(), f_new, new)]
        self._edit_table(quantized + ring_ids)
        for r, a, ids in quantized:
            self._held[r] = a + len(ids)
        self._advance(rows, n)

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

    def _edit_table(self, updates: list[tuple[int, int, list[int]]]) -> None:
        """For each ``(row, j0, ids)``: row's pages ``j0, j0 + 1, ...`` become ``ids`` (host
        and device tables, one copy each)."""
        table = self._table.clone()  # edited as a copy: valid in and out of inference mode
        for row, j0, ids in updates:
            table[row, j0:j0 + len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self._table = table
        self.block_table = table.to(self.block_table.device, self.block_table.dtype)

    def _set_pages(self, row: int, j0: int, ids: list[int]) -> None:
        """Row ``row``'s pages ``j0, j0 + 1, ...`` become ``ids``, the last it holds."""
        self._edit_table([(row, j0, ids)])
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
        used = -(-self._lengths // self.page_size)  # table slots in use, ring pages included
        for r in rows.tolist():
            self._release(r, self._first[r], self._held[r])
            self._set_pages(r, 0, [0] * max(self._held[r], int(used[r])))
            self._held[r] = self._first[r] = 0
        lengths, starts = self._lengths.clone(), self.starts.clone()
        lengths[rows], starts[rows] = 0, 0
        self._lengths, self.starts = lengths, starts
        self._trimmed[rows] = False
        self._freed[rows] = True

    def _release(self, row: int, j0: int, j1: int) -> None:
        """Drop row's references to its pages ``[j0, j1)``: a page nobody holds is free."""
        for p in self._table[row, j0:j1].tolist():
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def free_outside_window(self, window: tuple[int, int]) -> int:
        """Give back every page that no query still to come can see through ``window =
        (left, right)`` (attn's pair; ``left >= 0``, the widest left of the model's layers):
        queries still to come sit at positions ``>= lengths[s]`` (call it after a step's
        attention), so they see no key before ``lengths[s] - left``; the pages wholly before
        that go back to the pool (a page a fork still holds stays, with that fork) and
        ``starts[s]`` moves to the first page kept. Full-precision recent pages stay (they
        are the sequence's own ring). Later :func:`attn.decode` calls on those sequences must
        not reach further back (ValueError). Returns the number of pages given back."""
        self._owned("free_outside_window")
        left = window_pair(window)[0] if window is not None else -1
        if left < 0:
            raise ValueError(f"window {window}: an unbounded left (-1) keeps every key; pass "
                             f"left >= 0")
        before = len(self._free)
        page = self.page_size
        starts = self.starts.clone()
        for r in range(self.batch):
            keep = max(int(starts[r]), int(self._lengths[r]) - left)
            j = min(keep // page, self._held[r])
            if j <= self._first[r]:
                continue
            self._release(r, self._first[r], j)
            self._first[r] = j
            starts[r] = max(int(starts[r]), j * page)
            self._trimmed[r] = True
        self.starts = starts
        return len(self._free) - before

    def check_not_freed(self, rows: Tensor | None) -> None:
        """ValueError when a call reads a sequence that :meth:`free` emptied and nothing was
        appended to since: it would attend to nothing and give zeros, silently. (A sequence
        never written to reads as any row without keys: zeros, lse -inf, as DESIGN's rule
        for empty rows says and ragged batches rely on.)"""
        freed = self._freed if rows is None else self._freed[rows]
        hit = freed.nonzero().flatten()
        if hit.numel():
            seqs = (hit if rows is None else rows[hit]).tolist()
            raise ValueError(f"sequences {seqs[:16]} of the cache were freed and hold no keys: "
                             f"decoding them would attend to nothing and return zeros; append "
                             f"their keys first, or leave them out of seq_ids (lengths "
                             f"{_shown(self._lengths)})")

    def check_reach(self, rows: Tensor | None, n_q: int, window) -> None:
        """ValueError when a query of a call (``n_q`` queries per sequence, bottom-right,
        ``window`` as attn's, None: unbounded) could see a key that
        :meth:`free_outside_window` gave back."""
        trimmed = self._trimmed if rows is None else self._trimmed[rows]
        if not bool(trimmed.any()):
            return
        left = -1 if window is None else window[0]
        lengths = self._lengths if rows is None else self._lengths[rows]
        starts = self.starts if rows is None else self.starts[rows]
        low = lengths - n_q - left  # the first query's first visible key
        bad = trimmed & ((left < 0) | (low < starts))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            seq = i if rows is None else int(rows[i])
            reach = "every key" if left < 0 else f"key {int(low[i])}"
            raise ValueError(f"window {window} with {n_q} queries reaches {reach} of sequence "
                             f"{seq}, whose keys before {int(starts[i])} were given back by "
                             f"free_outside_window: pass a window no wider than the one freed "
                             f"with")

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
        W = self.quant.recent_pages if self.quant is not None else 0
        first = self._first[src]
        # pages [first, full) are shared; a partial last page is copied (no window), or the
        # ring of recent pages is (with one)
        full = self._held[src] if W else length // page
        new = self._pop_pages(1, f"forking sequence {src}") if length % page and not W else []
        shared = self._table[src, first:full].tolist()
        for p in shared:
            self._refs[p] += 1
        with torch.no_grad():
            if new:
                for t in (self.k_pages, self.v_pages, self.k_scales, self.v_scales):
                    if t is not None and t.dim() == 4:
                        t[new[0]] = t[int(self._table[src, full])]
            ring = [dst * W + x % W for x in range(full, -(-length // page))] if W else []
            if ring:
                for t in (self.recent_k, self.recent_v):
                    t[ring] = t[self._table[src, full:full + len(ring)].to(t.device)]
        self._set_pages(dst, 0, [0] * first + shared + new)
        self._first[dst] = first
        if ring:
            self._edit_table([(dst, full, ring)])
        lengths, starts = self._lengths.clone(), self.starts.clone()
        lengths[dst], starts[dst] = length, starts[src]
        self._lengths, self.starts = lengths, starts
        self._trimmed[dst], self._freed[dst] = self._trimmed[src], self._freed[src]
        return dst

    # -- reads: the keys [starts[b], lengths[b]) of each sequence --

    def _span(self, start: int, stop: int) -> tuple[int, int, int, int]:
        """Pages ``[p0, p1)`` holding positions ``[start, stop)``, and those positions
        counted from page p0's first slot."""
        page = self.page_size
        p0, p1 = start // page, -(-stop // page)
        return p0, p1, start - p0 * page, stop - p0 * page

    def _values_at(self, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """A quantized cache's keys and values at positions ``pos`` of sequences ``seq``
        (host int64 ``(n,)``), dequantized: float32 ``(n, Hkv, D)``, ``(n, Hkv, Dv)``."""
        page, dev = self.page_size, self.k_pages.device
        j, off = pos // page, pos % page
        blk = self._table[seq, j]
        recent = j >= self.recent_from()[seq]
        coded = (~recent).nonzero().squeeze(1)
        kept = recent.nonzero().squeeze(1)
        out = []
        for codes, scales, ring, dim in ((self.k_pages, self.k_scales, self.recent_k,
                                          self._dims[0]),
                                         (self.v_pages, self.v_scales, self.recent_v,
                                          self._dims[1])):
            x = torch.empty(len(pos), self.heads_kv, dim, dtype=torch.float32, device=dev)
            b, o = blk[coded].to(dev), off[coded].to(dev)
            if scales.dim() == 1:  # one per kv head: (Hkv,) -> (1, Hkv, 1)
                s = scales.view(1, -1, 1)
            else:  # per token (slot o) or per channel (the page's one row)
                s = scales[b, o if scales.shape[1] > 1 else 0]
            x[coded.to(dev)] = kvquant.dequantize(codes[b, o], s, self.quant.kind)
            if len(kept):
                x[kept.to(dev)] = ring[blk[kept].to(dev), off[kept].to(dev)].float()
            out.append(x)
        return out[0], out[1]

    def sequence_kv(self, b: int) -> tuple[Tensor, Tensor]:
        """Sequence b's keys and values ``(N_b, Hkv, D)``: a view of its page when they lie
        in one, else a copy of the pages in use (a quantized cache: dequantized, float32,
        exactly ``code · scale``, the values its attention reads)."""
        if self.quant is not None:
            pos = torch.arange(int(self.starts[b]), int(self.lengths[b]))
            return self._values_at(torch.full_like(pos, b), pos)
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
        if self.batch == 0 or not self.equal_lengths or self.quant is not None:
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
        if self.quant is not None:
            B, n = self.batch, z - a
            pos = torch.arange(int(self.starts[0]), int(self.lengths[0])).repeat(B)
            # (B·N, Hkv, D) -> (B, Hkv, N, D), copied head-major
            return tuple(x.view(B, n, *x.shape[1:]).transpose(1, 2).contiguous()
                         for x in self._values_at(torch.arange(B).repeat_interleave(n), pos))
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
        pos = (torch.arange(total) - cu[:-1][seq] + self.starts[seq])
        if self.quant is not None:  # (total, Hkv, D) copied head-major
            k, v = (x.transpose(0, 1).contiguous().transpose(0, 1)
                    for x in self._values_at(seq, pos))
            return k, v, cu
        pos = pos.to(dev)
        blk = self.block_table[seq.to(dev), pos // page].long()
        k, v = (_head_major(c, blk, pos % page) for c in (self.k_pages, self.v_pages))
        return k, v, cu
