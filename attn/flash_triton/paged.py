"""Attention from a paged KV cache: split-KV's grid and combine (:mod:`attn.flash_triton.split`)
with each key tile loaded through its row's page table (:func:`_page_slots`,
:func:`_load_page_tile`), masked past the row's own length ``N_b``. A quantized cache
(``QUANT`` 1 int8, 2 int4, 3 fp8 e4m3; 0 compiles none of it) is dequantized after the load
(:func:`_load_quant_tile`), its fp16 scales at ``page · s0 + slot · s1 + head · s2 + (d //
GROUP) · s3`` (per channel ``s1 = 0``, per kv head ``s0 = s1 = 0``). How, why and the tests:
docs/kvcache.md, "How CUDA reads the pages".
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn.flash_triton.kernels import (_INTERPRET, _LOG2E, _dot, _head_consts, _load, _scores,
                                       _softmax_step, _stage_range)
from attn.flash_triton.split import _chunk_stages, _split_program, _store_partial

# The interpreter turns float32 into bfloat16 by truncation where a GPU rounds to nearest
# even: a dequantized tile would then differ from the tiled backend's (and the oracle's)
# values by an ulp, so under the interpreter the rounding is done by hand first.
_RTNE_BF16 = tl.constexpr(_INTERPRET)


@triton.jit
def _page_slots(TableRow, stride_t, pos, ok, page_size, MASKED: tl.constexpr):
    """Page id (int64) and slot of one sequence's key positions ``pos``, its page ids at
    ``TableRow[0], TableRow[stride_t], …``. Where ``ok`` is False (past the row's length)
    the table is not read: the ids there are 0 and never used for a load."""
    if MASKED:
        blk = tl.load(TableRow + (pos // page_size) * stride_t, mask=ok, other=0)
    else:
        blk = tl.load(TableRow + (pos // page_size) * stride_t)
    return blk.to(tl.int64), pos % page_size


@triton.jit
def _load_page_tile(P, PS, blk, slot, ok, DIM: tl.constexpr, BLOCK: tl.constexpr,
                    TRANS: tl.constexpr, MASKED: tl.constexpr):
    """The rows at (page ``blk``, slot ``slot``) of one kv head's storage ``P`` (strides
    ``PS`` = (block, slot, head, dim)): a (keys, BLOCK) tile, or (BLOCK, keys) with ``TRANS``
    (a dot's right operand); masked keys and dims give 0 and are not read."""
    offs_d = tl.arange(0, BLOCK)
    at, d = _outer(blk * PS[0] + slot * PS[1], offs_d, TRANS)
    ok_k, ok_d = _outer(ok, offs_d < DIM, TRANS)
    return _load(P + at + d * PS[3], ok_k, ok_d, MASKED, BLOCK != DIM)


@triton.jit
def _outer(keys, dims, TRANS: tl.constexpr):
    """A key-axis vector and a dim-axis vector broadcast to a (keys, dims) tile's axes, or a
    (dims, keys) one's with ``TRANS``."""
    if TRANS:
        k2, d2 = keys[None, :], dims[:, None]
    else:
        k2, d2 = keys[:, None], dims[None, :]
    return k2, d2


@triton.jit
def _codes_to_float(c, nibble, QUANT: tl.constexpr):
    """Stored codes as float32 numbers, before their scale: int8 as they are; int4 the
    nibble ``nibble`` (0 low, 1 high) of each byte, minus 8; fp8 e4m3fn bytes decoded from
    their bits (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 subnormal,
    ``0x7f`` / ``0xff`` NaN)."""
    if QUANT == 1:
        x = c.to(tl.float32)
    elif QUANT == 2:
        x = (((c.to(tl.int32) >> (4 * nibble)) & 15) - 8).to(tl.float32)
    else:
        b = c.to(tl.int32)  # zero-extended: the byte is uint8
        e = (b >> 3) & 15
        m = b & 7
        # a normal number's float32 bits: exponent e - 7 rebiased by 127, mantissa on top
        x = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        x = tl.where(e == 0, m.to(tl.float32) * 0.001953125, x)  # subnormal: m · 2^-9
        x = tl.where((b & 127) == 127, float("nan"), x)
        x = tl.where(b >= 128, -x, x)
    return x


@triton.jit
def _as_dtype_of(x, like):
    """float32 ``x`` in ``like``'s dtype, rounded to nearest even (see ``_RTNE_BF16``)."""
    if _RTNE_BF16 and like.dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)  # half an ulp, ties to even, then truncated
        x = (b + 0x7FFF + ((b >> 16) & 1)).to(tl.float32, bitcast=True)
    return x.to(like.dtype)


@triton.jit
def _dequant_tile(P, PS, S, SS, blk, slot, ok, DIM: tl.constexpr, BLOCK: tl.constexpr,
                  TRANS: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr,
                  GROUP: tl.constexpr):
    """``code · scale`` in float32 at (page ``blk``, slot ``slot``) of one kv head's codes
    ``P`` (strides ``PS``) and scales ``S`` (strides ``SS``, see the module docstring), laid
    out as :func:`_load_page_tile`'s tile; masked keys and dims give 0 and are not read."""
    offs_d = tl.arange(0, BLOCK)
    at_k, d = _outer(blk * PS[0] + slot * PS[1], offs_d, TRANS)
    ok_k, ok_d = _outer(ok, offs_d < DIM, TRANS)
    byte_d = d
    if QUANT == 2:  # two codes per byte
        byte_d = d // 2
    c = _load(P + at_k + byte_d * PS[3], ok_k, ok_d, MASKED, BLOCK != DIM)
    at_s, _ = _outer(blk * SS[0] + slot * SS[1], offs_d, TRANS)
    if GROUP >= DIM:  # one scale per key: a vector, broadcast along the dims
        s = _load(S + at_s, ok_k, ok_k, MASKED, False)
    else:
        s = _load(S + at_s + (d // GROUP) * SS[3], ok_k, ok_d, MASKED, BLOCK != DIM)
    return _codes_to_float(c, d % 2, QUANT) * s.to(tl.float32)


@triton.jit
def _load_quant_tile(P, PS, S, SS, R, RS, blk, slot, ok, recent, DIM: tl.constexpr,
                     BLOCK: tl.constexpr, TRANS: tl.constexpr, MASKED: tl.constexpr,
                     QUANT: tl.constexpr, GROUP: tl.constexpr, HAS_RECENT: tl.constexpr):
    """:func:`_load_page_tile` of a quantized cache, in float32: keys in coded pages
    dequantized (:func:`_dequant_tile`), keys in full-precision pages (``recent``, where
    ``HAS_RECENT``) loaded from the ring ``R`` (strides ``RS``); each key is read from its
    own store only, the other load masked off."""
    if HAS_RECENT:
        x = _dequant_tile(P, PS, S, SS, blk, slot, ok & (recent == 0), DIM, BLOCK, TRANS,
                          True, QUANT, GROUP)
        # each key is 0 in the load that skipped it, so the sum is the value of the other
        x += _load_page_tile(R, RS, blk, slot, ok & recent, DIM, BLOCK, TRANS,
                             True).to(tl.float32)
    else:
        x = _dequant_tile(P, PS, S, SS, blk, slot, ok, DIM, BLOCK, TRANS, MASKED, QUANT,
                          GROUP)
    return x


@triton.jit
def _tile_value_offset(v, v_log_scale, V_OFFSET: tl.constexpr):
    """``_value_offset`` from one tile's values: log(max|v| · 2·N_b / fmax) when positive
    and finite, else 0 (every ordinary tile); base 2, as the row max it rides on."""
    c = 0.0
    if V_OFFSET:
        c = tl.log(tl.max(tl.max(tl.abs(v), 1), 0).to(tl.float32)) + v_log_scale
        c = tl.where((c > 0.0) & (c < float("inf")), c * _LOG2E, 0.0)
    return c


@triton.jit
def _paged_inner(acc, l_i, m_i, q, KP, VP, KQ, VQ, TableRow, stride_t, first, page_size,
                 recent_from, lo, hi, offs_m, cap, slope, SC, KPS, VPS, BAND, v_log_scale,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 BANDED: tl.constexpr, SCORE: tl.constexpr, V_OFFSET: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, K_GROUP: tl.constexpr,
                 V_GROUP: tl.constexpr, HAS_RECENT: tl.constexpr):
    """``_fwd_inner`` over key tiles [lo, hi) of one row whose keys are read through its
    page table (no attn_mask, no dropout: a cache is read for inference). A quantized
    cache's ``KQ`` / ``VQ``: (scales, their strides, recent ring, its strides)."""
    N_K = BAND[1]
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ok = offs_n < N_K
        # -- where the tile's keys live --
        blk, slot = _page_slots(TableRow, stride_t, first + offs_n, ok, page_size, MASKED)
        recent = ok
        if HAS_RECENT:  # keys in the row's full-precision pages
            recent = (first + offs_n) // page_size >= recent_from
        # -- compute qk --
        if QUANT == 0:
            kT = _load_page_tile(KP, KPS, blk, slot, ok, HEAD_DIM, BLOCK_D, True, MASKED)
        else:
            kT = _as_dtype_of(_load_quant_tile(
                KP, KPS, KQ[0], KQ[1], KQ[2], KQ[3], blk, slot, ok, recent, HEAD_DIM, BLOCK_D,
                True, MASKED, QUANT, K_GROUP, HAS_RECENT), q)
        qk = _dot(q, kT.to(q.dtype), None, DOT_PRECISION)
        s, _, _ = _scores(qk, offs_m[:, None], offs_n[None, :], (KP, 0, 0), cap, slope, SC,
                          BAND, MASKED, BANDED, 0, SCORE)
        # -- online softmax, the value offset from this tile's values --
        if QUANT == 0:
            v = _load_page_tile(VP, VPS, blk, slot, ok, HEAD_DIM_V, BLOCK_DV, False,
                                MASKED).to(q.dtype)
        else:
            v = _as_dtype_of(_load_quant_tile(
                VP, VPS, VQ[0], VQ[1], VQ[2], VQ[3], blk, slot, ok, recent, HEAD_DIM_V,
                BLOCK_DV, False, MASKED, QUANT, V_GROUP, HAS_RECENT), q)
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i,
                                           _tile_value_offset(v, v_log_scale, V_OFFSET), SC,
                                           False, SCORE, V_OFFSET)
        # -- update acc --
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_paged(Q, KP, VP, Table, Seq, OutP, LseP, Softcap, Alibi, KS, VS, RK, RV, QS,
                    KPS, VPS, TS, AS, KSS, VSS, RKS, RVS, B, H, GROUP, N_Q, offset, left,
                    right, SC, page_size, v_log_scale, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BANDED: tl.constexpr, SCORE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    V_OFFSET: tl.constexpr, QUANT: tl.constexpr, K_GROUP: tl.constexpr,
                    V_GROUP: tl.constexpr, HAS_RECENT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """One key chunk of one (batch row, kv head) read through the block table ``Table (B,
    max_pages)``, for a block of its group's rows; ``Seq (B, 4)`` int32 holds each row's
    first key position, end, first full-precision page and key chunk (its own: the row's
    split plan never depends on the rest of the batch). With ``QUANT``, ``KP`` / ``VP``
    hold codes, ``KS`` / ``VS`` their scales (strides ``KSS`` / ``VSS``, the module
    docstring's four) and, with ``HAS_RECENT``, ``RK`` / ``RV`` the recent ring (strides
    ``RKS`` / ``RVS``); ``K_GROUP`` / ``V_GROUP``: dims per scale. Partials as
    ``_attn_fwd_split``'s."""
    split, off_b, off_hk, row_ok, offs_m, off_h, q = _split_program(
        Q, QS, H, GROUP, N_Q, HEAD_DIM, BLOCK_D, BLOCK_M)
    # -- this row's keys: positions [first, first + N_K) of its pages, its band from its end --
    first = tl.load(Seq + off_b * 4)
    N_K = tl.load(Seq + off_b * 4 + 1) - first
    chunk = tl.load(Seq + off_b * 4 + 3)
    recent_from = 0
    if HAS_RECENT:
        recent_from = tl.load(Seq + off_b * 4 + 2)
    offset = offset + N_K
    BAND = (N_Q, N_K, offset, left, right)
    hk = off_hk.to(tl.int64)
    KP = KP + hk * KPS[2]
    VP = VP + hk * VPS[2]
    KQ = (KS + hk * KSS[2], KSS, RK + hk * RKS[2], RKS)
    VQ = (VS + hk * VSS[2], VSS, RV + hk * RVS[2], RVS)
    cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h[:, None], SCORE)
    v_log_scale += tl.log(tl.maximum(N_K, 1).to(tl.float32))  # log(2·N_b / fmax)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # -- the stages of this block's queries (a block across two heads: all of them) --
    q0 = tl.min(tl.where(row_ok, offs_m, N_Q), 0)
    q1 = tl.max(tl.where(row_ok, offs_m, 0), 0) + 1
    lo, a, b, hi = _chunk_stages(split, chunk, q0, q1 - q0, N_Q, N_K, offset, left, right,
                                 BLOCK_N)
    for stage in tl.static_range(3):
        s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
        acc, l_i, m_i = _paged_inner(
            acc, l_i, m_i, q, KP, VP, KQ, VQ, Table + off_b * TS[0], TS[1], first, page_size,
            recent_from, s_lo, s_hi, offs_m, cap, slope, SC, KPS, VPS, BAND, v_log_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
            SCORE, V_OFFSET, DOT_PRECISION, QUANT, K_GROUP, V_GROUP,
            HAS_RECENT)

    # -- epilogue --
    _store_partial(OutP, LseP, acc, l_i, m_i, split, off_b, off_h, offs_m, row_ok, B, H, N_Q,
                   HEAD_DIM_V, BLOCK_DV)
