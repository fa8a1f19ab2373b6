"""flash-attn's rotary embedding (``flash_attn.layers.rotary.apply_rotary_emb``) in PyTorch.

RoPE (Su et al. 2021) rotates pairs of features by position-dependent angles: with
``interleaved=True`` the pairs are (0, 1), (2, 3), ... (GPT-J); with ``False`` they are
(i, i + rd/2) (GPT-NeoX). Only the first ``rotary_dim = 2 · cos.shape[-1]`` features turn;
any even rotary_dim ``<= D`` works (flash-attn's kernels want multiples of 16). Computed in
float32 (float64 for float64 input) and cast back, differentiable.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "rotate_at"]


def _error(msg: str) -> Exception:
    from attn.compat.flash_attn import FlashAttnError
    return FlashAttnError(msg)


def _check_cos_sin(cos: object, sin: object, D: int) -> tuple[Tensor, Tensor]:
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor (seqlen_ro, rotary_dim / 2), got "
                            f"{type(t).__name__}")
    if cos.dim() != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= D:
        raise _error(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                     f"rotary_dim <= headdim {D}, got {tuple(cos.shape)} and "
                     f"{tuple(sin.shape)}")
    return cos, sin


def rotate_at(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool,
              name: str = "x") -> Tensor:
    """``x (B, N, H, D)`` rotated at ``positions (B, N)`` (rows of cos / sin)."""
    cos, sin = _check_cos_sin(cos, sin, x.shape[-1])
    if positions.numel() and (int(positions.max()) >= cos.shape[0] or int(positions.min()) < 0):
        raise _error(f"rotary_cos/rotary_sin have {cos.shape[0]} rows; {name} needs positions "
                     f"up to {int(positions.max())} (shape {tuple(x.shape)})")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
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
    ``cu_seqlens``), cos / sin ``(seqlen_ro, rotary_dim / 2)``; token s of sequence b turns
    at position ``s + seqlen_offsets[b]`` (an int or ``(B,)``). ``inplace`` writes into x.
    Returns the rotated tensor, x's shape and dtype; differentiable.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if cu_seqlens is None:
        if x.dim() != 4:
            raise _error(f"x must be (batch_size, seqlen, nheads, headdim), got shape "
                         f"{tuple(x.shape)}")
        B, S = x.shape[:2]
        offs = (torch.as_tensor(seqlen_offsets).long().cpu().expand(B) if not
                isinstance(seqlen_offsets, int) else torch.full((B,), seqlen_offsets))
        positions = offs.view(B, 1) + torch.arange(S).view(1, S)
        out = rotate_at(x, cos, sin, positions, interleaved)
    else:
        if x.dim() != 3:
            raise _error(f"x must be (total_seqlen, nheads, headdim) with cu_seqlens, got shape "
                         f"{tuple(x.shape)}")
        cu = cu_seqlens.cpu().long()
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        offs = (torch.as_tensor(seqlen_offsets).long().cpu().expand(lengths.numel())
                if not isinstance(seqlen_offsets, int)
                else torch.full((lengths.numel(),), seqlen_offsets))
        positions = torch.arange(seq.numel()) - cu[:-1][seq] + offs[seq]
        used = int(cu[-1])
        out = rotate_at(x[:used].unsqueeze(0), cos, sin, positions.unsqueeze(0),
                        interleaved)[0]
        if used < x.shape[0]:
            out = torch.cat([out, x[used:]])
    if inplace:
        x.copy_(out)
        return x
    return out


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias, kept for old code
