"""The fused backend: torch's own fused attention kernels as attn's block primitive.

torch ships a fused attention kernel that returns the log-sum-exp beside the output
(``aten::_scaled_dot_product_flash_attention_for_cpu``) and a backward that takes them back.
Called on the pieces of attn's plan and merged through their lse (the online softmax at block
granularity, :mod:`attn.merge`), it computes attn's calls exactly at the speed of torch's
kernel. This is the only module that calls torch's private ``aten::_scaled_dot_product_*`` ops,
never through ``F.scaled_dot_product_attention`` (which :func:`attn.patch_sdpa` may route back
to attn); their schemas are checked against the installed torch when first used, and a
mismatch turns the backend off with one warning and a reason.

How a call is cut (CPU). Work items are (batch row, kv head, query block, key range): one
batch row and one kv head with its G query heads (GQA without K/V copies), so torch's kernel
never chooses its own packing from the batch or the thread count. A query block's keys are cut
by the band into at most three pieces (:func:`pieces`): keys every row of the block sees (no
mask), the diagonal where the band's right edge runs (torch's top-left ``is_causal`` on that
square, no mask), and the strip its left edge cuts (a block-sized mask); empty pieces are
never called. A user mask is sliced per piece and turned into an additive mask of q's dtype
there. Decoding cuts the keys into ranges (split-KV) merged in key order; the sinks join as one
more partial. Every cut depends on the sequence's own lengths and the model's heads, never on
the batch or the number of workers, and merges run in a fixed order: a sequence's bits do not
depend on its batch.

The backward runs per (batch row, kv head): each query block's pieces go through torch's
backward op with the call's *merged* output and lse (so each piece's dQ/dK/dV share is exact),
dQ summed over the pieces and dK/dV over the query blocks in order, in the accumulation dtype.
Nothing N x N is ever allocated.

What it expresses is an allow-list over the call's fields (:func:`unsupported_reason`, and
:data:`SPEC_DECISIONS` for every :class:`attn.spec.LaunchSpec` field: a field without a decision
makes a call not expressible).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from attn import workers
from attn.grads import Grads, sink_grad
from attn.masks import Band, as_4d
from attn.merge import _merge_trusted
from attn.spec import LaunchSpec, Operands
from attn.spec import acc_dtype as _acc_dtype

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
    """torch's CPU ops, or why they cannot be used (absent, or a schema this module was not
    written for: one warning, then the backend stays off for the process)."""
    found = []
    for name, expected in _CPU_SCHEMAS.items():
        packet = getattr(torch.ops.aten, name, None)
        overload = None if packet is None else getattr(packet, "default", None)
        if overload is None:
            why = f"torch {torch.__version__} has no aten::{name}"
        elif str(overload._schema) != expected:
            why = (f"aten::{name} has another schema on torch {torch.__version__}: "
                   f"{overload._schema}")
        else:
            found.append(overload)
            continue
        warnings.warn(f"attn: the fused backend is off: {why}", RuntimeWarning, stacklevel=3)
        return why
    return _CpuOps(*found)


def ops_reason(device: str) -> str | None:
    """Why torch's fused ops cannot serve ``device`` in this process, or None."""
    if device != "cpu":
        return (f"the fused backend runs on CPU; on {device} it waits for a committed "
                f"verification of torch's ops there")
    ops = _cpu_ops()
    return ops if isinstance(ops, str) else None


# -- what it expresses -------------------------------------------------------------------------

# Every LaunchSpec field and what the fused backend does with it: "read" (computed exactly),
# "default" (expressible only at the field's default value). A field missing here makes
# every call inexpressible (spec_reason), and tests/test_fused.py fails until it is decided.
SPEC_DECISIONS: dict[str, str] = {
    "qk_scale": "read",  # torch's scale argument
    "band": "read",  # pieces: full, top-left causal diagonal, masked strip
    "softcap": "default",  # torch's kernel has no score transform
    "dropout_p": "default",  # attn's hash dropout cannot be handed to torch's kernel
    "dropout_seed": "read",  # meaningless without dropout
    "q_start": "read",  # the local band carries the shard's positions
    "k_start": "read",
    "head_start": "read",  # only dropout and ALiBi read heads, and neither runs here
    "heads_total": "read",
    "block_m": "read",  # the tiled backend's tile sizes: ignored (torch tiles itself)
    "block_n": "read",
    "score_mod": "default",
    "mask_mod": "default",  # not yet evaluated per piece
    "mask_blocks": "default",
    "dropout_rows": "default",
    "alibi_rows": "default",
    "max_seqlen_q": "default",  # packed sequences: not yet
    "max_seqlen_k": "default",
}

# Operands the fused backend reads; the others must be None / empty.
_OPERANDS_READ = ("attn_mask", "sinks")


def spec_reason(spec: LaunchSpec, ops: Operands) -> str | None:
    """Why the fused backend cannot compute a call with this spec and these operands."""
    for f in dataclasses.fields(LaunchSpec):
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
    if call.mask_mod:
        return "mask_mod / block masks (not yet evaluated per piece)"
    if call.softcap is not None:
        return "softcap (torch's fused kernel has no score transform)"
    if call.dropout:
        return "dropout (attn's reproducible hash dropout cannot be handed to torch's kernel)"
    if call.mask_grad:
        return "a float mask's gradient (the tiled backend computes it)"
    if call.alibi:
        return "alibi_slopes (not yet a block-sized bias here)"
    if call.varlen:
        return "packed varlen sequences (not yet)"
    if call.head_dim != call.head_dim_v:
        return (f"a value head dim ({call.head_dim_v}) other than the query's "
                f"({call.head_dim}): torch's fused kernel needs them equal")
    return ops_reason(call.device)


# -- the plan ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """How the fused backend cuts a call. Counts depend on shapes and the model's heads only."""

    # a bandless or causal call without a mask is cut into query blocks only for parallelism:
    # about this many items per batch row (kv heads x query blocks), blocks of at least
    # min_block_m query rows
    items_per_row: int = 8
    min_block_m: int = 256
    # a call with a masked piece (a window's left edge, a user mask) takes blocks of this
    # many query rows, so each mask is block-sized
    masked_block_m: int = 256
    # split-KV decoding: at most split_max_q query rows per head and at least
    # split_min_keys keys: key ranges of split_min_chunk, doubled until at most
    # split_max_chunks
    split_max_q: int = 16
    split_min_keys: int = 8192
    split_min_chunk: int = 4096
    split_max_chunks: int = 8
    # calls smaller than this (scores visited) run their items in order on the caller
    serial_max_scores: int = 1 << 16


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


def kv_split(n_q: int, n_k: int, config: FusedConfig = DEFAULT) -> int | None:
    """Keys per range of a split-KV decoding call, or None (the shapes alone decide)."""
    if n_q > config.split_max_q or n_k < config.split_min_keys:
        return None
    chunk = config.split_min_chunk
    while -(-n_k // chunk) > config.split_max_chunks:
        chunk *= 2
    return chunk


def query_blocks(band: Band, n_q: int, n_k: int, hkv: int, masked: bool,
                 config: FusedConfig = DEFAULT) -> list[tuple[int, int]]:
    """The query blocks of one (batch row, kv head): block-sized where a piece is masked,
    else as few as give ``items_per_row`` items over the kv heads."""
    if masked or band.left is not None:
        bm = config.masked_block_m
    else:
        want = max(1, -(-config.items_per_row // hkv))
        bm = max(config.min_block_m, -(-n_q // want))
    return [(m0, min(m0 + bm, n_q)) for m0 in range(0, n_q, bm)]


# -- launchers ---------------------------------------------------------------------------------

def _piece_mask(spec_band: Band, mask4: Tensor | None, b: int, heads: slice, m0: int, m1: int,
                p: Piece, dtype: torch.dtype, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """The additive mask of one piece ``(1, G or 1, rows, keys)`` in q's dtype (0 / -inf for
    bool masks and the band, a float mask's values), and which rows see no key of the piece
    ``(G or 1, rows)`` (None when every row sees one)."""
    keep = None
    if p.masked or (p.causal and mask4 is not None):  # a user mask: the band joins it
        keep = spec_band.mask(torch.arange(m0, m1, device=device),
                              torch.arange(p.n0, p.n1, device=device))[None, None]
    add = None
    if mask4 is not None:
        user = mask4[b if mask4.shape[0] > 1 else 0, heads if mask4.shape[1] > 1 else slice(None)]
        user = user[:, m0:m1] if user.shape[1] > 1 else user
        user = user[..., p.n0:p.n1] if user.shape[2] > 1 else user
        user = user[None]  # (1, G or 1, rows or 1, keys or 1)
        if user.dtype == torch.bool:
            keep = user if keep is None else keep & user
        else:
            add = user.to(dtype)
    if keep is None and add is None:
        return None, None
    if keep is not None:
        shape = torch.broadcast_shapes(keep.shape, (1, 1, m1 - m0, p.n1 - p.n0))
        band_add = torch.zeros(shape, dtype=dtype, device=device).masked_fill_(
            ~keep.expand(shape), float("-inf"))
        add = band_add if add is None else band_add + add
    add = add.expand(*add.shape[:2], m1 - m0, p.n1 - p.n0)
    empty = ~(add[0] > float("-inf")).any(-1)  # (G or 1, rows): rows that see no key here
    return add, (empty if bool(empty.any()) else None)


def _item_forward(ops_cpu: _CpuOps, q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec,
                  band: Band, mask4: Tensor | None, b: int, hk: int, G: int, m0: int, m1: int,
                  n_lo: int, n_hi: int) -> tuple[Tensor, Tensor] | None:
    """One item's forward: rows [m0, m1) of batch row b, kv head hk's G query heads, against
    keys [n_lo, n_hi) → (out (G, rows, Dv) in the accumulation dtype or q's, lse (G, rows)),
    or None when the band leaves the item no key."""
    heads = slice(hk * G, (hk + 1) * G)
    qb = q[b:b + 1, heads, m0:m1]  # (1, G, rows, D)
    outs, lses = [], []
    for p in pieces(band, m0, m1, k.shape[2]):
        n0, n1 = max(p.n0, n_lo), min(p.n1, n_hi)
        if n0 >= n1:
            continue
        if (n0, n1) != (p.n0, p.n1):  # a split-KV range cuts the piece
            causal = p.causal and n0 == p.n0
            p = Piece(n0, n1, causal, p.masked or (p.causal and not causal))
        add, empty = _piece_mask(band, mask4, b, heads, m0, m1, p, q.dtype, q.device)
        kb = k[b:b + 1, hk:hk + 1, p.n0:p.n1]
        vb = v[b:b + 1, hk:hk + 1, p.n0:p.n1]
        o, lse = ops_cpu.fwd(qb, kb, vb, 0.0, p.causal and add is None, attn_mask=add,
                             scale=spec.qk_scale)
        o, lse = o[0], lse[0]
        if empty is not None:  # torch's kernel gives lse 0 to a row that saw no key
            lse = lse.masked_fill(empty.expand_as(lse), float("-inf"))
        outs.append(o)
        lses.append(lse)
    if not outs:
        return None
    if len(outs) == 1:
        return outs[0], lses[0]
    return _merge_trusted(outs, lses)


def _plan_items(q: Tensor, k: Tensor, spec: LaunchSpec, ops: Operands, config: FusedConfig):
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    band = spec.local_band()
    chunk = kv_split(Nq, Nk, config)
    if chunk is not None:
        blocks = [(0, Nq)]
        ranges = [(n0, min(n0 + chunk, Nk)) for n0 in range(0, Nk, chunk)]
    else:
        blocks = query_blocks(band, Nq, Nk, Hkv, ops.attn_mask is not None, config)
        ranges = [(0, Nk)]
    return band, blocks, ranges


def _threads(q: Tensor, scores: int, config: FusedConfig) -> int | None:
    if torch.compiler.is_compiling():
        return 0
    return 1 if scores < config.serial_max_scores else None


def _fwd(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec, ops: Operands = Operands(), *,
         config: FusedConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """``(out (B, H, Nq, Dv) in q's dtype, lse (B, H, Nq) in the accumulation dtype)``."""
    ops_cpu = _cpu_ops()
    if isinstance(ops_cpu, str):
        raise NotImplementedError(f"backend='fused' is off: {ops_cpu}")
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    band, blocks, ranges = _plan_items(q, k, spec, ops, config)
    mask4 = None if ops.attn_mask is None else as_4d(ops.attn_mask)
    R = len(ranges)
    out = torch.empty(B, H, Nq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Nq, dtype=acc, device=q.device)
    if R > 1:
        parts_out = torch.empty(R, B, H, Nq, Dv, dtype=q.dtype, device=q.device)
        parts_lse = torch.empty(R, B, H, Nq, dtype=acc, device=q.device)
    items = [(b, hk, bi, r) for bi in range(len(blocks)) for r in range(R)
             for b in range(B) for hk in range(Hkv)]

    def run(i: int) -> None:
        b, hk, bi, r = items[i]
        m0, m1 = blocks[bi]
        heads = slice(hk * G, (hk + 1) * G)
        res = _item_forward(ops_cpu, q, k, v, spec, band, mask4, b, hk, G, m0, m1, *ranges[r])
        o_to, l_to = (out, lse) if R == 1 else (parts_out[r], parts_lse[r])
        if res is None:
            o_to[b, heads, m0:m1] = 0.0
            l_to[b, heads, m0:m1] = float("-inf")
        else:
            o_to[b, heads, m0:m1] = res[0]
            l_to[b, heads, m0:m1] = res[1]

    workers.run_items(run, len(items), threads=_threads(q, B * H * Nq * Nk, config))
    if R > 1 or ops.sinks is not None:
        outs = [out] if R == 1 else list(parts_out.unbind(0))
        lses = [lse] if R == 1 else list(parts_lse.unbind(0))
        if ops.sinks is not None:  # one more partial of value 0, in the denominator once
            outs.append(torch.zeros_like(outs[0]))
            lses.append(ops.sinks.to(acc).view(1, H, 1).expand(B, H, Nq))
        merged, merged_lse = _merge_trusted(outs, lses)
        out.copy_(merged)
        lse = merged_lse
    return out, lse


def _bwd(do: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
         lse: Tensor, spec: LaunchSpec, ops: Operands = Operands(), *,
         config: FusedConfig = DEFAULT) -> Grads:
    """Gradients of a fused forward from its merged ``out`` and ``lse``: dq, dk, dv in the
    accumulation dtype, and the sinks'. ``dlse`` must be None (the autograd.Function hands a
    call whose lse output has a gradient to the tiled backward)."""
    assert dlse is None, "a gradient through the lse is the tiled backward's"
    ops_cpu = _cpu_ops()
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    acc = _acc_dtype(q.dtype)
    band = spec.local_band()
    blocks = query_blocks(band, Nq, Nk, Hkv, ops.attn_mask is not None, config)
    mask4 = None if ops.attn_mask is None else as_4d(ops.attn_mask)
    # rows with no key: lse -inf would give exp(s + inf); +inf gives P = 0 there
    lse_in = lse.masked_fill(lse == float("-inf"), float("inf"))
    dq = torch.empty(B, H, Nq, D, dtype=acc, device=q.device)
    dk = torch.zeros(B, Hkv, Nk, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, Nk, Dv, dtype=acc, device=q.device)
    items = [(b, hk) for b in range(B) for hk in range(Hkv)]
    do = do.to(q.dtype)

    def run(i: int) -> None:
        b, hk = items[i]
        heads = slice(hk * G, (hk + 1) * G)
        for m0, m1 in blocks:
            dq_blk = dq[b, heads, m0:m1]
            dq_blk.zero_()
            qb, dob, ob = (t[b:b + 1, heads, m0:m1] for t in (q, do, out))
            lb = lse_in[b:b + 1, heads, m0:m1]
            for p in pieces(band, m0, m1, Nk):
                add, _ = _piece_mask(band, mask4, b, heads, m0, m1, p, q.dtype, q.device)
                kb = k[b:b + 1, hk:hk + 1, p.n0:p.n1]
                vb = v[b:b + 1, hk:hk + 1, p.n0:p.n1]
                gq, gk, gv = ops_cpu.bwd(dob, qb, kb, vb, ob, lb, 0.0,
                                         p.causal and add is None, attn_mask=add,
                                         scale=spec.qk_scale)
                dq_blk += gq[0]
                dk[b, hk, p.n0:p.n1] += gk[0, 0]
                dv[b, hk, p.n0:p.n1] += gv[0, 0]

    workers.run_items(run, len(items), threads=_threads(q, B * H * Nq * Nk, config))
    dsinks = None
    if ops.sinks is not None:
        delta = (do.to(acc) * out.to(acc)).sum(-1)
        dsinks = sink_grad(ops.sinks, lse.to(acc), delta)
    return Grads(dq, dk, dv, None, dsinks, None, ())


# -- autograd and the public function ----------------------------------------------------------

class _FusedAttention(torch.autograd.Function):
    """Saves q, k, v, out, lse (and the mask, sinks); the backward runs torch's backward op
    per piece. A gradient reaching the lse output goes to the tiled backward instead, through
    ``lse_backward`` (the caller's: this backend does not import another)."""

    @staticmethod
    def forward(ctx, q, k, v, spec: LaunchSpec, config: FusedConfig, lse_backward, attn_mask,
                sinks):
        ops = Operands(attn_mask=attn_mask, sinks=sinks)
        out, lse = _fwd(q, k, v, spec, ops, config=config)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, sinks)
        ctx.spec, ctx.config, ctx.lse_backward = spec, config, lse_backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, sinks = ctx.saved_tensors
        ops = Operands(attn_mask=attn_mask, sinks=sinks)
        do = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is not None and bool((dlse != 0).any()):
            if ctx.lse_backward is None:
                raise NotImplementedError(
                    "backend='fused': the lse output has a gradient, which torch's backward "
                    "op does not take; attn.attention hands it to the tiled backward")
            g = ctx.lse_backward(do, dlse, q, k, v, out, lse, ctx.spec, ops)
        else:
            g = _bwd(do, None, q, k, v, out, lse, ctx.spec, ops, config=ctx.config)
        dsinks = None if g.dsinks is None else g.dsinks.to(sinks.dtype)
        return (g.dq.to(q.dtype), g.dk.to(k.dtype), g.dv.to(v.dtype), None, None, None, None,
                dsinks)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, spec: LaunchSpec,
                    operands: Operands | None = None, *, config: FusedConfig = DEFAULT,
                    lse_backward: Callable | None = None) -> tuple[Tensor, Tensor]:
    """Exact attention on torch's fused kernels, per piece of attn's plan. Inputs validated.

    q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, D) → out (B, H, Nq, D) in q's dtype,
    lse (B, H, Nq) float32 (float64 for float64). ``spec`` as the other backends' (a tensor
    temperature already folded into q); ``operands``: a bool or float mask (no gradient),
    sinks (H,). ``lse_backward(do, dlse, q, k, v, out, lse, spec, ops) -> Grads``: the
    backward used when the lse output receives a gradient (torch's backward op has no lse
    term); without it such a gradient raises."""
    ops = operands or Operands()
    why = spec_reason(spec, ops) or ops_reason(q.device.type)
    if why is not None:
        raise NotImplementedError(f"backend='fused' cannot compute this call: {why}")
    return _FusedAttention.apply(q, k, v, spec, config, lse_backward, ops.attn_mask, ops.sinks)
