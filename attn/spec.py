"""The launcher spec and operands: what a backend's launchers need for one call.

``spec`` (:class:`LaunchSpec`) holds static values only, ``ops`` (:class:`Operands`) the
optional tensors; positions are global, so a shard reproduces the unsharded call (the
protocol and why: docs/design.md, "A call's path").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from attn.masks import (PARTIAL, Band, Blocks, band_kinds, classify_band, classify_grid,
                        combine_kinds)


class ScoreTerms(NamedTuple):
    """The constants of built-in score variants that carry no tensor, by name, a float each:
    the one :class:`LaunchSpec` field a new static score variant fills, so it adds no spec
    field, no call flag and no resolver line (docs/adding-a-variant.md). A backend applies
    the terms its score step names (``SCORE_TERMS`` in :mod:`attn.tiled.tile` and in
    :mod:`attn.flash_triton.kernels`) and refuses a call carrying any other; backends
    without a score step (sdpa, fused) refuse every term. Build it with :meth:`of`.

    A NamedTuple like :class:`attn.masks.Band`: torch.compile (2.11 included) traces the
    default ``ScoreTerms()``, where a dataclass instance breaks the graph."""

    items: tuple[tuple[str, float], ...] = ()  # (name, value), sorted by name

    @classmethod
    def of(cls, **values: float | None) -> "ScoreTerms":
        """The terms given a value, sorted by name (None: that variant is off)."""
        return cls(tuple(sorted((n, float(v)) for n, v in values.items() if v is not None)))

    def get(self, name: str, default: float | None = None) -> float | None:
        """The value of term ``name``, or ``default`` when the call does not carry it."""
        return next((v for n, v in self.items if n == name), default)

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.items)

    def refuse_unknown(self, known: tuple[str, ...], backend: str) -> None:
        """NotImplementedError naming the terms ``backend``'s score step does not apply."""
        unknown = [n for n in self.names() if n not in known]
        if unknown:
            raise NotImplementedError(f"{backend} does not apply the score term(s) {unknown} "
                                      f"(it applies {list(known)}): add the term's stage to "
                                      f"its score step (docs/adding-a-variant.md)")


@dataclass(frozen=True)
class LaunchSpec:
    qk_scale: float  # multiplies q·k: the public ``scale`` over a float temperature
    band: Band = Band()  # causal / window in global positions
    softcap: float | None = None  # a fixed cap; a learnable one is a tensor argument
    terms: ScoreTerms = ScoreTerms()  # the static score variants' constants, by name
    dropout_p: float = 0.0
    dropout_seed: int = 0
    q_start: int = 0  # global position of this call's first query
    k_start: int = 0  # global position of this call's first key
    head_start: int = 0  # global index of this call's first query head
    heads_total: int | None = None  # query heads of the whole computation (None: this call's)
    block_m: int | None = None  # tile sizes where a backend takes them (None: its default)
    block_n: int | None = None
    # programmable attention (attn.flex): callables, static like the rest; tensors they
    # capture that need a gradient are passed to the autograd.Function explicitly
    score_mod: Callable | None = None  # score_mod(score, b, h, q_idx, kv_idx) -> score
    mask_mod: Callable | None = None  # mask_mod(b, h, q_idx, kv_idx) -> bool, True = attend
    # the mask's tile classification (local positions); a callable (block_m, block_n) ->
    # Blocks is called by the backend at its own tile sizes (attn.mods.mod_spec)
    mask_blocks: Blocks | Callable[[int, int], Blocks] | None = None
    # packed sequences: (offs_m, offs_n) -> (sequence per row, position per row, position
    # per key) for the dropout hash, so a packed call draws its padded batch's mask
    dropout_rows: Callable | None = None
    # ALiBi's distances (the slopes are a tensor argument of _fwd / _bwd): None measures
    # |j - (i + offset)| from the band's global diagonal; packed sequences pass
    # (offs_m, offs_n) -> (sequence per row, query positions, key positions), both counted
    # from their own sequence's end, and each row takes its sequence's slopes
    alibi_rows: Callable | None = None
    # packed sequences (operands.cu_seqlens_q / _k set): the longest query and key sequence,
    # which size the launch grid; the band is then per sequence, end-relative
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    def local_band(self) -> Band:
        """The band in this call's own positions: query i is global ``q_start + i``."""
        b = self.band
        return Band(b.offset + self.q_start - self.k_start, b.left, b.right)

    @property
    def sharded(self) -> bool:
        return bool(self.q_start or self.k_start or self.head_start
                    or self.heads_total is not None)

    def blocks(self, n_q: int, n_k: int, block_m: int, block_n: int) -> Blocks:
        """Which tiles this call visits (:func:`attn.masks.classify_band` of the local band),
        AND the mask's own classification when there is one (its tile sizes win: the
        mask_mod is evaluated only in the tiles it marks partial)."""
        if self.mask_blocks is None and self.mask_mod is None:
            return classify_band(self.local_band(), n_q, n_k, block_m, block_n)
        if self.mask_blocks is None:  # an unclassified mask_mod: every visited tile partial
            kinds = band_kinds(self.local_band(), n_q, n_k, block_m, block_n).clamp(max=PARTIAL)
            return classify_grid(kinds, n_q, n_k, block_m, block_n)
        mb = self.mask_blocks
        if (mb.n_q, mb.n_k) != (n_q, n_k):
            raise ValueError(f"the block mask covers {mb.n_q} x {mb.n_k} (Nq x Nk), the call "
                             f"{n_q} x {n_k}")
        kinds = combine_kinds(mb.kinds(), band_kinds(self.local_band(), n_q, n_k,
                                                     mb.block_m, mb.block_n))
        return classify_grid(kinds, n_q, n_k, mb.block_m, mb.block_n)

    def shard(self, *, q_start: int = 0, k_start: int = 0, head_start: int = 0,
              heads_total: int | None = None) -> "LaunchSpec":
        """The same computation restricted to a shard starting at these global positions."""
        if self.mask_blocks is not None:
            raise NotImplementedError("a block mask is classified in one call's own positions "
                                      "and cannot be sharded")
        return replace(self, q_start=self.q_start + q_start, k_start=self.k_start + k_start,
                       head_start=self.head_start + head_start,
                       heads_total=heads_total if heads_total is not None else self.heads_total)


class PageTable(NamedTuple):
    """Where a paged call's keys live (:func:`attn.tiled.paged_attention`): k and v are then
    page storage ``(num_blocks, page_size, Hkv, D)``, and batch row b reads its keys
    ``[starts[b], lengths[b])`` in pages ``block_table[b, t // page_size]`` at slot
    ``t % page_size``. The three are host int64 tensors (``(B, max_pages)``, ``(B,)``,
    ``(B,)``): the plan cuts the call from them, so they are shapes, not device data. The
    triton kernel (:func:`attn.flash_triton.paged_attention`) reads the table where it lies
    (int32 or int64, moved to q's device if it is not there); starts and lengths stay host
    tensors there too."""

    block_table: Tensor
    starts: Tensor
    lengths: Tensor


class QuantPages(NamedTuple):
    """A quantized paged call's scales and full-precision pages, beside its :class:`PageTable`
    (formats: :mod:`attn.kvquant`): k and v are then code storage, int8 or uint8 ``(num_blocks,
    page_size, Hkv, Dc)``. Row b's pages ``j < recent_from[b]`` are codes, dequantized as
    ``code · scale``; pages ``j >= recent_from[b]`` are ids into ``recent_k`` / ``recent_v``
    (full precision, the most recent tokens). Plain tensors and a kind name, so a kernel can
    read them as they are."""

    kind: str  # "int8", "int4" (two codes per byte) or "fp8_e4m3" (bytes)
    # fp16; (num_blocks, page_size, Hkv, D // group) per token / group, (num_blocks, 1, Hkv, D)
    # per channel over a page's tokens, or (Hkv,) per kv head
    k_scales: Tensor
    v_scales: Tensor
    recent_from: Tensor  # (B,) host int64: row b's first full-precision page
    recent_k: Tensor | None = None  # (slots, page_size, Hkv, D) in the cache's storage dtype
    recent_v: Tensor | None = None
    # int8 keys with one scale per token scored against q rounded to int8 per row (integer
    # products; attn.decode's quantized_q)
    int8_scores: bool = False

    def dim(self, stored: int) -> int:
        """The head dim of pages storing ``stored`` codes per token and head (int4: two per
        byte)."""
        return stored * 2 if self.kind == "int4" else stored


class Operands(NamedTuple):
    """The optional tensors of one call, beside its :class:`LaunchSpec` (how launchers and
    autograd Functions take them: docs/design.md, "A call's path"). A new optional tensor
    (k/v scales, a block table) is a field here."""

    attn_mask: Tensor | None = None  # bool, or float with -inf for masked; broadcast to 4-d
    sinks: Tensor | None = None  # (H,) learnable extra softmax denominator term
    softcap: Tensor | None = None  # a learnable cap broadcastable to (H,); a fixed one is spec's
    alibi: Tensor | None = None  # ALiBi slopes (B, H), packed (sequences, H); constants
    captured: tuple[Tensor, ...] = ()  # tensors spec.score_mod reads that need a gradient
    cu_seqlens_q: Tensor | None = None  # packed sequences: (sequences + 1,) int32 offsets
    cu_seqlens_k: Tensor | None = None
    # a tensor temperature, as the multiplier scale / temperature (B, H, 1, 1) in the
    # accumulation dtype: attn.call.run folds it into q (autograd carries its gradient), so
    # launchers never see it; spec.qk_scale is then 1
    q_scale: Tensor | None = None
    pages: PageTable | None = None  # k and v are page storage read through this table
    quant: QuantPages | None = None  # the pages hold codes: their scales, recent pages


def check_paged_forward_only(q: Tensor, k_pages: Tensor, v_pages: Tensor, ops: Operands
                             ) -> None:
    """ValueError when a paged call (a backend's ``paged_attention``) would need a gradient:
    under grad mode, q, the pages, or a quantized cache's scales or recent pages requiring
    one. Caches serve inference; the paged reads are forward only."""
    held = (q, k_pages, v_pages) + (() if ops.quant is None else tuple(
        t for t in ops.quant[1:] if isinstance(t, Tensor)))
    if torch.is_grad_enabled() and any(t.requires_grad for t in held):
        raise ValueError("paged attention is forward only (caches serve inference): run it "
                         "under torch.no_grad() or torch.inference_mode()")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation (and lse) dtype of a call in ``dtype``: float64 stays, every other
    dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite(x: Tensor) -> bool:
    """Whether every entry of ``x`` is finite, by one summing pass in the accumulation dtype
    (a NaN or ±inf entry makes the sum NaN or ±inf). A sum that overflows although every
    entry is finite (|x| near the dtype's largest value) answers False, which only sends a
    caller down its careful path, never to a wrong answer. Much cheaper than
    ``isfinite(x).all()``: no bool tensors (docs/benchmarks.md, "Measurements behind the
    code's choices"). One host read."""
    return math.isfinite(x.sum(dtype=acc_dtype(x.dtype)).item())
