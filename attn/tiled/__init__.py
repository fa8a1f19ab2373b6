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
from attn.tiled.paged import paged_attention
from attn.tiled.plan import (BLOCK_M, BLOCK_N, DEFAULT, SequenceBlocks, TileConfig, _plan,
                             cpu_path_reason)
from attn.tiled.steps import COMPILED_DEFAULT, compiled_steps_default, steps_path_reason
from attn.tiled.tile import LN2, LOG2E, _Tile

__all__ = ["BLOCK_M", "BLOCK_N", "DEFAULT", "COMPILED_DEFAULT", "Grads", "LaunchSpec",
           "SequenceBlocks", "TileConfig", "compiled_steps_default", "cpu_path_reason",
           "steps_path_reason",
           "paged_attention", "sink_grad", "tiled_attention"]
