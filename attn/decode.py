"""Attention of new queries against the keys a KV cache holds (decoding, chunked prefill).

:func:`decode` reads each sequence's keys ``[starts[b], lengths[b])`` of an
:class:`attn.kvcache.PagedKVCache` and runs :func:`attn.attention` (or
:func:`attn.varlen_attention`) over them. How it reads them is a choice of execution strategy,
made from the lengths (read on the host) and the device; the result is the same up to the
rounding of a batched versus a per-sequence GEMM:

* **one view**: sequences of equal lengths whose keys lie in consecutive pages (a contiguous
  cache read in order) run as one call on a view of the pages, no copy;
* **per sequence** (CPU): one call per sequence on a view of its keys (a copy of its pages in
  use when they span several), instead of gathering every sequence's keys;
* **batched gather** (other devices, equal lengths): one call on the keys in use, copied
  head-major through the block table;
* **packed** (other devices, ragged lengths): the keys in use copied head-major end to end,
  one sequence each, through :func:`attn.varlen_attention`.

Forward only: callers run it under ``torch.no_grad()`` or ``torch.inference_mode()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attn.api import attention
from attn.kvcache import PagedKVCache
from attn.spec import acc_dtype
from attn.varlen import varlen_attention

__all__ = ["decode"]

# Devices where a ragged or paged batch runs sequence by sequence (see the module docstring);
# the tests also run the batched strategies on CPU by emptying it.
_PER_ROW_DEVICES = ("cpu",)


def _no_keys(q: Tensor, B: int, Dv: int) -> tuple[Tensor, Tensor]:
    """out and lse of ``B`` rows of q ``(·, H, Nq, D)`` that see no key: zeros and -inf."""
    _, H, Nq, _ = q.shape
    return (q.new_zeros(B, H, Nq, Dv),
            torch.full((B, H, Nq), float("-inf"), device=q.device, dtype=acc_dtype(q.dtype)))


def decode(q: Tensor, cache: PagedKVCache, *, causal: bool = False,
           window: tuple[int, int] | None = None, scale: float | None = None,
           softcap: float | None = None, alibi_slopes: Tensor | None = None,
           return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """q ``(B, H, Nq, D)`` against sequence b's cached keys ``[starts[b], lengths[b])``
    (``N_b`` of them) → out ``(B, H, Nq, Dv)``, with ``return_lse`` also lse ``(B, H, Nq)``.

    ``causal`` / ``window`` are bottom-right over each sequence's own keys (query i sees key
    j iff ``j <= i + N_b − Nq``); ``scale``, ``softcap`` and ``alibi_slopes`` ``(H,)`` or
    ``(B, H)`` mean what they mean in :func:`attn.attention`. A sequence without keys gives
    zeros and lse −inf.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an attn.kvcache.PagedKVCache, got "
                        f"{type(cache).__name__}")
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != cache.batch:
        shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be (B, H, Nq, D) with B = {cache.batch} sequences of the "
                         f"cache, got {shape}")
    B, Dv = cache.batch, cache.v_pages.shape[-1]
    lengths = cache.lengths - cache.starts
    if int(lengths.max()) == 0:  # no sequence has a key
        out, lse = _no_keys(q, B, Dv)
        return (out, lse) if return_lse else out
    kw = dict(causal=causal, window=window, scale=scale, softcap=softcap)
    if cache.batch_is_view:
        out, lse = _batched(q, cache, alibi_slopes, kw)
    elif q.device.type in _PER_ROW_DEVICES:
        out, lse = _per_sequence(q, cache, alibi_slopes, kw)
    elif cache.equal_lengths:
        out, lse = _batched(q, cache, alibi_slopes, kw)
    else:
        out, lse = _packed(q, cache, lengths, alibi_slopes, kw)
    return (out, lse) if return_lse else out


def _batched(q, cache: PagedKVCache, alibi_slopes, kw) -> tuple[Tensor, Tensor]:
    k, v = cache.batch_kv()
    return attention(q, k, v, alibi_slopes=alibi_slopes, return_lse=True, **kw)


def _per_sequence(q, cache: PagedKVCache, alibi_slopes, kw) -> tuple[Tensor, Tensor]:
    outs, lses = [], []
    for b in range(cache.batch):
        if cache.lengths[b] == cache.starts[b]:
            out, lse = _no_keys(q, 1, cache.v_pages.shape[-1])
        else:
            k, v = cache.sequence_kv(b)
            slopes = (alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1
                      else alibi_slopes[b:b + 1])
            # (N, Hkv, D) -> (1, Hkv, N, D): views
            out, lse = attention(q[b:b + 1], k[None].transpose(1, 2), v[None].transpose(1, 2),
                                 alibi_slopes=slopes, return_lse=True, **kw)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _packed(q, cache: PagedKVCache, lengths: Tensor, alibi_slopes, kw) -> tuple[Tensor, Tensor]:
    B, H, Nq, D = q.shape
    k, v, cu_k = cache.packed_kv()
    cu_q = torch.arange(B + 1, dtype=torch.int64) * Nq
    # (B, H, Nq, D) -> (B·Nq, H, D): the packed layout, one sequence per batch row
    out, lse = varlen_attention(q.transpose(1, 2).reshape(B * Nq, H, D), k, v,
                                cu_q.to(q.device), cu_k.to(q.device), Nq, int(lengths.max()),
                                alibi_slopes=alibi_slopes, return_lse=True, **kw)
    # (B·Nq, H, Dv) -> (B, H, Nq, Dv); lse (H, B·Nq) -> (B, H, Nq)
    return out.view(B, Nq, H, -1).transpose(1, 2), lse.view(H, B, Nq).transpose(0, 1)
