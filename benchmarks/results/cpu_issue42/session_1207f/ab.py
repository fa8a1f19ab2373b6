"""A/B: one process per code version would differ in state; instead time this version's
calls, printed as JSON, and the driver interleaves processes."""
import json, sys, time, torch, attn
torch.manual_seed(0)
cases = {
 "window1024_N4096_fwdbwd": dict(B=1, H=8, N=4096, kw=dict(window=(1024, 0))),
 "causal_N2048_fwdbwd": dict(B=1, H=8, N=2048, kw=dict(is_causal=True)),
 "boolmask_B2_N1024_fwdbwd": dict(B=2, H=8, N=1024, kw="mask"),
}
res = {}
for name, c in cases.items():
    B, H, N = c["B"], c["H"], c["N"]
    q, k, v = (torch.randn(B, H, N, 64, requires_grad=True) for _ in range(3))
    kw = c["kw"]
    if kw == "mask":
        kw = dict(attn_mask=torch.rand(B, 1, N, N) > 0.2)
    def step():
        if "window" in kw:
            out = attn.attention(q, k, v, window=kw["window"], backend="fused")
        else:
            out = attn.scaled_dot_product_attention(q, k, v, backend="fused", **kw)
        out.sum().backward()
    step()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    ts.sort(); res[name] = ts[2] * 1e3
print(json.dumps(res))
