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

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "attention_flops": "attn.bench.flops",
    "matmul_tflops": "attn.bench.flops",
    "Row": "attn.bench.sweep",
    "SweepConfig": "attn.bench.sweep",
    "finish": "attn.bench.sweep",
    "plan": "attn.bench.sweep",
    "predicted_peak_bytes": "attn.bench.sweep",
    "run_sweep": "attn.bench.sweep",
    "CPU_ERROR_BYTES": "attn.timing",
    "Timing": "attn.timing",
    "benchmark": "attn.timing",
    "peak_bytes": "attn.timing",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from attn.bench.flops import attention_flops, matmul_tflops
    from attn.bench.sweep import Row, SweepConfig, finish, plan, predicted_peak_bytes, run_sweep
    from attn.timing import CPU_ERROR_BYTES, Timing, benchmark, peak_bytes


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
