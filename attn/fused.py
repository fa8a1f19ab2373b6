"""The fused backend: torch's own fused attention kernels as attn's block primitive, called on
the pieces of attn's plan and merged through their lse (the online softmax at block
granularity, :mod:`attn.merge`). The only module that calls torch's private
``aten::_scaled_dot_product_*`` ops, never through ``F.scaled_dot_product_attention``; their
schemas are checked when first used. What it expresses is an allow-list (:func:`call_reason`,
:data:`SPEC_DECISIONS`). Items, pieces, decoding, the backward, batch invariance and the CUDA
ops: docs/design.md, "The fused backend".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from attn import fused_cuda, workers
from attn.grads import Grads, call_sink_grad
from attn.masks import EMPTY, FULL, PARTIAL, Band, Blocks, as_4d, band_kinds, combine_kinds
from attn.mods import mask_mod_kinds
from attn.merge import _merge_trusted
from attn.spec import LaunchSpec, Operands, PageTable, all_finite, check_paged_forward_only
from attn.spec import acc_dtype as _acc_dtype
from attn.workers import kv_split, page_ranges

# -- torch's ops, checked once -----------------------------------------------------------------

_CPU_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, "
        "Tensor value, float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp)"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, "
        "Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, float dropout_p, "
        "bool is_causal, *, Tensor? attn_mask=None, float? scale=None) -> (Tensor grad_query, "
        "Tensor grad_key, Tensor grad_value)"),
}


class _CpuOps(NamedTuple):
    fwd: Callable
    bwd: Callable


@functools.cache
def _cpu_ops() -> _CpuOps | str:
    """torch's CPU ops, or why they cannot be used (:func:`attn.fused_cuda.checked_ops`: one
    warning, then the backend stays off for the process)."""
    found = fused_cuda.checked_ops(_CPU_SCHEMAS, show=True)
    return found if isinstance(found, str) else _CpuOps(*found.values())


def ops_reason(device: str) -> str | None:
    """Why torch's fused ops cannot serve ``device`` in this process, or None."""
    if device not in ("cpu", "cuda"):
        return f"the fused backend runs on CPU and CUDA, not {device}"
    ops = _cpu_ops() if device == "cpu" else fused_cuda.ops()
    return ops if isinstance(ops, str) else None


# the kernel pair of a call's pieces: (masked piece) -> pair
Kernels = Callable[[bool], fused_cuda.Pair]


def kernels(q: Tensor) -> Kernels:
    """The kernel pair each piece of a call on q's device runs: on CPU torch's CPU op, on
    CUDA :func:`cuda_kernels`. NotImplementedError when the ops are off."""
    why = ops_reason(q.device.type)
    if why is not None:
        raise NotImplementedError(f"backend='fused' is off: {why}")
    if q.device.type == "cpu":
        ops_cpu = _cpu_ops()

        def fwd(q, k, v, causal, mask, scale):
            return ops_cpu.fwd(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)

        def bwd(do, q, k, v, out, lse, causal, mask, scale):
            return ops_cpu.bwd(do, q, k, v, out, lse, 0.0, causal, attn_mask=mask,
                               scale=scale)

        cpu = fused_cuda.Pair("cpu", fwd, bwd)
        return lambda masked: cpu
    return cuda_kernels(q.dtype, q.shape[-1], q.device)


def cuda_kernels(dtype: torch.dtype, head_dim: int, device: torch.device) -> Kernels:
    """On CUDA, per masked or unmasked piece: the op :func:`attn.fused_cuda.force_op` set
    where it takes the piece, else the one :func:`attn.fused_cuda.choose` names."""
    forced = fused_cuda.forced_op()
    pairs = {}
    for masked in (False, True):
        op = forced
        if op is None or not fused_cuda.can_run(op, dtype, head_dim, masked):
            op = fused_cuda.choose(dtype, head_dim, masked, device)
        pairs[masked] = fused_cuda.pair(op)
    return pairs.__getitem__


# -- what it expresses -------------------------------------------------------------------------

# Every LaunchSpec field and what the fused backend does with it: "read" (computed exactly),
# "default" (only at the field's default); a field missing here makes every call inexpressible
SPEC_DECISIONS: dict[str, str] = {
    "qk_scale": "read",  # torch's scale argument
    "band": "read",  # pieces: full, top-left causal diagonal, masked strip
    "softcap": "default",  # torch's kernel has no score transform
    "terms": "default",  # nor a score step for a static variant's term
    "dropout_p": "default",  # attn's hash dropout cannot be handed to torch's kernel
    "dropout_seed": "read",  # meaningless without dropout
    "q_start": "read",  # the local band carries the shard's positions
    "k_start": "read",
    "head_start": "read",  # only dropout and ALiBi read heads, and neither runs here
    "heads_total": "read",
    "block_m": "read",  # query rows per block, where set
    "block_n": "read",  # ignored: torch's kernel tiles the keys itself
    "score_mod": "default",
    "mask_mod": "read",  # evaluated per partial piece into a bool mask
    "mask_blocks": "read",  # which tiles are skipped, full (no mask) or partial
    "dropout_rows": "default",
    "alibi_rows": "default",  # packed ALiBi reads operands.alibi per sequence instead
    "max_seqlen_q": "read",  # packed sequences: one item per sequence, never a tile of two
    "max_seqlen_k": "read",
}

# Operands the fused backend reads; the others must be None / empty.
_OPERANDS_READ = ("attn_mask", "sinks", "alibi", "cu_seqlens_q", "cu_seqlens_k")


def spec_reason(spec: LaunchSpec, ops: Operands) -> str | None:
    """Why the fused backend cannot compute a call with this spec and these operands."""
    for f in dataclasses.fields(spec):
        decision = SPEC_DECISIONS.get(f.name)
        if decision is None:
            return f"LaunchSpec.{f.name} has no fused decision yet"
        if decision == "default" and getattr(spec, f.name) != f.default:
            return f"LaunchSpec.{f.name} (torch's fused kernel cannot express it)"
    for name in Operands._fields:
        if name not in _OPERANDS_READ:
            value = getattr(ops, name)
            if value is not None and not (isinstance(value, tuple) and not value):
                return f"operands.{name} (not read by the fused backend)"
    if ops.attn_mask is not None and ops.attn_mask.requires_grad:
        return "a float mask's gradient (the tiled backend computes it)"
    return None


def call_reason(call) -> str | None:
    """Why the fused backend cannot compute ``call`` (an :class:`attn.call.AttentionCall`),
    or None: the allow-list over its fields, then the device's ops."""
    if call.score_mod:
        return "score_mod (torch's fused kernel has no score transform)"
    if call.softcap is not None:
        return "softcap (torch's fused kernel has no score transform)"
    if call.terms:
        return f"the score term(s) {list(call.terms)} (torch's fused kernel has no score step)"
    if call.dropout:
        return "dropout (attn's reproducible hash dropout cannot be handed to torch's kernel)"
    if call.mask_grad:
        return "a float mask's gradient (the tiled backend computes it)"
    if call.alibi and call.dtype not in (torch.float32, torch.float64):
        return ("alibi_slopes in a 16-bit dtype (torch's kernel would add the bias rounded "
                "to it; the tiled backend adds it in float32)")
    if call.head_dim != call.head_dim_v:
        return (f"a value head dim ({call.head_dim_v}) other than the query's "
                f"({call.head_dim}): torch's fused kernel needs them equal")
    if call.device == "cuda" and call.dtype == torch.float64:
        return "float64 on CUDA (torch's fused CUDA kernels have none)"
    if call.device == "cuda" and call.head_dim > 256:
        return f"head dim {call.head_dim} on CUDA (torch's fused CUDA kernels stop at 256)"
    return ops_reason(call.device)


def _one_piece(band: Band, n_q: int, n_k: int) -> Piece | None:
    """The piece a sequence of ``n_q`` rows and ``n_k`` keys is where ``band`` leaves it one
    piece of all its keys that needs no mask (none, or top-left causal), else None."""
    ps = pieces(band, 0, n_q, n_k)
    if len(ps) != 1 or ps[0].masked or (ps[0].n0, ps[0].n1) != (0, n_k):
        return None
    return ps[0]


def cut_per_sequence(call) -> bool:
    """Whether fused runs each sequence of ``call`` as items of its own (a window's or
    ALiBi's masked pieces, a bottom-right diagonal, a mask_mod, packed or key-padded
    sequences) rather than as one op call over the batch, which is what the table's ``tiny``
    and ``small`` cells measure (docs/benchmarks.md)."""
    if call.varlen or call.mask_mod or call.alibi or call.mask_padding:
        return True
    return _one_piece(call.band, call.n_q, call.n_k) is None


def cuda_verified(call) -> str | None:
    """The op that ``attn gpu-check`` verified for this CUDA call (its torch, arch, dtype and
    head dim; one that also takes masked pieces) and measured at least as fast as triton,
    or None: ``auto`` takes the fused backend on CUDA only then, and never for decoding (at
    most 16 query rows without a gradient: triton's split-KV) or packed sequences (one
    op call per sequence)."""
    if (call.device != "cuda" or call_reason(call) is not None or call.varlen
            or (call.n_q <= 16 and not call.grad)):
        return None
    return fused_cuda.verified_op(call.dtype, call.head_dim, True, torch.device("cuda"),
                                  faster=True)


# -- the plan ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """How the fused backend cuts a call. Every count depends on a sequence's own lengths and
    the model's heads, never on the batch or the number of workers."""

    # unmasked calls (bandless, causal) are cut into query blocks only for parallelism: about
    # items_per_row items per sequence (kv heads x query blocks), min_block_m rows or more
    items_per_row: int = 8
    min_block_m: int = 256
    # calls with masked pieces (a window's left edge, a user mask, ALiBi's bias): blocks of
    # masked_block_m query rows, masks of at most masked_block_n keys; ALiBi alone takes
    # alibi_block_m rows (its off-diagonal keys take one bias row per head, so larger blocks
    # mean fewer pieces and merges). spec.block_m, where set, wins.
    masked_block_m: int = 256
    masked_block_n: int = 1024
    alibi_block_m: int = 1024
    # calls with a user mask and no band (every piece masked, none cut away) are cut as
    # unmasked ones, in blocks of mask_min_block_m to mask_max_block_m rows, key pieces of at
    # most mask_block_n keys (with a band: masked_block_m and _n; why: docs/benchmarks.md)
    mask_min_block_m: int = 1024
    mask_max_block_m: int = 2048
    mask_block_n: int = 4096
    # the backward cuts a sequence's query blocks into runs (each with dK/dV partials of its
    # own, summed in run order) for about items_per_row items, at most bwd_max_runs
    bwd_max_runs: int = 4
    # split-KV decoding: at most split_max_q query rows per head, at least split_min_keys
    # keys, ranges of split_min_chunk keys doubled until at most split_max_chunks
    split_max_q: int = 16
    split_min_keys: int = 8192
    split_min_chunk: int = 4096
    split_max_chunks: int = 8
    # calls smaller than this (scores visited) run their items in order on the caller
    serial_max_scores: int = 1 << 16
    # a call below 32 query rows that :func:`_whole_call` allows is one op call on the
    # caller's thread alone up to this many scores, else its items (docs/benchmarks.md)
    serial_call_max_scores: int = 1 << 22
    # ALiBi's causal diagonals keep torch's causal flag beside their bias (the CPU op takes
    # both: no -inf in the bias, no check for rows without keys), else they are masked
    causal_bias: bool = True
    # an item takes as many kv heads as keep its scores within item_max_scores (one op call
    # per group: small blocks pay attn's per-call cost once per group); 0: one kv head each
    item_max_scores: int = 1 << 21
    # a CPU call :func:`_whole_call` allows is one op call over the whole batch; CUDA's
    # pairs take one item (batch 1, one head group) at a time
    whole_call: bool = True
    # such a call's backward is at most whole_bwd_parts op calls (:func:`_whole_bwd_parts`:
    # one per whole_bwd_part_scores scores, by batch rows, else by kv heads), one thread each
    whole_bwd_parts: int = 8
    whole_bwd_part_scores: int = 1 << 20
    # GQA decoding (:func:`folds`): a kv head's query heads as query rows of one op call
    fold_gqa: bool = True


DEFAULT = FusedConfig()


class Piece(NamedTuple):
    """Keys ``[n0, n1)`` of one query block, and how the band cuts them: ``causal`` torch's
    top-left causal on the piece (row i of the block sees the piece's keys j <= i),
    ``masked`` a mask evaluated on the piece, else every row sees every key."""
    n0: int
    n1: int
    causal: bool = False
    masked: bool = False


def pieces(band: Band, m0: int, m1: int, n_k: int) -> list[Piece]:
    """The key pieces of query rows ``[m0, m1)`` under ``band`` (local positions), empty
    ones left out: the left edge's strip (masked), the keys every row sees, and the right
    edge's diagonal (top-left causal when it starts on row m0's edge inside the keys, else
    masked). A band narrower than the block is one masked piece."""
    lo, hi = band.key_range(m0, m1, n_k)
    if lo >= hi:
        return []
    if band.is_full:
        return [Piece(lo, hi)]
    off = band.offset
    # keys every row of the block sees: [f0, f1)
    f0 = lo if band.left is None else max(lo, m1 - 1 + off - band.left)
    f1 = hi if band.right is None else min(hi, m0 + off + band.right + 1)
    if f0 >= f1:
        return [Piece(lo, hi, masked=True)]
    out = []
    if f0 > lo:
        out.append(Piece(lo, f0, masked=True))
    if band.right is None or f1 >= hi:
        out.append(Piece(f0, f1))
        return out
    a = m0 + off + band.right  # row m0's last key: the diagonal starts there
    if a > f0:
        out.append(Piece(f0, a))
    out.append(Piece(max(a, f0), hi, causal=a >= f0))
    return out


def _cut(ps: list[Piece], width: int) -> list[Piece]:
    """Pieces whose mask will be built (masked, or any piece when everything is masked)
    cut into runs of at most ``width`` keys, so no mask outgrows a block."""
    # (a causal diagonal cut: its first run keeps torch's top-left alignment)
    return [Piece(n0, min(n0 + width, p.n1), p.causal and n0 == p.n0,
                  p.masked or (p.causal and n0 != p.n0))
            for p in ps for n0 in range(p.n0, p.n1, width)]


def folds(n_q: int, G: int, config: FusedConfig = DEFAULT) -> bool:
    """Whether a forward of ``n_q`` query rows per head and ``G`` query heads per kv head
    runs its unmasked, uncausal pieces with each kv head's G query heads as ``G * n_q`` rows
    of one op call (decoding; why: docs/design.md, "The fused backend", Decoding)."""
    return config.fold_gqa and G > 1 and n_q <= config.split_max_q


def masks_scores(spec: LaunchSpec, ops: Operands, n_q: int, n_k: int,
                 config: FusedConfig = DEFAULT) -> bool:
    """Whether some piece of a call gets an additive mask (docs/design.md, "The fused
    backend", Masked keys): a user mask, mask_mod or block mask, ALiBi's diagonals, a
    window's strips, rows without keys (a negative offset), split-KV ranges; packed
    sequences each by their own band and lengths (a window's left edge that hides no key of
    the sequence, as flash-attn's compat gives, is none). Full pieces and causal diagonals
    are not: the op's causal flag overwrites the scores right of the diagonal first."""
    if (ops.attn_mask is not None or spec.mask_mod is not None or spec.mask_blocks is not None
            or ops.alibi is not None):
        return True
    lengths = [(n_q, n_k, spec.local_band())]
    if ops.cu_seqlens_q is not None:
        lengths = [(s.q1 - s.q0, s.k1 - s.k0, s.band)
                   for s in _packed_sequences(spec.local_band(), ops)]
    for m, n, b in lengths:
        if b.left is not None and m - 1 + b.offset - b.left <= 0:
            b = Band(b.offset, None, b.right)  # a left edge that hides no key of any row
        if b.is_full:
            continue
        if b.left is not None or b.right != 0 or b.offset < 0:
            return True
        if kv_split(m, n, config) is not None:
            return True
    return False


class Seq(NamedTuple):
    """One sequence of a call: batch row ``b`` (0 in the packed layout), query rows
    ``[q0, q1)`` and keys ``[k0, k1)`` of that row, its band in its own positions, and its
    row of the ALiBi slopes."""
    b: int
    q0: int
    q1: int
    k0: int
    k1: int
    band: Band
    slopes_row: int


def key_spans(mask: Tensor | None, B: int, n_k: int) -> list[tuple[int, int]] | None:
    """Each batch row's keys ``[a, b)`` when ``mask`` is key padding only (bool, ``(B or 1,
    1, 1, Nk)``, each row's kept keys one run: right or left padding), else None. Such a
    mask is then a cut of the keys, not a mask: no piece builds it."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return None
    rows = mask[:, 0, 0].expand(B, n_k) if mask.shape[0] == 1 else mask[:, 0, 0]
    kept = rows.sum(1)
    first = torch.where(kept > 0, rows.int().argmax(1), torch.zeros_like(kept))
    pos = torch.arange(n_k, device=mask.device)
    run = (pos[None] >= first[:, None]) & (pos[None] < (first + kept)[:, None])
    if not bool((run == rows).all()):
        return None
    return [(int(a), int(a + n)) for a, n in zip(first.tolist(), kept.tolist())]


def _packed_sequences(band: Band, ops: Operands) -> list[Seq]:
    """The packed sequences of ``ops.cu_seqlens_q / _k``, each with ``band`` counted from its
    own end."""
    cq, ck = ops.cu_seqlens_q.tolist(), ops.cu_seqlens_k.tolist()
    return [Seq(0, cq[s], cq[s + 1], ck[s], ck[s + 1],
                Band(band.offset + (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s]), band.left,
                     band.right), s) for s in range(len(cq) - 1)]


class _Plan(NamedTuple):
    blocks: list[tuple[int, int]]  # query blocks in the sequence's positions
    ranges: list[tuple[int, int]]  # key ranges (split-KV), else [(0, Nk)]
    masked: bool  # every piece gets a mask (a user mask)
    # a mask_mod / block mask's pieces per query block (tiles grouped: full runs without a
    # mask, partial runs masked), None where the band alone cuts the blocks
    mask_pieces: list[list[Piece]] | None = None


MASK_BLOCK = 128  # the tiles a mask_mod is classified over (spec.block_m / _n win)


def _mask_plan(seq: Seq, spec: LaunchSpec, H: int) -> _Plan:
    """A call with a mask_mod or a block mask: its tiles (a block mask's own, else the
    mask_mod's over this sequence's rows, every head) combined with the band's; query blocks
    are its rows of tiles, each cut into runs of full tiles (no mask) and of partial ones
    (docs/design.md, "The fused backend", Pieces: classified per batch row)."""
    n_q, n_k = seq.q1 - seq.q0, seq.k1 - seq.k0
    mb = spec.mask_blocks
    if isinstance(mb, Blocks):
        bm, bn = mb.block_m, mb.block_n
        kinds = combine_kinds(mb.kinds(), band_kinds(seq.band, n_q, n_k, bm, bn))
    else:
        bm, bn = spec.block_m or MASK_BLOCK, spec.block_n or MASK_BLOCK
        kinds = band_kinds(seq.band, n_q, n_k, bm, bn)
        if spec.mask_mod is not None:
            visit, full = mask_mod_kinds(_global_mask_mod(spec, seq), 1, H, n_q, n_k, bm, bn)
            grid = torch.where(full.all(1)[0], FULL,
                               torch.where(visit.any(1)[0], PARTIAL, EMPTY)).to(torch.int8)
            kinds = combine_kinds(kinds, grid)
    per_block = []
    for row in kinds.tolist():  # each run of tiles of one kind (not empty) is a piece
        ps: list[Piece] = []
        j = 0
        for kind, run in itertools.groupby(row):
            n = len(list(run))
            if kind != EMPTY:
                ps.append(Piece(j * bn, min((j + n) * bn, n_k), masked=kind != FULL))
            j += n
        per_block.append(ps)
    blocks = [(i * bm, min((i + 1) * bm, n_q)) for i in range(kinds.shape[0])]
    return _Plan(blocks, [(0, n_k)], False, per_block)


def _global_mask_mod(spec: LaunchSpec, seq: Seq) -> Callable:
    """The call's mask_mod seen from one sequence's own positions (batch row 0, its rows
    and keys from 0): it reads the global batch row, heads and positions."""
    mask_mod = spec.mask_mod

    def local(b, h, q_idx, kv_idx):
        return mask_mod(b + seq.b, h + spec.head_start, q_idx + spec.q_start,
                        kv_idx + spec.k_start + seq.k0)
    return local


def plan(seq: Seq, hkv: int, spec: LaunchSpec, ops: Operands, config: FusedConfig = DEFAULT,
         *, backward: bool = False, heads: int | None = None) -> _Plan:
    """How one sequence is cut: its query blocks and (forward, decoding) key ranges."""
    n_q, n_k = seq.q1 - seq.q0, seq.k1 - seq.k0
    if spec.mask_mod is not None or spec.mask_blocks is not None:
        return _mask_plan(seq, spec, hkv if heads is None else heads)
    every = ops.attn_mask is not None
    chunk = None if backward else kv_split(n_q, n_k, config)
    if chunk is not None:
        return _Plan([(0, n_q)], [(n0, min(n0 + chunk, n_k)) for n0 in range(0, n_k, chunk)],
                     every)
    want = max(1, -(-config.items_per_row // hkv))  # query blocks for about items_per_row
    if spec.block_m:
        bm = spec.block_m
    elif every and seq.band.is_full:
        bm = min(config.mask_max_block_m, max(config.mask_min_block_m, -(-n_q // want)))
    elif every or seq.band.left is not None:
        bm = config.masked_block_m
    elif ops.alibi is not None:
        bm = config.alibi_block_m
    else:
        bm = max(config.min_block_m, -(-n_q // want))
    return _Plan([(m0, min(m0 + bm, n_q)) for m0 in range(0, n_q, bm)], [(0, n_k)], every)


def block_pieces(seq: Seq, p: _Plan, m0: int, m1: int, n_lo: int, n_hi: int,
                 config: FusedConfig = DEFAULT, alibi: bool = False) -> list[Piece]:
    """The pieces of query block ``[m0, m1)`` within keys ``[n_lo, n_hi)``, masked ones (or
    all, where everything is masked) cut to at most ``masked_block_n`` keys (a user mask
    without a band: ``mask_block_n``). With ``alibi`` a piece that crosses the block's
    diagonal is cut into its left keys, the square around it (masked) and its right keys
    (:func:`_alibi_terms`; docs/design.md, "The fused backend", Pieces)."""
    out = []
    if alibi and p.mask_pieces is None and not p.masked:
        off = seq.band.offset
        for pc in block_pieces(seq, p, m0, m1, n_lo, n_hi, config):
            if pc.causal:  # the diagonal is not split: its scores would carry terms up to
                # slope x rows where its probabilities are (2e-5 off, float32, 128 rows, slope 1)
                out.append(pc if config.causal_bias else Piece(pc.n0, pc.n1, False, True))
                continue
            if pc.masked or _side(pc, m0, m1, off) != 0:
                out.append(pc)
                continue
            a = max(pc.n0, min(pc.n1, m0 + off + 1))  # keys left of every row's diagonal
            b = min(pc.n1, max(a, m1 - 1 + off))  # keys right of every row's diagonal
            out += [x for x in (Piece(pc.n0, a), Piece(a, b, masked=True), Piece(b, pc.n1))
                    if x.n1 > x.n0]
        return _cut([x for x in out if x.masked], config.masked_block_n) + [
            x for x in out if not x.masked]
    if p.mask_pieces is not None:  # a mask's tiles: its own pieces, already cut
        ps = p.mask_pieces[p.blocks.index((m0, m1))]
        return _cut([pc for pc in ps if pc.masked], config.masked_block_n) + [
            pc for pc in ps if not pc.masked]
    for pc in pieces(seq.band, m0, m1, seq.k1 - seq.k0):
        n0, n1 = max(pc.n0, n_lo), min(pc.n1, n_hi)
        if n0 >= n1:
            continue
        if (n0, n1) != (pc.n0, pc.n1):  # a split-KV range cuts the piece
            causal = pc.causal and n0 == pc.n0
            pc = Piece(n0, n1, causal, pc.masked or (pc.causal and not causal))
        if p.masked:  # a mask is built for every piece: the band joins it
            pc = Piece(pc.n0, pc.n1, False, pc.masked or pc.causal)
        out.append(pc)
    if p.masked and seq.band.is_full:
        return _cut(out, config.mask_block_n)
    return _cut(out, config.masked_block_n) if any(x.masked for x in out) else out


# -- launchers ---------------------------------------------------------------------------------

# what each thread's "fused_alibi" scratch buffer holds: (launch, slopes row, heads, the
# piece's shift, rows, keys, device), so the next piece of the same launch and heads at the
# same place relative to the diagonal (each causal diagonal) reads it without the multiply
_ALIBI_HELD = threading.local()
_LAUNCHES = itertools.count()  # a token per launch, never reused (unlike an id())


def _piece_mask(seq: Seq, mask4: _UserMask | None, slopes: Tensor | None, heads: slice,
                m0: int, m1: int, pc: Piece, dtype: torch.dtype, device: torch.device,
                mask_mod: Callable | None = None, launch: int | None = None
                ) -> tuple[Tensor | None, Tensor | None]:
    """The additive mask of one piece ``(1, G or 1, rows, keys)`` in q's dtype (0 / -inf for
    bool masks and the band, a float mask's values, ALiBi's bias), and what the piece's rows
    see ``(G or 1, rows, keys)`` (bool, or the float mask whose -inf hides a key; None where
    every row sees a key), which :func:`_empty_rows` reads after the op. ``launch``: the caller's
    token from ``_LAUNCHES``, under which an ALiBi bias alone is reused (``_ALIBI_HELD``)."""
    if not pc.masked and mask4 is None and slopes is None:
        return None, None
    rows = torch.arange(m0, m1, device=device)
    cols = torch.arange(pc.n0, pc.n1, device=device)
    keep = None  # the band only where it cuts the piece: elsewhere every pair is inside it
    if pc.masked:
        keep = seq.band.mask(rows, cols)  # (rows, keys), None for a bandless call
        keep = None if keep is None else keep[None, None]
    if mask_mod is not None and pc.masked:  # (1, G or 1, rows, keys) in the call's positions
        hs = torch.arange(heads.start, heads.stop, device=device).view(1, -1, 1, 1)
        mm = mask_mod(torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device), hs,
                      rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1))
        keep = mm if keep is None else keep & mm
    add = seen = None
    may_hide = keep is not None  # whether a row may see no key of the piece
    if mask4 is not None:
        add = _user_piece(mask4.add, seq, heads, m0, m1, pc).to(dtype)
        if mask4.keep is not None:  # what the rows see: the bool mask's piece (and the band)
            seen = _user_piece(mask4.keep, seq, heads, m0, m1, pc)
            seen = seen if keep is None else keep & seen
        may_hide = True
    if slopes is not None:  # ALiBi: -slope_h |j - (i + offset)|, built in the accumulation dtype
        shift = pc.n0 - m0 - seq.band.offset
        dist = _distances(shift, m1 - m0, pc.n1 - pc.n0, device)
        minus = -slopes[seq.slopes_row, heads].to(_acc_dtype(dtype)).view(1, -1, 1, 1)
        if add is None and dtype == torch.float32:  # into the thread's buffer: a fresh
            # block-sized mask per piece costs its page faults each time (workers.scratch)
            add = workers.scratch("fused_alibi", (1, minus.shape[1], *dist.shape), dtype,
                                  device)
            held = (launch, seq.slopes_row, heads.start, heads.stop, shift, *dist.shape,
                    device)
            if launch is None or getattr(_ALIBI_HELD, "key", None) != held:
                _ALIBI_HELD.key = None  # (the buffer is being rewritten)
                torch.mul(dist, minus, out=add)
                _ALIBI_HELD.key = held
        else:
            bias = (dist * minus).to(dtype)
            add = bias if add is None else add + bias
    shape = (1, 1, m1 - m0, pc.n1 - pc.n0)
    if add is None:
        add = torch.zeros(shape, dtype=dtype, device=device)
    if keep is not None:  # (a per-head keep widens the mask to the heads)
        add = torch.where(keep, add, torch.tensor(float("-inf"), dtype=dtype, device=device))
    add = add.expand(*add.shape[:2], *shape[2:])
    if not may_hide:
        return add, None
    seen = add if seen is None else seen  # (a float mask's -inf hides keys too)
    return add, seen.expand(*seen.shape[:2], *shape[2:])[0]  # (G or 1, rows, keys)


def _empty_rows(seen: Tensor | None, lse: Tensor, causal_rows: int | None = None
                ) -> Tensor | None:
    """The rows of an op call that saw no key (bool, ``lse``'s shape), None where there is
    none. ``seen``: what the call's rows see (bool, True: the key is seen; or a float mask,
    -inf: hidden), broadcast dims kept; None: every row sees a key. A row is empty where its
    largest byte is 0 (a uint8 max, not a bool any: docs/benchmarks.md; on the caller's
    thread alone where small, :func:`attn.workers.small_pass`). With ``causal_rows``, the
    rows ``0..causal_rows-1`` of a top-left causal call, row i seeing keys j <= i: a row is
    also empty where its first key (the index torch's max returns, the first of the largest)
    lies past i; no (rows, keys) grid of the band is built. On CPU read only where some lse
    came back 0 or not finite (torch's CPU op gives such a row lse 0: docs/design.md, "The
    fused backend", Pieces)."""
    if seen is None:
        return None
    if lse.device.type == "cpu" and not bool(((lse == 0) | ~lse.isfinite()).any()):
        return None
    seen = seen if seen.dtype == torch.bool else seen > float("-inf")
    seen = seen.expand(*lse.shape, seen.shape[-1])
    with workers.small_pass(seen):
        if causal_rows is None:
            empty = seen.view(torch.uint8).amax(-1) == 0
        else:
            most, first = seen.view(torch.uint8).max(-1)
            empty = (most == 0) | (first > torch.arange(causal_rows, device=seen.device))
    return empty if bool(empty.any()) else None


def _user_piece(t: Tensor, seq: Seq, heads: slice, m0: int, m1: int, pc: Piece) -> Tensor:
    """The piece of a user mask ``t`` (4-d, broadcast dims kept) that query block ``[m0,
    m1)`` of ``seq`` and its ``heads`` read: ``(1, G or 1, rows or 1, keys or 1)``, a view."""
    user = t[seq.b if t.shape[0] > 1 else 0, heads if t.shape[1] > 1 else slice(None)]
    user = user[:, seq.q0 + m0:seq.q0 + m1] if user.shape[1] > 1 else user
    user = user[..., seq.k0 + pc.n0:seq.k0 + pc.n1] if user.shape[2] > 1 else user
    return user[None]


@functools.lru_cache(maxsize=4)
def _distances(shift: int, rows: int, keys: int, device: torch.device) -> Tensor:
    """``|c + shift - r|`` for rows r and keys c of a piece, float32 ``(rows, keys)``: ALiBi's
    distances, the same for every block at the same place relative to the diagonal, so
    built once (read only; outside inference mode, so a call with autograd reads it too).
    Four kept (a call has one or two such shapes), at most 16 MiB at 1024-row blocks."""
    with torch.inference_mode(False):
        return (torch.arange(shift, shift + keys, dtype=torch.float32, device=device)[None, :]
                - torch.arange(rows, dtype=torch.float32, device=device)[:, None]).abs_()


def _side(pc: Piece, m0: int, m1: int, off: int) -> int:
    """+1 when every key of the piece is at or left of every row's diagonal (``j <= i + off``),
    -1 when at or right of it, 0 when the piece crosses it (or is the causal diagonal, which
    it reaches)."""
    if pc.causal:
        return 0
    if pc.n1 - 1 <= m0 + off:
        return 1
    if pc.n0 >= m1 - 1 + off:
        return -1
    return 0


class _AlibiTerms(NamedTuple):
    """ALiBi's bias on one piece split in two terms: ``add``, the term per key, which torch's
    op adds to the scores (``(1, G, 1, keys)`` in q's dtype, one row the op reads for every
    row; on CUDA expanded to the rows), and ``shift``, the per-row constant the softmax
    ignores: ``lse = lse_op - shift``."""
    add: Tensor
    shift: Tensor  # (G, rows), accumulation dtype


def _alibi_terms(qb: Tensor, slopes: Tensor | None, seq: Seq, p: _Plan, mask_mod, m0: int,
                 m1: int, pc: Piece) -> _AlibiTerms | None:
    """ALiBi split into a term per key and a term per row where it splits (else None): a
    piece the band does not cut, no other mask on it, on one side of every row's diagonal
    (:func:`_side`). There ALiBi's ``-s_h |j - (i + off)|`` is ``side·s_h·(j - c) -
    side·s_h·(i + off - c)``. ``c`` is the piece's edge nearest the diagonal, so both terms
    stay as small as the bias itself where the probabilities are. A mask of one row per head
    costs torch's CPU op about what no mask does, and keeps the head dim (docs/benchmarks.md)."""
    side = _side(pc, m0, m1, seq.band.offset)
    if slopes is None or pc.masked or p.masked or mask_mod is not None or side == 0:
        return None
    G, rows, n = qb.shape[1], m1 - m0, pc.n1 - pc.n0
    c = pc.n1 if side > 0 else pc.n0
    acc = _acc_dtype(qb.dtype)  # float64 keeps float64's terms exact to its own rounding
    s = slopes[seq.slopes_row].to(acc)  # (G,)
    j = torch.arange(pc.n0 - c, pc.n1 - c, dtype=acc, device=qb.device)
    add = (side * s[:, None] * j[None, :]).to(qb.dtype).view(1, G, 1, n)
    if qb.device.type != "cpu":  # torch's CUDA ops are given whole masks, as other pieces'
        add = add.expand(1, G, rows, n).contiguous()
    i = torch.arange(m0 + seq.band.offset - c, m1 + seq.band.offset - c, dtype=acc,
                     device=qb.device)
    return _AlibiTerms(add, side * s[:, None] * i[None, :])


class _UserMask(NamedTuple):
    """A call's user mask, 4-d with its broadcast dims: ``add``, what torch's op adds to the
    scores (a float mask as given; a bool mask's 0 / -inf in q's dtype, built once per call
    rather than once per piece and head group, by :func:`_added`; None until then), and
    ``keep``, the bool mask (None for a float one), which tells the rows that see no key of a
    piece at a byte a score."""
    add: Tensor | None
    keep: Tensor | None


def _sequences_and_mask(q: Tensor, k: Tensor, spec: LaunchSpec, ops: Operands
                        ) -> tuple[list[Seq], _UserMask | None, Operands]:
    """The call's sequences: each batch row, or each packed sequence (its band counted from
    its own end, as attn.varlen's convention says); its mask (None where there is none, or
    where it is key padding, :func:`key_spans`: each row's keys are then cut to its run),
    and the operands to match."""
    mask4 = None if ops.attn_mask is None else as_4d(ops.attn_mask)
    if ops.cu_seqlens_q is not None:
        seqs = _packed_sequences(spec.band, ops)
    else:
        band, n_q = spec.local_band(), q.shape[2]
        spans = key_spans(mask4, q.shape[0], k.shape[2])
        if spans is not None:  # keys from a: positions (the band's, ALiBi's) shift by a
            return [Seq(b, 0, n_q, a, z, Band(band.offset - a, band.left, band.right), b)
                    for b, (a, z) in enumerate(spans)], None, ops._replace(attn_mask=None)
        seqs = [Seq(b, 0, n_q, 0, k.shape[2], band, b) for b in range(q.shape[0])]
    if mask4 is not None:  # a bool mask's 0 / -inf: _added, once the path is known
        mask4 = _UserMask(None, mask4) if mask4.dtype == torch.bool else _UserMask(mask4, None)
    return seqs, mask4, ops


# a float's -inf as the signed integer of its width is -c: a bool mask's 0 / -inf is
# (keep - 1) * c in those integers, read back as the float: integer passes, several times
# faster than torch.where of two scalars into the float (docs/benchmarks.md)
_INF_BITS = {torch.bfloat16: (torch.int16, 1 << 7), torch.float16: (torch.int16, 1 << 10),
             torch.float32: (torch.int32, 1 << 23), torch.float64: (torch.int64, 1 << 52)}


def _added(mask4: _UserMask | None, dtype: torch.dtype) -> _UserMask | None:
    """``mask4`` with a bool mask's additive form (0 / -inf in ``dtype``) built: once per
    call, on the caller's thread alone where small (:func:`attn.workers.small_pass`) or
    where the items follow (:func:`_caller`)."""
    if mask4 is None or mask4.add is not None:
        return mask4
    keep = mask4.keep
    if dtype not in _INF_BITS:
        return mask4._replace(add=torch.where(
            keep, torch.zeros((), dtype=dtype, device=keep.device),
            torch.full((), float("-inf"), dtype=dtype, device=keep.device)))
    ints, c = _INF_BITS[dtype]
    add = torch.empty(keep.shape, dtype=dtype, device=keep.device)
    with workers.small_pass(keep):  # (three passes: each on torch's threads would wait
        add.view(ints).copy_(keep).sub_(1).mul_(c)  # for a busy core's)
    return mask4._replace(add=add)


# on CUDA a call runs its items in order on one stream, so it is cut only where the band or a
# mask needs it: one query block per sequence, masks of up to 1024 x 4096
CUDA = FusedConfig(items_per_row=1, min_block_m=1 << 30, masked_block_m=1024,
                   masked_block_n=4096, mask_max_block_m=1024, mask_block_n=4096,
                   bwd_max_runs=1, serial_max_scores=0, item_max_scores=0,
                   causal_bias=False, whole_call=False, fold_gqa=False)


def _config(q: Tensor, config: FusedConfig) -> FusedConfig:
    """The cut a call takes: on CUDA the default becomes :data:`CUDA`."""
    return CUDA if q.device.type == "cuda" and config == DEFAULT else config


def _rows_packed(x: Tensor, rows: int, config: FusedConfig) -> Tensor:
    """Keys (or values) ``(B, heads, n, D)`` for ``rows`` query rows with each key's row right
    after the previous one: x itself where they are or where the rows are at most
    ``config.split_max_q``, else a copy (why: docs/kvcache.md, "CPU, fused";
    docs/benchmarks.md)."""
    if x.shape[2] < 2 or x.stride(2) == x.shape[3] or rows <= config.split_max_q:
        return x
    return x.contiguous()


# one op call over the whole batch (:func:`_whole_call`): the dtypes whose bits torch's CPU
# kernel computes per (batch row, head) whatever the batch or threads, and the query rows
# from which its threads' scratch buffers leave the bits alone (below: the caller's thread
# only). Why: docs/design.md, "The fused backend", Items.
_WHOLE_CALL_DTYPES = (torch.float32, torch.float64)
_WHOLE_CALL_MIN_ROWS = 32


def _whole_call(q: Tensor, k: Tensor, seqs: list[Seq], plans: list[_Plan], hgs: list[int],
                mask4: _UserMask | None, ops: Operands, mask_mods: list,
                config: FusedConfig) -> Piece | None:
    """The one piece a CPU call is, where its forward or backward (``plans`` and ``hgs``
    its own) can be one op call over the whole batch, else None (which calls, and why each
    condition: docs/design.md, "The fused backend", Items)."""
    if (q.device.type != "cpu" or not config.whole_call or q.dtype not in _WHOLE_CALL_DTYPES
            or not seqs or ops.alibi is not None or any(m is not None for m in mask_mods)):
        return None
    n_q, n_k, band = seqs[0].q1, seqs[0].k1, seqs[0].band
    hkv = k.shape[1]
    if (n_q, seqs[0].k0, n_k) != (q.shape[2], 0, k.shape[2]):  # a key-padding cut: items
        return None
    if n_q < _WHOLE_CALL_MIN_ROWS and (
            n_q * n_k * q.shape[0] * q.shape[1] > config.serial_call_max_scores
            or not workers.openmp_threads() or torch.compiler.is_compiling()):
        return None
    for s, p, hg in zip(seqs, plans, hgs):
        if ((s.q0, s.q1, s.k0, s.k1, s.band) != (0, n_q, 0, n_k, band) or len(p.ranges) != 1
                or p.mask_pieces is not None
                or (mask4 is None and (len(p.blocks) != 1 or hg != hkv))):
            return None
    return _one_piece(band, n_q, n_k)


def _cut_call(q: Tensor, k: Tensor, spec: LaunchSpec, ops: Operands, config: FusedConfig,
              *, check: bool, backward: bool) -> tuple:
    """How :func:`_fwd` and :func:`_bwd` cut a call, once per call: ``(seqs, apart, mask4,
    ops, plans, mask_mods, hgs, whole, threads)``, :func:`_sequences_and_mask`'s split by
    :func:`_poisoned` (``check``), each sequence's plan, mask_mod in its own positions (or
    None) and kv heads per item, :func:`_whole_call`'s piece, and the worker pool's threads
    for the items (:func:`attn.workers.item_threads`; the pool's counted now, before the
    caller's own work drops to one thread, :func:`_caller`). Without a mask_mod or block
    mask a plan is made once per distinct length and band, not once per batch row."""
    seqs, mask4, ops = _sequences_and_mask(q, k, spec, ops)
    seqs, apart = _poisoned(q, k, seqs, spec, ops, config, check)
    H, Hkv = q.shape[1], k.shape[1]
    per_row = spec.mask_mod is not None or spec.mask_blocks is not None
    made: dict = {}
    plans, hgs = [], []
    for s in seqs:
        key = s if per_row else (s.q1 - s.q0, s.k1 - s.k0, s.band)
        if key not in made:
            p = plan(s, Hkv, spec, ops, config, backward=backward, heads=H)
            made[key] = p, head_group(s, p, Hkv, H // Hkv, config, fold=not backward)
        plans.append(made[key][0])
        hgs.append(made[key][1])
    mask_mods = [None if spec.mask_mod is None else _global_mask_mod(spec, s) for s in seqs]
    whole = _whole_call(q, k, seqs, plans, hgs, mask4, ops, mask_mods, config)
    scores = sum((s.q1 - s.q0) * (s.k1 - s.k0) for s in seqs) * H
    threads = workers.item_threads(q, scores, config)
    threads = workers.workers_for_call() if threads is None else threads
    return seqs, apart, mask4, ops, plans, mask_mods, hgs, whole, threads


def _poisoned(q: Tensor, k: Tensor, seqs: list[Seq], spec: LaunchSpec, ops: Operands,
              config: FusedConfig, check: bool) -> tuple[list[Seq], list[Seq]]:
    """``seqs`` as (those torch's op computes, those it cannot: on CPU, where some piece is
    masked, :func:`masks_scores`, a sequence whose keys are not all finite), where
    ``check``; else (seqs, []) (docs/design.md, "The fused backend", Masked keys)."""
    if (not check or q.device.type != "cpu" or torch.compiler.is_compiling()
            or not masks_scores(spec, ops, q.shape[2], k.shape[2], config)):
        return seqs, []
    with workers.small_pass(k):
        if all_finite(k):
            return seqs, []
        bad = [s.k1 > s.k0 and s.q1 > s.q0 and not all_finite(k[s.b, :, s.k0:s.k1])
               for s in seqs]
    return [s for s, x in zip(seqs, bad) if not x], [s for s, x in zip(seqs, bad) if x]


def _rows_of(x: Tensor | None, rows: list[int] | None) -> Tensor | None:
    """Batch rows ``rows`` of ``x`` (a copy), x itself where it broadcasts over the batch or
    ``rows`` is None."""
    return x if x is None or rows is None or x.shape[0] == 1 else x[rows]


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands = Operands(), *,
         config: FusedConfig = DEFAULT, fallback: Callable | None = None
         ) -> tuple[Tensor, Tensor]:
    """``(out (B, H, Nq, Dv) in q's dtype, lse (B, H, Nq) in the accumulation dtype)``, by
    items or one op call (docs/design.md, "The fused backend", Items, Decoding).
    ``fallback``: :func:`fused_attention`'s (without it the sequences :func:`_poisoned`
    finds take the NaN). Long on purpose: ``run``, the items' body, shares the call's
    buffers and plans as a closure, which the worker pool calls by index."""
    config = _config(q, config)
    kern = kernels(q)
    B, H, Nq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    seqs, apart, mask4, ops, plans, mask_mods, hgs, whole, threads = _cut_call(
        q, k, spec, ops, config, check=fallback is not None, backward=False)
    if whole is not None:  # one op call over the rows it computes
        rows = [s.b for s in seqs] if apart else None
        out, lse = _whole_fwd(kern, q, k, v, rows, _added(mask4, q.dtype), whole, spec, config)
        if apart:
            o, l_ = out, lse
            out = torch.zeros(B, H, Nq, Dv, dtype=q.dtype, device=q.device)
            lse = torch.full((B, H, Nq), float("-inf"), dtype=acc, device=q.device)
            out[rows], lse[rows] = o, l_
            _apart_fwd(fallback, apart, q, k, v, spec, ops, out, lse)
        return _sinks_joined(out, lse, None, None, ops.sinks)
    R = max((len(p.ranges) for p in plans), default=1)
    with _caller(threads):
        mask4 = _added(mask4, q.dtype)
        out = torch.zeros(B, H, Nq, Dv, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, Nq), float("-inf"), dtype=acc, device=q.device)
        parts_out = parts_lse = None
        if R > 1:  # key ranges' partials, merged after the items (-inf: a range a row lacks)
            parts_out = torch.zeros(R, B, H, Nq, Dv, dtype=q.dtype, device=q.device)
            parts_lse = torch.full((R, B, H, Nq), float("-inf"), dtype=acc, device=q.device)
    # a head group's items one after another (its keys stay in cache, an ALiBi bias is
    # reused), the largest blocks (causal: the last) first, so the call's end waits on a
    # small one
    items = [(si, hk, bi, r) for si, p in enumerate(plans) for hk in range(0, Hkv, hgs[si])
             for bi in reversed(range(len(p.blocks))) for r in range(len(p.ranges))]
    launch = next(_LAUNCHES)

    def run(i: int) -> None:
        si, hk, bi, r = items[i]
        s, p = seqs[si], plans[si]
        m0, m1 = p.blocks[bi]
        kvh = slice(hk, hk + hgs[si])  # the item's kv heads, and their query heads
        heads = slice(hk * G, kvh.stop * G)
        qb = q[s.b:s.b + 1, heads, s.q0 + m0:s.q0 + m1]  # (1, heads, rows, D)
        fold = folds(m1 - m0, G, config)
        outs, lses = [], []
        slopes = None if ops.alibi is None else ops.alibi[:, heads]
        for pc in block_pieces(s, p, m0, m1, *p.ranges[r], config=config,
                               alibi=slopes is not None):
            kb, vb = (_rows_packed(t[s.b:s.b + 1, kvh, s.k0 + pc.n0:s.k0 + pc.n1], m1 - m0,
                                   config) for t in (k, v))
            terms = _alibi_terms(qb, slopes, s, p, mask_mods[si], m0, m1, pc)
            add, seen = (terms.add, None) if terms is not None else _piece_mask(
                s, mask4, ops.alibi, heads, m0, m1, pc, q.dtype, q.device, mask_mods[si],
                launch)
            if fold and add is None and not pc.causal:
                # each kv head's G query heads as G x rows query rows (folds)
                o, l_ = kern(False).fwd(qb.reshape(1, kvh.stop - hk, -1, qb.shape[-1]), kb,
                                        vb, False, None, spec.qk_scale)
                o, l_ = o.reshape(qb.shape[:3] + o.shape[-1:]), l_.reshape(qb.shape[:3])
            else:
                o, l_ = kern(add is not None).fwd(qb, kb, vb, pc.causal, add, spec.qk_scale)
            o, l_ = o[0, ..., :Dv], l_[0]
            empty = _empty_rows(seen, l_)  # (the op's own lse)
            if terms is not None:
                l_ = l_ - terms.shift
            if empty is not None:  # a row that saw no key: torch's CPU op gives out 0 and
                # lse 0, its CUDA ops may give NaN out: zeros and -inf, whatever ran
                l_ = l_.masked_fill(empty.expand_as(l_), float("-inf"))
                o = o.masked_fill(empty.unsqueeze(-1), 0.0)
            outs.append(o)
            lses.append(l_)
        if not outs:  # the band leaves the block no key: zeros and -inf, as allocated
            return
        o, l_ = (outs[0], lses[0]) if len(outs) == 1 else _merge_trusted(outs, lses)
        o_to, l_to = (out, lse) if parts_out is None else (parts_out[r], parts_lse[r])
        o_to[s.b, heads, s.q0 + m0:s.q0 + m1] = o
        l_to[s.b, heads, s.q0 + m0:s.q0 + m1] = l_

    workers.run_items(run, len(items), threads=threads, flush_denormals=True)
    _apart_fwd(fallback, apart, q, k, v, spec, ops, out if parts_out is None else parts_out[0],
               lse if parts_out is None else parts_lse[0])
    with _caller(threads):
        return _sinks_joined(out, lse, parts_out, parts_lse, ops.sinks)


def _whole_fwd(kern, q: Tensor, k: Tensor, v: Tensor, rows: list[int] | None,
               mask4: _UserMask | None, whole: Piece, spec: LaunchSpec, config: FusedConfig
               ) -> tuple[Tensor, Tensor]:
    """:func:`_fwd`'s one op call over batch rows ``rows`` (None: all), before the sinks:
    out in q's dtype, lse in the accumulation dtype; rows the mask (and band) hide whole
    get out 0 and lse -inf."""
    Nq = q.shape[2]
    kw, vw = (_rows_packed(_rows_of(t, rows), Nq, config) for t in (k, v))
    add = None if mask4 is None else _rows_of(mask4.add, rows).to(q.dtype)
    # on torch's threads from _WHOLE_CALL_MIN_ROWS query rows, below on the caller's alone
    with workers.single_thread() if Nq < _WHOLE_CALL_MIN_ROWS else contextlib.nullcontext():
        out, lse = kern(add is not None).fwd(_rows_of(q, rows), kw, vw, whole.causal, add,
                                             spec.qk_scale)
    lse = lse.to(_acc_dtype(q.dtype))
    if mask4 is not None:
        seen = _rows_of(mask4.add if mask4.keep is None else mask4.keep, rows)
        empty = _empty_rows(seen, lse, Nq if whole.causal else None)
        if empty is not None:
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def _apart_fwd(fallback: Callable | None, apart: list[Seq], q: Tensor, k: Tensor, v: Tensor,
               spec: LaunchSpec, ops: Operands, out: Tensor, lse: Tensor) -> None:
    """Each sequence of ``apart`` as a call of its own (:func:`_own_call`) on ``fallback``,
    without the sinks (the call joins them after), into ``out`` and ``lse``."""
    for s in apart:
        (b, rows, keys), sspec, sops = _own_call(s, spec, ops, sinks=False)
        o, l_ = fallback(q[b, :, rows], k[b, :, keys], v[b, :, keys], sspec, sops)
        out[b, :, rows], lse[b, :, rows] = o, l_


def _sinks_joined(out: Tensor, lse: Tensor, parts_out: Tensor | None,
                  parts_lse: Tensor | None, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """``out, lse`` with the key ranges' partials (split-KV) merged in range order and the
    sinks as one more partial of value 0, in the denominator once."""
    if parts_out is None and sinks is None:
        return out, lse
    B, H, Nq = lse.shape
    outs = [out] if parts_out is None else list(parts_out.unbind(0))
    lses = [lse] if parts_out is None else list(parts_lse.unbind(0))
    if sinks is not None:
        outs.append(torch.zeros_like(outs[0]))
        lses.append(sinks.to(lse.dtype).view(1, H, 1).expand(B, H, Nq))
    merged, lse = _merge_trusted(outs, lses)
    out.copy_(merged)
    return out, lse


def _caller(threads: int | None) -> contextlib.AbstractContextManager:
    """The caller's own work around a call's items (the fills, the merges) on its thread
    alone unless :func:`_cut_call`'s ``threads`` is 0, so the call's one parallel region is
    its items' (as tiled's; why: docs/design.md, "The fused backend", Items)."""
    return workers.single_thread() if threads != 0 else contextlib.nullcontext()


def head_group(seq: Seq, p: _Plan, hkv: int, G: int, config: FusedConfig = DEFAULT,
               *, fold: bool = False) -> int:
    """How many kv heads (and their G query heads each) one item of ``seq`` takes: the most
    that divide ``hkv`` with an item's scores within ``config.item_max_scores``, at least 1,
    keeping ``config.items_per_row`` items for a forward that ``fold``s (:func:`folds`) with
    at least ``config.serial_max_scores`` scores (docs/design.md, "The fused backend", Items,
    Decoding). A sequence without query rows: all its kv heads."""
    if not p.blocks:
        return hkv
    n_q, n_k, parts = seq.q1 - seq.q0, seq.k1 - seq.k0, len(p.blocks) * len(p.ranges)
    per_head = n_q * n_k // parts
    fits = [d for d in range(1, hkv + 1)
            if hkv % d == 0 and d * G * per_head <= config.item_max_scores]
    if fold and folds(n_q, G, config) and n_q * n_k * hkv * G >= config.serial_max_scores:
        want = min(config.items_per_row, hkv * parts)
        fits = [d for d in fits if hkv // d * parts >= want]
    return max(fits, default=1)


def bwd_runs(n_blocks: int, groups: int, config: FusedConfig = DEFAULT
             ) -> list[tuple[int, int]]:
    """A sequence's query blocks cut into runs for the backward (each run its own item with
    dK/dV partials): about ``items_per_row`` items over its ``groups`` of kv heads, at most
    ``bwd_max_runs``; shapes and heads alone decide."""
    n = max(1, min(-(-config.items_per_row // groups), config.bwd_max_runs, n_blocks))
    cuts = [round(i * n_blocks / n) for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


# |lse| from which torch's backward op, rebuilding P = exp(s - lse) from one rounded lse, loses
# more than the error budget allows (P's relative error is about |lse| · 2^-24 in float32;
# docs/design.md, "Backward"): such calls recompute through ``precise``
LSE_PRECISE_LIMIT = {torch.float32: 64.0, torch.float16: 4096.0, torch.bfloat16: 4096.0}


def lse_too_large(lse: Tensor, dtype: torch.dtype) -> bool:
    """Whether any finite |lse| passes :data:`LSE_PRECISE_LIMIT` for ``dtype`` (one host
    read; never for float64)."""
    limit = LSE_PRECISE_LIMIT.get(dtype)
    if limit is None or lse.numel() == 0:
        return False
    with workers.small_pass(lse):
        return bool((lse.abs() > limit).logical_and_(torch.isfinite(lse)).any())


def _own_call(s: Seq, spec: LaunchSpec, ops: Operands, *, sinks: bool = True
              ) -> tuple[tuple[slice, slice, slice], LaunchSpec, Operands]:
    """Sequence ``s`` as a dense call of its own: ``(batch row, query rows, keys)`` to slice
    the call's tensors with, its spec (its band in its own positions, a mask_mod that reads
    the call's global batch row, heads and positions; the whole call's block mask only
    where there is no mask_mod: its tiles then cover the sequence's) and its operands (its
    rows of the mask and the ALiBi slopes; the sinks unless ``sinks`` is False)."""
    b = slice(s.b, s.b + 1)
    mask = alibi = None
    if ops.attn_mask is not None:
        m4 = as_4d(ops.attn_mask)
        mask = m4[b] if m4.shape[0] > 1 else m4
    if ops.alibi is not None:
        alibi = ops.alibi[s.slopes_row:s.slopes_row + 1] if ops.alibi.shape[0] > 1 else ops.alibi
    mod = None if spec.mask_mod is None else _global_mask_mod(spec, s)
    own = dataclasses.replace(spec, band=s.band, q_start=0, k_start=0, head_start=0,
                              mask_mod=mod, mask_blocks=None if mod else spec.mask_blocks,
                              max_seqlen_q=None, max_seqlen_k=None)
    return ((b, slice(s.q0, s.q1), slice(s.k0, s.k1)), own,
            Operands(attn_mask=mask, sinks=ops.sinks if sinks else None, alibi=alibi))


def _precise_into(precise: Callable, seqs: list[Seq], do, dlse, q, k, v, spec: LaunchSpec,
                  ops: Operands, dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor | None:
    """The backward through ``precise(do, dlse, q, k, v, spec, ops) -> Grads`` (the caller's
    dense backward, which recomputes its forward) of each of ``seqs`` as a call of its own
    (:func:`_own_call`), into ``dq``, ``dk``, ``dv``; returns the sinks' gradient summed
    over them."""
    dsinks = None
    for s in seqs:
        if s.q1 == s.q0:
            continue
        (b, rows, keys), sspec, sops = _own_call(s, spec, ops)
        g = precise(do[b, :, rows], None if dlse is None else dlse[b, :, rows], q[b, :, rows],
                    k[b, :, keys], v[b, :, keys], sspec, sops)
        dq[b, :, rows] = g.dq
        dk[b, :, keys] += g.dk
        dv[b, :, keys] += g.dv
        if g.dsinks is not None:
            dsinks = g.dsinks if dsinks is None else dsinks + g.dsinks
    return dsinks


def _dlse_columns(q: Tensor, k: Tensor, v: Tensor, out: Tensor, do: Tensor, pad: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, k, v, out, dO)`` with the two more head-dim columns that turn the op's ``Δ =
    rowsum(dO ∘ O)`` into ``Δ - dlse``: zeros in q, k, v, ``pad`` (``-dlse`` in a high and
    a low part of q's dtype) in out, ones in dO."""
    q, k, v = (torch.nn.functional.pad(t, (0, 2)) for t in (q, k, v))
    return q, k, v, torch.cat([out, pad], -1), torch.nn.functional.pad(do, (0, 2), value=1.0)


def _whole_bwd_parts(B: int, Hkv: int, scores: int, config: FusedConfig
                     ) -> list[tuple[int, int, int, int]]:
    """How :func:`_whole_bwd` cuts a backward of ``B`` batch rows and ``Hkv`` kv heads,
    ``scores`` per row and kv head: ``(b0, b1, g0, g1)`` per op call, about one per
    ``config.whole_bwd_part_scores`` scores, at most ``config.whole_bwd_parts``; by batch rows,
    or where there are fewer rows than calls each row by kv heads (a divisor of ``Hkv``).
    A function of the shapes alone: each (row, head) is computed by one call on one thread
    whatever the cut, so the cut changes no bits (docs/design.md, "The fused backend")."""
    n = max(1, min(config.whole_bwd_parts, B * Hkv * scores // config.whole_bwd_part_scores))
    if n <= B:
        r = -(-B // n)
        return [(b, min(b + r, B), 0, Hkv) for b in range(0, B, r)]
    cuts = max(c for c in range(1, Hkv + 1) if Hkv % c == 0 and c <= -(-n // B))
    w = Hkv // cuts
    return [(b, b + 1, g, g + w) for b in range(B) for g in range(0, Hkv, w)]


def _whole_bwd(kern, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse_in: Tensor,
               pad: Tensor | None, rows: list[int] | None, mask4: _UserMask | None,
               whole: Piece, spec: LaunchSpec, config: FusedConfig, threads: int | None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_bwd`'s op calls over batch rows ``rows`` (None: all): their dq, dk, dv in
    the accumulation dtype (``pad``: the dlse columns, :func:`_dlse_columns`). The calls
    (:func:`_whole_bwd_parts`) run as items, one intra-op thread each (why: docs/design.md,
    "The fused backend", Items)."""
    D, Dv, acc = q.shape[-1], v.shape[-1], _acc_dtype(q.dtype)
    qw, kw, vw, ow, dow = (_rows_of(t, rows) for t in (q, k, v, out, do))
    if pad is not None:
        qw, kw, vw, ow, dow = _dlse_columns(qw, kw, vw, ow, dow, _rows_of(pad, rows))
    add = None if mask4 is None else _rows_of(mask4.add, rows).to(q.dtype)
    lw = _rows_of(lse_in, rows)
    B, Hkv = kw.shape[:2]
    G = qw.shape[1] // Hkv
    parts = _whole_bwd_parts(B, Hkv, qw.shape[2] * kw.shape[2] * G, config)
    pair = kern(add is not None)
    grads = ()

    def run(i: int) -> None:
        b0, b1, g0, g1 = parts[i]
        hq, hk = slice(g0 * G, g1 * G), slice(g0, g1)
        m = add
        if m is not None:
            m = m[b0:b1] if m.shape[0] > 1 else m
            m = m[:, hq] if m.shape[1] > 1 else m
        got = pair.bwd(dow[b0:b1, hq], qw[b0:b1, hq], kw[b0:b1, hk], vw[b0:b1, hk],
                       ow[b0:b1, hq], lw[b0:b1, hq], whole.causal, m, spec.qk_scale)
        for g, h, t in zip(grads, (hq, hk, hk), got):
            g[b0:b1, h] = t

    if len(parts) == 1:  # on the caller's thread alone, into no copy
        with _caller(threads):
            grads = pair.bwd(dow, qw, kw, vw, ow, lw, whole.causal, add, spec.qk_scale)
    else:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device)
                      for t in (qw, kw, vw))
        workers.run_items(run, len(parts), threads=threads)
    gq, gk, gv = grads
    return gq[..., :D].to(acc), gk[..., :D].to(acc), gv[..., :Dv].to(acc)


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, ops: Operands = Operands(), *,
         config: FusedConfig = DEFAULT, precise: Callable | None = None,
         apart: bool = False) -> Grads:
    """Gradients of a fused forward from its merged ``out`` and ``lse``: dq, dk, dv in the
    accumulation dtype, and the sinks' (items, runs and the dlse columns: docs/design.md,
    "The fused backend", Backward). ``precise``: :func:`fused_attention`'s; ``apart``: the
    forward ran the sequences :func:`_poisoned` finds on its fallback, so theirs come from
    ``precise``. Long for the forward's reason: ``run`` is a closure."""
    config = _config(q, config)
    kern = kernels(q)
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    if precise is not None and lse_too_large(lse, q.dtype):  # every sequence on precise
        seqs, _, ops = _sequences_and_mask(q, k, spec, ops)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
        dsinks = _precise_into(precise, seqs, do, dlse, q, k, v, spec, ops, dq, dk, dv)
        return Grads(dq, dk, dv, None, dsinks, None, ())
    seqs, poisoned, mask4, ops, plans, mask_mods, hgs, whole, threads = _cut_call(
        q, k, spec, ops, config, check=apart, backward=True)
    # (before items, the caller's passes on its thread alone, as the forward's)
    with _caller(threads):
        # rows with no key: lse -inf would give exp(s + inf); +inf gives P = 0 there
        lse_in = lse.masked_fill(lse == float("-inf"), float("inf"))
        do = do.to(q.dtype)
        pad = None
        if dlse is not None and bool((dlse != 0).any()):
            minus = -dlse.to(acc)
            hi = minus.to(q.dtype)
            pad = torch.stack([hi, (minus - hi.to(acc)).to(q.dtype)], -1)  # (B, H, Nq, 2)
    if whole is not None:  # a few op calls (_whole_bwd_parts) over the rows it computes
        rows = [s.b for s in seqs] if poisoned else None
        gq, gk, gv = _whole_bwd(kern, do, q, k, v, out, lse_in, pad, rows,
                                _added(mask4, q.dtype), whole, spec, config, threads)
        if poisoned:
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
            dq[rows], dk[rows], dv[rows] = gq, gk, gv
            _precise_into(precise, poisoned, do, dlse, q, k, v, spec, ops, dq, dk, dv)
            gq, gk, gv = dq, dk, dv
        dsinks = call_sink_grad(ops.sinks, do, dlse, out, lse, acc)
        return Grads(gq, gk, gv, None, dsinks, None, ())
    runs = [bwd_runs(len(p.blocks), Hkv // hg, config) for p, hg in zip(plans, hgs)]
    with _caller(threads):  # as the forward's
        mask4 = _added(mask4, q.dtype)
    # zeroed on the pool: a fresh buffer's first touch (page faults) on the caller alone was
    # most of the backward's setup (docs/benchmarks.md)
    dq, dk, dv = (torch.empty(*shape, dtype=acc, device=q.device)
                  for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv)))
    workers.fill_passes([(dq, None), (dk, None), (dv, None)], threads=threads)
    items = [(si, hk, r) for si in range(len(seqs)) for r in range(len(runs[si]))
             for hk in range(0, Hkv, hgs[si])]
    extra: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}

    def run(i: int) -> None:
        si, hk, r = items[i]
        s, p = seqs[si], plans[si]
        kvh = slice(hk, hk + hgs[si])  # the item's kv heads, and their query heads
        heads = slice(hk * G, kvh.stop * G)
        keys = slice(s.k0, s.k1)
        if r == 0:
            dk_to, dv_to = dk[s.b, kvh, keys], dv[s.b, kvh, keys]
        else:  # a later run's partial, joined in run order below
            dk_to, dv_to = (torch.zeros(hgs[si], s.k1 - s.k0, d, dtype=acc, device=q.device)
                            for d in (D, Dv))
            extra[si, hk, r] = (dk_to, dv_to)
        b0, b1 = runs[si][r]
        slopes = None if ops.alibi is None else ops.alibi[:, heads]
        for m0, m1 in p.blocks[b0:b1]:
            rows = slice(s.q0 + m0, s.q0 + m1)
            qb0, dob0, ob0 = (t[s.b:s.b + 1, heads, rows] for t in (q, do, out))
            lb0 = lse_in[s.b:s.b + 1, heads, rows]
            padb = None if pad is None else pad[s.b:s.b + 1, heads, rows]
            dq_blk = dq[s.b, heads, rows]
            for pc in block_pieces(s, p, m0, m1, 0, s.k1 - s.k0, config=config,
                                   alibi=slopes is not None):
                kb, vb = (t[s.b:s.b + 1, kvh, s.k0 + pc.n0:s.k0 + pc.n1] for t in (k, v))
                terms = _alibi_terms(qb0, slopes, s, p, mask_mods[si], m0, m1, pc)
                if terms is not None:  # (+inf rows stay +inf)
                    add, lb = terms.add, lb0 + terms.shift.to(lb0.dtype)
                else:
                    add, _ = _piece_mask(s, mask4, ops.alibi, heads, m0, m1, pc, q.dtype,
                                         q.device, mask_mods[si])
                    lb = lb0
                qb, ob, dob = qb0, ob0, dob0
                if padb is not None:  # the dlse columns: the op's head dim grows by 2
                    qb, kb, vb, ob, dob = _dlse_columns(qb, kb, vb, ob, dob, padb)
                gq, gk, gv = kern(add is not None).bwd(dob, qb, kb, vb, ob, lb, pc.causal, add,
                                                       spec.qk_scale)
                dq_blk += gq[0, ..., :D]
                dk_to[:, pc.n0:pc.n1] += gk[0, :, :, :D]
                dv_to[:, pc.n0:pc.n1] += gv[0, :, :, :Dv]

    workers.run_items(run, len(items), threads=threads, flush_denormals=True)
    with _caller(threads):
        for si, hk, r in sorted(extra):  # runs' partials in run order: fixed, whatever finished
            s, kvh = seqs[si], slice(hk, hk + hgs[si])
            dk[s.b, kvh, s.k0:s.k1] += extra[si, hk, r][0]
            dv[s.b, kvh, s.k0:s.k1] += extra[si, hk, r][1]
        dsinks = call_sink_grad(ops.sinks, do, dlse, out, lse, acc)
    # the sequences the forward ran on its fallback (their sinks' part is in dsinks)
    _precise_into(precise, poisoned, do, dlse, q, k, v, spec, ops, dq, dk, dv)
    return Grads(dq, dk, dv, None, dsinks, None, ())


# -- paged caches ------------------------------------------------------------------------------

def page_span(storage: Tensor, row: Tensor, a: int, z: int) -> tuple[Tensor, bool]:
    """Slots ``[a, z)`` of a sequence whose pages are ``row`` (its block-table row, host
    int64), from page storage ``(num_blocks, page, Hkv, D)``, as ``(1, Hkv, z - a, D)``, and
    whether that is a view: one span of consecutive page ids is a strided view of the storage
    (torch's CPU op reads it through its strides, no copy); else those pages only are copied,
    in table order."""
    page = storage.shape[1]
    p0, p1 = a // page, -(-z // page)
    ids = row[p0:p1]
    first = int(ids[0])
    view = bool((ids == torch.arange(first, first + p1 - p0)).all())
    pages = storage[first:first + p1 - p0] if view else storage[ids.to(storage.device)]
    # (pages, page, Hkv, D) -> (pages·page, Hkv, D) -> (1, Hkv, n, D): views
    keys = pages.flatten(0, 1)[a - p0 * page:z - p0 * page]
    return keys.transpose(0, 1).unsqueeze(0), view


def _paged_row(q: Tensor, k_pages: Tensor, v_pages: Tensor, spec: LaunchSpec, ops: Operands,
               b: int, config: FusedConfig, check: bool) -> tuple[Tensor, Tensor] | None:
    """Row b of :func:`paged_attention` for its q ``(1, H, Nq, D)``: its ranges and the sinks
    merged, out ``(1, H, Nq, D)`` in q's dtype, lse in the accumulation dtype; None where
    ``check`` finds a key it reads not finite."""
    table, starts, lengths = ops.pages
    _, H, Nq, _ = q.shape
    acc = _acc_dtype(q.dtype)
    band = spec.band
    inner = dataclasses.replace(config, split_min_keys=1 << 62)  # the ranges are the split
    s, e = int(starts[b]), int(lengths[b])
    chunk = kv_split(Nq, e - s, config) or config.split_min_chunk
    row_spec = dataclasses.replace(spec, band=Band(band.offset + e - s, band.left, band.right))
    outs, lses = [], []
    for a, z in page_ranges(s, e, 1, chunk):  # at chunk's multiples: page_span crosses pages
        # the range's band: row b's band with N_b keys, from the range's first key on
        local = Band(band.offset + e - a, band.left, band.right)
        lo, hi = local.key_range(0, Nq, z - a)
        if lo >= hi:  # no query row sees a key of the range
            continue
        # (pages stored in another dtype: converted)
        k, v = (page_span(t, table[b], a + lo, a + hi)[0].to(q.dtype) for t in (k_pages, v_pages))
        rspec = row_spec.shard(k_start=a + lo - s)
        rops = Operands(alibi=None if ops.alibi is None else ops.alibi[b:b + 1])
        if (check and masks_scores(rspec, rops, Nq, hi - lo, inner)
                and not all_finite(k)):
            return None
        o, l_ = _fwd(q, k, v, rspec, rops, config=inner)
        outs.append(o)
        lses.append(l_)
    if ops.sinks is not None:  # one more partial of value 0, in the denominator once
        outs.append(q.new_zeros(1, H, Nq, v_pages.shape[-1]))
        lses.append(ops.sinks.to(acc).view(1, H, 1).expand(1, H, Nq))
    if not outs:  # no key and no sink
        return (q.new_zeros(1, H, Nq, v_pages.shape[-1]),
                torch.full((1, H, Nq), float("-inf"), dtype=acc, device=q.device))
    return (outs[0], lses[0]) if len(outs) == 1 else _merge_trusted(outs, lses)


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, spec: LaunchSpec,
                    ops: Operands, *, config: FusedConfig = DEFAULT,
                    fallback: Callable | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q ``(B, H, Nq, D)`` against float pages read through a page table, on
    torch's fused op, forward only → out ``(B, H, Nq, D)`` in q's dtype, lse ``(B, H, Nq)``.
    The arguments are :func:`attn.tiled.paged_attention`'s: ``ops.pages`` says which slots
    ``[starts[b], lengths[b])`` row b reads, the band is counted from each row's end
    (``spec.band`` of a call with no key, its offset plus ``N_b``), ALiBi slopes ``(B, H)``.

    Each row's ranges (:func:`page_ranges`, :func:`page_span`) run :func:`_fwd` and merge
    with the sinks in key order (docs/kvcache.md, "CPU, fused"). ``fallback``: the same
    signature, run instead for a row whose band masks keys from some of its query rows
    (:func:`masks_scores`) and whose keys read are not all finite (torch's op adds its mask
    to the scores: 0·NaN); without it such rows take the NaN. The others' bits do not move."""
    if ops.pages is None or ops.quant is not None or ops.attn_mask is not None:
        raise ValueError("fused paged_attention takes ops.pages of float pages, no quant and "
                         "no attn_mask")
    why = spec_reason(spec, ops._replace(pages=None)) or ops_reason(q.device.type)
    if why is not None:
        raise NotImplementedError(f"backend='fused' cannot read these pages: {why}")
    check_paged_forward_only(q, k_pages, v_pages, ops)
    B, H, Nq, _ = q.shape
    hidden = Nq > 1 and not spec.band.is_full  # a band may hide keys from some query rows
    out = torch.empty(B, H, Nq, v_pages.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=_acc_dtype(q.dtype), device=q.device)
    for b in range(B):
        got = _paged_row(q[b:b + 1], k_pages, v_pages, spec, ops, b, config,
                         check=hidden and fallback is not None)
        if got is None:  # a key the band hides is not finite: this row on the fallback
            row = ops._replace(pages=PageTable(*(t[b:b + 1] for t in ops.pages)),
                               alibi=None if ops.alibi is None else ops.alibi[b:b + 1])
            got = fallback(q[b:b + 1], k_pages, v_pages, spec, row)
        out[b], lse[b] = got[0][0], got[1][0]
    return out, lse


# -- autograd and the public function ----------------------------------------------------------

class _Setup(NamedTuple):
    """What a call of :class:`_FusedAttention` holds besides the tensors autograd sees
    (:func:`fused_attention`'s arguments)."""
    spec: LaunchSpec
    config: FusedConfig
    consts: Operands  # the operands but the mask and sinks
    precise: Callable | None
    second: Callable | None
    fallback: Callable | None


class _FusedAttention(torch.autograd.Function):
    """Saves q, k, v, out, lse (and the mask, sinks, setup); the backward runs torch's
    backward op per piece. Asked for a differentiable backward (``create_graph=True``) it
    hands off to ``second`` (the caller's: tiled's double-differentiable backward from the
    same saved tensors). Under torch.func transforms the entry points do not choose this
    backend (attn.call routes them to tiled)."""

    @staticmethod
    def forward(q, k, v, setup: _Setup, attn_mask, sinks):
        ops = setup.consts._replace(attn_mask=attn_mask, sinks=sinks)
        return _fwd(q, k, v, setup.spec, ops, config=setup.config, fallback=setup.fallback)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, setup, attn_mask, sinks = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks)
        ctx.setup = setup
        ctx.forced = fused_cuda.forced_op()  # the backward may run on autograd's own thread

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, sinks = ctx.saved_tensors
        setup = ctx.setup
        ops = setup.consts._replace(attn_mask=attn_mask, sinks=sinks)
        do = torch.zeros_like(out) if dout is None else dout
        if torch.is_grad_enabled():  # create_graph=True: gradients that are differentiable
            if setup.second is None:
                raise NotImplementedError(
                    "backend='fused' has no double backward of its own; backend='tiled' and "
                    "backend='reference' differentiate their gradients (create_graph=True)")
            dq, dk, dv, dsinks = setup.second(do, dlse, q, k, v, out, lse, setup.spec, ops)
        else:
            forced = ctx.forced
            with contextlib.nullcontext() if forced is None else fused_cuda.force_op(forced):
                g = _bwd(do, dlse, q, k, v, out, lse, setup.spec, ops, config=setup.config,
                         precise=setup.precise, apart=setup.fallback is not None)
            dq, dk, dv, dsinks = g.dq, g.dk, g.dv, g.dsinks
        dsinks = None if dsinks is None else dsinks.to(sinks.dtype)
        dq, dk, dv = _cast((dq, dk, dv), (q.dtype, k.dtype, v.dtype))
        return dq, dk, dv, None, None, dsinks


def _cast(grads: tuple[Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> tuple[Tensor, ...]:
    """Each of ``grads`` in its dtype of ``dtypes``: cast on the worker pool on CPU
    (:func:`attn.workers.fill_passes`, as the backward's zeros), else by ``.to`` (also for
    differentiable gradients, ``create_graph=True``, whose cast autograd records)."""
    if all(g.dtype == d for g, d in zip(grads, dtypes)):
        return grads
    if (grads[0].device.type != "cpu" or torch.compiler.is_compiling()
            or torch.is_grad_enabled() or not all(g.is_contiguous() for g in grads)):
        return tuple(g.to(d) for g, d in zip(grads, dtypes))
    outs = tuple(g if g.dtype == d else torch.empty(g.shape, dtype=d, device=g.device)
                 for g, d in zip(grads, dtypes))
    workers.fill_passes([(o, g) for o, g in zip(outs, grads) if o is not g])
    return outs


def fused_attention(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec,
                    operands: Operands | None = None, *, config: FusedConfig = DEFAULT,
                    precise: Callable | None = None, second: Callable | None = None,
                    fallback: Callable | None = None) -> tuple[Tensor, Tensor]:
    """Exact attention on torch's fused kernels, per piece of attn's plan. Inputs validated.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, D) → out (B, H, Nq, D) in q's dtype,
    lse (B, H, Nq) float32 (float64 for float64). ``spec`` as the other backends' (a tensor
    temperature already folded into q); ``operands``: a bool or float mask (no gradient),
    sinks (H,), ALiBi slopes (B, H) (packed: (sequences, H)), packed sequences'
    ``cu_seqlens_q`` / ``_k`` with q, k, v laid out as one batch row (1, H, total, D).
    ``precise(do, dlse, q, k, v, spec, ops) -> Grads``: a dense backward that recomputes the
    forward itself, used where the lse is too large for torch's backward op to rebuild the
    probabilities within budget (:data:`LSE_PRECISE_LIMIT`); without it they are rebuilt
    anyway. ``second(do, dlse, q, k, v, out, lse, spec, ops) -> (dq, dk, dv, dsinks)``: a
    backward whose gradients are differentiable, run where one is asked for
    (``create_graph=True``); without it that raises NotImplementedError.
    ``fallback(q, k, v, spec, ops) -> (out, lse)``: a dense forward that never reads a
    masked key's score, run for each sequence whose keys torch's op cannot take
    (:func:`_poisoned`; its backward is then ``precise``, which ``fallback`` needs); the
    others keep the bits they have in any batch."""
    if fallback is not None and precise is None:
        raise ValueError("fused_attention: a fallback needs precise, its backward")
    ops = operands or Operands()
    why = spec_reason(spec, ops) or ops_reason(q.device.type)
    if why is not None:
        raise NotImplementedError(f"backend='fused' cannot compute this call: {why}")
    setup = _Setup(spec, config, ops._replace(attn_mask=None, sinks=None), precise, second,
                   fallback)
    return _FusedAttention.apply(q, k, v, setup, ops.attn_mask, ops.sinks)
