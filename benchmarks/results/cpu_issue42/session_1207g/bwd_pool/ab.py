import sys, subprocess, json, statistics
trees = {"old": "/tmp/old", "new": "/work/main"}
code = r'''
import torch, time, attn, json, statistics
from torch.nn.functional import scaled_dot_product_attention as sdpa
torch.manual_seed(0)
res = {}
for name, dt, B, H, N, causal in [("train bf16", "bfloat16", 8, 12, 512, True), ("train fp32", "float32", 8, 12, 512, True), ("causal4096 bf16", "bfloat16", 1, 8, 4096, True)]:
    dt = getattr(torch, dt)
    q,k,v = (torch.randn(B,H,N,64,dtype=dt, requires_grad=True) for _ in range(3))
    def s():
        sdpa(q,k,v,is_causal=causal).sum().backward()
    def f():
        attn.scaled_dot_product_attention(q,k,v,is_causal=causal,backend="fused").sum().backward()
    f(); s()
    r=[]
    for _ in range(3):
        f(); t=time.perf_counter(); s(); a=time.perf_counter()-t
        f(); t=time.perf_counter(); f(); b=time.perf_counter()-t
        r.append(a/b)
    res[name]=statistics.median(r)
print(json.dumps(res))
'''
out = {t: [] for t in trees}
for rnd in range(3):
    for t, path in trees.items():
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, cwd="/tmp")
        if p.returncode: print(p.stderr[-2000:]); sys.exit(1)
        out[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
for n in out["old"][0]:
    print(n, "SDPA/fused fwd+bwd old", round(statistics.median(r[n] for r in out["old"]),3), "new", round(statistics.median(r[n] for r in out["new"]),3))
