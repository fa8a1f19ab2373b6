"""Double backward of tiled attention: the backward as an autograd.Function of its own
(:class:`_TiledBackward`) whose backward and forward-mode rule recompute tile by tile, O(N)
memory, for every variant the score pipeline of :class:`attn.tiled.jvp.TileScores` covers.

The backward maps ``(g, g_lse)`` (the cotangents of out and lse) to ``Jᵀ (g, g_lse)``. Its
own vector-Jacobian product against cotangents ``t`` of those gradients (t for q, k, v, the
mask, sinks and softcap) is the gradient of the scalar ``L = g·ȯ(t) + g_lse·lsė(t)``, where
``(ȯ, lsė)`` is the forward-mode tangent along t (:mod:`attn.tiled.jvp`): so ``∂L/∂g = ȯ``,
``∂L/∂g_lse = lsė``, and with a_j = ṡ_j along t, dp_j = z_j g·v_j, e_j = g·t_v_j,
c_j = a_j dp_j + z_j e_j, row sums ā = Σ p a, C = Σ p c, Δ_pd = Σ p dp, Δ = Δ_pd − g_lse:

    ∂L/∂s_j = p_j [(c_j − C) − Δ (a_j − ā) − ā (dp_j − Δ_pd)],   ∂L/∂a_j = p_j (dp_j − Δ),
    ∂L/∂v_j = z_j p_j (a_j − ā) g,

and ``(∂L/∂s, ∂L/∂a)`` go back through the tile's score function and its tangent map (the
vjp of a jvp, one tile at a time) to q, k, the softcap and the mask. A first pass over a
query block's tiles gives the row sums, a second the gradients. The forward-mode rule of the
backward (what ``jacfwd(jacrev(f))`` needs) is the same kernel with the tangent of ``g`` added
as a first-order term: ``Jᵀ ġ + ∇(g·J ẋ)`` (the Hessian is symmetric).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attn import transforms
from attn.grads import reduce_to
from attn.masks import as_4d
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import batching
from attn.tiled.jvp import (TileScores, one_thread, probs, pv, qk_t, rows, safe_lse, span,
                            tp_kv, unsupported)

_GRAD_NAMES = ("q", "k", "v", "mask", "sinks", "softcap")


class _Tiles:
    """Per-tile partial sums along one dim of a tensor, joined at the end without in-place
    writes (vmap-safe): ``add(n0, n1, x)``, then :meth:`join` to ``length`` along ``dim``."""

    def __init__(self, dim: int, broadcast: bool = False) -> None:
        self.dim, self.broadcast, self.parts = dim, broadcast, {}

    def add(self, n0: int, n1: int, x: Tensor) -> None:
        self.parts[(n0, n1)] = x if (n0, n1) not in self.parts else self.parts[(n0, n1)] + x

    def join(self, length: int, like: Tensor) -> Tensor:
        d = self.dim % like.dim()
        total = None
        for (n0, n1), x in self.parts.items():
            if self.broadcast:  # the tensor broadcasts along this dim: a sum, not a slice
                part = x
            else:
                pad = [0, 0] * (like.dim() - 1 - d) + [n0, length - n1]
                part = F.pad(x, pad)
            total = part if total is None else total + part
        return torch.zeros_like(like) if total is None else total


def tiled_hvp(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: LaunchSpec,
              ops: Operands, g: Tensor, glse: Tensor | None, t: dict[str, Tensor | None],
              first: tuple[Tensor | None, Tensor | None] | None = None) -> dict[str, Tensor]:
    """The gradient of ``L = g·ȯ(t) + g_lse·lsė(t)`` (see the module docstring) with respect
    to g ("do"), g_lse ("dlse"), q, k, v, the float mask, sinks and softcap, each in the
    accumulation dtype at its operand's shape. ``t``: directions by name (q, k, v, mask,
    sinks, softcap, alibi; missing: 0). ``first = (ġ, ġ_lse)``: the forward-mode rule of the
    backward, ``Jᵀ ġ`` added to the q, k, v, mask, sinks and softcap entries."""
    with one_thread(q):
        return _tiled_hvp(q, k, v, out, lse, spec, ops, g, glse, t, first)


def _tiled_hvp(q, k, v, out, lse, spec, ops, g, glse, t, first):
    unsupported(spec, ops, "the double backward")
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    ts = TileScores(q, k, spec, ops)
    primal = {"q": q, "k": k, "softcap": ops.softcap, "mask": ops.attn_mask, "alibi": ops.alibi}
    lse_a, g_a = safe_lse(lse, acc), g.to(acc)
    tv = None if t.get("v") is None else t["v"].to(acc)
    gd, glse_d = (None, None) if first is None else first
    gd = None if gd is None else gd.to(acc)
    sinks = None if ops.sinks is None else ops.sinks.to(acc).view(1, H, 1, 1)
    t_sink = None if t.get("sinks") is None else t["sinks"].to(acc).view(1, H, 1, 1)
    names = ts._names()
    dq_blocks, dg_blocks, dlse_blocks = [], [], []
    dk, dv = _Tiles(2), _Tiles(2)
    mask4 = None if ops.attn_mask is None or not ts.float_mask else as_4d(ops.attn_mask)
    dmask_bcast = mask4 is not None and mask4.shape[3] == 1
    dmask = _Tiles(3, dmask_bcast)
    dmask_rows: list[tuple[int, int, Tensor]] = []
    dcap = dsink = None

    def tile(m0, m1, n0, n1, full):
        xs = ts.operands(primal, m0, m1, n0, n1)
        txs = ts.operands(t, m0, m1, n0, n1)
        fn = ts.fn(m0, m1, n0, n1, full, txs)
        vt = span(v, 2, n0, n1).to(acc)  # (B, Hkv, BN, Dv): the grouped GEMMs take KV heads
        tvt = None if tv is None else span(tv, 2, n0, n1)
        return xs, txs, fn, vt, tvt, ts.dropout(m0, m1, n0, n1)

    def col(x: Tensor | None, m0: int, m1: int) -> Tensor | float:
        return 0.0 if x is None else rows(x.to(acc), m0, m1)

    for m0, m1, key_tiles in ts.query_blocks():
        BM = m1 - m0
        lse_col, g_blk = rows(lse_a, m0, m1), span(g_a, 2, m0, m1)

        def terms(s, a, z, vt, tvt, lse_col=lse_col, g_blk=g_blk):
            """p, p·z, dp = z·(g vᵀ) and c = a·dp + z·(g t_vᵀ) of a tile."""
            p = probs(s, lse_col)
            dp, e = qk_t(g_blk, vt, G), None
            if tvt is not None:
                e = qk_t(g_blk, tvt, G)
            if z is not None:
                dp, e = dp * z, None if e is None else e * z
            c = a * dp if e is None else a * dp + e
            return p, p if z is None else p * z, dp, c

        gd_blk = None if gd is None else span(gd, 2, m0, m1)
        zero_col = torch.zeros(B, H, BM, 1, dtype=acc, device=q.device)
        # -- pass 1: the row sums ā, C, Δ_pd (and Σ p ḋp for the first-order term) --
        abar, c_sum, dpd, dpd_dot = zero_col, zero_col, zero_col, zero_col
        for n0, n1, full in key_tiles:
            xs, txs, fn, vt, tvt, z = tile(m0, m1, n0, n1, full)
            s, a = fn(*xs)
            p, pz, dp, c = terms(s, a, z, vt, tvt)
            abar = abar + (p * a).sum(-1, keepdim=True)
            c_sum = c_sum + (p * c).sum(-1, keepdim=True)
            dpd = dpd + (p * dp).sum(-1, keepdim=True)
            if gd_blk is not None:
                dpd_dot = dpd_dot + (pz * qk_t(gd_blk, vt, G)).sum(-1, keepdim=True)
        p_sink = None
        if sinks is not None:
            p_sink = torch.exp(sinks - lse_col)
            if t_sink is not None:
                abar = abar + p_sink * t_sink
        delta = dpd - col(glse, m0, m1)
        delta_dot = dpd_dot - col(glse_d, m0, m1)
        # -- pass 2: the gradients --
        dq_blk = torch.zeros(B, H, BM, D, dtype=acc, device=q.device)
        dg_blk = torch.zeros(B, H, BM, Dv, dtype=acc, device=q.device)
        for n0, n1, full in key_tiles:
            xs, txs, fn, vt, tvt, z = tile(m0, m1, n0, n1, full)
            (s, a), vjp_fn = torch.func.vjp(fn, *xs)
            p, pz, dp, c = terms(s, a, z, vt, tvt)
            s_bar = p * ((c - c_sum) - delta * (a - abar) - abar * (dp - dpd))
            a_bar = p * (dp - delta)
            w = pz * (a - abar)  # ∂L/∂dp before z, per (row, key)
            dv_h = tp_kv(w, g_blk, G)
            if gd_blk is not None:
                ddp = qk_t(gd_blk, vt, G)
                if z is not None:
                    ddp = ddp * z
                s_bar = s_bar + p * (ddp - delta_dot)
                dv_h = dv_h + tp_kv(pz, gd_blk, G)
            grads = dict(zip(names, vjp_fn((s_bar, a_bar))))
            dq_blk = dq_blk + grads["q"]
            dk.add(n0, n1, grads["k"])
            dv.add(n0, n1, dv_h)
            dg_blk = dg_blk + pv(w, vt, G)
            if tvt is not None:
                dg_blk = dg_blk + pv(pz, tvt, G)
            if "softcap" in grads:
                dcap = grads["softcap"] if dcap is None else dcap + grads["softcap"]
            if "mask" in grads:
                dmask.add(n0, n1, grads["mask"])
        if p_sink is not None:
            t_s = 0.0 if t_sink is None else t_sink
            ds = p_sink * (-c_sum - delta * (t_s - abar) + abar * dpd)
            if gd_blk is not None:
                ds = ds - p_sink * delta_dot
            ds = ds.sum(dim=(0, 2, 3))
            dsink = ds if dsink is None else dsink + ds
        if mask4 is not None and dmask.parts:
            dmask_rows.append((m0, m1, dmask.join(mask4.shape[3], _mask_like(mask4, BM))))
            dmask = _Tiles(3, dmask_bcast)
        dq_blocks.append(dq_blk)
        dg_blocks.append(dg_blk)
        dlse_blocks.append(abar.squeeze(-1))
    def cat(xs):
        return xs[0] if len(xs) == 1 else torch.cat(xs, dim=2)

    res = {"q": cat(dq_blocks),
           "k": dk.join(Nk, torch.zeros(B, Hkv, Nk, D, dtype=acc, device=q.device)),
           "v": dv.join(Nk, torch.zeros(B, Hkv, Nk, Dv, dtype=acc, device=q.device)),
           "do": cat(dg_blocks), "dlse": cat(dlse_blocks)}
    if mask4 is not None:
        res["mask"] = _join_rows(dmask_rows, mask4, Nq).reshape(ops.attn_mask.shape)
    if ops.softcap is not None:
        res["softcap"] = (torch.zeros_like(ops.softcap, dtype=acc) if dcap is None
                          else reduce_to(dcap, ops.softcap.shape))
    if ops.sinks is not None:
        res["sinks"] = torch.zeros(H, dtype=acc, device=q.device) if dsink is None else dsink
    return res


def _mask_like(mask4: Tensor, BM: int) -> Tensor:
    """Zeros shaped as a query block's rows of the mask ``(b, h, BM or 1, Nk or 1)``."""
    shape = list(mask4.shape)
    if shape[2] != 1:
        shape[2] = BM
    return torch.zeros(shape, dtype=_acc_dtype(mask4.dtype), device=mask4.device)


def _join_rows(blocks: list[tuple[int, int, Tensor]], mask4: Tensor, Nq: int) -> Tensor:
    """The mask's gradient from its query blocks' rows (summed where the mask broadcasts
    along the rows)."""
    acc = _acc_dtype(mask4.dtype)
    if not blocks:
        return torch.zeros(mask4.shape, dtype=acc, device=mask4.device)
    if mask4.shape[2] == 1:
        total = blocks[0][2]
        for _, _, x in blocks[1:]:
            total = total + x
        return total
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
    dmask = r.get("mask") if static.need_dmask else None
    dcap = r.get("softcap") if static.need_dcap else None
    like = (q, k, v, ops.attn_mask, ops.sinks, ops.softcap)
    grads = (r["q"], r["k"], r["v"], dmask, r.get("sinks"), dcap)
    return tuple(None if g is None else g.to(x.dtype) for g, x in zip(grads, like)) + (
        (None,) * len(ops.captured))


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
    """Whether the mapped dimension may fold into B (:mod:`attn.tiled.batching`)."""
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
        dcap = None
        if g.dsoftcap is not None:
            dcap = reduce_to(g.dsoftcap, softcap.shape).to(softcap.dtype)
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
        need = ctx.needs_input_grad

        def cast(name, like, i):
            return None if like is None or not need[i] else r[name].to(like.dtype)

        return (None, cast("do", do, 1), cast("dlse", dlse, 2), cast("q", q, 3),
                cast("k", k, 4), cast("v", v, 5), None, None, None,
                cast("mask", ops.attn_mask if "mask" in r else None, 9),
                cast("sinks", ops.sinks, 10), cast("softcap", ops.softcap, 11), None,
                *(None,) * len(ctx.captured))

    @staticmethod
    def vmap(info, in_dims, static, do, dlse, q, k, v, out, lse, lse2, attn_mask, sinks,
             softcap, alibi, *captured):
        args = (static, do, dlse, q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi,
                *captured)
        ops = Operands(attn_mask, sinks, softcap, alibi, tuple(captured))
        X = info.batch_size
        if not _foldable(static.spec, ops, static.need_dmask):
            return batching.call_per_sample(_TiledBackwardJvp.apply, X, in_dims, args)
        B = batching.rows_of(q, in_dims[3])
        f = [batching.fold(x, d, X, B) for x, d in zip(args[1:9], in_dims[1:9])]
        m = batching.fold_mask(attn_mask, in_dims[9], X, B)
        al = batching.fold(alibi, in_dims[12], X, B)
        res = _TiledBackwardJvp.apply(static, *f, m, None, None, al)
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
        tangents = tuple(None if none or x is None else r[name].to(x.dtype)
                         for name, x, none in zip(_GRAD_NAMES, like, ctx.outputs_none))
        return tangents + (None,) * len(ctx.captured)


def differentiable_backward(static: Static, do: Tensor, dlse: Tensor | None, q: Tensor,
                            k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            lse2: Tensor | None, ops: Operands) -> tuple:
    """Tiled attention's gradients ``(dq, dk, dv, dmask, dsinks, dsoftcap, *dcaptured)``
    through :class:`_TiledBackward`: differentiable again (create_graph=True, torch.func)."""
    args = (do, dlse, q, k, v, out, lse, *ops[:4], *ops.captured)
    fn = _TiledBackwardJvp if transforms.active(*args) else _TiledBackward
    return fn.apply(static, do, dlse, q, k, v, out, lse, lse2, ops.attn_mask, ops.sinks,
                    ops.softcap, ops.alibi, *ops.captured)
