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
