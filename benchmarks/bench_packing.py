"""Packed against padded training throughput of the toy GPT, over a spread of document lengths.

    python benchmarks/bench_packing.py --out benchmarks/results/packing_cpu.md

One "epoch" is a fixed set of documents whose lengths are drawn from a distribution (or the
stdlib documents ``--pack`` trains on). Both modes train on exactly those tokens:

* padded: ``--batch`` documents per step, each row one document right-padded to the longest
  in the step (dynamic padding; documents longer than ``--block`` are cut). Causal attention
  keeps real tokens from seeing the padding, whose targets are ignored.
* packed: documents laid end to end into rows of ``--block`` tokens, ``--batch`` rows per
  step, a document mask between them (GPT(doc_ids=...) → attn.varlen_attention; tiles
  between documents skipped).

Throughput: real (non-padding) tokens per second of training steps (forward, backward,
AdamW), summed over the epoch, median of ``--repeats`` epochs after a warm-up step, the
epochs alternating between the two modes (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402

from attn.models import GPT, AttentionConfig, GPTConfig  # noqa: E402
from attn.models.data import IGNORE, VOCAB_SIZE  # noqa: E402

LOAD = os.getloadavg()


def lengths_for(name: str, total: int, block: int, g: torch.Generator) -> list[int]:
    """Document lengths summing to about ``total`` tokens."""
    if name == "stdlib":
        from attn.models.data import TextCorpus
        docs = TextCorpus.load().train_docs
        pool = (docs[1:] - docs[:-1]).clamp(max=block)
        pool = pool[pool > 1]
        out = []
        while sum(out) < total:
            out.append(int(pool[torch.randint(0, len(pool), (1,), generator=g)]))
        return out
    mean = int(name.split("-")[1])  # "lognormal-<mean>": spread sigma = 1
    sigma = 1.0
    mu = torch.log(torch.tensor(float(mean))) - sigma ** 2 / 2
    out = []
    while sum(out) < total:
        x = torch.exp(mu + sigma * torch.randn(1, generator=g)).item()
        out.append(int(min(block, max(2, round(x)))))
    return out


def padded_batches(lengths: list[int], batch: int, g: torch.Generator):
    for i in range(0, len(lengths), batch):
        chunk = lengths[i:i + batch]
        T = max(chunk)
        x = torch.randint(0, VOCAB_SIZE, (len(chunk), T), generator=g)
        y = torch.randint(0, VOCAB_SIZE, (len(chunk), T), generator=g)
        for r, n in enumerate(chunk):
            y[r, n:] = IGNORE
        yield x, y, None, sum(chunk)


def packed_batches(lengths: list[int], batch: int, block: int, g: torch.Generator):
    row_fill = 0
    rows: list[list[int]] = [[]]
    for n in lengths:  # first fit in order: a document that does not fit starts a new row
        if row_fill + n > block:
            rows.append([])
            row_fill = 0
        rows[-1].append(n)
        row_fill += n
    next_id = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        doc = torch.empty(len(chunk), block, dtype=torch.long)
        y = torch.randint(0, VOCAB_SIZE, (len(chunk), block), generator=g)
        for r, row in enumerate(chunk):
            pos = 0
            for n in row:
                doc[r, pos:pos + n] = next_id
                pos, next_id = pos + n, next_id + 1
            doc[r, pos:] = next_id  # the row's tail: one padding "document", no targets
            y[r, pos:] = IGNORE
            next_id += 1
        x = torch.randint(0, VOCAB_SIZE, (len(chunk), block), generator=g)
        yield x, y, doc, sum(sum(row) for row in chunk)


def run_epoch(model, opt, batches) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for x, y, doc, real in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y, doc_ids=doc)
        loss.backward()
        opt.step()
        seconds += time.perf_counter() - t0
        tokens += real
    return seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dists", nargs="+",
                   default=["lognormal-64", "lognormal-256", "lognormal-1024", "stdlib"])
    p.add_argument("--block", type=int, default=2048, help="packed row length")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per epoch")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=VOCAB_SIZE, block_size=args.block, n_layer=args.n_layer,
                    dim=args.dim, attention=AttentionConfig(heads=args.heads, backend="tiled"))
    rows = []
    for dist in args.dists:
        g = torch.Generator().manual_seed(0)
        lengths = lengths_for(dist, args.tokens, args.block, g)
        runs = {}
        for mode in ("padded", "packed"):
            torch.manual_seed(0)
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def batches(mode=mode):
                bg = torch.Generator().manual_seed(1)
                if mode == "padded":
                    return padded_batches(lengths, args.batch, bg)
                return packed_batches(lengths, args.batch, args.block, bg)
            run_epoch(model, opt, [next(iter(batches()))])  # warm-up step
            runs[mode] = (model, opt, batches, [])
        # epochs alternate between the modes: a shared machine's load changes hit both
        for _ in range(args.repeats):
            for mode, (model, opt, batches, times) in runs.items():
                seconds, tokens = run_epoch(model, opt, batches())
                times.append(seconds)
        result = {}
        for mode, (_, _, batches, times) in runs.items():
            result[mode] = (tokens / statistics.median(times), sum(1 for _ in batches()))
            print(dist, mode, f"{result[mode][0]:,.0f} tok/s", result[mode][1], "steps",
                  flush=True)
        lengths_t = torch.tensor(lengths, dtype=torch.float)
        rows.append((dist, len(lengths), lengths_t.mean().item(), lengths_t.median().item(),
                     result))

    lines = [
        "# Packed against padded training throughput (toy GPT, CPU)",
        "",
        f"- command: `python benchmarks/bench_packing.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{platform.platform()}; load average before the run "
        f"{', '.join(f'{x:.2f}' for x in LOAD)} (1, 5, 15 min; the machine is shared)",
        f"- versions: torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- model: GPT n_layer={args.n_layer}, dim={args.dim}, heads={args.heads}, RoPE, causal, "
        f"fp32, AdamW, attention backend tiled; {args.tokens} tokens per epoch",
        f"- padded: {args.batch} documents per step, each padded to the step's longest "
        f"(≤ {args.block}); packed: rows of {args.block} tokens, {args.batch} rows per step, "
        "documents kept apart by attn.varlen_attention",
        f"- tokens/s: real tokens over training-step time, median of {args.repeats} epochs "
        "after a warm-up step, alternating between the modes. Published packing gains are "
        "1.4-2x tokens/s.",
        "",
        "| documents | count | mean len | median len | padded tok/s (steps) "
        "| packed tok/s (steps) | packed / padded |",
        "|---|---|---|---|---|---|---|",
    ]
    for dist, count, mean, median, r in rows:
        (pad, pad_steps), (pack, pack_steps) = r["padded"], r["packed"]
        lines.append(f"| {dist} | {count} | {mean:.0f} | {median:.0f} | {pad:,.0f} ({pad_steps}) "
                     f"| {pack:,.0f} ({pack_steps}) | {pack / pad:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
