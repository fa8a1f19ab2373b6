"""The outer kernels: one program per (block, sequence·head), dense (B, H, N, D) or, with
``VARLEN``, packed (total, H, D) (:func:`_seq_info`: all that differs), each owning its
block's initialisation and epilogue. Their layouts, stride tuples and bundles: docs/gpu.md,
"The kernels' arguments".
"""

from __future__ import annotations

from functools import partial

import triton
import triton.language as tl

from attn.flash_triton.kernels import (_LN2, _LOG2E, _SATURATED_LOGL, _SCALE, _SOFTCAP,
                                       _T_Q, _dkdv_inner, _dq_inner, _drop_ctx, _fwd_inner,
                                       _head_consts, _jvp_inner, _load_rows, _lse_of,
                                       _stage_range, _stages, _store_rows, _value_offset)
from attn.flash_triton.tune import AUTOTUNE_KEY, _configs, _prune

_KEY = list(AUTOTUNE_KEY)


@triton.jit
def _seq_info(CuQ, CuK, off_b, N_Q, N_K, offset, VARLEN: tl.constexpr):
    """Sequence ``off_b``: its first query and key in units of the batch strides, its
    lengths and its band offset. Dense: batch row ``off_b``, the call's lengths and offset.
    Packed: offsets from ``cu_seqlens`` (int64), the offset counted from the sequence's
    bottom-right corner."""
    if VARLEN:
        seq_q = tl.load(CuQ + off_b).to(tl.int64)
        seq_k = tl.load(CuK + off_b).to(tl.int64)
        n_q = tl.load(CuQ + off_b + 1).to(tl.int64) - seq_q
        n_k = tl.load(CuK + off_b + 1).to(tl.int64) - seq_k
        offset = n_k - n_q + offset
    else:
        seq_q = off_b.to(tl.int64)
        seq_k = seq_q
        n_q = N_Q
        n_k = N_K
    return seq_q, seq_k, n_q, n_k, offset


@triton.jit
def _q_program(CuQ, CuK, H, GROUP, N_Q, N_K, offset, VARLEN: tl.constexpr):
    """The (sequence·head) of a query-block program: batch row, head, its kv head (GQA),
    and :func:`_seq_info` of its sequence."""
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    seq_q, seq_k, n_q, n_k, offset = _seq_info(CuQ, CuK, off_b, N_Q, N_K, offset, VARLEN)
    return off_b, off_h, off_h // GROUP, seq_q, seq_k, n_q, n_k, offset


@triton.jit
def _at(P, seq, off_h, S):
    """``P`` moved to (sequence ``seq`` (int64), head ``off_h``) by the strides ``S``."""
    return P + seq * S[0] + off_h.to(tl.int64) * S[1]


@triton.jit
def _row0(seq_q, off_b, off_h, H, N_Q, LS, VARLEN: tl.constexpr):
    """Where (sequence, head)'s rows of lse, Δ and log l start: (B, H, N_Q) or (H, total_q).
    The dense form is one product (b·H + h)·N_Q, which keeps dK/dV's registers as they were."""
    if VARLEN:
        row0 = seq_q * LS[0] + off_h.to(tl.int64) * LS[1]
    else:
        row0 = (off_b * H + off_h).to(tl.int64) * N_Q
    return row0


@triton.autotune(configs=_configs("fwd"), key=_KEY,
                 prune_configs_by={"early_config_prune": partial(_prune, kind="fwd")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_fwd(Q, K, V, Out, Lse, LogL, Lse2, Mask, Sinks, Softcap, Alibi, CuQ, CuK,
              QS, KS, VS, OS, MS, AS, LS, H, GROUP, N_Q, N_K, offset, left, right, SC,
              drop_seed, DR, TUNE_N, VMax, VMS, v_log_scale, HEAD_DIM: tl.constexpr,
              HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
              HAS_SINKS: tl.constexpr, V_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    off_b, off_h, off_hk, seq_q, seq_k, N_Q, N_K, offset = _q_program(
        CuQ, CuK, H, GROUP, N_Q, N_K, offset, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    run = True
    if VARLEN:
        run = start_m < N_Q  # programs past their sequence's end have nothing to do
    if run:
        Q = _at(Q, seq_q, off_h, QS)
        K = _at(K, seq_k, off_hk, KS)
        V = _at(V, seq_k, off_hk, VS)
        Out = _at(Out, seq_q, off_h, OS)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (_at(Mask, off_b.to(tl.int64), off_h, MS), MS[2], MS[3])
        DROP = _drop_ctx(off_b, off_h, drop_seed, DR, HAS_DROPOUT)
        # this sequence's own values set its offset: the others' never move its result
        voff = _value_offset(VMax + off_b * VMS[0] + off_hk * VMS[1], v_log_scale, V_OFFSET)
        # -- init: the sink, when present, is a first key with value 0 --
        if HAS_SINKS:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + off_h) * _LOG2E
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h, SCORE)
        q = _load_rows(Q, offs_m, (QS[2], QS[3]), N_Q, HEAD_DIM, BLOCK_D, True)

        # -- loop over key tiles: masked edge, full middle, masked edge --
        lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
        for stage in tl.static_range(0 if BANDED else 1, 3):  # no band: lo = a = 0
            s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, K, V, s_lo, s_hi, offs_m, cap, slope, SC,
                (KS[2], KS[3]), (VS[2], VS[3]), MASK, BAND, DROP, voff,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
                MASK_KIND, SCORE, HAS_DROPOUT, V_OFFSET, DOT_PRECISION)

        # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
        # (m_i and voff are base 2; lse and log l leave in natural units)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        _store_rows(Out, offs_m, (OS[2], OS[3]), N_Q, out, HEAD_DIM_V, BLOCK_DV)
        row = _row0(seq_q, off_b, off_h, H, N_Q, LS, VARLEN) + offs_m
        tl.store(Lse + row, _lse_of(m_i, l_i), mask=offs_m < N_Q)
        # ... and lse in base 2 as the softmax had it (m + log2 l), which the backward reads:
        # converting the natural lse back would lose its exact cancellation against the row
        # max's score at a saturated row (P of the max off by ulps, times scale·K in dQ)
        tl.store(Lse2 + row, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)),
                 mask=offs_m < N_Q)
        # log l relative to the row max (the value offset taken back): the backward's
        # saturation test, which lse alone cannot answer
        logl = tl.where(l_i == 0.0, float("inf"), (tl.log2(l_safe) + voff) * _LN2)
        tl.store(LogL + row, logl, mask=offs_m < N_Q)


# -- backward ------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess(Out, DOut, DLse, Delta, OS, DOS, H, N_Q, HEAD_DIM_V: tl.constexpr,
                         BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    o = _load_rows(_at(Out, off_b, off_h, OS), offs_m, (OS[2], OS[3]), N_Q, HEAD_DIM_V,
                   BLOCK_DV, True)
    do = _load_rows(_at(DOut, off_b, off_h, DOS), offs_m, (DOS[2], DOS[3]), N_Q, HEAD_DIM_V,
                    BLOCK_DV, True)
    # -- Δ = rowsum(dO ∘ O) − dlse: the lse output's gradient joins dS as dlse_i · P_ij --
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=offs_m < N_Q, other=0.0)
    tl.store(Delta + row, delta, mask=offs_m < N_Q)


@triton.autotune(configs=_configs("dkdv"), key=_KEY,
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dkdv")},
                 reset_to_zero=["DCap"])  # configs differ in how many partial sums they write
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, Mask, Softcap, Alibi, DCap, CuQ, CuK,
                   QS, KS, VS, OS, GS, GVS, MS, AS, LS, H, GROUP, N_Q, N_K, offset, left,
                   right, SC, drop_seed, DR, TUNE_N, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK and dV of one key block (``GS``, ``GVS``: their strides)."""
    pid_n = tl.program_id(0)
    pid_bhk = tl.program_id(1)
    H_KV = H // GROUP
    off_b = pid_bhk // H_KV
    off_hk = pid_bhk % H_KV
    seq_q, seq_k, N_Q, N_K, offset = _seq_info(CuQ, CuK, off_b, N_Q, N_K, offset, VARLEN)
    start_n = pid_n * BLOCK_N
    run = True
    if VARLEN:
        run = start_n < N_K
    if run:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(_at(K, seq_k, off_hk, KS), offs_n, (KS[2], KS[3]), N_K, HEAD_DIM,
                       BLOCK_D, True)
        v = _load_rows(_at(V, seq_k, off_hk, VS), offs_n, (VS[2], VS[3]), N_K, HEAD_DIM_V,
                       BLOCK_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        BAND = (N_Q, N_K, offset, left, right)
        # the band seen from a key: queries i with -right <= i - (j - offset) <= left
        lo, a, b, hi = _stages(start_n, N_K, N_Q, -offset, right, left, BLOCK_N, BLOCK_M)

        # -- every query head of the GQA group adds into the same dK, dV --
        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            MASK = (_at(Mask, off_b.to(tl.int64), off_h, MS), MS[2], MS[3])
            rows = _row0(seq_q, off_b, off_h, H, N_Q, LS, VARLEN)  # lse, Δ
            DROP = _drop_ctx(off_b, off_h, drop_seed, DR, HAS_DROPOUT)
            cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h, SCORE)
            dc = 0.0
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                dk, dv, dc = _dkdv_inner(
                    dk, dv, dc, k, v, _at(Q, seq_q, off_h, QS), _at(DO, seq_q, off_h, OS),
                    Lse + rows, Delta + rows, s_lo, s_hi, offs_n, cap, slope, SC,
                    (QS[2], QS[3]), (OS[2], OS[3]), MASK, BAND, DROP, HEAD_DIM, HEAD_DIM_V,
                    BLOCK_D, BLOCK_DV, BLOCK_M, stage != 1, BANDED, MASK_KIND, SCORE,
                    HAS_DROPOUT, DOT_PRECISION)
            if SCORE[_SOFTCAP]:  # one partial sum per (key block, b, h); the launcher adds them up
                tl.store(DCap + pid_n.to(tl.int64) * tl.num_programs(1) * GROUP + off_b * H
                         + off_h, dc)

        # -- epilogue: s = scale · q·k, so dK picks up the scale once here --
        _store_rows(_at(DK, seq_k, off_hk, GS), offs_n, (GS[2], GS[3]), N_K, dk * SC[_SCALE],
                    HEAD_DIM, BLOCK_D)
        _store_rows(_at(DV, seq_k, off_hk, GVS), offs_n, (GVS[2], GVS[3]), N_K, dv,
                    HEAD_DIM_V, BLOCK_DV)


@triton.autotune(configs=_configs("dq"), key=_KEY + ["DELTA_PASS"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dq")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, Mask, Softcap, Alibi, Sinks, CuQ, CuK, LogL, DLse,
                 QS, KS, VS, OS, GS, MS, AS, LS, H, GROUP, N_Q, N_K, offset, left, right,
                 SC, drop_seed, DR, TUNE_N, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 VARLEN: tl.constexpr, DELTA_PASS: tl.constexpr,
                 HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """dQ of one query block (``GS``: its strides); with ``DELTA_PASS``, instead,
    Δ = Σ_j P_ij dP_ij (− dlse) of a query block holding a saturated row (``LogL``: log l of
    each row relative to its max, from the forward), written over the preprocessing's
    rowsum(dO ∘ O). Other blocks leave at once: an ordinary call pays one launch and a load
    of LogL."""
    off_b, off_h, off_hk, seq_q, seq_k, N_Q, N_K, offset = _q_program(
        CuQ, CuK, H, GROUP, N_Q, N_K, offset, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row = _row0(seq_q, off_b, off_h, H, N_Q, LS, VARLEN) + offs_m
    run = True
    if VARLEN:
        run = start_m < N_Q
    if DELTA_PASS:
        if run:
            logl = tl.load(LogL + row, mask=offs_m < N_Q, other=float("inf"))
            run = tl.min(logl, 0) < _SATURATED_LOGL
    if run:
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (_at(Mask, off_b.to(tl.int64), off_h, MS), MS[2], MS[3])
        DROP = _drop_ctx(off_b, off_h, drop_seed, DR, HAS_DROPOUT)
        q = _load_rows(_at(Q, seq_q, off_h, QS), offs_m, (QS[2], QS[3]), N_Q, HEAD_DIM,
                       BLOCK_D, True)
        do = _load_rows(_at(DO, seq_q, off_h, OS), offs_m, (OS[2], OS[3]), N_Q, HEAD_DIM_V,
                        BLOCK_DV, True)
        lse = tl.load(Lse + row, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # base 2 (Lse2)
        cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h, SCORE)
        if DELTA_PASS:
            dq = 0.0
            delta = tl.zeros([BLOCK_M], dtype=tl.float32)
            psum = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_SINKS:  # the sink (value 0) counts in Σ P, not in Σ P·dP
                psum += tl.math.exp2(tl.load(Sinks + off_h) * _LOG2E - lse)
        else:
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            delta = tl.load(Delta + row, mask=offs_m < N_Q, other=0.0)
            psum = 0.0
        lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
        for stage in tl.static_range(3):
            s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
            dq, delta, psum = _dq_inner(
                dq, delta, psum, q, do, lse, _at(K, seq_k, off_hk, KS),
                _at(V, seq_k, off_hk, VS), s_lo, s_hi, offs_m, cap, slope, SC,
                (KS[2], KS[3]), (VS[2], VS[3]), MASK, BAND, DROP, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED, MASK_KIND, SCORE,
                HAS_DROPOUT, DOT_PRECISION, DELTA_PASS)
        if DELTA_PASS:
            delta = tl.where(psum > 0.0, delta / psum, 0.0)
            if HAS_DLSE:
                delta -= tl.load(DLse + row, mask=offs_m < N_Q, other=0.0)
            tl.store(Delta + row, delta, mask=offs_m < N_Q)
        else:
            _store_rows(_at(DQ, seq_q, off_h, GS), offs_m, (GS[2], GS[3]), N_Q, dq * SC[_SCALE],
                        HEAD_DIM, BLOCK_D)


# -- forward-mode AD -----------------------------------------------------------------------

@triton.autotune(configs=_configs("jvp"), key=_KEY + ["TAN"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="jvp")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_jvp(Q, K, V, Out, Lse, DQ, DK, DV, DOut, DLse, Mask, DMask, Softcap, DCap, Alibi,
              DAlibi, Sinks, DSinks, CuQ, CuK, QS, KS, VS, OS, TQS, TKS, TVS, GS, MS, DMS, AS,
              DAS, LS, H, GROUP, N_Q, N_K, offset, left, right, SC, drop_seed, DR, TUNE_N,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
              SCORE: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
              VARLEN: tl.constexpr, TAN: tl.constexpr, HAS_SINKS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tangents (ȯ, lsė) = (A − b·o, b) of one query block's (out, lse), in one pass over
    its key tiles from the forward's out and base-2 lse (``Lse``: Lse2; :func:`_jvp_inner`
    accumulates A and b, docs/gpu.md, "How the kernels work"). ``DQ``, ``DK``, ``DV``, ``DMask`` the
    tangents of q, k, v and a float mask (``TAN``: which are given; strides ``TQS``, ``TKS``,
    ``TVS``, ``DMS``), ``DCap`` the softcap's per head, ``DAlibi`` the slopes' (strides
    ``DAS``), ``DSinks`` the sinks'; ``DOut`` (strides ``GS``) in out's dtype, ``DLse``
    float32 laid out as lse."""
    off_b, off_h, off_hk, seq_q, seq_k, N_Q, N_K, offset = _q_program(
        CuQ, CuK, H, GROUP, N_Q, N_K, offset, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    run = True
    if VARLEN:
        run = start_m < N_Q
    if run:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row = _row0(seq_q, off_b, off_h, H, N_Q, LS, VARLEN) + offs_m
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (_at(Mask, off_b.to(tl.int64), off_h, MS), MS[2], MS[3])
        DMASK = (_at(DMask, off_b.to(tl.int64), off_h, DMS), DMS[2], DMS[3])
        DROP = _drop_ctx(off_b, off_h, drop_seed, DR, HAS_DROPOUT)
        q = _load_rows(_at(Q, seq_q, off_h, QS), offs_m, (QS[2], QS[3]), N_Q, HEAD_DIM,
                       BLOCK_D, True)
        dq = q
        if TAN[_T_Q]:
            dq = _load_rows(_at(DQ, seq_q, off_h, TQS), offs_m, (TQS[2], TQS[3]), N_Q,
                            HEAD_DIM, BLOCK_D, True)
        lse = tl.load(Lse + row, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # base 2 (Lse2)
        cap, slope = _head_consts(Softcap, Alibi, AS, off_b, off_h, SCORE)
        dcap, dslope = _head_consts(DCap, DAlibi, DAS, off_b, off_h, SCORE)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        b_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # one more key, of value 0: b gets p_sink · ṡink, A nothing
            b_i += tl.math.exp2(tl.load(Sinks + off_h) * _LOG2E - lse) * tl.load(DSinks + off_h)
        lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
        for stage in tl.static_range(3):
            s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
            acc, b_i = _jvp_inner(
                acc, b_i, q, dq, lse, _at(K, seq_k, off_hk, KS), _at(V, seq_k, off_hk, VS),
                _at(DK, seq_k, off_hk, TKS), _at(DV, seq_k, off_hk, TVS), s_lo, s_hi, offs_m,
                cap, slope, dcap, dslope, SC, (KS[2], KS[3]), (VS[2], VS[3]),
                (TKS[2], TKS[3]), (TVS[2], TVS[3]), MASK, DMASK, BAND, DROP, HEAD_DIM,
                HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED, MASK_KIND, SCORE,
                HAS_DROPOUT, TAN, DOT_PRECISION)
        # -- epilogue: ȯ = A − b·o, lsė = b --
        o = _load_rows(_at(Out, seq_q, off_h, OS), offs_m, (OS[2], OS[3]), N_Q, HEAD_DIM_V,
                       BLOCK_DV, True)
        d_out = acc - b_i[:, None] * o.to(tl.float32)
        _store_rows(_at(DOut, seq_q, off_h, GS), offs_m, (GS[2], GS[3]), N_Q, d_out,
                    HEAD_DIM_V, BLOCK_DV)
        tl.store(DLse + row, b_i, mask=offs_m < N_Q)
