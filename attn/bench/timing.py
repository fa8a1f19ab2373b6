"""Wall-clock timing: warm-up, then the median of repeated calls.

CPU kernels run synchronously, so ``time.perf_counter`` around the call is the time. On CUDA
the launch returns before the kernel ends: CUDA events recorded on the stream around the call,
read after ``synchronize``, time the work itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
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
           device: str | torch.device = "cpu") -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round: every round runs each
    function ``reps`` times in a row, the functions in turn (in ``fns`` order). On a machine
    that drifts over minutes (a shared VM: 10-20%), a ratio taken within one round compares
    like with like; see :func:`median_ratio`. Warm up before calling this."""
    device = torch.device(device)
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
