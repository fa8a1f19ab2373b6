"""Experiment (issue 13): ``torch.compile`` of a whole query block's loop body on CPU.

The forward for one block of queries — every key tile's GEMM, online-softmax update and
P·V — as one Python function compiled by inductor (its C++ backend; the GEMMs stay aten
calls). Dynamo unrolls the loop over key tiles, so the graph depends on the number of key
tiles: one compile per sequence length (dynamic shapes cannot fold a Python loop count).
This measures what that buys against the tiled backend's default path and against torch
SDPA, and what it costs to compile, on the plain non-causal forward (fp32, B=1, H=8, D=64),
the backends taking turns round after round.

    python benchmarks/experiments/compile_qblock_cpu.py --n 1024 2048 4096 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import attn
from attn.timing import median_ratio, paired

LOG2E = 1.4426950408889634


def qblock(q_blk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int) -> torch.Tensor:
    """out for one query block ``(B·H, BM, D)`` against all keys ``(B·H, N, D)``."""
    m_i = torch.full(q_blk.shape[:2] + (1,), -1e30)
    l_i = torch.zeros(q_blk.shape[:2] + (1,))
    acc = torch.zeros(q_blk.shape[:2] + (v.shape[-1],))
    for n0 in range(0, k.shape[1], block_n):
        s = torch.bmm(q_blk, k[:, n0:n0 + block_n].transpose(1, 2))
        m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
        p = torch.exp2(s - m_new)
        alpha = torch.exp2(m_i - m_new)
        l_i = l_i * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v[:, n0:n0 + block_n])
        m_i = m_new
    return acc / l_i


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--block-m", type=int, default=256)
    p.add_argument("--block-n", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    BM, BN = args.block_m, args.block_n
    print("| N | compile s | compiled q-block / SDPA | tiled default / SDPA | max err |")
    print("|--:|--:|--:|--:|--:|")
    for N in args.n:
        g = torch.Generator().manual_seed(N)
        q, k, v = (torch.randn(1, 8, N, 64, generator=g) for _ in range(3))
        q3, k3, v3 = (x.reshape(8, N, 64) for x in (q, k, v))
        torch._dynamo.reset()
        fn = torch.compile(qblock, dynamic=False)
        scale = 64 ** -0.5 * LOG2E

        def compiled():
            return torch.cat([fn(q3[:, m0:m0 + BM] * scale, k3, v3, BN)
                              for m0 in range(0, N, BM)], dim=1)
        t0 = time.perf_counter()
        out = compiled()
        compile_s = time.perf_counter() - t0
        ref = F.scaled_dot_product_attention(q, k, v).reshape(8, N, 64)
        err = (out - ref).abs().max().item()
        fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v), "compiled": compiled,
               "tiled": lambda: attn.attention(q, k, v, backend="tiled")}
        for f in fns.values():
            f()
        times = paired(fns, args.rounds)
        ratio = {n: median_ratio(times, "sdpa", n) for n in fns}
        print(f"| {N} | {compile_s:.1f} | {ratio['compiled']:.2f} | {ratio['tiled']:.2f} | "
              f"{err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
