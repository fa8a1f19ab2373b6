"""``attn bench train-step``: peak memory and time of one GPT training step per backend.

Forward, backward and AdamW on the toy GPT of :mod:`attn.models`, the same seed and batch for
every backend (the warm-up step's loss is in the rows: they agree to rounding);
docs/benchmarks.md ("Memory of a training step") has the method and the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from attn.bench import report
from attn.models import GPT, AttentionConfig, GPTConfig
from attn.models.data import VOCAB_SIZE
from attn.timing import CPU_ERROR_BYTES, peak_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", "--n", dest="lengths", type=int, nargs="+", default=[2048, 4096],
                   help="sequence lengths N (the model's block size)")
    p.add_argument("--backends", nargs="+", default=["reference", "tiled", "sdpa"])
    p.add_argument("--batch", "-B", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", "-H", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="timed steps (median)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", type=Path, default=Path("out/bench-train-step"),
                   help="folder for results.json and results.md")


def measure(n: int, backend: str, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB_SIZE, block_size=n, n_layer=args.n_layer, dim=args.dim,
                    attention=AttentionConfig(heads=args.heads, backend=backend))
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB_SIZE, (args.batch, n))
    y = torch.randint(0, VOCAB_SIZE, (args.batch, n))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    loss = step()  # warm-up: AdamW state and gradients exist before measuring
    peak = peak_bytes(step)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"N": n, "backend": backend, "peak_bytes": peak,
            "step_ms": statistics.median(times) * 1e3, "loss": loss}


def markdown(header: dict, rows: list[dict]) -> str:
    m = header["model"]
    reference = {r["N"]: r["peak_bytes"] for r in rows if r["backend"] == "reference"}
    lines = [
        "# One GPT training step on CPU: peak memory and time per attention backend", "",
        *report.machine_lines(header),
        f"- model: GPT n_layer={m['n_layer']}, dim={m['dim']}, heads={m['heads']} "
        f"(head_dim {m['dim'] // m['heads']}), RoPE, causal, batch {m['batch']}, fp32, AdamW",
        "- peak memory: attn.timing.peak_bytes (torch profiler allocator events, bytes above "
        "the model, optimizer state and batch; misses allocations outside c10, documented "
        f"bound {CPU_ERROR_BYTES / 2**20:.0f} MiB)",
        f"- time: median of {m['repeats']} steps after a warm-up step; absolute times depend "
        "on the machine and its load: compare rows of one run",
        "", "| N | backend | peak MiB | vs reference | step ms | loss |",
        "|---|---|---|---|---|---|"]
    for r in rows:
        base = reference.get(r["N"])
        ratio = f"{r['peak_bytes'] / base:.1%}" if base else "–"
        lines.append(f"| {r['N']} | {r['backend']} | {r['peak_bytes'] / 2**20:,.1f} | {ratio} "
                     f"| {r['step_ms']:,.0f} | {r['loss']:.4f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    header = report.run_header("cpu", argv)
    header["model"] = {"n_layer": args.n_layer, "dim": args.dim, "heads": args.heads,
                       "batch": args.batch, "repeats": args.repeats}
    rows = []
    for n, backend in itertools.product(args.lengths, args.backends):
        r = measure(n, backend, args)
        rows.append(r)
        print(f"N={n} {backend}: peak {r['peak_bytes'] / 2**20:,.1f} MiB, "
              f"{r['step_ms']:,.0f} ms", file=sys.stderr, flush=True)
    report.write_results(args.out, header, rows, markdown(header, rows))
    return 0
