"""Where the tiled backend's CPU time goes: a torch.profiler table per mode.

For each (mode, causal) it profiles one call of ``attn.attention(backend="tiled")`` after a
warm-up and groups aten ops into GEMMs (bmm, baddbmm, addmm; oneDNN's linear on the unit
path), the softmax's elementwise passes (amax, sub, exp2, sum, mul, add, where, ...) and the
rest; "Python and dispatch" is the autograd Function's own time (the tile loops). The
profiled call runs its units in order on the calling thread (torch.profiler does not follow
the worker threads); the same ops run either way. Same run: torch SDPA's time for the ratio,
with the units where they normally run.

    python scripts/profile_tiled_cpu.py --n 4096 --out benchmarks/results/cpu/profile.md
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

import attn
from attn import tiled
from attn.bench.report import device_name
from attn.bench.timing import benchmark

GEMM = {"aten::bmm", "aten::baddbmm_", "aten::baddbmm", "aten::addmm_", "aten::addmm",
        "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise"}
ELEMENTWISE = {"aten::amax", "aten::sub_", "aten::sub", "aten::exp2_", "aten::exp2",
               "aten::sum", "aten::mul_", "aten::mul", "aten::add_", "aten::add",
               "aten::maximum", "aten::where", "aten::div", "aten::log2", "aten::masked_fill_",
               "aten::copy_", "aten::fill_", "aten::zeros", "aten::full", "aten::empty"}
OWN = {"_TiledAttention", "_TiledAttentionBackward"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/cpu/profile.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    N, H, D = args.n, args.heads, args.d
    lines = ["# Where tiled's CPU time goes", "",
             f"- device: {device_name('cpu')} ({os.cpu_count()} CPUs, "
             f"{torch.get_num_threads()} torch threads); torch {torch.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- command: `python scripts/profile_tiled_cpu.py --n {N}"
             + (f" --threads {args.threads}" if args.threads else "") + "`",
             f"- tiled backend: {tiled.fused_path_reason('cpu')}",
             f"- shape: fp32, B=1, H={H}, N={N}, D={D}; one profiled call after a warm-up; "
             "self CPU time of the ops, summed over both threads' view of the caller "
             "(units in order on the caller's thread)",
             "",
             "| mode | causal | sdpa/tiled | GEMMs | elementwise | Python and dispatch | other "
             "| top elementwise ops (share of total) |",
             "|:--|:--|--:|--:|--:|--:|--:|:--|"]
    for bwd in (False, True):
        for causal in (False, True):
            q, k, v = (torch.randn(1, H, N, D, requires_grad=bwd) for _ in range(3))

            def run(fn):
                def go():
                    out = fn()
                    if bwd:
                        out.sum().backward()
                return go
            t_tiled = benchmark(run(lambda: attn.attention(q, k, v, causal=causal,
                                                           backend="tiled")), repeats=3).median_ms
            t_sdpa = benchmark(run(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal)), repeats=3).median_ms
            pool_min, tiled.POOL_MIN_SCORES = tiled.POOL_MIN_SCORES, 1 << 62
            try:
                with profile() as prof:
                    run(lambda: attn.attention(q, k, v, causal=causal, backend="tiled"))()
            finally:
                tiled.POOL_MIN_SCORES = pool_min
            groups, ops = defaultdict(float), {}
            for e in prof.key_averages():
                t = e.self_cpu_time_total
                g = ("gemm" if e.key in GEMM else "elem" if e.key in ELEMENTWISE
                     else "own" if e.key in OWN else "other")
                groups[g] += t
                if g == "elem":
                    ops[e.key] = t
            total = sum(groups.values())
            top = sorted(ops.items(), key=lambda kv: -kv[1])[:5]
            lines.append(
                f"| {'fwd+bwd' if bwd else 'fwd'} | {causal} | {t_sdpa / t_tiled:.2f} | "
                + " | ".join(f"{100 * groups[g] / total:.0f}%" for g in
                             ("gemm", "elem", "own", "other"))
                + " | " + ", ".join(f"{k.removeprefix('aten::')} {100 * t / total:.1f}%"
                                    for k, t in top) + " |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
