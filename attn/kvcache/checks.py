"""The argument checks of a paged cache: its storage, block table, lengths and sequence ids,
each message naming the caller's argument and its shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attn.kvquant import KVQuant

if TYPE_CHECKING:
    from attn.kvcache import PagedKVCache

__all__ = ["check_allocate", "check_block_table", "check_not_freed", "check_pages", "check_reach",
           "check_tokens", "host_ints", "seq_rows", "shown"]


def shown(t: Tensor) -> list[int]:
    """At most 16 values of a host tensor, for a message."""
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


def check_pages(kn: str, k_pages: object, vn: str, v_pages: object) -> None:
    """``k_pages`` / ``v_pages`` (named ``kn`` / ``vn``): 4-d tensors, non-empty, agreeing in
    every dim but the head dim, on one device in one dtype."""
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


def check_block_table(name: str, table: object, pages_name: str, k_pages: Tensor) -> Tensor:
    """``table`` (named ``name``) as an int64 host copy, every id a page of ``k_pages``."""
    if not isinstance(table, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dim() != 2:
        raise ValueError(f"{name} must be 2-d (sequences, max_pages), got shape "
                         f"{tuple(table.shape)}")
    if table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 (or int64), got {table.dtype}")
    num_blocks = k_pages.shape[0]
    host = table.cpu().long()
    bad = ((host < 0) | (host >= num_blocks)).nonzero()
    if bad.numel():
        b, j = bad[0].tolist()
        raise ValueError(f"{name}[{b}, {j}] = {int(host[b, j])} is not a page of "
                         f"{pages_name} {tuple(k_pages.shape)}: page ids must lie in "
                         f"[0, num_blocks) = [0, {num_blocks}) ({bad.shape[0]} bad ids in "
                         f"{name} {tuple(table.shape)})")
    return host


def seq_rows(name: str, seq_ids: object, batch: int) -> Tensor:
    """``seq_ids`` (None: every sequence; an int, a list of ints or an int tensor) as
    distinct host int64 row indices of ``[0, batch)``."""
    if seq_ids is None:
        return torch.arange(batch)
    if isinstance(seq_ids, int) and not isinstance(seq_ids, bool):
        seq_ids = [seq_ids]
    if isinstance(seq_ids, (list, tuple)):
        seq_ids = torch.tensor(seq_ids, dtype=torch.int64)
    if not isinstance(seq_ids, Tensor) or seq_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int, a list of ints or an int tensor, got "
                        f"{type(seq_ids).__name__}")
    rows = seq_ids.cpu().long().reshape(-1)
    if bool(((rows < 0) | (rows >= batch)).any()) or len(set(rows.tolist())) != len(rows):
        raise ValueError(f"{name} {rows.tolist()[:16]} must be distinct sequences of "
                         f"[0, {batch})")
    return rows


def check_not_freed(cache: PagedKVCache, rows: Tensor | None) -> None:
    """ValueError when a call reads a sequence that :meth:`free` emptied and nothing was
    appended to since: it would attend to nothing and give zeros, silently (a sequence
    never written to is a row without keys: docs/kvcache.md, "The cache")."""
    freed = cache._freed if rows is None else cache._freed[rows]
    hit = freed.nonzero().flatten()
    if hit.numel():
        seqs = (hit if rows is None else rows[hit]).tolist()
        raise ValueError(f"sequences {seqs[:16]} of the cache were freed and hold no keys: "
                         f"decoding them would attend to nothing and return zeros; append "
                         f"their keys first, or leave them out of seq_ids (lengths "
                         f"{shown(cache.lengths)})")


def check_reach(cache: PagedKVCache, rows: Tensor | None, n_q: int, window) -> None:
    """ValueError when a query of a call (``n_q`` queries per sequence, bottom-right,
    ``window`` as attn's, None: unbounded) could see a key that
    :meth:`free_outside_window` gave back."""
    trimmed = cache._trimmed if rows is None else cache._trimmed[rows]
    if not bool(trimmed.any()):
        return
    left = -1 if window is None else window[0]
    lengths = cache.lengths if rows is None else cache.lengths[rows]
    starts = cache.starts if rows is None else cache.starts[rows]
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


def check_allocate(sizes: dict[str, object], dtype: object, quant: object) -> KVQuant | None:
    """:meth:`PagedKVCache.allocate`'s arguments: ``sizes`` positive ints, ``dtype`` a
    floating dtype, ``quant`` a :class:`KVQuant`, a kind name or None (returned as a
    KVQuant or None)."""
    for name, x in sizes.items():
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(quant, str):
        quant = KVQuant(quant)
    if quant is not None and not isinstance(quant, KVQuant):
        raise TypeError(f"quant must be an attn.kvquant.KVQuant, a kind name or None, got "
                        f"{type(quant).__name__}")
    return quant


def check_tokens(cache: PagedKVCache, n_rows: int, k: object, v: object) -> None:
    """:meth:`PagedKVCache.append`'s ``k (B', Hkv, Nnew, D)`` and ``v (B', Hkv, Nnew, Dv)``
    for ``n_rows = B'`` sequences, on the pages' device."""
    for name, t, dim in (("k", k, cache.head_dim), ("v", v, cache.head_dim_v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if (t.dim() != 4 or t.shape[0] != n_rows or t.shape[1] != cache.heads_kv
                or t.shape[3] != dim or t.shape[2] != k.shape[2]):
            raise ValueError(f"{name} must be (B, Hkv, Nnew, D) = ({n_rows}, {cache.heads_kv}, "
                             f"Nnew, {dim}) for {cache._shapes()}, got k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}")
        if t.device != cache.k_pages.device:
            raise ValueError(f"{name} is on {t.device}, the pages on {cache.k_pages.device}")
