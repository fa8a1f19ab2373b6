"""The unit path's tile shape on CPU (issue 13): query rows per tile (``UNIT_ROWS``, G·BM)
by keys per tile (``UNIT_BLOCK_N``), as paired ratios against torch SDPA.

Every round runs torch SDPA, then tiled with each tile shape in turn; the ratio is the
median over rounds of ``sdpa time / tiled time`` within the round (> 1: faster). The unit
path is forced (``ATTN_TILED_GEMM=onednn``, and causal tiles allowed to be mostly
partial) so that every shape runs it, with the units where they would run at that size.

    python scripts/sweep_unit_tiles.py --n 1024 2048 4096 --threads 2 \\
        --out benchmarks/results/cpu_unit_tiles.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import attn
from attn import tiled
from attn.bench.report import device_name
from attn.bench.timing import median_ratio, paired

SHAPES = ((256, 256), (256, 512), (512, 256), (512, 512), (512, 1024), (1024, 512))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/cpu_unit_tiles.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["ATTN_TILED_GEMM"] = "onednn"
    os.environ["ATTN_TILED_COMPILE"] = "0"
    tiled.UNIT_MAX_PARTIAL = 1.0
    names = [f"{r}x{c}" for r, c in SHAPES]
    lines = ["# The unit path's tile shape: paired ratios (sdpa time / tiled time)", "",
             f"- device: {device_name('cpu')} ({os.cpu_count()} CPUs, "
             f"{torch.get_num_threads()} torch threads); torch {torch.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             "- command: `python scripts/sweep_unit_tiles.py "
             + " ".join(argv or sys.argv[1:]) + "`",
             "- fp32, B=1, H=8, D=64; columns: query rows x keys per tile; "
             f"median of {args.rounds} rounds", "",
             "| N | mode | causal | " + " | ".join(names) + " |",
             "|--:|:--|:--|" + "--:|" * len(names)]
    print("\n".join(lines[-2:]), flush=True)
    for N in args.n:
        for bwd in (False, True):
            g = torch.Generator().manual_seed(N)
            q, k, v = (torch.randn(1, 8, N, 64, generator=g).requires_grad_(bwd)
                       for _ in range(3))
            for causal in (False, True):
                def run(fn, shape=None):
                    def go():
                        if shape is not None:
                            tiled.UNIT_ROWS, tiled.UNIT_BLOCK_N = shape
                        out = fn()
                        if bwd:
                            out.sum().backward()
                    return go
                fns = {"sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=causal))}
                for name, shape in zip(names, SHAPES):
                    fns[name] = run(lambda: attn.attention(q, k, v, causal=causal,
                                                           backend="tiled"), shape)
                for fn in fns.values():
                    fn()
                times = paired(fns, args.rounds)
                ratio = {n: median_ratio(times, "sdpa", n) for n in names}
                lines.append(f"| {N} | {'fwd+bwd' if bwd else 'fwd'} | {causal} | "
                             + " | ".join(f"{ratio[n]:.2f}" for n in names) + " |")
                print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
