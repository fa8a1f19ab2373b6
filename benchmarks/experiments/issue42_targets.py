"""Issue 42's target table on this CPU: attn.attention (auto, and the fused backend) against
torch's F.scaled_dot_product_attention, as medians of in-round ratios over interleaved
rounds (attn.timing.paired), quiet or with one core kept busy (``--busy-core``).

    python benchmarks/experiments/issue42_targets.py --out benchmarks/results/cpu_issue42/quiet
    python benchmarks/experiments/issue42_targets.py --busy-core --out .../busy

Rows (each fp32 and bf16 unless said):
- what SDPA computes directly: plain N=2048, top-left causal N=4096, GQA 32:8 D=128 causal
  N=2048, a padding bool mask and a random one N=2048; fwd and fwd+bwd; the training shape B=8 H=12 N=512
  causal fwd+bwd. Target: attn >= 0.97x SDPA.
- sliding window 1024 at N=16384 and bottom-right causal prefill 512 x 8192 (fwd), SDPA given
  the equivalent dense bool mask. Target: >= 2x.
- sinks, return_lse, ALiBi (fp32) on causal N=4096 fwd: attn's time over its plain call's.
  Target: <= 1.25.
- decode Nq=1 against Nk 4k / 16k / 32k, GQA 32:8, D=128. Target: >= 1.5x.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import attn
from attn import choose
from attn.bench import report
from attn.bench.paired import busy_core
from attn.sdpa import torch_sdpa
from attn.timing import median_ratio, paired


def _qkv(B, H, Hkv, Nq, Nk, D, dtype, grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g).to(dtype).requires_grad_(grad)
                 for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))


def _step(fn, grad):
    def go():
        out = fn()
        if grad:
            out.sum().backward()
    return go


def _measure(fns: dict, rounds: int) -> dict:
    for f in fns.values():
        f()
    times = paired(fns, rounds)
    base = next(iter(fns))
    return {"ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "ratio": {n: median_ratio(times, base, n) for n in fns if n != base}}


def direct_rows(dtypes, rounds):
    """SDPA's own calls: attn auto and fused against it."""
    rows = []
    cases = [("plain N=2048", 1, 8, 8, 2048, 2048, 64, False, None),
             ("top-left causal N=4096", 1, 8, 8, 4096, 4096, 64, True, None),
             ("GQA 32:8 D=128 causal N=2048", 1, 32, 8, 2048, 2048, 128, True, None),
             ("padding bool mask N=2048", 2, 8, 8, 2048, 2048, 64, False, "pad"),
             # a mask of no band and padding, which every piece reads (1 in 5 pairs hidden)
             ("random bool mask N=2048", 1, 8, 8, 2048, 2048, 64, False, "random")]
    for dtype in dtypes:
        for name, B, H, Hkv, Nq, Nk, D, causal, mask in cases:
            for grad in (False, True):
                q, k, v = _qkv(B, H, Hkv, Nq, Nk, D, dtype, grad)
                m = None
                if mask == "pad":
                    lengths = torch.tensor([Nk, Nk * 3 // 4])
                    m = (torch.arange(Nk)[None] < lengths[:, None])[:, None, None, :]
                elif mask == "random":
                    g = torch.Generator().manual_seed(1)
                    m = torch.rand(B, 1, Nq, Nk, generator=g) > 0.2
                kw = {"enable_gqa": True} if H != Hkv else {}
                fns = {"sdpa": _step(lambda: torch_sdpa(q, k, v, attn_mask=m, is_causal=causal,
                                                        **kw), grad)}
                for be in ("auto", "fused"):
                    fns[be] = _step(lambda be=be: attn.scaled_dot_product_attention(
                        q, k, v, attn_mask=m, is_causal=causal, enable_gqa=H != Hkv,
                        backend=be), grad)
                r = _measure(fns, rounds)
                rows.append({"row": name, "dtype": str(dtype)[6:],
                             "mode": "fwd+bwd" if grad else "fwd", **r})
                print(rows[-1], flush=True)
    # the training shape
    for dtype in dtypes:
        q, k, v = _qkv(8, 12, 12, 512, 512, 64, dtype, True)
        fns = {"sdpa": _step(lambda: torch_sdpa(q, k, v, is_causal=True), True)}
        for be in ("auto", "fused"):
            fns[be] = _step(lambda be=be: attn.attention(q, k, v, causal=True, backend=be),
                            True)
        rows.append({"row": "training B=8 H=12 N=512 causal", "dtype": str(dtype)[6:],
                     "mode": "fwd+bwd", **_measure(fns, rounds)})
        print(rows[-1], flush=True)
    return rows


def band_rows(dtypes, rounds):
    rows = []
    for dtype in dtypes:
        for name, Nq, Nk, window in (("window 1024 at N=16384", 16384, 16384, (1024, 0)),
                                     ("bottom-right causal prefill 512x8192", 512, 8192,
                                      None)):
            q, k, v = _qkv(1, 8, 8, Nq, Nk, 64, dtype, False)
            i, j = torch.arange(Nq)[:, None], torch.arange(Nk)[None]
            rel = j - (i + Nk - Nq)
            dense = (rel <= 0) & (rel >= -window[0]) if window else rel <= 0
            fns = {"sdpa": lambda: torch_sdpa(q, k, v, attn_mask=dense)}
            for be in ("auto", "fused"):
                fns[be] = (lambda be=be: attn.attention(q, k, v, causal=True, window=window,
                                                        backend=be))
            rows.append({"row": name, "dtype": str(dtype)[6:], "mode": "fwd",
                         **_measure(fns, max(3, rounds // 2))})
            print(rows[-1], flush=True)
    return rows


def variant_rows(dtypes, rounds):
    rows = []
    for dtype in dtypes:
        q, k, v = _qkv(1, 8, 8, 4096, 4096, 64, dtype, False)
        sinks = torch.randn(8)
        slopes = 2.0 ** (-8.0 * torch.arange(1, 9) / 8)
        fns = {"plain": lambda: attn.attention(q, k, v, causal=True),
               "sinks": lambda: attn.attention(q, k, v, causal=True, sinks=sinks),
               "return_lse": lambda: attn.attention(q, k, v, causal=True, return_lse=True)[0]}
        if dtype == torch.float32:  # 16-bit ALiBi runs on tiled (fused builds it in fp32)
            fns["alibi"] = lambda: attn.attention(q, k, v, causal=True, alibi_slopes=slopes)
        r = _measure(fns, rounds)
        # attn's time over the plain call's: 1 / (plain time / variant time)
        r["time_over_plain"] = {n: 1 / x for n, x in r.pop("ratio").items()}
        rows.append({"row": "variants on causal N=4096", "dtype": str(dtype)[6:],
                     "mode": "fwd", **r})
        print(rows[-1], flush=True)
    return rows


def decode_rows(dtypes, rounds):
    rows = []
    for dtype in dtypes:
        for Nk in (4096, 16384, 32768):
            q, k, v = _qkv(1, 32, 8, 1, Nk, 128, dtype, False)
            fns = {"sdpa": lambda: torch_sdpa(q, k, v, enable_gqa=True)}
            for be in ("auto", "fused", "tiled"):
                fns[be] = lambda be=be: attn.attention(q, k, v, backend=be)
            rows.append({"row": f"decode Nk={Nk} GQA 32:8 D=128", "dtype": str(dtype)[6:],
                         "mode": "fwd", **_measure(fns, rounds)})
            print(rows[-1], flush=True)
    return rows


def markdown(header, rows) -> str:
    out = [f"# Issue 42's targets on {header['device_name']} ({header['kind']})", "",
           f"{header['busy']}; torch {header['torch']}, {header['torch_threads']} threads, "
           f"{header['date']}, load at the start {header['loadavg_1min']}", "",
           "| row | dtype | mode | ms (medians) | ratios (median of in-round ratios) |",
           "|:--|:--|:--|:--|:--|"]
    for r in rows:
        ms = ", ".join(f"{n} {x:.1f}" for n, x in r["ms"].items())
        if "time_over_plain" in r:
            rat = ", ".join(f"{n} {x:.2f}x plain's time" for n, x in r["time_over_plain"].items())
        else:
            rat = ", ".join(f"SDPA/{n} {x:.2f}" for n, x in r["ratio"].items())
        out.append(f"| {r['row']} | {r['dtype']} | {r['mode']} | {ms} | {rat} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--busy-core", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--parts", nargs="+", default=["direct", "band", "variants", "decode"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dtypes = [getattr(torch, d) for d in args.dtype]
    header = report.run_header("cpu", [], prog="python benchmarks/experiments/issue42_targets.py")
    header["kind"] = choose.cpu_kind()
    rows = []
    with busy_core(args.busy_core) as core:
        header["busy"] = ("quiet (no load started)" if core is None
                          else f"one core (CPU {core}) kept busy by a spinning process")
        parts = {"direct": direct_rows, "band": band_rows, "variants": variant_rows,
                 "decode": decode_rows}
        for part in args.parts:
            rows += parts[part](dtypes, args.rounds)
    report.write_results(args.out, header, rows, markdown(header, rows))


if __name__ == "__main__":
    main()
