"""Double backward of tiled attention: the backward as an autograd.Function of its own
(:class:`_TiledBackward`) whose backward and forward-mode rule recompute tile by tile, O(N)
memory, for every variant the score pipeline of :class:`attn.tiled.jvp.TileScores` covers
(the gradient it takes and the names below: docs/transforms.md, "Double backward, tile by
tile")."""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attn import batching, transforms
from attn.grads import reduce_to
from attn.masks import as_4d
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import cpu
from attn.tiled.jvp import (TileScores, grouped, one_thread, plain, pv, qk_t, rows, safe_lse,
                            span, tp_kv, unsupported)

_GRAD_NAMES = ("q", "k", "v", "mask", "sinks", "softcap")


class _Tiles:
    """Per-tile partial sums along one dim of a tensor, joined at the end without in-place
    writes (vmap-safe): ``add(n0, n1, x)``, then :meth:`join` to ``length`` along ``dim``."""

    def __init__(self, dim: int, broadcast: bool = False) -> None:
        self.dim, self.broadcast, self.parts = dim, broadcast, {}

    def add(self, n0: int, n1: int, x: Tensor) -> None:
        self.parts[(n0, n1)] = x if (n0, n1) not in self.parts else self.parts[(n0, n1)] + x

    def join(self, length: int, like: Tensor) -> Tensor:
        pad = [0, 0] * (like.dim() - 1 - self.dim % like.dim())
        # where the tensor broadcasts along this dim, a sum, not a slice
        total = _sum(x if self.broadcast else F.pad(x, pad + [n0, length - n1])
                     for (n0, n1), x in self.parts.items())
        return torch.zeros_like(like) if total is None else total


# Runs of query blocks in the pooled double backward (:func:`_pooled`): each sums dK and dV
# into a partial of its own; a few more than the workers a 2-4 core machine has balance them
_RUNS = 4
# Pass 1's probabilities and score tangents of a query block, kept for pass 2 up to this
# many bytes per block (the rest recomputed): three GEMMs and an exp per kept tile saved, a
# bounded buffer per worker, so memory stays linear in N (docs/benchmarks.md: the sizes)
_KEEP_BYTES = 16 << 20
_HVP_BLOCKS = (256, 512)


@dataclasses.dataclass
class _Sums:
    """Pass 1's row quantities of one query block (names as in the module docstring): ā,
    Σ (p z) v, C, Δ_pd, Δ, its tangent Δ̇, the row constant r0 of ∂L/∂s, ∂L/∂g, the sinks'
    probabilities, and the (p, a) tiles kept for pass 2 by key tile start."""
    abar: Tensor
    pv_sum: Tensor
    c_sum: Tensor
    dpd: Tensor
    delta: Tensor
    delta_dot: Tensor | float
    r0: Tensor
    dg: Tensor
    p_sink: Tensor | None
    kept: dict[int, tuple[Tensor, Tensor]]


class _Hvp:
    """One call's double backward: the call-wide operands in the accumulation dtype, and
    :meth:`block`, one query block's two passes (what :func:`_pooled` and :func:`_in_order`
    run per block)."""

    def __init__(self, q, k, v, lse, spec, ops, g, glse, t, first) -> None:
        unsupported(spec, ops, "the double backward")
        self.q, self.k, self.v, self.glse, self.t = q, k, v, glse, t
        self.B, self.H, self.Nq, self.D = q.shape
        self.Hkv, self.Nk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
        self.G = self.H // self.Hkv
        self.acc = acc = _acc_dtype(q.dtype)
        self.ts = TileScores(q, k, spec, ops, blocks=_HVP_BLOCKS)
        self.lse_a, self.g_a = safe_lse(lse, acc), g.to(acc)
        gd, self.glse_d = (None, None) if first is None else first
        self.gd = None if gd is None else gd.to(acc)
        self.sinks = None if ops.sinks is None else ops.sinks.to(acc).view(1, self.H, 1, 1)
        self.t_sink = (None if t.get("sinks") is None
                       else t["sinks"].to(acc).view(1, self.H, 1, 1))
        self.names = self.ts.names
        self.mask4 = (None if ops.attn_mask is None or not self.ts.float_mask
                      else as_4d(ops.attn_mask))
        self.dmask_bcast = self.mask4 is not None and self.mask4.shape[3] == 1
        # the score map is linear in q and k (no score_mod, no softcap): its vjp by hand, two
        # GEMMs per operand, rather than through torch.func.vjp per tile
        self.linear = spec.score_mod is None and spec.softcap is None and not self.ts.has_cap
        self.tq, self.tk, self.tv = (None if t.get(n) is None else t[n].to(acc) for n in "qkv")
        self.scale = spec.qk_scale

    def tile(self, m0, m1, n0, n1, full):
        """A tile's primal and tangent operands, score function, V and t_V tiles (KV heads:
        the grouped GEMMs take them) and dropout keep-scale."""
        ts = self.ts
        xs = ts.operands(ts.primal, m0, m1, n0, n1)
        txs = ts.operands(self.t, m0, m1, n0, n1)
        vt = span(self.v, 2, n0, n1).to(self.acc)
        tvt = None if self.tv is None else span(self.tv, 2, n0, n1)
        return xs, txs, ts.fn(m0, m1, n0, n1, full, txs), vt, tvt, ts.dropout(m0, m1, n0, n1)

    def _col(self, x: Tensor | None, m0: int, m1: int) -> Tensor | float:
        return 0.0 if x is None else rows(x.to(self.acc), m0, m1)

    def zeros(self, *shape: int) -> Tensor:
        """Fresh zeros in the accumulation dtype: the GEMMs may accumulate into them in place."""
        return torch.zeros(*shape, dtype=self.acc, device=self.q.device)

    def _rows0(self, m0: int, m1: int, width: int) -> Tensor:
        return self.zeros(self.B, self.H, m1 - m0, width)

    def block(self, m0, m1, key_tiles, kv_into):
        """One query block: ``(dq rows, dg rows, lsė rows, dsinks part, dsoftcap part,
        dmask rows)``, its dK / dV added through ``kv_into(n0, n1, dk, dv)``."""
        lse_col, g_blk = rows(self.lse_a, m0, m1), span(self.g_a, 2, m0, m1)
        gd_blk = None if self.gd is None else span(self.gd, 2, m0, m1)
        sums = self._pass1(m0, m1, key_tiles, lse_col, g_blk, gd_blk)
        dq_blk, dcap, dmask = self._pass2(m0, m1, key_tiles, kv_into, lse_col, g_blk, gd_blk,
                                          sums)
        dsink = None
        if sums.p_sink is not None:
            t_s = 0.0 if self.t_sink is None else self.t_sink
            dsink = _sink_terms(sums.p_sink, t_s, sums.abar, sums.c_sum, sums.delta, sums.dpd)
            if gd_blk is not None:
                dsink = dsink - sums.p_sink * sums.delta_dot
            dsink = dsink.sum(dim=(0, 2, 3))
        drow = None
        if self.mask4 is not None and dmask.parts:  # as the block's rows of the mask
            m4 = self.mask4
            like = torch.zeros(*m4.shape[:2], 1 if m4.shape[2] == 1 else m1 - m0, m4.shape[3],
                               dtype=_acc_dtype(m4.dtype), device=m4.device)
            drow = dmask.join(m4.shape[3], like)
        return dq_blk, sums.dg, sums.abar.squeeze(-1), dsink, dcap, drow

    def _pass1(self, m0, m1, key_tiles, lse_col, g_blk, gd_blk) -> _Sums:
        """The row sums ā = Σ p a, C = Σ p c (c = a·dp + e) and Δ_pd = Σ p dp, the last two
        as g·(Σ (p z a) v + Σ (p z) t_v) and g·Σ (p z) v: GEMMs accumulating (BM, Dv) rows
        rather than products over the tile (and Σ p ḋp is ġ·Σ (p z) v)."""
        G, Dv = self.G, self.Dv
        col0 = self._rows0(m0, m1, 1)
        abar, pav, pv_sum, ptv = (col0, self._rows0(m0, m1, Dv), self._rows0(m0, m1, Dv),
                                  self._rows0(m0, m1, Dv))
        kept: dict[int, tuple[Tensor, Tensor]] = {}  # pass 1's (p, a) that pass 2 reuses
        kept_bytes = 0
        for n0, n1, full in key_tiles:
            xs, txs, fn, vt, tvt, z = self.tile(m0, m1, n0, n1, full)
            s, a = fn(*xs)
            p = torch.exp(s - lse_col)
            if self.linear and kept_bytes + 2 * p.nbytes <= _KEEP_BYTES:
                kept[n0] = (p, a)
                kept_bytes += 2 * p.nbytes
            pa = p * a
            abar = abar + pa.sum(-1, keepdim=True)
            pz = p if z is None else p * z
            pv_sum = pv(pz, vt, G, add=pv_sum)
            pav = pv(pa if z is None else pa * z, vt, G, add=pav)
            if tvt is not None:
                ptv = pv(pz, tvt, G, add=ptv)
        c_sum = (g_blk * (pav + ptv)).sum(-1, keepdim=True)
        dpd = (g_blk * pv_sum).sum(-1, keepdim=True)
        dpd_dot = col0 if gd_blk is None else (gd_blk * pv_sum).sum(-1, keepdim=True)
        p_sink = None
        if self.sinks is not None:
            p_sink = torch.exp(self.sinks - lse_col)
            if self.t_sink is not None:
                abar = abar + p_sink * self.t_sink
        delta = dpd - self._col(self.glse, m0, m1)
        # s̄ = p [(c − C) − Δ (a − ā) − ā (dp − Δ_pd)] = a·ā_s + p (e − ā dp + r0) with the
        # row constant r0 = Δ ā + ā Δ_pd − C and ā_s = p (dp − Δ)
        r0 = delta * abar + abar * dpd - c_sum
        # ∂L/∂g = Σ w v + Σ (p z) t_v with w = p z (a − ā): pass 1's rows already hold it
        return _Sums(abar=abar, pv_sum=pv_sum, c_sum=c_sum, dpd=dpd, delta=delta,
                     delta_dot=dpd_dot - self._col(self.glse_d, m0, m1), r0=r0,
                     dg=pav - abar * pv_sum + ptv, p_sink=p_sink, kept=kept)

    def _pass2(self, m0, m1, key_tiles, kv_into, lse_col, g_blk, gd_blk, sums: _Sums):
        """The gradients to q, k, v, the softcap and the mask from pass 1's row sums: ``(dq
        rows, dsoftcap part, the mask's per-tile parts)``, dK / dV through ``kv_into``."""
        G, scale, linear, names = self.G, self.scale, self.linear, self.names
        abar, delta, r0, kept = sums.abar, sums.delta, sums.r0, sums.kept
        dq_blk = self._rows0(m0, m1, self.D)
        dmask = _Tiles(3, self.dmask_bcast)
        dcap = None
        q_blk = span(self.q, 2, m0, m1).to(self.acc)
        tq_blk = None if self.tq is None else span(self.tq, 2, m0, m1)
        for n0, n1, full in key_tiles:
            xs, txs, fn, vt, tvt, z = self.tile(m0, m1, n0, n1, full)
            if n0 in kept:
                p, a = kept.pop(n0)
            elif linear:
                s, a = fn(*xs)
                p = torch.exp(s - lse_col)
            else:
                (s, a), vjp_fn = torch.func.vjp(fn, *xs)
                p = torch.exp(s - lse_col)
            # p z, dp = z·(g vᵀ) and e = z·(g t_vᵀ) (None without t_v)
            dp, e = qk_t(g_blk, vt, G), None if tvt is None else qk_t(g_blk, tvt, G)
            pz = p
            if z is not None:
                pz, dp, e = p * z, dp * z, None if e is None else e * z
            a_bar = p * (dp - delta)
            inner = torch.addcmul(r0, dp, abar, value=-1.0)
            if e is not None:
                inner = inner + e
            if gd_blk is not None:
                ddp = qk_t(gd_blk, vt, G)
                inner = inner + (ddp if z is None else ddp * z) - sums.delta_dot
            s_bar = torch.addcmul(a * a_bar, p, inner)
            w = pz * (a - abar)  # ∂L/∂dp before z, per (row, key)
            # dV = Σ over the group's rows of wᵀ g (+ (p z)ᵀ ġ): terms (a, b, alpha) of aᵀ b
            dv_terms = [(w, g_blk, 1.0)]
            if gd_blk is not None:
                dv_terms.append((pz, gd_blk, 1.0))
            if linear:  # s = (c q) kᵀ + bias, a = c (q̇ kᵀ + q k̇ᵀ) + ...: the vjp by hand
                dq_blk = pv(s_bar, span(self.k, 2, n0, n1).to(self.acc), G, add=dq_blk,
                            alpha=scale)
                dk_terms = [(s_bar, q_blk, scale)]
                if self.tk is not None:
                    dq_blk = pv(a_bar, span(self.tk, 2, n0, n1), G, add=dq_blk, alpha=scale)
                if tq_blk is not None:
                    dk_terms.append((a_bar, tq_blk, scale))
                grads = {}
                if "mask" in names:  # s = ... + mask: its gradient is s̄ where it broadcasts
                    grads["mask"] = reduce_to(s_bar, xs[names.index("mask")].shape)
            else:
                grads = dict(zip(names, vjp_fn((s_bar, a_bar))))
                dq_blk = dq_blk + grads["q"]
                dk_terms = grads["k"]
            kv_into(n0, n1, dk_terms, dv_terms)
            if "softcap" in grads:
                dcap = grads["softcap"] if dcap is None else dcap + grads["softcap"]
            if "mask" in grads:
                dmask.add(n0, n1, grads["mask"])
        return dq_blk, dcap, dmask


def _sink_terms(p_sink: Tensor, t_s, abar: Tensor, c_sum: Tensor, delta: Tensor,
                dpd: Tensor) -> Tensor:
    """The sinks' part of the double backward per row, before the sum over rows:
    p_s (−C − Δ (t_s − ā) + ā Δ_pd), shared by :class:`_Hvp` and :class:`_PlainHvp`."""
    return p_sink * (-c_sum - delta * (t_s - abar) + abar * dpd)


class _PlainHvp:
    """:class:`_Hvp`'s two passes for plain CPU tensors that nothing differentiates (the
    pooled path) when the score map is linear in q and k with no learnable term of its own
    and ``first`` is None: the same sums, with GEMMs into per-thread tile buffers and the
    elementwise steps in place (docs/transforms.md, "Double backward, tile by tile": where
    it differs from :meth:`_Hvp.block`)."""

    def __init__(self, hvp: _Hvp, out: Tensor, blocks) -> None:
        self.h = hvp
        B, H, acc = hvp.B, hvp.H, hvp.acc
        self.k3 = hvp.k.to(acc).flatten(0, 1)  # (B·Hkv, Nk, ·)
        self.tk3 = None if hvp.tk is None else hvp.tk.flatten(0, 1)
        self.v3 = hvp.v.to(acc).flatten(0, 1)
        self.tv3 = None if hvp.tv is None else hvp.tv.flatten(0, 1)
        self.out = out.to(acc)
        # the keys' operands side by side, each GEMM over a run of their columns against a
        # block's rows built to match (a row constant joins a GEMM as one more column of
        # depth: docs/transforms.md, "Double backward, tile by tile"):
        #   [t_k | k | 1]: s − lse = [c q | −lse]·[k | 1]ᵀ, a = [c q | c t_q]·[t_k | k]ᵀ
        #   [v | 1 | t_v]: dP − Δ = [g | −Δ]·[v | 1]ᵀ, e + r1 = [r1 | g]·[1 | t_v]ᵀ
        ones = torch.ones_like(self.k3[..., :1])
        tk3 = torch.zeros_like(self.k3) if self.tk3 is None else self.tk3
        tv3 = torch.zeros_like(self.v3) if self.tv3 is None else self.tv3
        self.kx = torch.cat([tk3, self.k3, ones], -1)  # (B·Hkv, Nk, 2D + 1)
        self.vx = torch.cat([self.v3, ones, tv3], -1)  # (B·Hkv, Nk, 2Dv + 1)
        # the largest tile and a block's tiles, in elements: the buffers' sizes
        size = torch.finfo(acc).bits // 8
        rows = [B * H * (m1 - m0) for m0, m1, _ in blocks]
        self.tile_elems = max((r * (n1 - n0) for r, (_, _, kt) in zip(rows, blocks)
                               for n0, n1, _ in kt), default=0)
        self.arena_elems = min(_KEEP_BYTES // size, max(
            (2 * r * sum(n1 - n0 for n0, n1, _ in kt) for r, (_, _, kt) in zip(rows, blocks)),
            default=0))
        self.local = threading.local()  # each worker thread's buffers, for this call

    def _rows3(self, x: Tensor, m0: int, m1: int) -> Tensor:
        """A block's rows of a ``(B, H, Nq, X)`` tensor as ``(B·Hkv, G·BM, X)``, a group's
        query heads stacked (what one GEMM per KV head takes)."""
        r = span(x, 2, m0, m1)
        return r.reshape(self.h.B * self.h.Hkv, -1, r.shape[-1])

    def _buf(self, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
        """This thread's buffer ``name``: a tile (``shape``) or, without one, the arena."""
        bufs = self.local.__dict__.setdefault("bufs", {})
        if name not in bufs:
            n = self.arena_elems if shape is None else self.tile_elems
            bufs[name] = torch.empty(n, dtype=self.h.acc, device=self.h.q.device)
        return bufs[name] if shape is None else bufs[name][:math.prod(shape)].view(shape)

    def _scores(self, m0, m1, n0, n1, full, ql_b, s) -> tuple[Tensor, Tensor | None]:
        """The tile's p into ``s`` (``ql_b``: the block's [c q | −lse]), and its bool
        keep-mask (None: every key kept)."""
        D = self.h.D
        torch.bmm(ql_b, self.kx[:, n0:n1, D:].transpose(1, 2), out=s)
        keep = self.h.ts.allowed(m0, m1, n0, n1, full)
        if keep is not None:
            s.view(self.h.B, self.h.H, m1 - m0, n1 - n0).masked_fill_(~keep, float("-inf"))
        return s.exp_(), keep

    def _pa(self, m0, m1, n0, n1, qa_b, p, keep, a) -> Tensor:
        """The tile's p a into ``a`` (a masked key's a is 0, however large)."""
        D = self.h.D
        if self.tk3 is None:  # a = c t_q kᵀ
            right = self.kx[:, n0:n1, D:2 * D]
        elif self.h.tq is None:  # a = c q t_kᵀ
            right = self.kx[:, n0:n1, :D]
        else:
            right = self.kx[:, n0:n1, :2 * D]
        torch.bmm(qa_b, right.transpose(1, 2), out=a)
        if keep is not None:
            a.view(self.h.B, self.h.H, m1 - m0, n1 - n0).masked_fill_(~keep, 0.0)
        return a.mul_(p)

    def _z(self, m0, m1, n0, n1) -> Tensor | None:
        z = self.h.ts.dropout(m0, m1, n0, n1)
        return None if z is None else z.reshape(self.h.B * self.h.Hkv, -1, n1 - n0)

    def _plan_keep(self, lead, key_tiles) -> dict[int, tuple[int | None, int | None]]:
        """Where in the arena pass 1 keeps each tile's ``(p a, p)`` (None: recomputed):
        p a of every tile first, then p, as far as the arena goes."""
        sizes = [(n0, lead[0] * lead[1] * (n1 - n0)) for n0, n1, _ in key_tiles]
        at, room = 0, self.arena_elems
        places: dict[int, list] = {n0: [None, None] for n0, _ in sizes}
        for slot in (0, 1):
            for n0, n in sizes:
                if at + n <= room:
                    places[n0][slot], at = at, at + n
        return {n0: tuple(x) for n0, x in places.items()}

    def _q_rows(self, m0, m1) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor]:
        """A block's query-side operands (B·Hkv, G·BM, ·): lse, c q, c t_q (None without a
        direction), [c q | −lse] (see self.kx) and the rows of a ([c q | c t_q], the terms
        whose direction is 0 left out); c q is a view of [c q | −lse]."""
        h = self.h
        lse_b = self._rows3(h.lse_a.unsqueeze(-1), m0, m1)
        q_blk = self._rows3(h.q, m0, m1).to(h.acc) * h.scale
        tq_b = None if h.tq is None else self._rows3(h.tq, m0, m1) * h.scale
        ql_b = torch.cat([q_blk, -lse_b], -1)
        q_b = ql_b[..., :h.D]
        if tq_b is None:
            qa_b = q_b
        elif h.tk is None:
            qa_b = tq_b
        else:
            qa_b = torch.cat([q_b, tq_b], -1)
        return lse_b, q_b, tq_b, ql_b, qa_b

    def _row_sums(self, m0, m1, lse_b, g_b, out_b, abar, pav):
        """The row sums between the passes (module docstring): Δ_pd = g·out, C = g·(Σ p z a v
        + Σ p z t_v) → ā with the sinks' share, Δ, r1 = r0 − ā Δ and the sinks' gradient
        terms (None without sinks)."""
        h = self.h
        B, H, BM = h.B, h.H, m1 - m0
        dpd = (g_b * out_b).sum(-1, keepdim=True)
        c_sum = (g_b * pav).sum(-1, keepdim=True)
        delta = dpd - (0.0 if h.glse is None else self._rows3(
            h.glse.to(h.acc).unsqueeze(-1), m0, m1))
        dsink = None
        if h.sinks is not None:
            p_sink = torch.exp(h.sinks - lse_b.view(B, H, BM, 1))
            t_s = 0.0 if h.t_sink is None else h.t_sink
            abar = abar + (p_sink * t_s).reshape(B * self.h.Hkv, BM * h.G, 1)
            a4, c4, d4, dpd4 = (x.view(B, H, BM, 1) for x in (abar, c_sum, delta, dpd))
            dsink = _sink_terms(p_sink, t_s, a4, c4, d4, dpd4).sum(dim=(0, 2, 3))
        r1 = abar * dpd - c_sum  # r0 − ā Δ, r0 = Δ ā + ā Δ_pd − C
        return abar, delta, r1, dsink

    def block(self, m0, m1, key_tiles, kv_into):
        """:meth:`_Hvp.block` (its return value and ``kv_into`` terms). Long on purpose: the
        two passes and the row sums between them share the block's operands, kept tiles and
        buffers; split, each part would take them all."""
        h = self.h
        B, H, BM, Dv = h.B, h.H, m1 - m0, h.Dv
        lead = (B * self.h.Hkv, BM * h.G)
        lse_b, q_b, tq_b, ql_b, qa_b = self._q_rows(m0, m1)
        g_b, out_b = self._rows3(h.g_a, m0, m1), self._rows3(self.out, m0, m1)
        arena = self._buf("kept")
        places = self._plan_keep(lead, key_tiles)

        def tile_of(n0, n1, slot, scratch):
            shape = (*lead, n1 - n0)
            at = places[n0][slot]
            if at is None:
                return self._buf(scratch, shape)
            return arena[at:at + math.prod(shape)].view(shape)

        # -- pass 1: ā = Σ p a, and Σ p z a v + Σ p z t_v (∂L/∂g and C read it) --
        abar, pav = h.zeros(*lead, 1), h.zeros(*lead, Dv)
        for n0, n1, full in key_tiles:
            p, keep = self._scores(m0, m1, n0, n1, full, ql_b, tile_of(n0, n1, 1, "s"))
            pa = self._pa(m0, m1, n0, n1, qa_b, p, keep, tile_of(n0, n1, 0, "a"))
            abar += pa.sum(-1, keepdim=True)
            z = self._z(m0, m1, n0, n1)
            pav.baddbmm_(pa if z is None else pa * z, self.v3[:, n0:n1])
            if self.tv3 is not None:
                pav.baddbmm_(p if z is None else p * z, self.tv3[:, n0:n1])
        abar, delta, r1, dsink = self._row_sums(m0, m1, lse_b, g_b, out_b, abar, pav)
        dg = pav.sub_(abar * out_b)  # ∂L/∂g = Σ p z (a − ā) v + Σ p z t_v
        # -- pass 2: s̄ = p (e + r1) + (dP − Δ) w', ā_s = p (dP − Δ), w = z w', w' = p a − ā p --
        dq = h.zeros(*lead, h.D)
        g_delta = torch.cat([g_b, -delta], -1)  # [g | −Δ]·[v | 1]ᵀ = dP − Δ
        g_r1 = None if self.tv3 is None else torch.cat([r1, g_b], -1)  # e + r1, alike
        for n0, n1, full in key_tiles:
            shape = (*lead, n1 - n0)
            at_pa, at_p = places[n0]
            keep = None
            if at_p is None:
                p, keep = self._scores(m0, m1, n0, n1, full, ql_b, self._buf("s", shape))
            else:
                p = arena[at_p:at_p + math.prod(shape)].view(shape)
            if at_pa is None:
                if keep is None:
                    keep = h.ts.allowed(m0, m1, n0, n1, full)
                pa = self._pa(m0, m1, n0, n1, qa_b, p, keep, self._buf("a", shape))
            else:
                pa = arena[at_pa:at_pa + math.prod(shape)].view(shape)
            z = self._z(m0, m1, n0, n1)
            # dP − Δ and e + r1 (with dropout, z dP − Δ and z e + r1)
            if z is None:
                dp = torch.bmm(g_delta, self.vx[:, n0:n1, :Dv + 1].transpose(1, 2),
                               out=self._buf("dp", shape))
            else:
                dp = torch.bmm(g_b, self.v3[:, n0:n1].transpose(1, 2),
                               out=self._buf("dp", shape)).mul_(z).sub_(delta)
            if self.tv3 is None:
                s_bar = torch.mul(p, r1, out=self._buf("e", shape))
            elif z is None:
                s_bar = torch.bmm(g_r1, self.vx[:, n0:n1, Dv:].transpose(1, 2),
                                  out=self._buf("e", shape)).mul_(p)
            else:
                s_bar = torch.bmm(g_b, self.tv3[:, n0:n1].transpose(1, 2),
                                  out=self._buf("e", shape)).mul_(z).add_(r1).mul_(p)
            w = pa.addcmul_(p, abar, value=-1.0)
            s_bar.addcmul_(dp, w)
            a_bar = dp.mul_(p)
            if z is not None:
                w.mul_(z)
            dq.baddbmm_(s_bar, self.k3[:, n0:n1], alpha=h.scale)
            if self.tk3 is not None:
                dq.baddbmm_(a_bar, self.tk3[:, n0:n1], alpha=h.scale)
            q4 = (B, H, BM, -1)
            dk_terms = [(s_bar.view(q4), q_b.reshape(q4), 1.0)]
            if tq_b is not None:
                dk_terms.append((a_bar.view(q4), tq_b.reshape(q4), 1.0))
            kv_into(n0, n1, dk_terms, [(w.view(q4), g_b.view(q4), 1.0)])
        return (dq.view(B, H, BM, h.D), dg.view(B, H, BM, Dv), abar.view(B, H, BM), dsink,
                None, None)


def tiled_hvp(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: LaunchSpec,
              ops: Operands, g: Tensor, glse: Tensor | None, t: dict[str, Tensor | None],
              first: tuple[Tensor | None, Tensor | None] | None = None) -> dict[str, Tensor]:
    """The gradient of ``L = g·ȯ(t) + g_lse·lsė(t)`` (see the module docstring) with respect
    to g ("do"), g_lse ("dlse"), q, k, v, the float mask, sinks and softcap, each in the
    accumulation dtype at its operand's shape. ``t``: directions by name (q, k, v, mask,
    sinks, softcap, alibi; missing: 0). ``first = (ġ, ġ_lse)``: the forward-mode rule of the
    backward, ``Jᵀ ġ`` added to the q, k, v, mask, sinks and softcap entries."""
    threads = cpu.workers_for_call()  # read before one_thread sets the caller's to 1
    with one_thread(q):
        hvp = _Hvp(q, k, v, lse, spec, ops, g, glse, t, first)
        H, Nq, acc = hvp.H, hvp.Nq, hvp.acc
        gd, glse_d = (None, None) if first is None else first
        tensors = (q, k, v, out, lse, g, glse, gd, glse_d, *ops[:4], *t.values())
        pooled = plain(*tensors) and not (torch.is_grad_enabled() and any(
            isinstance(x, Tensor) and x.requires_grad for x in tensors))
        blocks = list(hvp.ts.query_blocks())
        if pooled:
            block = hvp.block
            # _PlainHvp builds s = c q kᵀ by hand: no score term (jvp.SCORE_TERMS) may join it
            if (first is None and hvp.linear and hvp.mask4 is None and ops.alibi is None
                    and not spec.terms.items and (hvp.tq is not None or hvp.tk is not None)):
                block = _PlainHvp(hvp, out, blocks).block
            res, extras = _pooled(blocks, block, hvp, threads)
        else:
            res, extras = _in_order(blocks, hvp.block, hvp)
        # each block's (dsinks part, dsoftcap part, dmask rows), summed in block order
        dsink, dcap = _sum(e[0] for e in extras), _sum(e[1] for e in extras)
        dmask_rows = [(m0, m1, e[2]) for (m0, m1, _), e in zip(blocks, extras) if e[2] is not None]
        if hvp.mask4 is not None:
            res["mask"] = _join_rows(dmask_rows, hvp.mask4, Nq).reshape(ops.attn_mask.shape)
        if ops.softcap is not None:
            res["softcap"] = (torch.zeros_like(ops.softcap, dtype=acc) if dcap is None
                              else reduce_to(dcap, ops.softcap.shape))
        if ops.sinks is not None:
            res["sinks"] = torch.zeros(H, dtype=acc, device=q.device) if dsink is None else dsink
        return res


def _terms(x, G: int) -> Tensor:
    """A KV-head gradient tile: ``x`` itself, or the sum of its terms ``[(a, b, alpha)]``,
    each ``alpha · Σ_group aᵀ b`` (:func:`attn.tiled.jvp.tp_kv`)."""
    if isinstance(x, Tensor):
        return x
    return _sum(tp_kv(a, b, G) * alpha if alpha != 1.0 else tp_kv(a, b, G) for a, b, alpha in x)


def _terms_into(into: Tensor, x, G: int) -> None:
    """``into += x`` for :func:`_terms`' ``x``, each term's GEMM accumulating in place."""
    if isinstance(x, Tensor):
        into.add_(x)
        return
    B, Hkv, N, X = into.shape
    into3 = into.view(B * Hkv, N, X)
    for a, b, alpha in x:
        a3 = grouped(a, G).reshape(B * Hkv, -1, N)
        b3 = grouped(b, G).reshape(B * Hkv, -1, X)
        into3.baddbmm_(a3.transpose(-2, -1), b3, alpha=alpha)


def _sum(xs) -> Tensor | None:
    """The sum of the non-None entries in order, None if there are none."""
    total = None
    for x in xs:
        if x is not None:
            total = x if total is None else total + x
    return total


def _in_order(blocks, block, hvp: _Hvp):
    """The query blocks in order on the caller, nothing written in place (the tensors may be
    functorch's or autograd's): ``{q, k, v, do, dlse}`` and each block's (dsinks part,
    dsoftcap part, dmask rows)."""
    B, H, Nq, Hkv, Nk, G, D, Dv = (hvp.B, hvp.H, hvp.Nq, hvp.Hkv, hvp.Nk, hvp.G, hvp.D, hvp.Dv)
    dk, dv = _Tiles(2), _Tiles(2)

    def kv_into(n0, n1, dk_t, dv_t):
        dk.add(n0, n1, _terms(dk_t, G))
        dv.add(n0, n1, _terms(dv_t, G))

    outs = [block(m0, m1, key_tiles, kv_into) for m0, m1, key_tiles in blocks]
    dq, dg, dl = list(zip(*outs))[:3] if outs else ((),) * 3

    def cat(xs, width):
        if not xs:
            return hvp.zeros(B, H, Nq, *width)
        return xs[0] if len(xs) == 1 else torch.cat(xs, dim=2)

    res = {"q": cat(dq, (D,)), "do": cat(dg, (Dv,)), "dlse": cat(dl, ()),
           "k": dk.join(Nk, hvp.zeros(B, Hkv, Nk, D)), "v": dv.join(Nk, hvp.zeros(B, Hkv, Nk, Dv))}
    return res, [o[3:] for o in outs]


def _runs(blocks, n_runs: int) -> list[list[int]]:
    """The query blocks cut into at most ``n_runs`` consecutive runs of about equal work (key
    tiles), from the blocks alone."""
    work = [len(kt) for _, _, kt in blocks]
    total = max(sum(work), 1)
    runs: list[list[int]] = [[] for _ in range(min(n_runs, len(blocks)))]
    done = 0
    for i, w in enumerate(work):
        runs[min(done * len(runs) // total, len(runs) - 1)].append(i)
        done += w
    return [r for r in runs if r]


def _pooled(blocks, block, hvp: _Hvp, threads):
    """Runs of query blocks (:func:`_runs`) as work items on the tiled backend's pool (plain
    CPU tensors, no gradient recorded): a run takes its blocks in order, writes their rows
    of dq, do and lse and sums their dK / dV into a partial of its own over the keys they
    see; the partials and the per-block sums are then added in run order, so the bits do
    not depend on how many workers took the runs."""
    B, H, Nq, Hkv, Nk, G, D, Dv = (hvp.B, hvp.H, hvp.Nq, hvp.Hkv, hvp.Nk, hvp.G, hvp.D, hvp.Dv)
    runs = _runs(blocks, _RUNS)
    dq, dg, dl = hvp.zeros(B, H, Nq, D), hvp.zeros(B, H, Nq, Dv), hvp.zeros(B, H, Nq)
    kv_parts: list = [None] * len(runs)
    extras: list = [None] * len(blocks)

    def item(r: int) -> None:
        lo = min((kt[0][0] for _, _, kt in (blocks[i] for i in runs[r]) if kt), default=0)
        hi = max((kt[-1][1] for _, _, kt in (blocks[i] for i in runs[r]) if kt), default=0)
        dk, dv = hvp.zeros(B, Hkv, max(hi - lo, 0), D), hvp.zeros(B, Hkv, max(hi - lo, 0), Dv)

        def kv_into(n0, n1, dk_t, dv_t):
            _terms_into(dk[:, :, n0 - lo:n1 - lo], dk_t, G)
            _terms_into(dv[:, :, n0 - lo:n1 - lo], dv_t, G)

        for i in runs[r]:
            m0, m1, key_tiles = blocks[i]
            dq_b, dg_b, dl_b, dsink, dcap, drow = block(m0, m1, key_tiles, kv_into)
            dq[:, :, m0:m1], dg[:, :, m0:m1], dl[:, :, m0:m1] = dq_b, dg_b, dl_b
            extras[i] = (dsink, dcap, drow)
        kv_parts[r] = (lo, hi, dk, dv)

    cpu.run_items(item, len(runs), threads=threads)
    dk, dv = hvp.zeros(B, Hkv, Nk, D), hvp.zeros(B, Hkv, Nk, Dv)
    for lo, hi, dk_r, dv_r in kv_parts:
        dk[:, :, lo:hi] += dk_r
        dv[:, :, lo:hi] += dv_r
    res = {"q": dq, "do": dg, "dlse": dl, "k": dk, "v": dv}
    return res, extras


def _join_rows(blocks: list[tuple[int, int, Tensor]], mask4: Tensor, Nq: int) -> Tensor:
    """The mask's gradient from its query blocks' rows (summed where the mask broadcasts
    along the rows)."""
    acc = _acc_dtype(mask4.dtype)
    if not blocks:
        return torch.zeros(mask4.shape, dtype=acc, device=mask4.device)
    if mask4.shape[2] == 1:
        return _sum(x for _, _, x in blocks)
    parts, at = [], 0
    for m0, m1, x in blocks:
        if m0 > at:
            parts.append(torch.zeros(*x.shape[:2], m0 - at, x.shape[3], dtype=acc,
                                     device=x.device))
        parts.append(x)
        at = m1
    if at < Nq:
        x = blocks[0][2]
        parts.append(torch.zeros(*x.shape[:2], Nq - at, x.shape[3], dtype=acc, device=x.device))
    return torch.cat(parts, dim=2)


def _legacy_batched(x: Tensor | None) -> bool:
    """Whether ``x`` is batched by torch's legacy vmap (``torch._vmap_internals``, which
    gradcheck's batched-gradient checks use): it has no rule for the launchers' views and
    ``out=`` GEMMs, and passes no in_dims to unwrap by."""
    return x is not None and "Batched" in str(torch._C._dispatch_keys(x)).replace(
        "FuncTorchBatched", "")


def _pure_backward(static, do, dlse, q, k, v, out, lse, ops: Operands) -> tuple:
    """The first-order gradients by :func:`tiled_hvp` (no direction, ``first = (do,
    dlse)``): plain tensor code, for tensors the launchers cannot take."""
    r = tiled_hvp(q, k, v, out, lse, static.spec, ops._replace(captured=()), do, dlse, {},
                  first=(do, dlse))
    like = (q, k, v, ops.attn_mask, ops.sinks, ops.softcap)
    wanted = (True, True, True, static.need_dmask, True, static.need_dcap)
    return _in_dtypes(r, _GRAD_NAMES, like, wanted) + (None,) * len(ops.captured)


def _in_dtypes(r: dict[str, Tensor], names, like, wanted) -> tuple:
    """:func:`tiled_hvp`'s results ``r`` by ``names``, each in its ``like``'s dtype; None
    where ``like`` is None, it is not ``wanted`` or ``r`` has no such entry."""
    return tuple(None if x is None or not w or n not in r else r[n].to(x.dtype)
                 for n, x, w in zip(names, like, wanted))


@dataclasses.dataclass(frozen=True)
class Static:
    """The non-tensor inputs of :class:`_TiledBackward`: the call's spec and tile config, the
    first-order launcher (``attn.tiled.attention._bwd``) and which optional gradients the
    forward's inputs need."""
    spec: LaunchSpec
    config: object
    bwd: Callable
    need_dmask: bool
    need_dcap: bool


def _foldable(spec: LaunchSpec, ops: Operands, need_dmask: bool) -> bool:
    """Whether the mapped dimension may fold into B (:mod:`attn.batching`)."""
    return (spec.score_mod is None and spec.mask_mod is None and spec.mask_blocks is None
            and spec.dropout_p == 0.0 and not spec.sharded and spec.alibi_rows is None
            and ops.sinks is None and ops.softcap is None and not ops.captured
            and not need_dmask)


class _TiledBackward(torch.autograd.Function):
    """Tiled attention's backward ``(do, dlse) → (dq, dk, dv, dmask, dsinks, dsoftcap,
    *dcaptured)`` as a function of its own, so that it is differentiable again: its backward
    and its forward-mode rule are :func:`tiled_hvp`. out, lse and lse2 are the forward's,
    functions of q, k, v: the rules give total derivatives and nothing to them."""

    @staticmethod
    def forward(static: Static, do, dlse, q, k, v, out, lse, lse2, attn_mask, sinks, softcap,
                alibi, *captured):
        ops = Operands(attn_mask, sinks, softcap, alibi, captured)
        if not torch.compiler.is_compiling() and any(
                _legacy_batched(x) for x in (do, dlse, q, k, v)):
            return _pure_backward(static, do, dlse, q, k, v, out, lse, ops)
        g = static.bwd(do.contiguous(), dlse, q, k, v, out, lse, static.spec, ops,
                       need_dmask=static.need_dmask, need_dcap=static.need_dcap, lse2=lse2,
                       config=static.config)
        dmask = None if g.dmask is None else g.dmask.reshape(attn_mask.shape).to(attn_mask.dtype)
        dsinks = None if g.dsinks is None else g.dsinks.to(sinks.dtype)
        dcap = (None if g.dsoftcap is None
                else reduce_to(g.dsoftcap, softcap.shape).to(softcap.dtype))
        dcaptured = tuple(None if d is None else d.to(c.dtype)
                          for d, c in zip(g.dcaptured, captured))
        return (g.dq.to(q.dtype), g.dk.to(k.dtype), g.dv.to(v.dtype), dmask, dsinks, dcap,
                *dcaptured)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        static, do, dlse, q, k, v, out, lse, _, attn_mask, sinks, softcap, alibi, *cap = inputs
        saved = (do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, alibi)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)
        ctx.static, ctx.captured = static, tuple(cap)
        ctx.outputs_none = tuple(o is None for o in output)

    @staticmethod
    def _saved(ctx):
        do, dlse, q, k, v, out, lse, attn_mask, sinks, softcap, alibi = ctx.saved_tensors
        ops = Operands(attn_mask, sinks, softcap, alibi, ctx.captured)
        return do, dlse, q, k, v, out, lse, ops

    @staticmethod
    def backward(ctx, *grads):
        do, dlse, q, k, v, out, lse, ops = _TiledBackward._saved(ctx)
        if any(gc is not None for gc in grads[6:]):
            unsupported(ctx.static.spec, ops, "the double backward")
        t = dict(zip(_GRAD_NAMES, grads[:6]))
        r = tiled_hvp(q, k, v, out, lse, ctx.static.spec, ops._replace(captured=()), do, dlse,
                      t)
        # forward's inputs: static, do, dlse, q, k, v, out, lse, lse2, the four operands
        names = (None, "do", "dlse", *"qkv", None, None, None, *_GRAD_NAMES[3:], None)
        like = (None, do, dlse, q, k, v, None, None, None, *ops[:3], None)
        return (_in_dtypes(r, names, like, ctx.needs_input_grad)
                + (None,) * len(ctx.captured))

    @staticmethod
    def vmap(info, in_dims, static, do, dlse, q, k, v, out, lse, lse2, attn_mask, sinks,
             softcap, alibi, *captured):
        args = (static, do, dlse, q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi,
                *captured)
        ops = Operands(attn_mask, sinks, softcap, alibi, tuple(captured))
        X = info.batch_size
        if not _foldable(static.spec, ops, static.need_dmask):
            return batching.call_per_sample(_TiledBackwardJvp.apply, X, in_dims, args)
        # (no sinks, softcap or captures: _foldable)
        res = _TiledBackwardJvp.apply(*batching.fold_args(
            args, in_dims, X, batching.rows_of(q, in_dims[3]), mask=9))
        outs = tuple(batching.unfold(x, X) for x in res)
        return outs, tuple(None if o is None else 0 for o in outs)


class _TiledBackwardJvp(_TiledBackward):
    """:class:`_TiledBackward` with its forward-mode rule (``jacfwd(jacrev(f))``), taken
    under torch.func transforms and forward-mode AD (torch.compile cannot trace a Function
    that defines ``jvp``)."""

    @staticmethod
    def jvp(ctx, _static, t_do, t_dlse, t_q, t_k, t_v, _out, _lse, _lse2, t_mask, t_sinks,
            t_cap, t_alibi, *t_captured):
        do, dlse, q, k, v, out, lse, ops = _TiledBackward._saved(ctx)
        if any(tc is not None for tc in t_captured):
            unsupported(ctx.static.spec, ops, "forward-mode AD of the backward")
        t = {"q": t_q, "k": t_k, "v": t_v, "mask": t_mask, "sinks": t_sinks,
             "softcap": t_cap, "alibi": t_alibi}
        if t_do is None:
            t_do = torch.zeros_like(do)
        r = tiled_hvp(q, k, v, out, lse, ctx.static.spec, ops._replace(captured=()), do, dlse,
                      t, first=(t_do, t_dlse))
        like = (q, k, v, ops.attn_mask, ops.sinks, ops.softcap)
        wanted = tuple(not none for none in ctx.outputs_none)
        return _in_dtypes(r, _GRAD_NAMES, like, wanted) + (None,) * len(ctx.captured)


def differentiable_backward(static: Static, do: Tensor, dlse: Tensor | None, q: Tensor,
                            k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            lse2: Tensor | None, ops: Operands) -> tuple:
    """Tiled attention's gradients ``(dq, dk, dv, dmask, dsinks, dsoftcap, *dcaptured)``
    through :class:`_TiledBackward`: differentiable again (create_graph=True, torch.func)."""
    args = (do, dlse, q, k, v, out, lse, *ops[:4], *ops.captured)
    fn = _TiledBackwardJvp if transforms.active(*args) else _TiledBackward
    return fn.apply(static, do, dlse, q, k, v, out, lse, lse2, ops.attn_mask, ops.sinks,
                    ops.softcap, ops.alibi, *ops.captured)
