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
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import warnings
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from attn import cpu
# the shared backward helpers; _reduce_to and the public names stay importable from here
from attn.grads import SATURATED_LOG2L, Grads, sink_grad
from attn.grads import reduce_to as _reduce_to
from attn.masks import Blocks, as_4d, dropout_keep, dropout_keep_rows
from attn.spec import LaunchSpec
from attn.spec import acc_dtype as _acc_dtype

# Chosen by measurement (scripts/tune_tiled_blocks.py; benchmarks/results/tiled_blocks_cpu.md):
# on 2 CPU cores, fp32, B=1, H=8, D=64, causal, 256 x 256 was fastest or tied at N = 4096
# and 8192, forward and backward. Smaller tiles pay more per-tile Python and dispatch cost;
# larger ones (512 x 512: 8 MiB per score tile) fall out of cache and lose 5-25%.
BLOCK_M = 256
BLOCK_N = 256

# The unit path (:mod:`attn.cpu`): when oneDNN runs this CPU's GEMMs clearly faster than
# torch's bmm, a call is cut into units — one batch row, one KV head with its G query heads —
# each tile's GEMMs 2-D through oneDNN, the units in order or on worker threads. Tiles are about
# UNIT_ROWS query rows (G·BM) by UNIT_BLOCK_N keys: oneDNN's per-call cost (~15 us) wants
# large GEMMs, and one head's 512 x 512 tile (1 MiB) still fits a core's L2. Calls with
# fewer rows per tile or keys than the minimums (decoding, short sequences) stay batched.
UNIT_ROWS = 512
UNIT_BLOCK_N = 512
# Without a band (no causal / window tiles to skip) twice the rows per tile measured 5-15%
# faster from N = 2048 (benchmarks/results/cpu_unit_tiles.md), but its 2 MiB tile (and one
# more per extra worker) would put the forward's peak over 1.5x SDPA's below 8192 query rows.
UNIT_ROWS_FULL = 1024
UNIT_ROWS_FULL_MIN_Q = 8192  # query rows (G·Nq) from which a call without a band takes them
UNIT_MIN_ROWS = 128
UNIT_MIN_KEYS = 256
# A band whose visited tiles are mostly partial (causal at N <= 1024: 2 of 3) wastes too much
# of each large tile on masked scores: such calls stay batched with the smaller tiles.
UNIT_MAX_PARTIAL = 0.5
# Units run on the worker threads (one intra-op thread each) only for calls of at least
# this many visited scores (B·H·Nq·Nk inside the band). Smaller calls run the units in
# order here, each GEMM on torch's own intra-op threads: the workers share the cores with
# the threads OpenMP keeps spinning (~ms) after the previous torch op, a fixed cost per
# call measured at 10-25% of a B=1, H=8, N=1024 call and ~5% at N=4096.
POOL_MIN_SCORES = 64 << 20

# Scores live in base-2 units (s·log2 e) and probabilities are exp2(s - m): on CPU torch's
# exp2 runs ~4.6x faster than exp at 1.2 ulp in fp32, and exp was the largest non-GEMM cost
# per tile. When nothing nonlinear sits between q·kᵀ and the softmax (no softcap, score_mod
# or float mask), log2 e folds into the q scale and costs nothing; otherwise the finished
# scores are multiplied once. The forward keeps lse2 = (m, log2 l) for the backward, in two
# parts: P = exp2(s - m) / l. One fp32 number m + log2(l) loses log2 l where it is
# below half an ulp of m (at logits of 1e4 an ulp is 1e-3: a row whose second key has
# P = 1e-5 came back as P = 1 exactly, and dV went 2x over its error budget), and the natural
# lse the forward returns cannot be turned back at all (the round trip moves P by 1e-3).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453



def _mask4d(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """``mask`` expanded (no copy) to ``shape``."""
    return as_4d(mask).expand(shape)


def _scores_finite(q: Tensor, k: Tensor, spec: LaunchSpec) -> bool:
    """Whether every q·k of the call is surely finite: q and k finite and
    ``max|q|·max|k|·D·scale`` (with log2 e) below the accumulation dtype's largest value.
    Off CPU it answers False without looking (no host sync): the masks then replace."""
    if q.numel() == 0 or k.numel() == 0:
        return True
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    fmax = torch.finfo(_acc_dtype(q.dtype)).max
    bound = abs(spec.qk_scale) * LOG2E * q.shape[-1]
    for x in (q, k):  # aminmax propagates NaN, and inf fails the bound
        lo, hi = torch.aminmax(x)
        bound *= max(-lo.item(), hi.item())
    return bound < fmax  # False for NaN


def _values_may_overflow(v: Tensor, n_k: int) -> bool:
    """Whether ``Σ_j p_j v_j`` over up to ``n_k`` keys (p ≤ 1) may pass half the accumulation
    dtype's largest value: ``max|v| · 2·n_k`` above it (NaN and ±inf answer False: the
    output is not finite anyway). float16 values never can (65504 · 2·n_k is far below
    float32's max), so they are not looked at; off CPU, and while compiling, the answer is
    True without looking (no host sync): :meth:`_Tile.value_offset` then decides per tile
    on the device."""
    fmax = torch.finfo(_acc_dtype(v.dtype)).max
    if v.numel() == 0 or torch.finfo(v.dtype).max * 2.0 * n_k <= fmax:
        return False
    if v.device.type != "cpu" or torch.compiler.is_compiling():
        return True
    lo, hi = torch.aminmax(v)
    return 1.0 < max(-lo.item(), hi.item()) * 2.0 * n_k / fmax < float("inf")


def _finite_or_zero(x: Tensor) -> Tensor:
    """``x`` with its NaN and ±inf entries replaced by 0."""
    return torch.where(torch.isfinite(x), x, 0.0)


class _Tile:
    """What every (query block, key block) tile needs to rebuild its scores.

    Layout: k and v as ``(B·Hkv, N, D)``; a query block as ``(B·Hkv, G·BM, D)`` with the G
    query heads of a group stacked along rows, so one ``bmm`` serves the whole group.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec,
                 attn_mask: Tensor | None, softcap_t: Tensor | None,
                 alibi: Tensor | None = None, b0: int = 0, engine: str = "bmm") -> None:
        B, H, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        self.B, self.H, self.Hkv, self.G = B, H, Hkv, H // Hkv
        self.spec = spec
        self.band = spec.local_band()
        self.device = q.device
        acc = self.acc_dtype = _acc_dtype(q.dtype)
        self.q = q
        self.k3 = k.reshape(B * Hkv, Nk, D)  # (B·Hkv, Nk, D), a view when k is contiguous
        self.v3 = v.reshape(B * Hkv, Nk, v.shape[-1])
        # oneDNN (one unit: B·Hkv = 1) takes 2-D operands in the accumulation dtype, row-major
        # (or column-major, the second): k and v converted once here
        self.onednn = engine == "onednn"
        # the backward on oneDNN computes its tiles keys-major, (BN, G·BM) in memory, seen
        # through a transposed view: dV += Pᵀ dO and dK += dSᵀ Q then read Pᵀ and dSᵀ
        # row-major and dQ += dS K takes dS as a column-major weight (set by _bwd_rows; the
        # forward, keys-major too, measured 20-35% slower: its row reductions run strided)
        self.keys_major = False
        if self.onednn:
            if B * Hkv != 1:
                raise AssertionError(f"the oneDNN engine runs one unit (B·Hkv = 1), got "
                                     f"B={B}, Hkv={Hkv}")
            self.k3 = self.k3.to(acc).contiguous()
            self.v3 = self.v3.to(acc).contiguous()
        self._buffers: dict[tuple, Tensor] = {}
        self.mask5 = self.mask4 = None
        self.ninf = torch.tensor(float("-inf"), dtype=acc, device=q.device)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # kept at its own broadcast shape; each tile's slice becomes a 0 / -inf bias:
            # masked_fill_ through a broadcast mask ran 10x slower than add_ (250 vs 25 us)
            self.mask4 = as_4d(attn_mask)
        elif attn_mask is not None:
            self.mask5 = _mask4d(attn_mask, (B, H, Nq, Nk)).view(B, Hkv, self.G, Nq, Nk)
        # Masked scores are *replaced* by -inf, so a key outside the mask never reaches a row
        # (NaN + -inf is NaN). The additive 0 / -inf bias is as exact and runs 10-50x faster
        # than a broadcast where / masked_fill on CPU, but only while every q·k is finite:
        # checked once per call from max |q|, max |k| (NaN-propagating), where a mask exists
        self.masked = (not self.band.is_full or attn_mask is not None
                       or spec.mask_mod is not None)
        self.finite_scores = not self.masked or _scores_finite(q, k, spec)
        self.k3_dq = self.k3  # the backward's dQ += dS K reads this (see _bwd_rows)
        # set by the forward (_values_may_overflow): whether value_offset looks at the tiles
        self.values_may_overflow = False
        self._value_offsets: dict[tuple[int, int], Tensor | None] = {}
        # log2 e in the q scale when every step up to the softmax is linear in s or a -inf fill
        self.fold_log2 = (spec.score_mod is None and spec.softcap is None and softcap_t is None
                          and self.mask5 is None)
        self.cap5 = None
        if softcap_t is not None:
            self.cap5 = softcap_t.to(acc).expand(H).reshape(1, Hkv, self.G, 1, 1)
        # -- ALiBi: minus the slopes, per (batch, head), or per (head, sequence) when packed
        self.alibi5 = self.alibi_seq = None
        if alibi is not None and spec.alibi_rows is None:
            self.alibi5 = -self._units(alibi.to(acc)).expand(B, H).reshape(B, Hkv, self.G, 1, 1)
        elif alibi is not None:
            # (Hkv, G, seqs)
            self.alibi_seq = -self._units(alibi.to(acc)).t().reshape(Hkv, self.G, -1)
        self._alibi_dist: dict[tuple[int, int, int], Tensor] = {}
        if spec.dropout_p > 0.0:
            # the hash reads global (b·H + h, i, j): a shard draws the unsharded mask
            heads = spec.heads_total or H
            h = torch.arange(H, device=q.device) + spec.head_start
            b = torch.arange(b0, b0 + B, device=q.device)  # b0: this batch chunk's first row
            self.bh = (b[:, None] * heads + h).view(B, Hkv, self.G)
            self.heads, self.h_glob = heads, h.view(1, Hkv, self.G, 1)
        self._band_masks: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        # -- score_mod / mask_mod: index tensors broadcast to (B, H, BM, BN), global positions
        self.score_mod, self.mask_mod = spec.score_mod, spec.mask_mod
        if self.score_mod is not None or self.mask_mod is not None:
            self.b_idx = torch.arange(b0, b0 + B, device=q.device).view(B, 1, 1, 1)
            self.h_idx = (torch.arange(H, device=q.device) + spec.head_start).view(1, H, 1, 1)

    def _units(self, x: Tensor) -> Tensor:
        """A term added to the scores, in the units they have when it is added."""
        return x * LOG2E if self.fold_log2 else x

    def _idx(self, m0: int, m1: int, n0: int, n1: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        q_idx = (torch.arange(m0, m1, device=self.device) + self.spec.q_start).view(1, 1, -1, 1)
        kv_idx = (torch.arange(n0, n1, device=self.device) + self.spec.k_start).view(1, 1, 1, -1)
        return self.b_idx, self.h_idx, q_idx, kv_idx

    def _score_mod(self, s: Tensor, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """``score_mod`` on a tile viewed as (B, H, BM, BN); back in the tile layout."""
        shape = (self.B, self.H, m1 - m0, n1 - n0)
        out = self.score_mod(s.view(shape), *self._idx(m0, m1, n0, n1))
        if not isinstance(out, Tensor):
            raise TypeError(f"score_mod must return a tensor, got {type(out).__name__}")
        try:
            out = torch.broadcast_to(out.to(self.acc_dtype), shape)
        except RuntimeError:
            raise ValueError(f"score_mod returned shape {tuple(out.shape)}, which does not "
                             f"broadcast to the tile's scores (B, H, BM, BN) = {shape}") from None
        return out.reshape(s.shape).contiguous()  # the steps after it work in place

    def mask_mod_keep(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """``mask_mod`` on one tile: bool broadcastable to (B, H, BM, BN), True = attend."""
        keep = self.mask_mod(*self._idx(m0, m1, n0, n1))
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            what = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
            raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {what}")
        shape = (self.B, self.H, m1 - m0, n1 - n0)
        try:
            torch.broadcast_shapes(keep.shape, shape)
        except RuntimeError:
            raise ValueError(f"mask_mod returned shape {tuple(keep.shape)}, which does not "
                             f"broadcast to the tile (B, H, BM, BN) = {shape}") from None
        return keep

    def q_block(self, m0: int, m1: int) -> Tensor:
        """Scaled queries ``(B·Hkv, G·BM, D)`` in the accumulation dtype (a fresh copy); the
        scale carries log2 e when :attr:`fold_log2`."""
        scale = self.spec.qk_scale * (LOG2E if self.fold_log2 else 1.0)
        q_blk = self.q[:, :, m0:m1].to(self.acc_dtype) * scale  # (B, H, BM, D)
        return q_blk.reshape(self.B * self.Hkv, self.G * (m1 - m0), q_blk.shape[-1])

    def k_block(self, n0: int, n1: int) -> Tensor:
        return self.k3[:, n0:n1].to(self.acc_dtype)

    def v_block(self, n0: int, n1: int) -> Tensor:
        return self.v3[:, n0:n1].to(self.acc_dtype)

    def _band_mask(self, m0: int, m1: int, n0: int, n1: int) -> tuple[Tensor, Tensor]:
        """The band of a tile as (BM, BN) ``(inside, bias)``: bool, and the additive 0 / -inf
        bias. A tile's band depends only on its diagonal offset and size: each is built once."""
        key = (n0 - m0, m1 - m0, n1 - n0)
        if key not in self._band_masks:
            offs_m = torch.arange(m0, m1, device=self.device)
            offs_n = torch.arange(n0, n1, device=self.device)
            inside = self.band.mask(offs_m, offs_n)
            bias = torch.zeros(inside.shape, dtype=self.acc_dtype, device=self.device)
            self._band_masks[key] = inside, bias.masked_fill_(~inside, float("-inf"))
        return self._band_masks[key]

    def _bool_mask_tile(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """The bool attn_mask's tile (True = attend) at the mask's own broadcast shape."""
        m = self.mask4
        rows = slice(m0, m1) if m.shape[2] != 1 else slice(None)
        cols = slice(n0, n1) if m.shape[3] != 1 else slice(None)
        return m[:, :, rows, cols]

    def _mask_out(self, s: Tensor, keep: Tensor, bias: Tensor | None = None) -> None:
        """``s`` ← ``s`` where ``keep``, else -inf, in place (``keep`` broadcasts to ``s``):
        the bias add where every score is finite, a replacement otherwise."""
        if self.finite_scores:
            s.add_(torch.where(keep, 0.0, self.ninf) if bias is None else bias)
        else:
            torch.where(keep, s, self.ninf, out=s)

    def _add_alibi(self, s5: Tensor, m0: int, m1: int, n0: int, n1: int) -> None:
        """``s5 += −slope · |distance|`` in place: distances from the band's diagonal, global
        (a tile's depend only on its diagonal offset and size: built once), or, packed,
        inside each row's own sequence with that sequence's slopes."""
        if self.alibi5 is not None:
            key = (n0 - m0, m1 - m0, n1 - n0)
            if key not in self._alibi_dist:
                offs_m = torch.arange(m0, m1, device=self.device)
                offs_n = torch.arange(n0, n1, device=self.device)
                rel = offs_n[None, :] - (offs_m[:, None] + self.band.offset)
                self._alibi_dist[key] = rel.abs().to(self.acc_dtype)  # (BM, BN)
            s5.addcmul_(self.alibi5, self._alibi_dist[key])
            return
        offs_m = torch.arange(m0, m1, device=self.device) + self.spec.q_start
        offs_n = torch.arange(n0, n1, device=self.device) + self.spec.k_start
        seq, pos_m, pos_n = self.spec.alibi_rows(offs_m, offs_n)
        dist = (pos_n[None, :] - pos_m[:, None]).abs().to(self.acc_dtype)  # (BM, BN)
        s5.addcmul_(self.alibi_seq[:, :, seq].unsqueeze(-1), dist)  # (Hkv, G, BM, 1)

    # -- the tile GEMMs: batched bmm over (B·Hkv), or one unit's 2-D products through oneDNN --

    def qk(self, q_blk: Tensor, n0: int, n1: int) -> Tensor:
        """``q_blk kᵀ`` for key block [n0, n1): ``(B·Hkv, G·BM, BN)``; with
        :attr:`keys_major`, a view of the contiguous ``k q_blkᵀ``."""
        if self.keys_major:
            return cpu.mm_nt(self.k3[0, n0:n1], q_blk[0]).t().unsqueeze(0)
        if self.onednn:
            return cpu.mm_nt(q_blk[0], self.k3[0, n0:n1]).unsqueeze(0)
        k_blkT = self.k3[:, n0:n1].to(self.acc_dtype).transpose(1, 2)  # a view for fp32/fp64
        shape = (q_blk.shape[0], q_blk.shape[1], n1 - n0)
        return torch.bmm(q_blk, k_blkT, out=self.buffer("s", shape))

    def add_pv(self, acc: Tensor, p: Tensor, n0: int, n1: int) -> None:
        """``acc += p V`` for key block [n0, n1)."""
        if self.onednn:
            acc[0].add_(cpu.mm_nt(p[0], self.v3[0, n0:n1].t()))
        else:
            acc.baddbmm_(p, self.v_block(n0, n1))

    def dp(self, do_blk: Tensor, n0: int, n1: int) -> Tensor:
        """``dO Vᵀ`` for key block [n0, n1): ``(B·Hkv, G·BM, BN)``."""
        if self.keys_major:
            return cpu.mm_nt(self.v3[0, n0:n1], do_blk[0]).t().unsqueeze(0)
        if self.onednn:
            return cpu.mm_nt(do_blk[0], self.v3[0, n0:n1]).unsqueeze(0)
        shape = (do_blk.shape[0], do_blk.shape[1], n1 - n0)
        return torch.bmm(do_blk, self.v_block(n0, n1).transpose(1, 2),
                         out=self.buffer("dp", shape))

    def add_dq(self, dq_blk: Tensor, ds: Tensor, n0: int, n1: int) -> None:
        """``dq_blk += dS K`` for key block [n0, n1)."""
        k3 = self.k3_dq
        if self.keys_major:  # dS is keys-major: dQᵀ = Kᵀ dSᵀ takes it as it lies
            dq_blk[0].add_(cpu.mm_nt(k3[0, n0:n1].t(), ds[0]).t())
        elif self.onednn:
            dq_blk[0].add_(cpu.mm_nt(ds[0], k3[0, n0:n1].t()))
        else:
            dq_blk.baddbmm_(ds, k3[:, n0:n1].to(self.acc_dtype))

    def add_tn(self, dst: Tensor, a: Tensor, b: Tensor, name: str) -> None:
        """``dst += aᵀ b``: dV += Pᵀ dO and dK += dSᵀ Q for one tile, ``a (·, G·BM, BN)``,
        ``b (·, G·BM, D)``. Both engines add a contiguous product into the slice (a GEMM
        into a column slice of (B·Hkv, Nk, D) runs as one addmm per batch entry, ~10%
        slower). On oneDNN ``a`` is keys-major (:attr:`keys_major`): ``aᵀ`` is row-major."""
        if self.onednn:
            dst[0].add_(cpu.mm_nt(a[0].t(), b[0].t()))
        else:
            shape = (a.shape[0], a.shape[2], b.shape[2])
            dst.add_(torch.bmm(a.transpose(1, 2), b, out=self.buffer(name, shape)))

    def buffer(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A tile-sized scratch tensor reused across tiles: no allocator churn per tile."""
        key = (name, shape)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=self.acc_dtype, device=self.device)
        return self._buffers[key]

    def scores(self, q_blk: Tensor, m0: int, m1: int, n0: int, n1: int, full: bool,
               track: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Masked scores ``(B·Hkv, G·BM, BN)`` in base-2 units; with softcap also
        ``u = s_raw / c`` and ``t = tanh(u)`` (the backward needs both). ``full``: the block
        classification says no mask (band, mask_mod) masks anything in this tile. Order:
        scale → score_mod → softcap → ALiBi → masks → log2 e (the ALiBi bias is a constant:
        dS flows through it unchanged, so the backward needs nothing more). ``track``
        (backward): the score_mod runs under autograd and ``self.mod_graph`` keeps
        ``(scores in, scores out)`` for :meth:`score_mod_vjp`."""
        B, Hkv, G, BM, BN = self.B, self.Hkv, self.G, m1 - m0, n1 - n0
        s = self.qk(q_blk, n0, n1)  # q_blk already scaled
        if self.score_mod is not None:
            if track:
                s_in = s.detach().requires_grad_()
                with torch.enable_grad():
                    s_out = self._score_mod(s_in, m0, m1, n0, n1)
                self.mod_graph = (s_in, s_out)
                s = s_out.detach().clone()  # the steps below work in place: keep the graph's
            else:
                s = self._score_mod(s, m0, m1, n0, n1)
        s5 = s.view(B, Hkv, G, BM, BN)
        u = t = None
        if self.cap5 is not None or self.spec.softcap is not None:
            c = self.cap5 if self.cap5 is not None else self.spec.softcap
            u = s5.div_(c).view(B * Hkv, G * BM, BN)
            t = torch.tanh(u)
            s = t * c if self.cap5 is None else (t.view_as(s5) * c).view_as(t)
            s5 = s.view(B, Hkv, G, BM, BN)
        if self.alibi5 is not None or self.alibi_seq is not None:
            self._add_alibi(s5, m0, m1, n0, n1)
        # -- masks --
        if not full:
            if not self.band.is_full:
                self._mask_out(s5, *self._band_mask(m0, m1, n0, n1))
            if self.mask_mod is not None:
                keep = self.mask_mod_keep(m0, m1, n0, n1)
                s.view(B, self.H, BM, BN).masked_fill_(~keep, float("-inf"))
        if self.mask4 is not None:
            self._mask_out(s.view(B, self.H, BM, BN), self._bool_mask_tile(m0, m1, n0, n1))
        elif self.mask5 is not None:
            bias = self.mask5[..., m0:m1, n0:n1]
            s5.add_(bias)
            if not self.finite_scores:  # a -inf entry masks: NaN + -inf would stay NaN
                s5.masked_fill_(bias == float("-inf"), float("-inf"))
        if not self.fold_log2:
            s.mul_(LOG2E)
        return s, u, t

    def score_mod_vjp(self, ds: Tensor, captured: tuple[Tensor, ...]
                      ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """The score_mod's backward on the last tracked tile, by autograd: dS before the mod
        and this tile's share of each captured tensor's gradient (None where unused)."""
        s_in, s_out = self.mod_graph
        self.mod_graph = None
        grads = torch.autograd.grad(s_out, (s_in, *captured), grad_outputs=ds.view_as(s_out),
                                    allow_unused=True)
        ds_in = grads[0] if grads[0] is not None else torch.zeros_like(s_in)
        return ds_in, grads[1:]

    def dropout_scale(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """Kept elements scaled by 1/(1-p), dropped ones 0: ``(B·Hkv, G·BM, BN)``."""
        spec = self.spec
        offs_m = torch.arange(m0, m1, device=self.device) + spec.q_start
        offs_n = torch.arange(n0, n1, device=self.device) + spec.k_start
        if spec.dropout_rows is None:
            keep = dropout_keep(spec.dropout_seed, self.bh, offs_m, offs_n, spec.dropout_p)
        else:  # packed: one batch row holding many sequences (B == 1)
            b_rows, offs_m, offs_n = spec.dropout_rows(offs_m, offs_n)
            bh = b_rows.view(1, 1, 1, -1) * self.heads + self.h_glob  # (1, Hkv, G, BM)
            keep = dropout_keep_rows(spec.dropout_seed, bh, offs_m, offs_n, spec.dropout_p)
        z = keep.to(self.acc_dtype) / (1.0 - spec.dropout_p)  # (B, Hkv, G, BM, BN)
        return z.view(self.B * self.Hkv, self.G * (m1 - m0), n1 - n0)

    def value_offset(self, n0: int, n1: int) -> Tensor | None:
        """The forward's exponent offset ``c ≥ 0`` for key tile [n0, n1), per (batch row, kv
        head) as ``(B·Hkv, 1, 1)`` in base-2 units, or None where it is 0 for every row.

        ``acc = Σ_j p_j v_j`` with ``p ≤ 1`` reaches ``Nk · max|v|``, past the accumulation
        dtype's largest value when ``|v|`` is near it. A row's running max then carries
        ``c = log2(max|v| · 2·Nk / fmax)`` of its tile on top, so ``p = exp2(s − (m + c))
        ≤ 2^-c`` and ``Σ_j p_j |v_j| ≤ fmax / 2``; out = acc / l and lse = m + log2 l are
        unchanged (l shrinks by the same factor). Read from this tile's own values, per
        (batch row, kv head): another sequence's values never move a row's result (packed
        tiles hold one sequence's keys)."""
        if not self.values_may_overflow:
            return None
        key = (n0, n1)
        if key not in self._value_offsets:
            vb = self.v3[:, n0:n1]
            vmax = torch.maximum(vb.amax(dim=(1, 2)), -vb.amin(dim=(1, 2))).to(self.acc_dtype)
            fmax = torch.finfo(self.acc_dtype).max
            c = torch.log2(vmax) + math.log2(2.0 * self.k3.shape[1] / fmax)
            c = torch.where((c > 0.0) & (c < float("inf")), c, 0.0).view(-1, 1, 1)  # NaN: 0
            if self.device.type == "cpu" and not torch.compiler.is_compiling() \
                    and not bool(c.any()):
                c = None  # the ordinary steps, bit for bit
            self._value_offsets[key] = c
        return self._value_offsets[key]

    def rows(self, x: Tensor, m0: int, m1: int) -> Tensor:
        """Per-row values (B, H, Nq) of a query block as a column ``(B·Hkv, G·BM, 1)``."""
        return x[:, :, m0:m1].reshape(self.B * self.Hkv, self.G * (m1 - m0), 1)


# -- per-tile steps: the online-softmax update and dS, each in exactly one place ------------

def _fwd_tile(m_i: Tensor, l_i: Tensor, s: Tensor, z: Tensor | None, c: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One key tile of the forward (Triton's ``_fwd_inner`` body, up to the P·V GEMM): the
    new row max, ``p = exp2(s - m_new)``, the rescale ``alpha`` of the old state and the new
    denominator. Returns ``(p, m_new, l_new, alpha)``; the caller does
    ``acc ← alpha·acc + p V``. ``s`` is consumed (overwritten by p), ``l_i`` updated in
    place; ``z`` is the dropout scale (values only); ``c`` the tile's value offset
    (:meth:`_Tile.value_offset`), added to its row max."""
    m_tile = s.amax(dim=-1, keepdim=True)
    if c is not None:
        m_tile.add_(c.expand(-1, m_tile.shape[1], -1))
    m_new = torch.maximum(m_i, m_tile)
    p = s.sub_(m_new).exp2_()
    alpha = (m_i - m_new).exp2_()
    l_i = l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
    if z is not None:  # the denominator counts every key, the values only the kept ones
        p.mul_(z)
    return p, m_new, l_i, alpha


def _bwd_tile(s: Tensor, u: Tensor | None, t: Tensor | None, lse_blk: Tensor,
              delta_blk: Tensor, dp: Tensor, z: Tensor | None,
              need_dc: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One tile of the backward (Triton's ``_dkdv_inner`` / ``_dq_inner`` body): recompute
    P from lse, then ``dS = P ∘ (dP − Δ)`` with ``dP = dO Vᵀ`` given (consumed). Returns
    ``(pd, ds, ds_capped, dc_terms)``: P
    with dropout applied (for dV), dS before and after the softcap chain rule (dS feeds a
    float mask's gradient; the capped one feeds dQ, dK), and the softcap gradient's terms."""
    p = s.sub_(lse_blk).exp2_()  # (B·Hkv, G·BM, BN), s and lse in base-2 units
    # -- dropout scales P for dV and dP alike (ᵈ) --
    pd = p
    if z is not None:
        pd = p * z
        dp.mul_(z)
    # -- dS = P ∘ (dP − Δ) --
    ds = dp.sub_(delta_blk).mul_(p)
    return (pd, ds) + _softcap_chain(ds, u, t, need_dc)


def _softcap_chain(ds: Tensor, u: Tensor | None, t: Tensor | None, need_dc: bool
                   ) -> tuple[Tensor, Tensor | None]:
    """dS before the softcap and the softcap gradient's terms (both steps share it)."""
    if t is None:
        return ds, None
    # s = c·tanh(u), u = s_raw/c: ds_raw = ds·(1 − t²); dc = Σ ds·(t − u(1 − t²))
    one_m_t2 = 1.0 - t * t
    dc_terms = ds * (t - u * one_m_t2) if need_dc else None
    return ds * one_m_t2, dc_terms


# -- the fused CPU path: the same two steps, compiled ---------------------------------------
# torch.compile (inductor's C++ backend) turns each step's elementwise chain into two loops
# over the tile (row max, then exp2 / sum / dS) instead of one pass per op, and drops the
# per-op dispatch. The GEMMs stay eager (torch's bmm). Shapes are symbolic (dynamic=True:
# measured as fast as static ones), so sequence lengths, edge tiles and batch sizes never
# recompile; each combination of dtype, step variant and size-1 dims compiles once per
# process, in a code object of its own so that no combination eats another's recompile budget.

def _fwd_tile_fused(m_i: Tensor, l_i: Tensor, s: Tensor, z: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_fwd_tile` without the P·V GEMM, functional (for torch.compile): returns
    ``(p, m_new, l_new, alpha)``; ``acc ← alpha·acc + p V`` stays with the caller."""
    m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
    p = torch.exp2(s - m_new)
    alpha = torch.exp2(m_i - m_new)
    l_new = l_i * alpha + p.sum(dim=-1, keepdim=True)
    if z is not None:
        p = p * z
    return p, m_new, l_new, alpha


def _bwd_tile_fused(s: Tensor, dp: Tensor, u: Tensor | None, t: Tensor | None, lse_blk: Tensor,
                    delta_blk: Tensor, z: Tensor | None, need_dc: bool
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`_bwd_tile` after the dP GEMM, functional (for torch.compile)."""
    p = torch.exp2(s - lse_blk)
    pd = p
    if z is not None:
        pd = p * z
        dp = dp * z
    ds = p * (dp - delta_blk)
    return (pd, ds) + _softcap_chain(ds, u, t, need_dc)


_COMPILED: dict[str, Callable] = {}
_FUSED_FAILED: str | None = None  # why the fused path is off for this process, once it failed


def fused_cpu_default() -> bool:
    """Whether the fused path is on: ``ATTN_TILED_COMPILE=0|1``, read at each call."""
    flag = os.environ.get("ATTN_TILED_COMPILE", "1" if FUSED_DEFAULT else "0").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"ATTN_TILED_COMPILE must be 0 or 1, got {flag!r}")
    return flag == "1"


# Chosen by measurement (benchmarks/results/cpu/, README "CPU speed").
FUSED_DEFAULT = False


def fused_path_reason(device: torch.device | str) -> str:
    """Which tiled path a call on ``device`` will try, for :func:`attn.select_backend`: the
    per-tile steps (eager or compiled) and the GEMM engine."""
    if torch.device(device).type != "cpu":
        return "eager tiled steps (the fused path is CPU only)"
    if not fused_cpu_default():
        steps = "eager tiled steps (ATTN_TILED_COMPILE=0)"
    elif _FUSED_FAILED is not None:
        steps = f"eager tiled steps (the fused path failed earlier: {_FUSED_FAILED})"
    else:
        return "fused CPU steps (torch.compile, ATTN_TILED_COMPILE=1); GEMMs: torch.bmm"
    if torch.compiler.is_compiling():  # traced into a graph: no worker threads, no timing
        return f"{steps}; GEMMs: torch.bmm (under torch.compile)"
    engine, why = cpu.gemm_engine()
    if engine == "onednn":
        return (f"{steps}; GEMMs: oneDNN, head by head, for large fp32 calls ({why}), "
                f"torch.bmm for the rest")
    return f"{steps}; GEMMs: torch.bmm ({why})"


def _fused_steps(q: Tensor) -> bool:
    """Whether this call's full-size tiles take the compiled steps."""
    return (q.device.type == "cpu" and _FUSED_FAILED is None and fused_cpu_default()
            and not torch.compiler.is_compiling())


def _compiled(fn: Callable, key: tuple) -> Callable:
    if key not in _COMPILED:
        # a copy of fn with its own code object: dynamo keeps its graphs per code object
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_COMPILED)}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)
        _COMPILED[key] = torch.compile(copy, dynamic=True, fullgraph=True)
    return _COMPILED[key]


def _fusable(s: Tensor) -> bool:
    """A tile with one row or one column (decoding, N ≡ 1 mod the block) stays eager: it is
    tiny, and a size-1 dim would make dynamo build one more graph."""
    return s.shape[1] > 1 and s.shape[2] > 1


def _run_fused(fn: Callable, *args):
    """``fn(*args)`` compiled, or None when compiling or running it fails: then the fused
    path is switched off with one warning and the caller runs the eager step. The compiled
    functions are functional, so a failed call changed nothing."""
    global _FUSED_FAILED
    if _FUSED_FAILED is not None:  # failed on an earlier tile of this call
        return None
    # contiguous inputs: a stride that follows N (a row slice of lse) would recompile
    args = tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)
    # what makes dynamo build another graph: tensor or None, dtype, size-1 dims, flags
    key = (fn.__name__,) + tuple(
        (a.dtype, tuple(d == 1 for d in a.shape)) if isinstance(a, Tensor) else a
        for a in args)
    try:
        if key in _COMPILED:
            return _COMPILED[key](*args)
        # first call: dynamo traces here. Without duck shaping, two dims that happen to be
        # equal on this call (BLOCK_M rows and BLOCK_N columns) get their own symbols, so a
        # ragged edge tile later does not fail a "rows == cols" guard and recompile
        from torch.fx.experimental import _config as fx_config
        with fx_config.patch(use_duck_shape=False):
            return _compiled(fn, key)(*args)
    except Exception as exc:  # no C++ compiler, an inductor error: eager is always exact
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _FUSED_FAILED = f"{type(exc).__name__}: {first}"
        warnings.warn(f"attn: the fused CPU path of the tiled backend could not run "
                      f"({_FUSED_FAILED}); using the eager tiled path for the rest of this "
                      f"process. Set ATTN_TILED_COMPILE=0 to silence this.", RuntimeWarning,
                      stacklevel=3)
        return None


@dataclasses.dataclass(frozen=True)
class SequenceBlocks(Blocks):
    """The tile plan of packed sequences: query block i is rows ``rows[i] = (m0, m1)`` with
    key tiles ``tiles[i]``, and every query and key block lies inside one sequence. So no
    tile holds two sequences' data: a NaN or inf in one sequence cannot reach another's rows
    through 0·NaN in P·V or dSᵀQ, as it would in a tile where the other sequence's keys are
    merely masked. The loops take this plan as it is (the packed call has no band of its
    own; its mask_mod holds the per-sequence band for the partial tiles)."""
    rows: tuple[tuple[int, int], ...] = ()

    def query_blocks(self):
        for (m0, m1), key_tiles in zip(self.rows, self.tiles):
            yield m0, m1, key_tiles

    def kinds(self) -> Tensor:
        raise NotImplementedError("sequence tiles are not on an aligned grid")


def _blocks(spec: LaunchSpec, n_q: int, n_k: int) -> Blocks:
    mb = spec.mask_blocks
    if isinstance(mb, SequenceBlocks):
        assert spec.local_band().is_full and not spec.sharded and (mb.n_q, mb.n_k) == (n_q, n_k)
        return mb
    return spec.blocks(n_q, n_k, spec.block_m or BLOCK_M, spec.block_n or BLOCK_N)


# Score tiles are batched over (B, heads). Past a few MiB a tile no longer stays in cache
# between the GEMM that writes it and the passes that read it: B=8, H=12, N=512 ran 19%
# faster batch row by batch row (3 MiB tiles) than as one 24 MiB tile. So the batch is cut
# into chunks whose tile fits TILE_BYTES, each run as its own call.
TILE_BYTES = 4 << 20


class _Chunk(NamedTuple):
    """Batch rows [b0, b1) and KV heads [h0, h1) of a call, run as a call of its own. The
    slicing methods take each argument of the whole call to this chunk's part (a tensor
    broadcast along a dim keeps it); the spec becomes a head shard, so the dropout hash and
    ALiBi see global heads."""
    b0: int
    b1: int
    h0: int
    h1: int
    B: int  # the whole call's
    H: int
    Hkv: int

    @property
    def heads(self) -> slice:  # its query heads
        G = self.H // self.Hkv
        return slice(self.h0 * G, self.h1 * G)

    @property
    def whole(self) -> bool:
        return (self.b0, self.b1, self.h0, self.h1) == (0, self.B, 0, self.Hkv)

    def bh(self, x: Tensor | None) -> Tensor | None:  # (B, H, ...): q, out, lse, do, dq
        return x if x is None or self.whole else x[self.b0:self.b1, self.heads]

    def kv(self, x: Tensor | None) -> Tensor | None:  # (B, Hkv, ...): k, v, dk, dv
        return x if x is None or self.whole else x[self.b0:self.b1, self.h0:self.h1]

    def head_vec(self, x: Tensor | None) -> Tensor | None:  # sinks, softcap: (H,)
        if x is None or (self.h0, self.h1) == (0, self.Hkv):
            return x
        return x.reshape(-1).expand(self.H)[self.heads]

    def mask_index(self, mask4: Tensor) -> tuple[slice, slice]:
        """This chunk's (batch, head) slices of a mask broadcastable to (B, H, Nq, Nk)."""
        rows = slice(self.b0, self.b1) if mask4.shape[0] == self.B else slice(None)
        heads = self.heads if mask4.shape[1] == self.H else slice(None)
        return rows, heads

    def mask(self, mask: Tensor | None) -> Tensor | None:
        if mask is None or self.whole:
            return mask
        m4 = as_4d(mask)
        return m4[self.mask_index(m4)]

    def alibi(self, alibi: Tensor | None, packed: bool) -> Tensor | None:
        """(B, H) slopes; packed, (sequences, H): per sequence, so every row's."""
        if alibi is None or self.whole:
            return alibi
        return alibi[:, self.heads] if packed else alibi[self.b0:self.b1, self.heads]

    def spec(self, spec: LaunchSpec) -> LaunchSpec:
        if (self.h0, self.h1) == (0, self.Hkv):
            return spec
        return spec.shard(head_start=self.heads.start, heads_total=spec.heads_total or self.H)


class _Plan(NamedTuple):
    chunks: list[_Chunk]
    engine: str  # "onednn": one unit per chunk, 2-D oneDNN GEMMs; "bmm": batched
    spec: LaunchSpec  # with the unit path's tile sizes where it runs
    parallel: bool = False  # the chunks run on the worker threads (attn.cpu.run_units)


def _plan(q: Tensor, k: Tensor, spec: LaunchSpec, v: Tensor | None = None) -> _Plan:
    """How a call runs: as units on the oneDNN engine where :func:`_unit_path` allows,
    else batched, in batch chunks whose score tile fits :data:`TILE_BYTES`."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    unit, _, uspec, scores = _unit_path(q, k, spec)
    if unit:
        units = [_Chunk(b, b + 1, h, h + 1, B, H, Hkv) for b in range(B) for h in range(Hkv)]
        return _Plan(units, "onednn", uspec, parallel=scores >= POOL_MIN_SCORES)
    if B == 1 or spec.score_mod is not None or spec.mask_mod is not None \
            or spec.dropout_rows is not None:
        return _Plan([_Chunk(0, B, 0, Hkv, B, H, Hkv)], "bmm", spec)
    per_row = (H * min(spec.block_m or BLOCK_M, Nq) * min(spec.block_n or BLOCK_N, Nk)
               * torch.finfo(_acc_dtype(q.dtype)).bits // 8)
    step = max(1, TILE_BYTES // per_row)
    if not (_heads_merge(k) and (v is None or _heads_merge(v))):
        # k / v seen head-first from a (B, N, Hkv, D) cache: (B·Hkv, N, D) would be a copy of
        # the whole cache, one batch row's (Hkv, N, D) is a view
        step = 1
    return _Plan([_Chunk(b, min(b + step, B), 0, Hkv, B, H, Hkv) for b in range(0, B, step)],
                 "bmm", spec)


def _heads_merge(x: Tensor) -> bool:
    """Whether ``x (B, Hkv, N, D)`` has a ``(B·Hkv, N, D)`` view (no copy)."""
    return x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1)


def _unit_path(q: Tensor, k: Tensor, spec: LaunchSpec
               ) -> tuple[bool, str, LaunchSpec, int]:
    """Whether a call runs as units on the oneDNN engine, why (not), the spec with the unit
    tile sizes, and the scores it visits (B·H·Nq·Nk inside the band)."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    tile_rows = (UNIT_ROWS_FULL if spec.band.is_full and G * Nq >= UNIT_ROWS_FULL_MIN_Q
                 else UNIT_ROWS)
    uspec = dataclasses.replace(spec, block_m=spec.block_m or max(1, tile_rows // G),
                                block_n=spec.block_n or UNIT_BLOCK_N)

    def no(why: str) -> tuple[bool, str, LaunchSpec, int]:
        return False, why, spec, 0
    if q.device.type != "cpu":
        return no("not on CPU")
    if _acc_dtype(q.dtype) != torch.float32:
        return no("float64 stays on bmm")
    if spec.score_mod is not None or spec.mask_mod is not None or spec.mask_blocks is not None:
        return no("score_mod / mask_mod run batched")
    if spec.dropout_rows is not None or spec.alibi_rows is not None:
        return no("packed sequences run batched")
    if fused_cpu_default():
        return no("ATTN_TILED_COMPILE=1 compiles the batched steps")
    if torch.compiler.is_compiling():
        return no("under torch.compile")
    rows = G * min(Nq, uspec.block_m)
    if rows < UNIT_MIN_ROWS or Nk < UNIT_MIN_KEYS:
        return no(f"{rows} query rows x {Nk} keys per tile is below the unit path's "
                  f"{UNIT_MIN_ROWS} x {UNIT_MIN_KEYS}")
    visited = partial = area = 0
    for m0, m1, key_tiles in _blocks(uspec, Nq, Nk).query_blocks():
        for n0, n1, full in key_tiles:
            visited += 1
            partial += not full
            area += (m1 - m0) * (n1 - n0)
    if visited == 0 or partial > UNIT_MAX_PARTIAL * visited:
        return no(f"{partial} of {visited} unit tiles are partly masked")
    engine, why = cpu.gemm_engine()
    if engine != "onednn":
        return no(why)
    return True, why, uspec, B * H * area


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, attn_mask: Tensor | None = None,
         sinks: Tensor | None = None, softcap: Tensor | None = None,
         alibi: Tensor | None = None, *, want_lse2: bool = False
         ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """``(out, lse)``, and with ``want_lse2`` also ``lse2 (B, H, Nq, 2)``: each row's base-2
    max m and log2 of its denominator l, the exact row constant the backward subtracts in
    two parts (pass it to :func:`_bwd` as ``lse2``). Rows with no key: (-inf, 0)."""
    B, H, Nq, _ = q.shape
    acc_dtype = _acc_dtype(q.dtype)
    out = torch.empty(B, H, Nq, v.shape[-1], dtype=v.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc_dtype, device=q.device)
    lse2 = torch.empty(B, H, Nq, 2, dtype=acc_dtype, device=q.device)  # (m, log2 l)
    plan = _plan(q, k, spec, v)
    packed = spec.alibi_rows is not None

    def run(c: _Chunk) -> None:  # each chunk writes its part of the outputs
        _fwd_rows(c.bh(q), c.kv(k), c.kv(v), c.spec(plan.spec), c.mask(attn_mask),
                  c.head_vec(sinks), c.head_vec(softcap), c.alibi(alibi, packed), c.bh(out),
                  c.bh(lse), c.bh(lse2), b0=c.b0, engine=plan.engine)

    cpu.run_units(run, plan.chunks, parallel=plan.parallel)
    return (out, lse, lse2) if want_lse2 else (out, lse)


def _fwd_rows(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, attn_mask: Tensor | None,
              sinks: Tensor | None, softcap: Tensor | None, alibi: Tensor | None, out: Tensor,
              lse: Tensor, lse2: Tensor, b0: int = 0, engine: str = "bmm") -> None:
    """The forward of one chunk, into ``out``, ``lse``, ``lse2`` (its views of the call's;
    ``b0``: its first batch row's index in the call; ``engine``: the plan's)."""
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    tile = _Tile(q, k, v, spec, attn_mask, softcap, alibi, b0=b0, engine=engine)
    sink_rows = None  # in base-2 units, like m_i
    if sinks is not None:
        sink_rows = (sinks.to(acc_dtype) * LOG2E).view(1, H, 1).expand(B, H, Nq)
    # a finite "-inf" start keeps exp(m_i - m_new) and exp(s - m_new) free of inf - inf
    lowest = torch.finfo(acc_dtype).min
    blocks = _blocks(spec, Nq, Nk)
    fused = _fused_steps(q) and engine == "bmm"
    tile.values_may_overflow = _values_may_overflow(v, Nk)

    for m0, m1, key_tiles in blocks.query_blocks():
        rows = (B * Hkv, G * (m1 - m0), 1)
        # -- init: the sink, when present, is the first "key" of every row --
        if sink_rows is None:
            m_i = torch.full(rows, lowest, dtype=acc_dtype, device=q.device)
            l_i = torch.zeros(rows, dtype=acc_dtype, device=q.device)
        else:
            m_i = tile.rows(sink_rows, m0, m1).clone()
            l_i = torch.ones(rows, dtype=acc_dtype, device=q.device)
        acc = torch.zeros(rows[:2] + (Dv,), dtype=acc_dtype, device=q.device)
        if key_tiles:
            q_blk = tile.q_block(m0, m1)
        for n0, n1, full in key_tiles:
            s, _, _ = tile.scores(q_blk, m0, m1, n0, n1, full)
            z = tile.dropout_scale(m0, m1, n0, n1) if spec.dropout_p > 0.0 else None
            c = tile.value_offset(n0, n1)
            step = (_run_fused(_fwd_tile_fused, m_i, l_i, s, z)
                    if fused and c is None and _fusable(s) else None)
            p, m_i, l_i, alpha = step if step is not None else _fwd_tile(m_i, l_i, s, z, c)
            tile.add_pv(acc.mul_(alpha), p, n0, n1)
        # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
        seen = l_i > 0
        out[:, :, m0:m1] = (acc / torch.where(seen, l_i, 1.0)).view(B, H, m1 - m0, Dv)
        lse2[:, :, m0:m1, 0] = torch.where(seen, m_i, float("-inf")).view(B, H, -1)
        lse2[:, :, m0:m1, 1] = torch.where(seen, torch.log2(l_i), 0.0).view(B, H, -1)
    torch.mul(lse2.sum(-1), LN2, out=lse)


def _softmax_delta(tile: _Tile, q_blk: Tensor, do_blk: Tensor, lse_blk: Tensor, m0: int,
                   m1: int, key_tiles) -> Tensor:
    """``Σ_j p_ij dp_ij`` over a query block's tiles, ``(B·Hkv, G·BM, 1)``: p = exp2(s − m)
    and dp = ``do_blk`` Vᵀ (dropout-scaled) exactly as the backward's tile loop forms them,
    so a saturated row's dS = p∘(dp − Δ) is 0 where its exact value rounds to 0."""
    spec = tile.spec
    delta = torch.zeros(do_blk.shape[:2] + (1,), dtype=tile.acc_dtype, device=do_blk.device)
    for n0, n1, full in key_tiles:
        s, _, _ = tile.scores(q_blk, m0, m1, n0, n1, full)
        p = s.sub_(lse_blk).exp2_()
        dp = tile.dp(do_blk, n0, n1)
        if spec.dropout_p > 0.0:
            dp = dp * tile.dropout_scale(m0, m1, n0, n1)
        delta += (p * dp).sum(dim=-1, keepdim=True)
    return delta


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, attn_mask: Tensor | None = None,
         sinks: Tensor | None = None, softcap: Tensor | None = None, *,
         need_dmask: bool = False, need_dcap: bool = True,
         captured: tuple[Tensor, ...] = (), alibi: Tensor | None = None,
         lse2: Tensor | None = None) -> Grads:
    """Gradients of one call (chunk by chunk, as :func:`_plan` cuts it): dq, dk,
    dv always; the float mask's only with ``need_dmask`` (an N x N tensor when the mask
    is), sinks' when given, the learnable softcap's when given and ``need_dcap``, and those
    of the tensors ``captured`` by ``spec.score_mod`` (summed tile by tile in a fixed order:
    deterministic, no atomics). ``alibi``: the slopes, constants (none of their own
    gradient). ``lse2``: the forward's two-part base-2 lse (``_fwd(want_lse2=True)``);
    without it ``lse·log2 e`` stands in, exact up to its rounding."""
    plan = _plan(q, k, spec, v)
    packed = spec.alibi_rows is not None
    kw = dict(need_dmask=need_dmask, need_dcap=need_dcap, engine=plan.engine)
    if len(plan.chunks) == 1:
        return _bwd_rows(do, dlse, q, k, v, out, lse, plan.chunks[0].spec(plan.spec),
                         attn_mask, sinks, softcap, captured=captured, alibi=alibi, lse2=lse2,
                         **kw)
    B, H, Nq, D = q.shape
    acc_dtype = _acc_dtype(q.dtype)
    # each chunk accumulates into its part of dq, dk, dv: no copies to join them
    into = (torch.zeros(B, H, Nq, D, dtype=acc_dtype, device=q.device),
            torch.zeros(k.shape[:3] + (D,), dtype=acc_dtype, device=q.device),
            torch.zeros(v.shape, dtype=acc_dtype, device=q.device))
    parts: list[Grads | None] = [None] * len(plan.chunks)

    def run(i: int) -> None:
        c = plan.chunks[i]
        parts[i] = _bwd_rows(c.bh(do), c.bh(dlse), c.bh(q), c.kv(k), c.kv(v), c.bh(out),
                             c.bh(lse), c.spec(plan.spec), c.mask(attn_mask),
                             c.head_vec(sinks), c.head_vec(softcap),
                             alibi=c.alibi(alibi, packed), lse2=c.bh(lse2), b0=c.b0,
                             into=(c.bh(into[0]), c.kv(into[1]), c.kv(into[2])), **kw)

    cpu.run_units(run, range(len(plan.chunks)), parallel=plan.parallel)
    # the per-head and mask gradients: each chunk's into its slice, in chunk order
    dmask = dsinks = dsoftcap = None
    if need_dmask:
        dmask = torch.zeros(as_4d(attn_mask).shape, dtype=acc_dtype, device=q.device)
    if sinks is not None:
        dsinks = torch.zeros(H, dtype=acc_dtype, device=q.device)
    if parts[0].dsoftcap is not None:
        dsoftcap = torch.zeros(H, dtype=acc_dtype, device=q.device)
    for c, g in zip(plan.chunks, parts):
        if dmask is not None:
            dmask[c.mask_index(dmask)] += g.dmask
        if dsinks is not None:
            dsinks[c.heads] += g.dsinks
        if dsoftcap is not None:
            dsoftcap[c.heads] += g.dsoftcap
    return Grads(*into, dmask, dsinks, dsoftcap, ())


def _bwd_rows(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
              lse: Tensor, spec: LaunchSpec, attn_mask: Tensor | None = None,
              sinks: Tensor | None = None, softcap: Tensor | None = None, *,
              need_dmask: bool = False, need_dcap: bool = True,
              captured: tuple[Tensor, ...] = (), alibi: Tensor | None = None,
              lse2: Tensor | None = None, b0: int = 0,
              into: tuple[Tensor, Tensor, Tensor] | None = None, engine: str = "bmm") -> Grads:
    """:func:`_bwd` of one chunk (``b0``: its first batch row's index in the call; ``into``:
    zeroed (dq, dk, dv) views of its part to accumulate into; ``engine``: the plan's)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    tile = _Tile(q, k, v, spec, attn_mask, softcap, alibi, b0=b0, engine=engine)
    tile.keys_major = tile.onednn
    if not tile.finite_scores:
        # a masked key has dS = 0, but 0·NaN in dS K would still reach dQ: a non-finite key
        # enters dQ as 0 (a row that sees it has NaN dS anyway)
        tile.k3_dq = _finite_or_zero(tile.k3)
    blocks = _blocks(spec, Nq, Nk)
    if into is None:
        into = (torch.zeros(B, H, Nq, D, dtype=acc_dtype, device=q.device),
                torch.zeros(B, Hkv, Nk, D, dtype=acc_dtype, device=q.device),
                torch.zeros(B, Hkv, Nk, Dv, dtype=acc_dtype, device=q.device))
    dq = into[0]
    dk3, dv3 = into[1].view(B * Hkv, Nk, D), into[2].view(B * Hkv, Nk, Dv)  # row slices: views
    dsoftcap = None
    if softcap is not None and need_dcap:
        dsoftcap = torch.zeros(H, dtype=acc_dtype, device=q.device)
    dmask = None
    if need_dmask:
        dmask = torch.zeros(as_4d(attn_mask).shape, dtype=acc_dtype, device=q.device)
    # Δ = rowsum(dO ∘ O) − dlse: the lse output's gradient joins dS as dlse_i · P_ij
    delta = (do.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # (B, H, Nq)
    if dlse is not None:
        delta = delta - dlse.to(acc_dtype)
    if lse2 is None:  # the natural lse alone: exact up to its rounding
        lse_m, inv_l = lse.to(acc_dtype) * LOG2E, None
    else:
        # P = exp2(s - m) / l: the tiles subtract m alone, and 1/l scales each row of dO and
        # Δ instead (dV = Σ P dO and dS = P∘(dP − Δ) are linear in both), so the second
        # part costs a (rows, D) multiply per query block, not a pass over every tile
        lse_m, inv_l = lse2[..., 0], torch.exp2(-lse2[..., 1])
    lse_m = lse_m.masked_fill(lse_m == float("-inf"), float("inf"))  # P = 0 on empty rows
    # query blocks holding a saturated row (l within SATURATED_LOG2L of 1) take Δ from the
    # tiles themselves (one host read of a (Nq,) flag per call). Rows the forward gave a
    # value offset (l scaled by 2^-c, _Tile.value_offset) read as saturated too: exact, one
    # more pass, and only at |v| near the dtype's largest
    saturated = None
    # (a data-dependent branch: skipped while torch.compile traces, as the value checks are)
    if lse2 is not None and Nq > 0 and not torch.compiler.is_compiling():
        saturated = (lse2[..., 1] < SATURATED_LOG2L).flatten(0, 1).any(0).cpu()
    track = spec.score_mod is not None
    dcaptured: list[Tensor | None] = [None] * len(captured)
    fused = _fused_steps(q) and engine == "bmm"

    for m0, m1, key_tiles in blocks.query_blocks():
        if not key_tiles:
            continue
        BM = m1 - m0
        q_blk = tile.q_block(m0, m1)  # (B·Hkv, G·BM, D)
        do_blk = do[:, :, m0:m1].to(acc_dtype).reshape(B * Hkv, G * BM, Dv)
        lse_blk = tile.rows(lse_m, m0, m1)
        delta_blk = tile.rows(delta, m0, m1)
        if inv_l is not None:  # dO/l and Δ/l: the dP GEMM then yields dP/l
            inv_l_blk = tile.rows(inv_l, m0, m1)
            do_blk, delta_blk = do_blk * inv_l_blk, delta_blk * inv_l_blk
            if saturated is not None and bool(saturated[m0:m1].any()):
                delta_blk = _softmax_delta(tile, q_blk, do_blk, lse_blk, m0, m1, key_tiles)
                delta_blk.mul_(inv_l_blk)
                if dlse is not None:
                    delta_blk.sub_(tile.rows(dlse.to(acc_dtype), m0, m1) * inv_l_blk)
        dq_blk = torch.zeros(B * Hkv, G * BM, D, dtype=acc_dtype, device=q.device)
        for n0, n1, full in key_tiles:
            BN = n1 - n0
            s, u, t = tile.scores(q_blk, m0, m1, n0, n1, full, track=track)
            z = tile.dropout_scale(m0, m1, n0, n1) if spec.dropout_p > 0.0 else None
            dp = tile.dp(do_blk, n0, n1)
            step = None
            if fused and _fusable(s):
                step = _run_fused(_bwd_tile_fused, s, dp, u, t, lse_blk, delta_blk, z,
                                  dsoftcap is not None)
            if step is None:
                step = _bwd_tile(s, u, t, lse_blk, delta_blk, dp, z, dsoftcap is not None)
            pd, ds, ds_raw, dc_terms = step
            # -- dV += Pᵈᵀ dO (Pᵀ sums over the GQA group) --
            tile.add_tn(dv3[:, n0:n1], pd, do_blk, "dv")
            if dmask is not None:
                rows = slice(m0, m1) if dmask.shape[2] != 1 else slice(None)
                cols = slice(n0, n1) if dmask.shape[3] != 1 else slice(None)
                dmask[:, :, rows, cols] += _reduce_to(ds.view(B, H, BM, BN), dmask.shape)
            if dsoftcap is not None:
                dsoftcap += dc_terms.view(B, Hkv, G, BM, BN).sum(dim=(0, 3, 4)).reshape(H)
            if track:  # -- the score_mod's backward, by autograd on this tile's graph --
                ds_raw, dcap_t = tile.score_mod_vjp(ds_raw, captured)
                for i, g in enumerate(dcap_t):
                    if g is not None:
                        dcaptured[i] = g if dcaptured[i] is None else dcaptured[i] + g
            # -- dQ += dS K, dK += dSᵀ Q (q_blk carries the scale; dQ gets it at the end) --
            tile.add_dq(dq_blk, ds_raw, n0, n1)
            tile.add_tn(dk3[:, n0:n1], ds_raw, q_blk, "dk")
        dq[:, :, m0:m1] = dq_blk.view(B, H, BM, D) * spec.qk_scale

    if tile.fold_log2:  # q_blk carried log2 e: dK = Σ dSᵀ q·scale needs it taken out
        dk3.mul_(LN2)
    dsinks = None if sinks is None else sink_grad(sinks, lse.to(acc_dtype), delta)
    return Grads(dq, dk3.view(B, Hkv, Nk, D), dv3.view(B, Hkv, Nk, Dv), dmask, dsinks,
                 dsoftcap, tuple(dcaptured))


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, softcap, alibi, spec: LaunchSpec, *captured):
        out, lse, lse2 = _fwd(q, k, v, spec, attn_mask, sinks, softcap, alibi, want_lse2=True)
        # the captured tensors are not saved: the score_mod reads them itself in backward
        ctx.save_for_backward(q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi)
        ctx.spec, ctx.captured = spec, captured
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi = ctx.saved_tensors
        need_dmask = bool(ctx.needs_input_grad[3])
        do = torch.zeros_like(out) if dout is None else dout.contiguous()  # only lse was used
        g = _bwd(do, dlse, q, k, v, out, lse, ctx.spec, attn_mask, sinks, softcap,
                 need_dmask=need_dmask, need_dcap=bool(ctx.needs_input_grad[5]),
                 captured=ctx.captured, alibi=alibi, lse2=lse2)
        dmask = None if g.dmask is None else g.dmask.reshape(attn_mask.shape).to(attn_mask.dtype)
        dsinks = None if g.dsinks is None else g.dsinks.to(sinks.dtype)
        dsoftcap = None
        if g.dsoftcap is not None:
            dsoftcap = _reduce_to(g.dsoftcap, softcap.shape).to(softcap.dtype)
        dcaptured = tuple(None if d is None else d.to(c.dtype)
                          for d, c in zip(g.dcaptured, ctx.captured))
        return (g.dq.to(q.dtype), g.dk.to(k.dtype), g.dv.to(v.dtype), dmask, dsinks, dsoftcap,
                None, None, *dcaptured)


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: LaunchSpec,
    *,
    attn_mask: Tensor | None = None,
    softcap: Tensor | None = None,
    sinks: Tensor | None = None,
    captured: tuple[Tensor, ...] = (),
    alibi: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Memory-linear exact attention. Inputs already validated by ``attn.api``.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv) in v's dtype,
    lse (B, H, Nq) in float32 (float64 for float64 inputs). ``spec`` holds the static
    values (q·k scale, band, fixed softcap, dropout, global positions, block sizes; a tensor
    temperature must already be folded into q); ``softcap`` a learnable tensor
    broadcastable to (H,), ``sinks`` (H,), ``alibi`` the ALiBi slopes (B, H) (packed:
    (sequences, H) with ``spec.alibi_rows``), constants. Block sizes default to the module's
    ``BLOCK_M`` / ``BLOCK_N``, read at call time; a callable ``spec.mask_blocks`` (see
    :func:`attn.mods.mod_spec`) is called here at those sizes. ``captured``: the tensors
    ``spec.score_mod`` reads that need a gradient (see :func:`attn.mods.captured_tensors`).
    """
    if callable(spec.mask_blocks):  # a mask's tiles, classified at this backend's tile sizes
        mb = spec.mask_blocks(spec.block_m or BLOCK_M, spec.block_n or BLOCK_N)
        spec = dataclasses.replace(spec, block_m=mb.block_m, block_n=mb.block_n, mask_blocks=mb)
    return _TiledAttention.apply(q, k, v, attn_mask, sinks, softcap, alibi, spec, *captured)
