"""The ordered score pipeline of one (query block, key block) tile: :class:`_Tile` rebuilds a
tile's scores (scale, score_mod, softcap, ALiBi, masks, base-2 units) and its dropout state,
and holds the checks that decide how masking may be done exactly."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attn.masks import as_4d, dropout_keep, dropout_keep_rows
from attn.mods import checked_keep
from attn.spec import LaunchSpec
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled.gemm import _Gemm

# Scores live in base-2 units (s·log2 e), probabilities are exp2(s - m), and the forward
# keeps lse2 = (m, log2 l) for the backward in two parts (docs/design.md, "Base-2 scores")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The static score variants' terms (attn.spec.ScoreTerms, by name) _Tile.scores applies; a
# call carrying any other is refused when its tiles are built
SCORE_TERMS: tuple[str, ...] = ()


def _scores_finite(q: Tensor, k: Tensor, spec: LaunchSpec) -> bool:
    """Whether every q·k of the call is surely finite: q and k finite and
    ``max|q|·max|k|·D·scale`` (with log2 e) below the accumulation dtype's largest value.
    Off CPU it answers False without looking (no host sync): the masks then replace."""
    if q.numel() == 0 or k.numel() == 0:
        return True
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    fmax = torch.finfo(_acc_dtype(q.dtype)).max
    bound = abs(spec.qk_scale) * LOG2E * q.shape[-1]
    for x in (q, k):  # aminmax propagates NaN, and inf fails the bound
        lo, hi = torch.aminmax(x)
        bound *= max(-lo.item(), hi.item())
    return bound < fmax  # False for NaN


def _values_may_overflow(v: Tensor, n_k: int) -> bool:
    """Whether ``Σ_j p_j v_j`` over up to ``n_k`` keys may pass half the accumulation dtype's
    largest value (docs/design.md, "Values near the dtype's largest"); NaN and ±inf answer
    False (the output is not finite anyway), off CPU and while compiling True unlooked."""
    fmax = torch.finfo(_acc_dtype(v.dtype)).max
    if v.numel() == 0 or torch.finfo(v.dtype).max * 2.0 * n_k <= fmax:
        return False
    if v.device.type != "cpu" or torch.compiler.is_compiling():
        return True
    lo, hi = torch.aminmax(v)
    return 1.0 < max(-lo.item(), hi.item()) * 2.0 * n_k / fmax < float("inf")


def tile_index(x: Tensor, m0: int, m1: int, n0: int, n1: int) -> tuple[slice, ...]:
    """Tile [m0, m1) x [n0, n1) of a 4-D mask (or its gradient) at its own broadcast shape:
    a size-1 dim taken whole."""
    return (slice(None), slice(None), slice(m0, m1) if x.shape[2] != 1 else slice(None),
            slice(n0, n1) if x.shape[3] != 1 else slice(None))


def mod_index(spec: LaunchSpec, B: int, H: int, m0: int, m1: int, n0: int, n1: int,
              device: torch.device, b0: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A tile's ``(b, h, q_idx, kv_idx)`` for a score_mod / mask_mod, broadcasting to (B, H,
    BM, BN), in global rows, heads and positions (``b0``: the first batch row's)."""
    return (torch.arange(b0, b0 + B, device=device).view(B, 1, 1, 1),
            (torch.arange(H, device=device) + spec.head_start).view(1, H, 1, 1),
            (torch.arange(m0, m1, device=device) + spec.q_start).view(1, 1, -1, 1),
            (torch.arange(n0, n1, device=device) + spec.k_start).view(1, 1, 1, -1))


def alibi_distance(spec: LaunchSpec, m0: int, m1: int, n0: int, n1: int,
                   device: torch.device) -> tuple[Tensor | None, Tensor]:
    """ALiBi's integer ``|distance|`` (BM, BN) over a tile: from the band's diagonal, or,
    packed (``spec.alibi_rows``), inside each row's own sequence, with the rows' sequence
    indices (else None)."""
    offs_m = torch.arange(m0, m1, device=device)
    offs_n = torch.arange(n0, n1, device=device)
    if spec.alibi_rows is None:
        return None, (offs_n[None, :] - (offs_m[:, None] + spec.local_band().offset)).abs()
    seq, pos_m, pos_n = spec.alibi_rows(offs_m + spec.q_start, offs_n + spec.k_start)
    return seq, (pos_n[None, :] - pos_m[:, None]).abs()


def dropout_keep_scale(spec: LaunchSpec, bh: Tensor, heads: int, h: Tensor, m0: int, m1: int,
                       n0: int, n1: int, acc: torch.dtype) -> Tensor:
    """Tile [m0, m1) x [n0, n1)'s kept elements (at global positions) scaled by 1/(1-p),
    dropped ones 0, at ``bh``'s (b·heads + h) shape + (BM, BN); packed
    (``spec.dropout_rows``), each row's own b·heads + ``h`` instead."""
    offs_m = torch.arange(m0, m1, device=bh.device) + spec.q_start
    offs_n = torch.arange(n0, n1, device=bh.device) + spec.k_start
    if spec.dropout_rows is None:
        keep = dropout_keep(spec.dropout_seed, bh, offs_m, offs_n, spec.dropout_p)
    else:  # packed: one batch row holding many sequences (B == 1)
        b_rows, offs_m, offs_n = spec.dropout_rows(offs_m, offs_n)
        keep = dropout_keep_rows(spec.dropout_seed, b_rows * heads + h, offs_m, offs_n,
                                 spec.dropout_p)
    return keep.to(acc) / (1.0 - spec.dropout_p)


class _Tile:
    """What every (query block, key block) tile needs to rebuild its scores, one ordered
    pipeline (:meth:`scores`): scale, score_mod, softcap, ALiBi, masks, base-2 units; and its
    dropout scale. The GEMMs and their scratch are ``gemm``'s (:class:`attn.tiled.gemm._Gemm`).

    Layout: a query block as ``(B·Hkv, G·BM, D)`` with the G query heads of a group stacked
    along rows, scores ``(B·Hkv, G·BM, BN)``.
    """

    def __init__(self, q: Tensor, k: Tensor, spec: LaunchSpec, gemm: _Gemm,
                 attn_mask: Tensor | None, softcap_t: Tensor | None,
                 alibi: Tensor | None = None, b0: int = 0, *, finite_scores: bool) -> None:
        B, H, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        spec.terms.refuse_unknown(SCORE_TERMS, "the tiled backend")
        self.B, self.H, self.Hkv, self.G = B, H, Hkv, H // Hkv
        self.spec = spec
        self.band = spec.local_band()
        self.device = q.device
        acc = self.acc_dtype = _acc_dtype(q.dtype)
        self.q = q
        self.gemm = gemm  # q kᵀ, and the values value_offset reads
        self.mask5 = self.mask4 = None
        self.ninf = torch.tensor(float("-inf"), dtype=acc, device=q.device)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            self.mask4 = as_4d(attn_mask)  # its own broadcast shape; per tile a 0 / -inf bias
        elif attn_mask is not None:
            self.mask5 = as_4d(attn_mask).expand(B, H, Nq, Nk).view(B, Hkv, self.G, Nq, Nk)
        # Masked scores are *replaced* by -inf, so a key outside the mask never reaches a row
        # (NaN + -inf is NaN). The additive 0 / -inf bias (docs/design.md, "Masks as a bias")
        # is as exact only while every q·k is finite: the caller's answer (_facts, once a call)
        self.masked = (not self.band.is_full or attn_mask is not None
                       or spec.mask_mod is not None)
        self.finite_scores = not self.masked or finite_scores
        # set by the forward (_values_may_overflow): whether value_offset looks at the tiles
        self.values_may_overflow = False
        self._value_offsets: dict[tuple[int, int], Tensor | None] = {}
        # log2 e in the q scale when every step up to the softmax is linear in s or a -inf fill
        self.fold_log2 = (spec.score_mod is None and spec.softcap is None and softcap_t is None
                          and self.mask5 is None)
        if gemm.low_qk:  # q blocks stay raw bf16 (q_block): q·kᵀ's conversion takes the scale
            gemm.qk_scale = spec.qk_scale * (LOG2E if self.fold_log2 else 1.0)
        self.cap5 = (None if softcap_t is None
                     else softcap_t.to(acc).expand(H).reshape(1, Hkv, self.G, 1, 1))
        # -- ALiBi: minus the slopes, per (batch, head), or per (head, sequence) when packed
        self.alibi5 = self.alibi_seq = None
        if alibi is not None and spec.alibi_rows is None:
            self.alibi5 = -self._units(alibi.to(acc)).expand(B, H).reshape(B, Hkv, self.G, 1, 1)
        elif alibi is not None:  # (Hkv, G, seqs)
            self.alibi_seq = -self._units(alibi.to(acc)).t().reshape(Hkv, self.G, -1)
        self._alibi_dist: dict[tuple[int, int, int], Tensor] = {}
        if spec.dropout_p > 0.0:
            # the hash reads global (b·H + h, i, j): a shard draws the unsharded mask
            heads = spec.heads_total or H
            h = torch.arange(H, device=q.device) + spec.head_start
            b = torch.arange(b0, b0 + B, device=q.device)  # b0: this batch chunk's first row
            self.bh = (b[:, None] * heads + h).view(B, Hkv, self.G)
            self.heads, self.h_glob = heads, h.view(1, Hkv, self.G, 1)
        self._band_masks: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self.score_mod, self.mask_mod, self.b0 = spec.score_mod, spec.mask_mod, b0

    def _units(self, x: Tensor) -> Tensor:
        """A term added to the scores, in the units they have when it is added."""
        return x * LOG2E if self.fold_log2 else x

    def _idx(self, m0: int, m1: int, n0: int, n1: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return mod_index(self.spec, self.B, self.H, m0, m1, n0, n1, self.device, self.b0)

    def _score_mod(self, s: Tensor, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """``score_mod`` on a tile viewed as (B, H, BM, BN); back in the tile layout."""
        shape = (self.B, self.H, m1 - m0, n1 - n0)
        out = self.score_mod(s.view(shape), *self._idx(m0, m1, n0, n1))
        if not isinstance(out, Tensor):
            raise TypeError(f"score_mod must return a tensor, got {type(out).__name__}")
        try:
            out = torch.broadcast_to(out.to(self.acc_dtype), shape)
        except RuntimeError:
            raise ValueError(f"score_mod returned shape {tuple(out.shape)}, which does not "
                             f"broadcast to the tile's scores (B, H, BM, BN) = {shape}") from None
        return out.reshape(s.shape).contiguous()  # the steps after it work in place

    def mask_mod_keep(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """``mask_mod`` on one tile: bool broadcastable to (B, H, BM, BN), True = attend."""
        keep = checked_keep(self.mask_mod(*self._idx(m0, m1, n0, n1)))
        shape = (self.B, self.H, m1 - m0, n1 - n0)
        try:
            torch.broadcast_shapes(keep.shape, shape)
        except RuntimeError:
            raise ValueError(f"mask_mod returned shape {tuple(keep.shape)}, which does not "
                             f"broadcast to the tile (B, H, BM, BN) = {shape}") from None
        return keep

    def q_block(self, m0: int, m1: int) -> Tensor:
        """Scaled queries ``(B·Hkv, G·BM, D)`` in the accumulation dtype (a fresh copy); the
        scale carries log2 e when :attr:`fold_log2`. Where the GEMMs run q·kᵀ in bf16
        (``gemm.low_qk``), the queries as they are, and the scale goes to the GEMM."""
        if self.gemm.low_qk:
            q_blk = self.q[:, :, m0:m1].contiguous()
            return q_blk.view(self.B * self.Hkv, self.G * (m1 - m0), q_blk.shape[-1])
        scale = self.spec.qk_scale * (LOG2E if self.fold_log2 else 1.0)
        q_blk = self.q[:, :, m0:m1].to(self.acc_dtype) * scale  # (B, H, BM, D)
        return q_blk.reshape(self.B * self.Hkv, self.G * (m1 - m0), q_blk.shape[-1])

    def _band_mask(self, m0: int, m1: int, n0: int, n1: int) -> tuple[Tensor, Tensor]:
        """The band of a tile as (BM, BN) ``(inside, bias)``: bool, and the additive 0 / -inf
        bias. A tile's band depends only on its diagonal offset and size: each is built once."""
        key = (n0 - m0, m1 - m0, n1 - n0)
        if key not in self._band_masks:
            offs_m = torch.arange(m0, m1, device=self.device)
            offs_n = torch.arange(n0, n1, device=self.device)
            inside = self.band.mask(offs_m, offs_n)
            bias = torch.zeros(inside.shape, dtype=self.acc_dtype, device=self.device)
            self._band_masks[key] = inside, bias.masked_fill_(~inside, float("-inf"))
        return self._band_masks[key]

    def _mask_out(self, s: Tensor, keep: Tensor, bias: Tensor | None = None) -> None:
        """``s`` ← ``s`` where ``keep``, else -inf, in place (``keep`` broadcasts to ``s``):
        the bias add where every score is finite, a replacement otherwise."""
        if self.finite_scores:
            s.add_(torch.where(keep, 0.0, self.ninf) if bias is None else bias)
        else:
            torch.where(keep, s, self.ninf, out=s)

    def _add_alibi(self, s5: Tensor, m0: int, m1: int, n0: int, n1: int) -> None:
        """``s5 += −slope · |distance|`` in place: distances from the band's diagonal, global
        (a tile's depend only on its diagonal offset and size: built once), or, packed,
        inside each row's own sequence with that sequence's slopes."""
        if self.alibi5 is not None:
            key = (n0 - m0, m1 - m0, n1 - n0)
            if key not in self._alibi_dist:
                dist = alibi_distance(self.spec, m0, m1, n0, n1, self.device)[1]
                self._alibi_dist[key] = dist.to(self.acc_dtype)  # (BM, BN)
            s5.addcmul_(self.alibi5, self._alibi_dist[key])
            return
        seq, dist = alibi_distance(self.spec, m0, m1, n0, n1, self.device)
        s5.addcmul_(self.alibi_seq[:, :, seq].unsqueeze(-1), dist.to(self.acc_dtype))

    def scores(self, q_blk: Tensor, m0: int, m1: int, n0: int, n1: int, full: bool,
               track: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Masked scores ``(B·Hkv, G·BM, BN)`` in base-2 units; with softcap also
        ``u = s_raw / c`` and ``t = tanh(u)`` (the backward needs both). ``full``: the block
        classification says no mask (band, mask_mod) masks anything in this tile. Order:
        scale → score_mod → softcap → ALiBi → masks → log2 e (the ALiBi bias is a constant:
        dS flows through it unchanged, so the backward needs nothing more). ``track``
        (backward): the score_mod runs under autograd and ``self.mod_graph`` keeps
        ``(scores in, scores out)`` for :meth:`score_mod_vjp`."""
        B, Hkv, G, BM, BN = self.B, self.Hkv, self.G, m1 - m0, n1 - n0
        s = self.gemm.qk(q_blk, n0, n1)  # q_blk already scaled
        if self.score_mod is not None:
            if track:
                s_in = s.detach().requires_grad_()
                with torch.enable_grad():
                    s_out = self._score_mod(s_in, m0, m1, n0, n1)
                self.mod_graph = (s_in, s_out)
                s = s_out.detach().clone()  # the steps below work in place: keep the graph's
            else:
                s = self._score_mod(s, m0, m1, n0, n1)
        s5 = s.view(B, Hkv, G, BM, BN)
        u = t = None
        if self.cap5 is not None or self.spec.softcap is not None:
            c = self.cap5 if self.cap5 is not None else self.spec.softcap
            u = s5.div_(c).view(B * Hkv, G * BM, BN)
            t = torch.tanh(u)
            s = t * c if self.cap5 is None else (t.view_as(s5) * c).view_as(t)
            s5 = s.view(B, Hkv, G, BM, BN)
        if self.alibi5 is not None or self.alibi_seq is not None:
            self._add_alibi(s5, m0, m1, n0, n1)
        # -- masks --
        if not full:
            if not self.band.is_full:
                self._mask_out(s5, *self._band_mask(m0, m1, n0, n1))
            if self.mask_mod is not None:
                keep = self.mask_mod_keep(m0, m1, n0, n1)
                s.view(B, self.H, BM, BN).masked_fill_(~keep, float("-inf"))
        if self.mask4 is not None:
            m4 = self.mask4
            self._mask_out(s.view(B, self.H, BM, BN), m4[tile_index(m4, m0, m1, n0, n1)])
        elif self.mask5 is not None:
            bias = self.mask5[..., m0:m1, n0:n1]
            s5.add_(bias)
            if not self.finite_scores:  # a -inf entry masks: NaN + -inf would stay NaN
                s5.masked_fill_(bias == float("-inf"), float("-inf"))
        if not self.fold_log2:
            s.mul_(LOG2E)
        return s, u, t

    def score_mod_vjp(self, ds: Tensor, captured: tuple[Tensor, ...]
                      ) -> tuple[Tensor, tuple[Tensor | None, ...]]:
        """The score_mod's backward on the last tracked tile, by autograd: dS before the mod
        and this tile's share of each captured tensor's gradient (None where unused)."""
        s_in, s_out = self.mod_graph
        self.mod_graph = None
        grads = torch.autograd.grad(s_out, (s_in, *captured), grad_outputs=ds.view_as(s_out),
                                    allow_unused=True)
        ds_in = grads[0] if grads[0] is not None else torch.zeros_like(s_in)
        return ds_in, grads[1:]

    def dropout_scale(self, m0: int, m1: int, n0: int, n1: int) -> Tensor:
        """Kept elements scaled by 1/(1-p), dropped ones 0: ``(B·Hkv, G·BM, BN)``."""
        z = dropout_keep_scale(self.spec, self.bh, self.heads, self.h_glob, m0, m1, n0, n1,
                               self.acc_dtype)  # (B, Hkv, G, BM, BN)
        return z.view(self.B * self.Hkv, self.G * (m1 - m0), n1 - n0)

    def value_offset(self, n0: int, n1: int) -> Tensor | None:
        """The forward's exponent offset ``c = log2(max|v| · 2·Nk / fmax) ≥ 0`` for key tile
        [n0, n1), per (batch row, kv head) as ``(B·Hkv, 1, 1)`` in base-2 units, or None
        where it is 0 for every row (docs/design.md, "Values near the dtype's largest")."""
        if not self.values_may_overflow:
            return None
        key = (n0, n1)
        if key not in self._value_offsets:
            vb = self.gemm.v3[:, n0:n1]
            vmax = torch.maximum(vb.amax(dim=(1, 2)), -vb.amin(dim=(1, 2))).to(self.acc_dtype)
            fmax = torch.finfo(self.acc_dtype).max
            c = torch.log2(vmax) + math.log2(2.0 * self.gemm.v3.shape[1] / fmax)
            c = torch.where((c > 0.0) & (c < float("inf")), c, 0.0).view(-1, 1, 1)  # NaN: 0
            if self.device.type == "cpu" and not torch.compiler.is_compiling() \
                    and not bool(c.any()):
                c = None  # the ordinary steps, bit for bit
            self._value_offsets[key] = c
        return self._value_offsets[key]

    def rows(self, x: Tensor, m0: int, m1: int) -> Tensor:
        """Per-row values (B, H, Nq) of a query block as a column ``(B·Hkv, G·BM, 1)``."""
        return x[:, :, m0:m1].reshape(self.B * self.Hkv, self.G * (m1 - m0), 1)

