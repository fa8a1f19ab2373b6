"""Tiled attention in PyTorch: FlashAttention's online softmax, block by block, on any device,
nothing N x N alive but a mask the caller passes (docs/design.md, "The online softmax"; one
idea per module, listed in "The layers"). GQA without copies: a query block is viewed as
``(B, Hkv, G·BLOCK_M, D)``, so one matmul serves every query head of a group and ``Pᵀ dO``
sums dV over the group.
"""

from attn.grads import Grads, sink_grad
from attn.spec import LaunchSpec
from attn.tiled.attention import _bwd, _fwd, double_backward, tiled_attention
from attn.tiled.paged import paged_attention
from attn.tiled.plan import (BLOCK_M, BLOCK_N, DEFAULT, SequenceBlocks, TileConfig, _plan,
                             cpu_path_reason)
from attn.tiled.steps import COMPILED_DEFAULT, compiled_steps_default, steps_path_reason
from attn.tiled.tile import _Tile

__all__ = ["BLOCK_M", "BLOCK_N", "DEFAULT", "COMPILED_DEFAULT", "Grads", "LaunchSpec",
           "SequenceBlocks", "TileConfig", "compiled_steps_default", "cpu_path_reason",
           "double_backward", "steps_path_reason",
           "paged_attention", "sink_grad", "tiled_attention"]
