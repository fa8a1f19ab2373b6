"""The GEMMs of the tiled backend's tiles and their scratch: batched ``bmm`` over (B·Hkv) into
reused tile-sized buffers, or one unit's 2-D products through oneDNN (:func:`attn.tiled.cpu.mm_nt`;
the plan picks the engine). The score pipeline (:mod:`attn.tiled.tile`) only asks for
``q kᵀ``; the launchers ask for the rest."""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from attn.tiled import cpu


class _Gemm:
    """The tile GEMMs of one call (or chunk). Layout: k and v as ``(B·Hkv, N, D)``; a query
    block as ``(B·Hkv, G·BM, D)`` with the G query heads of a group stacked along rows, so
    one ``bmm`` serves the whole group."""

    def __init__(self, k: Tensor, v: Tensor, acc_dtype: torch.dtype, engine: str = "bmm",
                 low: bool = False, key_scales: tuple[Tensor | None, Tensor | None] = (None, None)
                 ) -> None:
        B, Hkv, Nk, D = k.shape
        self.acc_dtype, self.device = acc_dtype, k.device
        self.k3 = k.reshape(B * Hkv, Nk, D)  # (B·Hkv, Nk, D), a view when k is contiguous
        self.v3 = v.reshape(B * Hkv, Nk, v.shape[-1])
        # oneDNN (one unit: B·Hkv = 1) takes 2-D operands in the accumulation dtype, row-major
        # (or column-major, the second): k and v converted once here
        self.onednn = engine == "onednn"
        # the backward on oneDNN computes its tiles keys-major, (BN, G·BM) in memory, seen
        # through a transposed view (set by _bwd_rows; docs/benchmarks.md: why, and why not
        # the forward)
        self.keys_major = False
        if self.onednn:
            if B * Hkv != 1:
                raise AssertionError(f"the oneDNN engine runs one unit (B·Hkv = 1), got "
                                     f"B={B}, Hkv={Hkv}")
            self.k3 = self.k3.to(acc_dtype).contiguous()
            self.v3 = self.v3.to(acc_dtype).contiguous()
        self.k3_dq = self.k3  # the backward's dQ += dS K reads this (see _bwd_rows)
        self._buffers: dict[tuple, Tensor] = {}
        # ``low`` (bmm engine, opted into: low_gemms; docs/design.md, "bf16"): P·V takes P
        # rounded to bf16 and the bf16 values as they are, q·kᵀ the raw bf16 queries
        # (_Tile.q_block) and keys, its scale joining in fp32 as the product is converted
        self.low = (low and not self.onednn and v.dtype == torch.bfloat16
                    and key_scales[1] is None)
        self.low_qk = (low and not self.onednn and k.dtype == torch.bfloat16
                       and key_scales[0] is None)
        self.qk_scale = 1.0  # with low_qk: q·kᵀ's multiplier (_Tile sets it once)
        # ``key_scales`` (forward, bmm engine): per-key multipliers ``(B·Hkv, Nk)`` of k and
        # of v (either may be None), a quantized cache's per-token or per-head scales: the
        # tiles then hold the bare codes, and q kᵀ's columns and P's columns carry the scales
        # (G·BM products per key instead of D: one pass over the keys fewer)
        self.k_scale, self.v_scale = key_scales
        if (self.k_scale is not None or self.v_scale is not None) and engine != "bmm":
            raise AssertionError(f"key_scales need the bmm engine, got {engine!r}")

    def v_block(self, n0: int, n1: int) -> Tensor:
        return self.v3[:, n0:n1].to(self.acc_dtype)

    def qk(self, q_blk: Tensor, n0: int, n1: int) -> Tensor:
        """``q_blk kᵀ`` for key block [n0, n1): ``(B·Hkv, G·BM, BN)``; with
        :attr:`keys_major`, a view of the contiguous ``k q_blkᵀ``."""
        if self.keys_major:
            return cpu.mm_nt(self.k3[0, n0:n1], q_blk[0]).t().unsqueeze(0)
        if self.onednn:
            return cpu.mm_nt(q_blk[0], self.k3[0, n0:n1]).unsqueeze(0)
        shape = (q_blk.shape[0], q_blk.shape[1], n1 - n0)
        if self.low_qk:  # q_blk: the raw bf16 queries
            s16 = self._bmm16(q_blk, self._low_tile(self.k3, n0, n1).transpose(1, 2), "s16")
            s = torch.mul(s16, self.qk_scale, out=self.buffer("s", shape))
        elif self.k3.dtype == torch.int8:  # int8 codes: scored against q rounded to int8
            s = self._int8_scores(q_blk, n0, n1, self.buffer("s", shape))
        else:
            k_blkT = self.k3[:, n0:n1].to(self.acc_dtype).transpose(1, 2)  # a view for fp32
            s = torch.bmm(q_blk, k_blkT, out=self.buffer("s", shape))
        if self.k_scale is not None:
            s.mul_(self.k_scale[:, None, n0:n1])
        return s

    def _int8_scores(self, q_blk: Tensor, n0: int, n1: int, s: Tensor) -> Tensor:
        """``q_blk kᵀ`` into ``s`` with k int8 codes (their scales are ``k_scale``'s): each
        query row rounded to int8 with its own scale ``max|row| / 127`` (half to even, as the
        cache's codes), the products in int32 (exact), then both scales. The keys are read as
        they are stored, never converted; q's rounding is the error this adds."""
        amax = q_blk.abs().amax(-1, keepdim=True)
        q_scale = amax / 127.0
        q8 = torch.round(q_blk / torch.where(amax > 0, q_scale, 1.0)).clamp_(-127, 127)
        q8 = q8.to(torch.int8)
        prod = torch.empty(s.shape, dtype=torch.int32, device=s.device)
        for u in range(q_blk.shape[0]):  # _int_mm is 2-D: one (batch row, kv head) at a time
            torch._int_mm(q8[u], self.k3[u, n0:n1].t(), out=prod[u])
        return torch.mul(prod, q_scale, out=s)  # NaN in q stays NaN (its scale is NaN)

    def _bmm16(self, a: Tensor, b: Tensor, name: str) -> Tensor:
        """``a b`` of bf16 operands into the reused bf16 buffer ``name``: oneDNN accumulates
        in fp32 and rounds the product to bf16 once (torch's CPU GEMMs give no fp32 output
        for bf16 operands)."""
        shape = (a.shape[0], a.shape[1], b.shape[2])
        return torch.bmm(a, b, out=self.buffer(name, shape, torch.bfloat16))

    def _low_tile(self, x3: Tensor, n0: int, n1: int) -> Tensor:
        """Rows [n0, n1) of bf16 ``x3`` as a contiguous tile (a reused buffer unless the
        slice is one already): a transposed bf16 operand whose batch stride is not the
        tile's own sends torch's bmm to a slower path than copying the tile first
        (docs/design.md, "bf16")."""
        tile = x3[:, n0:n1]
        if tile.is_contiguous():
            return tile
        return self.buffer("x16", tile.shape, torch.bfloat16).copy_(tile)

    def add_pv(self, acc: Tensor, p: Tensor, n0: int, n1: int) -> None:
        """``acc += p V`` for key block [n0, n1)."""
        if self.onednn:
            acc[0].add_(cpu.mm_nt(p[0], self.v3[0, n0:n1].t()))
        elif self.low:
            acc.add_(self._bmm16(self.low_operand(p, "p16"), self._low_tile(self.v3, n0, n1),
                                 "pv16"))
        elif self.v_scale is not None:
            acc.baddbmm_(p * self.v_scale[:, None, n0:n1], self.v_block(n0, n1))
        else:
            acc.baddbmm_(p, self.v_block(n0, n1))

    def dp(self, do_blk: Tensor, n0: int, n1: int, rows: Tensor | None = None) -> Tensor:
        """``dO Vᵀ`` for key block [n0, n1): ``(B·Hkv, G·BM, BN)``. A bf16 ``do_blk`` (the
        backward's dO as it is, where :attr:`low`) runs a bf16 GEMM, rounded to bf16 once as
        q·kᵀ is, and ``rows`` ``(B·Hkv, G·BM, 1)`` (1/l) join it in fp32 as it is
        converted."""
        if do_blk.dtype == torch.bfloat16 and self.low:
            dp16 = self._bmm16(do_blk, self._low_tile(self.v3, n0, n1).transpose(1, 2), "dp16")
            if rows is None:
                return dp16.to(self.acc_dtype)
            return torch.mul(dp16, rows, out=self.buffer("dp", dp16.shape))
        if self.keys_major:
            return cpu.mm_nt(self.v3[0, n0:n1], do_blk[0]).t().unsqueeze(0)
        if self.onednn:
            return cpu.mm_nt(do_blk[0], self.v3[0, n0:n1]).unsqueeze(0)
        shape = (do_blk.shape[0], do_blk.shape[1], n1 - n0)
        return torch.bmm(do_blk, self.v_block(n0, n1).transpose(1, 2),
                         out=self.buffer("dp", shape))

    def low_operand(self, x: Tensor, name: str) -> Tensor:
        """``x`` (a tile in the accumulation dtype) rounded to bf16 once, into a reused
        buffer: P for the forward's P·V and the backward's dV, and dS for :meth:`add_tn` and
        :meth:`add_dq`'s bf16 GEMMs (docs/design.md, "bf16": what that rounding loses)."""
        return self.buffer(name, x.shape, torch.bfloat16).copy_(x)

    def add_dq(self, dq_blk: Tensor, ds: Tensor, n0: int, n1: int) -> None:
        """``dq_blk += dS K`` for key block [n0, n1). A bf16 ``ds`` (:meth:`low_operand`)
        multiplies the bf16 keys as they are; the product, rounded to bf16 once, joins the
        fp32 ``dq_blk``."""
        k3 = self.k3_dq
        if ds.dtype == torch.bfloat16:
            dq_blk.add_(self._bmm16(ds, self._low_tile(k3, n0, n1), "dq16"))
        elif self.keys_major:  # dS is keys-major: dQᵀ = Kᵀ dSᵀ takes it as it lies
            dq_blk[0].add_(cpu.mm_nt(k3[0, n0:n1].t(), ds[0]).t())
        elif self.onednn:
            dq_blk[0].add_(cpu.mm_nt(ds[0], k3[0, n0:n1].t()))
        else:
            dq_blk.baddbmm_(ds, k3[:, n0:n1].to(self.acc_dtype))

    def add_tn(self, dst: Tensor, a: Tensor, b: Tensor, name: str) -> None:
        """``dst += aᵀ b``: dV += Pᵀ dO and dK += dSᵀ Q for one tile, ``a (·, G·BM, BN)``,
        ``b (·, G·BM, D)``. Both engines add a contiguous product into the slice
        (docs/benchmarks.md: faster than a GEMM into it). On oneDNN ``a`` is keys-major
        (:attr:`keys_major`). bf16 ``a`` and ``b`` (:meth:`low_operand`, the raw bf16 q, dO/l
        rounded) run a bf16 GEMM whose product, rounded to bf16 once, joins the fp32 ``dst``."""
        if a.dtype == torch.bfloat16:
            dst.add_(self._bmm16(a.transpose(1, 2), b, name + "16"))
        elif self.onednn:
            dst[0].add_(cpu.mm_nt(a[0].t(), b[0].t()))
        else:
            shape = (a.shape[0], a.shape[2], b.shape[2])
            dst.add_(torch.bmm(a.transpose(1, 2), b, out=self.buffer(name, shape)))

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
               ) -> Tensor:
        """A tile-sized scratch tensor reused across tiles (in the accumulation dtype by
        default): no allocator churn per tile."""
        key = (name, shape)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype or self.acc_dtype,
                                             device=self.device)
        return self._buffers[key]


def low_gemms(q: Tensor) -> bool:
    """Whether a call's q·kᵀ and P·V tile GEMMs run in bf16 (``_Gemm(low=True)``; the
    backward's q·kᵀ follows): only when asked for with ``ATTN_TILED_BF16_GEMM=1``, for bf16
    inputs on a CPU whose oneDNN has bf16 kernels, eager; read at each call, forward and
    backward alike. Why it is off by default (accuracy): docs/design.md, "bf16"."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    if os.environ.get("ATTN_TILED_BF16_GEMM", "0").strip() != "1":
        return False
    return _native_bf16()


@functools.cache
def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
