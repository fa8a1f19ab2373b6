"""attn's triton kernels vs torch SDPA (default and each backend) and FlexAttention, bf16.

One benchmark group per (D, causal, mode, N) holds every competitor, so the table puts them
side by side and ``--benchmark-compare`` matches each case with an earlier run.
``extra_info`` carries the FLOP count (4·B·H·N²·D forward, /2 causal, ×3.5 fwd+bwd) and the
resulting TFLOP/s. CUDA only: every case skips without a GPU. The calls are attn.bench's
sweep points (``attn bench speed --preset triton`` runs the same question as one report), so
both measure exactly the same calls.

    pytest benchmarks/bench_triton.py --benchmark-autosave
"""

import pytest
import torch

from attn.bench.competitors import COMPETITORS
from attn.bench.flops import MODES, attention_flops
from attn.bench.sweep import Row, SweepConfig, make_call
from attn.timing import synchronize

TOKENS, WIDTH = 16384, 2048  # B = TOKENS // N, H = WIDTH // D


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ("triton", "sdpa", *COMPETITORS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", [1024, 2048, 4096, 8192, 16384])
@pytest.mark.parametrize("D", [64, 128])
def bench_triton_vs_torch(benchmark, D, N, causal, mode, backend):
    pytest.importorskip("triton")
    B, H = max(1, TOKENS // N), WIDTH // D
    try:
        row = Row(backend, "cuda", "bfloat16", B, H, N, D, causal, mode)
        call = make_call(row, SweepConfig(device="cuda", dtypes=("bfloat16",)))
        call()  # compile / autotune / check the backend accepts the shape, untimed
    except Exception as exc:  # e.g. cuDNN or flash not available on this GPU or build
        pytest.skip(f"{backend} cannot run this case: {type(exc).__name__}: {exc}")

    def fn():
        call()
        synchronize("cuda")  # launches are asynchronous: time the work, not the launch

    flops = attention_flops(B, H, N, N, D, causal=causal, mode=mode)
    benchmark.group = f"bf16 D={D} {'causal' if causal else 'full'} {mode} N={N}"
    benchmark.extra_info.update(backend=backend, B=B, H=H, N=N, D=D, flops=flops)
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2, iterations=1)
    benchmark.extra_info["tflops"] = flops / benchmark.stats.stats.median / 1e12


@pytest.mark.cuda
def bench_matmul_bf16(benchmark):
    """The ceiling, in the same run: an 8192³ bf16 matmul."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def fn():
        a @ b
        synchronize("cuda")

    benchmark.group = "bf16 matmul"
    benchmark.pedantic(fn, rounds=10, warmup_rounds=2, iterations=1)
    benchmark.extra_info["tflops"] = 2 * n**3 / benchmark.stats.stats.median / 1e12
