"""One-time cost of the tiled backend's fused CPU path (ATTN_TILED_COMPILE=1).

Runs in a fresh inductor cache directory (so nothing is reused from earlier runs), times
the first forward+backward call (which compiles every step it needs), then the second call
(compiled), then calls at other sequence lengths and batch sizes, and counts the graphs
dynamo built: a sequence length or batch size must not add any.

    python benchmarks/experiments/fused_compile_time.py --n 4096
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    os.environ["ATTN_TILED_COMPILE"] = "1"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn-inductor-")
    import torch
    from torch._dynamo.utils import counters

    import attn
    from attn import tiled

    if args.threads:
        torch.set_num_threads(args.threads)

    def step(B, N, causal=True):
        q, k, v = (torch.randn(B, 8, N, 64, requires_grad=True) for _ in range(3))
        t0 = time.perf_counter()
        attn.attention(q, k, v, causal=causal, backend="tiled").sum().backward()
        return time.perf_counter() - t0

    first = step(1, args.n)
    second = step(1, args.n)
    graphs = counters["stats"]["unique_graphs"]
    others = [step(B, n) for B, n in ((1, args.n + 300), (2, args.n // 2 + 77), (3, 1000))]
    print(f"fused path: {tiled.steps_path_reason('cpu')}")
    print(f"first fwd+bwd call (compiles): {first:.1f} s; second: {second:.2f} s; "
          f"one-time compile cost ~{first - second:.1f} s")
    print(f"graphs after the first shape: {graphs}; after 3 more lengths/batches: "
          f"{counters['stats']['unique_graphs']} (calls took "
          + ", ".join(f"{t:.2f}" for t in others) + " s)")


if __name__ == "__main__":
    main()
