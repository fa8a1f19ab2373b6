"""Decoding on CPU: one new query against a long KV cache, tiled against torch SDPA.

Shape (issue 13): Nq = 1, Nk = 4096 ... 32768, H = 32 query heads, Hkv = 8 KV heads (GQA),
D = 128, fp32, B = 1. SDPA runs twice: with ``enable_gqa=True`` on the same (B, Hkv, Nk, D)
cache attn reads, and on a cache already expanded to 32 heads (the expansion is done once,
outside the timing, as a model keeping an expanded cache would). Each point times the
backends in turn, ``--repeats`` rounds, and reports medians and the ratio SDPA time / attn
time (> 1: attn is faster) in the same run.

    python scripts/bench_decode_cpu.py --out benchmarks/results/decode_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attn
from attn import tiled
from attn.bench.report import device_name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nk", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/decode_cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.d
    rows = []
    with torch.inference_mode():
        for nk in args.nk:
            g = torch.Generator().manual_seed(nk)
            q = torch.randn(B, H, 1, D, generator=g)
            k = torch.randn(B, Hkv, nk, D, generator=g)
            v = torch.randn(B, Hkv, nk, D, generator=g)
            k_rep, v_rep = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
            fns = {
                "attn tiled": lambda: attn.attention(q, k, v, backend="tiled"),
                "sdpa enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v,
                                                                          enable_gqa=True),
                "sdpa expanded cache": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep),
            }
            ref = F.scaled_dot_product_attention(q, k_rep, v_rep)
            err = (fns["attn tiled"]() - ref).abs().max().item()
            for fn in fns.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {n: [] for n in fns}
            for _ in range(args.repeats):  # interleaved: drift hits every backend alike
                for n, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(t) for n, t in times.items()}
            rows.append({"nk": nk, "ms": {n: t * 1e3 for n, t in med.items()},
                         "max_abs_diff_vs_sdpa": err,
                         "ratio_gqa": med["sdpa enable_gqa"] / med["attn tiled"],
                         "ratio_expanded": med["sdpa expanded cache"] / med["attn tiled"]})
            print(f"Nk={nk}: " + ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in med.items())
                  + f"; sdpa/attn {rows[-1]['ratio_gqa']:.2f} (gqa), "
                  f"{rows[-1]['ratio_expanded']:.2f} (expanded)", flush=True)
    header = {
        "device": device_name("cpu"), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_decode_cpu.py " + " ".join(argv or sys.argv[1:]),
        "tiled_path": tiled.fused_path_reason("cpu"),
        "shape": {"B": B, "H": H, "Hkv": Hkv, "D": D, "Nq": 1, "dtype": "float32"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    lines = [
        "# Decoding on CPU: attn tiled vs torch SDPA",
        "",
        f"- device: {header['device']} ({header['cpu_count']} CPUs, "
        f"{header['torch_threads']} torch threads)",
        f"- torch {header['torch']}, python {header['python']}, {header['date']}",
        f"- command: `{header['command']}`",
        f"- tiled backend: {header['tiled_path']}",
        f"- shape: B={B}, Nq=1, H={H}, Hkv={Hkv}, D={D}, fp32; medians of {args.repeats} "
        "interleaved rounds",
        "",
        "| Nk | attn tiled ms | sdpa enable_gqa ms | sdpa expanded ms | sdpa(gqa) / attn "
        "| sdpa(expanded) / attn | max abs diff |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['nk']} | {ms['attn tiled']:.2f} | {ms['sdpa enable_gqa']:.2f} | "
                     f"{ms['sdpa expanded cache']:.2f} | {r['ratio_gqa']:.2f} | "
                     f"{r['ratio_expanded']:.2f} | {r['max_abs_diff_vs_sdpa']:.1e} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
