"""tiled vs torch SDPA on CPU, as paired ratios: the backends take turns, round after round.

``attn report`` times each backend in a block, one after the other; on a shared machine a
slow minute can land on one backend only. Here every round runs torch SDPA, then tiled as it
runs by default (eager steps, GEMM engine per ``ATTN_TILED_GEMM=auto``), tiled with
torch.bmm GEMMs only (``ATTN_TILED_GEMM=bmm``: no unit path), tiled with the fused
(compiled) steps, and optionally compiled FlexAttention (forward only: it has no CPU
backward). Each backend's sample in a round is ``reps`` calls in a row (enough for ~50 ms,
chosen at warm-up, the same for every backend), and the reported ratio is the median over
rounds of ``sdpa time / backend time`` within the round (> 1: faster than SDPA).

    python scripts/bench_cpu_ratio.py --out benchmarks/results/cpu_ratio
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attn
from attn.bench.report import device_name
from attn.bench.timing import median_ratio, paired


def _flex(causal: bool, N: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, N, N,
                                       device="cpu")
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--batch", "-B", type=int, default=1)
    p.add_argument("--heads", "-H", type=int, default=8)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
    p.add_argument("--causal", choices=["false", "true", "both"], default="both")
    p.add_argument("--flex-max-n", type=int, default=4096,
                   help="compiled flex (causal forward) up to this N; its CPU path held "
                        "24 GB at N=16384 causal and was killed for memory on this machine")
    p.add_argument("--no-fused", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/cpu_ratio")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, D = args.batch, args.heads, args.d
    causals = {"false": [False], "true": [True], "both": [False, True]}[args.causal]
    rows = []
    for N in args.n:
        rounds = 9 if N <= 2048 else 5 if N <= 4096 else 3
        for mode in args.modes:
            bwd = mode == "fwd+bwd"
            g = torch.Generator().manual_seed(N)
            q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_(bwd) for _ in range(3))
            for causal in causals:
                def run(fn, env=None):
                    def go():
                        for name, value in (env or {}).items():
                            os.environ[name] = value
                        out = fn()
                        if bwd:
                            out.sum().backward()
                    return go
                tiled = lambda: attn.attention(q, k, v, causal=causal, backend="tiled")  # noqa: E731
                fns = {"sdpa": run(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                          is_causal=causal)),
                       "tiled": run(tiled, {"ATTN_TILED_COMPILE": "0", "ATTN_TILED_GEMM": "auto"}),
                       "tiled bmm": run(tiled, {"ATTN_TILED_COMPILE": "0",
                                                "ATTN_TILED_GEMM": "bmm"})}
                if not args.no_fused:
                    fns["tiled fused"] = run(tiled, {"ATTN_TILED_COMPILE": "1",
                                                     "ATTN_TILED_GEMM": "auto"})
                if not bwd and causal and N <= args.flex_max_n:
                    flex = _flex(causal, N)
                    fns["flex (compiled)"] = run(lambda: flex(q, k, v))
                slowest = 0.0
                for fn in fns.values():  # warm-up: compiles, first-touch allocations
                    fn()
                    t0 = time.perf_counter()
                    fn()
                    slowest = max(slowest, time.perf_counter() - t0)
                reps = max(1, round(0.05 / slowest))
                times = paired(fns, rounds, reps)
                row = {"N": N, "mode": mode, "causal": causal, "rounds": rounds, "reps": reps,
                       "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
                       "ratio": {n: median_ratio(times, "sdpa", n) for n in fns if n != "sdpa"}}
                rows.append(row)
                print(N, mode, "causal" if causal else "full",
                      " ".join(f"{n}:{r:.2f}" for n, r in row["ratio"].items()), flush=True)
    os.environ.pop("ATTN_TILED_COMPILE", None)
    os.environ.pop("ATTN_TILED_GEMM", None)
    header = {"device": device_name("cpu"), "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "loadavg_1min": os.getloadavg()[0],
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python scripts/bench_cpu_ratio.py " + " ".join(argv or sys.argv[1:]),
              "shape": f"fp32, B={B}, H={H}, D={D}",
              "tiled_path": attn.tiled.fused_path_reason("cpu")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    names = []
    for r in rows:
        names += [n for n in r["ratio"] if n not in names]
    lines = ["# tiled vs torch SDPA on CPU: paired ratios (sdpa time / backend time)", "",
             f"- device: {header['device']} ({header['cpu_count']} CPUs, "
             f"{header['torch_threads']} torch threads); torch {header['torch']}; "
             f"{header['date']}; load before the last point {header['loadavg_1min']:.2f}",
             f"- command: `{header['command']}`",
             f"- shape: {header['shape']}; each round runs every backend in turn, reps calls "
             "each (~50 ms); the ratio is the median over rounds of the in-round ratio "
             "(> 1: faster than SDPA)",
             f"- tiled: the default ({header['tiled_path']}); tiled bmm: ATTN_TILED_GEMM=bmm "
             "(torch.bmm GEMMs, batched over heads); tiled fused: ATTN_TILED_COMPILE=1 "
             "(per-tile steps compiled by torch.compile, bmm GEMMs)", "",
             "| N | mode | causal | rounds x reps | sdpa ms | " + " | ".join(names) + " |",
             "|--:|:--|:--|--:|--:|" + "--:|" * len(names)]
    for r in rows:
        lines.append(f"| {r['N']} | {r['mode']} | {r['causal']} | {r['rounds']} x {r['reps']} | "
                     f"{r['ms']['sdpa']:.1f} | "
                     + " | ".join(f"{r['ratio'][n]:.2f}" if n in r["ratio"] else "—"
                                  for n in names) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
