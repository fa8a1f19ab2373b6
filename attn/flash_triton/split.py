"""Split-KV decoding (Flash-Decoding): the plan (:func:`split_kv_plan`), and the two kernels
that carry it out, per-chunk partials and their combine; other calls run the plain kernels
(:func:`split_kv_unsupported`). When, how many chunks and how the kernels pack the GQA group:
docs/gpu.md, "Split-KV decoding".
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

from attn.flash_triton.kernels import (_fwd_inner, _head_consts, _lse_of, _stage_range, _stages,
                                       _value_offset)
from attn.flash_triton.outer import _at
from attn.flash_triton.tune import pow2

MAX_SPLIT_Q = 16  # query rows per head up to which a call counts as decoding
MIN_CHUNK = 256  # keys: the shortest chunk the auto rule cuts (the merge costs a partial)
WAVES = 2  # the auto rule aims at this many programs per SM ...
PROGRAMS_PER_CHUNK = 8  # ... counting each chunk as this many programs (one sequence's kv heads)
MAX_SPLITS = 128  # bounds the partials' memory and the combine's loop
# The Triton interpreter has no SMs: a fixed stand-in, so that the CPU tests see the same
# plans on every machine.
INTERPRETER_SM_COUNT = 8
ENV = "ATTN_TRITON_SPLIT_KV"


@dataclass(frozen=True)
class SplitPlan:
    """How one call's keys are cut: ``splits`` chunks of ``chunk`` keys (whole tiles; the
    last chunk may be shorter). ``splits == 1``: the plain kernel runs."""

    splits: int
    chunk: int


def split_kv_plan(n_k: int, n_q: int, sm_count: int, *, tile: int = 64,
                  force: int | None = None) -> SplitPlan:
    """The split count of a decoding call: pure, from its key length ``n_k``, its query rows
    per head ``n_q`` and the GPU's ``sm_count``, never from its batch (B·Hkv), so that a
    sequence's bits do not depend on the rest of its batch; the rule: docs/gpu.md, "Split-KV
    decoding". ``tile``: the kernel's key tile (chunks are whole tiles). ``force`` (the
    override): that many chunks instead (0 or 1: none), rounded to whole tiles, so a short
    cache may get fewer."""
    for name, val, low in (("n_k", n_k, 0), ("n_q", n_q, 1),
                           ("sm_count", sm_count, 1), ("tile", tile, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"split_kv_plan: {name} must be an int >= {low}, got {val!r}")
    if force is not None and (isinstance(force, bool) or not isinstance(force, int) or force < 0):
        raise ValueError(f"split_kv_plan: force must be an int >= 0 or None, got {force!r}")
    tiles = max(1, -(-n_k // tile))
    if n_q > MAX_SPLIT_Q:
        return SplitPlan(1, n_k)
    if force is not None:
        want = force
    elif n_k < 2 * MIN_CHUNK:
        want = 1
    else:
        want = min(-(-WAVES * sm_count // PROGRAMS_PER_CHUNK), n_k // MIN_CHUNK, MAX_SPLITS)
    want = max(1, min(want, tiles))
    chunk = tile * -(-tiles // want)
    return SplitPlan(max(1, -(-n_k // chunk)), chunk)


def split_kv_override() -> int | None:
    """``ATTN_TRITON_SPLIT_KV``: None for ``auto`` (unset or empty), else the forced count."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV} must be 'auto', '0' (never split) or a positive int, "
                         f"got {raw!r}")
    return n


def split_kv_unsupported(*, n_q: int, grad: bool, dropout: bool, varlen: bool,
                         transform: str | None = None) -> str | None:
    """Why a triton call cannot take the split-KV path, or None when it is eligible
    (``transform``: the torch.func transforms it runs under, ``attn.transforms.active``)."""
    if grad:
        return "split-KV is forward-only and this call needs gradients"
    if transform is not None:
        return f"split-KV has no rule for torch.func transforms or forward-mode AD ({transform})"
    if dropout:
        return "split-KV does not run dropout"
    if varlen:
        return "split-KV does not run packed sequences"
    if n_q > MAX_SPLIT_Q:
        return f"Nq = {n_q} > {MAX_SPLIT_Q} query rows per head (not decoding)"
    return None


def split_kv_reason(call) -> str:
    """The split-KV half of ``select_backend``'s reason for a triton call (``call``: an
    ``attn.call.AttentionCall``): when it is taken, or why not."""
    why = split_kv_unsupported(n_q=call.n_q, grad=call.grad, dropout=call.dropout,
                               varlen=call.varlen, transform=call.transform)
    if why is not None:
        return f"plain kernels ({why})"
    if call.n_k < 2 * MIN_CHUNK:
        return f"plain kernels (Nk = {call.n_k} < {2 * MIN_CHUNK}: too short to split)"
    return (f"split-KV decoding (Nq <= {MAX_SPLIT_Q}, Nk >= {2 * MIN_CHUNK}, forward only): "
            f"keys cut into chunks of >= {MIN_CHUNK}, as many as {WAVES}x the SMs over "
            f"{PROGRAMS_PER_CHUNK} (attn.flash_triton.split_kv_plan; {ENV} overrides)")


def sm_count_of(device) -> int:
    """SMs of a CUDA device (cached by torch), or the interpreter's stand-in."""
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


# -- kernels -------------------------------------------------------------------------------

@triton.jit
def _split_program(Q, QS, H, GROUP, N_Q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """What a split-KV program works on, from its ids (rows block, chunk, batch·kv head):
    its chunk, batch row (int64), kv head, and its block of the group's rows (row r is head
    ``r // N_Q`` of the group, query ``r % N_Q``; padding rows borrow the last real head so
    that every load stays inside the tensors, and are never stored) with their q tile.
    Returns (split, off_b, off_hk, row_ok, offs_m, off_h, q)."""
    pid_r = tl.program_id(0)
    split = tl.program_id(1)
    pid_bhk = tl.program_id(2)
    off_b = (pid_bhk // (H // GROUP)).to(tl.int64)
    off_hk = pid_bhk % (H // GROUP)
    rows = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * N_Q
    g = tl.minimum(rows // N_Q, GROUP - 1)
    offs_m = rows % N_Q
    off_h = off_hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + off_b * QS[0] + off_h[:, None].to(tl.int64) * QS[1]
                + offs_m[:, None] * QS[2] + offs_d[None, :] * QS[3],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return split, off_b, off_hk, row_ok, offs_m, off_h, q


@triton.jit
def _chunk_stages(split, chunk, q0, n_rows, N_Q, N_K, offset, left, right,
                  BLOCK_N: tl.constexpr):
    """The band's three stages (``_stages``) for queries ``[q0, q0 + n_rows)``, clipped to
    chunk ``split``'s keys ``[split·chunk, (split + 1)·chunk)``."""
    n0 = split * chunk
    n1 = tl.minimum(n0 + chunk, N_K)
    lo, a, b, hi = _stages(q0, N_Q, N_K, offset, left, right, n_rows, BLOCK_N)
    lo = tl.maximum(lo, n0)
    hi = tl.maximum(tl.minimum(hi, n1), lo)
    a = tl.minimum(tl.maximum(a, lo), hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def _store_partial(OutP, LseP, acc, l_i, m_i, split, off_b, off_h, offs_m, row_ok, B, H,
                   N_Q, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A chunk's partial out and lse into (splits, B, H, N_Q, ·) float32; a chunk a row sees
    nothing of gives 0 and lse = -inf (weight 0 in the combine)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = _lse_of(m_i, l_i)
    part = ((split * B + off_b) * H + off_h).to(tl.int64) * N_Q + offs_m  # (splits, B, H, N_Q)
    tl.store(LseP + part, lse, mask=row_ok)
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(OutP + part[:, None] * HEAD_DIM_V + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _attn_fwd_split(Q, K, V, OutP, LseP, Mask, Softcap, Alibi, QS, KS, VS, MS, AS,
                    B, H, GROUP, N_Q, N_K, offset, left, right, SC, chunk, VMax, VMS,
                    v_log_scale, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BANDED: tl.constexpr,
                    MASK_KIND: tl.constexpr, SCORE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    V_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key chunk of one (batch, kv head) for a block of its group's rows: partial out
    (splits, B, H, N_Q, HEAD_DIM_V) and lse (splits, B, H, N_Q), float32, contiguous."""
    split, off_b, off_hk, row_ok, offs_m, off_h, q = _split_program(
        Q, QS, H, GROUP, N_Q, HEAD_DIM, BLOCK_D, BLOCK_M)
    K = _at(K, off_b, off_hk, KS)
    V = _at(V, off_b, off_hk, VS)
    BAND = (N_Q, N_K, offset, left, right)
    mask_rows = Mask + off_b * MS[0] + off_h[:, None].to(tl.int64) * MS[1]
    MASK = (mask_rows, MS[2], MS[3])
    cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h[:, None], SCORE)
    voff = _value_offset(VMax + off_b * VMS[0] + off_hk * VMS[1], v_log_scale, V_OFFSET)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # -- the band's stages for every query of the call, clipped to this chunk's keys --
    lo, a, b, hi = _chunk_stages(split, chunk, 0, N_Q, N_Q, N_K, offset, left, right, BLOCK_N)
    for stage in tl.static_range(3):
        s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, s_lo, s_hi, offs_m, cap, slope, SC,
            (KS[2], KS[3]), (VS[2], VS[3]), MASK, BAND, (0, 0, 0.0, 0, 0), voff,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
            MASK_KIND, SCORE, False, V_OFFSET, DOT_PRECISION)

    # -- epilogue --
    _store_partial(OutP, LseP, acc, l_i, m_i, split, off_b, off_h, offs_m, row_ok, B, H, N_Q,
                   HEAD_DIM_V, BLOCK_DV)


@triton.jit
def _attn_split_combine(OutP, LseP, Out, Lse, Sinks, OS, rows_total, H, N_Q, splits,
                        HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One (batch, head, query) row: merge the chunks' partials through their lse, in chunk
    order (the same bits whatever order the chunks ran in); the sink, when present, is one
    more partial of value 0. Out in its dtype through ``OS``; lse (B, H, N_Q) float32."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    lse_p = tl.load(LseP + offs_s * rows_total + row, mask=offs_s < splits,
                    other=float("-inf"))
    m = tl.max(lse_p, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + (row // N_Q) % H)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # every part empty: weights stay 0
    total = tl.sum(tl.exp(lse_p - m_safe), 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_safe)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(0, splits):
        w = tl.exp(tl.load(LseP + s * rows_total + row) - m_safe)
        o = tl.load(OutP + (s * rows_total + row) * HEAD_DIM_V + offs_dv,
                    mask=offs_dv < HEAD_DIM_V, other=0.0)
        acc += w * o
    t_safe = tl.where(total == 0.0, 1.0, total)
    off_b = row // (H * N_Q)
    off_h = (row // N_Q) % H
    off_m = row % N_Q
    tl.store(Out + off_b * OS[0] + off_h * OS[1] + off_m * OS[2] + offs_dv * OS[3],
             (acc / t_safe).to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(t_safe)))


def combine_block(splits: int) -> int:
    """The combine kernel's BLOCK_S: the chunks' lse in one load."""
    return max(2, pow2(splits))


__all__ = ["SplitPlan", "split_kv_plan", "split_kv_override", "split_kv_unsupported",
           "split_kv_reason", "sm_count_of", "MAX_SPLIT_Q", "MIN_CHUNK", "INTERPRETER_SM_COUNT"]
