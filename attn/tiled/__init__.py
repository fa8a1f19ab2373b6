"""Tiled attention in PyTorch: FlashAttention's online softmax, block by block, on any device,
nothing N x N alive but a mask the caller passes (docs/design.md, "The online softmax"; one
idea per module, listed in "The layers"). GQA without copies: a query block is viewed as
``(B, Hkv, G·BLOCK_M, D)``, so one matmul serves every query head of a group and ``Pᵀ dO``
sums dV over the group.
"""

import dataclasses

from attn.grads import Grads, sink_grad
from attn.spec import LaunchSpec
from attn.tiled.attention import _bwd, _fwd, tiled_attention
from attn.tiled.double import Static as _Static
from attn.tiled.double import differentiable_backward as _differentiable_backward
from attn.tiled.paged import paged_attention
from attn.tiled.plan import (BLOCK_M, BLOCK_N, DEFAULT, SequenceBlocks, TileConfig, _plan,
                             cpu_path_reason)
from attn.tiled.steps import COMPILED_DEFAULT, compiled_steps_default, steps_path_reason
from attn.tiled.tile import _Tile


def double_backward(do, dlse, q, k, v, out, lse, spec: LaunchSpec, ops):
    """``(dq, dk, dv, dsinks)`` of a call that another backend ran forward, from its saved
    q, k, v, out and lse, by tiled's backward whose gradients are differentiable again
    (DESIGN's pinned decision "Transforms": a backward asked for its own gradient hands
    off here). ``ops``: the call's Operands (no learnable softcap or mask gradient)."""
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
