"""The jit helpers and inner loops every outer kernel shares: tile loads, the score pipeline
with its launch arguments (:func:`score_args`), the dropout hash, the stages of a block's
walk, and the loops over the other axis (``_fwd_inner``, ``_dkdv_inner``, ``_dq_inner``,
``_jvp_inner``). ``_INTERPRET`` is decided here. docs/gpu.md, "How the kernels work".
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn.grads import SATURATED_LOG2L

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
# The interpreter's tl.dot multiplies bfloat16 tiles as their raw uint16 bits: feed it float64
# (exact products of 16- and 32-bit floats, see _dot).
_DOT_UPCAST = tl.constexpr(_INTERPRET)
# The softmax runs in base 2: scores are kept as s·log2(e), so that each exponent is one
# exp2 of one fused multiply-add (the q·k scale carries the log2(e) factor); lse and log l
# leave the kernels in natural units, converted once per row.
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# A row whose denominator l (relative to its max, natural log) is within this of 1: its
# softmax is saturated (one P ≈ 1) and the backward takes Δ = Σ P·dP (see _dq_inner)
_SATURATED_LOGL = tl.constexpr(SATURATED_LOG2L * 0.6931471805599453)


# -- the score pipeline's launch arguments -------------------------------------------------
# Two bundles reach every kernel that builds scores, and pass unchanged through the outer
# kernels and inner loops to _scores: SC, the runtime constants, and SCORE, the constexpr
# flags (a tuple of bools: triton specializes on each). These name their places.
_SCALE = tl.constexpr(0)  # SC: the q·k scale (the epilogues' dK, dQ take it too)
_SCALE2 = tl.constexpr(1)  # SC: the scale times log2(e), rounded once: base-2 scores
_SOFTCAP = tl.constexpr(0)  # SCORE: a softcap (its per-head value: the Softcap pointer)
_ALIBI = tl.constexpr(1)  # SCORE: ALiBi (its per-head slope: the Alibi pointer)
_NEG_SCALE = tl.constexpr(2)  # SCORE: the scale is negative (a row's max of s is its min of q·k)


# The static score variants' terms (attn.spec.ScoreTerms, by name) _scores applies; a call
# carrying any other is refused (flash_triton.unsupported_reason, and score_args below)
SCORE_TERMS: tuple[str, ...] = ()


def score_args(spec, *, softcap: bool, alibi: bool) -> dict:
    """``SC`` and ``SCORE`` of one call (an :class:`attn.spec.LaunchSpec`; ``softcap`` /
    ``alibi``: whether the launcher passes those tensors). A static score variant (a term of
    ``spec.terms``, named in ``SCORE_TERMS``) appends its value to ``SC`` and its flag to
    ``SCORE`` here, names their places above and reads them in :func:`_scores`: no launcher,
    outer kernel or inner loop changes."""
    spec.terms.refuse_unknown(SCORE_TERMS, "the triton kernels")
    scale = float(spec.qk_scale)
    return dict(SC=(scale, scale * 1.4426950408889634), SCORE=(softcap, alibi, scale < 0.0))


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
    if CHECK_A and CHECK_B:
        x = tl.load(ptrs, mask=ok_a & ok_b, other=0.0)
    elif CHECK_A:
        x = tl.load(ptrs, mask=ok_a, other=0.0)
    elif CHECK_B:
        x = tl.load(ptrs, mask=ok_b, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _stages(start, n_own, n_other, offset, left, right, BLOCK_OWN, BLOCK: tl.constexpr):
    """Split the other axis for the own block [start, start + BLOCK_OWN) into tile starts
    [lo, a) masked, [a, b) full (every pair inside the band and the tensors), [b, hi) masked.
    ``BLOCK_OWN`` may be a runtime length: the split-KV kernel's block holds every query.

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
def _drop_ctx(off_b, off_h, drop_seed, DR, HAS_DROPOUT: tl.constexpr):
    """One (batch, head)'s dropout context: the hash of its *global* index b·H + h (H and h
    of the whole computation: a head shard draws the unsharded mask), threshold, scale,
    and the global position of this call's first query and key. ``DR``: (threshold,
    1 / keep, first query, first key, heads in all, first head), the launcher's order."""
    h_bh = 0
    if HAS_DROPOUT:
        bh = off_b * DR[4] + DR[5] + off_h
        h_bh = _mix32(bh.to(tl.uint32) ^ _mix32(drop_seed.to(tl.uint32)))
    return (h_bh, DR[0], DR[1], DR[2], DR[3])


@triton.jit
def _head_consts(Softcap, Alibi, AS, off_b, off_h, SCORE: tl.constexpr):
    """Head ``off_h``'s softcap (1.0 without one) and sequence ``off_b``'s ALiBi slope for it
    (0.0 without; ``AS``: the slopes' (sequence, head) strides)."""
    cap = 1.0
    if SCORE[_SOFTCAP]:
        cap = tl.load(Softcap + off_h)
    slope = 0.0
    if SCORE[_ALIBI]:
        slope = tl.load(Alibi + off_b * AS[0] + off_h * AS[1])
    return cap, slope


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
def _store_rows(P, offs, STRIDES, N, val, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """``val`` (len(offs), BLOCK) into rows ``offs`` of a (N, DIM) matrix, in P's dtype."""
    stride_n, stride_d = STRIDES
    offs_d = tl.arange(0, BLOCK)
    tl.store(P + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
             val.to(P.dtype.element_ty), mask=(offs[:, None] < N) & (offs_d[None, :] < DIM))


@triton.constexpr_function
def _is_raw(MASKED, MASK_KIND, SCORE):
    """A tile whose scores are q·k times the scale alone (no masking, attn_mask or score
    flag on: softcap, ALiBi, or one a variant appends): its exponents are exp2(q·k·c − m),
    one FFMA each, on raw q·k."""
    flags = [f for i, f in enumerate(SCORE) if i != _NEG_SCALE.value]
    return not MASKED and MASK_KIND == 0 and not any(flags)


@triton.jit
def _scores(qk, om, on, MASK, cap, slope, SC, BAND,
            MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
            SCORE: tl.constexpr):
    """Scores of a tile from q·k in base 2 (s·log2 e): scale, softcap, ALiBi, band and
    attn_mask. ``om``/``on`` are the query/key indices broadcast to the tile's layout (either
    orientation); ``MASK = (Mask, stride_mm, stride_mn)``, ``BAND = (N_Q, N_K, offset, left,
    right)`` in local positions; ``SC`` / ``SCORE`` the pipeline's constants and flags
    (:func:`score_args`); ``cap`` / ``slope`` this head's softcap and ALiBi slope. With
    softcap also returns u = s_raw / c and t = tanh(u), which the backward needs (the bias,
    a constant, needs nothing); u and t are of the natural-unit scores."""
    Mask, stride_mm, stride_mn = MASK
    N_Q, N_K, offset, left, right = BAND
    s = qk * SC[_SCALE2]
    u = s
    t = s
    if SCORE[_SOFTCAP]:
        u = (qk * SC[_SCALE]) / cap
        t = _tanh(u)
        s = (cap * _LOG2E) * t
    if SCORE[_ALIBI]:  # −slope·|distance from the band's diagonal|, after the cap
        s = s - (slope * _LOG2E) * tl.abs(on - (om + offset)).to(tl.float32)
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
        s = tl.where(mv == float("-inf"), float("-inf"), s + mv * _LOG2E)
    return s, u, t


@triton.jit
def _raw_max(qk, SC, SCORE: tl.constexpr):
    """A tile's row max of the base-2 scores taken on raw q·k (the scale applied to one
    value per row): max(q·k)·c, or min(q·k)·c for a negative scale c (rounding is monotone,
    so this is the max of the scaled scores, bit for bit)."""
    if SCORE[_NEG_SCALE]:
        return tl.min(qk, 1) * SC[_SCALE2]
    else:
        return tl.max(qk, 1) * SC[_SCALE2]


@triton.jit
def _qk_scores(q, K, offs_m, offs_n, offs_n0, cap, slope, SC, KSTR, MASK, BAND,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """The query-resident tile step shared by the forward and dQ: load Kᵀ, s = q·kᵀ, scores
    (a tile that :func:`_is_raw` finds has none returns q·k as s)."""
    N_K = BAND[1]
    # the tile's scalar start, then loop-invariant offsets: fewer address instructions
    start_n = offs_n0
    kT = _load_cols(K + start_n * KSTR[0], offs_n - start_n, KSTR, N_K - start_n, HEAD_DIM,
                    BLOCK_D, MASKED)
    qk = _dot(q, kT, None, DOT_PRECISION)
    if _is_raw(MASKED, MASK_KIND, SCORE):
        s, u, t = qk, qk, qk
    else:
        s, u, t = _scores(qk, offs_m[:, None], offs_n[None, :], MASK, cap, slope, SC, BAND,
                          MASKED, BANDED, MASK_KIND, SCORE)
    return kT, s, u, t


@triton.jit
def _stage_range(STAGE: tl.constexpr, lo, a, b, hi):
    """Tile starts of stage 0 (masked edge), 1 (full middle) or 2 (masked edge)."""
    if STAGE == 1:
        return a, b
    elif STAGE == 2:
        return b, hi
    else:
        return lo, a


# -- forward -------------------------------------------------------------------------------

@triton.jit
def _value_offset(VMax, v_log_scale, V_OFFSET: tl.constexpr):
    """The forward's exponent offset ``c = log(max|v| · 2·N_K / fmax)`` (``v_log_scale =
    log(2·N_K / fmax)``) for one (sequence, kv head), in base 2 (c·log2 e) for the row max
    it rides on; 0 where not positive (every ordinary call: the plain steps bit for bit) and
    for NaN / inf; float16 (``V_OFFSET`` False) never needs it. Why: docs/design.md, "Values
    near the dtype's largest"."""
    c = 0.0
    if V_OFFSET:
        c = tl.log(tl.load(VMax).to(tl.float32)) + v_log_scale
        c = tl.where((c > 0.0) & (c < float("inf")), c * _LOG2E, 0.0)
    return c


@triton.jit
def _softmax_step(s, m_i, l_i, voff, SC, RAW: tl.constexpr, SCORE: tl.constexpr,
                  V_OFFSET: tl.constexpr):
    """One key tile's step of the online softmax in base 2: the tile's p (up to 1 / l),
    alpha (which rescales what earlier tiles gave acc), and the new l_i and m_i (m in base
    2). ``s``: the base-2 scores, or with ``RAW`` the tile's raw q·k (scaled here, its row
    max on q·k and each exponent one FFMA). Rows that have seen nothing yet keep m_safe = 0;
    the value offset (base 2) rides on the row max (_value_offset)."""
    if RAW:
        row_max = _raw_max(s, SC, SCORE)
    else:
        row_max = tl.max(s, 1)
    if V_OFFSET:
        m_new = tl.maximum(m_i, row_max + voff)
    else:
        m_new = tl.maximum(m_i, row_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if RAW:
        p = tl.math.exp2(s * SC[_SCALE2] - m_safe[:, None])
    else:
        p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def _lse_of(m_i, l_i):
    """lse in natural units of a row's base-2 max and denominator: -inf where l = 0."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, lo, hi, offs_m, cap, slope, SC, KSTR, VSTR, MASK, BAND,
               DROP, voff, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
               SCORE: tl.constexpr, HAS_DROPOUT: tl.constexpr, V_OFFSET: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    N_K = BAND[1]
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED and not BANDED else None):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- compute qk --
        kT, s, u, t = _qk_scores(q, K, offs_m, offs_n, start_n, cap, slope, SC, KSTR, MASK, BAND,
                                 HEAD_DIM, BLOCK_D, MASKED, BANDED, MASK_KIND, SCORE,
                                 DOT_PRECISION)
        # -- online softmax --
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, voff, SC,
                                             _is_raw(MASKED, MASK_KIND, SCORE), SCORE,
                                             V_OFFSET)
        if HAS_DROPOUT:  # the denominator counts every key, the values only the kept ones
            p = p * _dropout_scale(DROP, offs_m[:, None], offs_n[None, :])
        # -- update acc --
        v = _load_rows(V + start_n * VSTR[0], tl.arange(0, BLOCK_N), VSTR, N_K - start_n,
                       HEAD_DIM_V, BLOCK_DV, MASKED)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i



@triton.jit
def _dkdv_inner(dk, dv, dc, k, v, Q, DO, Lse, Delta, lo, hi, offs_n, cap, slope, SC, QSTR,
                DOSTR, MASK, BAND, DROP, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
                SCORE: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # transposed tiles (keys x queries), so neither P nor dS needs a transpose
    N_Q = BAND[0]
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load_cols(Q, offs_m, QSTR, N_Q, HEAD_DIM, BLOCK_D, MASKED)
        # lse (base 2: the forward's Lse2) = -inf marks a row that saw nothing: +inf makes
        # its P exactly 0
        lse = tl.load(Lse + offs_m, mask=offs_m < N_Q, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        # -- recompute P from lse --
        qkT = _dot(k, qT, None, DOT_PRECISION)
        om = offs_m[None, :]
        on = offs_n[:, None]
        if _is_raw(MASKED, MASK_KIND, SCORE):
            uT, tT = qkT, qkT
            pT = tl.math.exp2(qkT * SC[_SCALE2] - lse[None, :])
        else:
            sT, uT, tT = _scores(qkT, om, on, MASK, cap, slope, SC, BAND, MASKED, BANDED,
                                 MASK_KIND, SCORE)
            pT = tl.math.exp2(sT - lse[None, :])
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
        if SCORE[_SOFTCAP]:
            # s = c·tanh(u), u = s_raw/c: ds_raw = ds·(1 − t²); dc = Σ ds·(t − u(1 − t²))
            one_m_t2 = 1.0 - tT * tT
            dc += tl.sum(tl.sum(dsT * (tT - uT * one_m_t2), 1), 0)
            dsT = dsT * one_m_t2
        # -- dK += dSᵀ Q --
        dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PRECISION)
    return dk, dv, dc



@triton.jit
def _dq_inner(dq, delta, psum, q, do, lse, K, V, lo, hi, offs_m, cap, slope, SC, KSTR, VSTR,
              MASK, BAND, DROP, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, BANDED: tl.constexpr, MASK_KIND: tl.constexpr,
              SCORE: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DELTA_PASS: tl.constexpr):
    """The query-resident backward over key tiles [lo, hi): P recomputed from lse (base 2,
    as the forward's Lse2) and dP = dO Vᵀ (dropout-scaled), then either ``dq += dS K`` with
    dS = P ∘ (dP − Δ), ``delta`` holding each row's Δ, or, with ``DELTA_PASS``,
    ``delta += Σ_j p_ij dp_ij`` and ``psum += Σ_j p_ij`` (``dq`` untouched). The two share
    one P and dP so that the Δ pass sums exactly what dQ multiplies (docs/design.md,
    "Saturated rows"). The caller divides the pass's sum by Σ P: at logits of 1e3 and up, P
    recomputed from one float32 lse is off by a common factor of up to e^(ulp(lse)), which
    the quotient cancels."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT, s, u, t = _qk_scores(q, K, offs_m, offs_n, start_n, cap, slope, SC, KSTR, MASK, BAND,
                                 HEAD_DIM, BLOCK_D, MASKED, BANDED, MASK_KIND, SCORE,
                                 DOT_PRECISION)
        if _is_raw(MASKED, MASK_KIND, SCORE):
            p = tl.math.exp2(s * SC[_SCALE2] - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None])
        vT = _load_cols(V, offs_n, VSTR, BAND[1], HEAD_DIM_V, BLOCK_DV, MASKED)
        dp = _dot(do, vT, None, DOT_PRECISION)
        if HAS_DROPOUT:
            dp = dp * _dropout_scale(DROP, offs_m[:, None], offs_n[None, :])
        if DELTA_PASS:
            delta += tl.sum(p * dp, 1)
            psum += tl.sum(p, 1)
        else:
            ds = p * (dp - delta[:, None])
            if SCORE[_SOFTCAP]:
                ds = ds * (1.0 - t * t)
            if MASKED or MASK_KIND != 0:
                # a masked key has dS = 0, but 0·NaN would still reach dQ: a non-finite key
                # enters dQ as 0 (a row that sees it has a NaN dS anyway)
                kT = tl.where(tl.abs(kT) < float("inf"), kT, 0.0)
            # -- dQ += dS K --
            dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq, DOT_PRECISION)
    return dq, delta, psum


# -- forward-mode (JVP) --------------------------------------------------------------------
# TAN's flags: which tangents the launcher passes (a missing one is zero: never loaded)
_T_Q = tl.constexpr(0)
_T_K = tl.constexpr(1)
_T_V = tl.constexpr(2)
_T_MASK = tl.constexpr(3)  # the float attn_mask's tangent


@triton.jit
def _jvp_inner(acc, b_i, q, dq, lse, K, V, DK, DV, lo, hi, offs_m, cap, slope, dcap, dslope,
               SC, KSTR, VSTR, DKSTR, DVSTR, MASK, DMASK, BAND, DROP,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, TAN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The query-resident tangent pass over key tiles [lo, hi): P recomputed from lse (base
    2, the forward's Lse2) and the scores' tangent ṡ in natural units, then
    ``acc += (P∘ṡ∘z)·V + (P∘z)·V̇`` and ``b_i += Σ_j P∘ṡ`` (z: dropout's kept scale), so that
    ȯ = acc − b·o and lsė = b (see :func:`attn.flash_triton.outer._attn_jvp`).

    ṡ of s = c·tanh(u), u = scale·q·k / c: (1 − t²)·scale·(q̇·kᵀ + q·k̇ᵀ) + ċ·(t − u(1 − t²));
    ALiBi subtracts ṡlope·|distance|, a float mask adds its tangent. A masked entry (P = 0)
    adds nothing, whatever its tangent (an inf there would give 0·inf)."""
    N_K = BAND[1]
    DMask, stride_dm, stride_dn = DMASK
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT, s, u, t = _qk_scores(q, K, offs_m, offs_n, start_n, cap, slope, SC, KSTR, MASK,
                                 BAND, HEAD_DIM, BLOCK_D, MASKED, BANDED, MASK_KIND, SCORE,
                                 DOT_PRECISION)
        if _is_raw(MASKED, MASK_KIND, SCORE):
            p = tl.math.exp2(s * SC[_SCALE2] - lse[:, None])
        else:
            p = tl.math.exp2(s - lse[:, None])
        # -- ṡ: the raw scores' tangent, then through softcap, ALiBi and the mask --
        sd = tl.zeros_like(p)
        if TAN[_T_Q]:
            sd = _dot(dq, kT, sd, DOT_PRECISION)
        if TAN[_T_K]:
            dkT = _load_cols(DK, offs_n, DKSTR, N_K, HEAD_DIM, BLOCK_D, MASKED)
            sd = _dot(q, dkT, sd, DOT_PRECISION)
        sd = sd * SC[_SCALE]
        om = offs_m[:, None]
        on = offs_n[None, :]
        if SCORE[_SOFTCAP]:
            one_m_t2 = 1.0 - t * t
            sd = sd * one_m_t2 + dcap * (t - u * one_m_t2)
        if SCORE[_ALIBI]:
            sd = sd - dslope * tl.abs(on - (om + BAND[2])).to(tl.float32)
        if TAN[_T_MASK]:
            sd += tl.load(DMask + om * stride_dm + on * stride_dn,
                          mask=(om < BAND[0]) & (on < N_K), other=0.0).to(tl.float32)
        psd = tl.where(p > 0.0, p * sd, 0.0)
        b_i += tl.sum(psd, 1)
        if HAS_DROPOUT:
            z = _dropout_scale(DROP, om, on)
            p = p * z
            psd = psd * z
        # -- A += (P∘ṡ)·V + P·V̇ --
        v = _load_rows(V + start_n * VSTR[0], tl.arange(0, BLOCK_N), VSTR, N_K - start_n,
                       HEAD_DIM_V, BLOCK_DV, MASKED)
        acc = _dot(psd.to(v.dtype), v, acc, DOT_PRECISION)
        if TAN[_T_V]:
            dv = _load_rows(DV + start_n * DVSTR[0], tl.arange(0, BLOCK_N), DVSTR,
                            N_K - start_n, HEAD_DIM_V, BLOCK_DV, MASKED)
            acc = _dot(p.to(dv.dtype), dv, acc, DOT_PRECISION)
    return acc, b_i
