"""flash-attn's rotary embedding (``flash_attn.layers.rotary.apply_rotary_emb``) in PyTorch.

RoPE (Su et al. 2021) rotates pairs of features by position-dependent angles: with
``interleaved=True`` the pairs are (0, 1), (2, 3), ... (GPT-J); with ``False`` they are
(i, i + rd/2) (GPT-NeoX). Only the first ``rotary_dim = 2 · cos.shape[-1]`` features turn;
any even rotary_dim ``<= D`` works (flash-attn's kernels want multiples of 16). Computed in
float32 (float64 for float64 input) and cast back, differentiable.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor

from attn.compat.errors import FlashAttnError, translating
from attn.spec import acc_dtype
from attn.varlen import check_cu_form, check_cu_values

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "rotate_at"]


def _check_cos_sin(cos: object, sin: object, x: Tensor,
                   names: tuple[str, str] = ("rotary_cos", "rotary_sin")) -> tuple[Tensor, Tensor]:
    nc, ns = names
    for name, t in zip(names, (cos, sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor (seqlen_ro, rotary_dim / 2), got "
                            f"{type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating, got {t.dtype}")
        if t.device != x.device:
            raise FlashAttnError(f"{name} is on {t.device}, the tensor it rotates on {x.device}")
    D = x.shape[-1]
    if cos.dim() != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= D:
        raise FlashAttnError(f"{nc} and {ns} must both be (seqlen_ro, rotary_dim / 2) with "
                             f"rotary_dim <= headdim {D}, got {tuple(cos.shape)} and "
                             f"{tuple(sin.shape)}")
    return cos, sin


def rotate_at(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool,
              name: str = "x", table: tuple[str, str] = ("rotary_cos", "rotary_sin")) -> Tensor:
    """``x (B, N, H, D)`` rotated at ``positions (B, N)`` (rows of cos / sin); ``name`` and
    ``table`` are the caller's names of x and of cos / sin, for messages."""
    cos, sin = _check_cos_sin(cos, sin, x, table)
    if positions.numel() and (int(positions.max()) >= cos.shape[0] or int(positions.min()) < 0):
        raise FlashAttnError(f"{table[0]}/{table[1]} have {cos.shape[0]} rows; {name} needs "
                             f"positions from {int(positions.min())} up to "
                             f"{int(positions.max())} (shape {tuple(x.shape)})")
    acc = acc_dtype(x.dtype)
    pos = positions.to(cos.device).long()
    c = cos.to(acc)[pos].unsqueeze(2)  # (B, N, 1, rd/2): one angle per pair, all heads
    s = sin.to(acc)[pos].unsqueeze(2)
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _offsets(seqlen_offsets: object, B: int) -> Tensor:
    """flash-attn's ``seqlen_offsets``: an int, or an int32 / int64 tensor ``(batch_size,)``
    (a 0-d one too), as a ``(B,)`` int64 host tensor."""
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seqlen_offsets must be an int or an int32 tensor, got "
                            f"{seqlen_offsets.dtype}")
        if seqlen_offsets.shape not in ((), (B,)):
            raise FlashAttnError(f"seqlen_offsets must be an int or a (batch_size,) = ({B},) "
                                 f"tensor, got shape {tuple(seqlen_offsets.shape)}")
        return seqlen_offsets.cpu().long().expand(B)
    if isinstance(seqlen_offsets, (bool, np.bool_)) or not isinstance(
            seqlen_offsets, (int, np.integer)):
        raise TypeError(f"seqlen_offsets must be an int or a (batch_size,) int32 tensor, got "
                        f"{type(seqlen_offsets).__name__}")
    return torch.full((B,), int(seqlen_offsets), dtype=torch.int64)


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets: Union[int, Tensor] = 0,
    cu_seqlens: Optional[Tensor] = None,
    max_seqlen: Optional[int] = None,
):
    """flash-attn's ``apply_rotary_emb``: x ``(B, S, H, D)`` (or ``(total, H, D)`` with
    ``cu_seqlens (B + 1,)``), cos / sin ``(seqlen_ro, rotary_dim / 2)``; token s of sequence
    b turns at position ``s + seqlen_offsets[b]`` (an int or an int32 / int64 ``(B,)``
    tensor). ``inplace`` writes into x. Returns the rotated tensor, x's shape and dtype;
    differentiable. A position outside cos / sin raises (flash-attn's kernel leaves such a
    token unrotated when the offsets are a tensor).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if cu_seqlens is None:
        if x.dim() != 4:
            raise FlashAttnError(f"x must be (batch_size, seqlen, nheads, headdim), got shape "
                                 f"{tuple(x.shape)}")
        B, S = x.shape[:2]
        positions = _offsets(seqlen_offsets, B).view(B, 1) + torch.arange(S).view(1, S)
        out = rotate_at(x, cos, sin, positions, interleaved, "x", ("cos", "sin"))
    else:
        if x.dim() != 3:
            raise FlashAttnError(f"x must be (total_seqlen, nheads, headdim) with cu_seqlens, "
                                 f"got shape {tuple(x.shape)}")
        with translating():  # attn's one rule for packed offsets
            cu = check_cu_values("cu_seqlens", check_cu_form("cu_seqlens", cu_seqlens),
                                 x.shape[0], "x.shape[0]", padded=True).long()
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        offs = _offsets(seqlen_offsets, lengths.numel())
        positions = torch.arange(seq.numel()) - cu[:-1][seq] + offs[seq]
        used = int(cu[-1])
        out = rotate_at(x[:used].unsqueeze(0), cos, sin, positions.unsqueeze(0),
                        interleaved, "x", ("cos", "sin"))[0]
        if used < x.shape[0]:
            out = torch.cat([out, x[used:]])
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias, kept for old code
