"""Dense reads of a paged cache: one sequence's keys and values, a batch of equal lengths,
or every sequence packed end to end (what :func:`attn.decode` hands ``attention`` and
``varlen_attention`` where no backend reads the pages itself, and what tests compare with).

Each function reads only the keys ``[starts[b], lengths[b])`` of each sequence, through the
cache's public fields (``k_pages``, ``v_pages``, ``block_table``, ``host_table``,
``starts``, ``lengths``, ``quant``): a view where one covers what is asked for, else a copy
of the pages in use only. A quantized cache's values come dequantized, float32, exactly
``code · scale``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attn.kvcache import PagedKVCache

__all__ = ["batch_kv", "packed_kv", "sequence_kv", "values_at", "view_page"]


def _head_major(pages: Tensor, blk: Tensor, off) -> Tensor:
    """``pages[blk, off]`` as ``(..., Hkv, D)`` copied head-major (a transposed view of a
    contiguous ``(Hkv, ..., D)``): attention reads ``(Hkv, n, D)`` slabs, and the tiled
    backend on CPU reads strided keys several times slower."""
    return pages.permute(2, 0, 1, 3)[:, blk, off].transpose(0, 1)


def _span(page: int, start: int, stop: int) -> tuple[int, int, int, int]:
    """Pages ``[p0, p1)`` holding positions ``[start, stop)``, and those positions counted
    from page p0's first slot."""
    p0, p1 = start // page, -(-stop // page)
    return p0, p1, start - p0 * page, stop - p0 * page


def values_at(cache: PagedKVCache, seq: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """A quantized cache's keys and values at positions ``pos`` of sequences ``seq`` (host
    int64 ``(n,)``), dequantized: float32 ``(n, Hkv, D)``, ``(n, Hkv, Dv)``."""
    page = cache.page_size
    j = pos // page
    return cache.quantized.values_at((cache.k_pages, cache.v_pages), cache.host_table[seq, j],
                                     pos % page, j >= cache.recent_from()[seq])


def sequence_kv(cache: PagedKVCache, b: int) -> tuple[Tensor, Tensor]:
    """Sequence b's keys and values ``(N_b, Hkv, D)``: a view of its page when they lie in
    one, else a copy of the pages in use (a quantized cache: dequantized)."""
    start, stop = int(cache.starts[b]), int(cache.lengths[b])
    if cache.quant is not None:
        pos = torch.arange(start, stop)
        return values_at(cache, torch.full_like(pos, b), pos)
    p0, p1, a, z = _span(cache.page_size, start, stop)
    if p1 - p0 <= 1:
        blk = int(cache.host_table[b, p0]) if p1 > p0 else 0
        return cache.k_pages[blk, a:z], cache.v_pages[blk, a:z]  # views
    blocks = cache.block_table[b, p0:p1].long()
    return tuple(pages[blocks].flatten(0, 1)[a:z] for pages in (cache.k_pages, cache.v_pages))


def view_page(cache: PagedKVCache) -> int | None:
    """The first sequence's page when :func:`batch_kv` is a view (equal lengths, every
    sequence's keys in one page, those pages consecutive: a contiguous cache read in
    order), else None."""
    if cache.batch == 0 or not cache.equal_lengths or cache.quant is not None:
        return None
    p0, p1, _, _ = _span(cache.page_size, int(cache.starts[0]), int(cache.lengths[0]))
    ids = cache.host_table[:, p0] if p1 - p0 == 1 else None
    if ids is None or not bool((ids == ids[0] + torch.arange(cache.batch)).all()):
        return None
    return int(ids[0])


def batch_kv(cache: PagedKVCache) -> tuple[Tensor, Tensor]:
    """Keys and values ``(B, Hkv, N, D)`` of sequences of equal lengths: a view when
    :func:`view_page` finds one, else copied head-major (only the pages in use)."""
    starts, lengths = cache.starts, cache.lengths
    if not cache.equal_lengths:
        raise ValueError(f"batch_kv reads sequences of equal lengths, got starts "
                         f"{starts.tolist()[:16]} and lengths {lengths.tolist()[:16]}")
    p0, p1, a, z = _span(cache.page_size, int(starts[0]), int(lengths[0]))
    if cache.quant is not None:
        B, n = cache.batch, z - a
        pos = torch.arange(int(starts[0]), int(lengths[0])).repeat(B)
        # (B·N, Hkv, D) -> (B, Hkv, N, D), copied head-major
        return tuple(x.view(B, n, *x.shape[1:]).transpose(1, 2).contiguous()
                     for x in values_at(cache, torch.arange(B).repeat_interleave(n), pos))
    pair = (cache.k_pages, cache.v_pages)
    b0 = view_page(cache)
    if b0 is not None:
        # (B, N, Hkv, D) -> (B, Hkv, N, D): views, no copy
        return tuple(c[b0:b0 + cache.batch, a:z].transpose(1, 2) for c in pair)
    if p1 - p0 == 1:  # one page each: only the positions in use
        blk = cache.block_table[:, p0].long()
        return tuple(_head_major(c, blk, slice(a, z)) for c in pair)
    blocks = cache.block_table[:, p0:p1].long()  # (B, pages): only the pages in use
    # (Hkv, B, pages, page, D) -> (B, Hkv, pages·page, D), copied head-major
    return tuple(_head_major(c, blocks, slice(None)).flatten(2, 3)[:, :, a:z] for c in pair)


def packed_kv(cache: PagedKVCache) -> tuple[Tensor, Tensor, Tensor]:
    """Every sequence's keys and values laid end to end, ``(total, Hkv, D)`` copied
    head-major, and their offsets ``cu_seqlens (B + 1,)`` int64 on the host (the packed
    layout of :func:`attn.varlen_attention`)."""
    n = cache.lengths - cache.starts
    total = int(n.sum())
    seq = torch.repeat_interleave(torch.arange(cache.batch), n)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    dev, page = cache.k_pages.device, cache.page_size
    pos = (torch.arange(total) - cu[:-1][seq] + cache.starts[seq])
    if cache.quant is not None:  # (total, Hkv, D) copied head-major
        k, v = (x.transpose(0, 1).contiguous().transpose(0, 1)
                for x in values_at(cache, seq, pos))
        return k, v, cu
    pos = pos.to(dev)
    blk = cache.block_table[seq.to(dev), pos // page].long()
    k, v = (_head_major(c, blk, pos % page) for c in (cache.k_pages, cache.v_pages))
    return k, v, cu
