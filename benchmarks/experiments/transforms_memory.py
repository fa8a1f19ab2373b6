"""Experiment (issue 41): peak memory and time of forward-mode AD (``torch.func.jvp``) and of
a double-backward step (``create_graph=True`` gradients, differentiated again), tiled
against the reference backend (what a user has today: the N x N scores materialized), at
several N. Memory: peak bytes allocated above the inputs (attn.timing.peak_bytes, torch's
CPU profiler; CUDA: max_memory_allocated), and the working memory: that peak less what the
case returns (a jvp returns the primal output and its tangent, twice a forward's). Times:
median of interleaved rounds (the backends take turns), so ratios hold on a loaded machine.

    python benchmarks/experiments/transforms_memory.py --n 512 1024 2048 --rounds 3
    python benchmarks/experiments/transforms_memory.py --n 4096 8192 16384 --reference-max 2048
    python benchmarks/experiments/transforms_memory.py --per-sample 256 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.func import jvp

import attn
from attn.bench.paired import busy_core
from attn.timing import paired, peak_bytes


def cases(backend: str, q, k, v, tq, tk, tv):
    """name → a callable: forward, forward + backward, jvp, double-backward step."""
    def fwd():
        with torch.no_grad():
            return attn.attention(q, k, v, causal=True, backend=backend)

    def fwd_bwd():
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn.attention(*x, causal=True, backend=backend)
        return torch.autograd.grad((out * out).sum(), x)

    def tangent():
        return jvp(lambda a, b, c: attn.attention(a, b, c, causal=True, backend=backend),
                   (q, k, v), (tq, tk, tv))

    def double():
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attn.attention(*x, causal=True, backend=backend)
        g = torch.autograd.grad((out * out).sum(), x, create_graph=True)
        return torch.autograd.grad(sum((t * t).sum() for t in g), x)

    return {"forward": fwd, "fwd+bwd": fwd_bwd, "jvp": tangent, "double bwd": double}


def per_sample(n: int, heads: int, head_dim: int, rounds: int, samples: int = 16) -> None:
    """``vmap(grad(loss))`` over ``samples`` sequences against a Python loop of ``grad``."""
    from torch.func import grad, vmap

    q, k, v = (torch.randn(samples, heads, n, head_dim) for _ in range(3))
    fns = {}
    for be in ("tiled", "reference"):
        def loss(a, b, c, be=be):
            return attn.attention(a[None], b[None], c[None], causal=True,
                                  backend=be).square().sum()
        g = grad(loss, argnums=(0, 1, 2))
        fns[f"{be} vmap"] = lambda g=g: vmap(g)(q, k, v)
        fns[f"{be} loop"] = lambda g=g: [g(q[i], k[i], v[i]) for i in range(samples)]
    for fn in fns.values():
        fn()
    times = paired(fns, rounds=rounds)
    print(f"per-sample gradients, {samples} samples of (H={heads}, N={n}, D={head_dim}):")
    for be in ("tiled", "reference"):
        ratio = statistics.median(a / b for a, b in zip(times[f"{be} vmap"],
                                                        times[f"{be} loop"]))
        print(f"| {be} | vmap {statistics.median(times[f'{be} vmap']) * 1e3:.1f} ms | loop "
              f"{statistics.median(times[f'{be} loop']) * 1e3:.1f} ms | vmap / loop "
              f"{ratio:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reference-max", type=int, default=1 << 30, metavar="N",
                    help="run the reference backend (N x N scores) only up to this N")
    ap.add_argument("--per-sample", type=int, default=0, metavar="N",
                    help="instead: vmap(grad) over 16 samples of length N against a loop")
    ap.add_argument("--busy-core", action="store_true",
                    help="keep one core busy with a spinning process for the run")
    args = ap.parse_args()
    with busy_core(args.busy_core):
        run(args)


def run(args) -> None:
    torch.manual_seed(0)
    if args.per_sample:
        per_sample(args.per_sample, args.heads, args.head_dim, args.rounds)
        return
    print(f"torch {torch.__version__}, {args.device}, float32, B=1 H={args.heads} "
          f"D={args.head_dim}, causal; peak MiB above the inputs; ms median of "
          f"{args.rounds} interleaved rounds{'; one core kept busy' if args.busy_core else ''}")
    print("| N | backend | case | peak MiB | peak / forward's | working MiB | working / "
          "forward's | ms | ms / forward's | ms / fwd+bwd's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        shape = (1, args.heads, n, args.head_dim)
        q, k, v, tq, tk, tv = (torch.randn(shape, device=args.device) for _ in range(6))
        rows = []
        fns = {}
        for be in ("tiled", "reference"):
            if be == "reference" and n > args.reference_max:
                continue
            for name, fn in cases(be, q, k, v, tq, tk, tv).items():
                kept = fn()  # warm-up (plans, first-call costs); what the case returns
                ret = sum(t.nbytes for t in torch.utils._pytree.tree_leaves(kept)
                          if isinstance(t, torch.Tensor))
                rows.append((be, name, peak_bytes(fn, args.device) / 2**20, ret / 2**20))
                fns[f"{be} {name}"] = fn
        times = paired(fns, rounds=args.rounds)
        peaks = {(be, name): (mib, mib - ret) for be, name, mib, ret in rows}
        for be, name, mib, ret in rows:
            t, f, fb = (times[f"{be} {x}"] for x in (name, "forward", "fwd+bwd"))
            ratio = statistics.median(a / b for a, b in zip(t, f))  # within each round
            ratio_fb = statistics.median(a / b for a, b in zip(t, fb))
            f_peak, f_work = peaks[be, "forward"]
            print(f"| {n} | {be} | {name} | {mib:.1f} | {mib / f_peak:.2f} | {mib - ret:.1f} | "
                  f"{(mib - ret) / f_work:.2f} | {statistics.median(t) * 1e3:.1f} | "
                  f"{ratio:.2f} | {ratio_fb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
