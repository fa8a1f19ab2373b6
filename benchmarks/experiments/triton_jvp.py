"""Experiment (issue 41, triton): time and peak memory of triton's forward-mode pass
(``torch.func.jvp``: the forward, then the ``_attn_jvp`` kernel) against its forward, at
several N, beside the reference backend's jvp (the N x N scores materialized: what a user
has today); and ``vmap(grad(loss))`` over 16 samples against a loop of ``grad``. Targets:
jvp within 3.5x the forward's time and 1.5x its peak memory; vmap(grad) within 1.5x the loop.

Times are medians of interleaved rounds (attn.timing.paired); ratios are taken within each
round. Peak: bytes allocated above the inputs (attn.timing.peak_bytes). On CUDA::

    python benchmarks/experiments/triton_jvp.py --n 4096 8192 16384
    python benchmarks/experiments/triton_jvp.py --per-sample 1024

On CPU only in the Triton interpreter (TRITON_INTERPRET=1, tiny sizes: a smoke run).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.func import grad, jvp, vmap

import attn
from attn.timing import paired, peak_bytes


def cases(backend: str, q, k, v, tq, tk, tv) -> dict:
    """name → a callable: the forward alone, and jvp along q, k and v (causal)."""
    def fwd():
        return attn.attention(q, k, v, causal=True, backend=backend)

    def tangent():
        return jvp(lambda a, b, c: attn.attention(a, b, c, causal=True, backend=backend),
                   (q, k, v), (tq, tk, tv))

    return {"forward": fwd, "jvp": tangent}


def per_sample(n: int, heads: int, head_dim: int, rounds: int, device: str, dtype,
               samples: int = 16) -> None:
    """``vmap(grad(loss))`` over ``samples`` sequences against a Python loop of ``grad``."""
    q, k, v = (torch.randn(samples, heads, n, head_dim, device=device, dtype=dtype)
               for _ in range(3))

    def loss(a, b, c):
        return attn.attention(a[None], b[None], c[None], causal=True,
                              backend="triton").float().square().sum()
    g = grad(loss, argnums=(0, 1, 2))
    fns = {"vmap": lambda: vmap(g)(q, k, v),
           "loop": lambda: [g(q[i], k[i], v[i]) for i in range(samples)]}
    for fn in fns.values():
        fn()
    times = paired(fns, rounds=rounds, device=device)
    ratio = statistics.median(a / b for a, b in zip(times["vmap"], times["loop"]))
    print(f"triton per-sample gradients, {samples} samples of (H={heads}, N={n}, "
          f"D={head_dim}): vmap {statistics.median(times['vmap']) * 1e3:.1f} ms, loop "
          f"{statistics.median(times['loop']) * 1e3:.1f} ms, vmap / loop {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reference-up-to", type=int, default=8192,
                    help="run the reference's jvp (N x N) only up to this N")
    ap.add_argument("--per-sample", type=int, default=0, metavar="N",
                    help="instead: vmap(grad) over 16 samples of length N against a loop")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.per_sample:
        per_sample(args.per_sample, args.heads, args.head_dim, args.rounds, args.device, dtype)
        return
    print(f"torch {torch.__version__}, {args.device}, {args.dtype}, B=1 H={args.heads} "
          f"D={args.head_dim}, causal; peak MiB above the inputs; ms median of "
          f"{args.rounds} interleaved rounds; ratios to triton's forward within each round")
    print("| N | backend | case | peak MiB | ms | ms / forward's | peak / forward's |")
    print("|---|---|---|---|---|---|---|")
    for n in args.n:
        shape = (1, args.heads, n, args.head_dim)
        q, k, v, tq, tk, tv = (torch.randn(shape, device=args.device, dtype=dtype)
                               for _ in range(6))
        rows, fns = [], {}
        backends = ["triton"] + (["reference"] if n <= args.reference_up_to else [])
        for be in backends:
            for name, fn in cases(be, q, k, v, tq, tk, tv).items():
                fn()  # warm-up (autotuning, first-call costs)
                rows.append((be, name, peak_bytes(fn, args.device)))
                fns[f"{be} {name}"] = fn
        times = paired(fns, rounds=args.rounds, device=args.device)
        fwd_peak = next(b for be, name, b in rows if be == "triton" and name == "forward")
        for be, name, peak in rows:
            t, f = times[f"{be} {name}"], times["triton forward"]
            ratio = statistics.median(a / b for a, b in zip(t, f))
            print(f"| {n} | {be} | {name} | {peak / 2**20:.1f} | "
                  f"{statistics.median(t) * 1e3:.2f} | {ratio:.2f} | "
                  f"{peak / max(fwd_peak, 1):.2f} |", flush=True)


if __name__ == "__main__":
    main()
