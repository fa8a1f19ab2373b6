"""Attention of new queries against the keys a KV cache holds (decoding, chunked prefill).

:func:`decode` is attn's one entry for attending from a cache object
(:class:`attn.kvcache.PagedKVCache`), exported as ``attn.decode``; compat, HF and the toy
GPT call it. :func:`read_plan` says how a call reads the cache, and why. Forward only. The
reads and the compiled path (the opaque op ``attn::paged_decode``, whose body is the eager
read, ``_read``): docs/kvcache.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attn import fused, tiled, transforms
from attn.call import (AttentionCall, _check_tensor, _no_keys, attend, resolve,
                       select_backend, unsupported_reason)
from attn.kvcache import KVQuant, PagedKVCache
from attn.masks import make_band, window_pair
from attn.spec import PageTable, QuantPages, acc_dtype
from attn.varlen import varlen_attention

__all__ = ["decode", "read_plan"]

# Devices where the tiled backend reads the pages itself (see the module docstring); the
# tests also run the other devices' strategies on CPU by emptying it.
_PAGED_DEVICES = ("cpu",)
# Devices where the triton kernel reads the pages through the block table; the tests run it
# on CPU in the Triton interpreter by naming "cpu" here (and emptying _PAGED_DEVICES).
_TRITON_PAGED_DEVICES = ("cuda",)
_TRITON_PAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _seq_rows(seq_ids: object, cache: PagedKVCache, q: Tensor) -> Tensor | None:
    """``seq_ids`` as a ``(B,)`` int64 host tensor (None: the cache's rows in order)."""
    shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
    if seq_ids is None:
        if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != cache.batch:
            raise ValueError(f"q must be (B, H, Nq, D) with B = {cache.batch} sequences of the "
                             f"cache (or pass seq_ids), got {shape}")
        return None
    if isinstance(seq_ids, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in seq_ids):
            raise TypeError(f"seq_ids must hold ints, got {list(seq_ids)[:16]}")
        seq_ids = torch.tensor(seq_ids, dtype=torch.int64)
    if not isinstance(seq_ids, Tensor) or seq_ids.dtype not in (torch.int32, torch.int64):
        what = seq_ids.dtype if isinstance(seq_ids, Tensor) else type(seq_ids).__name__
        raise TypeError(f"seq_ids must be a (B,) int32 / int64 tensor or a list of ints, got "
                        f"{what}")
    if not isinstance(q, Tensor) or q.dim() != 4 or tuple(seq_ids.shape) != (q.shape[0],):
        raise ValueError(f"seq_ids must be (B,) for q (B, H, Nq, D): got seq_ids "
                         f"{tuple(seq_ids.shape)} and q {shape}")
    rows = seq_ids.cpu().long()
    if not torch.compiler.is_compiling():  # data: attn::paged_decode checks it when it runs
        _check_rows(rows, cache)
    return rows


def _check_rows(rows: Tensor | None, cache: PagedKVCache) -> None:
    """ValueError unless every one of ``rows`` (host int64) is a sequence of the cache."""
    if rows is not None and bool(((rows < 0) | (rows >= cache.batch)).any()):
        raise ValueError(f"seq_ids {rows.tolist()[:16]} must lie in [0, {cache.batch}): the "
                         f"cache holds {cache.batch} sequences")


def decode(q: Tensor, cache: PagedKVCache, *, seq_ids: Tensor | list[int] | None = None,
           causal: bool = False, window: tuple[int, int] | None = None,
           scale: float | None = None, softcap: float | None = None,
           alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
           return_lse: bool = False, quantized_q: bool = False
           ) -> Tensor | tuple[Tensor, Tensor]:
    """q ``(B, H, Nq, D)`` against the cached keys of sequences ``seq_ids (B,)`` (default:
    the cache's B sequences in order; sequence s holds keys ``[starts[s], lengths[s])``,
    ``N_s`` of them) → out ``(B, H, Nq, Dv)`` in q's dtype, with ``return_lse`` also lse
    ``(B, H, Nq)``.

    ``causal`` / ``window`` are bottom-right over each sequence's own keys (query i sees key
    j iff ``j <= i + N_s − Nq``); ``scale``, ``softcap``, ``sinks (H,)`` and ``alibi_slopes``
    ``(H,)`` or ``(B, H)`` mean what they mean in :func:`attn.attention`. A sequence without
    keys gives zeros and lse −inf (or the sink). Forward only. Reading a sequence that
    ``free`` emptied, or keys that ``free_outside_window`` gave back, raises ValueError.
    ``quantized_q`` (opt-in; an int8 cache with one scale per token, on CPU) scores q
    rounded to int8 against the int8 keys by integer products. The reads, the dtypes and
    the quantization error: docs/kvcache.md.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an attn.kvcache.PagedKVCache, got "
                        f"{type(cache).__name__}")
    _check_tensor("q", q)
    rows = _seq_rows(seq_ids, cache, q)
    B, H, Nq, D = q.shape
    k_pages = cache.k_pages
    if D != cache.head_dim or H % cache.heads_kv or q.device != k_pages.device:
        pages = (*k_pages.shape[:3], cache.head_dim)
        raise ValueError(f"q (B, H, Nq, D) = {tuple(q.shape)} on {q.device} does not fit the "
                         f"cache's pages (num_blocks, page, Hkv, D) = {pages} "
                         f"on {k_pages.device}: D must match, H a multiple of Hkv, one device")
    if cache.quant is not None and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, cache.k_scales, cache.v_scales,
                                                        cache.recent_k, cache.recent_v)):
        raise ValueError("a quantized cache is forward only (it serves inference): run "
                         "attn.decode under torch.no_grad() or torch.inference_mode()")
    # traced, the checks that read data and the read itself run in the op attn::paged_decode,
    # whose implementation is _read too
    read = _traced if torch.compiler.is_compiling() else _read
    out, lse = read(q, cache, rows, causal, window, scale, softcap, alibi_slopes, sinks,
                    return_lse, quantized_q)
    return (out, lse) if return_lse else out


def _read(q: Tensor, cache: PagedKVCache, rows: Tensor | None, causal, window, scale, softcap,
          alibi_slopes, sinks, return_lse: bool, quantized_q: bool) -> tuple[Tensor, Tensor]:
    """decode once q, seq_ids and the cache's shapes are checked: the checks that read data
    (keys given back, freed sequences), then the read :func:`read_plan` picks. The one path
    of every call: eager decode calls it, and so does ``attn::paged_decode`` when a compiled
    graph runs."""
    B, H, Nq, _ = q.shape
    cache.check_reach(rows, Nq, window_pair(window))
    cache.check_not_freed(rows)
    read = read_plan(q, cache, causal=causal, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse)[0]
    if read != "copy" and transforms.in_vmap():  # the paged reads run on plain tensors only
        if cache.quant is not None:
            raise NotImplementedError("decode from a quantized cache under torch.func.vmap: "
                                      "call it once per sample")
        read = "copy"  # the cache's keys as one batch, through attention's vmap rule
    if quantized_q and (cache.quant is None or not cache.quant.int8_per_token):
        raise ValueError(f"quantized_q scores int8 keys with one scale per token (KVQuant("
                         f"'int8')), but the cache holds {cache.quant or cache.storage_dtype}")
    if quantized_q and read != "tiled":
        raise ValueError(f"quantized_q runs on the tiled read (on {_PAGED_DEVICES}); this call "
                         f"reads the cache by {read!r}")
    if read != "copy":
        return _paged(q, cache, rows, read, causal, window, scale, softcap, alibi_slopes, sinks,
                      return_lse, quantized_q)
    if rows is not None:
        cache = cache.select(rows)
    lengths = cache.lengths - cache.starts
    kw = dict(scale=scale, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    if B == 0 or int(lengths.max()) == 0:  # no sequence has a key
        none = q.new_empty(B, cache.heads_kv, 0, cache.head_dim_v)
        return _no_keys(q, none, none, sinks=sinks, linked=())
    if cache.equal_lengths:  # one dense call: a view when batch_is_view, else copied head-major
        k, v = (t.to(q.dtype) for t in cache.batch_kv())
        band = make_band(Nq, k.shape[2], causal=bool(causal), window=window_pair(window))
        return attend(q, k, v, band=band, backend="auto", return_lse=True, **kw)
    return _packed(q, cache, lengths, dict(kw, causal=causal, window=window))


def _paged(q, cache: PagedKVCache, rows, read: str, causal, window, scale, softcap,
           alibi_slopes, sinks, return_lse, quantized_q: bool = False):
    """The pages read through the block table (``read``: :func:`read_plan`'s "fused", "tiled"
    or "triton"): the variants checked and resolved as every entry's are, against one key per
    row, the band counted from each sequence's end, the rows of ``seq_ids`` picked from the
    table (a copy of table rows, not of pages; on triton's device for triton)."""
    B, H, Nq, D = q.shape
    one_key = [q.new_zeros(()).expand(B, cache.heads_kv, 1, d)
               for d in (cache.head_dim, cache.head_dim_v)]
    band = make_band(Nq, 0, causal=bool(causal), window=window_pair(window))
    _, spec, ops = resolve(q, *one_key, band=band, scale=scale, softcap=softcap, sinks=sinks,
                           alibi_slopes=alibi_slopes, return_lse=return_lse)
    table = cache.host_table if read == "tiled" else cache.block_table
    starts, lengths = cache.starts, cache.lengths
    if rows is not None:
        table, starts, lengths = table[rows.to(table.device)], starts[rows], lengths[rows]
    ops = ops._replace(pages=PageTable(table, starts, lengths))
    if cache.quant is not None:
        ops = ops._replace(quant=QuantPages(
            cache.quant.kind, cache.k_scales, cache.v_scales, cache.recent_from(rows),
            cache.recent_k, cache.recent_v, quantized_q))
    if read == "triton":  # read_plan sends only float pages, or codes, there
        from attn import flash_triton  # importable: read_plan asked it

        return flash_triton.paged_attention(q, cache.k_pages, cache.v_pages, spec, ops)
    if read == "fused":  # float pages; a masked non-finite key sends the call to tiled
        return fused.paged_attention(q, cache.k_pages, cache.v_pages, spec, ops,
                                     fallback=tiled.paged_attention)
    return tiled.paged_attention(q, cache.k_pages, cache.v_pages, spec, ops)


def read_plan(q: Tensor, cache: PagedKVCache, *, causal: bool = False,
              window: tuple[int, int] | None = None, softcap: float | Tensor | None = None,
              alibi_slopes: Tensor | None = None, sinks: Tensor | None = None,
              return_lse: bool = False) -> tuple[str, str]:
    """How :func:`decode` reads ``cache`` for ``q`` (B, H, Nq, D) and these options, and
    why: ``"fused"`` (torch's fused op per key range, the pages read as spans of consecutive
    ids), ``"tiled"`` (work items read the pages), ``"triton"`` (the kernel loads page ids
    from the block table) or ``"copy"`` (a view, or the keys in use copied, through
    ``attention`` / ``varlen_attention``). Pure and cheap: device, dtypes, head dims, the
    options and ``auto``'s committed table (:func:`attn.select_backend`) decide."""
    dev = q.device.type
    if dev in _PAGED_DEVICES:
        why = _fused_reason(q, cache, causal, window, softcap, alibi_slopes, sinks,
                            return_lse)
        if why is None:
            return "fused", (f"auto's table prefers fused for this call on {dev}: torch's "
                             f"fused op per key range of each sequence, its pages read as "
                             f"views where their ids are consecutive (attn.fused."
                             f"paged_attention)")
        return "tiled", (f"the tiled backend's work items read the pages through the block "
                         f"table on {dev} (attn.tiled.paged_attention), not fused: {why}")
    # the values it loads as they are: the pages, or a quantized cache's recent pages (its
    # codes are the kernel's to decode)
    stored = cache.k_pages.dtype if cache.quant is None else (
        None if cache.recent_k is None else cache.recent_k.dtype)
    if dev not in _TRITON_PAGED_DEVICES:
        why = f"it runs on {_TRITON_PAGED_DEVICES}, not {dev}"
    elif stored is not None and stored not in _TRITON_PAGE_DTYPES:
        what = "pages" if cache.quant is None else "full-precision recent pages"
        why = f"{what} stored in {stored} (it reads float16, bfloat16, float32)"
    else:
        why = unsupported_reason("triton", AttentionCall(
            device=dev, dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=cache.head_dim_v,
            n_q=q.shape[2], n_k=cache.capacity))
    if why is None:
        codes = ("" if cache.quant is None else
                 f", dequantizing {cache.quant.kind} codes tile by tile after the load")
        return "triton", ("triton's paged kernel loads each key tile's page ids from the block "
                          f"table and reads the keys in place{codes} (attn.flash_triton."
                          "paged_attention; split-KV chunks planned for the longest sequence)")
    return "copy", (f"a view of the pages, or the keys in use copied, through attention / "
                    f"varlen_attention: triton's paged kernel cannot run because {why}")


def _fused_reason(q: Tensor, cache: PagedKVCache, causal, window, softcap, alibi_slopes,
                  sinks, return_lse) -> str | None:
    """Why a CPU decode call does not read its pages on the fused backend, or None: a
    quantized cache, or what ``auto`` chooses for the same call made by ``attention`` (its
    allow-list, then the measured table's class: decode for at most 16 query rows)."""
    if cache.quant is not None:
        return (f"a {cache.quant.kind} quantized cache (its codes are dequantized inside "
                f"tiled's items; torch's op reads float keys)")
    B, H, Nq, D = q.shape
    n_k = int((cache.lengths - cache.starts).max()) if cache.batch else 0
    choice = select_backend(AttentionCall(
        device=q.device.type, dtype=q.dtype, head_dim=D, head_dim_v=cache.head_dim_v,
        n_q=Nq, n_k=n_k, band=make_band(Nq, n_k, causal=bool(causal),
                                        window=window_pair(window)),
        softcap=None if softcap is None else (
            "learned" if isinstance(softcap, Tensor) else "fixed"),
        sinks=sinks is not None, return_lse=bool(return_lse),
        alibi=alibi_slopes is not None,
        transform=transforms.active(q, softcap, sinks, alibi_slopes)))
    return None if choice.name == "fused" else choice.reason


def _packed(q, cache: PagedKVCache, lengths: Tensor, kw) -> tuple[Tensor, Tensor]:
    """Ragged sequences packed end to end through :func:`attn.varlen_attention`."""
    B, H, Nq, D = q.shape
    k, v, cu_k = cache.packed_kv()
    k, v = k.to(q.dtype), v.to(q.dtype)
    cu_q = torch.arange(B + 1, dtype=torch.int64) * Nq
    # (B, H, Nq, D) -> (B·Nq, H, D): the packed layout, one sequence per batch row
    out, lse = varlen_attention(q.transpose(1, 2).reshape(B * Nq, H, D), k, v,
                                cu_q.to(q.device), cu_k.to(q.device), Nq, int(lengths.max()),
                                return_lse=True, **kw)
    # (B·Nq, H, Dv) -> (B, H, Nq, Dv); lse (H, B·Nq) -> (B, H, Nq)
    return out.view(B, Nq, H, -1).transpose(1, 2), lse.view(H, B, Nq).transpose(0, 1)


# -- under torch.compile: one opaque op ------------------------------------------------------
# decode's data checks and the items' plan branch on host tensors' values, which a traced
# graph cannot do: attn::paged_decode runs eager decode's _read when the graph runs.


def _op_float(name: str, x: object) -> float | None:
    """``scale`` / ``softcap`` as the op's schema takes them (a float or None)."""
    if x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)):
        return None if x is None else float(x)
    raise TypeError(f"{name} must be a float (or None) when attn.decode runs under "
                    f"torch.compile, got {type(x).__name__}")


def _traced(q: Tensor, cache: PagedKVCache, rows: Tensor | None, causal, window, scale, softcap,
            alibi_slopes, sinks, return_lse, quantized_q):
    """decode inside a traced graph: q, seq_ids and the cache's shapes, dtypes and devices
    are checked already; :func:`_paged_decode` does the rest when the graph runs."""
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    pair = window_pair(window)
    quant = cache.quant
    return _paged_decode(
        q, cache.k_pages, cache.v_pages, cache.host_table, cache.starts, cache.lengths,
        cache._trimmed, rows, cache.k_scales, cache.v_scales, cache.recent_k, cache.recent_v,
        alibi_slopes, sinks, [cache.head_dim, cache.head_dim_v],
        None if quant is None else quant.kind, None if quant is None else quant.group,
        quant is not None and quant.k_per_channel, 0 if quant is None else quant.recent_pages,
        bool(causal), None if pair is None else list(pair), _op_float("scale", scale),
        _op_float("softcap", softcap), bool(quantized_q))


@torch.library.custom_op("attn::paged_decode", mutates_args=())
def _paged_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor,
                  starts: Tensor, lengths: Tensor, trimmed: Tensor, seq_ids: Tensor | None,
                  k_scales: Tensor | None, v_scales: Tensor | None, recent_k: Tensor | None,
                  recent_v: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
                  dims: list[int], quant_kind: str | None, quant_group: int | None,
                  k_per_channel: bool, recent_pages: int, causal: bool,
                  window: list[int] | None, scale: float | None, softcap: float | None,
                  quantized_q: bool) -> tuple[Tensor, Tensor]:
    """out ``(B, H, Nq, Dv)`` and lse ``(B, H, Nq)`` of :func:`decode` on the cache these
    tensors make up (``block_table``, ``starts``, ``lengths``, ``trimmed``: its host
    tensors; the scales, recent pages and ``quant_*`` its format when quantized)."""
    quant = (None if quant_kind is None
             else KVQuant(quant_kind, quant_group, k_per_channel, recent_pages))
    cache = PagedKVCache.over(k_pages, v_pages, block_table, lengths, starts=starts,
                              trimmed=trimmed, quant=quant, dims=(dims[0], dims[1]),
                              k_scales=k_scales, v_scales=v_scales, recent_k=recent_k,
                              recent_v=recent_v)
    _check_rows(seq_ids, cache)
    out, lse = _read(q, cache, seq_ids, causal, None if window is None else tuple(window),
                     scale, softcap, alibi_slopes, sinks, True, quantized_q)
    # a custom op's outputs must not share memory with its inputs (a row with no key's lse
    # may be a view of the sinks)
    held = {t.untyped_storage().data_ptr() for t in (q, alibi_slopes, sinks) if t is not None}
    return tuple(t.clone() if t.untyped_storage().data_ptr() in held else t for t in (out, lse))


@_paged_decode.register_fake
def _(q, k_pages, v_pages, block_table, starts, lengths, trimmed, seq_ids, k_scales, v_scales,
      recent_k, recent_v, alibi_slopes, sinks, dims, quant_kind, quant_group, k_per_channel,
      recent_pages, causal, window, scale, softcap, quantized_q):
    B, H, Nq, _ = q.shape
    return q.new_empty(B, H, Nq, dims[1]), q.new_empty(B, H, Nq, dtype=acc_dtype(q.dtype))
