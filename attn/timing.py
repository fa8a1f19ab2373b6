"""Measuring primitives: wall-clock timing and peak memory of one call.

They sit at the bottom of the package so that anything may measure (the tiled backend's
oneDNN calibration, the toy GPT's training loop) without importing :mod:`attn.bench`, which
sits on top of everything.

Timing: :func:`benchmark`, :func:`paired`. Peak memory: :func:`peak_bytes`, whose method,
error and blind spots are docs/benchmarks.md's "How memory is measured".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    times_ms: tuple[float, ...]  # one entry per timed call, warm-up excluded

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def repeats(self) -> int:
        return len(self.times_ms)


def synchronize(device: str | torch.device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def benchmark(fn: Callable[[], object], *, device: str | torch.device = "cpu", warmup: int = 1,
              repeats: int = 5, min_repeats: int = 1, budget_s: float | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeats`` timed ones.

    With ``budget_s``, stop repeating once the timed calls have used that many seconds and at
    least ``min_repeats`` are done: a slow point (seconds per call) gets a few samples, a fast
    one all ``repeats``. Report the median; it ignores the odd call slowed by another process.
    """
    if repeats < 1 or min_repeats < 1:
        raise ValueError(f"repeats and min_repeats must be >= 1, got {repeats}, {min_repeats}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats):
        times.append(_time_once(fn, device))
        spent += times[-1] / 1e3
        if budget_s is not None and spent >= budget_s and len(times) >= min_repeats:
            break
    return Timing(tuple(times))


def paired(fns: dict[str, Callable[[], object]], rounds: int, reps: int = 1, *,
           device: str | torch.device = "cpu", warmup: int = 0) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round: every round runs each
    function ``reps`` times in a row, the functions in turn (in ``fns`` order), so a ratio
    taken within one round (:func:`median_ratio`) survives a machine that drifts over
    minutes. ``warmup`` untimed rounds of one call each come first."""
    device = torch.device(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            synchronize(device)
            times[name].append((time.perf_counter() - t0) / reps)
    return times


def median_ratio(times: dict[str, list[float]], baseline: str, name: str) -> float:
    """Median over rounds of ``baseline time / name time`` (> 1: ``name`` is faster)."""
    return statistics.median(b / t for b, t in zip(times[baseline], times[name]))


# Documented error bound of the CPU method on a known allocation (tests/test_bench.py):
# allocations outside c10 (oneDNN scratch, thread stacks) are small and not seen at all.
CPU_ERROR_BYTES = 1 << 20


# Lines the profiler itself writes to stderr on every use: kineto's start/stop markers (its
# log level can only be set before torch is imported) and c10's note that a block allocated
# before profiling was freed (expected: the curve starts at the inputs).
_NOISE = ("profiler_start", "profiler_stop", "Completed Stage", "allocated before the profiling")


@contextlib.contextmanager
def _filtered_stderr() -> Iterator[None]:
    """Send file descriptor 2 to a temporary file, then replay every line but the noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in line for n in _NOISE):
                    sys.stderr.write(line)


def peak_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated above the starting point while ``fn()`` runs (see module doc).

    Whatever ``fn`` returns is dropped before this returns, so keep anything you need alive
    outside (the inputs). The result counts tensors ``fn`` creates and frees along the way.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"peak_bytes supports cpu and cuda devices, got {device}")
    from torch.profiler import ProfilerActivity, profile

    with _filtered_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())  # stable: same-ns events keep allocation order
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
