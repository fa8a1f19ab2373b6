"""Packed sequences on the triton backend: one program grid over (sequence, block), as
FlashAttention-2's varlen kernels.

Each program reads its sequence's offsets from ``cu_seqlens`` and then runs the tile steps of
``attn.flash_triton.kernels`` (``_fwd_inner``, ``_dkdv_inner``, ``_dq_inner``) on that sequence
alone: its length, its bottom-right band (offset ``Lk - Lq``), its dropout coordinates
(sequence b as batch row b, positions inside it — the padded batch's mask, as the tiled
varlen path draws it). Programs past their sequence's end return at once, so the grid is
sized by ``max_seqlen``, the only value read on the host. Layout ``(total, H, D)``; lse
``(H, total_q)``. Only the outer kernels live here; the tile math is the kernels module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl
from torch import Tensor

from attn.flash_triton.kernels import (_SATURATED_LOGL, _delta_inner, _dkdv_inner, _dq_inner,
                                       _drop_ctx, _fwd_inner, _load_rows, _stage_range,
                                       _stages, _value_offset)
from attn.flash_triton.launch import _UNBOUNDED, value_offset_args
from attn.flash_triton.tune import _configs, _prune, _tune_n
from attn.grads import reduce_to, sink_grad
from attn.masks import Band


@triton.jit
def _seq(CuQ, CuK, seq):
    """First token and length of sequence ``seq`` in q and in k (int64)."""
    q0 = tl.load(CuQ + seq).to(tl.int64)
    k0 = tl.load(CuK + seq).to(tl.int64)
    return q0, tl.load(CuQ + seq + 1).to(tl.int64) - q0, k0, tl.load(CuK + seq + 1).to(tl.int64) - k0


@triton.autotune(configs=_configs("fwd"), key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="fwd")})
@triton.jit(do_not_specialize=["drop_seed"])
def _varlen_fwd(Q, K, V, Out, Lse, LogL, Sinks, Softcap, Alibi, CuQ, CuK,
                stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
                stride_vn, stride_vh, stride_vd, stride_om, stride_oh, stride_od,
                stride_ab, stride_ah,
                H, GROUP, TOTAL_Q, left, right, scale,
                drop_seed, drop_threshold, inv_keep, TUNE_N,
                VMax, stride_vmb, stride_vmh, v_log_scale,
                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SINKS: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                V_OFFSET: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    seq = pid_sh // H
    off_h = pid_sh % H
    off_hk = off_h // GROUP
    q0, N_Q, k0, N_K = _seq(CuQ, CuK, seq)
    start_m = pid_m * BLOCK_M
    if start_m < N_Q:  # programs past this sequence's end have nothing to do
        Q += q0 * stride_qm + off_h.to(tl.int64) * stride_qh
        K += k0 * stride_kn + off_hk.to(tl.int64) * stride_kh
        V += k0 * stride_vn + off_hk.to(tl.int64) * stride_vh
        Out += q0 * stride_om + off_h.to(tl.int64) * stride_oh
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        offset = N_K - N_Q  # bottom-right, per sequence
        BAND = (N_Q, N_K, offset, left, right)
        MASK = (Q, 0, 0)  # MASK_KIND = 0: never read
        DROP = _drop_ctx(seq, off_h, drop_seed, drop_threshold, inv_keep, 0, 0, H, 0,
                         HAS_DROPOUT)
        # this sequence's own values set its offset: the others' never move its result
        voff = _value_offset(VMax + seq * stride_vmb + off_hk * stride_vmh, v_log_scale,
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
            slope = tl.load(Alibi + seq * stride_ab + off_h * stride_ah)
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
        tl.store(Lse + off_h.to(tl.int64) * TOTAL_Q + q0 + offs_m, lse, mask=offs_m < N_Q)
        # log l relative to the row max: the backward's saturation test (see _varlen_dq)
        logl = tl.where(l_i == 0.0, float("inf"), tl.log(l_safe) + voff)
        tl.store(LogL + off_h.to(tl.int64) * TOTAL_Q + q0 + offs_m, logl, mask=offs_m < N_Q)


@triton.autotune(configs=_configs("dkdv"), key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dkdv")},
                 reset_to_zero=["DCap"])
@triton.jit(do_not_specialize=["drop_seed"])
def _varlen_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, Softcap, Alibi, DCap, CuQ, CuK,
                 stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
                 stride_vn, stride_vh, stride_vd, stride_dom, stride_doh, stride_dod,
                 stride_dkn, stride_dkh, stride_dkd, stride_dvn, stride_dvh, stride_dvd,
                 stride_ab, stride_ah,
                 H, GROUP, TOTAL_Q, left, right, scale,
                 drop_seed, drop_threshold, inv_keep, TUNE_N,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_sk = tl.program_id(1)
    H_KV = H // GROUP
    seq = pid_sk // H_KV
    off_hk = pid_sk % H_KV
    q0, N_Q, k0, N_K = _seq(CuQ, CuK, seq)
    start_n = pid_n * BLOCK_N
    if start_n < N_K:
        K += k0 * stride_kn + off_hk.to(tl.int64) * stride_kh
        V += k0 * stride_vn + off_hk.to(tl.int64) * stride_vh
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k = _load_rows(K, offs_n, (stride_kn, stride_kd), N_K, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(V, offs_n, (stride_vn, stride_vd), N_K, HEAD_DIM_V, BLOCK_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        offset = N_K - N_Q
        BAND = (N_Q, N_K, offset, left, right)
        # the band seen from a key: queries i with -right <= i - (j - offset) <= left
        lo, a, b, hi = _stages(start_n, N_K, N_Q, -offset, right, left, BLOCK_N, BLOCK_M)
        # -- every query head of the GQA group adds into the same dK, dV --
        for g in range(0, GROUP):
            off_h = off_hk * GROUP + g
            Qh = Q + q0 * stride_qm + off_h.to(tl.int64) * stride_qh
            DOh = DO + q0 * stride_dom + off_h.to(tl.int64) * stride_doh
            rows = off_h.to(tl.int64) * TOTAL_Q + q0  # this head's rows of lse and Δ
            DROP = _drop_ctx(seq, off_h, drop_seed, drop_threshold, inv_keep, 0, 0, H, 0,
                             HAS_DROPOUT)
            cap = 1.0
            if HAS_SOFTCAP:
                cap = tl.load(Softcap + off_h)
            slope = 0.0
            if HAS_ALIBI:
                slope = tl.load(Alibi + seq * stride_ab + off_h * stride_ah)
            dc = 0.0
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                dk, dv, dc = _dkdv_inner(
                    dk, dv, dc, k, v, Qh, DOh, Lse + rows, Delta + rows, s_lo, s_hi, offs_n,
                    cap, slope, scale, (stride_qm, stride_qd), (stride_dom, stride_dod),
                    (Q, 0, 0), BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M,
                    stage != 1, BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                    DOT_PRECISION)
            if HAS_SOFTCAP:  # one partial sum per (key block, sequence, head)
                tl.store(DCap + pid_n.to(tl.int64) * tl.num_programs(1) * GROUP
                         + seq * H + off_h, dc)
        # -- epilogue: s = scale · q·k, so dK picks up the scale once here --
        dk *= scale
        DK += k0 * stride_dkn + off_hk.to(tl.int64) * stride_dkh
        DV += k0 * stride_dvn + off_hk.to(tl.int64) * stride_dvh
        tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
                 dk.to(DK.dtype.element_ty),
                 mask=(offs_n[:, None] < N_K) & (offs_d[None, :] < HEAD_DIM))
        tl.store(DV + offs_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
                 dv.to(DV.dtype.element_ty),
                 mask=(offs_n[:, None] < N_K) & (offs_dv[None, :] < HEAD_DIM_V))


@triton.autotune(configs=_configs("dq"),
                 key=["TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED", "DELTA_PASS"],
                 prune_configs_by={"early_config_prune": partial(_prune, kind="dq")})
@triton.jit(do_not_specialize=["drop_seed"])
def _varlen_dq(Q, K, V, DO, DQ, Lse, Delta, Softcap, Alibi, Sinks, CuQ, CuK,
               stride_qm, stride_qh, stride_qd, stride_kn, stride_kh, stride_kd,
               stride_vn, stride_vh, stride_vd, stride_dom, stride_doh, stride_dod,
               stride_dqm, stride_dqh, stride_dqd,
               stride_ab, stride_ah,
               H, GROUP, TOTAL_Q, left, right, scale,
               drop_seed, drop_threshold, inv_keep, TUNE_N, LogL,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BANDED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DELTA_PASS: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """dQ of one query block; with ``DELTA_PASS`` instead Δ = Σ_j P_ij dP_ij of a block
    holding a saturated row (``LogL``), written over rowsum(dO ∘ O) (dlse is subtracted
    by the launcher), as flash_triton's ``_attn_bwd_dq``."""
    pid_m = tl.program_id(0)
    pid_sh = tl.program_id(1)
    seq = pid_sh // H
    off_h = pid_sh % H
    off_hk = off_h // GROUP
    q0, N_Q, k0, N_K = _seq(CuQ, CuK, seq)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row = off_h.to(tl.int64) * TOTAL_Q + q0 + offs_m
    run = start_m < N_Q
    if DELTA_PASS:
        if run:
            logl = tl.load(LogL + row, mask=offs_m < N_Q, other=float("inf"))
            run = tl.min(logl, 0) < _SATURATED_LOGL
    if run:
        Q += q0 * stride_qm + off_h.to(tl.int64) * stride_qh
        K += k0 * stride_kn + off_hk.to(tl.int64) * stride_kh
        V += k0 * stride_vn + off_hk.to(tl.int64) * stride_vh
        DO += q0 * stride_dom + off_h.to(tl.int64) * stride_doh
        DQ += q0 * stride_dqm + off_h.to(tl.int64) * stride_dqh
        offs_d = tl.arange(0, BLOCK_D)
        offset = N_K - N_Q
        BAND = (N_Q, N_K, offset, left, right)
        DROP = _drop_ctx(seq, off_h, drop_seed, drop_threshold, inv_keep, 0, 0, H, 0,
                         HAS_DROPOUT)
        q = _load_rows(Q, offs_m, (stride_qm, stride_qd), N_Q, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DO, offs_m, (stride_dom, stride_dod), N_Q, HEAD_DIM_V, BLOCK_DV, True)
        lse = tl.load(Lse + row, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        cap = 1.0
        if HAS_SOFTCAP:
            cap = tl.load(Softcap + off_h)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + seq * stride_ab + off_h * stride_ah)
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
                    (stride_kn, stride_kd), (stride_vn, stride_vd), (Q, 0, 0), BAND, DROP,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, stage != 1, BANDED,
                    MASK_KIND, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
            delta = tl.where(psum > 0.0, delta / psum, 0.0)
            tl.store(Delta + row, delta, mask=offs_m < N_Q)
        else:
            delta = tl.load(Delta + row, mask=offs_m < N_Q, other=0.0)
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for stage in tl.static_range(3):
                s_lo, s_hi = _stage_range(stage, lo, a, b, hi)
                dq = _dq_inner(dq, q, do, lse, delta, K, V, s_lo, s_hi, offs_m, cap, slope,
                               scale, (stride_kn, stride_kd), (stride_vn, stride_vd),
                               (Q, 0, 0), BAND, DROP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                               BLOCK_N, stage != 1, BANDED, MASK_KIND, HAS_SOFTCAP, HAS_ALIBI,
                               HAS_DROPOUT, DOT_PRECISION)
            dq *= scale
            tl.store(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                     dq.to(DQ.dtype.element_ty),
                     mask=(offs_m[:, None] < N_Q) & (offs_d[None, :] < HEAD_DIM))


# -- launchers -----------------------------------------------------------------------------

@dataclass(frozen=True)
class VarlenParams:
    """Static values of one packed call (the varlen counterpart of LaunchSpec)."""

    qk_scale: float
    band: Band  # per sequence, in end-relative positions (attn.varlen.make_band_pair)
    max_q: int
    max_k: int
    dropout_p: float = 0.0
    dropout_seed: int = 0


def _common(q: Tensor, k: Tensor, v: Tensor, P: VarlenParams, has_softcap: bool,
            alibi: Tensor | None) -> tuple:
    """The scalars, the ALiBi pointer and strides (q and zeros when there are none: never
    read), and the constexprs every kernel shares."""
    H, D = q.shape[1], q.shape[2]
    Dv = v.shape[2]
    left = _UNBOUNDED if P.band.left is None else P.band.left
    right = _UNBOUNDED if P.band.right is None else P.band.right
    p = P.dropout_p
    scalars = (H, H // k.shape[1], q.shape[0], left, right, float(P.qk_scale),
               int(P.dropout_seed) & 0xFFFFFFFF, int(p * 2**32), 1.0 / (1.0 - p),
               _tune_n(P.max_q, P.max_k))
    slopes = (q, 0, 0) if alibi is None else (alibi, *alibi.stride())
    constexprs = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=max(16, triton.next_power_of_2(D)),
                      BLOCK_DV=max(16, triton.next_power_of_2(Dv)), BANDED=not P.band.is_full,
                      MASK_KIND=0, HAS_SOFTCAP=has_softcap, HAS_ALIBI=alibi is not None,
                      HAS_DROPOUT=p > 0.0,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return scalars, slopes, constexprs


def _fwd(q, k, v, cu_q, cu_k, P: VarlenParams, sinks, softcap, alibi=None
         ) -> tuple[Tensor, Tensor, Tensor]:
    """out, lse and logl (H, total_q): log l of each row relative to its max, which
    :func:`_bwd` takes to find saturated rows."""
    total_q, H, _ = q.shape
    n_seq = cu_q.numel() - 1
    out = torch.empty(total_q, H, v.shape[2], dtype=v.dtype, device=q.device)
    lse = torch.empty(H, total_q, dtype=torch.float32, device=q.device)
    logl = torch.empty(H, total_q, dtype=torch.float32, device=q.device)
    scalars, (slopes, *slope_strides), constexprs = _common(q, k, v, P, softcap is not None,
                                                            alibi)
    # the largest |v| of each (sequence, kv head): per token, then a segment max (unsafe:
    # cu_k is already checked, and checking it again would read it on the host)
    voff = value_offset_args(v, P.max_k, (2,))  # (total_k, Hkv)
    vmax_strides = (0, 0)
    if voff["V_OFFSET"]:
        voff["VMax"] = torch.segment_reduce(voff["VMax"], "max", offsets=cu_k.long(), axis=0,
                                            unsafe=True, initial=0.0)  # (sequences, Hkv)
        vmax_strides = voff["VMax"].stride()
    grid = lambda meta: (triton.cdiv(P.max_q, meta["BLOCK_M"]), n_seq * H)  # noqa: E731
    _varlen_fwd[grid](q, k, v, out, lse, logl, q if sinks is None else sinks,
                      q if softcap is None else softcap, slopes, cu_q, cu_k,
                      *q.stride(), *k.stride(), *v.stride(), *out.stride(), *slope_strides,
                      *scalars, stride_vmb=vmax_strides[0], stride_vmh=vmax_strides[1],
                      HAS_SINKS=sinks is not None, **voff, **constexprs)
    return out, lse, logl


def _bwd(do, dlse, q, k, v, out, lse, cu_q, cu_k, P: VarlenParams, sinks, softcap,
         alibi=None, logl=None):
    total_q, H, _ = q.shape
    Hkv = k.shape[1]
    n_seq = cu_q.numel() - 1
    if do.stride(-1) != 1:
        do = do.contiguous()
    # Δ = rowsum(dO ∘ O) − dlse, (H, total_q) like lse
    delta = (do.float() * out.float()).sum(-1).t().contiguous()
    scalars, (slopes, *slope_strides), constexprs = _common(q, k, v, P, softcap is not None,
                                                            alibi)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cap = q if softcap is None else softcap
    grid_q = lambda meta: (triton.cdiv(P.max_q, meta["BLOCK_M"]), n_seq * H)  # noqa: E731
    if logl is not None:  # Δ = Σ P·dP in the blocks holding a saturated row
        _varlen_dq[grid_q](q, k, v, do, dq, lse, delta, cap, slopes,
                           lse if sinks is None else sinks, cu_q, cu_k,
                           *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
                           *slope_strides, *scalars, logl, **constexprs, DELTA_PASS=True,
                           HAS_SINKS=sinks is not None)
    if dlse is not None:
        delta = delta - dlse.float()
    min_bn = min(c.kwargs["BLOCK_N"] for c in _varlen_dkdv.configs)
    n_part = triton.cdiv(P.max_k, min_bn) if softcap is not None else 1
    dcap_part = torch.zeros(n_part, n_seq * H, dtype=torch.float32, device=q.device)
    grid_kv = lambda meta: (triton.cdiv(P.max_k, meta["BLOCK_N"]), n_seq * Hkv)  # noqa: E731
    _varlen_dkdv[grid_kv](q, k, v, do, dk, dv, lse, delta, cap, slopes, dcap_part, cu_q, cu_k,
                          *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
                          *dv.stride(), *slope_strides, *scalars, **constexprs)
    _varlen_dq[grid_q](q, k, v, do, dq, lse, delta, cap, slopes, lse, cu_q, cu_k,
                       *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
                       *slope_strides, *scalars, lse, **constexprs, DELTA_PASS=False,
                       HAS_SINKS=False)
    dcap = None if softcap is None else dcap_part.view(-1, n_seq, H).sum(dim=(0, 1))
    dsinks = None if sinks is None else sink_grad(sinks, lse[None], delta[None])
    return dq, dk, dv, dsinks, dcap


class _VarlenFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, softcap, alibi, cu_q, cu_k, P: VarlenParams):
        H = q.shape[1]
        qk = q.to(k.dtype) if q.dtype != k.dtype else q  # a temperature folded in float32
        sinks_f = None if sinks is None else sinks.to(torch.float32).contiguous()
        cap_f = None
        if softcap is not None:
            cap_f = softcap.to(device=q.device, dtype=torch.float32).expand(H).contiguous()
        alibi_f = None if alibi is None else alibi.to(torch.float32)  # (sequences, H)
        out, lse, logl = _fwd(qk, k, v, cu_q, cu_k, P, sinks_f, cap_f, alibi_f)
        ctx.save_for_backward(qk, k, v, out, lse, logl, sinks_f, cap_f, alibi_f, cu_q, cu_k)
        ctx.P, ctx.q_dtype, ctx.shapes = P, q.dtype, (sinks, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        qk, k, v, out, lse, logl, sinks_f, cap_f, alibi_f, cu_q, cu_k = ctx.saved_tensors
        sinks, softcap = ctx.shapes
        do = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, dsinks, dcap = _bwd(do, dlse, qk, k, v, out, lse, cu_q, cu_k, ctx.P,
                                        sinks_f, cap_f, alibi_f, logl)
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)
        if dcap is not None and isinstance(softcap, Tensor) and softcap.requires_grad:
            dcap = reduce_to(dcap, softcap.shape).to(softcap.dtype)
        else:
            dcap = None
        return dq.to(ctx.q_dtype), dk, dv, dsinks, dcap, None, None, None, None


def varlen_triton(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor,
                  P: VarlenParams, *, sinks: Tensor | None = None,
                  softcap: Tensor | float | None = None, alibi: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """Inputs already validated by :func:`attn.varlen.varlen_attention`: q (total_q, H, D),
    k, v (total_k, Hkv, D / Dv) with a unit last stride, cu offsets on q's device, ALiBi
    slopes (sequences, H) (constants) → out (total_q, H, Dv), lse (H, total_q) float32."""
    if isinstance(softcap, float):
        softcap = torch.tensor(softcap, device=q.device)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _VarlenFlash.apply(q, k, v, sinks, softcap, alibi, cu_q.contiguous(),
                              cu_k.contiguous(), P)


__all__ = ["VarlenParams", "varlen_triton"]
