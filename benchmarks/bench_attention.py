"""Each backend vs N, forward and forward+backward: how long does attention take here?

One benchmark group per (device, dtype, mode, N) holds every backend, so the table shows
reference, tiled, sdpa (and triton on CUDA) side by side, and ``--benchmark-compare`` matches
each case with the same case of an earlier run. ``extra_info`` carries the FLOP count
(4·B·H·N²·D forward, ×3.5 forward+backward) and the resulting TFLOP/s. Points that would not
fit in memory (the reference's N² scores) are skipped by the sweep's own prediction.
"""

import pytest

from attn.bench.flops import MODES
from attn.bench.sweep import Row, SweepConfig, make_call, skip_reason
from attn.timing import synchronize

B, H, D = 1, 8, 64
CASES = (  # (device, dtype, N)
    [pytest.param("cpu", "float32", n, id=f"cpu-fp32-N{n}") for n in (512, 1024, 2048, 4096)]
    + [pytest.param("cuda", "bfloat16", n, id=f"cuda-bf16-N{n}", marks=pytest.mark.cuda)
       for n in (1024, 4096, 16384)])


@pytest.mark.parametrize("backend", ["reference", "tiled", "triton", "sdpa"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device,dtype,N", CASES)
def bench_attention(benchmark, device, dtype, N, mode, backend):
    row = Row(backend, device, dtype, B, H, N, D, False, mode)
    cfg = SweepConfig(n=(N,), backends=(backend,), dtypes=(dtype,), modes=(mode,), device=device)
    why = skip_reason(row, cfg)
    if why is not None:
        pytest.skip(why)
    call = make_call(row, cfg)

    def fn():
        call()
        synchronize(device)  # CUDA launches are asynchronous: time the work, not the launch

    benchmark.group = f"{device} {dtype} {mode} N={N}"
    benchmark.extra_info.update(backend=backend, B=B, H=H, N=N, D=D, flops=row.flops)
    benchmark.pedantic(fn, rounds=5 if N <= 2048 else 3, warmup_rounds=1, iterations=1)
    benchmark.extra_info["tflops"] = row.flops / benchmark.stats.stats.median / 1e12
