"""Issue 37's speed cost: tiled bf16 with upcast fp32 tiles (the default now) against bf16 tile
GEMMs (ATTN_TILED_BF16_GEMM=1, the former default), interleaved rounds, medians of in-round
ratios; B=1 H=8 D=64 causal N=4096, fwd and fwd+bwd."""
import os, statistics, torch, attn
from attn.timing import paired, median_ratio
for grad in (False, True):
    q, k, v = (torch.randn(1, 8, 4096, 64).bfloat16().requires_grad_(grad) for _ in range(3))
    def mk(flag):
        def go():
            os.environ["ATTN_TILED_BF16_GEMM"] = flag
            o = attn.attention(q, k, v, causal=True, backend="tiled")
            if grad:
                o.sum().backward()
        return go
    fns = {"bf16 GEMMs": mk("1"), "upcast": mk("0")}
    for f in fns.values(): f()
    t = paired(fns, 4)
    print("fwd+bwd" if grad else "fwd", {n: round(1e3 * statistics.median(x), 1) for n, x in t.items()},
          "bf16-GEMM time / upcast time = %.2f" % median_ratio(t, "bf16 GEMMs", "upcast"))
