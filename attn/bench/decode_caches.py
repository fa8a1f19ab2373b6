"""``attn bench decode --caches``: one decoding step (``--nq``: a chunked-prefill chunk)
through :func:`attn.decode` from each cache format (:data:`FORMATS`), contiguous and paged
(:func:`_fill`), against torch SDPA on dense fp32 and bf16 caches, on CPU; docs/benchmarks.md
("Decoding from quantized and paged caches") has the method and the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import attn
from attn.bench import report
from attn.bench.plots import _pyplot, save
from attn.kvcache import KVQuant, PagedKVCache
from attn.sdpa import torch_sdpa
from attn.timing import paired

FORMATS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
           "int8": (torch.float32, KVQuant("int8")), "int4": (torch.float32, KVQuant("int4")),
           "fp8": (torch.float32, KVQuant("fp8_e4m3"))}
BASELINE = "sdpa, dense fp32"
TOLERANCE = 1e-4  # against float64 on the cache's own values: beyond fp32 rounding is a bug
QQ = ", int8 q"  # quantized_q paths: their error includes q's rounding, not held to it


def _fill(k: torch.Tensor, v: torch.Tensor, page: int, dtype, quant, interleave: bool
          ) -> PagedKVCache:
    """A cache of B sequences holding k, v ``(B, Hkv, L, D)``; with ``interleave``, a filler
    sequence takes a page after each page of theirs."""
    B, Hkv, L, D = k.shape
    pages = -(-L // page)
    cache = PagedKVCache.allocate((B + interleave) * pages, page, Hkv, D, max_seqs=B + 1,
                                  max_pages=pages, dtype=dtype, quant=quant)
    rows = list(range(B))
    for t in range(0, L, page):
        cache.append(k[:, :, t:t + page], v[:, :, t:t + page], seq_ids=rows)
        if interleave:
            cache.append(k[:1, :, t:t + page], v[:1, :, t:t + page], seq_ids=[B])
    return cache


def _bottom_right(n_q: int, n_k: int) -> torch.Tensor | None:
    """The causal mask of ``n_q`` new queries whose keys are the last of ``n_k`` (query i sees
    key j iff ``j <= i + n_k − n_q``), as SDPA takes it; None for one query (it sees all)."""
    return None if n_q == 1 else torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)


def _answer(q: torch.Tensor, rows) -> torch.Tensor:
    """float64 SDPA of q ``(B, H, Nq, D)`` on each row's keys and values ``(Hkv, L, D)``,
    causal from the end for Nq > 1, one row and one kv head's group at a time (a whole
    float64 batch of 32k keys is gigabytes)."""
    outs = []
    for b, (k, v) in enumerate(rows):
        G = q.shape[1] // k.shape[0]
        mask = _bottom_right(q.shape[2], k.shape[1])
        outs.append(torch.cat([torch_sdpa(q[b:b + 1, h * G:(h + 1) * G].double(),
                                          k[None, h:h + 1].double(), v[None, h:h + 1].double(),
                                          attn_mask=mask, enable_gqa=True)
                               for h in range(k.shape[0])], dim=1))
    return torch.cat(outs)


def cache_paths(B, H, Hkv, D, L, page, formats, g, n_q: int = 1):
    """The paths, each path's float64 answer on its own values, and the answer on the
    original values. ``n_q`` > 1: a prefill chunk of that many queries, causal from the end
    of the cache (which holds the chunk's own keys last)."""
    q = torch.randn(B, H, n_q, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    exact = _answer(q, zip(k, v))
    mask = _bottom_right(n_q, L)
    paths: dict[str, Callable] = {
        BASELINE: lambda: torch_sdpa(q, k, v, attn_mask=mask, enable_gqa=True),
        "sdpa, dense bf16": lambda: torch_sdpa(qb, kb, vb, attn_mask=mask, enable_gqa=True)}
    wants = {BASELINE: exact, "sdpa, dense bf16": _answer(qb, zip(kb, vb))}
    sizes = {}
    for name in formats:
        dtype, quant = FORMATS[name]
        for layout, interleave in (("contiguous", False), ("paged", True)):
            cache = _fill(k, v, L if layout == "contiguous" else page, dtype, quant, interleave)
            seq = list(range(B))
            path = f"attn {name} {layout}"
            paths[path] = (lambda c=cache, s=seq: attn.decode(q, c, seq_ids=s, causal=True))
            wants[path] = _answer(q, ((x.transpose(0, 1) for x in cache.sequence_kv(b))
                                      for b in range(B)))
            if name == "int8":  # the opt-in: keys scored against q rounded to int8
                paths[path + QQ] = (lambda c=cache, s=seq: attn.decode(
                    q, c, seq_ids=s, causal=True, quantized_q=True))
                wants[path + QQ] = wants[path]
            sizes[name] = cache.bytes_per_token()
    return paths, wants, exact, sizes


def add_rows(args: argparse.Namespace, B: int, H: int, Hkv: int, D: int, lengths, warmup,
             repeats, n_q: int = 1) -> list[dict]:
    rows = []
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        paths, wants, exact, sizes = cache_paths(B, H, Hkv, D, L, args.page, args.caches, g,
                                                 n_q)
        outs = {n: fn() for n, fn in paths.items()}
        err = {n: (outs[n].double() - wants[n]).abs().max().item() for n in paths}
        quant_err = {n: (outs[n].double() - exact).abs().max().item() for n in paths}
        times = paired(paths, repeats, warmup=warmup)
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        rows.append({"B": B, "Nq": n_q, "cache": L, "ms": ms,
                     "ratio_to_sdpa": {n: ms[BASELINE] / t for n, t in ms.items()},
                     "max_abs_err": err, "err_vs_original": quant_err,
                     "bytes_per_token": sizes})
        print(f"B={B} Nq={n_q} L={L}: " + ", ".join(f"{n} {t:.2f} ms" for n, t in ms.items()),
              file=sys.stderr, flush=True)
    return rows


def markdown(header: dict, rows: list[dict]) -> str:
    s = header["shape"]
    lines = ["# Decoding on CPU from each cache format, contiguous and paged, vs torch SDPA", "",
             *report.machine_lines(header),
             *([f"- note: {header['note']}"] if header.get("note") else []),
             f"- step: Nq={', '.join(map(str, s['Nq']))}, H={s['H']}, Hkv={s['Hkv']}, "
             f"D={s['D']}, q float32, attending to the whole cache (Nq > 1: a chunked-prefill "
             "chunk, causal from the cache's end; SDPA takes that mask as a bool tensor); "
             f"paged: pages of {header['page']} interleaved with a filler sequence's; median "
             f"of {header['repeats']} rounds after {header['warmup']} warm-up, the paths "
             "taking turns",
             f"- ratio: {BASELINE} time / path time (> 1: faster than SDPA on a dense fp32 "
             "cache); err: max abs difference from float64 SDPA on the values that cache "
             "holds; vs original: from float64 SDPA on the fp32 values (quantization error "
             f"included); '{QQ[2:]}': attn.decode(quantized_q=True), its err includes q's "
             "rounding to int8", "",
             "bytes per token (K and V, all kv heads, scales included): " + ", ".join(
                 f"{n} {b:.0f}" for n, b in rows[0]["bytes_per_token"].items()), "",
             "| B | Nq | L | path | ms / step | SDPA fp32 / path | err | vs original |",
             "|--:|--:|--:|:--|--:|--:|--:|--:|"]
    lines += report.per_path_lines(rows, lambda r, n, t: (
        str(r["B"]), str(r.get("Nq", 1)), str(r["cache"]), n, f"{t:.2f}",
        f"{r['ratio_to_sdpa'][n]:.2f}",
        f"{r['max_abs_err'][n]:.1e}", f"{r['err_vs_original'][n]:.1e}"))
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path) -> list[Path]:
    """step.png (ms per step vs L, one line per path, a panel per B) and bytes.png."""
    try:
        plt = _pyplot()
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    panels = sorted({(r["B"], r.get("Nq", 1)) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (B, n_q) in zip(axes[0], panels):
        rs = sorted((r for r in rows if (r["B"], r.get("Nq", 1)) == (B, n_q)),
                    key=lambda r: r["cache"])
        for path in rs[0]["ms"]:
            ax.plot([r["cache"] for r in rs], [r["ms"][path] for r in rs], marker="o", ms=3,
                    label=path, ls="--" if path.startswith("sdpa") else "-")
        ax.set(xscale="log", yscale="log", xlabel="cache length L", ylabel="ms per step",
               title=f"B={B}" + (f", Nq={n_q}" if n_q > 1 else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    step = save(fig, out / "step.png")
    sizes = rows[0]["bytes_per_token"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(list(sizes), list(sizes.values()))
    ax.set(ylabel="bytes per token (K+V, all kv heads)", title="cache size per token")
    return [step, save(fig, out / "bytes.png")]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    H, Hkv, D = args.heads, args.kv_heads, args.d
    lengths = args.cache or [4096, 16384, 32768]
    batches = [args.batch] if args.batch else [1, 8]
    warmup = args.warmup if args.warmup is not None else 1
    repeats = args.repeats or 9
    header = report.run_header("cpu", argv)
    n_qs = args.nq or [1]
    header.update(shape={"H": H, "Hkv": Hkv, "D": D, "Nq": n_qs}, page=args.page,
                  warmup=warmup, repeats=repeats, note=args.note)
    with torch.inference_mode():
        rows = [r for B in batches for n_q in n_qs
                for r in add_rows(args, B, H, Hkv, D, lengths, warmup, repeats, n_q)]
    pngs = plots(rows, Path(args.out))
    report.write_results(args.out, header, rows, markdown(header, rows), also=pngs)
    bad = [(r["B"], r["cache"], n, e) for r in rows for n, e in r["max_abs_err"].items()
           if n != "sdpa, dense bf16" and not n.endswith(QQ) and not e <= TOLERANCE]
    for B, L, n, e in bad:
        print(f"ERROR: {n} at B={B} L={L} is {e:.1e} from float64 on its own values",
              file=sys.stderr)
    return 1 if bad else 0
