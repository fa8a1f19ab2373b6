"""Choose tiled's BLOCK_M x BLOCK_N by measurement: time and peak memory against torch's SDPA.

    python benchmarks/experiments/tune_tiled_blocks.py --n 1024 4096 8192 --out benchmarks/results/tiled_blocks_cpu.md

For each N (B=1, H=8, D=64, causal, fp32 by default) it times torch SDPA and tiled with every
block pair, forward and forward+backward, in the same process, and prints the ratio
SDPA time / tiled time (> 1: tiled is faster) and tiled's peak bytes above the inputs.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys

import torch
import torch.nn.functional as F

import attn
from attn.timing import benchmark, peak_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--blocks", nargs="+", default=["128x256", "256x256", "256x512", "512x512",
                                                    "128x1024", "256x1024"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    blocks = [tuple(int(x) for x in b.split("x")) for b in args.blocks]

    lines = [f"# tiled block sizes, {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{datetime.date.today()}",
             "", f"`python {' '.join(sys.argv)}`", "",
             f"B={args.batch}, H={args.heads}, D={args.head_dim}, causal, float32. ratio = "
             "SDPA ms / tiled ms in the same process (> 1: tiled faster); memory = peak bytes "
             "above the inputs (attn.timing.peak_bytes).", "",
             "| N | blocks | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | fwd+bwd MiB |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for n in args.n:
        g = torch.Generator().manual_seed(0)
        shape = (args.batch, args.heads, n, args.head_dim)
        q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(shape, generator=g)

        def fwd(fn):
            def run():
                with torch.no_grad():
                    fn()
            return run

        def fwd_bwd(fn):
            def run():
                out = fn()
                torch.autograd.grad(out, (q, k, v), do)
            return run

        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        ref_f = benchmark(fwd(sdpa), repeats=args.repeats).median_ms
        ref_b = benchmark(fwd_bwd(sdpa), repeats=args.repeats).median_ms
        mem_sdpa = peak_bytes(fwd_bwd(sdpa))
        row = f"| {n} | torch SDPA | {ref_f:.1f} | 1.00 | {ref_b:.1f} | 1.00 | {mem_sdpa / 2**20:.1f} |"
        lines.append(row)
        print(row, flush=True)
        for bm, bn in blocks:
            tiled = lambda: attn.attention(q, k, v, causal=True, backend="tiled",  # noqa: E731
                                           block_m=bm, block_n=bn)
            t_f = benchmark(fwd(tiled), repeats=args.repeats).median_ms
            t_b = benchmark(fwd_bwd(tiled), repeats=args.repeats).median_ms
            mem = peak_bytes(fwd_bwd(tiled))
            row = (f"| {n} | {bm}x{bn} | {t_f:.1f} | {ref_f / t_f:.2f} | {t_b:.1f} | "
                   f"{ref_b / t_b:.2f} | {mem / 2**20:.1f} |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
