"""The tiled backend's three layers: the launchers ``_fwd`` / ``_bwd`` (chunk by chunk, as the
plan cuts a call), one ``torch.autograd.Function``, and the public :func:`tiled_attention`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from attn.grads import SATURATED_LOG2L, Grads, call_sink_grad, row_delta, sink_grad
from attn.grads import reduce_to as _reduce_to
from attn.masks import Band, as_4d
from attn.merge import _merge_trusted
from attn.spec import LaunchSpec, Operands, all_finite
from attn.spec import acc_dtype as _acc_dtype
from attn import batching, transforms
from attn.tiled import cpu, double, jvp
from attn.tiled.gemm import _Gemm, low_gemms
from attn.tiled.plan import (DEFAULT, TileConfig, _blocks, _plan, backward_items,
                             backward_runs, forward_items)
from attn.tiled.steps import (_bwd_tile, _bwd_tile_compiled, _compilable, _compiled_steps,
                              _fwd_tile, _fwd_tile_compiled, _run_compiled, exp2_)
from attn.tiled.tile import (LN2, LOG2E, _scores_finite, _Tile,
                             _values_may_overflow, tile_index)

_NO_OPERANDS = Operands()


def _check_operands(ops: Operands) -> None:
    if not isinstance(ops, Operands):
        raise TypeError(f"ops must be an attn.spec.Operands, got {type(ops).__name__}")
    if ops.cu_seqlens_q is not None or ops.cu_seqlens_k is not None:  # (SequenceBlocks)
        raise NotImplementedError("tiled: cu_seqlens operands are not read; packed sequences "
                                  "run as a document mask (attn.varlen_attention)")
    if ops.q_scale is not None:
        raise ValueError("tiled: fold operands.q_scale into q first (attn.call.run does)")
    if ops.pages is not None or ops.quant is not None:
        raise ValueError("tiled: paged keys (operands.pages, .quant) are read by "
                         "paged_attention, forward only")


class _Facts(NamedTuple):
    """What the tiles of a call need to know about its values, asked once per call (a pass
    over q, k, v each): whether every q·k is surely finite (masks may then be additive) and
    whether Σ p·v may overflow (the forward then looks at each tile's values)."""
    finite_scores: bool
    values_may_overflow: bool


def _facts(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands, *,
           items: bool = False) -> _Facts:
    """The call's :class:`_Facts`: the scores are looked at only where something masks
    (unmasked calls never need the answer), the values not on the items path (``items``:
    :func:`_fwd_rows` looks at each item's output instead)."""
    # a band that cuts no (query, key) pair of this call (a causal decoding step: its one
    # query sees every key) masks nothing, and asks no pass over q and k
    masked = (not spec.local_band().tile_is_full(0, q.shape[2], 0, k.shape[2])
              or ops.attn_mask is not None or spec.mask_mod is not None)
    finite = _scores_finite(q, k, spec) if masked else True
    overflow = False if items else _values_may_overflow(v, k.shape[2])
    return _Facts(finite, overflow)


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands = _NO_OPERANDS, *,
         want_lse2: bool = False, config: TileConfig = DEFAULT
         ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """``(out, lse)``, and with ``want_lse2`` also ``lse2 (B, H, Nq, 2)``: each row's base-2
    max m and log2 of its denominator l, the exact row constant the backward subtracts in
    two parts (pass it to :func:`_bwd` as ``lse2``). Rows with no key: (-inf, 0).
    ``ops``: the call's optional tensors (the mask, sinks, a learnable softcap, ALiBi slopes,
    a score_mod's captures); ``config``: how the call is cut (block sizes where ``spec`` has
    none, chunks, work items)."""
    _check_operands(ops)
    B, H, Nq, _ = q.shape
    acc_dtype = _acc_dtype(q.dtype)
    out = torch.empty(B, H, Nq, v.shape[-1], dtype=v.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc_dtype, device=q.device)
    lse2 = torch.empty(B, H, Nq, 2, dtype=acc_dtype, device=q.device)  # (m, log2 l)
    plan = _plan(q, k, spec, v, config)
    if plan.threads is None:  # the call's worker count, read before _caller sets it to 1
        plan = plan._replace(threads=cpu.workers_for_call())
    packed = spec.alibi_rows is not None
    with _caller(plan.threads):  # its own passes too run on one thread: no parallel region
        facts = _facts(q, k, v, spec, ops, items=plan.threads != 0)
        if plan.kv_chunk is not None:
            _fwd_split(q, k, v, plan, ops, facts, out, lse, lse2)
            return (out, lse, lse2) if want_lse2 else (out, lse)
    items = forward_items(plan)

    def run(i: int) -> None:  # each item writes its rows of the outputs
        ci, bi = items[i]
        c = plan.chunks[ci]
        _fwd_rows(c.bh(q), c.kv(k), c.kv(v), c.spec(plan.spec), c.operands(ops, packed),
                  c.bh(out), c.bh(lse), c.bh(lse2), b0=c.b0, engine=plan.engine,
                  blocks=plan.blocks[bi:bi + 1], facts=facts)

    cpu.run_items(run, len(items), threads=plan.threads, flush_denormals=True)
    return (out, lse, lse2) if want_lse2 else (out, lse)


def _caller(threads: int | None) -> contextlib.AbstractContextManager:
    """The calling thread's own work of a call on the items path (checks before the items,
    merges after them) runs with one intra-op thread: the call's one parallel region is
    its items'."""
    return cpu.single_thread() if threads != 0 else contextlib.nullcontext()


def _merge_partials(parts_out: Tensor, parts_lse: Tensor, sinks: Tensor | None
                    ) -> tuple[Tensor, Tensor]:
    """Key ranges' partials ``(R, B, H, Nq, Dv)`` / ``(R, B, H, Nq)`` merged in range order,
    the sinks ``(H,)`` joining the denominator once, as one more partial of value 0."""
    outs, lses = list(parts_out.unbind(0)), list(parts_lse.unbind(0))
    if sinks is not None:
        _, B, H, Nq = parts_lse.shape
        outs.append(torch.zeros_like(outs[0]))
        lses.append(sinks.to(parts_lse.dtype).view(1, H, 1).expand(B, H, Nq))
    # one partial is its own merge (the same values): no pass over it
    return _merge_trusted(outs, lses) if len(outs) > 1 else (outs[0], lses[0])


def _fwd_split(q: Tensor, k: Tensor, v: Tensor, plan, ops: Operands, facts: _Facts,
               out: Tensor, lse: Tensor, lse2: Tensor) -> None:
    """Split-KV decoding (docs/design.md, "The tiled backend on CPU"): (chunk, key range)
    items over all of a chunk's heads, each writing a partial output and lse, merged in key
    order with the sinks. lse2 = (lse·log2 e, 0): the backward then takes Δ from the tiles."""
    B, H, Nq, _ = q.shape
    Nk, Dv = k.shape[2], v.shape[-1]
    acc_dtype = lse.dtype
    step = plan.kv_chunk
    ranges = [(n0, min(n0 + step, Nk)) for n0 in range(0, Nk, step)]
    parts_out = torch.empty(len(ranges), B, H, Nq, Dv, dtype=acc_dtype, device=q.device)
    parts_lse = torch.empty(len(ranges), B, H, Nq, dtype=acc_dtype, device=q.device)
    scratch = torch.empty(len(ranges), B, H, Nq, 2, dtype=acc_dtype, device=q.device)
    packed = plan.spec.alibi_rows is not None
    no_sinks = ops._replace(sinks=None)
    items = [(ci, r) for r in range(len(ranges)) for ci in range(len(plan.chunks))]

    def run(i: int) -> None:
        ci, r = items[i]
        c, (n0, n1) = plan.chunks[ci], ranges[r]
        cops = c.operands(no_sinks, packed)
        mask = cops.attn_mask
        if mask is not None:
            m4 = as_4d(mask)
            cops = cops._replace(attn_mask=m4[..., n0:n1] if m4.shape[3] != 1 else m4)
        # one key tile per item: a decode tile is a few rows, so its torch ops cost about
        # as much Python as compute, and the Python holds the GIL
        spec = dataclasses.replace(c.spec(plan.spec), block_n=step).shard(k_start=n0)
        _fwd_rows(c.bh(q), c.kv(k)[:, :, n0:n1], c.kv(v)[:, :, n0:n1], spec, cops,
                  c.bh(parts_out[r]), c.bh(parts_lse[r]), c.bh(scratch[r]), b0=c.b0,
                  engine=plan.engine, facts=facts)

    cpu.run_items(run, len(items), threads=plan.threads,  # (the count read before _caller)
                  flush_denormals=True)
    merged, merged_lse = _merge_partials(parts_out, parts_lse, ops.sinks)
    out.copy_(merged)
    lse.copy_(merged_lse)
    lse2[..., 0] = lse * LOG2E
    lse2[..., 1] = 0.0


def _fwd_rows(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands, out: Tensor,
              lse: Tensor, lse2: Tensor, *, facts: _Facts, b0: int = 0, engine: str = "bmm",
              blocks=None, key_scales: tuple[Tensor | None, Tensor | None] = (None, None)
              ) -> None:
    """The forward of one item, into ``out``, ``lse``, ``lse2`` (its views of the call's;
    ``facts``: the call's, :func:`_facts`; ``b0``: its first batch row's index in the call;
    ``engine``: the plan's; ``key_scales``: per-key multipliers of k and v, ``_Gemm``'s), for
    the query ``blocks`` given (all of them by default), writing only their rows; once more
    with each tile's values looked at where those rows are not finite (docs/design.md,
    "Values near the dtype's largest")."""
    given = blocks
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    gemm = _Gemm(k, v, acc_dtype, engine, low=low_gemms(q), key_scales=key_scales)
    tile = _Tile(q, k, spec, gemm, ops.attn_mask, ops.softcap, ops.alibi, b0=b0,
                 finite_scores=facts.finite_scores)
    sink_rows = (None if ops.sinks is None  # in base-2 units, like m_i
                 else (ops.sinks.to(acc_dtype) * LOG2E).view(1, H, 1).expand(B, H, Nq))
    # a finite "-inf" start keeps exp(m_i - m_new) and exp(s - m_new) free of inf - inf
    lowest = torch.finfo(acc_dtype).min
    if blocks is None:
        blocks = _blocks(spec, Nq, Nk).query_blocks()
    compiled = _compiled_steps(q) and engine == "bmm"
    tile.values_may_overflow = facts.values_may_overflow

    for m0, m1, key_tiles in blocks:
        rows = (B * Hkv, G * (m1 - m0), 1)
        # -- init: the sink, when present, is the first "key" of every row --
        if sink_rows is None:
            m_i = torch.full(rows, lowest, dtype=acc_dtype, device=q.device)
            l_i = torch.zeros(rows, dtype=acc_dtype, device=q.device)
        else:
            m_i = tile.rows(sink_rows, m0, m1).clone()
            l_i = torch.ones(rows, dtype=acc_dtype, device=q.device)
        acc = torch.zeros(rows[:2] + (Dv,), dtype=acc_dtype, device=q.device)
        if key_tiles:
            q_blk = tile.q_block(m0, m1)
        for n0, n1, full in key_tiles:
            s, _, _ = tile.scores(q_blk, m0, m1, n0, n1, full)
            z = tile.dropout_scale(m0, m1, n0, n1) if spec.dropout_p > 0.0 else None
            c = tile.value_offset(n0, n1)
            step = (_run_compiled(_fwd_tile_compiled, m_i, l_i, s, z)
                    if compiled and c is None and _compilable(s) else None)
            p, m_i, l_i, alpha = step if step is not None else _fwd_tile(m_i, l_i, s, z, c)
            gemm.add_pv(acc.mul_(alpha), p, n0, n1)
        # -- epilogue: rows that saw nothing (l_i = 0) give 0 and lse = -inf --
        seen = l_i > 0
        out[:, :, m0:m1] = (acc / torch.where(seen, l_i, 1.0)).view(B, H, m1 - m0, Dv)
        part = lse2[:, :, m0:m1]
        part[..., 0] = torch.where(seen, m_i, float("-inf")).view(B, H, -1)
        part[..., 1] = torch.where(seen, torch.log2(l_i), 0.0).view(B, H, -1)
        lse[:, :, m0:m1] = part.sum(-1) * LN2  # (not out=: dynamo refuses a strided out)
    if not facts.values_may_overflow and not all_finite(
            out[:, :, given[0][0]:given[-1][1]] if given else out):
        _fwd_rows(q, k, v, spec, ops, out, lse, lse2, b0=b0, engine=engine, blocks=given,
                  facts=facts._replace(values_may_overflow=True), key_scales=key_scales)


def _softmax_delta(tile: _Tile, q_blk: Tensor, dp_of, lse_blk: Tensor, m0: int,
                   m1: int, key_tiles) -> Tensor:
    """``Σ_j p_ij dp_ij`` over a query block's tiles, ``(B·Hkv, G·BM, 1)``: p = exp2(s − m)
    and dp = ``dp_of(n0, n1)`` (dropout-scaled) exactly as the backward's tile loop forms
    them, so a saturated row's dS = p∘(dp − Δ) is 0 where its exact value rounds to 0."""
    spec = tile.spec
    delta = torch.zeros(q_blk.shape[:2] + (1,), dtype=tile.acc_dtype, device=q_blk.device)
    for n0, n1, full in key_tiles:
        s, _, _ = tile.scores(q_blk, m0, m1, n0, n1, full)
        p = exp2_(s.sub_(lse_blk))
        dp = dp_of(n0, n1)
        if spec.dropout_p > 0.0:
            dp = dp * tile.dropout_scale(m0, m1, n0, n1)
        delta += (p * dp).sum(dim=-1, keepdim=True)
    return delta


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, ops: Operands = _NO_OPERANDS, *,
         need_dmask: bool = False, need_dcap: bool = True, lse2: Tensor | None = None,
         config: TileConfig = DEFAULT) -> Grads:
    """Gradients of one call, as work items of :func:`backward_runs` (a chunk's run of
    query blocks each): dq, dk, dv always; the float mask's only with ``need_dmask`` (an
    N x N tensor when the mask is), sinks' when given, the learnable softcap's when given
    and ``need_dcap``, and those of the tensors ``ops.captured`` by ``spec.score_mod``, each
    summed across items in item order afterwards (no atomics). ALiBi's slopes are constants.
    ``lse2``: the forward's two-part base-2 lse (``_fwd(want_lse2=True)``); without it
    ``lse·log2 e`` stands in, exact up to its rounding. ``config``: the forward's."""
    _check_operands(ops)
    plan = _plan(q, k, spec, v, config, backward=True)
    packed = spec.alibi_rows is not None
    B, H, Nq, D = q.shape
    acc_dtype = _acc_dtype(q.dtype)
    runs = backward_runs(plan, config)
    with _caller(plan.threads):
        facts = _facts(q, k, v, spec, ops)
        # dq's rows no run covers (query blocks with no key tile) are 0; the items write the
        # rest, and each zeroes its own dk / dv slice before adding into it (run r > 0 of a
        # chunk into a partial of its own), so no zero-fill runs outside the items
        into = (torch.empty(B, H, Nq, D, dtype=acc_dtype, device=q.device),
                torch.empty(k.shape[:3] + (D,), dtype=acc_dtype, device=q.device),
                torch.empty(v.shape, dtype=acc_dtype, device=q.device))
        for m0, m1, key_tiles in plan.blocks:
            if not key_tiles:
                into[0][:, :, m0:m1] = 0.0
        if not runs:
            into[1].zero_(), into[2].zero_()
    extra = [(torch.empty_like(into[1]), torch.empty_like(into[2])) for _ in runs[1:]]
    kw = dict(need_dmask=need_dmask, need_dcap=need_dcap, engine=plan.engine,
              finite_scores=facts.finite_scores)
    items = backward_items(plan, runs)
    parts: list[Grads | None] = [None] * len(items)
    no_sinks = ops._replace(sinks=None)  # their gradient is the call's, below

    def run(i: int) -> None:
        ci, r = items[i]
        c = plan.chunks[ci]
        dk, dv = (c.kv(x).zero_() for x in (into[1:] if r == 0 else extra[r - 1]))
        parts[i] = _bwd_rows(c.bh(do), c.bh(dlse), c.bh(q), c.kv(k), c.kv(v), c.bh(out),
                             c.bh(lse), c.spec(plan.spec), c.operands(no_sinks, packed),
                             lse2=c.bh(lse2), b0=c.b0, blocks=plan.blocks[slice(*runs[r])],
                             into=(c.bh(into[0]), dk, dv), **kw)

    def join(ci: int) -> None:  # a chunk's dK/dV partials, added in run order
        c = plan.chunks[ci]
        for dk, dv in extra:
            c.kv(into[1]).add_(c.kv(dk))
            c.kv(into[2]).add_(c.kv(dv))

    cpu.run_items(run, len(items), threads=plan.threads, flush_denormals=True)
    if extra:
        cpu.run_items(join, len(plan.chunks), threads=plan.threads)
    # -- the per-head, mask and captured gradients: each item's into its chunk's slice, in
    # item order; the sinks' in one pass over the call's rows --
    with _caller(plan.threads):
        dmask, dsoftcap, dcaptured = _grad_sums(ops, H, need_dmask, need_dcap, acc_dtype,
                                                q.device)
        dsinks = call_sink_grad(ops.sinks, do, dlse, out, lse, acc_dtype)  # Δ as _bwd_rows's
        for (ci, _), g in zip(items, parts):
            c = plan.chunks[ci]
            if dmask is not None:
                dmask[c.mask_index(dmask)] += g.dmask
            if dsoftcap is not None:
                dsoftcap[c.heads] += g.dsoftcap
            for j, d in enumerate(g.dcaptured):
                if d is not None:
                    dcaptured[j] = d if dcaptured[j] is None else dcaptured[j] + d
        return Grads(*into, dmask, dsinks, dsoftcap, tuple(dcaptured))


def _grad_sums(ops: Operands, H: int, need_dmask: bool, need_dcap: bool, acc_dtype,
               device) -> tuple[Tensor | None, Tensor | None, list[Tensor | None]]:
    """Zeroed sums of the gradients that are not per row: the float mask's (with
    ``need_dmask``), the learnable softcap's (with ``need_dcap``), and the captured
    tensors' (None until a tile gives one)."""
    dmask = dsoftcap = None
    if need_dmask:
        dmask = torch.zeros(as_4d(ops.attn_mask).shape, dtype=acc_dtype, device=device)
    if ops.softcap is not None and need_dcap:
        dsoftcap = torch.zeros(H, dtype=acc_dtype, device=device)
    return dmask, dsoftcap, [None] * len(ops.captured)


def _bwd_tiles(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands, acc_dtype,
               engine: str, b0: int, finite_scores: bool) -> tuple[_Gemm, _Tile]:
    """A backward item's GEMMs (q·kᵀ as the forward's, keys-major where oneDNN runs them)
    and score tiles."""
    gemm = _Gemm(k, v, acc_dtype, engine, low=low_gemms(q))
    gemm.keys_major = gemm.onednn
    tile = _Tile(q, k, spec, gemm, ops.attn_mask, ops.softcap, ops.alibi, b0=b0,
                 finite_scores=finite_scores)
    if not tile.finite_scores:
        # a masked key has dS = 0, but 0·NaN in dS K would still reach dQ: a non-finite key
        # enters dQ as 0 (a row that sees it has NaN dS anyway)
        gemm.k3_dq = torch.where(torch.isfinite(gemm.k3), gemm.k3, 0.0)
    return gemm, tile


def _bwd_row_terms(do: Tensor, out: Tensor, dlse: Tensor | None, lse: Tensor,
                   lse2: Tensor | None, acc_dtype):
    """The rows' backward terms (B, H, Nq): Δ, the m the tiles subtract, 1/l (None without
    lse2) and, where lse2 is given, the saturated rows and their (Nq,) host flag."""
    delta = row_delta(do, out, dlse, acc_dtype)
    if lse2 is None:  # the natural lse alone: exact up to its rounding
        lse_m, inv_l = lse.to(acc_dtype) * LOG2E, None
    else:
        # P = exp2(s - m) / l: the tiles subtract m alone, and 1/l scales each row of dO and
        # Δ instead (dV = Σ P dO and dS = P∘(dP − Δ) are linear in both), so the second
        # part costs a (rows, D) multiply per query block, not a pass over every tile
        lse_m, inv_l = lse2[..., 0], exp2_(-lse2[..., 1])
    lse_m = lse_m.masked_fill(lse_m == float("-inf"), float("inf"))  # P = 0 on empty rows
    # saturated rows, and rows the forward gave a value offset, take Δ from the tiles
    # (docs/design.md, "Saturated rows", "Values near the dtype's largest")
    saturated = saturated_rows = None
    # (a data-dependent branch: skipped while torch.compile traces, as the value checks are)
    if lse2 is not None and do.shape[2] > 0 and not torch.compiler.is_compiling():
        saturated_rows = lse2[..., 1] < SATURATED_LOG2L  # (B, H, Nq)
        saturated = saturated_rows.flatten(0, 1).any(0).cpu()
    return delta, lse_m, inv_l, saturated, saturated_rows


def _bwd_rows(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
              lse: Tensor, spec: LaunchSpec, ops: Operands, *,
              need_dmask: bool = False, need_dcap: bool = True,
              into: tuple[Tensor, Tensor, Tensor], blocks, finite_scores: bool,
              lse2: Tensor | None = None, b0: int = 0, engine: str = "bmm") -> Grads:
    """One backward item of :func:`_bwd`: a chunk (``b0``: its first batch row's index in
    the call; ``engine``: the plan's) and a run of its query ``blocks``. Writes dq of their
    rows into ``into[0]`` and adds their share of dk and dv into ``into[1:]`` (zeroed
    views), and returns their share of the other gradients (not the sinks': :func:`_bwd`
    leaves them out of its items and takes them once for the call). ``finite_scores``: the
    call's (:class:`_Facts`).

    Long on purpose: one tile's backward steps share a dozen running tensors (dq, dk, dv,
    the mask, softcap and captures' gradients); as in the forward and the Triton kernels, the
    loop reads best whole, with phase markers."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc_dtype = _acc_dtype(q.dtype)
    sinks, captured = ops.sinks, ops.captured
    gemm, tile = _bwd_tiles(q, k, v, spec, ops, acc_dtype, engine, b0, finite_scores)
    dq = into[0]
    dk3, dv3 = into[1].view(B * Hkv, Nk, D), into[2].view(B * Hkv, Nk, Dv)  # row slices: views
    dmask, dsoftcap, dcaptured = _grad_sums(ops, H, need_dmask, need_dcap, acc_dtype,
                                            q.device)
    delta, lse_m, inv_l, saturated, saturated_rows = _bwd_row_terms(do, out, dlse, lse, lse2,
                                                                   acc_dtype)
    track = spec.score_mod is not None
    compiled = _compiled_steps(q) and engine == "bmm"
    # bf16 dP = dO Vᵀ, dV += Pᵀ dO, dK += dSᵀ q and dQ += dS K (where the forward's GEMMs
    # are bf16; q, k, v share a dtype, so gemm.low and gemm.low_qk agree): P, dS and dO/l
    # each rounded to bf16 once per tile (per query block for dO/l)
    low_bwd = gemm.low and gemm.low_qk and do.dtype == torch.bfloat16

    for m0, m1, key_tiles in blocks:
        if not key_tiles:
            continue
        BM = m1 - m0
        q_blk = tile.q_block(m0, m1)  # (B·Hkv, G·BM, D)
        # raw bf16 q (low_qk): scaled at the end
        q_dk = q_blk.to(acc_dtype) if gemm.low_qk and not low_bwd else q_blk
        do_blk = do[:, :, m0:m1].to(acc_dtype).reshape(B * Hkv, G * BM, Dv)
        lse_blk = tile.rows(lse_m, m0, m1)
        delta_blk = tile.rows(delta, m0, m1)
        inv_l_blk = None
        if inv_l is not None:  # dO/l and Δ/l: the dP GEMM then yields dP/l
            inv_l_blk = tile.rows(inv_l, m0, m1)
            do_blk, delta_blk = do_blk * inv_l_blk, delta_blk * inv_l_blk
        do_dv = do_blk.to(torch.bfloat16) if low_bwd else do_blk  # dV's dO (/l)
        # dP's dO: low_bwd, in bf16 as it is, 1/l joining as the bf16 dP is converted
        dp_do, dp_rows = ((do[:, :, m0:m1].contiguous().view(B * Hkv, G * BM, Dv), inv_l_blk)
                          if low_bwd else (do_blk, None))

        def dp_of(n0, n1, dp_do=dp_do, dp_rows=dp_rows):
            return gemm.dp(dp_do, n0, n1, dp_rows)
        if saturated is not None and bool(saturated[m0:m1].any()):  # (lse2 given: inv_l too)
            tiles_delta = _softmax_delta(tile, q_blk, dp_of, lse_blk, m0, m1, key_tiles)
            tiles_delta.mul_(inv_l_blk)
            if dlse is not None:
                tiles_delta.sub_(tile.rows(dlse.to(acc_dtype), m0, m1) * inv_l_blk)
            delta_blk = torch.where(tile.rows(saturated_rows, m0, m1), tiles_delta, delta_blk)
        dq_blk = torch.zeros(B * Hkv, G * BM, D, dtype=acc_dtype, device=q.device)
        for n0, n1, full in key_tiles:
            BN = n1 - n0
            s, u, t = tile.scores(q_blk, m0, m1, n0, n1, full, track=track)
            z = tile.dropout_scale(m0, m1, n0, n1) if spec.dropout_p > 0.0 else None
            dp = dp_of(n0, n1)
            step = None
            if compiled and _compilable(s):
                step = _run_compiled(_bwd_tile_compiled, s, dp, u, t, lse_blk, delta_blk, z,
                                  dsoftcap is not None)
            if step is None:
                step = _bwd_tile(s, u, t, lse_blk, delta_blk, dp, z, dsoftcap is not None)
            pd, ds, ds_raw, dc_terms = step
            # -- dV += Pᵈᵀ dO (Pᵀ sums over the GQA group) --
            gemm.add_tn(dv3[:, n0:n1], gemm.low_operand(pd, "pd16") if low_bwd else pd,
                        do_dv, "dv")
            if dmask is not None:
                dmask[tile_index(dmask, m0, m1, n0, n1)] += _reduce_to(ds.view(B, H, BM, BN),
                                                                      dmask.shape)
            if dsoftcap is not None:
                dsoftcap += dc_terms.view(B, Hkv, G, BM, BN).sum(dim=(0, 3, 4)).reshape(H)
            if track:  # -- the score_mod's backward, by autograd on this tile's graph --
                ds_raw, dcap_t = tile.score_mod_vjp(ds_raw, captured)
                for i, g in enumerate(dcap_t):
                    if g is not None:
                        dcaptured[i] = g if dcaptured[i] is None else dcaptured[i] + g
            # -- dQ += dS K, dK += dSᵀ Q (q_blk carries the scale; dQ gets it at the end) --
            if low_bwd:
                ds_raw = gemm.low_operand(ds_raw, "ds16")
            gemm.add_dq(dq_blk, ds_raw, n0, n1)
            gemm.add_tn(dk3[:, n0:n1], ds_raw, q_dk, "dk")
        dq[:, :, m0:m1] = dq_blk.view(B, H, BM, D) * spec.qk_scale

    if gemm.low_qk:  # q_blk was q as it is: dK = Σ dSᵀ q·scale
        dk3.mul_(spec.qk_scale)
    elif tile.fold_log2:  # q_blk carried log2 e: dK = Σ dSᵀ q·scale needs it taken out
        dk3.mul_(LN2)
    dsinks = None if sinks is None else sink_grad(sinks, lse.to(acc_dtype), delta)
    return Grads(dq, dk3.view(B, Hkv, Nk, D), dv3.view(B, Hkv, Nk, Dv), dmask, dsinks,
                 dsoftcap, tuple(dcaptured))


class _TiledAttention(torch.autograd.Function):
    """Saves q, k, v, out, lse (and lse2, the mask, sinks, softcap, slopes); the backward
    recomputes each tile. ``apply`` takes every optional tensor explicitly (attn.spec.Operands'
    rule); lse2 is a third, non-differentiable output (the backward's row constants). torch.func:
    the backward is :class:`attn.tiled.double._TiledBackward` (differentiable again), the
    forward-mode rule :func:`attn.tiled.jvp.tiled_jvp`, the vmap rule folds the mapped dim
    into B or loops (:mod:`attn.batching`)."""

    @staticmethod
    def forward(q, k, v, spec: LaunchSpec, config: TileConfig, attn_mask, sinks, softcap,
                alibi, *captured):
        ops = Operands(attn_mask, sinks, softcap, alibi, captured)
        return _fwd(q, k, v, spec, ops, want_lse2=True, config=config)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, spec, config, attn_mask, sinks, softcap, alibi, *captured = inputs
        out, lse, lse2 = output
        ctx.mark_non_differentiable(lse2)
        # the captured tensors are not saved: the score_mod reads them itself in backward
        ctx.save_for_backward(q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi)
        ctx.save_for_forward(q, k, v, out, lse, attn_mask, sinks, softcap, alibi)
        ctx.spec, ctx.config, ctx.captured = spec, config, tuple(captured)

    @staticmethod
    def backward(ctx, dout, dlse, _dlse2):
        q, k, v, out, lse, lse2, attn_mask, sinks, softcap, alibi = ctx.saved_tensors
        ops = Operands(attn_mask, sinks, softcap, alibi, ctx.captured)
        do = torch.zeros_like(out) if dout is None else dout  # only lse was used
        static = double.Static(ctx.spec, ctx.config, _bwd, bool(ctx.needs_input_grad[5]),
                               bool(ctx.needs_input_grad[7]))
        if torch.compiler.is_compiling():  # traced: the first-order launcher as it is
            g = double._TiledBackward.forward(static, do, dlse, q, k, v, out, lse, lse2,
                                              *ops[:4], *ops.captured)
        else:
            g = double.differentiable_backward(static, do, dlse, q, k, v, out, lse, lse2, ops)
        return (*g[:3], None, None, *g[3:6], None, *g[6:])

    @staticmethod
    def vmap(info, in_dims, q, k, v, spec, config, attn_mask, sinks, softcap, alibi,
             *captured):
        args = (q, k, v, spec, config, attn_mask, sinks, softcap, alibi, *captured)
        ops = Operands(attn_mask, sinks, softcap, alibi, tuple(captured))
        X = info.batch_size
        if not double._foldable(spec, ops, need_dmask=False) or any(
                d is not None for d in in_dims[6:]):
            return batching.call_per_sample(_TiledAttentionJvp.apply, X, in_dims, args)
        # (no sinks, softcap or captures: _foldable)
        res = _TiledAttentionJvp.apply(*batching.fold_args(
            args, in_dims, X, batching.rows_of(q, in_dims[0]), mask=5))
        return tuple(batching.unfold(x, X) for x in res), (0, 0, 0)


class _TiledAttentionJvp(_TiledAttention):
    """:class:`_TiledAttention` with its forward-mode rule, taken under torch.func transforms
    and forward-mode AD (torch.compile cannot trace a Function that defines ``jvp``)."""

    @staticmethod
    def jvp(ctx, dq, dk, dv, _spec, _config, dmask, dsinks, dsoftcap, dalibi, *dcaptured):
        q, k, v, out, lse, attn_mask, sinks, softcap, alibi = ctx.saved_tensors
        ops = Operands(attn_mask, sinks, softcap, alibi, ctx.captured)
        tangents = {"q": dq, "k": dk, "v": dv, "mask": dmask, "sinks": dsinks,
                    "softcap": dsoftcap, "alibi": dalibi,
                    "captured": any(d is not None for d in dcaptured)}
        d_out, d_lse = jvp.tiled_jvp(q, k, v, out, lse, ctx.spec, ops, tangents)
        return d_out, d_lse, None


# -- torch.export: the call as one opaque op --------------------------------------------------
# The tile loops run over the lengths, so traced they would fix each length as a constant:
# while exporting, a call whose spec is plain values (and a constant mask) runs as the op
# attn::tiled_fwd instead, whose fake shapes follow any symbolic length, and whose backward
# is attn::tiled_bwd. Op schemas take flat values: the spec travels as its fields.

def _exportable(spec: LaunchSpec, ops: Operands, config: TileConfig) -> bool:
    """Whether the ops carry this call whole: a spec the ops' fields rebuild exactly (so a
    field they do not carry, set, keeps the call off them; the dropout seed is unread
    without dropout), no optional tensor but a constant mask."""
    carried = _export_spec(*_export_fields(spec))
    return (config is DEFAULT and dataclasses.replace(spec, dropout_seed=0) == carried
            and all(f is None for f in (ops.sinks, ops.softcap, ops.alibi))
            and not ops.captured
            and (ops.attn_mask is None or not ops.attn_mask.requires_grad))


def _export_fields(spec: LaunchSpec) -> tuple:
    """The spec's fields as the ops take them, :func:`_export_spec`'s arguments."""
    b = spec.band
    return spec.qk_scale, b.offset, b.left, b.right, spec.softcap, spec.block_m, spec.block_n


def _export_spec(scale: float, offset: int, left: int | None, right: int | None,
                 softcap: float | None, block_m: int | None, block_n: int | None) -> LaunchSpec:
    return LaunchSpec(qk_scale=scale, band=Band(offset, left, right), softcap=softcap,
                      block_m=block_m, block_n=block_n)


@torch.library.custom_op("attn::tiled_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, scale: float,
            offset: int, left: int | None, right: int | None, softcap: float | None,
            block_m: int | None, block_n: int | None) -> tuple[Tensor, Tensor]:
    """out and lse (see :func:`_fwd`)."""
    spec = _export_spec(scale, offset, left, right, softcap, block_m, block_n)
    return _fwd(q, k, v, spec, Operands(attn_mask=attn_mask))


@_fwd_op.register_fake
def _(q, k, v, attn_mask, *fields):
    B, H, Nq, _ = q.shape
    return (q.new_empty(B, H, Nq, v.shape[-1], dtype=v.dtype),
            q.new_empty(B, H, Nq, dtype=_acc_dtype(q.dtype)))


@torch.library.custom_op("attn::tiled_bwd", mutates_args=())
def _bwd_op(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
            lse: Tensor, attn_mask: Tensor | None, scale: float, offset: int,
            left: int | None, right: int | None, softcap: float | None, block_m: int | None,
            block_n: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (see :func:`_bwd`)."""
    spec = _export_spec(scale, offset, left, right, softcap, block_m, block_n)
    g = _bwd(do.contiguous(), dlse, q, k, v, out, lse, spec, Operands(attn_mask=attn_mask))
    return g.dq.to(q.dtype), g.dk.to(k.dtype), g.dv.to(v.dtype)


@_bwd_op.register_fake
def _(do, dlse, q, k, v, out, lse, attn_mask, *fields):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_op_setup(ctx, inputs, output) -> None:
    q, k, v, attn_mask, *ctx.fields = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], attn_mask)


def _fwd_op_backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    do = torch.zeros_like(out) if dout is None else dout  # only the lse was used
    dq, dk, dv = _bwd_op(do, dlse, q, k, v, out, lse, attn_mask, *ctx.fields)
    return (dq, dk, dv) + (None,) * (1 + len(ctx.fields))


_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup)


def _mask_tiles(spec: LaunchSpec, config: TileConfig) -> LaunchSpec:
    """``spec`` with a callable ``spec.mask_blocks`` (:func:`attn.mods.mod_spec`) called:
    the mask's tiles classified at this backend's tile sizes (``spec.block_m`` / ``block_n``
    where set, else ``config``'s)."""
    if not callable(spec.mask_blocks):
        return spec
    mb = spec.mask_blocks(spec.block_m or config.block_m, spec.block_n or config.block_n)
    return dataclasses.replace(spec, block_m=mb.block_m, block_n=mb.block_n, mask_blocks=mb)


def double_backward(do, dlse, q, k, v, out, lse, spec: LaunchSpec, ops):
    """``(dq, dk, dv, dsinks)`` of a call that another backend ran forward, from its saved
    q, k, v, out and lse, by tiled's backward whose gradients are differentiable again
    (DESIGN's pinned decision "Transforms": a backward asked for its own gradient hands
    off here). ``ops``: the call's Operands (no learnable softcap or mask gradient)."""
    static = double.Static(_mask_tiles(spec, DEFAULT), DEFAULT, _bwd, False, False)
    g = double.differentiable_backward(static, do, dlse, q, k, v, out, lse, None, ops)
    return g[0], g[1], g[2], g[4]


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: LaunchSpec,
    operands: Operands | None = None,
    *,
    config: TileConfig = DEFAULT,
) -> tuple[Tensor, Tensor]:
    """Memory-linear exact attention. Inputs already validated by ``attn.api``.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) → out (B, H, Nq, Dv) in v's dtype,
    lse (B, H, Nq) in float32 (float64 for float64 inputs). ``spec`` holds the static values
    (a tensor temperature already folded into q), ``operands`` the optional tensors (their
    fields: :class:`attn.spec.LaunchSpec`, :class:`attn.spec.Operands`). ``config``: how the
    call is cut (:class:`attn.tiled.plan.TileConfig`); block sizes are ``spec.block_m`` /
    ``block_n`` where set, else the config's, and a callable ``spec.mask_blocks``
    (:func:`attn.mods.mod_spec`) is called here at those sizes.
    """
    operands = _NO_OPERANDS if operands is None else operands
    _check_operands(operands)
    if torch.compiler.is_exporting() and _exportable(spec, operands, config):
        return _fwd_op(q, k, v, operands.attn_mask, *_export_fields(spec))
    spec = _mask_tiles(spec, config)
    ts = (q, k, v, *operands[:4], *operands.captured)
    fn = _TiledAttention
    if torch.compiler.is_compiling() and not transforms.active(*ts) and not (
            torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad
                                            for t in ts)):
        # nothing to differentiate: the forward alone. (dynamo traces such an apply by
        # calling forward itself, and hands a Function whose forward takes *captured its
        # ctx as q: torch.compile(fullgraph=True) of an inference call failed)
        return _fwd(q, k, v, spec, operands, config=config)
    if transforms.active(*ts):
        dual = jvp.forward_with_tangent(q, k, v, spec, operands)  # forward AD alone: one pass
        if dual is not None:
            return dual
        fn = _TiledAttentionJvp
    if torch.compiler.is_compiling():  # the tile sizes set here, where torch 2.11's dynamo
        spec = config.tiles(spec)  # traces dataclasses.replace (inside the Function it cannot)
    out, lse, _ = fn.apply(q, k, v, spec, config, operands.attn_mask, operands.sinks,
                           operands.softcap, operands.alibi, *operands.captured)
    return out, lse
