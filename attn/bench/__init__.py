"""Measuring attention: timing, peak memory, FLOP counts, sweeps, reports and plots.

The main job is the ``attn report`` command (:mod:`attn.bench.cli`); the pieces are usable
on their own::

    from attn.bench import benchmark, peak_bytes, attention_flops
    t = benchmark(lambda: attn.attention(q, k, v, backend="tiled"), device="cpu")
    mem = peak_bytes(lambda: attn.attention(q, k, v, backend="tiled"), device="cpu")

The names load their module (and torch) on first use: the ``attn`` command imports this
package before it parses its arguments, and ``attn --help`` should not wait for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attn import _lazy

if TYPE_CHECKING:
    from attn.bench.flops import attention_flops, matmul_tflops
    from attn.bench.sweep import Row, SweepConfig, finish, plan, predicted_peak_bytes, run_sweep
    from attn.timing import CPU_ERROR_BYTES, Timing, benchmark, peak_bytes

_EXPORTS = {"attn.bench.flops": ("attention_flops", "matmul_tflops"),
            "attn.bench.sweep": ("Row", "SweepConfig", "finish", "plan", "predicted_peak_bytes",
                                 "run_sweep"),
            "attn.timing": ("CPU_ERROR_BYTES", "Timing", "benchmark", "peak_bytes")}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
