"""Peak memory of one call, in bytes allocated above what existed before it.

The metric is the same on every device: inputs (q, k, v and, for forward+backward, the
upstream gradient dO) are allocated *before* measuring, so the number is what the attention
call itself costs — activations, saved tensors, workspaces, the output and the gradients.

CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated() - memory_allocated()``
taken before the call; exact for everything that goes through PyTorch's caching allocator.

CPU: torch keeps no peak counter for host memory, and the process's RSS high-water mark is
noisy (page granularity, glibc arenas caching small blocks, big blocks mmapped and returned at
once, and a high-water mark can only grow within a process). Instead we use the allocator's
own reporting: under ``torch.profiler.profile(profile_memory=True)`` every allocation and
free made through c10's CPU allocator — from Python, inside aten kernels, and on intra-op
worker threads (``at::parallel_for`` carries the profiler state) — is recorded as a signed
``[memory]`` event with a timestamp. The running sum of those events, in time order, is the
live-bytes curve of the call; its maximum is the peak above the starting point. Blocks freed
during the call that were allocated before it (e.g. an old ``.grad``) are not counted, so the
curve starts at zero.

Error of the CPU method: exact (to the byte) for tensors and aten workspaces; it misses
memory that bypasses c10's allocator — oneDNN/MKL scratch buffers and OpenMP thread stacks
obtained with their own malloc — and Python objects. tests/test_bench.py checks a known
64 MiB allocation is found within ``CPU_ERROR_BYTES`` and that the reference backend's
measured peak matches the size of its score tensors. Events within the same nanosecond are
ordered as the profiler returns them (allocation order), which cannot raise the peak.

The profiler does not follow plain Python threads, so the tiled backend's unit path
(:mod:`attn.cpu`) runs its units one after another while a profiler is on. Run on its worker
threads, T units are alive at once: the peak is then higher by up to T − 1 units' tile
scratch (one unit's score tiles and their products: about 2 MiB forward and 4 MiB backward at
the default 512 x 512 tiles), which this method does not see.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch

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


def _cpu_peak(fn: Callable[[], object]) -> int:
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


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def peak_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak bytes allocated above the starting point while ``fn()`` runs (see module doc).

    Whatever ``fn`` returns is dropped before this returns, so keep anything you need alive
    outside (the inputs). The result counts tensors ``fn`` creates and frees along the way.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    if device.type == "cpu":
        return _cpu_peak(fn)
    raise ValueError(f"peak_bytes supports cpu and cuda devices, got {device}")
