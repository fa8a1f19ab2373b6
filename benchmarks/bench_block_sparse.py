"""Block-sparse attention: what a document mask costs next to dense attention.

    python benchmarks/bench_block_sparse.py --n 4096 --docs 8 \\
        --out benchmarks/results/block_sparse_cpu.md

Rows, same q, k, v (B=1, fp32), one process:

* dense: attn.attention, no mask (every tile);
* dense + mask: the document mask as a dense bool attn_mask (every tile visited, masked);
* flex block mask: attn.flex_attention with attn.create_block_mask's BlockMask (empty tiles
  skipped, full ones mask-free);
* varlen: attn.varlen_attention on the same documents (cu_seqlens);
* torch flex (eager): torch.nn.attention.flex_attention with the same BlockMask, forward
  only (eager torch materializes the scores; it has no CPU backward);
* torch flex (compiled): the same through ``torch.compile(dynamic=False)`` (inductor's CPU
  flex kernel), forward only; the compile happens in the warm-up call, outside the timing.

With D documents of equal length the visited tiles are 1/D of dense, so the ideal time
ratio is 1/D. Time: median of ``--repeats`` runs after one warm-up, the repeats taken
round-robin over the rows (a shared machine's load changes then hit every row alike);
forward, and forward + backward (a random upstream gradient on the output).
FLOPs counted as dense (4·B·H·N²·Dh forward, 2.5x that backward) so TFLOP/s columns show
the effective rate; the ratio column is time over dense's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as torch_flex  # noqa: E402

import attn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=256, help="block mask BLOCK_SIZE")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    N, H, Dh, docs = args.n, args.heads, args.head_dim, args.docs
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, N, Dh, generator=g) for _ in range(3))
    d_out = torch.randn(1, H, N, Dh, generator=g)
    doc = torch.arange(N) * docs // N  # D equal documents

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    t0 = time.perf_counter()
    block_mask = attn.create_block_mask(same_doc, None, None, N, N, BLOCK_SIZE=args.block)
    build_s = time.perf_counter() - t0
    dense_mask = same_doc(0, 0, torch.arange(N)[:, None], torch.arange(N)[None, :])
    cu = torch.arange(docs + 1, dtype=torch.int32) * N // docs
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # (N, H, Dh)

    rows = {
        "dense": lambda q, k, v: attn.attention(q, k, v, backend="tiled"),
        "dense + mask": lambda q, k, v: attn.attention(q, k, v, attn_mask=dense_mask,
                                                       backend="tiled"),
        "flex block mask": lambda q, k, v: attn.flex_attention(q, k, v, block_mask=block_mask),
        "varlen": None,
        "torch flex (eager)": lambda q, k, v: torch_flex(q, k, v, block_mask=block_mask),
        "torch flex (compiled)": lambda q, k, v: compiled_flex(q, k, v, block_mask=block_mask),
    }
    compiled_flex = torch.compile(torch_flex, dynamic=False)
    calls = []  # (name, forward, forward + backward or None)
    for name, fn in rows.items():
        if name == "varlen":
            def fwd():
                return attn.varlen_attention(*packed, cu, cu, N // docs, N // docs)
            leaves = [t.clone().requires_grad_() for t in packed]
            d_packed = d_out[0].transpose(0, 1).contiguous()

            def fwd_bwd(leaves=leaves):
                out = attn.varlen_attention(*leaves, cu, cu)
                torch.autograd.grad(out, leaves, d_packed)
        else:
            def fwd(fn=fn):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return fn(q, k, v)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def fwd_bwd(fn=fn, leaves=leaves):
                out = fn(*leaves)
                torch.autograd.grad(out, leaves, d_out)
        calls.append((name, fwd, None if name.startswith("torch") else fwd_bwd))
    # warm-up (compiles), then the repeats round-robin over the rows: the machine is shared,
    # and a load change then hits every row alike instead of a few rows
    for _, fwd, fwd_bwd in calls:
        with torch.no_grad():
            fwd()
        if fwd_bwd is not None:
            fwd_bwd()
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n, _, _ in calls}
    for _ in range(args.repeats):
        for name, fwd, fwd_bwd in calls:
            t0 = time.perf_counter()
            with torch.no_grad():
                fwd()
            times[name][0].append(time.perf_counter() - t0)
            if fwd_bwd is not None:
                t0 = time.perf_counter()
                fwd_bwd()
                times[name][1].append(time.perf_counter() - t0)
    results = [(n, statistics.median(f), statistics.median(fb) if fb else None)
               for n, (f, fb) in times.items()]
    for name, t_f, t_fb in results:
        print(name, f"{t_f * 1e3:.1f} ms", "" if t_fb is None else f"{t_fb * 1e3:.1f} ms")

    flops_f = 4 * H * N * N * Dh
    dense_f, dense_fb = results[0][1], results[0][2]
    c = block_mask.kv_num_blocks.sum().item(), block_mask.full_kv_num_blocks.sum().item()
    lines = [
        f"# Block-sparse attention on CPU: a document mask ({docs} documents) against dense",
        "",
        f"- command: `python benchmarks/bench_block_sparse.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"{platform.platform()}; load average before the run "
        f"{', '.join(f'{x:.2f}' for x in LOAD)} (1, 5, 15 min; the machine is shared)",
        f"- versions: torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- shape: B=1, H={H}, N={N}, head dim {Dh}, fp32; {docs} equal documents; block mask "
        f"BLOCK_SIZE={args.block}: {c[1]} full + {c[0]} partial tiles of "
        f"{(-(-N // args.block)) ** 2} (create_block_mask took {build_s * 1e3:.0f} ms, once)",
        f"- time: median of {args.repeats} runs after a warm-up, round-robin over the rows; "
        f"ideal ratio 1/{docs} = {1 / docs:.3f}; TFLOP/s counted as dense (4·B·H·N²·D forward, 2.5x backward)",
        "",
        "| row | fwd ms | fwd vs dense | fwd TFLOP/s (dense-equiv.) | fwd+bwd ms "
        "| fwd+bwd vs dense |",
        "|---|---|---|---|---|---|",
    ]
    for name, t_f, t_fb in results:
        fb = "not run (forward only)" if t_fb is None else f"{t_fb * 1e3:,.1f}"
        fb_ratio = "" if t_fb is None else f"{t_fb / dense_fb:.3f}"
        lines.append(f"| {name} | {t_f * 1e3:,.1f} | {t_f / dense_f:.3f} | "
                     f"{flops_f / t_f / 1e12:.3f} | {fb} | {fb_ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


LOAD = os.getloadavg()

if __name__ == "__main__":
    main()
