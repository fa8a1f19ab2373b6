"""Whether torch's CPU flash-attention op gives the same bits on 1 and 2 intra-op threads:
B=1 H=4, Nq = Nk = N, out, lse and its backward's dQ/dK/dV, for N in 1..69 and some larger,
D in 8..128, float32 and float64. Prints, per dtype, how many (D, N) differ, the N among them,
and those at N >= 32 (attn.fused makes one op call over a batch on torch's threads only from
32 query rows: docs/benchmarks.md). Run: python benchmarks/experiments/cpu_op_thread_bits.py
"""
import torch

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
NAMES = ("out", "lse", "dq", "dk", "dv")

for dtype in (torch.float32, torch.float64):
    bad = []
    for D in (8, 16, 32, 40, 64, 128):
        for N in list(range(1, 70)) + [100, 130, 191, 192, 200, 257, 300, 513, 769]:
            g = torch.Generator().manual_seed(N * 131 + D)
            q, k, v, do = (torch.randn(1, 4, N, D, generator=g, dtype=dtype) for _ in range(4))
            runs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out, lse = FWD(q, k, v, 0.0, False)
                runs.append((out, lse, *BWD(do, q, k, v, out, lse, 0.0, False)))
            differ = [n for n, a, b in zip(NAMES, *runs) if not torch.equal(a, b)]
            if differ:
                bad.append((D, N, differ))
    print(torch.__version__, dtype, len(bad), "differ; N:", sorted({N for _, N, _ in bad}),
          "; at N >= 32:", [b for b in bad if b[1] >= 32])
