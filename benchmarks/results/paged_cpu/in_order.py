"""Paged pages in storage order (as PagedKVCache.allocate hands them out) against the same
data contiguous and shuffled, through flash_attn_with_kvcache: B=8, L=4096, page 16, fp32,
median of 11 interleaved rounds. Run from the repository root:
`PYTHONPATH=$PWD python benchmarks/results/paged_cpu/in_order.py`."""
import torch, statistics, time
from attn.compat import flash_attn as fa
from attn.bench.decode import paged_copy
g = torch.Generator().manual_seed(0)
B, L, H, Hkv, D, page = 8, 4096, 32, 8, 128, 16
kc, vc = (torch.randn(B, L, Hkv, D, generator=g) for _ in range(2))
q = torch.randn(B, 1, H, D, generator=g)
n = L // page
in_order = (kc.reshape(B * n, page, Hkv, D), vc.reshape(B * n, page, Hkv, D),
            torch.arange(B * n, dtype=torch.int32).view(B, n))
kp, table, vp = paged_copy(kc, vc, page, g)
paths = {"contiguous": lambda: fa.flash_attn_with_kvcache(q, kc, vc, causal=True),
         "paged in order": lambda: fa.flash_attn_with_kvcache(q, in_order[0], in_order[1], block_table=in_order[2], causal=True),
         "paged shuffled": lambda: fa.flash_attn_with_kvcache(q, kp, vp, block_table=table, causal=True)}
times = {k: [] for k in paths}
with torch.inference_mode():
    for f in paths.values(): f()
    for _ in range(11):
        for k, f in paths.items():
            t0 = time.perf_counter(); f(); times[k].append(time.perf_counter() - t0)
for k, v in times.items():
    print(f"{k}: {statistics.median(v)*1e3:.1f} ms")
