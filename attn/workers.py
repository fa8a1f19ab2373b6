"""The CPU worker pool that runs a call's work items: shared by the backends that cut a call
into items (tiled, fused), so each call is one parallel region, not one OpenMP region with
its barrier per op (why: docs/design.md, "The tiled backend on CPU"). The caller and the
pool's workers pull items from one shared counter, each thread with a single intra-op thread
(:func:`run_items`); torch releases the GIL inside ops, so items run side by side. Also the
rules both backends cut items by (:func:`item_threads`, :func:`kv_split`,
:func:`page_ranges`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch
from torch import Tensor


@functools.cache
def openmp_threads() -> bool:
    """Whether intra-op threads are OpenMP's: then ``torch.set_num_threads`` in a worker
    thread sets that thread's own count (OpenMP keeps it per thread, as MKL and oneDNN do).
    Under torch's native pool it would resize the one shared pool, so workers are not used."""
    return "OpenMP" in torch.__config__.parallel_info()


# -- the worker pool: one per worker count, made once, never shut down, shared by callers -------

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
_WORKER = threading.local()


def _one_thread(barrier: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's lazy per-thread init first, so it cannot undo the next
    torch.set_num_threads(1)
    _WORKER.active = True
    barrier.wait()


def _pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n`` worker threads, each with one intra-op thread (made once per n)."""
    with _POOL_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            caller = torch.get_num_threads()
            pool = ThreadPoolExecutor(n, thread_name_prefix="attn-cpu")
            barrier = threading.Barrier(n)  # one task per thread: every worker sets its count
            for f in [pool.submit(_one_thread, barrier) for _ in range(n)]:
                f.result()
            # set_num_threads also stores a process-wide default, which threads that have not
            # started yet read: give the caller's back (each worker keeps its own 1)
            torch.set_num_threads(caller)
            _POOLS[n] = pool
    return pool


def _forget_pools() -> None:  # a forked child has the pool objects but none of their threads
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


class single_thread:
    """The calling thread's intra-op threads set to 1 for a block, then given back: its items
    then run as a worker's do (same ops, same bits), and none of its ops wakes OpenMP's
    team. Only under OpenMP, where the count is the calling thread's own."""

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        if self.saved != 1 and openmp_threads():
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        if self.saved != 1 and openmp_threads():
            torch.set_num_threads(self.saved)


# elements up to which a cheap pass (a reduction, a finiteness sum) runs on the caller's
# thread alone: under one busy core an op on torch's threads waits on the thread that core
# holds, whatever its size (measured: docs/benchmarks.md, "Measurements behind the code's choices")
SMALL_PASS = 1 << 22


def small_pass(x: Tensor) -> single_thread | contextlib.nullcontext:
    """:class:`single_thread` for one cheap pass over ``x`` on the CPU while it holds at
    most :data:`SMALL_PASS` elements (eager), else nothing changed."""
    if x.device.type != "cpu" or x.numel() > SMALL_PASS or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return single_thread()


@contextlib.contextmanager
def flushed_denormals(on: bool = True):
    """Denormal floats flushed to zero (and read as zero) on the calling thread for a block,
    then the thread's own setting given back. Why: a probability ``exp(s - m)`` between
    2^-149 and 2^-126 is a denormal, and every multiply that reads one is slow on x86 (ALiBi's
    far keys land there: docs/benchmarks.md). Flushed, such a probability counts as 0 in a row
    whose largest is 1: a change far below the dtype's rounding. torch has a setter only, so
    the setting is read back by one multiply whose exact result is a denormal. ``on=False``:
    nothing changes."""
    if not on:
        yield
        return
    saved = float(torch.tensor(1e-30) * 1e-10) == 0.0
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(saved)


def workers_for_call() -> int:
    """How many threads a call's items run on: torch's intra-op thread count now (the caller
    is one of them), or 1 where items must run in order on the caller: inside a worker,
    under the profiler (it records only the threads it started on, so ops and allocations
    on workers would be missing from profiles and attn.bench's CPU peaks), and under
    torch's native thread pool (``set_num_threads`` there resizes one shared pool)."""
    if (getattr(_WORKER, "active", False) or torch._C._autograd._profiler_enabled()
            or not openmp_threads()):
        return 1
    return torch.get_num_threads()


# -- how a call is cut into items: rules tiled and fused share, each with its own config -----

def items_here(q: Tensor) -> bool:
    """Whether a call on q's device runs as work items on the pool: eager, on CPU."""
    return q.device.type == "cpu" and not torch.compiler.is_compiling()


def item_threads(q: Tensor, scores: int, config) -> int | None:
    """How a call that visits ``scores`` scores runs its items: 0 in order with torch's
    threads untouched (traced, or another device than CPU), 1 in order on the caller (below
    ``config.serial_max_scores``: too small to wake the workers), None on the pool (its
    size read at the call: :func:`workers_for_call`)."""
    if not items_here(q):
        return 0
    return 1 if scores < config.serial_max_scores else None


def kv_split(n_q: int, n_k: int, config) -> int | None:
    """Keys per split-KV item for a call of ``n_q`` query rows per head and ``n_k`` keys, or
    None where the call is not split (more than ``config.split_max_q`` rows, fewer than
    ``split_min_keys`` keys): ranges of ``split_min_chunk`` keys doubled until there are at
    most ``split_max_chunks``. ``config``: the backend's (``TileConfig``, ``FusedConfig``).
    A pure function of the shapes: the same split, and the same bits, whatever the number of
    workers."""
    if n_q > config.split_max_q or n_k < config.split_min_keys:
        return None
    chunk = config.split_min_chunk
    while chunk * config.split_max_chunks < n_k:
        chunk *= 2
    return chunk


def page_ranges(start: int, stop: int, page: int, chunk: int) -> list[tuple[int, int]]:
    """The key ranges (positions ``[a, z)`` of one sequence's ``[start, stop)``) of a paged
    call's items, cut on page boundaries: pages smaller than ``chunk`` are grouped, ``chunk``
    rounded up to whole pages, so an item reads whole pages (the first and last only in
    part); a page of more than ``chunk`` keys is cut into ranges of ``chunk`` from its first
    slot, so no range crosses into the next page. ``page=1``: cut at the multiples of
    ``chunk`` alone. Shapes alone decide it."""
    ranges: list[tuple[int, int]] = []
    if page <= chunk:
        step = -(-chunk // page) * page
        cuts = lambda a: (a // step + 1) * step  # noqa: E731
    else:
        def cuts(a: int) -> int:
            base = a // page * page
            return min(base + ((a - base) // chunk + 1) * chunk, base + page)
    a = start
    while a < stop:
        z = min(cuts(a), stop)
        ranges.append((a, z))
        a = z
    return ranges


_SCRATCH = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
            ) -> Tensor:
    """A buffer of the calling thread's own, reused by every item it runs (one item at a time
    per thread, so nothing else writes it meanwhile): a multi-MiB tensor allocated per item
    costs page faults on every call (docs/benchmarks.md, "Measurements behind the code's
    choices"). One flat buffer per name, grown as asked,
    made outside inference mode so it can be written in and out of it."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:  # this thread's first buffer
        bufs = _SCRATCH.bufs = {}
    n = math.prod(shape)
    flat = bufs.get(name)
    if flat is None or flat.numel() < n or flat.dtype != dtype or flat.device != device:
        with torch.inference_mode(False):
            flat = bufs[name] = torch.empty(n, dtype=dtype, device=device)
    return flat[:n].view(shape)


def fill_passes(passes: list[tuple[Tensor, Tensor | None]], *, threads: int | None = None
                ) -> None:
    """For each ``(dst, src)`` of contiguous CPU tensors: ``dst`` zeroed (``src`` None) or
    set to ``src`` (same shape, cast to dst's dtype), cut into about four runs of elements
    per thread and run as :func:`run_items` items: a fresh buffer's first touch (its page
    faults) and the pass spread over the call's threads, none of it on OpenMP's team, whose
    spinning after a parallel op slows the pool's next items (docs/benchmarks.md).
    ``threads`` as :func:`run_items`'; 0: one op per pass, on torch's threads."""
    n = workers_for_call() if threads is None else threads
    cuts = []
    for dst, src in passes:
        flat, sflat = dst.view(-1), None if src is None else src.view(-1)
        step = max(1, flat.numel() if n == 0 else -(-flat.numel() // (4 * n)))
        cuts += [(flat, sflat, a, min(a + step, flat.numel()))
                 for a in range(0, flat.numel(), step)]

    def run(i: int) -> None:
        flat, sflat, a, b = cuts[i]
        if sflat is None:
            flat[a:b].zero_()
        else:
            flat[a:b].copy_(sflat[a:b])

    run_items(run, len(cuts), threads=n)


def run_items(fn: Callable[[int], None], n_items: int, *, threads: int | None = None,
              flush_denormals: bool = False) -> None:
    """``fn(i)`` for every ``i < n_items``, each exactly once, pulled in order of ``i`` from
    one shared counter by the caller and ``threads - 1`` pool workers (default
    :func:`workers_for_call`; 1: in order here; 0: in order with torch's threads untouched,
    for traced calls and other devices). Every thread runs its items with one
    intra-op thread, so an item computes the same bits whichever thread takes it: ``fn``
    must write only its own outputs. The workers take the caller's grad and inference modes
    (per thread in torch). After an exception no new item starts; the first is raised here
    once every started item has finished, so none still writes into the outputs. With
    ``flush_denormals`` each thread runs its items under :class:`flushed_denormals`."""
    if threads == 0:  # traced by torch.compile, or not on CPU: a plain loop
        for i in range(n_items):
            fn(i)
        return
    n = workers_for_call() if threads is None else threads
    if n <= 1 or n_items <= 1:
        with single_thread(), flushed_denormals(flush_denormals):
            for i in range(n_items):
                fn(i)
        return
    counter = itertools.count()  # next() on it is atomic under the GIL
    errors: list[BaseException] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def drain() -> None:
        with (torch.inference_mode(inference), torch.set_grad_enabled(grad),
              flushed_denormals(flush_denormals)):
            while not errors:
                i = next(counter)
                if i >= n_items:
                    return
                try:
                    fn(i)
                except BaseException as exc:  # noqa: BLE001 - raised by the caller below
                    errors.append(exc)
                    return

    pool = _pool(n - 1)
    futures = [pool.submit(drain) for _ in range(min(n - 1, n_items - 1))]
    with single_thread():
        drain()
    for f in futures:
        f.cancel()  # one still queued behind another caller's items has nothing left to do
    wait(futures)
    if errors:
        raise errors[0]
