import torch, attn, sys
from attn.timing import peak_bytes
from torch.nn.functional import scaled_dot_product_attention as sdpa
torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    for N in (2048, 4096):
        q,k,v = (torch.randn(1,8,N,64,dtype=dt, requires_grad=True) for _ in range(3))
        m = torch.rand(1,1,N,N) > 0.2
        def fb(fn):
            def f():
                o = fn(); o.sum().backward()
            return f
        r = {}
        for name, fn in (("sdpa", lambda: sdpa(q,k,v,attn_mask=m)), ("fused", lambda: attn.scaled_dot_product_attention(q,k,v,attn_mask=m,backend="fused"))):
            f = fb(fn); f()
            r[name] = round(peak_bytes(f, "cpu") / 2**20, 1)
        print(str(dt)[6:], N, r, "fused/sdpa", round(r["fused"]/r["sdpa"], 2))
