"""The outer kernels: one program per (block, sequence·head), for the dense layout
(B, H, N, D) and, with the ``VARLEN`` constexpr, packed sequences (total, H, D).

Each owns its block's initialisation and epilogue and walks the other axis in at most three
stages (masked edge, full middle, masked edge) through the inner loops of
:mod:`attn.flash_triton.kernels`. The only difference between the layouts is where a
program's sequence starts and how long it is (:func:`_seq_info`): dense, batch row b at the
batch strides with the call's lengths; packed, sequence b's first token (cu_seqlens, the
launcher passing the token strides as batch strides) with its own lengths and bottom-right
band, programs past its end leaving at once (the grid is sized by the longest sequence).
lse, Δ and log l are indexed through (sequence, head) strides: (B, H, N_Q) or (H, total_q).
"""

from __future__ import annotations

from functools import partial

import triton
import triton.language as tl

from attn.flash_triton.kernels import (_SATURATED_LOGL, _delta_inner, _dkdv_inner, _dq_inner,
                                       _drop_ctx, _fwd_inner, _head_consts, _load_rows,
                                       _stage_range, _stages, _value_offset)
from attn.flash_triton.tune import _configs, _prune

_KEY = ["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED", "VARLEN"]  # autotune: per layout too


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
def _row0(seq_q, off_b, off_h, H, N_Q, stride_lb, stride_lh, VARLEN: tl.constexpr):
    """Where (sequence, head)'s rows of lse, Δ and log l start: (B, H, N_Q) or (H, total_q).
    The dense form is one product (b·H + h)·N_Q, which keeps dK/dV's registers as they were."""
    if VARLEN:
        row0 = seq_q * stride_lb + off_h.to(tl.int64) * stride_lh
    else:
        row0 = (off_b * H + off_h).to(tl.int64) * N_Q
    return row0


@triton.autotune(configs=_configs("fwd"), key=_KEY,
                 prune_configs_by={"early_config_prune": partial(_prune, kind="fwd")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_fwd(Q, K, V, Out, Lse, LogL, Mask, Sinks, Softcap, Alibi, CuQ, CuK,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_mb, stride_mh, stride_mm, stride_mn,
              stride_ab, stride_ah, stride_lb, stride_lh,
              H, GROUP, N_Q, N_K, offset, left, right, scale,
              drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads, drop_head0,
              TUNE_N, VMax, stride_vmb, stride_vmh, v_log_scale,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SINKS: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              V_OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP  # GQA: the kv head this query head reads
    seq_q, seq_k, N_Q, N_K, offset = _seq_info(CuQ, CuK, off_b, N_Q, N_K, offset, VARLEN)
    start_m = pid_m * BLOCK_M
    run = True
    if VARLEN:
        run = start_m < N_Q  # programs past their sequence's end have nothing to do
    if run:
        Q += seq_q * stride_qb + off_h.to(tl.int64) * stride_qh
        K += seq_k * stride_kb + off_hk.to(tl.int64) * stride_kh
        V += seq_k * stride_vb + off_hk.to(tl.int64) * stride_vh
        Out += seq_q * stride_ob + off_h.to(tl.int64) * stride_oh
        Mask += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (Mask, stride_mm, stride_mn)
        DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0,
                         drop_col0, drop_heads, drop_head0, HAS_DROPOUT)
        # this sequence's own values set its offset: the others' never move its result
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
        cap, slope = _head_consts(Softcap, Alibi + off_b * stride_ab + off_h * stride_ah, off_h,
                                  HAS_SOFTCAP, HAS_ALIBI)
        q = _load_rows(Q, offs_m, (stride_qm, stride_qd), N_Q, HEAD_DIM, BLOCK_D, True)

        # -- loop over key tiles: masked edge, full middle, masked edge --
        lo, a, b, hi = _stages(start_m, N_Q, N_K, offset, left, right, BLOCK_M, BLOCK_N)
        for stage in tl.static_range(3):
            s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, K, V, s_lo, s_hi, offs_m, cap, slope, scale,
                (stride_kn, stride_kd), (stride_vn, stride_vd), MASK, BAND, DROP, voff,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
                MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, V_OFFSET, DOT_PRECISION)

        # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(Out + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(Out.dtype.element_ty),
                 mask=(offs_m[:, None] < N_Q) & (offs_dv[None, :] < HEAD_DIM_V))
        row = _row0(seq_q, off_b, off_h, H, N_Q, stride_lb, stride_lh, VARLEN) + offs_m
        tl.store(Lse + row, lse, mask=offs_m < N_Q)
        # log l relative to the row max (the value offset taken back): the backward's
        # saturation test, which lse alone cannot answer
        logl = tl.where(l_i == 0.0, float("inf"), tl.log(l_safe) + voff)
        tl.store(LogL + row, logl, mask=offs_m < N_Q)


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


@triton.autotune(configs=_configs("dkdv"), key=_KEY,
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dkdv")},
                 reset_to_zero=["DCap"])  # configs differ in how many partial sums they write
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, Mask, Softcap, Alibi, DCap, CuQ, CuK,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_mb, stride_mh, stride_mm, stride_mn,
                   stride_ab, stride_ah, stride_lb, stride_lh,
                   H, GROUP, N_Q, N_K, offset, left, right, scale,
                   drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads,
                   drop_head0, TUNE_N,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_ALIBI: tl.constexpr,
                   HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
        K += seq_k * stride_kb + off_hk.to(tl.int64) * stride_kh
        V += seq_k * stride_vb + off_hk.to(tl.int64) * stride_vh
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
            Qh = Q + seq_q * stride_qb + off_h.to(tl.int64) * stride_qh
            DOh = DO + seq_q * stride_dob + off_h.to(tl.int64) * stride_doh
            MASK = (Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh,
                    stride_mm, stride_mn)
            rows = _row0(seq_q, off_b, off_h, H, N_Q, stride_lb, stride_lh, VARLEN)  # lse, Δ
            DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0,
                             drop_col0, drop_heads, drop_head0, HAS_DROPOUT)
            cap, slope = _head_consts(Softcap, Alibi + off_b * stride_ab + off_h * stride_ah, off_h,
                                      HAS_SOFTCAP, HAS_ALIBI)
            dc = 0.0
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                dk, dv, dc = _dkdv_inner(
                    dk, dv, dc, k, v, Qh, DOh, Lse + rows, Delta + rows, s_lo, s_hi, offs_n,
                    cap, slope, scale, (stride_qm, stride_qd), (stride_dom, stride_dod), MASK,
                    BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, stage != 1,
                    BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
            if HAS_SOFTCAP:  # one partial sum per (key block, b, h); the launcher adds them up
                tl.store(DCap + pid_n.to(tl.int64) * tl.num_programs(1) * GROUP + off_b * H
                         + off_h, dc)

        # -- epilogue: s = scale · q·k, so dK picks up the scale once here --
        dk *= scale
        DK += seq_k * stride_dkb + off_hk.to(tl.int64) * stride_dkh
        DV += seq_k * stride_dvb + off_hk.to(tl.int64) * stride_dvh
        tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                 dk.to(DK.dtype.element_ty),
                 mask=(offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM))
        tl.store(DV + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
                 dv.to(DV.dtype.element_ty),
                 mask=(offs_n[:, None] < N_K) & (offs_dv[None, :] < HEAD_DIM_V))


@triton.autotune(configs=_configs("dq"), key=_KEY + ["DELTA_PASS"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dq")})
@triton.jit(do_not_specialize=["drop_seed"])  # a seed of 1 would become a constant: one compile per seed
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, Mask, Softcap, Alibi, Sinks, CuQ, CuK,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_mb, stride_mh, stride_mm, stride_mn,
                 stride_ab, stride_ah, stride_lb, stride_lh,
                 H, GROUP, N_Q, N_K, offset, left, right, scale,
                 drop_seed, drop_threshold, inv_keep, drop_row0, drop_col0, drop_heads,
                 drop_head0, TUNE_N, LogL, DLse,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DELTA_PASS: tl.constexpr, HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr,
                 VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of one query block; with ``DELTA_PASS``, instead, Δ = Σ_j P_ij dP_ij (− dlse) of
    a query block holding a saturated row (``LogL``: log l of each row relative to its max,
    from the forward), written over the preprocessing's rowsum(dO ∘ O). Other blocks leave
    at once: an ordinary call pays one launch and a load of LogL."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    off_hk = off_h // GROUP
    seq_q, seq_k, N_Q, N_K, offset = _seq_info(CuQ, CuK, off_b, N_Q, N_K, offset, VARLEN)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row = _row0(seq_q, off_b, off_h, H, N_Q, stride_lb, stride_lh, VARLEN) + offs_m
    run = True
    if VARLEN:
        run = start_m < N_Q
    if DELTA_PASS:
        if run:
            logl = tl.load(LogL + row, mask=offs_m < N_Q, other=float("inf"))
            run = tl.min(logl, 0) < _SATURATED_LOGL
    if run:
        Q += seq_q * stride_qb + off_h.to(tl.int64) * stride_qh
        K += seq_k * stride_kb + off_hk.to(tl.int64) * stride_kh
        V += seq_k * stride_vb + off_hk.to(tl.int64) * stride_vh
        DO += seq_q * stride_dob + off_h.to(tl.int64) * stride_doh
        DQ += seq_q * stride_dqb + off_h.to(tl.int64) * stride_dqh
        Mask += off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
        offs_d = tl.arange(0, BLOCK_D)
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (Mask, stride_mm, stride_mn)
        DROP = _drop_ctx(off_b, off_h, drop_seed, drop_threshold, inv_keep, drop_row0,
                         drop_col0, drop_heads, drop_head0, HAS_DROPOUT)
        q = _load_rows(Q, offs_m, (stride_qm, stride_qd), N_Q, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DO, offs_m, (stride_dom, stride_dod), N_Q, HEAD_DIM_V, BLOCK_DV, True)
        lse = tl.load(Lse + row, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        cap, slope = _head_consts(Softcap, Alibi + off_b * stride_ab + off_h * stride_ah, off_h,
                                  HAS_SOFTCAP, HAS_ALIBI)
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
