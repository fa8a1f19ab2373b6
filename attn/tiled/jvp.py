"""Forward-mode AD of tiled attention, tile by tile: the tangent of ``(out, lse)`` from the
saved out and lse in one pass over the tiles, O(N) memory.

With ``p_j = exp(s_j − lse)`` known from the forward, the online softmax has a forward-mode
twin that needs no running max: for ``o = Σ_j p_j v_j`` (dropout's kept scale ``z_j`` folded
into the sums over values),

    ȯ = Σ_j p_j z_j (ṡ_j − Σ_k p_k ṡ_k) v_j + Σ_j p_j z_j v̇_j,    lsė = Σ_j p_j ṡ_j,

so a query block accumulates ``A = Σ (p z ṡ) v + Σ (p z) v̇`` and ``b = Σ p ṡ`` over its key
tiles and ends with ``ȯ = A − b·o``. The sinks join ``b`` as one more key of value 0.

The tile's score tangent ṡ comes from :class:`TileScores`, a differentiable rebuild of one
tile's scores (scale → score_mod → softcap → ALiBi → masks, the reference's order) in natural
units beside their tangent, step by step: tangents of q, k, a learnable softcap, a float mask
and the ALiBi slopes all reach ṡ exactly, whatever the variant. The same class serves the
double backward (:mod:`attn.tiled.double`). Everything here is plain tensor code with no
host reads, so it runs under vmap as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch import Tensor

from attn.masks import as_4d, dropout_keep, dropout_keep_rows
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import cpu
from attn.tiled.plan import _blocks

# tile sizes of the transform kernels (a spec's own block sizes win)
BLOCK = 128

# the differentiable operands of a tile's scores, in the order TileScores.fn takes them
SCORE_INPUTS = ("q", "k", "softcap", "mask", "alibi")


def unsupported(spec: LaunchSpec, ops: Operands, what: str) -> None:
    """Raise NotImplementedError for what the transform kernels do not read."""
    if ops.captured:
        raise NotImplementedError(
            f"tiled: {what} through a score_mod's captured tensors that require grad is not "
            f"supported; backend='reference' differentiates them in every mode")
    if spec.sharded:
        raise NotImplementedError(f"tiled: {what} of a sharded call (q_start / k_start / "
                                  f"heads) is not supported; backend='reference' runs it")


class TileScores:
    """One tile's masked scores ``(B, H, BM, BN)`` in natural units as a differentiable
    function of its operands: :meth:`operands` slices q, k, the softcap, the float mask and
    the ALiBi slopes (or their tangents) for a tile, :meth:`fn` is the function of them.
    q ``(B, H, Nq, D)``, k ``(B, Hkv, Nk, D)``: the call's, accumulation dtype."""

    def __init__(self, q: Tensor, k: Tensor, spec: LaunchSpec, ops: Operands) -> None:
        B, H, Nq, _ = q.shape
        self.B, self.H, self.G, self.Nq, self.Nk = B, H, H // k.shape[1], Nq, k.shape[2]
        self.spec, self.device = spec, q.device
        self.acc = _acc_dtype(q.dtype)
        self.band = spec.local_band()
        mask = ops.attn_mask
        self.bool_mask = as_4d(mask) if mask is not None and mask.dtype == torch.bool else None
        self.float_mask = mask is not None and mask.dtype != torch.bool
        self.has_cap = ops.softcap is not None
        self.has_alibi = ops.alibi is not None
        bm = spec.block_m or BLOCK
        bn = spec.block_n or BLOCK
        self.spec_sized = dataclasses.replace(spec, block_m=bm, block_n=bn)

    def query_blocks(self):
        """``(m0, m1, key_tiles)`` as the forward visits them (band and mask blocks)."""
        return _blocks(self.spec_sized, self.Nq, self.Nk).query_blocks()

    def operands(self, t: dict[str, Tensor | None], m0: int, m1: int, n0: int, n1: int,
                 like: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
        """The tile's slices of ``t`` (full tensors by :data:`SCORE_INPUTS` name) in
        :meth:`fn`'s order; a missing entry is zeros shaped as ``like``'s (a tangent)."""
        out = []
        for i, name in enumerate(self._names()):
            x = t.get(name)
            if x is None:
                out.append(torch.zeros_like(like[i]))
                continue
            if name == "q":
                x = span(x, 2, m0, m1)
            elif name == "k":
                x = span(x, 2, n0, n1)
            elif name == "mask":
                x = as_4d(x)
                x = span(x, 2, m0, m1) if x.shape[2] != 1 else x
                x = span(x, 3, n0, n1) if x.shape[3] != 1 else x
            out.append(x.to(self.acc))
        return tuple(out)

    def _names(self) -> tuple[str, ...]:
        keep = {"q": True, "k": True, "softcap": self.has_cap, "mask": self.float_mask,
                "alibi": self.has_alibi}
        return tuple(n for n in SCORE_INPUTS if keep[n])

    def _idx(self, m0, m1, n0, n1):
        dev = self.device
        return (torch.arange(self.B, device=dev).view(-1, 1, 1, 1),
                torch.arange(self.H, device=dev).view(1, -1, 1, 1),
                torch.arange(m0, m1, device=dev).view(1, 1, -1, 1),
                torch.arange(n0, n1, device=dev).view(1, 1, 1, -1))

    def allowed(self, m0: int, m1: int, n0: int, n1: int, full: bool) -> Tensor | None:
        """Bool keep-mask of the tile (broadcastable to (B, H, BM, BN)), None: all kept."""
        keep = None
        dev = self.device
        if not full:
            keep = self.band.mask(torch.arange(m0, m1, device=dev),
                                  torch.arange(n0, n1, device=dev))
            if self.spec.mask_mod is not None:
                kmod = self.spec.mask_mod(*self._idx(m0, m1, n0, n1))
                keep = kmod if keep is None else keep & kmod
        if self.bool_mask is not None:
            m = self.bool_mask
            tile = m[:, :, m0:m1 if m.shape[2] != 1 else None, n0:n1 if m.shape[3] != 1 else None]
            keep = tile if keep is None else keep & tile
        return keep

    def dropout(self, m0: int, m1: int, n0: int, n1: int) -> Tensor | None:
        """Kept elements scaled by 1/(1-p), dropped ones 0, ``(B, H, BM, BN)``; None: none."""
        spec = self.spec
        if spec.dropout_p == 0.0:
            return None
        dev = self.device
        offs_m, offs_n = torch.arange(m0, m1, device=dev), torch.arange(n0, n1, device=dev)
        h = torch.arange(self.H, device=dev)
        if spec.dropout_rows is None:
            bh = torch.arange(self.B, device=dev)[:, None] * self.H + h
            keep = dropout_keep(spec.dropout_seed, bh, offs_m, offs_n, spec.dropout_p)
        else:  # packed: one batch row holding many sequences
            b_rows, offs_m, offs_n = spec.dropout_rows(offs_m, offs_n)
            bh = b_rows.view(1, 1, -1) * self.H + h.view(1, -1, 1)
            keep = dropout_keep_rows(spec.dropout_seed, bh, offs_m, offs_n, spec.dropout_p)
        return keep.to(self.acc) / (1.0 - spec.dropout_p)

    def fn(self, m0: int, m1: int, n0: int, n1: int, full: bool, tangents: tuple[Tensor, ...]
           ) -> Callable[..., tuple[Tensor, Tensor]]:
        """The tile's scores and their tangent along ``tangents`` (:meth:`operands`' order)
        as a function of :meth:`operands`' tensors: ``(s, ṡ)``, both ``(B, H, BM, BN)``.
        The tangent is written out step by step (no forward-mode AD inside, which would
        nest in the forward-mode AD that calls it), in differentiable ops, so a vjp of it
        is the double backward's."""
        spec, H, G, acc = self.spec, self.H, self.G, self.acc
        keep = self.allowed(m0, m1, n0, n1, full)
        dist = seq = None
        if self.has_alibi:
            offs_m = torch.arange(m0, m1, device=self.device)
            offs_n = torch.arange(n0, n1, device=self.device)
            if spec.alibi_rows is None:
                dist = (offs_n[None, :] - (offs_m[:, None] + self.band.offset)).abs()
            else:
                seq, pos_m, pos_n = spec.alibi_rows(offs_m, offs_n)
                dist = (pos_n[None, :] - pos_m[:, None]).abs()
            dist = dist.to(acc)
        idx = self._idx(m0, m1, n0, n1) if spec.score_mod is not None else None
        names = self._names()
        t = dict(zip(names, tangents))

        def mod(s: Tensor) -> Tensor:
            return torch.broadcast_to(spec.score_mod(s, *idx), s.shape).to(acc)

        def slopes(al: Tensor) -> Tensor:
            if seq is None:
                return al.expand(self.B, H).reshape(self.B, H, 1, 1)
            return al[seq].t().reshape(1, H, -1, 1)  # packed: each row its sequence's

        def scores(*xs: Tensor) -> tuple[Tensor, Tensor]:
            x = dict(zip(names, xs))
            kt, dkt = (expand_heads(y["k"], G) for y in (x, t))  # (B, H, BN, D)
            s = x["q"] @ kt.transpose(-2, -1) * spec.qk_scale
            sd = (t["q"] @ kt.transpose(-2, -1) + x["q"] @ dkt.transpose(-2, -1)) * spec.qk_scale
            if spec.score_mod is not None:  # elementwise in s: its derivative, by a vjp
                s, mod_vjp = torch.func.vjp(mod, s)
                sd = mod_vjp(torch.ones_like(s))[0] * sd
            if self.has_cap or spec.softcap is not None:
                c = x["softcap"].expand(H).reshape(1, H, 1, 1) if self.has_cap else spec.softcap
                u = s / c
                th = torch.tanh(u)
                s, sd = c * th, (1 - th * th) * sd
                if self.has_cap:  # d(c·tanh(r/c))/dc = tanh(u) − u·(1 − tanh²(u))
                    dc = t["softcap"].expand(H).reshape(1, H, 1, 1)
                    sd = sd + dc * (th - u * (1 - th * th))
            if dist is not None:
                s, sd = s - slopes(x["alibi"]) * dist, sd - slopes(t["alibi"]) * dist
            k_ = keep
            if self.float_mask:
                s, sd = s + x["mask"], sd + t["mask"]
                finite = x["mask"] != float("-inf")
                k_ = finite if k_ is None else k_ & finite
            if k_ is not None:
                s, sd = s.masked_fill(~k_, float("-inf")), sd.masked_fill(~k_, 0.0)
            return s, sd

        return scores


def span(x: Tensor, dim: int, a: int, b: int) -> Tensor:
    """``x``'s entries ``[a, b)`` along ``dim``; ``x`` itself where that is all of it (the
    legacy vmap of gradcheck's batched checks has no rule for the alias a full slice is)."""
    if a == 0 and b >= x.shape[dim]:
        return x
    return x.narrow(dim, a, b - a)


def rows(x: Tensor, m0: int, m1: int) -> Tensor:
    """Per-row values ``(B, H, Nq)`` of a query block as a column ``(B, H, BM, 1)``."""
    return span(x, 2, m0, m1).unsqueeze(-1)


def probs(s: Tensor, lse_col: Tensor) -> Tensor:
    """``exp(s − lse)``, 0 on rows that see nothing (lse −inf, made +inf by the caller)."""
    return torch.exp(s - lse_col)


def safe_lse(lse: Tensor, acc: torch.dtype) -> Tensor:
    """The lse in ``acc`` with −inf (rows that see nothing) as +inf, so their p is 0."""
    lse = lse.to(acc)
    return torch.where(lse == float("-inf"), float("inf"), lse)


def expand_heads(x: Tensor, G: int) -> Tensor:
    """K/V-head tensor ``(B, Hkv, ·, ·)`` repeated to the query heads ``(B, H, ·, ·)``."""
    return x.repeat_interleave(G, dim=1) if G > 1 else x


def plain(*xs: object) -> bool:
    """Whether every tensor of ``xs`` is a plain CPU tensor (no functorch wrapper, no legacy
    vmap batch, not traced): then the worker pool may run the kernels' items."""
    if torch.compiler.is_compiling():
        return False
    for x in xs:
        if isinstance(x, Tensor) and (
                x.device.type != "cpu" or torch._C._functorch.is_functorch_wrapped_tensor(x)
                or "Batched" in str(torch._C._dispatch_keys(x))):
            return False
    return True


def one_thread(x: Tensor) -> contextlib.AbstractContextManager:
    """CPU: the kernels' tile ops on one intra-op thread (as the tiled launchers' items run):
    a (BM, BN) tile is too small for a parallel region, and on a busy machine one runs ~100x
    slower than a single thread (OpenMP's team waits for threads that are not scheduled)."""
    return cpu.single_thread() if x.device.type == "cpu" else contextlib.nullcontext()


def tiled_jvp(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: LaunchSpec,
              ops: Operands, tangents: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
    """Tangents ``(ȯ, lsė)`` of tiled attention's ``(out, lse)`` at q, k, v (the call's,
    out and lse its forward's), for ``tangents`` by name: q, k, v, softcap, mask, alibi,
    sinks (None or missing: 0). ȯ in v's dtype, lsė in the lse's."""
    threads = cpu.workers_for_call()  # read before one_thread sets the caller's to 1
    with one_thread(q):
        return _tiled_jvp(q, k, v, out, lse, spec, ops, tangents, threads)


def _tiled_jvp(q, k, v, out, lse, spec, ops, tangents, threads):
    if tangents.get("captured"):
        unsupported(spec, ops, "forward-mode AD")
    unsupported(spec, ops._replace(captured=()), "forward-mode AD")
    B, H, Nq, _ = q.shape
    G = H // k.shape[1]
    acc = _acc_dtype(q.dtype)
    ts = TileScores(q, k, spec, ops)
    primal = {"q": q, "k": k, "softcap": ops.softcap, "mask": ops.attn_mask, "alibi": ops.alibi}
    lse_a = safe_lse(lse, acc)
    out_a = out.to(acc)
    tv = tangents.get("v")

    def block(m0: int, m1: int, key_tiles) -> tuple[Tensor, Tensor]:
        """One query block's ``(ȯ, lsė)`` rows."""
        lse_col = rows(lse_a, m0, m1)
        a_acc = torch.zeros(B, H, m1 - m0, v.shape[-1], dtype=acc, device=q.device)
        b_acc = torch.zeros(B, H, m1 - m0, 1, dtype=acc, device=q.device)
        for n0, n1, full in key_tiles:
            xs = ts.operands(primal, m0, m1, n0, n1)
            txs = ts.operands(tangents, m0, m1, n0, n1, like=xs)
            s, sd = ts.fn(m0, m1, n0, n1, full, txs)(*xs)
            p = probs(s, lse_col)
            psd = p * sd
            b_acc = b_acc + psd.sum(-1, keepdim=True)
            z = ts.dropout(m0, m1, n0, n1)
            if z is not None:
                p, psd = p * z, psd * z
            a_acc = a_acc + psd @ expand_heads(span(v, 2, n0, n1).to(acc), G)
            if tv is not None:
                a_acc = a_acc + p @ expand_heads(span(tv, 2, n0, n1).to(acc), G)
        if ops.sinks is not None and tangents.get("sinks") is not None:
            p_sink = torch.exp(ops.sinks.to(acc).view(1, H, 1, 1) - lse_col)
            b_acc = b_acc + p_sink * tangents["sinks"].to(acc).view(1, H, 1, 1)
        return a_acc - b_acc * span(out_a, 2, m0, m1), b_acc.squeeze(-1)

    blocks = list(ts.query_blocks())
    if plain(q, k, v, out, lse, *primal.values(), *tangents.values()):
        # plain CPU tensors: the query blocks are work items on the tiled backend's pool,
        # each writing its own rows (bits independent of the worker count)
        d_out = torch.empty(B, H, Nq, v.shape[-1], dtype=acc, device=q.device)
        d_lse = torch.empty(B, H, Nq, dtype=acc, device=q.device)

        def run(i: int) -> None:
            m0, m1, key_tiles = blocks[i]
            d_out[:, :, m0:m1], d_lse[:, :, m0:m1] = block(m0, m1, key_tiles)

        cpu.run_items(run, len(blocks), threads=threads)
        return d_out.to(v.dtype), d_lse.to(lse.dtype)
    # wrapped tensors (vmap, nested transforms): in order, concatenated, nothing in place
    outs, lses = zip(*(block(*b) for b in blocks))
    d_out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    d_lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return d_out.to(v.dtype), d_lse.to(lse.dtype)
