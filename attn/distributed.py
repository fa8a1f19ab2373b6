"""Context parallelism on torch.distributed: ring attention (zigzag-balanced) and Ulysses.

One sequence is sharded along N across the P processes of a group (gloo on CPU, NCCL on
GPU)::

    import attn.distributed as cp

    q_l = cp.shard_sequence(q)                          # this rank's part of dim 2
    out_l = cp.ring_attention(q_l, k_l, v_l, causal=True)
    out = cp.gather_sequence(out_l)                     # the full sequence on every rank

The functions are collectives (every rank calls them in the same order, backward too). The
layouts, the validation all-gather, the gradients of replicated tensors, the ring and
Ulysses steps, the tests and the measurements: docs/context-parallel.md.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attn import fused
from attn.call import _check_tensor, _validate_qkv, acc_dtype, resolve, run, select_backend
from attn.call import _draw_seed as _local_seed
from attn.grads import call_sink_grad, reduce_to
from attn.masks import Band, make_band, window_pair
from attn.merge import _merge_trusted
from attn.spec import LaunchSpec, Operands, all_finite

LAYOUTS = ("zigzag", "contiguous")
_TAG_KV, _TAG_DKV = 11, 12  # distinct tags: a K/V and a dK/dV message may be in flight at once


# -- layouts -----------------------------------------------------------------------------------

def shard_ranges(n: int, world_size: int, layout: str = "zigzag") -> list[list[tuple[int, int]]]:
    """Global ``[start, end)`` ranges each rank holds, in its local order (empty ones kept)."""
    _check_layout(layout)
    for name, x, low, what in (("n", n, 0, "a non-negative"),
                               ("world_size", world_size, 1, "a positive")):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be {what} int, got {x!r}")
        if x < low:
            raise ValueError(f"{name} must be {what} int, got {x!r}")
    P = world_size
    parts = 2 * P if layout == "zigzag" else P
    # where torch.tensor_split(x, parts) cuts a dim of length n: the first n % parts chunks
    # one longer
    cuts = [r * (n // parts) + min(r, n % parts) for r in range(parts + 1)]
    bounds = list(zip(cuts, cuts[1:]))
    if layout == "contiguous":
        return [[bounds[r]] for r in range(P)]
    return [[bounds[r], bounds[2 * P - 1 - r]] for r in range(P)]


def shard_positions(n: int, layout: str = "zigzag", group=None,
                    device: torch.device | str | None = None) -> Tensor:
    """Global positions (int64) of this rank's shard of a length-n sequence (e.g. for RoPE)."""
    rank, P = _world(group)
    return torch.cat([torch.arange(a, b, device=device) for a, b in
                      shard_ranges(n, P, layout)[rank]])


def _check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("attn.distributed needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group (torchrun sets the env)")
    return dist.get_rank(group), dist.get_world_size(group)


def _peer(group, rank: int) -> int:
    """The global rank P2P ops expect for ``rank`` of ``group``."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _lengths(ranges: list[list[tuple[int, int]]]) -> list[int]:
    """Each rank's number of positions."""
    return [sum(b - a for a, b in rs) for rs in ranges]


# -- shard / gather ----------------------------------------------------------------------------

def _take(x: Tensor, ranges: list[tuple[int, int]], dim: int) -> Tensor:
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _place(out: Tensor, parts: list[Tensor], ranges: list[list[tuple[int, int]]], dim: int
           ) -> Tensor:
    """``out`` with each rank's shard ``parts[r]`` written at its global ``ranges[r]`` along
    ``dim``: the inverse of :func:`_take` for every rank at once."""
    for part, rs in zip(parts, ranges):
        for l0, l1, a in _pieces(rs):
            out.narrow(dim, a, l1 - l0).copy_(part.narrow(dim, l0, l1 - l0))
    return out


def _all_gather_seq(x_l: Tensor, layout: str, group, dim: int) -> Tensor:
    """Every rank's shard (sizes may differ by one chunk) assembled in global order."""
    rank, P = _world(group)
    n_l = torch.tensor([x_l.shape[dim]], dtype=torch.int64, device=x_l.device)
    lens = [torch.empty_like(n_l) for _ in range(P)]
    dist.all_gather(lens, n_l, group=group)
    lens = [int(t) for t in lens]
    n = sum(lens)
    want = _lengths(shard_ranges(n, P, layout))
    if lens != want:
        raise ValueError(f"gather_sequence: shard lengths {lens} along dim {dim} are not the "
                         f"{layout!r} split of N = {n} over {P} ranks ({want})")
    before, after = x_l.shape[:dim], x_l.shape[dim + 1:]
    # gloo's all_gather needs equal shapes: pad the short shards (by at most 2 positions)
    pad = x_l.new_zeros(*before, max(lens) - x_l.shape[dim], *after)
    x_p = torch.cat([x_l, pad], dim=dim).contiguous()
    parts = [torch.empty_like(x_p) for _ in range(P)]
    dist.all_gather(parts, x_p, group=group)
    return _place(x_l.new_empty(*before, n, *after), parts, shard_ranges(n, P, layout), dim)


def _shard_or_gather(x: Tensor, to_full: bool, layout: str, group, dim: int) -> Tensor:
    """The full tensor from every rank's shard (``to_full``), or this rank's shard of it."""
    if to_full:
        return _all_gather_seq(x.contiguous(), layout, group, dim)
    rank, P = _world(group)
    return _take(x, shard_ranges(x.shape[dim], P, layout)[rank], dim)


class _Inverse(torch.autograd.Function):
    """``move(x, True)``, whose backward is ``move(g, False)``: a collective whose gradient
    is its inverse (shard and gather, the all-to-alls of sequence and head shards)."""

    @staticmethod
    def forward(ctx, x, move):
        ctx.move = move
        return move(x, True)

    @staticmethod
    def backward(ctx, g):
        return ctx.move(g, False), None


def shard_sequence(x: Tensor, layout: str = "zigzag", group=None, *, dim: int = 2) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (2: the N of (B, H, N, D)).

    ``x`` is the full tensor, the same on every rank. Differentiable: the gradient of ``x``
    is gathered from every rank, so it is complete when the loss is computed identically on
    every rank (e.g. from :func:`gather_sequence`'s output).
    """
    _check_layout(layout)
    _check_tensor("x", x)
    rank, P = _world(group)
    if x.dim() <= dim or x.shape[dim] < P:
        raise ValueError(f"shard_sequence: x of shape {tuple(x.shape)} needs a dim {dim} of "
                         f"length >= {P} (the world size) so that no rank is empty")
    # the gradient of a replicated input under a replicated loss: every rank's part gathered
    return _Inverse.apply(x, lambda t, fwd: _shard_or_gather(t, not fwd, layout, group, dim))


def gather_sequence(x_l: Tensor, layout: str = "zigzag", group=None, *, dim: int = 2) -> Tensor:
    """The full tensor on every rank from each rank's shard along ``dim`` (2: the N of
    (B, H, N, D), and of an lse (B, H, N)). Differentiable: the gradient of the shard is
    its part of the gradient of the output (the loss must be computed the same on every
    rank, as it then is)."""
    _check_layout(layout)
    _check_tensor("x_l", x_l)
    if x_l.dim() <= dim:
        raise ValueError(f"gather_sequence: x_l of shape {tuple(x_l.shape)} has no dim {dim}")
    # each rank computes the same loss from the gathered tensor: its part, no sum needed
    return _Inverse.apply(x_l, lambda t, fwd: _shard_or_gather(t, fwd, layout, group, dim))


# -- validation: locally, then one all-gather so that every rank raises together ---------------

@dataclass
class _Call:
    """One context-parallel call, resolved: what every rank agreed on."""

    rank: int
    P: int
    group: Any
    layout: str
    q_ranges: list[list[tuple[int, int]]]  # per rank, global query ranges
    k_ranges: list[list[tuple[int, int]]]
    spec: LaunchSpec
    backend: str
    extra: dict = field(default_factory=dict)


def _check_local(strategy: str, q, k, v, *, causal, layout, scale, temperature, softcap,
                 window, sinks, dropout_p, backend, attn_mask) -> tuple[dict, tuple]:
    """This rank's checks: its record (everything the others must agree with), and its call
    resolved by :func:`attn.call.resolve` (the band and the seed are set once the ranks
    agree on the global lengths)."""
    _check_layout(layout)
    _validate_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = window_pair(window)
    if attn_mask is not None:
        raise NotImplementedError(
            f"{strategy}: attn_mask is not supported: a mask over the global (Nq, Nk) would "
            f"have to be sharded along both queries and keys and travel with the keys; "
            f"express causal/sliding masks with causal= and window=")
    if backend not in ("auto", "tiled", "fused", "triton"):
        raise NotImplementedError(
            f"{strategy}: backend={backend!r}: context parallelism runs attn's launchers with "
            f"global positions; use 'auto', 'tiled', 'fused' or 'triton'")
    # every keyword checked and folded as attention does it
    resolved = resolve(q, k, v, band=Band(), scale=scale, temperature=temperature,
                       softcap=softcap, sinks=sinks, dropout_p=dropout_p, dropout_seed=0,
                       return_lse=True)
    record = dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dtype=str(q.dtype),
                  device=q.device.type, causal=causal, window=window, layout=layout,
                  scale=scale, dropout_p=float(dropout_p), backend=backend,
                  temperature=_kind(temperature), softcap=_kind(softcap),
                  sinks=None if sinks is None else tuple(sinks.shape),
                  keys_finite=_keys_finite(k, backend))
    return record, resolved


def _keys_finite(k: Tensor, backend: str) -> bool:
    """Whether this rank's keys are all finite where fused may run on CPU, as attn.call.run
    checks per call (elsewhere True without looking): docs/context-parallel.md, "Ring"."""
    if backend not in ("auto", "fused") or k.device.type != "cpu" or k.numel() == 0:
        return True
    return all_finite(k)


def _kind(x) -> Any:
    return ("tensor", tuple(x.shape)) if isinstance(x, Tensor) else x


def _agree(strategy: str, group, local: dict | Exception) -> list[dict]:
    """All-gather every rank's record (or error); raise the same error on every rank."""
    _, P = _world(group)
    mine = (type(local).__name__, str(local)) if isinstance(local, Exception) else local
    records: list[Any] = [None] * P
    dist.all_gather_object(records, mine, group=group)
    if isinstance(local, Exception):
        raise local
    for r, rec in enumerate(records):
        if isinstance(rec, tuple):
            kind = {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(
                rec[0], ValueError)
            raise kind(f"{strategy}: rank {r} refused its input: {rec[1]}")
    ref = records[0]
    for r, rec in enumerate(records[1:], start=1):
        for key in ("dtype", "device", "causal", "window", "layout", "scale", "dropout_p",
                    "backend", "temperature", "softcap", "sinks"):
            if rec[key] != ref[key]:
                raise ValueError(f"{strategy}: ranks disagree on {key}: rank 0 has "
                                 f"{ref[key]!r}, rank {r} has {rec[key]!r}")
        for name in ("q", "k", "v"):
            a, b = ref[name], rec[name]
            if a[:2] != b[:2] or a[3] != b[3]:
                raise ValueError(f"{strategy}: {name} shapes disagree outside the sequence "
                                 f"dim: rank 0 {a}, rank {r} {b}")
    for name in ("q", "k"):
        lens = [rec[name][2] for rec in records]
        want = _lengths(shard_ranges(sum(lens), P, ref["layout"]))
        if lens != want:
            bad = ", ".join(f"rank {r} has {a}, expected {b}"
                            for r, (a, b) in enumerate(zip(lens, want)) if a != b)
            raise ValueError(
                f"{strategy}: {name} shard lengths {lens} are not the {ref['layout']!r} split "
                f"of N = {sum(lens)} over {P} ranks ({want}): {bad}; use shard_sequence")
    return records


def _draw_seed(dropout_p: float, group) -> int:
    """attention's seed draw on every rank (generators stay in step), rank 0's value wins."""
    if dropout_p == 0.0:
        return 0
    seed = torch.tensor([_local_seed(dropout_p)], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        seed = seed.cuda()
    dist.broadcast(seed, src=_peer(group, 0), group=group)
    return int(seed.item())


def _prepare(strategy: str, q, k, v, *, group, **kw) -> tuple["_Call", Operands]:
    """Validate on every rank (so bad input on one raises on all), then set the global band
    and the shared dropout seed on the call :func:`attn.call.resolve` made; ``kw``: the
    public function's keywords but ``group`` and ``return_lse``."""
    rank, P = _world(group)
    layout = kw["layout"]
    try:
        local, (call, spec, ops) = _check_local(strategy, q, k, v, **kw)
        if strategy == "ulysses_attention":
            _ulysses_heads(q.shape[1], k.shape[1], P)
    except (ValueError, TypeError, NotImplementedError) as exc:
        local = exc
    records = _agree(strategy, group, local)
    q_lens, k_lens = ([r[name][2] for r in records] for name in ("q", "k"))  # per rank
    n_q, n_k = sum(q_lens), sum(k_lens)
    band = make_band(n_q, n_k, causal=kw["causal"], window=window_pair(kw["window"]))
    spec = replace(spec, band=band, dropout_seed=_draw_seed(float(kw["dropout_p"]), group))
    # the shape one launch sees, the same on every rank: the ring's largest (local queries,
    # one rank's keys) pair, Ulysses' whole sequence
    shape = (dict(n_q=max(q_lens), n_k=max(k_lens)) if strategy == "ring_attention"
             else dict(n_q=n_q, n_k=n_k))
    choice = select_backend(replace(call, band=band, **shape), kw["backend"])
    name, reason = choice.name, choice.reason
    if name == "fused":
        why = _fused_refuses(spec, ops, band, records)
        if why is not None:
            name, reason = "tiled", f"{reason}; tiled instead: {why}"
    c = _Call(rank=rank, P=P, group=group, layout=layout,
              q_ranges=shard_ranges(n_q, P, layout), k_ranges=shard_ranges(n_k, P, layout),
              spec=spec, backend=name, extra={"reason": reason})
    return c, ops


def _fused_refuses(spec: LaunchSpec, ops: Operands, band: Band, records: list[dict]
                   ) -> str | None:
    """Why a call :func:`select_backend` gave to fused must run on tiled after all, or None.
    A ring step's spec is the call's with other ``q_start`` / ``k_start`` (which fused reads),
    and its operands are the learnable softcap alone, so checking the call's spec once covers
    every step (the sinks and a tensor temperature never reach a launcher)."""
    why = fused.spec_reason(spec, Operands(softcap=ops.softcap))
    if why is None and not band.is_full and not all(r["keys_finite"] for r in records):
        why = ("a non-finite key under a causal / window band (torch's kernel would let a "
               "hidden NaN key reach its rows; tiled never reads a hidden key's score)")
    return why


def _rows(c: _Call, t: Tensor, rows: slice) -> Tensor:
    """Query rows of a per-query tensor for a launch: a view for tiled; a contiguous copy
    for triton, whose backward indexes lse and Δ as if (B, H, Nq) were contiguous."""
    t = t[:, :, rows]
    return t.contiguous() if c.backend == "triton" else t


def _launchers(backend: str):
    """The launchers of a ring step: ``fwd(q, k, v, spec, ops) -> (out, lse)`` and
    ``bwd(do, dlse, q, k, v, out, lse, spec, ops, need_dcap=) -> Grads``, of the backend the
    call chose (``tiled``, ``fused`` or ``triton``). Looked up at each call, so a test that
    wraps a backend's ``_fwd`` / ``_bwd`` sees the ring's launches."""
    if backend == "fused":
        # a fused step never has a softcap (refused in _fused_refuses), so need_dcap asks for
        # nothing; no precise recompute (docs/context-parallel.md, "Ring")
        return fused._fwd, lambda *a, need_dcap=False: fused._bwd(*a)
    if backend == "triton":
        from attn import flash_triton as mod
    else:
        from attn import tiled as mod
    return mod._fwd, mod._bwd


# -- ring attention ----------------------------------------------------------------------------

@dataclass
class RingStats:
    """What the last call on this rank did (for tests and benchmarks): K/V transfers,
    (query chunk, key chunk) launches run and skipped, and the seconds spent waiting on
    communication (ring: waits after the overlapped compute; Ulysses: the all-to-alls)."""

    kv_exchanges: int = 0
    dkv_exchanges: int = 0
    launches: int = 0
    skipped: int = 0
    comm_wait_s: float = 0.0
    # the launchers the ring's steps ran ("tiled", "fused", "triton") and why that backend
    # (select_backend's reason, and why not fused where fused was refused after it); "" for
    # Ulysses, whose one local call goes through attn.call.run
    backend: str = ""
    reason: str = ""


# Each thread's last call: its RingStats, read as cp.last_ring_stats (the forward),
# cp.last_ring_backward_stats (the backward of that forward, filled wherever autograd runs it)
# and cp.last_ulysses_stats (comm_wait_s: the all-to-alls, forward + backward). Per thread:
# two threads calling ring_attention each read their own.
_LAST_STATS = ("last_ring_stats", "last_ring_backward_stats", "last_ulysses_stats")
_last = threading.local()


def _new_stats(name: str) -> RingStats:
    """Fresh stats for a call, recorded as this thread's ``name`` (one of _LAST_STATS)."""
    stats = RingStats()
    setattr(_last, name, stats)
    return stats


def __getattr__(name: str) -> Any:
    if name in _LAST_STATS:
        return getattr(_last, name, None) or RingStats()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def _timed(stats: RingStats):
    """Add the time spent in a blocking wait (a ring hop, an all-to-all) to ``stats``."""
    t0 = time.perf_counter()
    yield
    stats.comm_wait_s += time.perf_counter() - t0


def _pieces(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Non-empty ``(local_start, local_end, global_start)`` pieces of one rank's ranges."""
    ends = itertools.accumulate(b - a for a, b in ranges)
    return [(end - (b - a), end, a) for end, (a, b) in zip(ends, ranges) if b > a]


def _step_pairs(c: _Call, src: int, stats: RingStats):
    """``(qi, rows, ki, spec)`` for each (local query piece, piece of rank ``src``'s keys) of
    the step that holds ``src``'s K/V that the band leaves any pair of (the others counted as
    skipped): the pieces' indices, the query rows, and the spec with both pieces' global
    positions."""
    for qi, (ql0, ql1, qg) in enumerate(_pieces(c.q_ranges[c.rank])):
        for ki, (kl0, kl1, kg) in enumerate(_pieces(c.k_ranges[src])):
            spec = c.spec.shard(q_start=qg, k_start=kg)
            n_q, n_k = ql1 - ql0, kl1 - kl0
            if not any(spec.blocks(n_q, n_k, n_q, n_k).tiles):  # one tile over both pieces
                stats.skipped += 1
                continue
            stats.launches += 1
            yield qi, slice(ql0, ql1), ki, spec


def _pack(c: _Call, src: int, *ts: Tensor) -> Tensor:
    """K and V (or dK and dV) of rank ``src`` as one flat buffer, piece by piece, so that a
    visiting piece unpacks to a contiguous view (no copy per step) and one message moves all."""
    pieces = _pieces(c.k_ranges[src])
    return torch.cat([t[:, :, a:b].reshape(-1) for t in ts for a, b, _ in pieces])


def _unpack(c: _Call, flat: Tensor, src: int, widths: tuple[int, ...], like: Tensor
            ) -> list[list[Tensor]]:
    """The inverse of :func:`_pack`: for each packed tensor, its pieces (B, Hkv, n, width)."""
    B, Hkv = like.shape[:2]
    pieces = _pieces(c.k_ranges[src])
    parts = iter(flat.split([B * Hkv * (b - a) * w for w in widths for a, b, _ in pieces]))
    return [[next(parts).view(B, Hkv, b - a, w) for a, b, _ in pieces] for w in widths]


def _kv_numel(c: _Call, k: Tensor, v: Tensor, src: int) -> int:
    B, Hkv = k.shape[:2]
    return B * Hkv * _lengths(c.k_ranges)[src] * (k.shape[-1] + v.shape[-1])


class _Transfer:
    """One ring hop: send ``flat`` to the next rank, receive ``n`` elements from the previous,
    posted at once (``batch_isend_irecv``) and waited for later, so compute runs meanwhile."""

    def __init__(self, c: _Call, flat: Tensor, n: int, tag: int, stats: RingStats) -> None:
        self.sent = flat  # alive until waited: the send reads it asynchronously
        self.buf = torch.empty(n, dtype=flat.dtype, device=flat.device)
        nxt, prv = _peer(c.group, (c.rank + 1) % c.P), _peer(c.group, (c.rank - 1) % c.P)
        ops = [dist.P2POp(dist.isend, flat, nxt, c.group, tag),
               dist.P2POp(dist.irecv, self.buf, prv, c.group, tag)]
        self.reqs = dist.batch_isend_irecv(ops)
        self.stats = stats

    def wait(self) -> Tensor:
        with _timed(self.stats):
            for r in self.reqs:
                r.wait()
        return self.buf


def _ring_steps(c: _Call, k: Tensor, v: Tensor, stats: RingStats):
    """``(src, k_s, v_s)`` for each ring step: rank ``src``'s K/V pieces. The next K/V is
    posted before the step is handed out and waited for when the next step is asked for, so
    the caller's compute (and its own dK/dV hop) runs while it travels."""
    kv = _pack(c, c.rank, k, v)
    for step in range(c.P):
        src = (c.rank - step) % c.P
        hop = None
        if step < c.P - 1:  # post the next K/V before computing on this one
            hop = _Transfer(c, kv, _kv_numel(c, k, v, (src - 1) % c.P), _TAG_KV, stats)
            stats.kv_exchanges += 1
        k_s, v_s = _unpack(c, kv, src, (k.shape[-1], v.shape[-1]), k)
        yield src, k_s, v_s
        if hop is not None:
            kv = hop.wait()


def _ring_fwd(c: _Call, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None,
              cap_t: Tensor | None) -> tuple[Tensor, Tensor]:
    stats = _new_stats("last_ring_stats")
    c.extra["backward_stats"] = _new_stats("last_ring_backward_stats")
    fwd, _ = _launchers(c.backend)
    stats.backend, stats.reason = c.backend, c.extra["reason"]
    ops = Operands(softcap=cap_t)  # the sinks join once, as one more partial below
    B, H, n_l, _ = q.shape
    acc = acc_dtype(q.dtype)
    q_pieces = _pieces(c.q_ranges[c.rank])
    # the running state, merged piece by piece; the sinks are one more partial, zero values
    out = torch.zeros(B, H, n_l, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((B, H, n_l), float("-inf"), dtype=acc, device=q.device)
    if sinks is not None:
        lse = sinks.detach().to(acc).view(1, H, 1).expand_as(lse).clone()
    for src, k_s, v_s in _ring_steps(c, k, v, stats):
        partials: list[list[tuple[Tensor, Tensor]]] = [[] for _ in q_pieces]
        for qi, rows, ki, spec in _step_pairs(c, src, stats):
            partials[qi].append(fwd(_rows(c, q, rows), k_s[ki], v_s[ki], spec, ops))
        for (ql0, ql1, _), parts in zip(q_pieces, partials):
            if parts:  # the running state first: the merge keeps its (accumulation) dtype
                r = slice(ql0, ql1)
                out[:, :, r], lse[:, :, r] = _merge_trusted(
                    [out[:, :, r]] + [p[0] for p in parts], [lse[:, :, r]] + [p[1] for p in parts])
    return out.to(v.dtype), lse


def _ring_bwd(c: _Call, do, dlse, q, k, v, out, lse, sinks, cap_t, need_dcap: bool):
    # the forward's caller reads these (autograd may run this on another thread); zeroed, so
    # a second backward of the same graph counts afresh
    stats = c.extra["backward_stats"]
    vars(stats).update(vars(RingStats(backend=c.backend, reason=c.extra["reason"])))
    _, bwd = _launchers(c.backend)
    ops = Operands(softcap=cap_t)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dcap = (torch.zeros(q.shape[1], dtype=acc, device=q.device)
            if cap_t is not None and need_dcap else None)
    widths = (k.shape[-1], v.shape[-1])
    dkv_hop = None
    for src, k_s, v_s in _ring_steps(c, k, v, stats):
        # dK/dV of the visiting pieces, packed like them, in the accumulation dtype
        dkv = torch.zeros(_kv_numel(c, k, v, src), dtype=acc, device=q.device)
        dk_s, dv_s = _unpack(c, dkv, src, widths, k)
        for qi, rows, ki, spec in _step_pairs(c, src, stats):
            # the global out and lse: P = exp(s − lse) and Δ are those of the unsharded call
            g = bwd(_rows(c, do, rows), _rows(c, dlse, rows), _rows(c, q, rows), k_s[ki],
                    v_s[ki], _rows(c, out, rows), _rows(c, lse, rows), spec, ops,
                    need_dcap=dcap is not None)
            dq[:, :, rows] += g.dq
            dk_s[ki] += g.dk
            dv_s[ki] += g.dv
            if dcap is not None:
                dcap += g.dsoftcap
        if dkv_hop is not None:  # what earlier ranks added for these K/V, sent last step
            dkv += dkv_hop.wait()
        if c.P > 1:  # dK/dV follow their K/V; after the last step they reach the owner
            dkv_hop = _Transfer(c, dkv, _kv_numel(c, k, v, (src - 1) % c.P), _TAG_DKV, stats)
            stats.dkv_exchanges += 1
    if dkv_hop is not None:
        dkv = dkv_hop.wait()
    dk, dv = (torch.cat(parts, dim=2) for parts in _unpack(c, dkv, c.rank, widths, k))
    return dq, dk, dv, call_sink_grad(sinks, do, dlse, out, lse, acc), dcap


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cap_t, c: _Call):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _ring_fwd(c, q, k, v, sinks, cap_t)
        ctx.save_for_backward(q, k, v, out, lse, sinks, cap_t)
        ctx.c = c
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, cap_t = ctx.saved_tensors  # dout, dlse: zeros where unused
        dq, dk, dv, dsinks, dcap = _ring_bwd(ctx.c, dout.contiguous(), dlse, q, k, v, out, lse,
                                             sinks, cap_t, bool(ctx.needs_input_grad[4]))
        if dcap is not None:
            dcap = reduce_to(dcap, cap_t.shape).to(cap_t.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if dsinks is None else dsinks.to(sinks.dtype), dcap, None)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group=None,
    scale: float | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | Tensor | None = None,
    window: tuple[int, int] | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    attn_mask: None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Ring attention over the sequence shards of ``group`` (see the module docstring).

    q (B, H, Nq_r, D), k (B, Hkv, Nk_r, D), v (B, Hkv, Nk_r, Dv): this rank's shards in
    ``layout`` (as :func:`shard_sequence` cuts them) → out (B, H, Nq_r, Dv), and with
    ``return_lse`` the lse (B, H, Nq_r), float32 (float64 for float64 input). Every keyword
    means what it means in :func:`attn.attention` on the full sequence: ``causal`` and
    ``window`` in the *global* (Nq, Nk), ``dropout_p`` the unsharded call's mask under the
    same ``torch.manual_seed`` (docs/context-parallel.md, "Variants").
    ``attn_mask`` raises NotImplementedError. ``backend``: ``"auto"``, ``"tiled"``,
    ``"fused"`` or ``"triton"``, the launchers every step runs (:data:`last_ring_stats`'s
    ``backend`` and ``reason`` say which ran and why).
    Gradients of sinks / tensor temperature / tensor softcap are this rank's contribution.
    """
    c, ops = _prepare(
        "ring_attention", q, k, v, causal=causal, layout=layout, group=group, scale=scale,
        temperature=temperature, softcap=softcap, window=window, sinks=sinks,
        dropout_p=dropout_p, backend=backend, attn_mask=attn_mask)
    q_in = q if ops.q_scale is None else q.to(ops.q_scale.dtype) * ops.q_scale
    out, lse = _RingAttention.apply(q_in, k, v, sinks, ops.softcap, c)
    return (out, lse) if return_lse else out


# -- Ulysses -----------------------------------------------------------------------------------

def _ulysses_heads(H: int, Hkv: int, P: int) -> int:
    """How many times each KV head is replicated (1: none); raises when heads do not split."""
    if H % P != 0:
        raise ValueError(f"ulysses_attention splits heads over the group: H = {H} query heads "
                         f"do not divide over P = {P} ranks (H % P must be 0; use "
                         f"ring_attention for any head count)")
    if Hkv % P == 0:
        return 1
    if P % Hkv == 0:
        return P // Hkv
    raise ValueError(f"ulysses_attention: Hkv = {Hkv} KV heads neither divide over P = {P} "
                     f"ranks (Hkv % P == 0) nor replicate evenly onto them (P % Hkv == 0)")


def _seq_to_head(c: _Call, x: Tensor, ranges: list[list[tuple[int, int]]]) -> Tensor:
    """(B, Hx, N_r, D) sequence shard → (B, Hx/P, N, D) head shard, global order."""
    B, Hx, n_l, D = x.shape
    hp = Hx // c.P
    lens = _lengths(ranges)
    n = sum(lens)
    sizes = [B * hp * m * D for m in lens]
    send = x.reshape(B, c.P, hp, n_l, D).transpose(0, 1).contiguous()  # (P, B, hp, N_r, D)
    recv = torch.empty(B * hp * n * D, dtype=x.dtype, device=x.device)
    with _timed(c.extra["stats"]):
        dist.all_to_all_single(recv, send.reshape(-1), sizes, [B * hp * n_l * D] * c.P,
                               group=c.group)
    parts = [part.view(B, hp, m, D) for part, m in zip(recv.split(sizes), lens)]
    return _place(x.new_empty(B, hp, n, D), parts, ranges, 2)


def _head_to_seq(c: _Call, x: Tensor, ranges: list[list[tuple[int, int]]]) -> Tensor:
    """(B, Hx/P, N, D) head shard → (B, Hx, N_r, D) sequence shard: the inverse."""
    B, hp, n, D = x.shape
    lens = _lengths(ranges)
    send = torch.cat([_take(x, rs, 2).reshape(-1) for rs in ranges])
    n_l = lens[c.rank]
    recv = torch.empty(c.P * B * hp * n_l * D, dtype=x.dtype, device=x.device)
    with _timed(c.extra["stats"]):
        dist.all_to_all_single(recv, send, [B * hp * n_l * D] * c.P,
                               [B * hp * m * D for m in lens], group=c.group)
    # (P, B, hp, N_r, D) → (B, P·hp, N_r, D)
    return recv.view(c.P, B, hp, n_l, D).transpose(0, 1).reshape(B, c.P * hp, n_l, D)


def _all_to_all(x: Tensor, c: _Call, ranges: list[list[tuple[int, int]]], to_heads: bool
                ) -> Tensor:
    """Sequence shards → head shards (``to_heads``) or back; the backward is the other way."""
    return _Inverse.apply(x, lambda t, fwd: (_seq_to_head if fwd == to_heads else _head_to_seq)(
        c, t.contiguous(), ranges))


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group=None,
    scale: float | None = None,
    temperature: float | Tensor = 1.0,
    softcap: float | Tensor | None = None,
    window: tuple[int, int] | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    attn_mask: None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """DeepSpeed-Ulysses attention (Jacobs et al. 2023): all-to-all to head shards, full-length
    attention on H/P heads, all-to-all back. Same shapes and keywords as
    :func:`ring_attention`. Needs ``H % P == 0``, and ``Hkv % P == 0`` or ``P % Hkv == 0``
    (then each KV head is sent to the P / Hkv ranks whose query heads read it); otherwise a
    ValueError on every rank. Memory per rank: the full sequence for H/P heads, O(N/P).
    """
    c, ops = _prepare(
        "ulysses_attention", q, k, v, causal=causal, layout=layout, group=group, scale=scale,
        temperature=temperature, softcap=softcap, window=window, sinks=sinks,
        dropout_p=dropout_p, backend=backend, attn_mask=attn_mask)
    c.extra["stats"] = _new_stats("last_ulysses_stats")
    B, H, _, _ = q.shape
    P, hp = c.P, H // c.P
    h0 = c.rank * hp
    rep = _ulysses_heads(H, k.shape[1], P)
    if rep > 1:  # (B, Hkv, N_r, D) → (B, P, N_r, D): KV head i on the ranks that read it
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_h = _all_to_all(q, c, c.q_ranges, True)  # (B, H/P, Nq, D)
    k_h = _all_to_all(k, c, c.k_ranges, True)  # (B, Hkv/P or 1, Nk, D)
    v_h = _all_to_all(v, c, c.k_ranges, True)
    spec = c.spec.shard(head_start=h0, heads_total=H)  # the dropout hash reads global heads
    heads = slice(h0, h0 + hp)  # this rank's query heads: their temperature, softcap, sinks
    ops_h = Operands(softcap=None if ops.softcap is None else ops.softcap.expand(H)[heads],
                     sinks=None if sinks is None else sinks[heads],
                     q_scale=None if ops.q_scale is None else ops.q_scale[:, heads])
    out_h, lse_h = run(c.backend, q_h, k_h, v_h, spec, ops_h)
    out = _all_to_all(out_h, c, c.q_ranges, False)  # (B, H, Nq_r, Dv)
    if not return_lse:
        return out
    lse = _all_to_all(lse_h.unsqueeze(-1), c, c.q_ranges, False).squeeze(-1)  # (B, H, Nq_r)
    return out, lse


# -- models ------------------------------------------------------------------------------------

@dataclass
class ContextParallel:
    """Run a model's attention across ``group`` with each rank holding a shard of the
    sequence: :meth:`apply_to` hooks every module with a ``context_parallel`` attribute
    (:class:`attn.nn.MultiHeadAttention`, the toy GPT), whose RoPE / position embeddings then
    read :meth:`positions` and whose attention runs through :meth:`attention`.

    ``shard`` cuts a full batch (any tensor, along ``dim``) and records the sequence length
    the positions refer to::

        cp = ContextParallel(layout="zigzag")
        cp.apply_to(model)
        logits_l, _ = model(cp.shard(idx, dim=1))      # (B, N_r, V): this rank's positions
    """

    group: Any = None
    layout: str = "zigzag"
    strategy: str = "ring"  # or "ulysses"
    seq_len: int | None = None  # the full N, set by shard()

    def __post_init__(self) -> None:
        _check_layout(self.layout)
        if self.strategy not in ("ring", "ulysses"):
            raise ValueError(f"strategy must be 'ring' or 'ulysses', got {self.strategy!r}")

    def shard(self, x: Tensor, dim: int = 2) -> Tensor:
        self.seq_len = x.shape[dim]
        return shard_sequence(x, self.layout, self.group, dim=dim)

    def gather(self, x_l: Tensor, dim: int = 2) -> Tensor:
        return gather_sequence(x_l, self.layout, self.group, dim=dim)

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        if self.seq_len is None:
            raise RuntimeError("ContextParallel.positions: call shard() on the batch first")
        return shard_positions(self.seq_len, self.layout, self.group, device=device)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
        run = ring_attention if self.strategy == "ring" else ulysses_attention
        return run(q, k, v, layout=self.layout, group=self.group, **kw)

    def apply_to(self, model: torch.nn.Module) -> torch.nn.Module:
        for m in model.modules():
            if hasattr(m, "context_parallel"):
                m.context_parallel = self
        return model
