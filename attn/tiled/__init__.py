"""Tiled attention in PyTorch: the FlashAttention algorithm, block by block, on any device.

Forward: for each block of ``BLOCK_M`` queries, walk the key blocks the band allows and keep
the online-softmax state per row — running max ``m_i``, running denominator ``l_i``,
rescaled accumulator ``acc`` — so the only score tensor alive is one
``(B, H, BLOCK_M, BLOCK_N)`` tile. Backward (FlashAttention-2): save only q, k, v, out and
lse; recompute each tile's probabilities from lse and form ``dS = P ∘ (dP − Δ)`` with
``Δ = rowsum(dO ∘ O)``. Nothing N x N exists at any moment unless the caller passed an
N x N ``attn_mask``.

GQA without copies: q is viewed as ``(B, Hkv, G·BLOCK_M, D)`` per block, so one matmul
serves every query head of a group and ``Pᵀ dO`` sums dV over the group for free.

Three layers, as in ``flash_triton.py``: ``_fwd`` / ``_bwd`` launchers, one
``torch.autograd.Function``, and the public :func:`tiled_attention`.

The package, one idea per module: :mod:`.attention` (launchers, autograd.Function, public
function), :mod:`.paged` (the paged reads of a KV cache), :mod:`.tile` (the ordered score pipeline of one tile), :mod:`.steps` (the per-tile
online-softmax steps and their compiled CPU form), :mod:`.plan` (block sizes, batch chunks,
units) and :mod:`.cpu` (GEMM engine choice, worker pool).
"""

from attn.grads import Grads, sink_grad
from attn.grads import reduce_to as _reduce_to
from attn.spec import LaunchSpec
from attn.tiled.attention import _bwd, _fwd, _TiledAttention, tiled_attention
from attn.tiled.double import Static as _Static
from attn.tiled.double import differentiable_backward as _differentiable_backward
from attn.tiled.paged import paged_attention
from attn.tiled.plan import (BLOCK_M, BLOCK_N, DEFAULT, SequenceBlocks, TileConfig, _plan,
                             cpu_path_reason)
from attn.tiled.steps import COMPILED_DEFAULT, compiled_steps_default, steps_path_reason
from attn.tiled.tile import LN2, LOG2E, _Tile



def double_backward(do, dlse, q, k, v, out, lse, spec: LaunchSpec, ops):
    """``(dq, dk, dv, dsinks)`` of a call that another backend ran forward, from its saved
    q, k, v, out and lse, by tiled's backward whose gradients are differentiable again
    (DESIGN's pinned decision "Transforms": a backward asked for its own gradient hands
    off here). ``ops``: the call's Operands (no learnable softcap or mask gradient)."""
    import dataclasses

    if callable(spec.mask_blocks):  # as tiled_attention: the mask's tiles at tiled's sizes
        mb = spec.mask_blocks(spec.block_m or BLOCK_M, spec.block_n or BLOCK_N)
        spec = dataclasses.replace(spec, block_m=mb.block_m, block_n=mb.block_n, mask_blocks=mb)
    g = _differentiable_backward(_Static(spec, DEFAULT, _bwd, False, False), do, dlse, q, k,
                                 v, out, lse, None, ops)
    return g[0], g[1], g[2], g[4]


__all__ = ["BLOCK_M", "BLOCK_N", "DEFAULT", "COMPILED_DEFAULT", "Grads", "LaunchSpec",
           "SequenceBlocks", "TileConfig", "compiled_steps_default", "cpu_path_reason",
           "double_backward", "steps_path_reason",
           "paged_attention", "sink_grad", "tiled_attention"]
