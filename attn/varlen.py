"""Packed sequences (``cu_seqlens``) without padding, and converters between the layouts.

The packed layout is one of the two documented exceptions to ``(B, H, N, D)``: q is
``(total_q, H, D)``, k and v ``(total_k, Hkv, D)``, the sequences laid end to end;
``cu_seqlens`` holds the ``B + 1`` offsets where they start (``[0, n0, n0 + n1, ...]``).
On tiled, :func:`varlen_attention` is a document mask (:class:`_DocMask`) cut at every
sequence boundary; how each backend keeps the sequences apart: docs/flex-varlen.md.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from attn.call import (_check_float_qkv, _check_tensor, _validate_alibi, _validate_dropout,
                       broadcasts_to, resolve, run, select_backend)
from attn.masks import Band, classify_band, make_band, window_pair
from attn.tiled import SequenceBlocks

__all__ = ["cu_seqlens_from_document_ids", "cu_seqlens_from_lengths",
           "cu_seqlens_from_padding_mask", "cu_seqlens_from_position_ids", "document_ids",
           "pack", "position_ids", "unpack", "varlen_attention"]


# -- converters ------------------------------------------------------------------------------

def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """Offsets ``(B + 1,)`` int32 from sequence lengths ``(B,)``."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-d (B,), got shape {tuple(lengths.shape)}")
    zero = torch.zeros(1, dtype=torch.int32, device=lengths.device)
    return torch.cat([zero, lengths.cumsum(0).to(torch.int32)])


def cu_seqlens_from_padding_mask(mask: Tensor) -> tuple[Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of a bool padding mask ``(B, N)``, True = a real token
    (each row's tokens are packed in order, wherever the padding is)."""
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool (B, N), got {mask.dtype} {tuple(mask.shape)}")
    lengths = mask.sum(1)
    return cu_seqlens_from_lengths(lengths), int(lengths.max()) if lengths.numel() else 0


def pack(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Padded ``x (B, N, ...)`` → ``(packed (total, ...), cu_seqlens, max_seqlen)``, keeping
    the tokens where ``mask (B, N)`` is True."""
    if x.shape[:2] != mask.shape:
        raise ValueError(f"x {tuple(x.shape)} and mask {tuple(mask.shape)} must agree in "
                         f"(B, N)")
    cu, max_len = cu_seqlens_from_padding_mask(mask)
    return x[mask], cu, max_len


def unpack(packed: Tensor, mask: Tensor) -> Tensor:
    """The inverse of :func:`pack`: ``(total, ...)`` → ``(B, N, ...)``, zeros at padding."""
    if packed.shape[0] != int(mask.sum()):
        raise ValueError(f"packed has {packed.shape[0]} tokens, mask {int(mask.sum())}")
    out = packed.new_zeros(*mask.shape, *packed.shape[1:])
    out[mask] = packed
    return out


def document_ids(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """``(total,)`` int64: the sequence index of every packed token (empty sequences own
    no token). ``cu_seqlens`` must start at 0 and never decrease; ``total``, when given,
    must be where it ends."""
    cu = check_cu_form("cu_seqlens", cu_seqlens)
    if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
        raise TypeError(f"total must be an int or None, got {type(total).__name__}")
    host = check_cu_values("cu_seqlens", cu, total)
    tokens = torch.arange(int(host[-1]), device=cu.device)
    return torch.searchsorted(cu[1:].to(torch.int64), tokens, right=True)


def position_ids(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """``(total,)`` int64: every token's position inside its own sequence (RoPE's input);
    ``cu_seqlens`` and ``total`` as in :func:`document_ids`."""
    doc = document_ids(cu_seqlens, total)
    return torch.arange(doc.numel(), device=doc.device) - cu_seqlens.to(torch.int64)[doc]


def cu_seqlens_from_position_ids(pos: Tensor) -> Tensor:
    """Offsets from packed position ids ``(total,)``: a sequence starts where ``pos == 0``."""
    if pos.dim() != 1 or pos.numel() == 0 or int(pos[0]) != 0:
        raise ValueError(f"position ids must be 1-d, non-empty and start at 0, got shape "
                         f"{tuple(pos.shape)}")
    starts = torch.nonzero(pos == 0).flatten()
    end = torch.tensor([pos.numel()], device=pos.device)
    return torch.cat([starts, end]).to(torch.int32)


def cu_seqlens_from_document_ids(doc: Tensor, num_docs: int | None = None) -> Tensor:
    """Offsets from sorted document ids ``doc (total,)``, at least one, in ``[0, num_docs)``
    (an id with no token is an empty sequence; ``num_docs`` defaults to the largest id + 1)."""
    _check_tensor("doc", doc)
    if doc.is_floating_point() or doc.is_complex() or doc.dtype == torch.bool:
        raise TypeError(f"doc must hold integer ids, got {doc.dtype}")
    if doc.dim() != 1 or doc.numel() == 0:
        raise ValueError(f"doc must hold at least one id, got shape {tuple(doc.shape)}")
    host = doc.cpu()  # one small copy: the checks below read every id
    if bool((host < 0).any()):
        at = int(torch.nonzero(host < 0)[0])
        raise ValueError(f"doc must hold ids >= 0, got {int(host[at])} at position {at}")
    if bool((host[1:] < host[:-1]).any()):
        at = int(torch.nonzero(host[1:] < host[:-1])[0]) + 1
        raise ValueError(f"doc must be non-decreasing, got {int(host[at - 1])} then "
                         f"{int(host[at])} at position {at}")
    if num_docs is not None and (isinstance(num_docs, bool) or not isinstance(num_docs, int)):
        raise TypeError(f"num_docs must be an int or None, got {type(num_docs).__name__}")
    n = int(host[-1]) + 1 if num_docs is None else num_docs
    if int(host[-1]) >= n:
        raise ValueError(f"doc holds id {int(host[-1])}, num_docs={n} allows 0..{n - 1}")
    return cu_seqlens_from_lengths(torch.bincount(doc.long(), minlength=n))


# -- validation -------------------------------------------------------------------------------

def check_cu_form(name: str, cu: object, device: torch.device | None = None,
                  device_name: str = "q") -> Tensor:
    """The one ``cu_seqlens`` rule, first half: a 1-d int32 / int64 tensor of ``B + 1 >= 2``
    offsets (on ``device``, given one): checks that read nothing from the device. Every
    entry taking packed offsets (varlen, nn, compat) checks them here."""
    _check_tensor(name, cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-d (B + 1,) with B >= 1, got shape {tuple(cu.shape)}")
    if device is not None and cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, {device_name} on {device}")
    return cu


def check_cu_values(name: str, cu: Tensor, total: int | None, total_name: str = "total", *,
                    padded: bool = False) -> Tensor:
    """The one ``cu_seqlens`` rule, second half: the offsets themselves, on the host (one
    small copy, returned): start 0, never decrease, end at ``total`` (when given;
    ``padded``: at most there, flash-attn's padded buffer whose tail is no sequence's). Each
    message shows the offsets (the first 16)."""
    host = cu.cpu()
    shown = host.tolist()
    shown = f"{shown}" if len(shown) <= 16 else f"{shown[:16]}"[:-1] + ", ...]"
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {name} = {shown}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{name} must not decrease (a sequence may be empty), got "
                         f"{name} = {shown}")
    last = int(host[-1])
    if total is not None and padded and last > total:
        raise ValueError(f"{name} must end at most at {total_name}={total}: {name}[-1] = "
                         f"{last} is larger than the {total} tokens, got {name} = {shown}")
    if total is not None and not padded and last != total:
        raise ValueError(f"{name} must end at {total_name}={total}, got {name} = {shown}")
    return host


def _validate_packed(q: object, k: object, v: object) -> None:
    """attn.call._validate_qkv's checks in the packed layout, so that a message shows the
    shapes the caller passed: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)."""
    _check_float_qkv(("q", "k", "v"), (q, k, v), 3, "(total, H, D) in the packed layout")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: {shapes}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in (total_k, Hkv): {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads must be a multiple of k heads (GQA), got H={q.shape[1]}, "
                         f"Hkv={k.shape[1]}: {shapes}")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise ValueError(f"q, k, v must not be empty: {shapes}")


# -- the tile plan -----------------------------------------------------------------------------

class _DocMask:
    """mask_mod of packed sequences: same sequence, and the per-sequence bottom-right band
    ``-left <= (j - end_k) - (i - end_q) <= right`` (positions counted from each sequence's
    end, which is FlashAttention's bottom-right alignment: ``j <= i + Lk - Lq``)."""

    def __init__(self, cu_q: Tensor, cu_k: Tensor, n_q: int, n_k: int, band: Band) -> None:
        self.doc_q, self.doc_k = document_ids(cu_q, n_q), document_ids(cu_k, n_k)
        self.start_q, self.start_k = cu_q.long()[:-1], cu_k.long()[:-1]
        self.band = band
        self.cu_q, self.cu_k = cu_q, cu_k
        # positions counted from each sequence's end (the band's and ALiBi's coordinates)
        self.pos_q = torch.arange(n_q, device=cu_q.device) - cu_q.long()[1:][self.doc_q]
        self.pos_k = torch.arange(n_k, device=cu_k.device) - cu_k.long()[1:][self.doc_k]

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = self.doc_q[q_idx] == self.doc_k[kv_idx]
        if not self.band.is_full:
            rel = self.pos_k[kv_idx] - self.pos_q[q_idx]
            if self.band.left is not None:
                keep = keep & (rel >= -self.band.left)
            if self.band.right is not None:
                keep = keep & (rel <= self.band.right)
        return keep

    def dropout_rows(self, offs_m: Tensor, offs_n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Dropout's hash coordinates: each row's sequence and the positions inside their
        own sequences, i.e. the padded batch's ``(b, i, j)``."""
        doc_q, doc_k = self.doc_q[offs_m], self.doc_k[offs_n]
        return doc_q, offs_m - self.start_q[doc_q], offs_n - self.start_k[doc_k]

    def alibi_rows(self, offs_m: Tensor, offs_n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """ALiBi's coordinates: each row's sequence and the end-relative positions, so
        ``|pos_k - pos_q| = |i + Lk_b - Lq_b - j|`` inside sequence b."""
        return self.doc_q[offs_m], self.pos_q[offs_m], self.pos_k[offs_n]

    def blocks(self, block_m: int, block_n: int) -> SequenceBlocks:
        """The tile plan, sequence by sequence: each sequence's queries cut into blocks of
        ``block_m`` from its first row, its keys into tiles of ``block_n`` from the first key
        its band lets a block see, so no tile spans two sequences (isolation: one
        sequence's NaN never meets another's rows). A tile is full when the per-sequence
        band masks nothing in it; tiles between sequences are never listed."""
        cu_q, cu_k = self.cu_q.tolist(), self.cu_k.tolist()  # one small copy each
        rows, tiles = [], []
        for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
            # sequence b alone: bottom-right band, offset Lk - Lq
            band = Band(k1 - k0 - (q1 - q0), self.band.left, self.band.right)
            for m0, m1, key_tiles in classify_band(band, q1 - q0, k1 - k0, block_m,
                                                   block_n).query_blocks():
                rows.append((q0 + m0, q0 + m1))
                tiles.append(tuple((k0 + n0, k0 + n1, full) for n0, n1, full in key_tiles))
        return SequenceBlocks(block_m, block_n, self.doc_q.numel(), self.doc_k.numel(),
                              tuple(tiles), tuple(rows))


# -- the function ---------------------------------------------------------------------------------

def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | Tensor | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    alibi_slopes: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over packed sequences (``flash_attn_varlen_func``'s layout), every device.

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); ``cu_seqlens_q`` /
    ``cu_seqlens_k`` int32 or int64 ``(B + 1,)`` offsets from 0 to total (sequences may be
    empty) → out (total_q, H, Dv); with ``return_lse`` also lse (H, total_q), float32
    (float64 for float64 input). ``causal`` and ``window=(left, right)`` are aligned
    bottom-right per sequence, as in FlashAttention (query i sees key j iff
    ``j <= i + Lk_b - Lq_b``); the other keywords mean what they mean in
    :func:`attn.attention`, ``temperature`` broadcastable to (H,), ``alibi_slopes`` (H,) or
    (B, H) (one row per sequence, ``−slope · |i + Lk_b − Lq_b − j|``). How the sequences stay
    isolated on every backend and dropout draws the padded batch's mask: docs/flex-varlen.md,
    "Packed sequences".

    ``max_seqlen_*`` are optional: given both, triton trusts ``cu_seqlens`` as flash-attn
    does (no host read); otherwise the offsets are checked on the host
    (:func:`check_cu_values`) and a given max_seqlen must cover the longest sequence. Long
    for its checks in the caller's names; the work itself is one resolve, one backend
    choice, tiled's document mask and one run.
    """
    _validate_packed(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    total_q, H, D = q.shape
    total_k = k.shape[0]
    cu_q = check_cu_form("cu_seqlens_q", cu_seqlens_q, q.device)
    cu_k = check_cu_form("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of "
                         f"sequences, got shapes {tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    given = (max_seqlen_q, max_seqlen_k)
    for name, g in zip(("max_seqlen_q", "max_seqlen_k"), given):
        if g is not None and (isinstance(g, bool) or not isinstance(g, int)):
            raise TypeError(f"{name} must be an int or None, got {type(g).__name__}")
    if isinstance(temperature, Tensor) and not broadcasts_to(temperature.shape, (H,)):
        raise ValueError(f"temperature of shape {tuple(temperature.shape)} does not broadcast "
                         f"to (H,) = ({H},) in the packed layout")
    _validate_dropout(dropout_p)
    if alibi_slopes is not None:
        alibi_slopes = _validate_alibi(alibi_slopes, cu_q.numel() - 1, "num_seqs", H, q)
    # per sequence, in end-relative positions (offset 0: both counted from the sequence's
    # end, which is the bottom-right alignment)
    band = make_band(0, 0, causal=causal, window=window_pair(window))
    # (total, H, D) -> (1, H, total, D): one batch row, the tokens along the sequence axis
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    # with both max_seqlen given, triton reads cu_seqlens on the device only (trusting them,
    # as flash-attn does); every other path checks them on the host
    def longest() -> tuple[int, int]:  # the offsets checked, then the longest sequences
        host_q = check_cu_values("cu_seqlens_q", cu_q, total_q, "q.shape[0]")
        host_k = check_cu_values("cu_seqlens_k", cu_k, total_k, "k.shape[0]")
        return int((host_q[1:] - host_q[:-1]).max()), int((host_k[1:] - host_k[:-1]).max())

    seen = longest() if None in given else None  # a missing max_seqlen: the longest sequence
    max_q, max_k = given if seen is None else (n if g is None else g for g, n in zip(given, seen))
    call, spec, ops = resolve(q4, k4, v4, band=band, scale=scale, temperature=temperature,
                              softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                              return_lse=return_lse, alibi_slopes=alibi_slopes,
                              cu_seqlens=(cu_q, cu_k), max_seqlen=(max_q, max_k))
    choice = select_backend(call, backend)
    if choice.name != "triton" or seen is not None:
        for name, g, n in zip(("max_seqlen_q", "max_seqlen_k"), given, seen or longest()):
            if g is not None and g < n:
                raise ValueError(f"{name}={g} is shorter than the longest sequence ({n})")
    if choice.name == "tiled":  # the sequences as a document mask of one batch row
        doc = _DocMask(cu_q, cu_k, total_q, total_k, band)
        spec = replace(spec, band=Band(), mask_mod=doc, mask_blocks=doc.blocks,
                       dropout_rows=doc.dropout_rows,
                       alibi_rows=None if ops.alibi is None else doc.alibi_rows)
        ops = ops._replace(cu_seqlens_q=None, cu_seqlens_k=None)
    out, lse = run(choice.name, q4, k4, v4, spec, ops)
    out = out[0].transpose(0, 1).contiguous()  # (H, total_q, Dv) -> (total_q, H, Dv)
    return (out, lse[0]) if return_lse else out
