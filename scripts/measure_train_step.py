"""Peak memory and time of one GPT training step (forward + backward + AdamW) per backend.

    python scripts/measure_train_step.py --lengths 2048 4096 --backends reference tiled sdpa \\
        --out benchmarks/results/train_step_memory_cpu.md

Peak memory: :func:`attn.bench.memory.peak_bytes` — on CPU, the live-bytes curve of torch's
allocator recorded by the profiler, above what existed before the step (the model, its
AdamW state and gradients from a warm-up step, and the batch), so it counts activations,
the attention's saved tensors and workspaces, and the new gradients. Time: median of
``--repeats`` steps run without the profiler, after the warm-up step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from attn.bench.memory import CPU_ERROR_BYTES, peak_bytes  # noqa: E402
from attn.models import GPT, AttentionConfig, GPTConfig  # noqa: E402
from attn.models.data import VOCAB_SIZE  # noqa: E402


def measure(n: int, backend: str, args: argparse.Namespace) -> tuple[int, float]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB_SIZE, block_size=n, n_layer=args.n_layer, dim=args.dim,
                    attention=AttentionConfig(heads=args.heads, backend=backend))
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB_SIZE, (args.batch, n))
    y = torch.randint(0, VOCAB_SIZE, (args.batch, n))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()

    step()  # warm-up: AdamW state and gradients exist before measuring
    peak = peak_bytes(step)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return peak, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--backends", nargs="+", default=["reference", "tiled", "sdpa"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    rows = []
    for n in args.lengths:
        base = None
        for backend in args.backends:
            peak, sec = measure(n, backend, args)
            if backend == "reference":
                base = peak
            ratio = f"{peak / base:.1%}" if base else "–"
            rows.append(f"| {n} | {backend} | {peak / 2**20:,.1f} | {ratio} | {sec * 1e3:,.0f} |")
            print(rows[-1], flush=True)
    cmd = "python " + " ".join(sys.argv)
    text = "\n".join([
        "# One GPT training step on CPU: peak memory and time per attention backend", "",
        f"- command: `{cmd}`",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{platform.processor() or platform.platform()}",
        f"- versions: torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- model: GPT n_layer={args.n_layer}, dim={args.dim}, heads={args.heads} "
        f"(head_dim {args.dim // args.heads}), RoPE, causal, batch {args.batch}, fp32, AdamW",
        "- peak memory: attn.bench.memory.peak_bytes (torch profiler allocator events, bytes "
        "above the model, optimizer state and batch; misses allocations outside c10, "
        f"documented bound {CPU_ERROR_BYTES / 2**20:.0f} MiB)",
        f"- time: median of {args.repeats} steps after a warm-up step; absolute times "
        "depend on the machine and its load: compare rows of one run",
        "", "| N | backend | peak MiB | vs reference | step ms |", "|---|---|---|---|---|",
        *rows, ""])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
