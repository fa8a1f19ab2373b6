"""How a call is cut and tiled: block sizes, batch chunks, the unit path's rules (one batch
row and one KV head per unit, on oneDNN), and the work items the CPU pool runs
(:func:`forward_items`, :func:`backward_runs`, :func:`kv_split`): all decided from the shapes
and the config alone, never from the number of workers, so results do not depend on it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from attn import workers
from attn.masks import Blocks, as_4d
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype
from attn.tiled import cpu
from attn.tiled.steps import compiled_steps_default
from attn.workers import item_threads, page_ranges  # noqa: F401 (tiled.paged reads them here)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """How the tiled backend cuts a call into tiles, chunks and units. The defaults are the
    measured ones (docs/benchmarks.md, "Measurements behind the code's choices"); a call takes
    another config as an argument (tests force small tiles or the unit path on small calls
    that way). ``spec.block_m`` / ``block_n``, where set, win over the block sizes here."""

    # the batched path's tile
    block_m: int = 256
    block_n: int = 256
    # a batched call whose score tile over (B, heads) would pass this runs in batch chunks,
    # so the tile stays in cache between its GEMM and the passes that read it
    tile_bytes: int = 4 << 20
    # the unit path (one batch row, one KV head with its G query heads, 2-D oneDNN GEMMs,
    # docs/design.md): tiles of about unit_rows query rows (G·BM) by unit_block_n keys;
    # unit_rows_full without a band from unit_rows_full_min_q query rows (G·Nq), where the
    # larger tile's memory stays within budget; calls below unit_min_rows per tile or
    # unit_min_keys keys stay batched, and so do bands whose visited tiles are more than
    # unit_max_partial partial (causal at N <= 1024)
    unit_rows: int = 512
    unit_block_n: int = 512
    unit_rows_full: int = 1024
    unit_rows_full_min_q: int = 8192
    unit_min_rows: int = 128
    unit_min_keys: int = 256
    unit_max_partial: float = 0.5
    # the backward's items: about bwd_items per batch chunk, from head groups of its kv heads
    # first (each writes its own dK/dV rows), then from runs of query blocks (at most
    # bwd_max_runs, each beyond the first with a dK/dV partial, summed in run order); the kv
    # heads and the blocks decide, never the batch or the workers
    bwd_items: int = 4
    bwd_max_runs: int = 4
    # a sequence of at least this many query x key pairs runs its backward one batch row per
    # chunk (no other row shares its tile GEMMs, which a batched GEMM over more matrices may
    # round differently); shorter ones keep the forward's batched chunks
    bwd_row_min_scores: int = 1 << 18
    # K/V in a (B, N, Hkv, D) layout have no (B·Hkv, N, D) view: a call whose rows each do at
    # least this many products (H·Nq·Nk·D) runs row by row on views, else its chunks copy K/V
    row_min_products: int = 1 << 22
    # calls that visit fewer scores run their items in order on the caller (one intra-op
    # thread, so the same bits): waking the workers would cost more than the call
    serial_max_scores: int = 1 << 16
    # split-KV decoding: at most split_max_q query rows per head and at least split_min_keys
    # keys run as (chunk, key range) items, ranges of split_min_chunk keys doubled until
    # there are at most split_max_chunks, merged in key order
    split_max_q: int = 16
    split_min_keys: int = 2048
    split_min_chunk: int = 2048
    split_max_chunks: int = 8

    def tiles(self, spec: LaunchSpec) -> LaunchSpec:
        """``spec`` with its block sizes set (its own where given, else this config's)."""
        if spec.block_m and spec.block_n:
            return spec
        return dataclasses.replace(spec, block_m=spec.block_m or self.block_m,
                                   block_n=spec.block_n or self.block_n)


DEFAULT = TileConfig()
BLOCK_M, BLOCK_N = DEFAULT.block_m, DEFAULT.block_n  # the default tile, for readers


@dataclasses.dataclass(frozen=True)
class SequenceBlocks(Blocks):
    """The tile plan of packed sequences: query block i is rows ``rows[i] = (m0, m1)`` with
    key tiles ``tiles[i]``, and every query and key block lies inside one sequence. So no
    tile holds two sequences' data: a NaN or inf in one sequence cannot reach another's rows
    through 0·NaN in P·V or dSᵀQ, as it would in a tile where the other sequence's keys are
    merely masked. The loops take this plan as it is (the packed call has no band of its
    own; its mask_mod holds the per-sequence band for the partial tiles)."""
    rows: tuple[tuple[int, int], ...] = ()

    def query_blocks(self):
        for (m0, m1), key_tiles in zip(self.rows, self.tiles):
            yield m0, m1, key_tiles

    def kinds(self) -> Tensor:
        raise NotImplementedError("sequence tiles are not on an aligned grid")


def _blocks(spec: LaunchSpec, n_q: int, n_k: int) -> Blocks:
    mb = spec.mask_blocks
    if isinstance(mb, SequenceBlocks):
        assert spec.local_band().is_full and not spec.sharded and (mb.n_q, mb.n_k) == (n_q, n_k)
        return mb
    return spec.blocks(n_q, n_k, spec.block_m, spec.block_n)  # set by the plan



class _Chunk(NamedTuple):
    """Batch rows [b0, b1) and KV heads [h0, h1) of a call, run as a call of its own. The
    slicing methods take each argument of the whole call to this chunk's part (a tensor
    broadcast along a dim keeps it); the spec becomes a head shard, so the dropout hash and
    ALiBi see global heads."""
    b0: int
    b1: int
    h0: int
    h1: int
    B: int  # the whole call's
    H: int
    Hkv: int

    @property
    def heads(self) -> slice:  # its query heads
        G = self.H // self.Hkv
        return slice(self.h0 * G, self.h1 * G)

    @property
    def whole(self) -> bool:
        return (self.b0, self.b1, self.h0, self.h1) == (0, self.B, 0, self.Hkv)

    def bh(self, x: Tensor | None) -> Tensor | None:  # (B, H, ...): q, out, lse, do, dq
        return x if x is None or self.whole else x[self.b0:self.b1, self.heads]

    def kv(self, x: Tensor | None) -> Tensor | None:  # (B, Hkv, ...): k, v, dk, dv
        return x if x is None or self.whole else x[self.b0:self.b1, self.h0:self.h1]

    def head_vec(self, x: Tensor | None) -> Tensor | None:  # sinks, softcap: (H,)
        if x is None or (self.h0, self.h1) == (0, self.Hkv):
            return x
        return x.reshape(-1).expand(self.H)[self.heads]

    def mask_index(self, mask4: Tensor) -> tuple[slice, slice]:
        """This chunk's (batch, head) slices of a mask broadcastable to (B, H, Nq, Nk)."""
        rows = slice(self.b0, self.b1) if mask4.shape[0] == self.B else slice(None)
        heads = self.heads if mask4.shape[1] == self.H else slice(None)
        return rows, heads

    def mask(self, mask: Tensor | None) -> Tensor | None:
        if mask is None or self.whole:
            return mask
        m4 = as_4d(mask)
        return m4[self.mask_index(m4)]

    def alibi(self, alibi: Tensor | None, packed: bool) -> Tensor | None:
        """(B, H) slopes; packed, (sequences, H): per sequence, so every row's."""
        if alibi is None or self.whole:
            return alibi
        return alibi[:, self.heads] if packed else alibi[self.b0:self.b1, self.heads]

    def operands(self, ops: Operands, packed: bool) -> Operands:
        """This chunk's part of each optional tensor (``packed``: ALiBi slopes per sequence)."""
        if self.whole:
            return ops
        return ops._replace(attn_mask=self.mask(ops.attn_mask), sinks=self.head_vec(ops.sinks),
                            softcap=self.head_vec(ops.softcap),
                            alibi=self.alibi(ops.alibi, packed))

    def spec(self, spec: LaunchSpec) -> LaunchSpec:
        if (self.h0, self.h1) == (0, self.Hkv):
            return spec
        return spec.shard(head_start=self.heads.start, heads_total=spec.heads_total or self.H)


class _Plan(NamedTuple):
    chunks: list[_Chunk]
    engine: str  # "onednn": one unit per chunk, 2-D oneDNN GEMMs; "bmm": batched
    spec: LaunchSpec  # with its block sizes set: the unit path's where it runs
    blocks: tuple = ()  # every chunk's query blocks: (m0, m1, key tiles)
    kv_chunk: int | None = None  # split-KV decoding: keys per item (kv_split)
    threads: int | None = None  # for cpu.run_items: None (the call's workers), 1 or 0


def _plan(q: Tensor, k: Tensor, spec: LaunchSpec, v: Tensor | None = None,
          config: TileConfig = DEFAULT, *, backward: bool = False) -> _Plan:
    """How a call runs: as units on the oneDNN engine where :func:`_unit_path` allows,
    else batched, in batch chunks whose score tile fits ``config.tile_bytes``. The
    backward's plan is the forward's without split-KV."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    uspec = _unit_path(q, k, spec, config)
    if uspec is not None:
        units = [_Chunk(b, b + 1, h, h + 1, B, H, Hkv) for b in range(B) for h in range(Hkv)]
        return _finish(_Plan(units, "onednn", uspec), q, k, config, backward)
    if backward and workers.items_here(q) and spec.mask_blocks is None and spec.mask_mod is None:
        # the forward's chunks cut into head groups (a block mask is classified in one
        # call's own positions and heads: it keeps whole chunks)
        plan = _plan(q, k, spec, v, config)
        per_row = q.shape[2] * k.shape[2] >= config.bwd_row_min_scores
        return plan._replace(chunks=head_groups(plan.chunks, config, per_row=per_row),
                             kv_chunk=None,
                             blocks=tuple(_blocks(plan.spec, q.shape[2], k.shape[2])
                                          .query_blocks()))
    spec = config.tiles(spec)
    whole = [_Chunk(0, B, 0, Hkv, B, H, Hkv)]
    if B == 1 or spec.score_mod is not None or spec.mask_mod is not None \
            or spec.dropout_rows is not None:
        return _finish(_Plan(whole, "bmm", spec), q, k, config, backward)
    per_row = (H * min(spec.block_m, Nq) * min(spec.block_n, Nk)
               * torch.finfo(_acc_dtype(q.dtype)).bits // 8)
    step = max(1, config.tile_bytes // per_row)
    D = q.shape[-1]
    if not (_heads_merge(k) and (v is None or _heads_merge(v))) \
            and H * Nq * Nk * D >= config.row_min_products:
        # head-first k / v with no (B·Hkv, N, D) view (a cache, a fused QKV projection):
        # one batch row's (Hkv, N, D) is a view, so rows go one by one (row_min_products)
        step = 1
    chunks = [_Chunk(b, min(b + step, B), 0, Hkv, B, H, Hkv) for b in range(0, B, step)]
    return _finish(_Plan(chunks, "bmm", spec), q, k, config, backward)


def _finish(plan: _Plan, q: Tensor, k: Tensor, config: TileConfig, backward: bool) -> _Plan:
    """The plan's query blocks, split-KV choice (the forward's) and thread rule."""
    Nq, Nk = q.shape[2], k.shape[2]
    spec = plan.spec
    kv_chunk = None
    if not backward and spec.mask_blocks is None and spec.dropout_rows is None \
            and spec.alibi_rows is None:
        kv_chunk = kv_split(Nq, Nk, config)
    blocks = tuple(_blocks(spec, Nq, Nk).query_blocks()) if kv_chunk is None else ()
    visited = Nq * Nk if kv_chunk else sum(_cost(b) for b in blocks)
    threads = item_threads(q, visited * q.shape[0] * q.shape[1], config)
    return plan._replace(blocks=blocks, kv_chunk=kv_chunk, threads=threads)


def _cost(block) -> int:
    """The scores one query block visits: its rows times its tiles' keys."""
    m0, m1, key_tiles = block
    return (m1 - m0) * sum(n1 - n0 for n0, n1, _ in key_tiles)


def forward_items(plan: _Plan) -> list[tuple[int, int]]:
    """The forward's work items, (chunk, query block) index pairs: every pair once, the
    most expensive blocks first (a causal call's last rows), so the cheap ones fill in
    around them at the end: :func:`backward_items` with a run per block."""
    return backward_items(plan, [(i, i + 1) for i in range(len(plan.blocks))])


def backward_runs(plan: _Plan, config: TileConfig = DEFAULT) -> list[tuple[int, int]]:
    """The backward's runs of query blocks, ``[(i0, i1), ...]`` covering every block with
    key tiles once, in order: as many as ``config.bwd_items`` items per batch chunk need
    beyond its head groups (:func:`head_groups`; the unit path's single heads), at most
    ``bwd_max_runs`` and one per block, cut where the visited scores are about evenly split.
    The kv heads and the blocks alone decide it, never the batch."""
    blocks = [i for i, b in enumerate(plan.blocks) if b[2]]
    if not blocks:
        return []
    # chunks per batch chunk: the same for every batch size (head groups, or unit heads)
    groups = len(plan.chunks) // len({(c.b0, c.b1) for c in plan.chunks})
    want = -(-config.bwd_items // groups)
    n_runs = max(1, min(want, config.bwd_max_runs, len(blocks)))
    costs = [_cost(plan.blocks[i]) for i in blocks]
    total, runs, start, acc = sum(costs), [], 0, 0
    for j, c in enumerate(costs):
        acc += c
        left = len(blocks) - j - 1  # blocks after this one
        cut = len(runs) + 1 < n_runs and (acc * n_runs >= total * (len(runs) + 1)
                                          or left == n_runs - len(runs) - 1)
        if cut or j == len(blocks) - 1:
            runs.append((blocks[start], blocks[j] + 1))
            start = j + 1
    return runs


def head_groups(chunks: list[_Chunk], config: TileConfig = DEFAULT, *,
                per_row: bool = True) -> list[_Chunk]:
    """The backward's chunks. With ``per_row``: each batch row its own chunk (so every tile
    GEMM of a sequence is the same whatever else shares its batch: a batched GEMM over one
    matrix or over several may round differently), its kv heads cut into
    ``min(Hkv, bwd_items)`` groups of consecutive heads (each writes its own dK/dV rows).
    Without: the chunks as they are (a head slice of several rows would not be one view).
    Chunks already narrower (the unit path's single heads) stay."""
    out = []
    for c in chunks:
        n = c.h1 - c.h0
        if n < c.Hkv or not per_row:
            out.append(c)
            continue
        groups = min(n, config.bwd_items)
        cuts = [c.h0 + round(i * n / groups) for i in range(groups + 1)]
        out += [c._replace(b0=b, b1=b + 1, h0=h0, h1=h1) for b in range(c.b0, c.b1)
                for h0, h1 in zip(cuts, cuts[1:])]
    return out


def backward_items(plan: _Plan, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The backward's work items, (chunk, run) index pairs: every pair once, the most
    expensive runs first (where a causal call's runs differ in cost), as the forward's."""
    costs = [sum(_cost(b) for b in plan.blocks[i0:i1]) for i0, i1 in runs]
    order = sorted(range(len(runs)), key=lambda r: -costs[r])
    return [(c, r) for r in order for c in range(len(plan.chunks))]


def kv_split(n_q: int, n_k: int, config: TileConfig = DEFAULT) -> int | None:
    """:func:`attn.workers.kv_split` under tiled's config (by default :data:`DEFAULT`)."""
    return workers.kv_split(n_q, n_k, config)


def _heads_merge(x: Tensor) -> bool:
    """Whether ``x (B, Hkv, N, D)`` has a ``(B·Hkv, N, D)`` view (no copy)."""
    return x.shape[0] == 1 or x.shape[1] == 1 or x.stride(0) == x.shape[1] * x.stride(1)


def _unit_path(q: Tensor, k: Tensor, spec: LaunchSpec, config: TileConfig = DEFAULT
               ) -> LaunchSpec | None:
    """The spec with the unit tile sizes where a call runs as units on the oneDNN engine (a
    float32 CPU call, eager, no score_mod, mask_mod, block mask or packed sequences, tiles of
    enough rows and keys and mostly unmasked, oneDNN this CPU's engine), else None."""
    H, Nq = q.shape[1], q.shape[2]
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    tile_rows = (config.unit_rows_full
                 if spec.band.is_full and G * Nq >= config.unit_rows_full_min_q
                 else config.unit_rows)
    if (q.device.type != "cpu" or _acc_dtype(q.dtype) != torch.float32
            or spec.score_mod is not None or spec.mask_mod is not None
            or spec.mask_blocks is not None or spec.dropout_rows is not None
            or spec.alibi_rows is not None or compiled_steps_default()
            or torch.compiler.is_compiling()):
        return None  # (before dataclasses.replace, which torch 2.11's dynamo cannot trace)
    block_m = spec.block_m or max(1, tile_rows // G)
    if G * min(Nq, block_m) < config.unit_min_rows or Nk < config.unit_min_keys:
        return None
    uspec = dataclasses.replace(spec, block_m=block_m,
                                block_n=spec.block_n or config.unit_block_n)
    visited = partial = 0
    for _, _, key_tiles in _blocks(uspec, Nq, Nk).query_blocks():
        visited += len(key_tiles)
        partial += sum(not full for _, _, full in key_tiles)
    if visited == 0 or partial > config.unit_max_partial * visited:
        return None
    return uspec if cpu.gemm_engine()[0] == "onednn" else None


def cpu_path_reason(device: str, n_q: int, n_k: int, *, split_allowed: bool = True,
                    config: TileConfig = DEFAULT) -> str:
    """How an eager call of this size runs, for :func:`attn.select_backend`'s reason."""
    if torch.device(device).type != "cpu":
        return "tiles in order"
    if torch.compiler.is_compiling():
        return "tiles in order (traced by torch.compile)"
    threads = cpu.workers_for_call()
    chunk = kv_split(n_q, n_k, config) if split_allowed else None
    how = (f"split-KV decoding ({-(-n_k // chunk)} key ranges of {chunk})" if chunk
           else "query blocks as work items")
    return f"{how}, one parallel region on {threads} thread{'s' * (threads != 1)}"
