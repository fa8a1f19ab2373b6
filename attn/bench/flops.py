"""FLOP counts of attention and the matmul rate of this device, measured in the same run; the
count is docs/benchmarks.md's ('Reading the table', TFLOP/s): a matmul-equivalent rate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attn.timing import benchmark

MODES = ("fwd", "fwd+bwd")
BWD_FACTOR = 2.5


def attention_flops(B: int, H: int, Nq: int, Nk: int, D: int, *, Dv: int | None = None,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOPs of one attention call: ``4·B·H·Nq·Nk·D`` forward, halved when causal, and
    ``(1 + 2.5)×`` that for forward+backward. ``Dv`` (default D) splits the two matmuls."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    Dv = D if Dv is None else Dv
    flops = 2.0 * B * H * Nq * Nk * (D + Dv)
    if causal:
        flops /= 2
    if mode == "fwd+bwd":
        flops *= 1 + BWD_FACTOR
    return flops


def matmul_tflops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  n: int | None = None, repeats: int = 5, mm: Callable = torch.matmul) -> float:
    """TFLOP/s of an ``n × n`` by ``n × n`` matmul ``mm`` (``2·n³`` FLOPs) on this device and
    dtype: the ceiling attention's matmul-equivalent rate is compared against."""
    device = torch.device(device)
    if n is None:
        n = 4096 if device.type == "cuda" else 1024
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    t = benchmark(lambda: mm(a, b), device=device, warmup=2, repeats=repeats)
    return 2.0 * n**3 / (t.median_ms * 1e-3) / 1e12
