"""Measuring attention: timing, peak memory, FLOP counts, sweeps, reports and plots.

The main job is the ``attn report`` command (:mod:`attn.bench.cli`); the pieces are usable
on their own::

    from attn.bench import benchmark, peak_bytes, attention_flops
    t = benchmark(lambda: attn.attention(q, k, v, backend="tiled"), device="cpu")
    mem = peak_bytes(lambda: attn.attention(q, k, v, backend="tiled"), device="cpu")
"""

from attn.bench.flops import attention_flops, matmul_tflops
from attn.bench.sweep import Row, SweepConfig, finish, plan, predicted_peak_bytes, run_sweep
from attn.timing import CPU_ERROR_BYTES, Timing, benchmark, peak_bytes

__all__ = [
    "CPU_ERROR_BYTES",
    "Row",
    "SweepConfig",
    "Timing",
    "attention_flops",
    "benchmark",
    "finish",
    "matmul_tflops",
    "peak_bytes",
    "plan",
    "predicted_peak_bytes",
    "run_sweep",
]
