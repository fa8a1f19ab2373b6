"""flash-attn 2.8.3's public functions, names, signatures and layouts, on attn's backends.

This module only translates layouts, flags and conventions; the attention is
:func:`attn.attention` (q viewed ``(B, H, N, D)``), :func:`attn.varlen_attention`, and for a
KV cache an :class:`attn.kvcache.PagedKVCache` read by :func:`attn.decode`. Layouts are
flash-attn's; its lse of +inf on rows with no key, its window rule (:func:`_band`), the
errors (:class:`FlashAttnError` naming the caller's argument; wrong types raise TypeError),
supersets, dropout and costs: docs/flash-attn.md.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from attn.call import _check_tensor
from attn.compat.errors import FlashAttnError, translating
from attn.compat.rotary import rotate_at
from attn.decoding import decode
from attn.kvcache import PagedKVCache, host_ints
from attn.varlen import check_cu_form, check_cu_values, varlen_attention
from attn.api import attention

__all__ = ["FlashAttnError", "flash_attn_func", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_with_kvcache"]


# -- checks ----------------------------------------------------------------------------------

def _tensor(name: str, t: object, dims: int, letters: str) -> Tensor:
    _check_tensor(name, t)
    if t.dim() != dims:
        raise FlashAttnError(f"{name} must have {dims} dims {letters}, got shape "
                             f"{tuple(t.shape)}")
    return t


def _unbind_packed(name: str, t: object, layout: str) -> tuple[Tensor, ...]:
    """``t`` checked as ``layout`` (``"(total, 3, nheads, headdim)"``) and unbound along its
    one numbered dim, which must hold that many tensors (qkv: 3, kv: 2)."""
    dims = layout.strip("()").split(", ")
    axis = next(i for i, d in enumerate(dims) if d.isdigit())
    _tensor(name, t, len(dims), layout)
    if t.shape[axis] != int(dims[axis]):
        raise FlashAttnError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    return t.unbind(axis)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _joined(names: tuple[str, ...]) -> str:
    """``q, k and v`` / ``q and kv`` / ``qkv``: each argument named once."""
    unique = list(dict.fromkeys(names))
    return unique[0] if len(unique) == 1 else ", ".join(unique[:-1]) + " and " + unique[-1]


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str] = ("q", "k", "v"),
               given: dict[str, Tensor] | None = None, *, batch: bool = False) -> None:
    """dtype, device and shape agreement of q, k, v in flash-attn's layouts (heads on axis
    -2, head dim last), checked here so a message names the arguments the caller passed
    (``names``; ``given`` maps each name to the tensor it passed, e.g. kv for k and v) with
    their shapes, not attn's internal (B, H, N, D) views. ``batch``: axis 0 is the batch in
    all three."""
    nq, nk, nv = names
    given = dict(zip(names, (q, k, v))) if given is None else given
    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in given.items())
    for name, t in zip(names, (q, k, v)):
        _check_float(name, t)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{_joined(names)} must share a dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    if not q.device == k.device == v.device:
        raise FlashAttnError(f"{_joined(names)} must be on one device, got {q.device}, "
                             f"{k.device}, {v.device}")
    if batch and not q.shape[0] == k.shape[0] == v.shape[0]:
        raise FlashAttnError(f"{_joined(names)} must have the same batch size: {shapes}")
    H, Hkv = q.shape[-2], k.shape[-2]
    if q.shape[-1] != k.shape[-1]:
        raise FlashAttnError(f"{nq} and {nk} head dims differ ({q.shape[-1]} vs {k.shape[-1]}): "
                             f"{shapes}")
    if k.shape[:-1] != v.shape[:-1]:
        raise FlashAttnError(f"{_joined((nk, nv))} must agree in every dim but the head dim: "
                             f"{shapes}")
    if Hkv == 0 or H % Hkv != 0:
        raise FlashAttnError(f"the number of heads in {_joined((nk, nv))} ({Hkv}) must divide "
                             f"the number of heads in {nq} ({H}): {shapes}")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise FlashAttnError(f"{_joined(names)} must not be empty: {shapes}")


def _int_like(x: object) -> int | None:
    """``x`` as an int when it is integer-like (a Python or numpy integer, a one-element
    integer tensor), else None; bools are not integers here."""
    if isinstance(x, Tensor):
        if x.numel() != 1 or x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
            return None
        return int(x.item())
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _window(window_size: object) -> tuple[int, int]:
    """A pair of integer-likes: a tuple or list of two, or a two-element integer tensor or
    array (flash-attn's own tests pass ``torch.randint(0, seqlen_k, (2,))``)."""
    two = (tuple(window_size.shape) == (2,) if isinstance(window_size, (Tensor, np.ndarray))
           else isinstance(window_size, (tuple, list)) and len(window_size) == 2)
    pair = [_int_like(w) for w in window_size] if two else [None]
    if None in pair:
        raise FlashAttnError(f"window_size must be a pair of ints (left, right), -1 for "
                             f"unbounded, got {window_size!r}")
    return pair[0], pair[1]


def _band(causal: bool, window_size: object, seqlen_k: int) -> tuple[tuple[int, int] | None, bool, bool]:
    """flash-attn 2.8.3's resolution of (causal, window_size) against ``seqlen_k``:
    ``(window for attn or None, pure_causal, local)``. ``causal`` keeps the left bound and
    sets the right one to 0; a side ``>= seqlen_k`` counts as −1, and a −1 beside a side
    ``>= 0`` stands for ``seqlen_k``: Nk (func), ``max_seqlen_k`` (varlen) or the cache
    capacity (kvcache), the numbers flash-attn substitutes."""
    left, right = (-1 if side >= seqlen_k else side for side in _window(window_size))
    if causal:
        right = 0
    pure_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    local = (left >= 0 or right >= 0) and not pure_causal
    window = None if left < 0 and right < 0 else (left, right)
    return window, pure_causal, local


def _check_alibi(alibi_slopes: Tensor | None, B: int, H: int) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(f"alibi_slopes must be a tensor, got {type(alibi_slopes).__name__}")
    if tuple(alibi_slopes.shape) not in ((H,), (B, H)):
        raise FlashAttnError(f"alibi_slopes must have shape (nheads,) = ({H},) or (batch_size, "
                             f"nheads) = ({B}, {H}), got {tuple(alibi_slopes.shape)}")


def _real(name: str, x: object) -> float:
    """A real number (Python or numpy; not a bool, not a tensor: flash-attn takes floats)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(x).__name__} {x!r}")
    if math.isnan(x):
        raise FlashAttnError(f"{name} must not be NaN")
    return float(x)


def _variants(softmax_scale, softcap, alibi_slopes) -> dict:
    """attn keywords of flash-attn's score variants (alibi_slopes only when given, so the
    call works on an attn without ALiBi as long as ALiBi is not asked for). ``softcap <= 0``
    (or None) is off, as in flash-attn."""
    scale = None if softmax_scale is None else _real("softmax_scale", softmax_scale)
    cap = 0.0 if softcap is None else _real("softcap", softcap)
    if cap == math.inf or (scale is not None and math.isinf(scale)):
        raise FlashAttnError(f"softmax_scale and softcap must be finite, got {softmax_scale!r} "
                             f"and {softcap!r}")
    kw = {"scale": scale, "softcap": cap if cap > 0 else None}
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    return kw


def _fa_lse(lse: Tensor, alibi_slopes: Tensor | None, pure_causal: bool,
            row_offset: Tensor | None) -> Tensor:
    """attn's lse → flash-attn's: +inf where a row sees no key, and under pure-causal ALiBi
    the ``slope·(i + Nk − Nq)`` flash-attn's ``+slope·j`` form adds. ``row_offset``
    broadcasts to lse: each row's ``i + Nk − Nq``; alibi_slopes (H,) or (B, H) is shaped to
    broadcast too by the caller."""
    empty = torch.isneginf(lse)
    if alibi_slopes is not None and pure_causal:
        lse = lse + alibi_slopes.to(lse.dtype) * row_offset.to(lse.dtype)
    return torch.where(empty, torch.full_like(lse, float("inf")), lse)


# -- (B, N, H, D) --------------------------------------------------------------------------

def _dense(q: Tensor, k: Tensor, v: Tensor, dropout_p, softmax_scale, causal, window_size,
           softcap, alibi_slopes, return_attn_probs, names: tuple[str, str, str] = ("q", "k", "v"),
           given: dict[str, Tensor] | None = None):
    """The body of the three (B, N, H, D) functions, their arguments in their order: out
    (B, Nq, H, Dv), with ``return_attn_probs`` ``(out, lse (B, H, Nq), S)``, S empty
    (docs/flash-attn.md); ``names`` / ``given``: the caller's arguments, as in
    :func:`_check_qkv`."""
    _check_qkv(q, k, v, names, given, batch=True)
    B, Nq, H, _ = q.shape
    Nk = k.shape[1]
    _check_alibi(alibi_slopes, B, H)
    window, pure_causal, _ = _band(causal, window_size, Nk)
    with translating():
        # (B, N, H, D) -> (B, H, N, D): views; attn's backends take any strides
        out, lse = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             causal=False, window=window, dropout_p=dropout_p,
                             return_lse=True, **_variants(softmax_scale, softcap, alibi_slopes))
    row_offset = torch.arange(Nq, device=q.device) + (Nk - Nq)  # each row's i + Nk − Nq
    lse = _fa_lse(lse, _slopes(alibi_slopes, H), pure_causal, row_offset)
    out = out.transpose(1, 2).contiguous()  # (B, H, Nq, Dv) -> (B, Nq, H, Dv)
    return (out, lse, q.new_empty(0)) if return_attn_probs else out  # S empty


def _slopes(alibi_slopes: Tensor | None, H: int) -> Tensor | None:
    """(H,) or (B, H) slopes shaped (1 or B, H, 1) to broadcast against lse (B, H, Nq)."""
    return None if alibi_slopes is None else alibi_slopes.reshape(-1, H, 1)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of qkv ``(B, N, 3, H, D)`` → out ``(B, N, H, D)``; gradients flow to qkv.

    With ``return_attn_probs``: ``(out, softmax_lse (B, H, N), S)``, S empty. See
    :func:`flash_attn_func` for the keywords.
    """
    q, k, v = _unbind_packed("qkv", qkv, "(batch_size, seqlen, 3, nheads, headdim)")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, ("qkv",) * 3, {"qkv": qkv})


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Attention of q ``(B, Nq, H, D)`` and kv ``(B, Nk, 2, Hkv, D)`` → out ``(B, Nq, H, D)``;
    gradients flow to q and kv. See :func:`flash_attn_func` for the keywords.
    """
    _tensor("q", q, 4, "(batch_size, seqlen, nheads, headdim)")
    k, v = _unbind_packed("kv", kv, "(batch_size, seqlen, 2, nheads_k, headdim)")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs, ("q", "kv", "kv"), {"q": q, "kv": kv})


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_func`` on attn: q ``(B, Nq, H, D)``, k and v
    ``(B, Nk, Hkv, D)`` → out ``(B, Nq, H, D)``, differentiable in q, k, v.

    Causal is aligned bottom-right; Nq = 2, Nk = 5, and Nq = 5, Nk = 2 (1 = keep)::

        1 1 1 1 0        0 0
        1 1 1 1 1        0 0
                         0 0
                         1 0
                         1 1

    A row that sees no key gives zeros (lse = +inf). ``window_size=(left, right)`` keeps keys
    ``[i + Nk − Nq − left, i + Nk − Nq + right]``; ``softcap > 0`` caps the scaled scores;
    ``alibi_slopes`` fp32 ``(H,)`` or ``(B, H)`` adds ``−slope·|i + Nk − Nq − j|`` after
    softcap. ``dropout_p``: attn's reproducible dropout (seed from torch's generator).
    With ``return_attn_probs``: ``(out, softmax_lse (B, H, Nq), S)``, S an empty tensor.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t, 4, "(batch_size, seqlen, nheads, headdim)")
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  return_attn_probs)


# -- packed sequences ------------------------------------------------------------------------

def _cu_host(name: str, cu: object, total: int, total_name: str) -> Tensor:
    """Offsets on the host by attn's one rule (:func:`attn.varlen.check_cu_form`), ending at
    most at ``total`` (a padded buffer is legal: its tail is no sequence's)."""
    with translating():
        return check_cu_values(name, check_cu_form(name, cu), total, total_name, padded=True)


def _check_block_table(block_table: object, B: int, k_cache: Tensor,
                       cache_name: str = "k_cache") -> None:
    """flash-attn's form of a paged cache: ``block_table (batch_size,
    max_num_blocks_per_seq)``, pages ``(num_blocks, page_block_size, nheads_k, headdim)``.
    The table's dtype and every page id (unused slots included) are checked by
    :class:`attn.kvcache.PagedKVCache` before any page is read or written."""
    _check_tensor("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise FlashAttnError(f"block_table must be (batch_size, max_num_blocks_per_seq) with "
                             f"batch_size {B}, got shape {tuple(block_table.shape)}")
    _tensor(cache_name, k_cache, 4, "(num_blocks, page_block_size, nheads_k, headdim) with a "
            "block_table")


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
            block_table=None, names: tuple[str, str, str] = ("q", "k", "v"),
            given: dict[str, Tensor] | None = None,
            max_names: tuple[str, str] = ("max_seqlen_q", "max_seqlen_k")):
    """The body of the three packed functions, their arguments in their order: out
    (total_q, H, Dv), with ``return_attn_probs`` ``(out, lse (H, total_q), S)``; ``names`` /
    ``given`` / ``max_names``: the caller's arguments, as in :func:`_check_qkv`."""
    for name, n in zip(max_names, (max_seqlen_q, max_seqlen_k)):
        if n is not None and _int_like(n) is None:
            raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    _tensor("q", q, 3, "(total_q, nheads, headdim)")
    paged = block_table is not None
    kdims = (4, "(num_blocks, page_block_size, nheads_k, headdim) with a block_table") if paged \
        else (3, "(total_k, nheads_k, headdim)")
    _tensor("k", k, *kdims)
    _tensor("v", v, *kdims)
    _check_qkv(q, k, v, names, given)
    total_q, H, _ = q.shape
    host_q = _cu_host("cu_seqlens_q", cu_seqlens_q, total_q, "q.shape[0]")
    B = host_q.numel() - 1
    if paged:
        _check_block_table(block_table, B, k, "k")
        host_k = _cu_host("cu_seqlens_k", cu_seqlens_k, B * block_table.shape[1] * k.shape[1],
                          "the cache's positions")
    else:
        host_k = _cu_host("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0]")
    if host_k.numel() != host_q.numel():
        raise FlashAttnError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of "
                             f"sequences, got shapes {tuple(cu_seqlens_q.shape)} and "
                             f"{tuple(cu_seqlens_k.shape)}")
    _check_alibi(alibi_slopes, B, H)
    len_q, len_k = host_q[1:] - host_q[:-1], host_k[1:] - host_k[:-1]
    used_q, used_k = int(host_q[-1]), int(host_k[-1])
    if paged:  # the sequences' keys gathered in order, through the page table
        with translating():
            cache = PagedKVCache(k, v, block_table, len_k, names={
                "k_pages": "k", "v_pages": "v", "lengths": "the lengths in cu_seqlens_k"})
        k, v, _ = cache.packed_kv()
    else:
        k, v = k[:used_k], v[:used_k]
    # flash-attn's seqlen_k of the window rule: the max_seqlen_k given
    seqlen_k = int(len_k.max()) if max_seqlen_k is None else _int_like(max_seqlen_k)
    window, pure_causal, _ = _band(causal, window_size, seqlen_k)
    cu_q, cu_k = (host.to(device=q.device) for host in (host_q, host_k))
    with translating():
        out, lse = varlen_attention(q[:used_q], k, v, cu_q, cu_k, int(len_q.max()),
                                    int(len_k.max()), window=window, dropout_p=dropout_p,
                                    return_lse=True,
                                    **_variants(softmax_scale, softcap, alibi_slopes))
    slopes = row_offset = None
    if alibi_slopes is not None and pure_causal:
        # each token's i + Lk_b - Lq_b, counted from its sequence's end
        doc = torch.repeat_interleave(torch.arange(B), len_q)
        row_offset = (torch.arange(used_q) - host_q[1:][doc] + len_k[doc]).to(q.device)
        slopes = (alibi_slopes.reshape(H, 1) if alibi_slopes.dim() == 1
                  else alibi_slopes.to(q.device)[doc.to(q.device)].T)  # (H, total_q)
    lse = _fa_lse(lse, slopes, pure_causal, row_offset)
    if used_q < total_q:  # a padded buffer: its tail sees no key
        out = torch.cat([out, out.new_zeros(total_q - used_q, *out.shape[1:])])
        lse = torch.cat([lse, lse.new_full((H, total_q - used_q), float("inf"))], dim=1)
    return (out, lse, q.new_empty(0)) if return_attn_probs else out  # S empty


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Packed sequences, qkv ``(total, 3, H, D)`` → out ``(total, H, D)``; gradients flow to
    qkv. See :func:`flash_attn_varlen_func`."""
    q, k, v = _unbind_packed("qkv", qkv, "(total, 3, nheads, headdim)")
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                   names=("qkv",) * 3, given={"qkv": qkv}, max_names=("max_seqlen",) * 2)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """Packed sequences, q ``(total_q, H, D)``, kv ``(total_k, 2, Hkv, D)`` → out
    ``(total_q, H, D)``; gradients flow to q and kv. See :func:`flash_attn_varlen_func`."""
    k, v = _unbind_packed("kv", kv, "(total_k, 2, nheads_k, headdim)")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                   names=("q", "kv", "kv"), given={"q": q, "kv": kv})


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Packed sequences on attn.varlen_attention: q ``(total_q, H, D)``, k and v
    ``(total_k, Hkv, D)`` → out ``(total_q, H, D)``, differentiable.

    ``cu_seqlens_q`` / ``cu_seqlens_k`` ``(B + 1,)``: sequence b's queries are
    ``q[cu_q[b]:cu_q[b+1]]`` and see only its keys; causal, window and ALiBi positions are
    per sequence, bottom-right (``j <= i + Lk_b − Lq_b``). A buffer longer than
    ``cu_seqlens[-1]`` is legal: the tail rows return zeros (lse +inf). ``block_table``
    ``(B, max_blocks)``: k and v are a paged cache ``(num_blocks, page, Hkv, D)`` (any page
    size) and sequence b's keys are its first ``Lk_b`` logical positions. ``alibi_slopes``
    ``(H,)`` or ``(B, H)``. With ``return_attn_probs``: ``(out, softmax_lse (H, total_q), S)``,
    S empty. ``max_seqlen_k`` is the ``seqlen_k`` of the window rule (module docstring).
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                   block_table)


# -- the KV cache ----------------------------------------------------------------------------

def _as_lengths(name: str, x: object, B: int) -> Tensor:
    """flash-attn's int (any integer-like) or (batch_size,) int32 tensor, as a (B,) int64
    host tensor."""
    if not isinstance(x, Tensor) and _int_like(x) is not None:
        x = _int_like(x)
    with translating():
        return host_ints(name, x, B, "batch_size")


def _kv_cache(q: Tensor, k_cache: object, v_cache: object, k: object, v: object,
              cache_seqlens, cache_batch_idx, cache_leftpad, block_table
              ) -> tuple[PagedKVCache, Tensor, int, int]:
    """flash_attn_with_kvcache's cache arguments checked (as flash-attn refuses them, and
    every page id) and read as a :class:`PagedKVCache` over the caller's storage, with the
    rows' ends ``cache_seqlens`` on the host, the new keys' count and the capacity of a row;
    refused before anything is written when the new keys do not fit."""
    B = q.shape[0]
    paged = block_table is not None
    if paged:
        for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if x is not None:
                raise FlashAttnError(f"a paged KV cache (block_table) does not support {name}, "
                                     f"as in flash-attn")
        _check_block_table(block_table, B, k_cache)
    else:
        _tensor("k_cache", k_cache, 4, "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _tensor("v_cache", v_cache, 4, "like k_cache")
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise FlashAttnError(f"k_cache {tuple(k_cache.shape)} and v_cache "
                             f"{tuple(v_cache.shape)} must agree in every dim but the head dim")
    _check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]

    Nnew = _new_kv(q, k_cache, v_cache, k, v, cache_seqlens)
    ends = (torch.full((B,), capacity, dtype=torch.int64) if cache_seqlens is None
            else _as_lengths("cache_seqlens", cache_seqlens, B))
    starts = (torch.zeros(B, dtype=torch.int64) if cache_leftpad is None
              else _as_lengths("cache_leftpad", cache_leftpad, B))
    if cache_batch_idx is not None:
        rows = _as_lengths("cache_batch_idx", cache_batch_idx, B)
        if bool((rows < 0).any()) or int(rows.max()) >= k_cache.shape[0]:
            raise FlashAttnError(f"cache_batch_idx {rows.tolist()[:16]} out of range for "
                                 f"k_cache {tuple(k_cache.shape)}")
    else:
        rows = torch.arange(B)
        if not paged and k_cache.shape[0] < B:
            raise FlashAttnError(f"k_cache {tuple(k_cache.shape)} holds fewer rows than the "
                                 f"batch of q {tuple(q.shape)}")
    # a contiguous cache is the paged one whose pages are its rows (L_cache positions each)
    table = block_table if paged else rows.view(B, 1).to(q.device)
    with translating():
        cache = PagedKVCache(k_cache, v_cache, table, ends, starts=starts, names={
            "k_pages": "k_cache", "v_pages": "v_cache", "lengths": "cache_seqlens",
            "block_table": "block_table" if paged else None, "starts": "cache_leftpad"})
        cache.check_room(Nnew)
    return cache, ends, Nnew, capacity


def _new_kv(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: object, v: object,
            cache_seqlens) -> int:
    """The new keys and values to append (0 without): their shapes, dtypes, devices, and
    ``cache_seqlens`` to append them at."""
    B = q.shape[0]
    if (k is None) != (v is None):
        raise FlashAttnError("k and v must be given together (new keys and values to append)")
    Nnew = 0
    if k is not None:
        _tensor("k", k, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        _tensor("v", v, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        for name, t in (("k", k), ("v", v)):
            _check_float(name, t)
            if t.device != k_cache.device:
                raise FlashAttnError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
        want_k = (B, k.shape[1], *k_cache.shape[2:])
        want_v = (B, k.shape[1], *v_cache.shape[2:])
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise FlashAttnError(f"k and v must be (batch_size, seqlen_new, nheads_k, headdim) "
                                 f"= {want_k} / {want_v} for q {tuple(q.shape)} and k_cache "
                                 f"{tuple(k_cache.shape)}, got {tuple(k.shape)} and "
                                 f"{tuple(v.shape)}")
        if cache_seqlens is None:
            raise FlashAttnError("k and v are appended at cache_seqlens: pass cache_seqlens "
                                 "(an int or a (batch_size,) int32 tensor)")
        Nnew = k.shape[1]
    return Nnew


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Decoding with a KV cache: append k, v in place, then attend; forward only.

    q ``(B, Nq, H, D)``; k_cache, v_cache ``(B_cache, L_cache, Hkv, D)``, or with
    ``block_table (B, max_blocks)`` a paged cache ``(num_blocks, page, Hkv, D)`` of any page
    size. k, v ``(B, Nnew, Hkv, D)`` are written **into the cache** at positions
    ``cache_seqlens[b] + t`` (after rotary), then q attends to the keys
    ``[cache_leftpad[b], cache_seqlens[b] + Nnew)`` of its row (``cache_batch_idx[b]``, default
    b), j counted from the left pad, causal/window bottom-right over those keys.
    ``cache_seqlens`` (int or ``(B,)``) is the absolute end, left pad included; None = the
    whole cache (then k/v are refused). ``rotary_cos``/``rotary_sin`` ``(seqlen_ro, rd / 2)``,
    any even ``rd <= D``: new k rotated at ``cache_seqlens + t``, q at ``cache_seqlens + t``
    when causal or local and at ``cache_seqlens`` otherwise (interleaved pairs, or GPT-NeoX
    halves when ``rotary_interleaved=False``); needs k and v. ``num_splits`` is accepted
    and ignored (attn picks its own split). Returns out ``(B, Nq, H, D)``, or
    ``(out, softmax_lse (B, H, Nq))``. Works under ``torch.inference_mode()``. What it
    refuses (as flash-attn does), its window rule for q's rotary positions and its host
    reads: docs/flash-attn.md.
    """
    _tensor("q", q, 4, "(batch_size, seqlen, nheads, headdim)")
    B, Nq, H, D = q.shape
    cache, ends, Nnew, capacity = _kv_cache(q, k_cache, v_cache, k, v, cache_seqlens,
                                            cache_batch_idx, cache_leftpad, block_table)
    _check_alibi(alibi_slopes, B, H)
    _variants(softmax_scale, softcap, None)  # checked before anything is written
    window, pure_causal, local = _band(causal, window_size, capacity)

    # -- rotary on the new keys and on q, at absolute cache positions --
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise FlashAttnError("rotary_cos/rotary_sin rotate the new keys: pass k and v")
        # flash-attn gives q's rows their own positions when its kernel runs causal (any
        # window that resolves to (-1, 0), causal=True or not) or local, else all rows sit
        # at cache_seqlens
        q_rows = ends.view(B, 1) + (torch.arange(Nq).view(1, Nq) if (pure_causal or local)
                                    else torch.zeros(1, Nq, dtype=torch.int64))
        k_rows = ends.view(B, 1) + torch.arange(Nnew).view(1, Nnew)
        k = rotate_at(k, rotary_cos, rotary_sin, k_rows, rotary_interleaved, "k")
        q = rotate_at(q, rotary_cos, rotary_sin, q_rows, rotary_interleaved, "q")

    with torch.no_grad():
        # -- append in place: row b's new token t goes to position ends[b] + t --
        if k is not None:
            cache.append(k.transpose(1, 2), v.transpose(1, 2))  # (B, Nnew, Hkv, D) views
        # -- attention over [starts, stops) of each row --
        with translating():
            out, lse = decode(q.transpose(1, 2), cache, window=window, return_lse=True,
                              **_variants(softmax_scale, softcap, alibi_slopes))
    keys = (cache.lengths - cache.starts).view(B, 1, 1).to(q.device)  # each row's Nk
    row_offset = torch.arange(Nq, device=q.device) + (keys - Nq)  # (B, 1, Nq): i + Nk − Nq
    lse = _fa_lse(lse, _slopes(alibi_slopes, H), pure_causal, row_offset)
    out = out.transpose(1, 2).contiguous()  # (B, H, Nq, Dv) -> (B, Nq, H, Dv)
    return (out, lse) if return_softmax_lse else out
