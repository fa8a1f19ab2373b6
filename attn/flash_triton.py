"""Fused attention in Triton: the tiled algorithm of ``tiled.py`` as GPU kernels.

Forward: one program per (query block, batch·head). The q tile stays in registers while the
program walks the key blocks its band allows, keeping the online-softmax state per row —
running max ``m_i``, running denominator ``l_i``, rescaled accumulator ``acc`` — and stores
the log-sum-exp for the backward. Backward (FlashAttention-2): ``Δ = rowsum(dO ∘ O) − dlse``
(preprocess kernel; query blocks holding a saturated softmax row take Δ = Σ P·dP / Σ P
from a Δ pass of the dQ kernel instead, see ``_delta_inner``), then dK/dV with the key block resident, looping over the query blocks
and over the heads of its GQA group (so dK/dV are summed over the group without atomics),
and dQ with the query block resident, looping over key blocks. Every program writes its own
output tile once: the backward is deterministic, there is no ``deterministic`` switch to get
wrong.

Each band (causal, window) splits a block's walk into at most three stages: masked tiles at
the start, full tiles in the middle (no mask arithmetic at all), masked tiles at the end;
tiles outside the band are never visited.

Three layers, as in ``tiled.py``: ``_fwd`` / ``_bwd`` launchers (registered as
``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces
through them), one ``torch.autograd.Function``, and the public :func:`triton_attention`.

Runs on CUDA; on CPU only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how the default test suite checks the kernels.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn.grads import SATURATED_LOG2L, Grads, sink_grad
from attn.masks import Band, as_4d
from attn.spec import LaunchSpec

# Triton decides interpreter vs compiler when a kernel is decorated, i.e. at import.
_INTERPRET = bool(triton.knobs.runtime.interpret)


def _interpreter_scalars_fix() -> None:
    """Let the interpreter of triton <= 3.6 use runtime scalars as ``range`` bounds on numpy >= 2.4.

    The interpreter holds every scalar (a kernel argument, ``tl.maximum(a, b)``) as a
    1-element array and gives ``tl.tensor`` an ``__index__`` of ``int(data)``; numpy 2.4
    stopped converting 1-element arrays that way, so every ``tl.range(lo, hi)`` with runtime
    bounds raised TypeError. Newer triton squeezes first; do the same here. No kernel code
    can avoid it (a kernel argument used directly as a bound fails too), and the compiled
    path never runs this.
    """
    import numpy as np
    import triton.runtime.interpreter as interp

    try:
        int(np.ones(1))
        return  # this numpy still converts 1-element arrays
    except TypeError:
        pass
    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_attn_squeezes", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)  # then the same __index__ as newer triton's
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    _patch_lang_tensor._attn_squeezes = True
    interp._patch_lang_tensor = _patch_lang_tensor


if _INTERPRET:
    _interpreter_scalars_fix()
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_UNBOUNDED = 1 << 30  # an open band side: farther than any key is from any query
# The interpreter's tl.dot multiplies bfloat16 tiles as their raw uint16 bits: feed it float64
# (exact products of 16- and 32-bit floats, see _dot).
_DOT_UPCAST = tl.constexpr(_INTERPRET)
# A row whose denominator l (relative to its max, natural log) is within this of 1: its
# softmax is saturated (one P ≈ 1) and the backward takes Δ = Σ P·dP (see _delta_inner)
_SATURATED_LOGL = tl.constexpr(SATURATED_LOG2L * 0.6931471805599453)


def unsupported_reason(call) -> str | None:
    """Why the triton backend cannot compute ``call`` (an ``attn.call.AttentionCall``), or None."""
    if call.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton needs CUDA (on CPU only in the interpreter, TRITON_INTERPRET=1)"
        if not _INTERPRET:
            return ("TRITON_INTERPRET=1 was set after attn.flash_triton was imported; "
                    "set it before the import to run the kernels on CPU")
    elif call.device != "cuda":
        return f"triton runs on CUDA, not {call.device}"
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (the kernels take float16, bfloat16 and float32)"
    if max(call.head_dim, call.head_dim_v) > _MAX_HEAD_DIM:
        return (f"head dim {call.head_dim}/{call.head_dim_v} > {_MAX_HEAD_DIM} "
                f"(q·k and acc tiles would not fit in registers)")
    if call.mask_grad:
        return "a gradient for a float attn_mask (dS would have to be written out N x N)"
    return None


# -- autotuning ----------------------------------------------------------------------------

def _configs(kind: str) -> list[triton.Config]:
    """BLOCK_M (queries) x BLOCK_N (keys) x warps x stages for one kernel kind."""
    if _INTERPRET:
        # one config, so nothing is benchmarked; the interpreter's cost is per tile, so tiles
        # as large as still give several (and unequal) tiles per row at the test sizes
        bm, bn = (32, 64) if kind == "dkdv" else (64, 32)
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    if kind == "fwd":
        blocks = [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]
    elif kind == "dkdv":  # the key block is resident: keep it large, stream small query tiles
        blocks = [(16, 64), (32, 64), (32, 128), (64, 64), (64, 128)]
    else:  # dq: the query block is resident
        blocks = [(64, 16), (64, 32), (128, 32), (64, 64), (128, 64)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn in blocks for w in (4, 8) for s in (2, 3, 4)]


_THIS_DEVICE = object()


def _prune(configs: list[triton.Config], named_args: dict, *, kind: str,
           arch: int | None | object = _THIS_DEVICE, **kwargs) -> list[triton.Config]:
    """The autotuner's pruning hook; ``arch`` (a compute capability) defaults to the
    current device's, and is given explicitly by the ahead-of-time compile checks."""
    if arch is _THIS_DEVICE:
        arch = _device_arch()
    return prune_for(configs, {**named_args, **kwargs}, kind=kind, arch=arch)


def _device_arch() -> int | None:
    if _INTERPRET or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


# opt-in shared memory per block by compute capability (sm_86/89 and unknown archs: 99 KiB)
_SMEM_BYTES = {80: 163 * 1024, 87: 163 * 1024, 90: 227 * 1024}


def smem_estimate(kind: str, c: triton.Config, args: dict) -> int:
    """Bytes of shared memory a config needs: the resident tiles, plus one buffer per stage
    of every streamed tile (K/V for fwd and dQ; Q/dO, lse and Δ for dK/dV; the mask tile).
    An upper bound of what triton allocates (checked by tests/test_triton_compile.py against
    the compiler's own figure): sm_90 keeps every stage in shared memory, sm_80 one fewer."""
    bm, bn, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages
    d, dv = args["BLOCK_D"], args["BLOCK_DV"]
    elem = args["Q"].element_size() if hasattr(args.get("Q"), "element_size") else 2
    mask = {0: 0, 1: 1, 2: 4}[args.get("MASK_KIND", 0)] * bm * bn
    if kind == "fwd":
        resident, streamed = bm * d * elem, bn * (d + dv) * elem + mask
    elif kind == "dkdv":
        resident, streamed = bn * (d + dv) * elem, bm * (d + dv) * elem + mask + 8 * bm
    else:  # dq
        resident, streamed = bm * (d + dv) * elem, bn * (d + dv) * elem + mask
    return resident + s * streamed + 1024  # + reduction and layout-conversion scratch


def _spills_heavily(kind: str, c: triton.Config, d: int) -> bool:
    """Configs that ptxas spills more than ~1 KiB of registers per thread for, on sm_90 and
    sm_80 alike (255 registers each): 4 warps holding a 128 x D (>= 128) accumulator in the
    query-resident kernels or a 64 x 128 one in dK/dV, and dK/dV tiles with
    BLOCK_M·BLOCK_N·D past 64·64·128 (at that size, deep pipelines). Measured with
    ``attn bench compile`` (benchmarks/results/compile-sm90); the slow compile test builds
    every config this keeps."""
    bm, bn, w, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    if kind in ("fwd", "dq"):
        return w == 4 and bm * d >= 128 * 128
    tile = bm * bn * d / (64 * 64 * 128)
    return (w == 4 and bn * d >= 64 * 128) or tile > 1 or (tile == 1 and s > (2 if d >= 256 else 3))


def prune_for(configs: list[triton.Config], args: dict, *, kind: str, arch: int | None
              ) -> list[triton.Config]:
    """The autotune configs worth timing for a ``kind`` ("fwd", "dkdv", "dq") launch with
    ``args`` on compute capability ``arch`` (90 for sm_90; None when unknown): drop tiles
    longer than the sequence, configs whose shared memory does not fit the arch, and tiles
    x warps that spill registers heavily (measured: benchmarks/results/compile-sm90)."""
    n, d = args["TUNE_N"], max(args["BLOCK_D"], args["BLOCK_DV"])
    smem = None if arch is None else _SMEM_BYTES.get(arch, 99 * 1024)
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if min(bm, bn) > 16 and max(bm, bn) > n:
            continue
        if smem is not None and smem_estimate(kind, c, args) > smem:
            continue
        if _spills_heavily(kind, c, d):
            continue
        if d >= 256 and (bm * bn > 64 * 64 or c.num_stages > 2):
            continue
        if d >= 128 and bm * bn >= 128 * 128 and c.num_warps < 8:
            continue
        if max(bm, bn) <= 32 and c.num_warps > 4:
            continue
        kept.append(c)
    return kept or configs[:1]


def _tune_n(n_q: int, n_k: int) -> int:
    # the autotune key: lengths rounded to a power of two, so varying lengths do not retune
    return triton.next_power_of_2(max(n_q, n_k))


# -- device helpers ------------------------------------------------------------------------

@triton.jit
def _mix32(x):
    # "lowbias32" integer mixer on uint32, bit-identical to attn.masks._mix32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _tanh(x):
    # libdevice has no interpreter path, and tanh.approx is too coarse for float32 tests:
    # an odd polynomial near 0 (Cephes tanhf), the exp form where it does not cancel
    a = tl.abs(x)
    z = x * x
    poly = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
             + 1.33314422036e-1) * z - 3.33332819422e-1) * z * x + x
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(x < 0.0, -big, big)
    return tl.where(a < 0.625, poly, big)


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if _DOT_UPCAST:
        # float64 products and sums, rounded once: the result no longer depends on the
        # host BLAS's summation order for each layout, so the backward's transposed k·qᵀ
        # reproduces the forward's q·kᵀ (at logits of 1e4 an ulp of s moves P by 1e-3;
        # whether a GPU's two dot layouts round alike is for the CUDA tests to show)
        d = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
        return d if acc is None else acc + d
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _load(ptrs, ok_a, ok_b, CHECK_A: tl.constexpr, CHECK_B: tl.constexpr):
    """Load a tile, bounds-checking only the axes that may run past the tensor."""
    if CHECK_A:
        if CHECK_B:
            x = tl.load(ptrs, mask=ok_a & ok_b, other=0.0)
        else:
            x = tl.load(ptrs, mask=ok_a, other=0.0)
    else:
        if CHECK_B:
            x = tl.load(ptrs, mask=ok_b, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _stages(start, n_own, n_other, offset, left, right,
            BLOCK_OWN: tl.constexpr, BLOCK: tl.constexpr):
    """Split the other axis for the own block [start, start + BLOCK_OWN) into tile starts
    [lo, a) masked, [a, b) full (every pair inside the band and the tensors), [b, hi) masked.

    Written for queries as own axis (keys j with -left <= j - (i + offset) <= right); the
    key-resident backward calls it with (offset, left, right) -> (-offset, right, left).
    """
    lo = tl.maximum(start + offset - left, 0)
    hi = tl.minimum(start + BLOCK_OWN + offset + right, n_other)
    full_lo = tl.maximum(start + BLOCK_OWN - 1 + offset - left, lo)
    full_hi = tl.minimum(start + offset + right + 1, n_other)
    lo = lo // BLOCK * BLOCK  # tiles are aligned to BLOCK from 0
    hi = tl.maximum(hi, lo)
    a = tl.minimum((full_lo + BLOCK - 1) // BLOCK * BLOCK, hi)
    b = tl.maximum(full_hi, 0) // BLOCK * BLOCK
    b = tl.minimum(tl.maximum(b, a), hi)
    # an own block running past its tensor needs the bounds mask on every tile
    b = tl.where(start + BLOCK_OWN > n_own, a, b)
    return lo, a, b, hi


@triton.jit
def _dropout_scale(DROP, om, on):
    """1/(1-p) where attn.masks.dropout_keep keeps the global position (row0 + om, col0 + on),
    else 0. ``DROP = (h_bh, threshold, inv_keep, row0, col0)`` from :func:`_drop_ctx`."""
    h_bh, drop_threshold, inv_keep, row0, col0 = DROP
    h_m = _mix32(h_bh ^ (om + row0).to(tl.uint32))
    bits = _mix32(h_m ^ _mix32((on + col0).to(tl.uint32)))
    return tl.where(bits >= drop_threshold.to(tl.uint32), inv_keep, 0.0)


@triton.jit
def _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0,
              drop_heads, drop_head0, HAS_DROPOUT: tl.constexpr):
    """One (batch, head)'s dropout context: the hash of its *global* index b·H + h (H and h
    of the whole computation: a head shard draws the unsharded mask), threshold, scale,
    and the global position of this call's first query and key."""
    h_bh = 0
    if HAS_DROPOUT:
        bh = off_b * drop_heads + drop_head0 + off_h
        h_bh = _mix32(bh.to(tl.uint32) ^ _mix32(drop_seed.to(tl.uint32)))
    return (h_bh, drop_threshold, inv_keep, drop_row0, drop_col0)


@triton.jit
def _load_rows(P, offs, STRIDES, N, DIM: tl.constexpr, BLOCK: tl.constexpr,
               MASKED: tl.constexpr):
    """A (len(offs), BLOCK) tile of rows ``offs`` of a (N, DIM) matrix."""
    stride_n, stride_d = STRIDES
    offs_d = tl.arange(0, BLOCK)
    return _load(P + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
                 offs[:, None] < N, offs_d[None, :] < DIM, MASKED, BLOCK != DIM)


@triton.jit
def _load_cols(P, offs, STRIDES, N, DIM: tl.constexpr, BLOCK: tl.constexpr,
               MASKED: tl.constexpr):
    """The same rows transposed: a (BLOCK, len(offs)) tile, ready as a dot's right operand."""
    stride_n, stride_d = STRIDES
    offs_d = tl.arange(0, BLOCK)
    return _load(P + offs[None, :] * stride_n + offs_d[:, None] * stride_d,
                 offs[None, :] < N, offs_d[:, None] < DIM, MASKED, BLOCK != DIM)


@triton.jit
def _scores(qk, om, on, MASK, cap, slope, scale, BAND,
            MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Scores of a tile from q·k: scale, softcap, ALiBi, band and attn_mask. ``om``/``on``
    are the query/key indices broadcast to the tile's layout (either orientation); ``MASK =
    (Mask, stride_mm, stride_mn)``, ``BAND = (N_Q, N_K, offset, left, right)`` in local
    positions; ``slope`` this head's ALiBi slope. With softcap also returns u = s_raw / c
    and t = tanh(u), which the backward needs (the bias, a constant, needs nothing)."""
    Mask, stride_mm, stride_mn = MASK
    N_Q, N_K, offset, left, right = BAND
    s = qk * scale
    u = s
    t = s
    if HAS_SOFTCAP:
        u = s / cap
        t = _tanh(u)
        s = cap * t
    if HAS_ALIBI:  # −slope·|distance from the band's diagonal|, after the cap
        s = s - slope * tl.abs(on - (om + offset)).to(tl.float32)
    if MASKED:
        keep = (om < N_Q) & (on < N_K)
        if BANDED:
            rel = on - (om + offset)
            keep = keep & (rel >= -left) & (rel <= right)
        s = tl.where(keep, s, float("-inf"))
    if MASK_KIND == 1:  # bool, stored as uint8: 0 = masked out
        mk = tl.load(Mask + om * stride_mm + on * stride_mn, mask=(om < N_Q) & (on < N_K),
                     other=0)
        s = tl.where(mk != 0, s, float("-inf"))
    elif MASK_KIND == 2:  # float, added; its -inf entries mask (replace: NaN + -inf is NaN)
        mv = tl.load(Mask + om * stride_mm + on * stride_mn, mask=(om < N_Q) & (on < N_K),
                     other=0.0).to(tl.float32)
        s = tl.where(mv == float("-inf"), float("-inf"), s + mv)
    return s, u, t


@triton.jit
def _qk_scores(q, K, offs_m, offs_n, cap, slope, scale, KSTR, MASK, BAND,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """The query-resident tile step shared by the forward and dQ: load Kᵀ, s = q·kᵀ, scores."""
    N_K = BAND[1]
    kT = _load_cols(K, offs_n, KSTR, N_K, HEAD_DIM, BLOCK_D, MASKED)
    qk = _dot(q, kT, None, DOT_PRECISION)
    s, u, t = _scores(qk, offs_m[:, None], offs_n[None, :], MASK, cap, slope, scale, BAND,
                      MASKED, BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI)
    return kT, s, u, t


@triton.jit
def _stage_range(STAGE: tl.constexpr, lo, a, b, hi):
    """Tile starts of stage 0 (masked edge), 1 (full middle) or 2 (masked edge)."""
    s_lo = lo
    s_hi = a
    if STAGE == 1:
        s_lo = a
        s_hi = b
    if STAGE == 2:
        s_lo = b
        s_hi = hi
    return s_lo, s_hi


# -- forward -------------------------------------------------------------------------------

@triton.jit
def _value_offset(VMax, v_log_scale, V_OFFSET: tl.constexpr):
    """The forward's exponent offset ``c >= 0`` for one (sequence, kv head), natural units.

    ``acc = Σ p·v`` with ``p <= 1`` reaches ``N_K · max|v|``, past float32's largest value
    when |v| is near it (float32, bfloat16). With ``c = log(max|v| · 2·N_K / fmax)``
    (``v_log_scale = log(2·N_K / fmax)``) added to the running max, ``p = exp(s − (m + c))
    <= e^-c`` and ``Σ p·|v| <= fmax / 2``; out = acc / l and lse = m + log l are unchanged.
    0 where that bound is not positive (every ordinary call: then bit for bit the plain
    steps), and for NaN / inf values; float16 (``V_OFFSET`` False) never needs it."""
    c = 0.0
    if V_OFFSET:
        c = tl.log(tl.load(VMax).to(tl.float32)) + v_log_scale
        c = tl.where((c > 0.0) & (c < float("inf")), c, 0.0)
    return c


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, lo, hi, offs_m, cap, slope, scale, KSTR, VSTR, MASK, BAND,
               DROP, voff, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               V_OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    N_K = BAND[1]
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- compute qk --
        kT, s, u, t = _qk_scores(q, K, offs_m, offs_n, cap, slope, scale, KSTR, MASK, BAND,
                                 HEAD_DIM, BLOCK_D, MASKED, BANDED, MASK_KIND, HAS_SOFTCAP,
                                 HAS_ALIBI, DOT_PRECISION)
        # -- online softmax (m_safe: rows that have seen nothing yet stay at 0); the value
        # offset rides on the row max (_value_offset) --
        if V_OFFSET:
            m_new = tl.maximum(m_i, tl.max(s, 1) + voff)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:  # the denominator counts every key, the values only the kept ones
            p = p * _dropout_scale(DROP, offs_m[:, None], offs_n[None, :])
        # -- update acc --
        v = _load_rows(V, offs_n, VSTR, N_K, HEAD_DIM_V, BLOCK_DV, MASKED)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="fwd")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_fwd(Q, K, V, Out, Lse, LogL, Mask, Sinks, Softcap, Alibi,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_mb, stride_mh, stride_mm, stride_mn,
              stride_ab, stride_ah,
              H, GROUP, N_Q, N_K, offset, left, right, scale,
              drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads, drop_head0,
              TUNE_N, VMax, stride_vmb, stride_vmh, v_log_scale,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SINKS: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              V_OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP  # GQA: the kv head this query head reads
    Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    Out += off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    Mask += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    BAND = (N_Q, N_K, offset, left, right)
    MASK = (Mask, stride_mm, stride_mn)
    DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0,
                     drop_heads, drop_head0, HAS_DROPOUT)

    voff = _value_offset(VMax + off_b * stride_vmb + off_hk * stride_vmh, v_log_scale,
                         V_OFFSET)
    # -- init: the sink, when present, is a first key with value 0 --
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + off_h)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    cap = 1.0
    if HAS_SOFTCAP:
        cap = tl.load(Softcap + off_h)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah)
    q = _load_rows(Q, offs_m, (stride_qm, stride_qd), N_Q, HEAD_DIM, BLOCK_D, True)

    # -- loop over key tiles: masked edge, full middle, masked edge --
    lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(3):
        s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, s_lo, s_hi, offs_m, cap, slope, scale, (stride_kn, stride_kd),
            (stride_vn, stride_vd), MASK, BAND, DROP, voff, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
            BLOCK_DV, BLOCK_N, stage != 1, BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI,
            HAS_DROPOUT, V_OFFSET, DOT_PRECISION)

    # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
    tl.store(Out + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
             out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < N_Q) & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(Lse + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)
    # log l relative to the row max (the value offset taken back): the backward's
    # saturation test, which lse alone cannot answer
    logl = tl.where(l_i == 0.0, float("inf"), tl.log(l_safe) + voff)
    tl.store(LogL + pid_bh.to(tl.int64) * N_Q + offs_m, logl, mask=offs_m < N_Q)


# -- backward ------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess(Out, DOut, DLse, Delta,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         H, N_Q, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                         HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh,
                   offs_m, (stride_om, stride_od), N_Q, HEAD_DIM_V, BLOCK_DV, True)
    do = _load_rows(DOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh,
                    offs_m, (stride_dom, stride_dod), N_Q, HEAD_DIM_V, BLOCK_DV, True)
    # -- Δ = rowsum(dO ∘ O) − dlse: the lse output's gradient joins dS as dlse_i · P_ij --
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=offs_m < N_Q, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < N_Q)


@triton.jit
def _dkdv_inner(dk, dv, dc, k, v, Q, DO, Lse, Delta, lo, hi, offs_n, cap, slope, scale, QSTR, DOSTR,
                MASK, BAND, DROP, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    # transposed tiles (keys x queries), so neither P nor dS needs a transpose
    N_Q = BAND[0]
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load_cols(Q, offs_m, QSTR, N_Q, HEAD_DIM, BLOCK_D, MASKED)
        # lse = -inf marks a row that saw nothing: +inf makes its P exactly 0
        lse = tl.load(Lse + offs_m, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        # -- recompute P from lse --
        qkT = _dot(k, qT, None, DOT_PRECISION)
        om = offs_m[None, :]
        on = offs_n[:, None]
        sT, uT, tT = _scores(qkT, om, on, MASK, cap, slope, scale, BAND, MASKED, BANDED, MASK_KIND,
                             HAS_SOFTCAP, HAS_ALIBI)
        pT = tl.exp(sT - lse[None, :])
        # -- dV += Pᵈᵀ dO, dPᵀ = V dOᵀ (ᵈ: with the dropout mask) --
        do = _load_rows(DO, offs_m, DOSTR, N_Q, HEAD_DIM_V, BLOCK_DV, MASKED)
        dpT = _dot(v, tl.trans(do), None, DOT_PRECISION)
        if HAS_DROPOUT:
            zT = _dropout_scale(DROP, om, on)
            dv = _dot((pT * zT).to(do.dtype), do, dv, DOT_PRECISION)
            dpT = dpT * zT
        else:
            dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION)
        # -- dS = P ∘ (dP − Δ) --
        delta = tl.load(Delta + offs_m, mask=offs_m < N_Q, other=0.0)
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            # s = c·tanh(u), u = s_raw/c: ds_raw = ds·(1 − t²); dc = Σ ds·(t − u(1 − t²))
            one_m_t2 = 1.0 - tT * tT
            dc += tl.sum(tl.sum(dsT * (tT - uT * one_m_t2), 1), 0)
            dsT = dsT * one_m_t2
        # -- dK += dSᵀ Q --
        dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PRECISION)
    return dk, dv, dc


@triton.autotune(configs=_configs("dkdv"), key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dkdv")},
                 reset_to_zero=["DCap"])  # configs differ in how many partial sums they write
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, Mask, Softcap, Alibi, DCap,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_mb, stride_mh, stride_mm, stride_mn,
                   stride_ab, stride_ah,
                   H, GROUP, N_Q, N_K, offset, left, right, scale,
                   drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads,
                   drop_head0, TUNE_N,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_ALIBI: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    H_KV = H // GROUP
    off_b = pid_bhk // H_KV
    off_hk = pid_bhk % H_KV
    K += off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_rows(K, offs_n, (stride_kn, stride_kd), N_K, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V, offs_n, (stride_vn, stride_vd), N_K, HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    BAND = (N_Q, N_K, offset, left, right)
    # the band seen from a key: queries i with -right <= i - (j - offset) <= left
    lo, a, b, hi = _stages(start_n, N_K, N_Q, -offset, right, left, BLOCK_N, BLOCK_M)

    # -- every query head of the GQA group adds into the same dK, dV --
    for g in range(0, GROUP):
        off_h = off_hk * GROUP + g
        bh = off_b * H + off_h
        Qh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        DOh = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        MASK = (Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh,
                stride_mm, stride_mn)
        DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0,
                         drop_col0, drop_heads, drop_head0, HAS_DROPOUT)
        cap = 1.0
        if HAS_SOFTCAP:
            cap = tl.load(Softcap + off_h)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah)
        dc = 0.0
        for stage in tl.static_range(3):
            s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
            dk, dv, dc = _dkdv_inner(
                dk, dv, dc, k, v, Qh, DOh, Lse + bh.to(tl.int64) * N_Q,
                Delta + bh.to(tl.int64) * N_Q, s_lo, s_hi, offs_n, cap, slope, scale,
                (stride_qm, stride_qd), (stride_dom, stride_dod), MASK, BAND, DROP, HEAD_DIM,
                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, stage != 1, BANDED, MASK_KIND,
                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
        if HAS_SOFTCAP:  # one partial sum per (key block, b, h); the launcher adds them up
            tl.store(DCap + pid_n.to(tl.int64) * tl.num_programs(1) * GROUP + bh, dc)

    # -- epilogue: s = scale · q·k, so dK picks up the scale once here --
    dk *= scale
    DK += off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh
    DV += off_b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh
    tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty),
             mask=(offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM))
    tl.store(DV + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty),
             mask=(offs_n[:, None] < N_K) & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _p_dp(q, do, lse, K, V, offs_m, offs_n, cap, slope, scale, KSTR, VSTR, MASK, BAND, DROP,
          HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, BANDED: tl.constexpr,
          MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
          HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the dQ loops: Kᵀ, P recomputed from lse, dP = dO Vᵀ (dropout-scaled)
    and the softcap's tanh, shared by ``_dq_inner`` and ``_delta_inner``."""
    kT, s, u, t = _qk_scores(q, K, offs_m, offs_n, cap, slope, scale, KSTR, MASK, BAND,
                             HEAD_DIM, BLOCK_D, MASKED, BANDED, MASK_KIND, HAS_SOFTCAP,
                             HAS_ALIBI, DOT_PRECISION)
    p = tl.exp(s - lse[:, None])
    vT = _load_cols(V, offs_n, VSTR, BAND[1], HEAD_DIM_V, BLOCK_DV, MASKED)
    dp = _dot(do, vT, None, DOT_PRECISION)
    if HAS_DROPOUT:
        dp = dp * _dropout_scale(DROP, offs_m[:, None], offs_n[None, :])
    return kT, p, dp, t


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, lo, hi, offs_m, cap, slope, scale, KSTR, VSTR, MASK,
              BAND, DROP, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- recompute P from lse; dS = P ∘ (dP − Δ) --
        kT, p, dp, t = _p_dp(q, do, lse, K, V, offs_m, offs_n, cap, slope, scale, KSTR, VSTR,
                             MASK, BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
                             BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                             DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if MASKED or MASK_KIND != 0:
            # a masked key has dS = 0, but 0·NaN would still reach dQ: a non-finite key
            # enters dQ as 0 (a row that sees it has a NaN dS anyway)
            kT = tl.where(tl.abs(kT) < float("inf"), kT, 0.0)
        # -- dQ += dS K --
        dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq, DOT_PRECISION)
    return dq


@triton.jit
def _delta_inner(delta, psum, q, do, lse, K, V, lo, hi, offs_m, cap, slope, scale, KSTR, VSTR, MASK,
                 BAND, DROP, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """``delta += Σ_j p_ij dp_ij`` and ``psum += Σ_j p_ij`` over key tiles [lo, hi), P and
    dP (dropout-scaled) formed exactly as ``_dq_inner`` forms them. Δ = rowsum(dO ∘ O)
    equals Σ P·dP only up to rounding; at a saturated row (one P ≈ 1) the exact
    dS = P ∘ (dP − Δ) is ~0, and the rounding gap, times scale·K in dQ and scale·Q in dK,
    would be the whole gradient. The caller divides by Σ P: at logits of 1e3 and up, P
    recomputed from one float32 lse is off by a common factor of up to e^(ulp(lse)), which
    the quotient cancels."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT, p, dp, t = _p_dp(q, do, lse, K, V, offs_m, offs_n, cap, slope, scale, KSTR, VSTR,
                             MASK, BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, MASKED,
                             BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                             DOT_PRECISION)
        delta += tl.sum(p * dp, 1)
        psum += tl.sum(p, 1)
    return delta, psum


@triton.autotune(configs=_configs("dq"),
                 key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED", "DELTA_PASS"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dq")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, Mask, Softcap, Alibi, Sinks,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_mb, stride_mh, stride_mm, stride_mn,
                 stride_ab, stride_ah,
                 H, GROUP, N_Q, N_K, offset, left, right, scale,
                 drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads,
                 drop_head0, TUNE_N, LogL, DLse,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DELTA_PASS: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of one query block; with ``DELTA_PASS``, instead, Δ = Σ_j P_ij dP_ij (− dlse) of
    a query block holding a saturated row (``LogL``: log l of each row relative to its max,
    from the forward), written over the preprocessing's rowsum(dO ∘ O). Other blocks leave
    at once: an ordinary call pays one launch and a load of LogL."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP
    Q += off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    V += off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    DO += off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    DQ += off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    Mask += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    BAND = (N_Q, N_K, offset, left, right)
    MASK = (Mask, stride_mm, stride_mn)
    DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0,
                     drop_heads, drop_head0, HAS_DROPOUT)
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    run = True
    if DELTA_PASS:
        logl = tl.load(LogL + row, mask=offs_m < N_Q, other=float("inf"))
        run = tl.min(logl, 0) < _SATURATED_LOGL
    if run:
        q = _load_rows(Q, offs_m, (stride_qm, stride_qd), N_Q, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DO, offs_m, (stride_dom, stride_dod), N_Q, HEAD_DIM_V, BLOCK_DV, True)
        lse = tl.load(Lse + row, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        cap = 1.0
        if HAS_SOFTCAP:
            cap = tl.load(Softcap + off_h)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah)
        lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
        if DELTA_PASS:
            delta = tl.zeros([BLOCK_M], dtype=tl.float32)
            psum = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_SINKS:  # the sink (value 0) counts in Σ P, not in Σ P·dP
                psum += tl.exp(tl.load(Sinks + off_h) - lse)
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                delta, psum = _delta_inner(
                    delta, psum, q, do, lse, K, V, s_lo, s_hi, offs_m, cap, slope, scale,
                    (stride_kn, stride_kd), (stride_vn, stride_vd), MASK, BAND, DROP,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
                    MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
            delta = tl.where(psum > 0.0, delta / psum, 0.0)
            if HAS_DLSE:
                delta -= tl.load(DLse + row, mask=offs_m < N_Q, other=0.0)
            tl.store(Delta + row, delta, mask=offs_m < N_Q)
        else:
            delta = tl.load(Delta + row, mask=offs_m < N_Q, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                dq = _dq_inner(dq, q, do, lse, delta, K, V, s_lo, s_hi, offs_m, cap, slope,
                               scale, (stride_kn, stride_kd), (stride_vn, stride_vd), MASK,
                               BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                               stage != 1, BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI,
                               HAS_DROPOUT, DOT_PRECISION)
            dq *= scale
            tl.store(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                     dq.to(DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM))


# -- launchers -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Launch:
    """The scalar and constexpr arguments every kernel shares, derived once per call."""

    H: int
    group: int
    n_q: int
    n_k: int
    offset: int
    left: int
    right: int
    scale: float
    drop_seed: int
    drop_threshold: int
    inv_keep: float
    drop_row0: int  # global position of the first query (the spec's q_start)
    drop_col0: int  # ... and of the first key
    drop_heads: int  # query heads of the whole computation
    drop_head0: int  # global index of this call's first query head
    tune_n: int
    head_dim: int
    head_dim_v: int
    block_d: int
    block_dv: int
    banded: bool
    mask_kind: int
    has_softcap: bool
    has_alibi: bool
    has_dropout: bool
    dot_precision: str

    def scalars(self) -> tuple:
        return (self.H, self.group, self.n_q, self.n_k, self.offset, self.left, self.right,
                self.scale, self.drop_seed, self.drop_threshold, self.inv_keep, self.drop_row0,
                self.drop_col0, self.drop_heads, self.drop_head0, self.tune_n)

    def constexprs(self) -> dict:
        # head dims are padded to powers of two inside the kernels (masked loads), not in memory
        return dict(HEAD_DIM=self.head_dim, HEAD_DIM_V=self.head_dim_v, BLOCK_D=self.block_d,
                    BLOCK_DV=self.block_dv, BANDED=self.banded, MASK_KIND=self.mask_kind,
                    HAS_SOFTCAP=self.has_softcap, HAS_ALIBI=self.has_alibi,
                    HAS_DROPOUT=self.has_dropout,
                    DOT_PRECISION=self.dot_precision)


def _launch_args(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, attn_mask: Tensor | None,
                 softcap: Tensor | None, alibi: Tensor | None = None) -> _Launch:
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    band = spec.local_band()
    p = spec.dropout_p
    return _Launch(
        H=H, group=H // Hkv, n_q=Nq, n_k=Nk, offset=band.offset,
        left=_UNBOUNDED if band.left is None else band.left,
        right=_UNBOUNDED if band.right is None else band.right,
        scale=float(spec.qk_scale), drop_seed=int(spec.dropout_seed) & 0xFFFFFFFF,
        drop_threshold=int(p * 2**32), inv_keep=1.0 / (1.0 - p),
        drop_row0=spec.q_start, drop_col0=spec.k_start, drop_heads=spec.heads_total or H,
        drop_head0=spec.head_start, tune_n=_tune_n(Nq, Nk), head_dim=D, head_dim_v=Dv,
        block_d=max(16, triton.next_power_of_2(D)), block_dv=max(16, triton.next_power_of_2(Dv)),
        banded=not band.is_full,
        mask_kind=0 if attn_mask is None else (1 if attn_mask.dtype == torch.bool else 2),
        has_softcap=softcap is not None, has_alibi=alibi is not None, has_dropout=p > 0.0,
        dot_precision="ieee" if q.dtype == torch.float32 else "tf32")


def _mask_arg(attn_mask: Tensor | None, q: Tensor, n_k: int) -> tuple[Tensor, tuple]:
    """The mask expanded (stride 0, no copy) to (B, H, Nq, Nk), bool viewed as uint8."""
    if attn_mask is None:
        return q, (0, 0, 0, 0)  # never read: MASK_KIND = 0
    B, H, Nq, _ = q.shape
    m = as_4d(attn_mask)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    m = m.expand(B, H, Nq, n_k)
    return m, m.stride()


def _alibi_arg(alibi: Tensor | None, q: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """The slopes as float32 (B, H) (an expanded view keeps its stride 0), or q and zero
    strides when there are none (never read: HAS_ALIBI = False)."""
    if alibi is None:
        return q, (0, 0)
    a = alibi.to(torch.float32).expand(q.shape[0], q.shape[1])
    return a, a.stride()


def value_offset_args(v: Tensor, n_k: int, dims: tuple[int, ...]) -> dict:
    """The forward kernels' value-offset arguments (see ``_value_offset``): ``VMax``, the
    largest |v| over ``dims`` as float32, one per (sequence, kv head) at ``v``'s other dims
    (computed on the device: no host sync), and ``v_log_scale = log(2·n_k / fmax)``.
    float16 values never need the offset: the kernels then read nothing."""
    if v.dtype == torch.float16 or v.numel() == 0:
        return dict(VMax=v, v_log_scale=0.0, V_OFFSET=False)
    vmax = torch.linalg.vector_norm(v, float("inf"), dim=dims, dtype=torch.float32)
    return dict(VMax=vmax, V_OFFSET=True,
                v_log_scale=math.log(2.0 * max(n_k, 1) / torch.finfo(torch.float32).max))


def _kernel_inputs(q: Tensor, k: Tensor, spec: LaunchSpec, sinks: Tensor | None,
                   softcap: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """q in k's dtype, sinks and the softcap (learnable, else the spec's fixed one) as
    contiguous float32 (H,) vectors: what the kernels read."""
    H = q.shape[1]
    if q.dtype != k.dtype:  # a temperature folded in float32: the kernels take one dtype
        q = q.to(k.dtype)
    if softcap is None and spec.softcap is not None:
        softcap = torch.tensor(float(spec.softcap), device=q.device)
    if softcap is not None:
        softcap = softcap.to(device=q.device, dtype=torch.float32).expand(H).contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    return q, sinks, softcap


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, attn_mask: Tensor | None = None,
         sinks: Tensor | None = None, softcap: Tensor | None = None,
         alibi: Tensor | None = None, *, want_logl: bool = False
         ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """``(out, lse)``, and with ``want_logl`` also ``logl (B, H, Nq)``: log of each row's
    denominator relative to its max (+inf for rows with no key), which :func:`_bwd` takes
    to find saturated rows."""
    q, sinks, softcap = _kernel_inputs(q, k, spec, sinks, softcap)
    B, H, Nq, _ = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    L = _launch_args(q, k, v, spec, attn_mask, softcap, alibi)
    slopes, slope_strides = _alibi_arg(alibi, q)
    out = torch.empty(B, H, Nq, Dv, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    logl = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    mask, mask_strides = _mask_arg(attn_mask, q, Nk)
    voff = value_offset_args(v, Nk, (2, 3))  # (B, Hkv)
    vmax_strides = voff["VMax"].stride() if voff["V_OFFSET"] else (0, 0)
    grid = lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H)  # noqa: E731
    _attn_fwd[grid](
        q, k, v, out, lse, logl, mask, q if sinks is None else sinks,
        q if softcap is None else softcap, slopes,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *mask_strides, *slope_strides,
        *L.scalars(), stride_vmb=vmax_strides[0], stride_vmh=vmax_strides[1],
        HAS_SINKS=sinks is not None, **voff, **L.constexprs())
    return (out, lse, logl) if want_logl else (out, lse)


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, attn_mask: Tensor | None = None,
         sinks: Tensor | None = None, softcap: Tensor | None = None, *,
         need_dmask: bool = False, need_dcap: bool = True, alibi: Tensor | None = None,
         logl: Tensor | None = None) -> Grads:
    """Gradients of one call, as :func:`attn.tiled._bwd`; a float mask's gradient is refused
    (``unsupported_reason``), so ``need_dmask`` must be False. ``alibi``: the slopes,
    constants. ``logl``: the forward's (``_fwd(want_logl=True)``); query blocks holding a
    saturated row then take Δ = Σ P·dP (``_attn_bwd_dq``'s Δ pass), else rowsum(dO ∘ O)
    serves every row."""
    if need_dmask:
        raise NotImplementedError("triton: the gradient of a float attn_mask (use tiled)")
    q, sinks, softcap = _kernel_inputs(q, k, spec, sinks, softcap)
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    L = _launch_args(q, k, v, spec, attn_mask, softcap, alibi)
    slopes, slope_strides = _alibi_arg(alibi, q)
    lse = lse.contiguous()  # the kernels index it as a packed (B, H, Nq): a row slice is not
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty(B, H, Nq, dtype=torch.float32, device=q.device)
    pre_block = 32 if _INTERPRET else 64
    _attn_bwd_preprocess[(triton.cdiv(Nq, pre_block), B * H)](
        out, do, delta if dlse is None else dlse.contiguous(), delta,
        *out.stride(), *do.stride(), H, Nq, HEAD_DIM_V=Dv, BLOCK_DV=L.block_dv,
        HAS_DLSE=dlse is not None, BLOCK_M=pre_block)

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    mask, mask_strides = _mask_arg(attn_mask, q, Nk)
    cap = q if softcap is None else softcap
    # the smallest BLOCK_N any dkdv config may pick bounds the number of partial sums
    min_bn = min(c.kwargs["BLOCK_N"] for c in _attn_bwd_dkdv.configs)
    n_part = triton.cdiv(Nk, min_bn) if softcap is not None else 1
    dcap_part = torch.zeros(n_part, B * H, dtype=torch.float32, device=q.device)
    grid_q = lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * H)  # noqa: E731
    if logl is not None:  # Δ of the blocks holding a saturated row, over the preprocessing's
        _attn_bwd_dq[grid_q](
            q, k, v, do, dq, lse, delta, mask, cap, slopes, lse if sinks is None else sinks,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *mask_strides,
            *slope_strides, *L.scalars(), logl.contiguous(),
            delta if dlse is None else dlse.contiguous(), **L.constexprs(), DELTA_PASS=True,
            HAS_DLSE=dlse is not None, HAS_SINKS=sinks is not None)
    grid_kv = lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    _attn_bwd_dkdv[grid_kv](
        q, k, v, do, dk, dv, lse, delta, mask, cap, slopes, dcap_part,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        *mask_strides, *slope_strides, *L.scalars(), **L.constexprs())
    _attn_bwd_dq[grid_q](
        q, k, v, do, dq, lse, delta, mask, cap, slopes, lse,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *mask_strides,
        *slope_strides, *L.scalars(), lse, lse, **L.constexprs(), DELTA_PASS=False,
        HAS_DLSE=False, HAS_SINKS=False)
    dcap = dcap_part.view(-1, B, H).sum(dim=(0, 1)) if need_dcap and softcap is not None else None
    dsinks = None if sinks is None else sink_grad(sinks, lse, delta)
    return Grads(dq, dk, dv, None, dsinks, dcap)


# -- torch.library ops: opaque to torch.compile, with shapes it can trace ------------------
# Op schemas take flat values: the spec travels as its fields.

def _op_args(spec: LaunchSpec) -> tuple:
    b = spec.band
    return (b.offset, b.left, b.right, float(spec.qk_scale), float(spec.dropout_p),
            int(spec.dropout_seed), [spec.q_start, spec.k_start, spec.head_start,
                                     -1 if spec.heads_total is None else spec.heads_total])


def _spec_of(offset: int, left: int | None, right: int | None, scale: float,
             dropout_p: float, dropout_seed: int, shard: list[int]) -> LaunchSpec:
    q_start, k_start, head_start, heads_total = shard
    return LaunchSpec(qk_scale=scale, band=Band(offset, left, right), dropout_p=dropout_p,
                      dropout_seed=dropout_seed, q_start=q_start, k_start=k_start,
                      head_start=head_start, heads_total=None if heads_total < 0 else heads_total)


@torch.library.custom_op("attn::flash_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
            softcap: Tensor | None, offset: int, left: int | None, right: int | None,
            scale: float, dropout_p: float, dropout_seed: int, shard: list[int],
            alibi: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """out, lse and logl (see :func:`_fwd`)."""
    spec = _spec_of(offset, left, right, scale, dropout_p, dropout_seed, shard)
    return _fwd(q, k, v, spec, attn_mask, sinks, softcap, alibi, want_logl=True)


@_fwd_op.register_fake
def _(q, k, v, attn_mask, sinks, softcap, offset, left, right, scale, dropout_p, dropout_seed,
      shard, alibi=None):
    B, H, Nq, _ = q.shape
    return (q.new_empty(B, H, Nq, v.shape[-1], dtype=v.dtype),
            q.new_empty(B, H, Nq, dtype=torch.float32),
            q.new_empty(B, H, Nq, dtype=torch.float32))


@torch.library.custom_op("attn::flash_bwd", mutates_args=())
def _bwd_op(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
            lse: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
            softcap: Tensor | None, offset: int, left: int | None, right: int | None,
            scale: float, dropout_p: float, dropout_seed: int, shard: list[int],
            need_dcap: bool, alibi: Tensor | None = None, logl: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks (H,) and dsoftcap (H,); the last two empty when not asked for."""
    spec = _spec_of(offset, left, right, scale, dropout_p, dropout_seed, shard)
    g = _bwd(do, dlse, q, k, v, out, lse, spec, attn_mask, sinks, softcap, need_dcap=need_dcap,
             alibi=alibi, logl=logl)
    def or_empty(t: Tensor | None) -> Tensor:  # a fresh tensor each: outputs must not alias
        return q.new_empty(0, dtype=torch.float32) if t is None else t

    return g.dq, g.dk, g.dv, or_empty(g.dsinks), or_empty(g.dsoftcap)


@_bwd_op.register_fake
def _(do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, offset, left, right, scale,
      dropout_p, dropout_seed, shard, need_dcap, alibi=None, logl=None):
    H = q.shape[1]
    n_sinks = 0 if sinks is None else H
    n_cap = H if need_dcap and softcap is not None else 0
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(n_sinks, dtype=torch.float32), q.new_empty(n_cap, dtype=torch.float32))


# -- autograd ------------------------------------------------------------------------------

class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, softcap, alibi, spec: LaunchSpec):
        out, lse, logl = _fwd_op(q, k, v, attn_mask, sinks, softcap, *_op_args(spec), alibi)
        ctx.save_for_backward(q, k, v, out, lse, logl, attn_mask, sinks, softcap, alibi)
        ctx.spec = spec
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, logl, attn_mask, sinks, softcap, alibi = ctx.saved_tensors
        need_dcap = softcap is not None and bool(ctx.needs_input_grad[5])
        dq, dk, dv, dsinks, dcap = _bwd_op(dout, dlse, q, k, v, out, lse, attn_mask, sinks,
                                           softcap, *_op_args(ctx.spec), need_dcap, alibi,
                                           logl)
        dsinks = dsinks if sinks is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, dsinks, dcap if need_dcap else None, None, None


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: LaunchSpec,
    *,
    attn_mask: Tensor | None = None,
    softcap: Tensor | None = None,
    sinks: Tensor | None = None,
    alibi: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused attention kernels. Inputs already validated by ``attn.api``.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv) in v's dtype,
    lse (B, H, Nq) float32. Same protocol as :func:`attn.tiled.tiled_attention`: ``spec``
    holds the static values (q·k scale with any tensor temperature already folded into q,
    band, a fixed softcap, dropout from the ``attn.masks.dropout_keep`` hash, global
    positions); ``softcap`` a learnable tensor broadcastable to (H,), ``sinks`` (H,),
    ``attn_mask`` bool or float broadcastable to (B, H, Nq, Nk), ``alibi`` ALiBi slopes
    broadcastable to (B, H), constants (the bias is measured from the band's diagonal).
    """
    # the conversions under autograd: it sums the per-head expand back to the caller's shapes
    q, sinks, cap = _kernel_inputs(q, k, spec, sinks, softcap)
    return _FlashAttention.apply(q, k, v, attn_mask, sinks, cap, alibi, spec)
