"""Forward-mode AD of tiled attention, tile by tile, O(N) memory (docs/transforms.md, "How it
works" and "Inside tiled's rules": the sums a query block accumulates): the autograd.Function's
``jvp`` rule (:func:`tiled_jvp`), and :func:`forward_with_tangent`, the one pass that computes
out, lse and both tangents together. The score tangent ṡ comes from :class:`TileScores` (the
reference's order of score steps; also the double backward's): plain tensor code with no host
reads, so it runs under vmap as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
from torch import Tensor

from attn import transforms
from attn.masks import as_4d
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import cpu
from attn.tiled.plan import _blocks
from attn.tiled.tile import alibi_distance, dropout_keep_scale, mod_index, tile_index

# tile sizes of the transform kernels (a spec's own block sizes win), and the one pass's
# score tile over every batch row and head (forward_with_tangent) at most ONE_PASS_TILE_BYTES
# in the accumulation dtype, the forward's unit tile: docs/benchmarks.md has the measurements
BLOCK_M = 128
BLOCK_N = 256
ONE_PASS_TILE_BYTES = 1 << 20


def _one_pass_blocks(q: Tensor, k: Tensor) -> tuple[int, int]:
    """``(block_m, block_n)`` of the one pass for a call (see ONE_PASS_TILE_BYTES): at most
    256 query rows, and at least 8 query blocks where the call has 1024 rows (a causal
    block's diagonal tile is half masked; the blocks are the pool's items)."""
    B, H, Nq, _ = q.shape
    bn = 512 if k.shape[2] >= 4096 else 256
    per_row = B * H * bn * torch.finfo(_acc_dtype(q.dtype)).bits // 8
    bm = min(256, ONE_PASS_TILE_BYTES // per_row, max(128, Nq // 8))
    return max(16, bm // 16 * 16), bn

# the differentiable operands of a tile's scores, in the order TileScores.fn takes them
SCORE_INPUTS = ("q", "k", "softcap", "mask", "alibi")
# The static score variants' terms (attn.spec.ScoreTerms, by name) TileScores applies: the
# forward-mode rule and the double backward refuse a call carrying any other
SCORE_TERMS: tuple[str, ...] = ()


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

    def __init__(self, q: Tensor, k: Tensor, spec: LaunchSpec, ops: Operands, *,
                 blocks: tuple[int, int] = (BLOCK_M, BLOCK_N), inplace: bool = False) -> None:
        # inplace: the caller's tensors are plain and nothing differentiates the tiles, so
        # the masking may write into them
        spec.terms.refuse_unknown(SCORE_TERMS, "tiled's forward-mode and double-backward "
                                               "rules (attn/tiled/jvp.py TileScores)")
        B, H, Nq, _ = q.shape
        self.B, self.H, self.G, self.Nq, self.Nk = B, H, H // k.shape[1], Nq, k.shape[2]
        self.spec, self.device, self.inplace = spec, q.device, inplace
        self.acc = _acc_dtype(q.dtype)
        self.band = spec.local_band()
        mask = ops.attn_mask
        self.bool_mask = as_4d(mask) if mask is not None and mask.dtype == torch.bool else None
        self.float_mask = mask is not None and mask.dtype != torch.bool
        self.has_cap = ops.softcap is not None
        self.has_alibi = ops.alibi is not None
        # the operands this call's scores read, in SCORE_INPUTS order: what :meth:`fn` takes
        kept = (True, True, self.has_cap, self.float_mask, self.has_alibi)
        self.names = tuple(n for n, keep in zip(SCORE_INPUTS, kept) if keep)
        # the call's own operands by SCORE_INPUTS name, for :meth:`operands` to slice
        self.primal = {"q": q, "k": k, "softcap": ops.softcap, "mask": ops.attn_mask,
                       "alibi": ops.alibi}
        if spec.dropout_p > 0.0:  # the hash's rows b·H + h, and the heads for packed rows
            h = torch.arange(H, device=q.device)
            self.bh = torch.arange(B, device=q.device)[:, None] * H + h
            self.h_col = h.view(1, -1, 1)
        self.spec_sized = dataclasses.replace(spec, block_m=spec.block_m or blocks[0],
                                              block_n=spec.block_n or blocks[1])

    def query_blocks(self):
        """``(m0, m1, key_tiles)`` as the forward visits them (band and mask blocks)."""
        return _blocks(self.spec_sized, self.Nq, self.Nk).query_blocks()

    def operands(self, t: dict[str, Tensor | None], m0: int, m1: int, n0: int, n1: int
                 ) -> tuple[Tensor | None, ...]:
        """The tile's slices of ``t`` (full tensors by :data:`SCORE_INPUTS` name) in
        :meth:`fn`'s order; a missing entry (a tangent that is 0) is None."""
        out = []
        for name in self.names:
            x = t.get(name)
            if x is None:
                out.append(None)
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

    def allowed(self, m0: int, m1: int, n0: int, n1: int, full: bool) -> Tensor | None:
        """Bool keep-mask of the tile (broadcastable to (B, H, BM, BN)), None: all kept."""
        keep = None
        dev = self.device
        if not full:
            keep = self.band.mask(torch.arange(m0, m1, device=dev),
                                  torch.arange(n0, n1, device=dev))
            if self.spec.mask_mod is not None:
                idx = mod_index(self.spec, self.B, self.H, m0, m1, n0, n1, dev)
                kmod = self.spec.mask_mod(*idx)
                keep = kmod if keep is None else keep & kmod
        if self.bool_mask is not None:
            tile = self.bool_mask[tile_index(self.bool_mask, m0, m1, n0, n1)]
            keep = tile if keep is None else keep & tile
        return keep

    def dropout(self, m0: int, m1: int, n0: int, n1: int) -> Tensor | None:
        """Kept elements scaled by 1/(1-p), dropped ones 0, ``(B, H, BM, BN)``; None: none."""
        if self.spec.dropout_p == 0.0:
            return None
        return dropout_keep_scale(self.spec, self.bh, self.H, self.h_col, m0, m1, n0, n1,
                                  self.acc)

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
            seq, dist = alibi_distance(spec, m0, m1, n0, n1, self.device)
            dist = dist.to(acc)
        idx = (None if spec.score_mod is None
               else mod_index(spec, self.B, H, m0, m1, n0, n1, self.device))
        names = self.names
        t = dict(zip(names, tangents))

        def mod(s: Tensor) -> Tensor:
            return torch.broadcast_to(spec.score_mod(s, *idx), s.shape).to(acc)

        def slopes(al: Tensor) -> Tensor:
            if seq is None:
                return al.expand(self.B, H).reshape(self.B, H, 1, 1)
            return al[seq].t().reshape(1, H, -1, 1)  # packed: each row its sequence's

        def scores(*xs: Tensor) -> tuple[Tensor, Tensor]:
            x = dict(zip(names, xs))
            # the scale on the (BM, D) rows rather than the (BM, BN) products
            q_s = x["q"] * spec.qk_scale
            s = qk_t(q_s, x["k"], G)
            sd = None  # the tangent: None while it is 0 (terms whose direction is 0 skipped)
            if t["q"] is not None:
                sd = qk_t(t["q"] * spec.qk_scale, x["k"], G)
            if t["k"] is not None:  # accumulated into the first term's tile where plain
                sd = qk_t(q_s, t["k"], G, add=sd)
            sd = torch.zeros_like(s) if sd is None else sd
            if spec.score_mod is not None:  # elementwise in s: its derivative, by a vjp
                s, mod_vjp = torch.func.vjp(mod, s)
                sd = mod_vjp(torch.ones_like(s))[0] * sd
            if self.has_cap or spec.softcap is not None:
                c = x["softcap"].expand(H).reshape(1, H, 1, 1) if self.has_cap else spec.softcap
                u = s / c
                th = torch.tanh(u)
                s, sd = c * th, (1 - th * th) * sd
                if self.has_cap and t["softcap"] is not None:
                    # d(c·tanh(r/c))/dc = tanh(u) − u·(1 − tanh²(u))
                    dc = t["softcap"].expand(H).reshape(1, H, 1, 1)
                    sd = sd + dc * (th - u * (1 - th * th))
            if dist is not None:
                s = s - slopes(x["alibi"]) * dist
                if t["alibi"] is not None:
                    sd = sd - slopes(t["alibi"]) * dist
            k_ = keep
            if self.float_mask:
                s = s + x["mask"]
                if t["mask"] is not None:
                    sd = sd + t["mask"]
                finite = x["mask"] != float("-inf")
                k_ = finite if k_ is None else k_ & finite
            if k_ is not None:
                if self.inplace:  # fresh tiles that nothing differentiates
                    drop = ~k_
                    s, sd = s.masked_fill_(drop, float("-inf")), sd.masked_fill_(drop, 0.0)
                else:
                    s, sd = s.masked_fill(~k_, float("-inf")), sd.masked_fill(~k_, 0.0)
            return s, sd

        return scores


def span(x: Tensor, dim: int, a: int, b: int) -> Tensor:
    """``x``'s entries ``[a, b)`` along ``dim``; ``x`` itself where that is all of it (the
    legacy vmap of gradcheck's batched checks has no rule for the alias a full slice is)."""
    return x if a == 0 and b >= x.shape[dim] else x.narrow(dim, a, b - a)


def rows(x: Tensor, m0: int, m1: int) -> Tensor:
    """Per-row values ``(B, H, Nq)`` of a query block as a column ``(B, H, BM, 1)``."""
    return span(x, 2, m0, m1).unsqueeze(-1)


def safe_lse(lse: Tensor, acc: torch.dtype) -> Tensor:
    """The lse in ``acc`` with −inf (rows that see nothing) as +inf, so their p =
    ``exp(s − lse)`` is 0."""
    lse = lse.to(acc)
    return torch.where(lse == float("-inf"), float("inf"), lse)


def grouped(x: Tensor, G: int) -> Tensor:
    """Query-head rows ``(B, H, M, X)`` as their KV heads' ``(B, Hkv, G·M, X)`` (a group's
    G heads one after another), so that one GEMM per KV head serves its G query heads."""
    if G == 1:
        return x
    B, H, M, X = x.shape
    return x.reshape(B, H // G, G * M, X)


def pv(a: Tensor, b: Tensor, G: int, add: Tensor | None = None, alpha: float = 1.0) -> Tensor:
    """``add + alpha · a b`` per KV head, as 3-D (b)mm over each group's query heads: a
    ``(B, H, M, K)`` (probabilities: K the keys), b ``(B, Hkv, K, X)`` → (B, H, M, X)."""
    B, H, M, _ = a.shape
    a3 = a.reshape(B * (H // G), G * M, a.shape[-1])
    b3 = b.reshape(B * b.shape[1], b.shape[2], b.shape[3])
    if add is None:
        y = torch.bmm(a3, b3).reshape(B, H, M, b.shape[-1])
        return y if alpha == 1.0 else y * alpha
    c3 = add.reshape(a3.shape[0], G * M, b.shape[-1])
    if _writable(c3, a3, b3):  # plain tensors: into add's own storage (a fresh result)
        return c3.baddbmm_(a3, b3, alpha=alpha).reshape(B, H, M, b.shape[-1])
    return torch.baddbmm(c3, a3, b3, alpha=alpha).reshape(B, H, M, b.shape[-1])


def _writable(c: Tensor, *xs: Tensor) -> bool:
    """Whether ``c`` may be written in place with a result of ``xs``: every one a plain
    tensor (no functorch wrapper, nothing for autograd to record), ``c`` contiguous. A 256
    KiB out-of-place result costs a fresh allocation (page faults) per tile."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (c, *xs)):
        return False
    return c.is_contiguous() and not any(transforms.wrapped(x) for x in (c, *xs))


def qk_t(a: Tensor, b: Tensor, G: int, add: Tensor | None = None) -> Tensor:
    """``add + a bᵀ`` per head: a ``(B, H, M, D)`` query-head rows, b ``(B, Hkv, N, D)`` →
    (B, H, M, N), each query head against its KV head (no copy of b per query head)."""
    return pv(a, b.transpose(-2, -1), G, add)


def tp_kv(a: Tensor, g: Tensor, G: int) -> Tensor:
    """``aᵀ g`` summed over each KV head's G query heads: a ``(B, H, M, N)``, g ``(B, H, M,
    X)`` → (B, Hkv, N, X) (the gradient of a KV-head operand of :func:`qk_t` / :func:`pv`)."""
    return grouped(a, G).transpose(-2, -1) @ grouped(g, G)


def plain(*xs: object) -> bool:
    """Whether every tensor of ``xs`` is a plain CPU tensor (no functorch wrapper, no legacy
    vmap batch, not traced): then the worker pool may run the kernels' items."""
    if torch.compiler.is_compiling():
        return False
    for x in xs:
        if isinstance(x, Tensor) and (x.device.type != "cpu" or transforms.wrapped(x)):
            return False
    return True


def one_thread(x: Tensor) -> contextlib.AbstractContextManager:
    """CPU: the kernels' tile ops on one intra-op thread, as the tiled launchers' items run
    (docs/design.md, "The tiled backend on CPU")."""
    return cpu.single_thread() if x.device.type == "cpu" else contextlib.nullcontext()


def tiled_jvp(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: LaunchSpec,
              ops: Operands, tangents: dict[str, Tensor | None]) -> tuple[Tensor, Tensor]:
    """Tangents ``(ȯ, lsė)`` of tiled attention's ``(out, lse)`` at q, k, v (the call's,
    out and lse its forward's), for ``tangents`` by name: q, k, v, softcap, mask, alibi,
    sinks (None or missing: 0). ȯ in v's dtype, lsė in the lse's."""
    threads = cpu.workers_for_call()  # read before one_thread sets the caller's to 1
    names = tuple(tangents)
    low = None
    if spec.score_mod is None and spec.mask_mod is None:  # no callable reads tensors of its own
        low = transforms.lowered(q, k, v, out, lse, *ops[:4], *(tangents[n] for n in names))
    if low is None:
        return _on_level(None, _tiled_jvp, q, k, v, out, lse, spec, ops, tangents, threads)
    # functorch's jvp hands the rule tensors wrapped at its own level: the tangent is linear
    # in them, so compute one level down on plain tensors (the worker pool may run them) and
    # wrap the result back
    level, xs = low
    return _on_level(level, _tiled_jvp, *xs[:5], spec, _with_operands(ops, xs[5:9]),
                     dict(zip(names, xs[9:])), threads)


def _with_operands(ops: Operands, xs) -> Operands:
    """``ops`` with its first four tensors (mask, sinks, softcap, slopes) taken from ``xs``."""
    return ops._replace(attn_mask=xs[0], sinks=xs[1], softcap=xs[2], alibi=xs[3])


def _on_level(level: int | None, fn: Callable, q: Tensor, *args) -> tuple:
    """``fn(q, *args)`` on one intra-op thread (:func:`one_thread`); with a functorch
    ``level`` (the tensors are :func:`transforms.lowered`'s), below it, its results
    wrapped back at it."""
    below = contextlib.nullcontext() if level is None else transforms.below()
    with below, one_thread(q):
        res = fn(q, *args)
    return res if level is None else tuple(transforms.rewrap(x, level) for x in res)


_TANGENT_NAMES = ("q", "k", "v", "mask", "sinks", "softcap", "alibi")


def forward_with_tangent(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands
                         ) -> tuple[Tensor, Tensor] | None:
    """``(out, lse)`` as dual tensors of forward-mode AD, primal and tangent in one pass over
    the tiles, where forward-mode AD is all that differentiates the call (docs/transforms.md,
    "Inside tiled's rules": its sums); else None, and the caller takes its
    autograd.Function, whose ``jvp`` rule (:func:`tiled_jvp`) reads q·kᵀ again."""
    import torch.autograd.forward_ad as fwad

    if ops.captured or spec.score_mod is not None or spec.mask_mod is not None or spec.sharded:
        return None
    stack = transforms.levels()
    if stack not in ([], ["jvp"]):  # one jvp level, or dual tensors alone
        return None
    xs = (q, k, v, *ops[:4])
    try:
        pairs = [(None, None) if x is None else tuple(fwad.unpack_dual(x)) for x in xs]
    except RuntimeError:  # no dual level open
        return None
    primals, tangents = [p for p, _ in pairs], [t for _, t in pairs]
    if all(t is None for t in tangents):
        return None
    level = None
    if stack:  # functorch's jvp: its level's wrappers taken off
        low = transforms.lowered(*primals, *tangents)
        if low is None:
            return None
        level, flat = low
        primals, tangents = flat[:len(xs)], flat[len(xs):]
    if any(transforms.wrapped(x) for x in (*primals, *tangents)):
        return None  # wrapped by something else (legacy vmap: gradcheck's batched checks)
    if transforms.graph_needed(*primals, *tangents):
        return None  # a backward may follow: the autograd.Function saves what it needs
    threads = cpu.workers_for_call() if q.device.type == "cpu" else 0
    out, lse, d_out, d_lse = _on_level(level, _one_pass, *primals[:3], spec,
                                       _with_operands(ops, primals[3:7]),
                                       dict(zip(_TANGENT_NAMES, tangents)), threads)
    return fwad.make_dual(out, d_out), fwad.make_dual(lse, d_lse)


def _one_pass(q, k, v, spec, ops, tangents, threads):
    """``(out, lse, ȯ, lsė)`` of plain tensors (see :func:`forward_with_tangent`)."""
    unsupported(spec, ops, "forward-mode AD")
    B, H, Nq, _ = q.shape
    G, Dv = H // k.shape[1], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    ts = TileScores(q, k, spec, ops, blocks=_one_pass_blocks(q, k), inplace=True)
    tv, t_sink = tangents.get("v"), tangents.get("sinks")
    new = {"dtype": acc, "device": q.device}
    res = tuple(torch.empty(B, H, Nq, *d, **new) for d in ((Dv,), (), (Dv,), ()))

    def block(i: int) -> None:
        m0, m1, key_tiles = blocks[i]
        col = (B, H, m1 - m0, 1)
        if ops.sinks is not None:  # the sink: a first key of value 0, its p = 1 at m = sink
            m = ops.sinks.to(acc).view(1, H, 1, 1).expand(col)
            l_i = torch.ones(col, **new)
            r = (torch.zeros(col, **new) if t_sink is None
                 else t_sink.to(acc).view(1, H, 1, 1).expand(col).clone())
        else:
            m = torch.full(col, float("-inf"), **new)
            l_i, r = (torch.zeros(col, **new) for _ in range(2))
        o, a = (torch.zeros(B, H, m1 - m0, Dv, **new) for _ in range(2))
        for n0, n1, full in key_tiles:
            xs = ts.operands(ts.primal, m0, m1, n0, n1)
            s, sd = ts.fn(m0, m1, n0, n1, full, ts.operands(tangents, m0, m1, n0, n1))(*xs)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
            alpha = torch.exp(m - m_safe)
            # plain tensors that nothing differentiates: the tile's buffers reused in place
            p = s.sub_(m_safe).exp_()
            psd = sd.mul_(p)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            r = r * alpha + psd.sum(-1, keepdim=True)
            z = ts.dropout(m0, m1, n0, n1)
            if z is not None:  # the denominator counts every key, the values the kept ones
                p, psd = p * z, psd.mul_(z)
            vt = span(v, 2, n0, n1).to(acc)
            o = pv(p, vt, G, add=o.mul_(alpha))
            a = pv(psd, vt, G, add=a.mul_(alpha))
            if tv is not None:
                a = pv(p, span(tv, 2, n0, n1).to(acc), G, add=a)
            m = m_new
        seen = l_i > 0
        l_safe = torch.where(seen, l_i, 1.0)
        o, r = o / l_safe, r / l_safe
        m_fin = torch.where(m == float("-inf"), 0.0, m)
        res[0][:, :, m0:m1] = o
        res[1][:, :, m0:m1] = torch.where(seen, m_fin + torch.log(l_safe),
                                          float("-inf")).squeeze(-1)
        res[2][:, :, m0:m1] = a / l_safe - r * o
        res[3][:, :, m0:m1] = r.squeeze(-1)

    blocks = list(ts.query_blocks())
    cpu.run_items(block, len(blocks), threads=threads)  # lse and lsė: acc, the lse's dtype
    return res[0].to(v.dtype), res[1], res[2].to(v.dtype), res[3]


def _tiled_jvp(q, k, v, out, lse, spec, ops, tangents, threads):
    # (the captures refused only where they carry a tangent; a sharded call always)
    unsupported(spec, ops if tangents.get("captured") else ops._replace(captured=()),
                "forward-mode AD")
    B, H, Nq, _ = q.shape
    G = H // k.shape[1]
    acc = _acc_dtype(q.dtype)
    ts = TileScores(q, k, spec, ops)
    lse_a = safe_lse(lse, acc)
    out_a = out.to(acc)
    tv = tangents.get("v")

    def block(m0: int, m1: int, key_tiles) -> tuple[Tensor, Tensor]:
        """One query block's ``(ȯ, lsė)`` rows."""
        lse_col = rows(lse_a, m0, m1)
        a_acc = torch.zeros(B, H, m1 - m0, v.shape[-1], dtype=acc, device=q.device)
        b_acc = torch.zeros(B, H, m1 - m0, 1, dtype=acc, device=q.device)
        for n0, n1, full in key_tiles:
            xs = ts.operands(ts.primal, m0, m1, n0, n1)
            txs = ts.operands(tangents, m0, m1, n0, n1)
            s, sd = ts.fn(m0, m1, n0, n1, full, txs)(*xs)
            p = torch.exp(s - lse_col)
            psd = p * sd
            b_acc = b_acc + psd.sum(-1, keepdim=True)
            z = ts.dropout(m0, m1, n0, n1)
            if z is not None:
                p, psd = p * z, psd * z
            a_acc = pv(psd, span(v, 2, n0, n1).to(acc), G, add=a_acc)
            if tv is not None:
                a_acc = pv(p, span(tv, 2, n0, n1).to(acc), G, add=a_acc)
        if ops.sinks is not None and tangents.get("sinks") is not None:
            p_sink = torch.exp(ops.sinks.to(acc).view(1, H, 1, 1) - lse_col)
            b_acc = b_acc + p_sink * tangents["sinks"].to(acc).view(1, H, 1, 1)
        return a_acc - b_acc * span(out_a, 2, m0, m1), b_acc.squeeze(-1)

    blocks = list(ts.query_blocks())
    if plain(q, k, v, out, lse, *ts.primal.values(), *tangents.values()):
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
