"""The triton backend's launchers, custom ops, autograd.Function and public function, dense and
packed alike (docs/gpu.md, "How the kernels work" and "The kernels' arguments").
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attn.flash_triton.outer import (_attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_preprocess,
                                     _attn_fwd, _attn_jvp)
from attn.flash_triton import kernels
from attn.flash_triton.kernels import _INTERPRET, score_args
from attn.flash_triton.paged import _attn_fwd_paged
from attn.flash_triton.split import (MAX_SPLITS, SplitPlan, _attn_fwd_split,
                                     _attn_split_combine, combine_block, sm_count_of,
                                     split_kv_override, split_kv_plan, split_kv_unsupported)
from attn.flash_triton.tune import _tune_n, cdiv, pow2, split_config
from attn import batching, transforms
from attn.grads import Grads, sink_grad
from attn.masks import as_4d
from attn.spec import LaunchSpec, Operands, ScoreTerms, check_paged_forward_only

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_UNBOUNDED = 1 << 30  # an open band side: farther than any key is from any query


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
    unknown = [n for n in call.terms if n not in kernels.SCORE_TERMS]
    if unknown:
        return (f"the score term(s) {unknown} (the kernels' _scores applies "
                f"{list(kernels.SCORE_TERMS)})")
    return None


# -- launchers -----------------------------------------------------------------------------

def _strides(t: Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(sequence, head, row, dim) strides of q, k, v, out or their gradients: a packed
    (total, H, D) tensor's token stride is both, the kernels adding the sequence's first
    token times it."""
    return (t.stride(0), t.stride(1), t.stride(0), t.stride(2)) if varlen else t.stride()


@dataclass(frozen=True)
class _Launch:
    """One call's kernel inputs and the arguments its kernels share, dense or packed, derived
    once per call by :func:`_launch_args`: the one place they are assembled."""

    q: Tensor  # in k's dtype (a temperature folded in float32: the kernels take one dtype)
    sinks: Tensor | None  # contiguous float32 (H,)
    softcap: Tensor | None  # contiguous float32 (H,): learnable, or the spec's fixed one
    batch: int  # batch rows, or packed sequences
    H: int
    group: int
    n_q: int  # the call's lengths (packed: the longest sequence's)
    n_k: int
    varlen: bool
    # by name, what every kernel of the call takes alike, the split kernel too (q in place of
    # a tensor that is absent: never read; head dims padded to powers of two in the kernels)
    shared: dict
    plain: dict  # ... and what the plain kernels (forward, dQ, dK/dV, jvp) take besides

    def strides(self, t: Tensor) -> tuple[int, int, int, int]:
        return _strides(t, self.varlen)

    def row_strides(self, lse: Tensor) -> tuple[int, int]:
        """(sequence, head) strides of lse, Δ and log l: (B, H, N_Q), or (H, total_q)."""
        return (lse.stride(1), lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def rows(self, q: Tensor) -> tuple[int, ...]:
        """The shape of lse: (B, H, N_Q), or (H, total_q)."""
        return (self.H, q.shape[0]) if self.varlen else (self.batch, self.H, self.n_q)

    def grid_q(self, meta: dict) -> tuple[int, int]:
        """The query-resident kernels' grid: (query blocks, sequences · heads)."""
        return cdiv(self.n_q, meta["BLOCK_M"]), self.batch * self.H


def _band_args(spec: LaunchSpec) -> dict:
    """The band's kernel arguments: its diagonal offset and sides (an open side
    ``_UNBOUNDED``), and ``BANDED``, whether it cuts anything."""
    band = spec.local_band()
    return dict(offset=band.offset, left=_UNBOUNDED if band.left is None else band.left,
                right=_UNBOUNDED if band.right is None else band.right, BANDED=not band.is_full)


def _head_dim_args(D: int, Dv: int, dtype: torch.dtype) -> dict:
    """The head dims, their power-of-two tiles and the dots' precision (float32: exact)."""
    return dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=max(16, pow2(D)), BLOCK_DV=max(16, pow2(Dv)),
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _launch_args(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands) -> _Launch:
    q, sinks, softcap = _kernel_inputs(q, k, spec, ops.sinks, ops.softcap)
    varlen = ops.cu_seqlens_q is not None
    if varlen:  # (total, H, D), the grid sized by the longest sequence
        if ops.attn_mask is not None:
            raise NotImplementedError("triton: an attn_mask with packed sequences")
        batch, H, D = ops.cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
        Nq, Nk = spec.max_seqlen_q, spec.max_seqlen_k
    else:
        batch, H, Nq, D = q.shape
        Nk = k.shape[2]
    Hkv, Dv = k.shape[1], v.shape[-1]
    p = spec.dropout_p
    attn_mask = ops.attn_mask
    mask, mask_strides = _mask_arg(attn_mask, q, Nk)
    slopes, slope_strides = _alibi_arg(ops.alibi, q, batch, H)
    shared = dict(
        Q=q, K=k, V=v, Mask=mask, Softcap=q if softcap is None else softcap, Alibi=slopes,
        QS=_strides(q, varlen), KS=_strides(k, varlen), VS=_strides(v, varlen),
        MS=mask_strides, AS=slope_strides, H=H, GROUP=H // Hkv, N_Q=Nq, N_K=Nk,
        **_band_args(spec),
        **score_args(spec, softcap=softcap is not None, alibi=ops.alibi is not None),
        **_head_dim_args(D, Dv, q.dtype),
        MASK_KIND=0 if attn_mask is None else (1 if attn_mask.dtype == torch.bool else 2))
    # dropout's values in _drop_ctx's order: threshold, 1 / keep, the global positions of the
    # first query and key, the query heads of the whole computation and this call's first
    dropout = (int(p * 2**32), 1.0 / (1.0 - p), spec.q_start, spec.k_start,
               spec.heads_total or H, spec.head_start)
    plain = dict(CuQ=ops.cu_seqlens_q if varlen else q, CuK=ops.cu_seqlens_k if varlen else q,
                 drop_seed=int(spec.dropout_seed) & 0xFFFFFFFF, DR=dropout,
                 TUNE_N=_tune_n(Nq, Nk), HAS_DROPOUT=p > 0.0, VARLEN=varlen)
    return _Launch(q, sinks, softcap, batch, H, H // Hkv, Nq, Nk, varlen, shared, plain)


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


def _alibi_arg(alibi: Tensor | None, q: Tensor, batch: int, H: int
               ) -> tuple[Tensor, tuple[int, int]]:
    """The slopes as float32 (sequences, H) (an expanded view keeps its stride 0), or q and
    zero strides when there are none (never read: SCORE's ALiBi flag off)."""
    if alibi is None:
        return q, (0, 0)
    a = alibi.to(torch.float32).expand(batch, H)
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


def _value_offsets(v: Tensor, L: _Launch, ops: Operands) -> dict:
    """:func:`value_offset_args` per (sequence, kv head), with VMax's strides."""
    if not L.varlen:
        voff = value_offset_args(v, L.n_k, (2, 3))  # (B, Hkv)
    else:
        # the largest |v| of each token, then a segment max per sequence (unsafe: the
        # offsets are checked by the caller, and checking again would read them on the host)
        voff = value_offset_args(v, L.n_k, (2,))  # (total_k, Hkv)
        if voff["V_OFFSET"]:
            voff["VMax"] = torch.segment_reduce(voff["VMax"], "max",
                                                offsets=ops.cu_seqlens_k.long(), axis=0,
                                                unsafe=True, initial=0.0)  # (sequences, Hkv)
    return dict(voff, VMS=voff["VMax"].stride() if voff["V_OFFSET"] else (0, 0))


def _kernel_inputs(q: Tensor, k: Tensor, spec: LaunchSpec, sinks: Tensor | None,
                   softcap: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """q in k's dtype, sinks and the softcap (learnable, else the spec's fixed one) as
    contiguous float32 (H,) vectors: what the kernels read."""
    H = q.shape[1]  # (B, H, N, D) or packed (total, H, D)
    if q.dtype != k.dtype:  # a temperature folded in float32: the kernels take one dtype
        q = q.to(k.dtype)
    if softcap is None and spec.softcap is not None:
        softcap = torch.tensor(float(spec.softcap), device=q.device)
    if softcap is not None:
        softcap = softcap.to(device=q.device, dtype=torch.float32).expand(H).contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    return q, sinks, softcap


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands | None = None, *,
         want_logl: bool = False) -> tuple[Tensor, ...]:
    """``(out, lse)``, and with ``want_logl`` also ``logl`` (lse's shape): log of each row's
    denominator relative to its max (+inf for rows with no key), which :func:`_bwd` takes
    to find saturated rows, and ``lse2``: lse in base 2 as the kernel's softmax had it,
    which :func:`_bwd` reads instead of converting lse back."""
    ops = Operands() if ops is None else ops
    L = _launch_args(q, k, v, spec, ops)
    q, sinks = L.q, L.sinks
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=q.device)
    lse = torch.empty(L.rows(q), dtype=torch.float32, device=q.device)
    logl, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    _attn_fwd[L.grid_q](
        Out=out, Lse=lse, LogL=logl, Lse2=lse2, Sinks=q if sinks is None else sinks,
        OS=L.strides(out), LS=L.row_strides(lse), HAS_SINKS=sinks is not None,
        **_value_offsets(v, L, ops), **L.shared, **L.plain)
    return (out, lse, logl, lse2) if want_logl else (out, lse)


def split_plan_for(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands, *,
                   grad: bool, transform: str | None = None) -> SplitPlan | None:
    """The split-KV plan of a dense call (q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv,
    Nk, Dv)), or None when it runs the plain kernels: not eligible
    (``split_kv_unsupported``), or one chunk. Reads ``ATTN_TRITON_SPLIT_KV`` at the call."""
    why = split_kv_unsupported(n_q=q.shape[2], grad=grad, dropout=spec.dropout_p > 0.0,
                               varlen=ops.cu_seqlens_q is not None, transform=transform)
    if why is not None:
        return None
    _, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dims = _head_dim_args(D, Dv, q.dtype)
    _, block_n, _, _ = split_config(dims["BLOCK_D"], dims["BLOCK_DV"], q.element_size(),
                                    (H // Hkv) * Nq)
    plan = split_kv_plan(Nk, Nq, sm_count_of(q.device), tile=block_n,
                         force=split_kv_override())
    return plan if plan.splits > 1 else None


def _fwd_split(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands, chunk: int
               ) -> tuple[Tensor, Tensor]:
    """Split-KV decoding: ``(out, lse)`` of a dense, forward-only call with its keys cut into
    chunks of ``chunk`` (whole key tiles); the grid and the combine: docs/gpu.md, "Split-KV
    decoding"."""
    L = _launch_args(q, k, v, spec, ops)
    rows = L.group * L.n_q
    block_d, block_dv = L.shared["BLOCK_D"], L.shared["BLOCK_DV"]
    block_m, block_n, warps, stages = split_config(block_d, block_dv, L.q.element_size(), rows)
    assert chunk % block_n == 0, (chunk, block_n)  # chunks are whole tiles: the band's stages
    splits = cdiv(L.n_k, chunk)
    B, H, Nq, Dv = L.batch, L.H, L.n_q, L.shared["HEAD_DIM_V"]
    out_p = torch.empty(splits, B, H, Nq, Dv, dtype=torch.float32, device=q.device)
    lse_p = torch.empty(splits, B, H, Nq, dtype=torch.float32, device=q.device)
    grid = (cdiv(rows, block_m), splits, B * (H // L.group))
    _attn_fwd_split[grid](
        OutP=out_p, LseP=lse_p, B=B, chunk=chunk, **_value_offsets(v, L, ops), **L.shared,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return _combine(out_p, lse_p, L.sinks, v.dtype, block_dv)


def _combine(out_p: Tensor, lse_p: Tensor, sinks: Tensor | None, dtype: torch.dtype,
             block_dv: int, block_s: int | None = None) -> tuple[Tensor, Tensor]:
    """The chunks' float32 partials ``(splits, B, H, Nq, Dv)`` / ``(splits, B, H, Nq)`` merged
    in chunk order (the sinks as one more partial of value 0) → out in ``dtype``, lse.
    ``block_s``: the combine's width (default: the splits' power of two)."""
    splits, B, H, Nq, Dv = out_p.shape
    if splits == 1 and sinks is None:  # one partial is its own merge: the same values
        return out_p[0].to(dtype), lse_p[0]
    out = torch.empty(B, H, Nq, Dv, dtype=dtype, device=out_p.device)
    lse = torch.empty(B, H, Nq, dtype=torch.float32, device=out_p.device)
    _attn_split_combine[(B * H * Nq,)](
        out_p, lse_p, out, lse, lse_p if sinks is None else sinks, out.stride(), B * H * Nq,
        H, Nq, splits, HEAD_DIM_V=Dv, BLOCK_DV=block_dv,
        BLOCK_S=combine_block(splits) if block_s is None else block_s,
        HAS_SINKS=sinks is not None)
    return out, lse


_QUANT_KINDS = {"int8": 1, "int4": 2, "fp8_e4m3": 3}  # the paged kernel's QUANT constexpr


def _paged_dv(v_pages: Tensor, quant) -> int:
    """Dv of paged values (int4 codes hold two dims per byte)."""
    return v_pages.shape[-1] if quant is None else quant.dim(v_pages.shape[-1])


def _scale_strides(scales: Tensor, dim: int, page: int) -> tuple[tuple[int, ...], int]:
    """The paged kernel's four scale strides (page, slot, kv head, group) and dims per scale
    for ``scales`` of a head dim ``dim``: per token or group ``(blocks, page, Hkv, G)`` as
    they are; per channel ``(blocks, 1, Hkv, D)`` with the slot's stride 0 (a page's one
    row); per kv head ``(Hkv,)`` with only the head's."""
    if scales.dim() == 1:
        return (0, 0, scales.stride(0), 0), dim
    s0, s1, s2, s3 = scales.stride()
    return (s0, s1 if scales.shape[1] == page else 0, s2, s3), dim // scales.shape[-1]


def _quant_args(quant, q: Tensor, D: int, Dv: int, page: int) -> dict:
    """The paged kernel's quantization arguments for ``quant`` (an
    :class:`attn.spec.QuantPages`, or None: QUANT = 0 and placeholders it never reads)."""
    if quant is None:
        return dict(KS=q, VS=q, RK=q, RV=q, KSS=(0,) * 4, VSS=(0,) * 4, RKS=(0,) * 4,
                    RVS=(0,) * 4, QUANT=0, K_GROUP=D, V_GROUP=Dv, HAS_RECENT=False)
    kss, k_group = _scale_strides(quant.k_scales, D, page)
    vss, v_group = _scale_strides(quant.v_scales, Dv, page)
    recent = quant.recent_k is not None
    rk, rv = (quant.recent_k, quant.recent_v) if recent else (q, q)
    return dict(KS=quant.k_scales, VS=quant.v_scales, RK=rk, RV=rv, KSS=kss, VSS=vss,
                RKS=rk.stride() if recent else (0,) * 4,
                RVS=rv.stride() if recent else (0,) * 4, QUANT=_QUANT_KINDS[quant.kind],
                K_GROUP=k_group, V_GROUP=v_group, HAS_RECENT=recent)


def _fwd_paged(q: Tensor, k_pages: Tensor, v_pages: Tensor, spec: LaunchSpec, ops: Operands
               ) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of q ``(B, H, Nq, D)`` against keys read through ``ops.pages``
    (:mod:`attn.flash_triton.paged`): the split-KV grid and combine, each row chunked by its
    own length (batch invariance: docs/kvcache.md, "How CUDA reads the pages")."""
    table, starts, lengths = ops.pages
    q, sinks, softcap = _kernel_inputs(q, q, spec, ops.sinks, ops.softcap)  # q's dtype rules
    B, H, Nq, D = q.shape
    page, Hkv, Dv = k_pages.shape[1], k_pages.shape[2], _paged_dv(v_pages, ops.quant)
    quant = _quant_args(ops.quant, q, D, Dv, page)
    group = H // Hkv
    dims = _head_dim_args(D, Dv, q.dtype)
    block_m, block_n, warps, stages = split_config(dims["BLOCK_D"], dims["BLOCK_DV"],
                                                   q.element_size(), group * Nq)
    sm, force = sm_count_of(q.device), split_kv_override()
    chunks, splits = [], 1
    for n in (lengths - starts).tolist():  # (one read of the lengths, as the plan needs them)
        plan = split_kv_plan(int(n), Nq, sm, tile=block_n, force=force)
        chunks.append(plan.chunk if plan.splits > 1 else block_n * max(1, cdiv(n, block_n)))
        splits = max(splits, plan.splits)
    # each row's first key position, end, first full-precision page and chunk, and its page
    # ids, where the kernel reads them
    recent_from = lengths if ops.quant is None else ops.quant.recent_from
    seq = torch.stack([t.to(device=q.device, dtype=torch.int32) for t in (
        starts, lengths, recent_from, torch.tensor(chunks, dtype=torch.int32))], 1)
    table = table.to(q.device)
    slopes, slope_strides = _alibi_arg(ops.alibi, q, B, H)
    out_p = torch.empty(splits, B, H, Nq, Dv, dtype=torch.float32, device=q.device)
    lse_p = torch.empty(splits, B, H, Nq, dtype=torch.float32, device=q.device)
    grid = (cdiv(group * Nq, block_m), splits, B * Hkv)
    _attn_fwd_paged[grid](
        q, k_pages, v_pages, table, seq, out_p, lse_p, q if softcap is None else softcap,
        slopes, QS=q.stride(), KPS=k_pages.stride(), VPS=v_pages.stride(), TS=table.stride(),
        AS=slope_strides, **quant, B=B, H=H, GROUP=group, N_Q=Nq, **_band_args(spec),
        **score_args(spec, softcap=softcap is not None, alibi=ops.alibi is not None),
        page_size=page, v_log_scale=math.log(2.0 / torch.finfo(torch.float32).max), **dims,
        V_OFFSET=q.dtype != torch.float16, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return _combine(out_p, lse_p, sinks, q.dtype, dims["BLOCK_DV"],
                    block_s=combine_block(max(splits, MAX_SPLITS)))


def _delta(do: Tensor, dlse: Tensor | None, out: Tensor, L: _Launch) -> Tensor:
    """Δ = rowsum(dO ∘ O) − dlse, laid out as lse: the preprocess kernel, or for packed
    sequences the same sum in torch."""
    if L.varlen:  # (total_q, H) -> (H, total_q)
        delta = (do.float() * out.float()).sum(-1).t().contiguous()
        return delta if dlse is None else delta - dlse.float()
    delta = torch.empty(L.rows(out), dtype=torch.float32, device=out.device)
    pre_block = 32 if _INTERPRET else 64
    _attn_bwd_preprocess[(cdiv(L.n_q, pre_block), L.batch * L.H)](
        out, do, delta if dlse is None else dlse.contiguous(), delta,
        out.stride(), do.stride(), L.H, L.n_q, HEAD_DIM_V=L.shared["HEAD_DIM_V"],
        BLOCK_DV=L.shared["BLOCK_DV"], HAS_DLSE=dlse is not None, BLOCK_M=pre_block)
    return delta


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, ops: Operands | None = None, *,
         need_dmask: bool = False, need_dcap: bool = True, logl: Tensor | None = None,
         lse2: Tensor | None = None) -> Grads:
    """Gradients of one call, as the tiled backend's ``_bwd``; a float mask's gradient is
    refused (``unsupported_reason``), so ``need_dmask`` must be False. ``logl``: the
    forward's (``_fwd(want_logl=True)``); query blocks holding a saturated row then take
    Δ = Σ P·dP (``_attn_bwd_dq``'s Δ pass), else rowsum(dO ∘ O) serves every row.
    ``lse2``: the forward's base-2 lse, which the kernels read (else lse · log2 e)."""
    if need_dmask:
        raise NotImplementedError("triton: the gradient of a float attn_mask (use tiled)")
    ops = Operands() if ops is None else ops
    L = _launch_args(q, k, v, spec, ops)
    q, sinks, softcap = L.q, L.sinks, L.softcap
    lse = lse.contiguous()  # the kernels index it as packed rows: a row slice is not
    lse2 = lse * 1.4426950408889634 if lse2 is None else lse2.contiguous()  # what they read
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = _delta(do, dlse, out, L)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # the smallest BLOCK_N any dkdv config may pick bounds the number of partial sums
    min_bn = min(c.kwargs["BLOCK_N"] for c in _attn_bwd_dkdv.configs)
    n_part = cdiv(L.n_k, min_bn) if softcap is not None else 1
    dcap_part = torch.zeros(n_part, L.batch * L.H, dtype=torch.float32, device=q.device)
    args = dict(DO=do, Lse=lse2, Delta=delta, OS=L.strides(do), LS=L.row_strides(lse),
                **L.shared, **L.plain)
    if logl is not None:  # Δ of the blocks holding a saturated row, over the preprocessing's
        _attn_bwd_dq[L.grid_q](
            DQ=dq, Sinks=lse if sinks is None else sinks, LogL=logl.contiguous(),
            DLse=delta if dlse is None else dlse.contiguous(), GS=L.strides(dq),
            DELTA_PASS=True, HAS_DLSE=dlse is not None, HAS_SINKS=sinks is not None, **args)
    n_kv = L.batch * (L.H // L.group)
    grid_kv = lambda meta: (cdiv(L.n_k, meta["BLOCK_N"]), n_kv)  # noqa: E731
    _attn_bwd_dkdv[grid_kv](DK=dk, DV=dv, DCap=dcap_part, GS=L.strides(dk), GVS=L.strides(dv),
                            **args)
    _attn_bwd_dq[L.grid_q](DQ=dq, Sinks=lse, LogL=lse, DLse=lse, GS=L.strides(dq),
                           DELTA_PASS=False, HAS_DLSE=False, HAS_SINKS=False, **args)
    dcap = None
    if need_dcap and softcap is not None:
        dcap = dcap_part.view(-1, L.batch, L.H).sum(dim=(0, 1))
    dsinks = None
    if sinks is not None:  # sink_grad reads (B, H, N) rows: packed rows are one batch row
        rows = (lse[None], delta[None]) if L.varlen else (lse, delta)
        dsinks = sink_grad(sinks, *rows)
    return Grads(dq, dk, dv, None, dsinks, dcap)


class Tangents(NamedTuple):
    """Forward-mode tangents of one call's inputs, each shaped as its primal (None: zero):
    q, k, v, a float mask, sinks, a learnable softcap and the ALiBi slopes."""

    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    attn_mask: Tensor | None = None
    sinks: Tensor | None = None
    softcap: Tensor | None = None
    alibi: Tensor | None = None


def _jvp(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: LaunchSpec,
         ops: Operands | None, tangents: Tangents, *, lse2: Tensor | None = None
         ) -> tuple[Tensor, Tensor]:
    """``(ȯ, lsė)``: the tangents of one call's ``(out, lse)`` (its forward's, ``lse2`` its
    base-2 lse, else lse · log2 e) along ``tangents``, in one query-resident pass
    (:func:`attn.flash_triton.outer._attn_jvp`). ȯ in v's dtype shaped as out, lsė float32
    laid out as lse; dense or packed as :func:`_fwd`."""
    ops = Operands() if ops is None else ops
    L = _launch_args(q, k, v, spec, ops)
    q, sinks, softcap = L.q, L.sinks, L.softcap
    lse = lse.contiguous()
    lse2 = lse * 1.4426950408889634 if lse2 is None else lse2.contiguous()
    t = tangents
    dq = None if t.q is None else t.q.to(q.dtype)
    dk = None if t.k is None else t.k.to(k.dtype)
    dv = None if t.v is None else t.v.to(v.dtype)
    has_dmask = L.shared["MASK_KIND"] == 2 and t.attn_mask is not None  # only a float one
    dmask, dmask_strides = _mask_arg(t.attn_mask if has_dmask else None, q, L.n_k)
    dcap = None
    if softcap is not None:  # a fixed cap has none: zeros
        dcap = (torch.zeros_like(softcap) if t.softcap is None else
                t.softcap.to(device=q.device, dtype=torch.float32).expand(L.H).contiguous())
    dslopes, dslope_strides = _alibi_arg(
        None if ops.alibi is None else (torch.zeros_like(ops.alibi, dtype=torch.float32)
                                        if t.alibi is None else t.alibi), q, L.batch, L.H)
    has_sinks = sinks is not None and t.sinks is not None
    d_out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype, device=q.device)
    d_lse = torch.empty(L.rows(q), dtype=torch.float32, device=q.device)
    none = (0, 0, 0, 0)
    _attn_jvp[L.grid_q](
        Out=out, Lse=lse2, DQ=q if dq is None else dq, DK=k if dk is None else dk,
        DV=v if dv is None else dv, DOut=d_out, DLse=d_lse,
        DMask=dmask, DCap=q if dcap is None else dcap, DAlibi=dslopes,
        Sinks=sinks if has_sinks else q,
        DSinks=t.sinks.to(torch.float32).contiguous() if has_sinks else q,
        OS=L.strides(out), TQS=none if dq is None else L.strides(dq),
        TKS=none if dk is None else L.strides(dk), TVS=none if dv is None else L.strides(dv),
        GS=L.strides(d_out), DMS=dmask_strides, DAS=dslope_strides, LS=L.row_strides(lse),
        TAN=(dq is not None, dk is not None, dv is not None, has_dmask), HAS_SINKS=has_sinks,
        **L.shared, **L.plain)
    return d_out, d_lse


# -- torch.library ops: opaque to torch.compile, with shapes it can trace ------------------
# Op schemas take flat values: the spec travels as two lists, every field encoded by its type.

# The LaunchSpec fields no op schema can carry, and why the ops' path never meets them set
_HOST_ONLY = {
    "score_mod": "a callable; triton refuses score_mod (select_backend)",
    "mask_mod": "a callable; triton refuses mask_mod (select_backend)",
    "mask_blocks": "a block mask or its callable; triton refuses block masks (select_backend)",
    "dropout_rows": "a callable of packed calls, which call the launchers directly",
    "alibi_rows": "a callable of packed calls, which call the launchers directly",
}
_SCALARS = (bool, int, float)  # bool first: a bool is an int too


def _field_kind(name: str, hint) -> tuple:
    """How one field travels: ``("scalar", type)``, ``("optional", type)`` (a presence flag
    among the ints, then the value), ``("struct", cls, kinds)`` for a NamedTuple or dataclass
    of such fields (``Band``), ``("terms",)`` or ``("host",)``; TypeError for anything else,
    at import (docs/adding-a-variant.md, "The five places": the custom ops)."""
    if name in _HOST_ONLY:
        return ("host",)
    if hint is ScoreTerms:
        return ("terms",)
    if hint in _SCALARS:
        return ("scalar", hint)
    args = typing.get_args(hint)
    if (typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2
            and type(None) in args):
        inner = next(a for a in args if a is not type(None))
        if inner in _SCALARS:
            return ("optional", inner)
    if isinstance(hint, type) and (hasattr(hint, "_fields") or dataclasses.is_dataclass(hint)):
        return ("struct", hint, _spec_kinds(hint))
    raise TypeError(f"LaunchSpec field {name!r} ({hint}) cannot travel through triton's custom "
                    f"ops: give it a kind in attn/flash_triton/launch.py (_field_kind), or list "
                    f"it in _HOST_ONLY with why the ops never see it set")


_KINDS: dict[type, tuple] = {}  # a plain dict, not functools.cache: torch.compile reads it


def _spec_kinds(cls: type) -> tuple[tuple[str, tuple], ...]:
    """``(field name, kind)`` for every field of the spec class ``cls`` (or of a struct in
    it), in field order."""
    if cls not in _KINDS:
        hints = typing.get_type_hints(cls)
        names = (cls._fields if hasattr(cls, "_fields") else
                 [f.name for f in dataclasses.fields(cls)])
        _KINDS[cls] = tuple((n, _field_kind(n, hints[n])) for n in names)
    return _KINDS[cls]


def _encode(obj, kinds, ints: list[int], floats: list[float]) -> None:
    for name, kind in kinds:
        value = getattr(obj, name)
        if kind[0] == "host":
            if value is not None:
                raise NotImplementedError(f"triton's custom ops cannot carry "
                                          f"LaunchSpec.{name}: {_HOST_ONLY[name]}")
        elif kind[0] == "struct":
            _encode(value, kind[2], ints, floats)
        elif kind[0] == "terms":
            ints.append(len(value.items))
            for term, x in value.items:
                raw = term.encode()
                ints.extend((len(raw), *raw))
                floats.append(x)
        else:
            if kind[0] == "optional":
                ints.append(int(value is not None))
                value = 0 if value is None else value
            if kind[1] is float:
                floats.append(float(value))
            else:
                ints.append(int(value))


def _decode(cls, kinds, ints, floats) -> object:
    """The inverse of :func:`_encode`, reading ``ints`` and ``floats`` (iterators)."""
    values = {}
    for name, kind in kinds:
        if kind[0] == "host":
            values[name] = None
        elif kind[0] == "struct":
            values[name] = _decode(kind[1], kind[2], ints, floats)
        elif kind[0] == "terms":
            items = []
            for _ in range(next(ints)):
                raw = bytes(next(ints) for _ in range(next(ints)))
                items.append((raw.decode(), next(floats)))
            values[name] = ScoreTerms(tuple(items))
        else:
            present = kind[0] == "scalar" or bool(next(ints))
            raw = next(floats) if kind[1] is float else next(ints)
            values[name] = kind[1](raw) if present else None
    return cls(**values)


def _op_args(spec: LaunchSpec) -> tuple[list[int], list[float]]:
    """``spec`` as the custom ops' ``(spec_ints, spec_floats)``: every field of its class,
    found by ``dataclasses.fields``, so a new field needs no edit here."""
    ints: list[int] = []
    floats: list[float] = []
    _encode(spec, _spec_kinds(type(spec)), ints, floats)
    return ints, floats


def _spec_of(spec_ints: list[int], spec_floats: list[float]) -> LaunchSpec:
    """The :class:`LaunchSpec` that :func:`_op_args` encoded (host-only fields None)."""
    ints, floats = iter(spec_ints), iter(spec_floats)
    spec = _decode(LaunchSpec, _spec_kinds(LaunchSpec), ints, floats)
    assert next(ints, None) is None and next(floats, None) is None, "spec arguments left over"
    return spec


_spec_kinds(LaunchSpec)  # a field of no known kind fails here, at import


def _direct(*tensors: Tensor | None) -> bool:
    """Whether a launcher may be called as it is rather than through its custom op: an eager
    call of plain tensors that nothing traces or transforms (docs/gpu.md, "Host time per
    call")."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _transforms_on():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) is Tensor for t in tensors)


def _transforms_on() -> bool:
    on = getattr(torch._C, "_are_functorch_transforms_active", None)
    return True if on is None else bool(on())  # unknown on this torch: the op, to be safe


@torch.library.custom_op("attn::flash_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
            softcap: Tensor | None, spec_ints: list[int], spec_floats: list[float],
            alibi: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """out, lse, logl and lse2 (see :func:`_fwd`)."""
    spec = _spec_of(spec_ints, spec_floats)
    return _fwd(q, k, v, spec, Operands(attn_mask, sinks, softcap, alibi), want_logl=True)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, *rest):
    return (q.new_empty(*q.shape[:-1], v.shape[-1], dtype=v.dtype),
            *(q.new_empty(q.shape[:-1], dtype=torch.float32) for _ in range(3)))


@torch.library.custom_op("attn::flash_fwd_split", mutates_args=())
def _fwd_split_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                  sinks: Tensor | None, softcap: Tensor | None, spec_ints: list[int],
                  spec_floats: list[float], alibi: Tensor | None, chunk: int
                  ) -> tuple[Tensor, Tensor]:
    """out and lse of split-KV decoding (see :func:`_fwd_split`); forward only."""
    spec = _spec_of(spec_ints, spec_floats)
    return _fwd_split(q, k, v, spec, Operands(attn_mask, sinks, softcap, alibi), chunk)


@_fwd_split_op.register_fake
def _(q, k, v, *rest):
    return _fwd_fake(q, k, v)[:2]  # out and lse


@torch.library.custom_op("attn::flash_bwd", mutates_args=())
def _bwd_op(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
            lse: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
            softcap: Tensor | None, spec_ints: list[int], spec_floats: list[float],
            need_dcap: bool, alibi: Tensor | None = None, logl: Tensor | None = None,
            lse2: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
            cu_seqlens_k: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks (H,) and dsoftcap (H,); the last two empty when not asked for.
    Dense or packed (the offsets given)."""
    g = _bwd_flat(do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap,
                  _spec_of(spec_ints, spec_floats), need_dcap, alibi, logl, lse2,
                  cu_seqlens_q, cu_seqlens_k)
    return g.dq, g.dk, g.dv, _or_empty(g.dsinks, q), _or_empty(g.dsoftcap, q)


def _bwd_flat(do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, spec, need_dcap, alibi,
              logl, lse2, cu_seqlens_q, cu_seqlens_k) -> Grads:
    """:func:`_bwd` from :func:`_bwd_op`'s arguments with the spec decoded: the op's body,
    and what the autograd backward runs directly in plain eager mode (:func:`_direct`)."""
    ops = Operands(attn_mask, sinks, softcap, alibi, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    return _bwd(do, dlse, q, k, v, out, lse, spec, ops, need_dcap=need_dcap, logl=logl,
                lse2=lse2)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    # a fresh tensor each: a custom op's outputs must not alias
    return like.new_empty(0, dtype=torch.float32) if t is None else t


@_bwd_op.register_fake
def _(do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, spec_ints, spec_floats,
      need_dcap, *rest):
    H = q.shape[1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(0 if sinks is None else H, dtype=torch.float32),
            q.new_empty(H if need_dcap and softcap is not None else 0, dtype=torch.float32))


def _bwd_op_vmap(info, in_dims, *args):
    """vmap of :func:`_bwd_op` (per-sample gradients, ``vmap(grad(...))``): the mapped dim
    folded into B for dense calls without sinks, a learnable softcap (their gradients sum
    over the batch: each sample needs its own) or dropout (its hash reads the batch index),
    else one op call per sample."""
    X = info.batch_size
    args = args + (None,) * (18 - len(args))  # the optional tail, where left at its default
    in_dims = tuple(d if isinstance(a, Tensor) else None
                    for a, d in zip(args, tuple(in_dims) + (None,) * (18 - len(in_dims))))
    spec = _spec_of(args[10], args[11])
    if (args[16] is not None or args[8] is not None or args[9] is not None
            or spec.dropout_p > 0.0 or spec.sharded):
        return batching.call_per_sample(_bwd_op, X, in_dims, args)
    # do, dlse, q, k, v, out, lse, logl, lse2; the mask; the slopes
    dq, dk, dv, dsinks, dcap = _bwd_op(*_fold(args, in_dims, X, q=2, masks=(7,), slopes=(13,),
                                              rows=(0, 1, 2, 3, 4, 5, 6, 14, 15)))
    unfolded = tuple(batching.unfold(g, X) for g in (dq, dk, dv))
    return (*unfolded, dsinks, dcap), (0, 0, 0, None, None)  # (no sinks, no softcap: empty)


_bwd_op.register_vmap(_bwd_op_vmap)


@torch.library.custom_op("attn::flash_jvp", mutates_args=())
def _jvp_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse2: Tensor,
            attn_mask: Tensor | None, sinks: Tensor | None, softcap: Tensor | None,
            alibi: Tensor | None, dq: Tensor | None, dk: Tensor | None, dv: Tensor | None,
            dmask: Tensor | None, dsinks: Tensor | None, dsoftcap: Tensor | None,
            dalibi: Tensor | None, spec_ints: list[int], spec_floats: list[float],
            cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None
            ) -> tuple[Tensor, Tensor]:
    """ȯ and lsė of a call, dense or packed (see :func:`_jvp`): an op, so that functorch's
    wrappers come off before the launcher, and vmap loops over it."""
    spec = _spec_of(spec_ints, spec_floats)
    ops = Operands(attn_mask, sinks, softcap, alibi, cu_seqlens_q=cu_seqlens_q,
                   cu_seqlens_k=cu_seqlens_k)
    return _jvp(q, k, v, out, lse, spec, ops,
                Tangents(dq, dk, dv, dmask, dsinks, dsoftcap, dalibi), lse2=lse2)


@_jvp_op.register_fake
def _(q, k, v, out, lse, lse2, *rest):
    return torch.empty_like(out), torch.empty_like(lse, dtype=torch.float32)


def _jvp_op_vmap(info, in_dims, *args):
    """vmap of :func:`_jvp_op` (``jacfwd``, ``vmap(jvp)``): the mapped dim folded into B for
    dense calls whose per-head operands (sinks, softcap and their tangents) are shared and
    that draw no dropout (its hash reads the batch index), else one op call per sample."""
    X = info.batch_size
    args = args + (None,) * (21 - len(args))  # the offsets, where left at their default
    in_dims = tuple(d if isinstance(a, Tensor) else None  # (a list's dims: one per item)
                    for a, d in zip(args, tuple(in_dims) + (None,) * (21 - len(in_dims))))
    spec = _spec_of(args[17], args[18])
    per_head = (7, 8, 14, 15)  # sinks, softcap, dsinks, dsoftcap
    if (args[19] is not None or spec.dropout_p > 0.0 or spec.sharded
            or any(in_dims[i] is not None for i in per_head)):
        return batching.call_per_sample(_jvp_op, X, in_dims, args)
    # q, k, v, out, lse, lse2, dq, dk, dv; the mask and its tangent; the slopes and theirs
    d_out, d_lse = _jvp_op(*_fold(args, in_dims, X, q=0, masks=(6, 13), slopes=(9, 16),
                                  rows=(0, 1, 2, 3, 4, 5, 10, 11, 12)))
    return (batching.unfold(d_out, X), batching.unfold(d_lse, X)), (0, 0)


_jvp_op.register_vmap(_jvp_op_vmap)


def _fold(args: tuple, in_dims: tuple, X: int, *, q: int, rows: tuple[int, ...],
          masks: tuple[int, ...], slopes: tuple[int, ...]) -> list:
    """A vmap rule's ``args`` with the mapped dim (``X`` samples) folded into the batch of
    ``args[q]``: the per-row tensors at ``rows`` (batching.fold), the masks at ``masks``
    (batching.fold_mask) and the ALiBi slopes at ``slopes``; the others as they are."""
    B = batching.rows_of(args[q], in_dims[q])
    folded = list(args)
    for i in rows:
        folded[i] = batching.fold(args[i], in_dims[i], X, B)
    for i in masks:
        folded[i] = batching.fold_mask(args[i], in_dims[i], X, B)
    for i in slopes:  # per sample (B or 1, H), or (H,): as (1, H), the mapped dim first
        a, d = args[i], in_dims[i]
        if a is not None and a.dim() - (d is not None) != 2:
            a, d = (a.unsqueeze(0), None) if d is None else (a.movedim(d, 0)[:, None], 0)
        folded[i] = batching.fold(a, d, X, B)
    return folded


# -- autograd ------------------------------------------------------------------------------

class _FlashAttention(torch.autograd.Function):
    """``apply(q, k, v, attn_mask, sinks, softcap, alibi, spec, ops, second)`` → ``(out, lse,
    logl, lse2)``, the last two the backward's row constants (not differentiable): every
    tensor a transform may carry a tangent on explicit (the ALiBi slopes too, though they
    get no gradient: attn.call refuses slopes that require one), ``ops`` the rest
    (cu_seqlens). Dense forwards run through the custom op (packed ones call the launcher:
    the forward op's fake shapes are dense); backward and forward-mode rules are ops for
    both layouts, so functorch's wrappers come off before a launcher."""

    @staticmethod
    def forward(q, k, v, attn_mask, sinks, softcap, alibi, spec: LaunchSpec, ops: Operands,
                second=None):
        ops = ops._replace(attn_mask=attn_mask, sinks=sinks, softcap=softcap, alibi=alibi)
        if ops.cu_seqlens_q is None and not _direct(q, k, v, attn_mask, sinks, softcap, alibi):
            return _fwd_op(q, k, v, attn_mask, sinks, softcap, *_op_args(spec), alibi)
        return _fwd(q, k, v, spec, ops, want_logl=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, attn_mask, sinks, softcap, alibi, spec, ops, second = inputs
        out, lse, logl, lse2 = output
        ctx.mark_non_differentiable(logl, lse2)
        ctx.save_for_backward(q, k, v, out, lse, logl, lse2, attn_mask, sinks, softcap, alibi,
                              ops.cu_seqlens_q, ops.cu_seqlens_k)
        ctx.save_for_forward(q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi,
                             ops.cu_seqlens_q, ops.cu_seqlens_k)
        ctx.spec, ctx.second = spec, second

    @staticmethod
    def backward(ctx, dout, dlse, _dlogl, _dlse2):
        (q, k, v, out, lse, logl, lse2, attn_mask, sinks, softcap, alibi, cu_q,
         cu_k) = ctx.saved_tensors
        need_dcap = softcap is not None and bool(ctx.needs_input_grad[5])
        rest = (None, None, None, None)  # alibi (constants), spec, ops, second
        if transforms.graph_needed(dout, dlse, q, k, v, out, lse, attn_mask, sinks, softcap):
            # create_graph=True: hand off, as DESIGN's "Transforms"
            why = ("a learnable softcap" if need_dcap else
                   "a float mask's gradient" if attn_mask is not None
                   and ctx.needs_input_grad[3] else
                   "packed sequences" if cu_q is not None else
                   "no double backward handed in" if ctx.second is None else None)
            if why is not None:
                raise NotImplementedError(
                    f"backend='triton' has no double backward of its own ({why}): "
                    f"backend='tiled' and backend='reference' differentiate their gradients "
                    f"(create_graph=True)")
            do = torch.zeros_like(out) if dout is None else dout
            dq, dk, dv, dsinks = ctx.second(do, dlse, q, k, v, out, lse, ctx.spec,
                                            Operands(attn_mask, sinks, softcap, alibi))
            dsinks = dsinks if sinks is not None and ctx.needs_input_grad[4] else None
            return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dsinks, None, *rest)
        with torch.no_grad():  # (under torch.func.grad its level has grad mode on)
            if _direct(dout, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, alibi):
                g = _bwd_flat(dout, dlse, q, k, v, out, lse, attn_mask, sinks, softcap,
                              ctx.spec, need_dcap, alibi, logl, lse2, cu_q, cu_k)
                dq, dk, dv, dsinks, dcap = g.dq, g.dk, g.dv, g.dsinks, g.dsoftcap
            else:
                dq, dk, dv, dsinks, dcap = _bwd_op(dout, dlse, q, k, v, out, lse, attn_mask,
                                                   sinks, softcap, *_op_args(ctx.spec),
                                                   need_dcap, alibi, logl, lse2, cu_q, cu_k)
        dsinks = dsinks if sinks is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, dsinks, dcap if need_dcap else None, *rest

    @staticmethod
    def vmap(info, in_dims, q, k, v, attn_mask, sinks, softcap, alibi, spec, ops, second):
        args = (q, k, v, attn_mask, sinks, softcap, alibi, spec, ops, second)
        if any(isinstance(d, int) for d in pytree.tree_leaves(in_dims[8])):  # ops' fields
            raise NotImplementedError("backend='triton': vmap over cu_seqlens; "
                                      "backend='tiled' runs it")
        in_dims = (*in_dims[:8], None, None)
        X = info.batch_size
        loop = (ops.cu_seqlens_q is not None or spec.dropout_p > 0.0 or spec.sharded
                or any(d is not None for d in in_dims[4:6]))
        if loop:  # per-sample operands, the dropout hash's batch index, packed offsets
            return batching.call_per_sample(_FlashAttentionJvp.apply, X, in_dims, args)
        res = _FlashAttentionJvp.apply(*_fold(args, in_dims, X, q=0, rows=(0, 1, 2),
                                              masks=(3,), slopes=(6,)))
        return tuple(batching.unfold(x, X) for x in res), (0, 0, 0, 0)


class _FlashAttentionJvp(_FlashAttention):
    """:class:`_FlashAttention` with its forward-mode rule (:func:`_jvp`, one kernel pass
    from the saved out and lse), taken under torch.func transforms and forward-mode AD
    (torch.compile cannot trace a Function that defines ``jvp``)."""

    @staticmethod
    def jvp(ctx, dq, dk, dv, dmask, dsinks, dsoftcap, dalibi, _spec, _ops, _second):
        (q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi, cu_q,
         cu_k) = ctx.saved_tensors
        tangents = (dq, dk, dv, dmask, dsinks, dsoftcap, dalibi)
        if transforms.graph_needed(q, k, v, out, lse, attn_mask, sinks, softcap, alibi, *tangents):
            raise NotImplementedError(
                "backend='triton': its forward-mode kernel's tangents are not differentiable "
                "again (reverse over forward, e.g. jacrev(jacfwd(f))); backend='tiled' and "
                "backend='reference' differentiate them")
        d_out, d_lse = _jvp_op(q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi,
                               dq, dk, dv, dmask, dsinks, dsoftcap, dalibi,
                               *_op_args(ctx.spec), cu_q, cu_k)
        return d_out, d_lse, None, None


class _FlashAttentionEager(torch.autograd.Function):
    """:class:`_FlashAttention` in autograd's original form (``forward(ctx, ...)``), which
    torch does not bind to its signature on every apply, for calls under no transform: the
    same forward, saved tensors and backward (docs/gpu.md, "Host time per call")."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _FlashAttention.forward(*inputs)
        _FlashAttention.setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_FlashAttention.backward)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: LaunchSpec,
    operands: Operands | None = None,
    *,
    second=None,
) -> tuple[Tensor, Tensor]:
    """Fused attention kernels, inputs already validated by ``attn.call``: the protocol of
    :func:`attn.tiled.tiled_attention` (q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk,
    Dv) → out (B, H, Nq, Dv) in v's dtype, lse (B, H, Nq) float32; ``spec`` static,
    ``operands`` the optional tensors), but no score_mod. Packed (``cu_seqlens_q`` / ``_k``
    set, the grid sized by ``spec.max_seqlen_q`` / ``_k``): q (total_q, H, D), k and v
    (total_k, Hkv, D / Dv) → out (total_q, H, Dv), lse (H, total_q).

    ``second(do, dlse, q, k, v, out, lse, spec, ops) -> (dq, dk, dv, dsinks)``: a backward
    whose gradients are differentiable (tiled's), run where one is asked for
    (``create_graph=True``); without it, or for what it cannot differentiate, that raises
    NotImplementedError rather than give gradients that silently have none. Under a
    torch.func transform or dual tensors the call runs :class:`_FlashAttentionJvp` (its
    forward-mode rule the ``_attn_jvp`` kernel, its vmap rule a fold into B or a loop).
    """
    ops = Operands() if operands is None else operands
    if ops.captured:
        raise NotImplementedError("triton: a score_mod's captured tensors (use tiled)")
    if ops.cu_seqlens_q is not None:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        ops = ops._replace(cu_seqlens_q=ops.cu_seqlens_q.contiguous(),
                           cu_seqlens_k=ops.cu_seqlens_k.contiguous())
    # the conversions under autograd: it sums the per-head expand back to the caller's shapes
    q, sinks, cap = _kernel_inputs(q, k, spec, ops.sinks, ops.softcap)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, ops.attn_mask, sinks, cap))
    transform = transforms.active(q, k, v, ops.attn_mask, sinks, cap, ops.alibi)
    plan = split_plan_for(q, k, v, spec, ops, grad=grad, transform=transform)
    if plan is not None:  # decoding: forward only, no autograd node
        if _direct(q, k, v, ops.attn_mask, sinks, cap, ops.alibi):
            return _fwd_split(q, k, v, spec, Operands(ops.attn_mask, sinks, cap, ops.alibi),
                              plan.chunk)
        return _fwd_split_op(q, k, v, ops.attn_mask, sinks, cap, *_op_args(spec), ops.alibi,
                             plan.chunk)
    if torch.jit.is_tracing():  # the trace keeps the spec as a constant that replays run
        spec = _spec_of(*_op_args(spec))  # directly: numbers, not the traced sizes' tensors
    fn = (_FlashAttentionJvp if transform is not None else
          _FlashAttention if _transforms_on() else _FlashAttentionEager)
    out, lse, _, _ = fn.apply(q, k, v, ops.attn_mask, sinks, cap, ops.alibi, spec,
                              ops._replace(attn_mask=None, sinks=None, softcap=None, alibi=None),
                              second)
    return out, lse


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, spec: LaunchSpec,
                    ops: Operands) -> tuple[Tensor, Tensor]:
    """Attention of q ``(B, H, Nq, D)`` against keys read through a page table inside the
    kernel, forward only → out ``(B, H, Nq, Dv)`` in q's dtype, lse ``(B, H, Nq)`` float32.
    The protocol of :func:`attn.tiled.paged_attention` (inputs validated by ``attn.decode``),
    pages (or ``ops.quant``'s codes, scales and ring) on q's device, the starts and lengths
    planning the call on the host; the reads: docs/kvcache.md, "How CUDA reads the pages"."""
    if ops.pages is None or ops.attn_mask is not None or ops.captured or ops.q_scale is not None:
        raise ValueError("triton paged_attention takes ops.pages, and no attn_mask, score_mod "
                         "or tensor temperature")
    check_paged_forward_only(q, k_pages, v_pages, ops)
    B, H, Nq, _ = q.shape
    if B == 0 or Nq == 0:  # no program to launch
        return (q.new_empty(B, H, Nq, _paged_dv(v_pages, ops.quant)),
                q.new_empty(B, H, Nq, dtype=torch.float32))
    return _fwd_paged(q, k_pages, v_pages, spec, ops)
