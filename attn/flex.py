"""Programmable attention: FlexAttention's ``score_mod`` / ``mask_mod`` / block masks on attn.

``flex_attention`` and ``create_block_mask`` take the arguments of
``torch.nn.attention.flex_attention`` and return torch's own ``BlockMask``, but run eagerly on
attn's tiled backend, on every device, any length without a recompile; how the mods run per
tile and where they sit among attention's keywords: docs/flex-varlen.md.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask, noop_mask

from attn.call import _check_positive_int_or_none, _validate_qkv, attend
from attn.masks import Band, Blocks
# the helpers the core shares live in attn.mods; two stay public here (__all__)
from attn.mods import (captured_tensors, mask_mod_kinds, reachable_tensors,  # noqa: F401
                       union_blocks)

__all__ = ["BlockMask", "captured_tensors", "create_block_mask", "flex_attention",
           "mask_mod_kinds"]


# -- a torch BlockMask as the tiles it visits ---------------------------------------------------

def _dense_from_indices(num: Tensor, idx: Tensor, kb: int) -> Tensor:
    """(B, H, QB, KB) bool from a BlockMask's (num_blocks, indices) pair."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    dense = torch.zeros(*idx.shape[:-1], kb + 1, dtype=torch.bool, device=idx.device)
    # invalid slots write into the spare last column, which is dropped
    dense.scatter_(-1, torch.where(valid, idx.long(), kb), True)
    return dense[..., :kb]


def block_mask_blocks(block_mask: BlockMask, B: int, H: int, n_q: int, n_k: int,
                      kernel_options: dict | None = None) -> Blocks:
    """The tiles a torch ``BlockMask`` visits, as :class:`attn.masks.Blocks`: its own block
    size, or ``kernel_options``' ``BLOCK_M`` / ``BLOCK_N`` when they divide it (the type
    is checked by :func:`flex_attention`, its one caller)."""
    q_len, kv_len = block_mask.seq_lengths
    if (q_len, kv_len) != (n_q, n_k):
        raise ValueError(f"block_mask was built for Q_LEN={q_len}, KV_LEN={kv_len}, the "
                         f"inputs have Nq={n_q}, Nk={n_k}")
    mb, mh = block_mask.kv_num_blocks.shape[:2]
    if mb not in (1, B) or mh not in (1, H):
        raise ValueError(f"block_mask of shape {tuple(block_mask.shape)} does not broadcast "
                         f"to (B, H) = ({B}, {H})")
    bs_m, bs_n = block_mask.BLOCK_SIZE
    qb, kb = -(-n_q // bs_m), -(-n_k // bs_n)
    visit = _dense_from_indices(block_mask.kv_num_blocks, block_mask.kv_indices, kb)
    full = torch.zeros_like(visit)
    if block_mask.full_kv_num_blocks is not None:
        full = _dense_from_indices(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kb)
    visit, full = (visit | full)[:, :, :qb], full[:, :, :qb]
    block_m, block_n = bs_m, bs_n
    opts = kernel_options or {}
    if "BLOCK_M" in opts or "BLOCK_N" in opts:
        block_m, block_n = int(opts.get("BLOCK_M", bs_m)), int(opts.get("BLOCK_N", bs_n))
        if block_m <= 0 or block_n <= 0 or bs_m % block_m or bs_n % block_n:
            raise ValueError(f"kernel_options BLOCK_M={block_m}, BLOCK_N={block_n} must divide "
                             f"the block mask's BLOCK_SIZE {(bs_m, bs_n)}")
        # sub-tiles inherit their block's kind; the grid is then trimmed to the lengths
        rm, rn = bs_m // block_m, bs_n // block_n
        visit, full = (t.repeat_interleave(rm, 2).repeat_interleave(rn, 3)
                       [:, :, :-(-n_q // block_m), :-(-n_k // block_n)] for t in (visit, full))
    return union_blocks(visit, full, n_q, n_k, block_m, block_n)


# -- public API -----------------------------------------------------------------------------------

def _checked_device(device: object) -> torch.device:
    """``device`` as a torch.device that can hold tensors here, or an error naming it."""
    if not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, a str or an int, got "
                        f"{type(device).__name__} {device!r}")
    try:
        device = torch.device(device)
        torch.empty(0, device=device)  # e.g. "cuda:99", or "cuda" in a CPU-only build
    except (RuntimeError, AssertionError, ValueError) as exc:
        # torch says AssertionError for a backend it was not built with
        raise ValueError(f"device {str(device)!r} is not a device tensors can live on here: "
                         f"{exc}") from None
    return device


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int,
                      KV_LEN: int, device=None, BLOCK_SIZE: int | tuple[int, int] = 128
                      ) -> BlockMask:
    """torch's ``create_block_mask``, eager: evaluate ``mask_mod(b, h, q_idx, kv_idx)`` (bool,
    True = attend) a chunk of tiles at a time and classify every ``BLOCK_SIZE`` tile as
    empty (skipped), full (no mask work) or partial (mask_mod evaluated inside).

    Returns torch's own ``BlockMask`` (usable by ``torch.nn.attention.flex_attention`` too),
    with shape (B, H, Q blocks, KV blocks); ``B`` / ``H`` = None broadcast over batch /
    heads (the mask_mod then sees b = 0 / h = 0 while classifying). No compile; any
    length. ``device``: where the mask lives; by default the device of a tensor the
    mask_mod captures, else torch's default device. Build it once and reuse it, as with
    torch's: it does not depend on q, k or v.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    for name, n in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    for name, n in (("B", B), ("H", H)):
        _check_positive_int_or_none(name, n)
    pair = BLOCK_SIZE if isinstance(BLOCK_SIZE, (tuple, list)) else (BLOCK_SIZE, BLOCK_SIZE)
    if (len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                  for x in pair)):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got "
                         f"{BLOCK_SIZE!r}")
    bm, bn = int(pair[0]), int(pair[1])
    if device is None:
        # the device of the first tensor mask_mod reads (document ids, a table), if any
        device = next((t.device for t in reachable_tensors(mask_mod)), None) \
            or torch.get_default_device()
    device = _checked_device(device)
    visit, full = mask_mod_kinds(mask_mod, B or 1, H or 1, Q_LEN, KV_LEN, bm, bn, device)
    partial = visit & ~full

    def as_indices(dense: Tensor) -> tuple[Tensor, Tensor]:
        num = dense.sum(-1, dtype=torch.int32)
        # listed blocks first, in increasing order (a stable sort of "not listed")
        idx = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num, idx

    kv_num, kv_idx = as_indices(partial)
    full_num, full_idx = as_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bm, bn),
                                    mask_mod=mask_mod, seq_lengths=(Q_LEN, KV_LEN))


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, AuxOutput]:
    """Drop-in for ``torch.nn.attention.flex_attention.flex_attention``, eager, on attn's
    backends, forward and backward on every device.

    query (B, H, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv);
    with ``return_lse`` also lse (B, H, Nq), float32 (float64 for float64 input), natural
    log. ``score_mod(score, b, h, q_idx, kv_idx)`` edits the scaled scores (``scale``
    defaults to ``D ** -0.5``); ``block_mask`` (torch's BlockMask, from
    :func:`create_block_mask` or torch's) skips its empty tiles and evaluates its mask_mod
    in partial ones. Tensors a score_mod captures receive exact, deterministic gradients.
    ``H != Hkv`` needs ``enable_gqa=True``. A row that sees no key gives zeros, lse -inf.

    ``kernel_options`` (only ``BLOCK_M`` / ``BLOCK_N`` are read, as tiled's tile sizes) and
    ``return_aux`` (lse only): docs/flex-varlen.md. ``backend``: as in :func:`attn.attention`.
    """
    _validate_qkv(query, key, value, ("query", "key", "value"))
    B, H, Nq, _ = query.shape
    Hkv, Nk = key.shape[1], key.shape[2]
    if H != Hkv and not enable_gqa:
        raise ValueError(f"query has {H} heads and key {Hkv}: pass enable_gqa=True for "
                         f"grouped-query attention (query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)})")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict, got {type(kernel_options).__name__}")
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be an AuxRequest, got {type(return_aux).__name__}")
    if return_aux is not None and return_aux.max_scores:
        raise NotImplementedError("return_aux=AuxRequest(max_scores=True) is not provided by "
                                  "attn.flex_attention; lse is")
    want_lse = bool(return_lse) or (return_aux is not None and return_aux.lse)

    mask_mod = mask_blocks = block_m = block_n = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a torch BlockMask, got "
                            f"{type(block_mask).__name__}")
        if block_mask.kv_num_blocks.device != query.device:
            block_mask = block_mask.to(query.device)
        mask_blocks = block_mask_blocks(block_mask, B, H, Nq, Nk, kernel_options)
        if block_mask.mask_mod is not noop_mask:
            mask_mod = block_mask.mask_mod
    elif kernel_options:  # tile sizes of the tiled backend
        block_m, block_n = kernel_options.get("BLOCK_M"), kernel_options.get("BLOCK_N")
    out, lse = attend(query, key, value, band=Band(), return_lse=True, backend=backend,
                      scale=scale, block_m=block_m, block_n=block_n, score_mod=score_mod,
                      mask_mod=mask_mod, mask_blocks=mask_blocks, q_name="query")
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None)
    return (out, lse) if want_lse else out
