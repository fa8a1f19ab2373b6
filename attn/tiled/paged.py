"""The tiled backend's paged reads of a KV cache, forward only: work items of one row's key
range each, read as a view of its pages or a copy of them (docs/kvcache.md, "How attention
reads it"); the launchers and tiles are :mod:`attn.tiled.attention`'s."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from attn.kvquant import decode_codes, dequantize
from attn.masks import Band
from attn.spec import LaunchSpec, Operands, PageTable, QuantPages, check_paged_forward_only
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import cpu
from attn.tiled.attention import _caller, _check_operands, _facts, _fwd_rows, _merge_partials
from attn.tiled.plan import DEFAULT, TileConfig, item_threads, kv_split, page_ranges

__all__ = ["paged_attention"]


class _PagedItem(NamedTuple):
    """One item of a paged call: batch row b's keys from its ``n0``-th on (counted from its
    first key), positions ``[a, z)`` of its pages; ``r``: the range's index, its slot among
    the row's partials; ``first``: the first page's id when the range's stored pages (its
    coded ones, in a quantized cache) are consecutive in the storage (one view), else None
    (its pages copied, in table order)."""
    b: int
    r: int
    n0: int
    a: int
    z: int
    first: int | None


def _page_items(pages: PageTable, page: int, chunk: int, coded_until: Tensor | None = None
                ) -> tuple[list[_PagedItem], int]:
    """Every row's key ranges (:func:`attn.tiled.plan.page_ranges`) as items, range-major
    (each row's first range, then each row's second, ...), and the most ranges of a row.
    ``coded_until (B,)``: a quantized cache's first full-precision page per row, whose table
    entries name ring slots, not storage pages: ``first`` looks at the pages before it."""
    table, starts, lengths = pages
    # consecutive[b, j]: page j + 1 of row b is the storage's next page after page j
    consecutive = table[:, 1:] == table[:, :-1] + 1
    per_row = [page_ranges(int(s), int(e), page, chunk) for s, e in zip(starts, lengths)]
    items = []
    for b, ranges in enumerate(per_row):
        s = int(starts[b])
        for r, (a, z) in enumerate(ranges):
            p0, p1 = a // page, -(-z // page)
            if coded_until is not None:
                p1 = min(max(int(coded_until[b]), p0), p1)
            one_view = p1 > p0 and bool(consecutive[b, p0:p1 - 1].all())
            items.append(_PagedItem(b, r, a - s, a, z, int(table[b, p0]) if one_view else None))
    items.sort(key=lambda it: (it.r, it.b))
    return items, max((len(r) for r in per_row), default=0)


def _page_span(storage: Tensor, table_row: Tensor, p0: int, p1: int, first: int | None,
               name: str) -> tuple[Tensor, slice | Tensor]:
    """Pages ``[p0, p1)`` of one row ``(p1 - p0, page, Hkv, ·)``: a view of the storage from
    page ``first`` when they are consecutive there (``first`` not None), else a copy of those
    pages only into the thread's buffer ``name``; and where they lie in the storage (a slice,
    or their ids), for whatever else is stored per page (a quantized cache's scales)."""
    if first is not None:
        at = slice(first, first + p1 - p0)
        return storage[at], at
    at = table_row[p0:p1].to(storage.device)
    span = cpu.scratch(name, (p1 - p0,) + tuple(storage.shape[1:]), storage.dtype,
                       storage.device)
    torch.index_select(storage, 0, at, out=span)
    return span, at


def _read_pages(storage: Tensor, table_row: Tensor, page: int, it: _PagedItem, name: str
                ) -> Tensor:
    """An item's keys (or values) ``(1, Hkv, n, D)``, positions ``[a, z)`` of its row: its
    pages (:func:`_page_span`: a view, or a copy of the item's own pages, never the row's
    other pages)."""
    p0, p1 = it.a // page, -(-it.z // page)
    span, _ = _page_span(storage, table_row, p0, p1, it.first, name)
    # (pages, page, Hkv, D) -> (pages·page, Hkv, D) -> (1, Hkv, n, D): views
    return span.flatten(0, 1)[it.a - p0 * page:it.z - p0 * page].transpose(0, 1).unsqueeze(0)


def _dequantize_rows(c: Tensor, s: Tensor, kind: str, lo: int, out: Tensor) -> None:
    """Rows ``[lo, lo + m)`` of the coded pages ``c (P, page, Hkv, Dc)`` read end to end,
    dequantized into ``out (m, Hkv, D)``: whole pages in one call, a partial first or last
    page on its own, so a range inside one long page dequantizes only its own rows. ``s``:
    the pages' scales, ``(P, page, Hkv, G)`` per token, ``(P, 1, Hkv, D)`` per channel, or
    ``(1, 1, Hkv, 1)`` per head."""
    page, m = c.shape[1], out.shape[0]
    j, r, done = lo // page, lo % page, 0
    while done < m:
        sj = s if s.shape[0] == 1 else s[j:]
        if r == 0 and m - done >= page:  # whole pages, as many as the range holds
            n = (m - done) // page
            dequantize(c[j:j + n], sj[:n] if s.shape[0] > 1 else sj,
                       kind, out=out[done:done + n * page].view(n, page, *out.shape[1:]))
            done, j = done + n * page, j + n
            continue
        take = min(page - r, m - done)
        sp = sj[0]  # (page or 1, Hkv, G): this page's scales
        dequantize(c[j, r:r + take], sp[r:r + take] if sp.shape[0] == page else sp, kind,
                   out=out[done:done + take])
        done, j, r = done + take, j + 1, 0


def _per_key(scales: Tensor, page: int) -> bool:
    """Whether ``scales`` give one multiplier per key and kv head (per token with one group,
    ``(P, page, Hkv, 1)``, or per kv head, ``(Hkv,)``): then an item keeps the bare codes and
    the tile GEMMs apply the scales to q kᵀ's and P's columns (``_Gemm(key_scales=)``)."""
    return scales.dim() == 1 or (scales.shape[1] == page and scales.shape[-1] == 1)


def _read_codes(codes: Tensor, scales: Tensor, recent: Tensor | None, quant: QuantPages,
                table_row: Tensor, recent_from: int, page: int, it: _PagedItem, name: str,
                dtype: torch.dtype, raw: bool = False) -> tuple[Tensor, Tensor | None]:
    """A quantized item's keys (or values) ``(1, Hkv, n, D)`` in ``dtype``, positions ``[a,
    z)`` of its row, in its thread's buffer ``name``: the range's rows of its coded pages
    dequantized into it (their codes and scales only: a view where the pages are consecutive,
    else a copy of them), the rows of its full-precision recent pages copied after them.

    Where the scales are one per key and kv head (:func:`_per_key`), the rows hold the bare
    codes (as numbers) and the second result is each row's multiplier ``(Hkv, n)`` float32
    (1 for the recent rows), for the GEMMs to apply; else it is None. With ``raw`` too (int8
    keys scored against an int8 q), a range of codes only comes back as the codes themselves
    (a view of the storage where its pages are consecutive), never converted."""
    p0, p1 = it.a // page, -(-it.z // page)
    pq = min(max(recent_from, p0), p1)  # pages [p0, pq) hold codes, [pq, p1) full precision
    D = quant.dim(codes.shape[-1])
    n, Hkv = it.z - it.a, codes.shape[2]
    fold = _per_key(scales, page)
    mult = cpu.scratch(name + " scales", (Hkv, n), torch.float32, codes.device) if fold else None
    coded = max(min(it.z, pq * page) - it.a, 0)  # rows [0, coded) come from codes
    keep_codes = raw and fold and coded == n  # the codes themselves, not converted
    span = None if keep_codes else cpu.scratch(name, (n, Hkv, D), dtype, codes.device)
    if coded:
        c, at = _page_span(codes, table_row, p0, pq, it.first, name + " codes")
        lo = it.a - p0 * page
        # (P, page, Hkv, Dc) -> (P·page, Hkv, Dc): the range's rows
        rows = c.flatten(0, 1)[lo:lo + coded]
        if fold:
            unit = 1.0 if keep_codes else decode_codes(rows, quant.kind, out=span[:coded])
            # per kv head (Hkv,) -> (Hkv, 1); per token (P, page, Hkv, 1) -> (Hkv, coded)
            s = (scales[:, None] if scales.dim() == 1
                 else scales[at].flatten(0, 1)[lo:lo + coded, :, 0].t())
            mult[:, :coded] = s.float() * unit
            if keep_codes:  # (n, Hkv, D) -> (1, Hkv, n, D): views
                return rows.transpose(0, 1).unsqueeze(0), mult
        else:
            # per token with groups (P, page, Hkv, G), per channel (P, 1, Hkv, D): as they
            # lie; their multipliers vary along D, so they are applied here
            _dequantize_rows(c, scales[at], quant.kind, lo, span[:coded])
    if coded < n:  # the recent pages' rows, from position pq · page on
        rows = recent[table_row[pq:p1].to(recent.device)].flatten(0, 1)
        first = it.a + coded - pq * page
        span[coded:] = rows[first:first + n - coded]
        if fold:
            mult[:, coded:] = 1.0
    # (n, Hkv, D) -> (1, Hkv, n, D): a view
    return span.transpose(0, 1).unsqueeze(0), mult


def _plan(q: Tensor, ops: Operands, page: int, spec: LaunchSpec, config: TileConfig
          ) -> tuple[list[_PagedItem], int, LaunchSpec, Tensor]:
    """The call's items (range-major; ranges of ``kv_split``'s chunk, or ``split_min_chunk``
    keys for longer query blocks: :func:`attn.tiled.plan.page_ranges`), the slots a row's
    partials take (at least 1), the spec with its tiles (one key tile per item for short
    query blocks, as split-KV decoding's items) and each row's key count ``(B,)``."""
    B, _, Nq, _ = q.shape
    quant = ops.quant
    _, starts, lengths = ops.pages
    n_keys = lengths - starts
    chunk = kv_split(Nq, int(n_keys.max()) if B else 0, config) or config.split_min_chunk
    items, R = _page_items(ops.pages, page, chunk,
                           None if quant is None else quant.recent_from)
    spec = config.tiles(spec)
    if Nq <= config.split_max_q:
        spec = dataclasses.replace(spec, block_n=-(-chunk // page) * page if page <= chunk
                                   else chunk)
    return items, max(R, 1), spec, n_keys


def _partials(items: list[_PagedItem], R: int, B: int, H: int, Nq: int, Dv: int, dtype,
              device) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's R partial outputs ``(R, B, H, Nq, Dv)`` and lse ``(R, B, H, Nq)``, and the
    items' scratch; the slots no item fills (rows with fewer ranges) an empty partial: out
    0, lse -inf (weight 0 in the merge)."""
    parts_out = torch.empty(R, B, H, Nq, Dv, dtype=dtype, device=device)
    parts_lse = torch.empty(R, B, H, Nq, dtype=dtype, device=device)
    scratch = torch.empty(R, B, H, Nq, 2, dtype=dtype, device=device)
    unused = torch.ones(R, B, dtype=torch.bool)
    for it in items:
        unused[it.r, it.b] = False
    if bool(unused.any()):
        parts_out[unused.to(device)] = 0.0
        parts_lse[unused.to(device)] = float("-inf")
    return parts_out, parts_lse, scratch


def _item_keys(k_pages: Tensor, v_pages: Tensor, table_row: Tensor, quant: QuantPages | None,
               page: int, it: _PagedItem, dtype: torch.dtype
               ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """An item's keys and values ``(1, Hkv, n, D[v])`` in q's ``dtype`` (int8 key codes
    stay codes: they are scored as they are), and, from a quantized cache, their
    multipliers (:func:`_read_codes`; else None)."""
    k_mult = v_mult = None
    if quant is not None:
        at = (table_row, int(quant.recent_from[it.b]), page, it)
        k, k_mult = _read_codes(k_pages, quant.k_scales, quant.recent_k, quant, *at,
                                "paged k", dtype, raw=quant.int8_scores)
        v, v_mult = _read_codes(v_pages, quant.v_scales, quant.recent_v, quant, *at,
                                "paged v", dtype)
    else:
        k = _read_pages(k_pages, table_row, page, it, "paged k")
        v = _read_pages(v_pages, table_row, page, it, "paged v")
    if k.dtype != dtype and k.dtype != torch.int8:
        k = k.to(dtype)
    return k, v.to(dtype), k_mult, v_mult


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, spec: LaunchSpec,
                    ops: Operands, config: TileConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """Attention of q ``(B, H, Nq, D)`` against keys read through a page table, forward only
    (caches serve inference) → out ``(B, H, Nq, Dv)`` in q's dtype, lse ``(B, H, Nq)``.

    ``k_pages (num_blocks, page_size, Hkv, D)``, ``v_pages (…, Dv)``: page storage, read
    through its strides; ``ops.pages`` (:class:`attn.spec.PageTable`) says which keys row b
    reads, ``N_b`` of them. The band is per row, counted from its end: row b's is
    ``spec.band`` with ``N_b`` added to its offset (pass the band of a call with no key,
    ``make_band(Nq, 0, …)``, for attn's bottom-right convention). ALiBi slopes ``(B, H)``.

    Work items are (row, key range) pairs, their partials merged in key order (:func:`_plan`;
    docs/kvcache.md, "How attention reads it"). With ``ops.quant``
    (:class:`attn.spec.QuantPages`) each item dequantizes its own range only."""
    if ops.pages is None or ops.attn_mask is not None or ops.captured:
        raise ValueError("paged_attention takes ops.pages, and no attn_mask or score_mod")
    _check_operands(ops._replace(pages=None, quant=None))
    check_paged_forward_only(q, k_pages, v_pages, ops)
    quant = ops.quant
    table = ops.pages.block_table
    B, H, Nq, _ = q.shape
    page, Dv = k_pages.shape[1], v_pages.shape[-1]
    if quant is not None:
        Dv = quant.dim(Dv)
    items, R, spec, n_keys = _plan(q, ops, page, spec, config)
    threads = item_threads(q, Nq * H * int(n_keys.sum()), config)
    if threads is None:
        threads = cpu.workers_for_call()
    caller = _caller(threads)
    with caller:
        parts_out, parts_lse, scratch = _partials(items, R, B, H, Nq, Dv, _acc_dtype(q.dtype),
                                                  q.device)
    band = spec.band

    def run(i: int) -> None:
        it = items[i]
        b = it.b
        k, v, k_mult, v_mult = _item_keys(k_pages, v_pages, table[b], quant, page, it, q.dtype)
        row_band = Band(band.offset + int(n_keys[b]), band.left, band.right)
        ispec = dataclasses.replace(spec, band=row_band).shard(k_start=it.n0)
        iops = Operands(softcap=ops.softcap,
                        alibi=None if ops.alibi is None else ops.alibi[b:b + 1])
        qb, out = q[b:b + 1], parts_out[it.r, b:b + 1]
        facts = _facts(qb, k, v, ispec, iops, items=True)
        if k_mult is not None:  # the bound _facts took is of the codes, not of the keys
            facts = facts._replace(finite_scores=False)
        _fwd_rows(qb, k, v, ispec, iops, out, parts_lse[it.r, b:b + 1], scratch[it.r, b:b + 1],
                  facts=facts, key_scales=(k_mult, v_mult))

    cpu.run_items(run, len(items), threads=threads, flush_denormals=True)
    with caller:
        out, lse = _merge_partials(parts_out, parts_lse, ops.sinks)
        return out.to(q.dtype), lse
