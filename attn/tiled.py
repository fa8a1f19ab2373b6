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

from dataclasses import dataclass

import torch
from torch import Tensor

from attn.masks import Band, as_4d, dropout_keep

# Chosen by measurement (scripts/tune_tiled_blocks.py; benchmarks/results/tiled_blocks_cpu.md):
# on 2 CPU cores, fp32, B=1, H=8, D=64, causal, 256 x 256 was fastest or tied at N = 4096
# and 8192, forward and backward. Smaller tiles pay more per-tile Python and dispatch cost;
# larger ones (512 x 512: 8 MiB per score tile) fall out of cache and lose 5-25%.
BLOCK_M = 256
BLOCK_N = 256


@dataclass(frozen=True)
class _Config:
    band: Band
    scale: float  # multiplier of q·k (a tensor temperature is folded into q by the caller)
    softcap: float | None  # a fixed softcap; a learnable one travels as a tensor input
    dropout_p: float
    dropout_seed: int
    block_m: int
    block_n: int


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mask4d(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """``mask`` expanded (no copy) to ``shape``."""
    return as_4d(mask).expand(shape)


def _reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a broadcast gradient back to ``shape`` (the shape of the tensor that broadcast)."""
    lead = grad.dim() - len(shape)
    if lead > 0:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(d for d, n in enumerate(shape) if n == 1 and grad.shape[d] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


class _Tile:
    """What every (query block, key block) tile needs to rebuild its scores.

    Layout: k and v as ``(B·Hkv, N, D)``; a query block as ``(B·Hkv, G·BM, D)`` with the G
    query heads of a group stacked along rows, so one ``bmm`` serves the whole group.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, cfg: _Config,
                 attn_mask: Tensor | None, softcap_t: Tensor | None) -> None:
        B, H, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        self.B, self.Hkv, self.G = B, Hkv, H // Hkv
        self.cfg = cfg
        self.device = q.device
        acc = self.acc_dtype = _acc_dtype(q.dtype)
        self.q = q
        self.k3 = k.reshape(B * Hkv, Nk, D)  # (B·Hkv, Nk, D), a view when k is contiguous
        self.v3 = v.reshape(B * Hkv, Nk, v.shape[-1])
        self._buffers: dict[tuple, Tensor] = {}
        self.mask5 = None  # bool masks stored inverted (True = masked): no ~ per tile
        if attn_mask is not None:
            m = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
            self.mask5 = _mask4d(m, (B, H, Nq, Nk)).view(B, Hkv, self.G, Nq, Nk)
        self.cap5 = None
        if softcap_t is not None:
            self.cap5 = softcap_t.to(acc).expand(H).reshape(1, Hkv, self.G, 1, 1)
        if cfg.dropout_p > 0.0:
            self.bh = torch.arange(B * H, device=q.device).view(B, Hkv, self.G)
        self._band_masks: dict[tuple[int, int, int], Tensor] = {}

    def q_block(self, m0: int, m1: int) -> Tensor:
        """Scaled queries ``(B·Hkv, G·BM, D)`` in the accumulation dtype (a fresh copy)."""
        q_blk = self.q[:, :, m0:m1].to(self.acc_dtype) * self.cfg.scale  # (B, H, BM, D)
        return q_blk.reshape(self.B * self.Hkv, self.G * (m1 - m0), q_blk.shape[-1])

    def k_block(self, n0: int, n1: int) -> Tensor:
        return self.k3[:, n0:n1].to(self.acc_dtype)

    def v_block(self, n0: int, n1: int) -> Tensor:
        return self.v3[:, n0:n1].to(self.acc_dtype)

    def _band_mask(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        # a tile's band mask depends only on its diagonal offset and size: build each once
        key = (n0 - m0, m1 - m0, n1 - n0)
        if key not in self._band_masks:
            offs_m = torch.arange(m0, m1, device=self.device)
            offs_n = torch.arange(n0, n1, device=self.device)
            self._band_masks[key] = ~self.cfg.band.mask(offs_m, offs_n)  # True = masked
        return self._band_masks[key]

    def buffer(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A tile-sized scratch tensor reused across tiles: no allocator churn per tile."""
        key = (name, shape)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=self.acc_dtype, device=self.device)
        return self._buffers[key]

    def scores(self, q_blk: Tensor, m0: int, m1: int, n0: int, n1: int
               ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Masked scores ``(B·Hkv, G·BM, BN)``; with softcap also ``u = s_raw / c`` and
        ``t = tanh(u)`` (the backward needs both)."""
        B, Hkv, G, BM, BN = self.B, self.Hkv, self.G, m1 - m0, n1 - n0
        # -- compute qk (q_blk already scaled) --
        k_blkT = self.k3[:, n0:n1].to(self.acc_dtype).transpose(1, 2)  # a view for fp32/fp64
        s = torch.bmm(q_blk, k_blkT, out=self.buffer("s", (B * Hkv, G * BM, BN)))
        s5 = s.view(B, Hkv, G, BM, BN)
        u = t = None
        if self.cap5 is not None or self.cfg.softcap is not None:
            c = self.cap5 if self.cap5 is not None else self.cfg.softcap
            u = s5.div_(c).view(B * Hkv, G * BM, BN)
            t = torch.tanh(u)
            s = t * c if self.cap5 is None else (t.view_as(s5) * c).view_as(t)
            s5 = s.view(B, Hkv, G, BM, BN)
        # -- masks --
        if not self.cfg.band.tile_is_full(m0, m1, n0, n1):
            s5.masked_fill_(self._band_mask(m0, m1, n0, n1), float("-inf"))
        if self.mask5 is not None:
            mt = self.mask5[..., m0:m1, n0:n1]
            if mt.dtype == torch.bool:
                s5.masked_fill_(mt, float("-inf"))
            else:
                s5.add_(mt)
        return s, u, t

    def dropout_scale(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """Kept elements scaled by 1/(1-p), dropped ones 0: ``(B·Hkv, G·BM, BN)``."""
        p = self.cfg.dropout_p
        offs_m = torch.arange(m0, m1, device=self.device)
        offs_n = torch.arange(n0, n1, device=self.device)
        keep = dropout_keep(self.cfg.dropout_seed, self.bh, offs_m, offs_n, p)
        z = keep.to(self.acc_dtype) / (1.0 - p)  # (B, Hkv, G, BM, BN)
        return z.view(self.B * self.Hkv, self.G * (m1 - m0), n1 - n0)

    def rows(self, x: Tensor, m0: int, m1: int) -> Tensor:
        """Per-row values (B, H, Nq) of a query block as a column ``(B·Hkv, G·BM, 1)``."""
        return x[:, :, m0:m1].reshape(self.B * self.Hkv, self.G * (m1 - m0), 1)


def _fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
         softcap_t: Tensor | None, cfg: _Config) -> tuple[Tensor, Tensor]:
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    tile = _Tile(q, k, v, cfg, attn_mask, softcap_t)
    out = torch.empty(B, H, Nq, Dv, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc_dtype, device=q.device)
    sink_rows = None if sinks is None else sinks.to(acc_dtype).view(1, H, 1).expand(B, H, Nq)
    # a finite "-inf" start keeps exp(m_i - m_new) and exp(s - m_new) free of inf - inf
    lowest = torch.finfo(acc_dtype).min

    for m0 in range(0, Nq, cfg.block_m):
        m1 = min(m0 + cfg.block_m, Nq)
        rows = (B * Hkv, G * (m1 - m0), 1)
        # -- init: the sink, when present, is the first "key" of every row --
        if sink_rows is None:
            m_i = torch.full(rows, lowest, dtype=acc_dtype, device=q.device)
            l_i = torch.zeros(rows, dtype=acc_dtype, device=q.device)
        else:
            m_i = tile.rows(sink_rows, m0, m1).clone()
            l_i = torch.ones(rows, dtype=acc_dtype, device=q.device)
        acc = torch.zeros(rows[:2] + (Dv,), dtype=acc_dtype, device=q.device)
        n_lo, n_hi = cfg.band.key_range(m0, m1, Nk)
        if n_lo < n_hi:
            q_blk = tile.q_block(m0, m1)
        for n0 in range(n_lo, n_hi, cfg.block_n):
            n1 = min(n0 + cfg.block_n, n_hi)
            s, _, _ = tile.scores(q_blk, m0, m1, n0, n1)
            v_blk = tile.v_block(n0, n1)
            # -- online softmax --
            m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
            p = s.sub_(m_new).exp_()  # in place: s is dead after this
            alpha = (m_i - m_new).exp_()
            l_i = l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            if cfg.dropout_p > 0.0:
                p.mul_(tile.dropout_scale(m0, m1, n0, n1))
            # -- update acc --
            acc.mul_(alpha).baddbmm_(p, v_blk)
            m_i = m_new
        # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
        seen = l_i > 0
        out[:, :, m0:m1] = (acc / torch.where(seen, l_i, 1.0)).view(B, H, m1 - m0, Dv)
        lse[:, :, m0:m1] = torch.where(seen, m_i + torch.log(l_i), float("-inf")).view(B, H, -1)
    return out, lse


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, attn_mask: Tensor | None, sinks: Tensor | None,
         softcap_t: Tensor | None, cfg: _Config, need_dmask: bool):
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    tile = _Tile(q, k, v, cfg, attn_mask, softcap_t)
    dq = torch.zeros(B, H, Nq, D, dtype=acc_dtype, device=q.device)
    dk3 = torch.zeros(B * Hkv, Nk, D, dtype=acc_dtype, device=q.device)
    dv3 = torch.zeros(B * Hkv, Nk, Dv, dtype=acc_dtype, device=q.device)
    dsoftcap = None if softcap_t is None else torch.zeros(H, dtype=acc_dtype, device=q.device)
    dmask = None
    if need_dmask:
        dmask = torch.zeros(as_4d(attn_mask).shape, dtype=acc_dtype, device=q.device)
    # Δ = rowsum(dO ∘ O) − dlse: the lse output's gradient joins dS as dlse_i · P_ij
    delta = (do.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # (B, H, Nq)
    if dlse is not None:
        delta = delta - dlse.to(acc_dtype)
    lse_rows = lse.masked_fill(lse == float("-inf"), float("inf"))  # P = 0 on empty rows

    for m0 in range(0, Nq, cfg.block_m):
        m1 = min(m0 + cfg.block_m, Nq)
        BM = m1 - m0
        n_lo, n_hi = cfg.band.key_range(m0, m1, Nk)
        if n_lo >= n_hi:
            continue
        q_blk = tile.q_block(m0, m1)  # (B·Hkv, G·BM, D)
        do_blk = do[:, :, m0:m1].to(acc_dtype).reshape(B * Hkv, G * BM, Dv)
        lse_blk = tile.rows(lse_rows, m0, m1)
        delta_blk = tile.rows(delta, m0, m1)
        dq_blk = torch.zeros(B * Hkv, G * BM, D, dtype=acc_dtype, device=q.device)
        for n0 in range(n_lo, n_hi, cfg.block_n):
            n1 = min(n0 + cfg.block_n, n_hi)
            BN = n1 - n0
            k_blk, v_blk = tile.k_block(n0, n1), tile.v_block(n0, n1)
            # -- recompute P from lse --
            s, u, t = tile.scores(q_blk, m0, m1, n0, n1)
            p = s.sub_(lse_blk).exp_()  # (B·Hkv, G·BM, BN)
            # -- dV += Pᵈᵀ dO, dP = dO Vᵀ (ᵈ: with the dropout mask); Pᵀ sums over the group --
            dp = torch.bmm(do_blk, v_blk.transpose(1, 2), out=tile.buffer("dp", s.shape))
            pd = p
            if cfg.dropout_p > 0.0:
                z = tile.dropout_scale(m0, m1, n0, n1)
                pd = p * z
                dp.mul_(z)
            dv3[:, n0:n1].baddbmm_(pd.transpose(1, 2), do_blk)
            # -- dS = P ∘ (dP − Δ) --
            ds = dp.sub_(delta_blk).mul_(p)
            if dmask is not None:
                rows = slice(m0, m1) if dmask.shape[2] != 1 else slice(None)
                cols = slice(n0, n1) if dmask.shape[3] != 1 else slice(None)
                dmask[:, :, rows, cols] += _reduce_to(ds.view(B, H, BM, BN), dmask.shape)
            if t is not None:
                # s = c·tanh(u), u = s_raw/c: ds_raw = ds·(1 − t²); dc = Σ ds·(t − u(1 − t²))
                one_m_t2 = 1.0 - t * t
                if dsoftcap is not None:
                    dc = (ds * (t - u * one_m_t2)).view(B, Hkv, G, BM, BN).sum(dim=(0, 3, 4))
                    dsoftcap += dc.reshape(H)
                ds = ds.mul_(one_m_t2)
            # -- dQ += dS K, dK += dSᵀ Q (q_blk carries the scale; dQ gets it at the end) --
            dq_blk.baddbmm_(ds, k_blk)
            dk3[:, n0:n1].baddbmm_(ds.transpose(1, 2), q_blk)
        dq[:, :, m0:m1] = dq_blk.view(B, H, BM, D) * cfg.scale

    dsinks = None
    if sinks is not None:
        # the sink is a key with value 0: dsink_h = −Σ_{b,i} exp(sink_h − lse_i) · Δ_i
        p_sink = torch.exp(sinks.to(acc_dtype).view(1, H, 1) - lse.to(acc_dtype))
        dsinks = -(p_sink * delta).sum(dim=(0, 2))
    dk, dv = dk3.view(B, Hkv, Nk, D), dv3.view(B, Hkv, Nk, Dv)
    return dq, dk, dv, dmask, dsinks, dsoftcap


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, sinks, softcap_t, cfg: _Config):
        out, lse = _fwd(q, k, v, attn_mask, sinks, softcap_t, cfg)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks, softcap_t)
        ctx.cfg = cfg
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, sinks, softcap_t = ctx.saved_tensors
        need_dmask = bool(ctx.needs_input_grad[3])
        do = torch.zeros_like(out) if dout is None else dout.contiguous()  # only lse was used
        dq, dk, dv, dmask, dsinks, dsoftcap = _bwd(
            do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap_t, ctx.cfg,
            need_dmask)
        if dmask is not None:
            dmask = dmask.reshape(attn_mask.shape).to(attn_mask.dtype)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype)
        if dsoftcap is not None:
            dsoftcap = _reduce_to(dsoftcap, softcap_t.shape).to(softcap_t.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, dsinks, dsoftcap, None


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    band: Band = Band(),
    attn_mask: Tensor | None = None,
    scale: float = 1.0,
    softcap: float | Tensor | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Memory-linear exact attention. Inputs already validated by ``attn.api``.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv) in v's dtype,
    lse (B, H, Nq) in float32 (float64 for float64 inputs). ``scale`` multiplies q·k; a
    tensor temperature must already be folded into q. ``softcap`` may be a float or a
    learnable tensor broadcastable to (H,); ``sinks`` (H,). Block sizes default to the
    module's ``BLOCK_M`` / ``BLOCK_N``, read at call time.
    """
    cap_t = softcap if isinstance(softcap, Tensor) else None
    cfg = _Config(band=band, scale=float(scale), softcap=None if cap_t is not None else softcap,
                  dropout_p=float(dropout_p), dropout_seed=int(dropout_seed),
                  block_m=int(block_m or BLOCK_M), block_n=int(block_n or BLOCK_N))
    return _TiledAttention.apply(q, k, v, attn_mask, sinks, cap_t, cfg)
