"""``attn bench decode``: one new query against a long KV cache on CPU, attn against torch SDPA.

Each step: one token's q (H heads) against a cache of L positions (Hkv kv heads), fp32,
through ``attn.attention`` (:func:`attention_paths`) or, ``--compat``, a full step of
``flash_attn_with_kvcache``, contiguous and paged (:func:`compat_paths`), each beside SDPA.
Each path is checked against float64 SDPA, then the paths take turns for ``--repeats``
rounds; results.md defines its columns. ``--caches``: :mod:`attn.bench.decode_caches`.

    attn bench decode --compat --cache 4096 --batch 8 --out benchmarks/results/decode_compat_cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import attn
from attn.bench import decode_caches, report
from attn.compat import flash_attn as fa
from attn.sdpa import torch_sdpa
from attn.timing import paired

BASELINE = "sdpa, same cache"
TOLERANCE = 1e-4  # fp32 against fp64: a path further off than this is broken, not slow


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compat", action="store_true",
                   help="step through flash_attn_with_kvcache (append + attend), contiguous "
                        "and paged, instead of attn.attention")
    p.add_argument("--cache", "--nk", type=int, nargs="+", default=None,
                   help="cache lengths L (default 4096 8192 16384 32768; 4096 with --compat)")
    p.add_argument("--batch", "-B", type=int, default=None, help="default 1 (8 with --compat)")
    p.add_argument("--heads", "-H", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", "--head-dim", dest="d", type=int, default=128, help="head dim D")
    p.add_argument("--caches", nargs="*", default=None, metavar="FORMAT",
                   choices=("fp32", "bf16", "int8", "int4", "fp8"),
                   help="step through attn.decode from caches stored in these formats "
                        "(none named: all five), contiguous and paged, against SDPA on dense "
                        "fp32 and bf16 caches (default lengths 4096 16384 32768, B 1 and 8)")
    p.add_argument("--nq", type=int, nargs="+", default=None,
                   help="--caches: queries per step (default 1; more: a chunked-prefill chunk "
                        "of that many, causal from the cache's end)")
    p.add_argument("--page", type=int, default=16, help="--caches: positions per page of the "
                                                         "paged caches")
    p.add_argument("--pages", type=int, nargs="*", default=[256, 16],
                   help="--compat: page sizes of the paged caches")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 1; 2 "
                                                             "with --compat)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, paths interleaved (default 21; 9 with --compat)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--note", default="", help="a line for the report (e.g. 'check run')")
    p.add_argument("--out", type=Path, default=Path("out/bench-decode"),
                   help="folder for results.json and results.md")


def paged_copy(kc: torch.Tensor, vc: torch.Tensor, page: int, g: torch.Generator):
    """Contiguous caches (B, L, Hkv, D) as shuffled pools of pages + their block table."""
    B, L = kc.shape[:2]
    n = -(-L // page)
    perm = torch.randperm(B * n, generator=g)
    pools = []
    for cache in (kc, vc):
        pages = F.pad(cache, (0, 0, 0, 0, 0, n * page - L)).reshape(B * n, page, *cache.shape[2:])
        pool = torch.empty_like(pages)
        pool[perm] = pages  # logical page i of the flat order lives in slot perm[i]
        pools.append(pool)
    return pools[0], perm.view(B, n).to(torch.int32), pools[1]


def _sdpa(q, k, v):
    """(B, H, Nq, D) queries on (B, Hkv, L, D) keys, GQA through enable_gqa when H != Hkv."""
    return torch_sdpa(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def attention_paths(B, H, Hkv, D, L, g) -> tuple[dict[str, Callable], torch.Tensor, Callable]:
    """The default question's paths (tiled; SDPA on the same cache and on one expanded to H
    heads outside the timing), its float64 answer, and a map of outputs to (B, H, D)."""
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    k_rep, v_rep = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    paths = {"attn tiled": lambda: attn.attention(q, k, v, backend="tiled"),
             BASELINE: lambda: _sdpa(q, k, v),
             "sdpa, expanded cache": lambda: torch_sdpa(q, k_rep, v_rep)}
    want = _sdpa(*(x.double() for x in (q, k, v)))
    return paths, want[:, :, 0], lambda out: out[:, :, 0]


def compat_paths(B, H, Hkv, D, L, pages, g) -> tuple[dict[str, Callable], torch.Tensor,
                                                      Callable]:
    """The ``--compat`` question's paths (each a full step: append, then attend), its float64
    answer, and a map of outputs to (B, H, D): a contiguous (B, L, Hkv, D) cache, the same in
    pages of each ``pages`` size behind a shuffled block table, SDPA with the same append on
    it seen as (B, Hkv, L, D) and on a head-major copy. The cache holds L - 1 keys before the
    step and the new one fills the last slot; it is written there up front too, so every
    repeated step writes the same value and sees the same keys."""
    kc, vc = (torch.randn(B, L, Hkv, D, generator=g) for _ in range(2))
    q = torch.randn(B, 1, H, D, generator=g)
    k_new, v_new = (torch.randn(B, 1, Hkv, D, generator=g) for _ in range(2))
    end = L - 1
    kc[:, end], vc[:, end] = k_new[:, 0], v_new[:, 0]
    kc_hm, vc_hm = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    pools = {page: paged_copy(kc, vc, page, g) for page in pages}

    def contiguous():
        return fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=end,
                                          causal=True)

    def paged(page):
        kp, table, vp = pools[page]
        return lambda: fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=end,
                                                  block_table=table, causal=True)

    def sdpa_view():
        kc[:, end], vc[:, end] = k_new[:, 0], v_new[:, 0]
        return _sdpa(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)).transpose(1, 2)

    def sdpa_head_major():
        kc_hm[:, :, end], vc_hm[:, :, end] = k_new[:, 0], v_new[:, 0]
        return _sdpa(q.transpose(1, 2), kc_hm, vc_hm).transpose(1, 2)

    paths = {"compat contiguous": contiguous}
    paths.update({f"compat paged (page {page})": paged(page) for page in pages})
    paths.update({BASELINE: sdpa_view, "sdpa, head-major": sdpa_head_major})
    want = _sdpa(q.double().transpose(1, 2), kc_hm.double(), vc_hm.double())
    return paths, want[:, :, 0], lambda out: out[:, 0]


def measure_point(paths: dict[str, Callable], want: torch.Tensor, heads_first: Callable,
                  flops: float, warmup: int, repeats: int) -> dict:
    """Errors against the float64 answer, then interleaved rounds: one row per cache length."""
    err = {n: (heads_first(fn()).double() - want).abs().max().item() for n, fn in paths.items()}
    times = paired(paths, repeats, warmup=warmup)
    ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return {"ms": ms, "gflops": {n: flops / t / 1e6 for n, t in ms.items()},
            "ratio_to_sdpa": {n: ms[BASELINE] / t for n, t in ms.items()},
            "max_abs_err": err, "times_ms": {n: [x * 1e3 for x in t] for n, t in times.items()}}


def markdown(header: dict, rows: list[dict]) -> str:
    s = header["shape"]
    what = ("flash_attn_with_kvcache (append + attend), contiguous and paged" if header["compat"]
            else "attn.attention (tiled)")
    lines = [f"# Decoding on CPU: {what} vs torch SDPA", "",
             *report.machine_lines(header, f"; attn backend: {header['attn_backend']}"),
             f"- step: B={s['B']}, Nq=1, H={s['H']}, Hkv={s['Hkv']}, D={s['D']}, fp32, "
             f"attending to the whole cache; median of {header['repeats']} rounds after "
             f"{header['warmup']} warm-up, the paths taking turns",
             f"- ratio: {BASELINE} (SDPA on the cache attn reads) time / path time (> 1: "
             "faster than SDPA); error: max abs difference from float64 SDPA"]
    if header["compat"]:
        lines.append("- paged: on CPU each work item reads its key range through the block "
                     "table (a view where its pages lie in order, else a copy of that range "
                     "only); other devices gather the pages in use into a dense tensor")
    if header["note"]:
        lines.append(f"- note: {header['note']}")
    lines += ["", "| cache | path | ms / step | GFLOP/s | SDPA / path | max abs err |",
              "|--:|:--|--:|--:|--:|--:|"]
    lines += report.per_path_lines(rows, lambda r, n, ms: (
        str(r["cache"]), n, f"{ms:.2f}", f"{r['gflops'][n]:.1f}",
        f"{r['ratio_to_sdpa'][n]:.2f}", f"{r['max_abs_err'][n]:.1e}"))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.caches is not None:
        if args.compat:
            raise SystemExit("attn: --caches and --compat are two questions: give one")
        args.caches = args.caches or list(decode_caches.FORMATS)
        return decode_caches.run(args, argv)
    B = args.batch or (8 if args.compat else 1)
    H, Hkv, D = args.heads, args.kv_heads, args.d
    if H % Hkv:
        raise SystemExit(f"attn: --heads ({H}) must be a multiple of --kv-heads ({Hkv})")
    lengths = args.cache or ([4096] if args.compat else [4096, 8192, 16384, 32768])
    warmup = args.warmup if args.warmup is not None else (2 if args.compat else 1)
    repeats = args.repeats or (9 if args.compat else 21)
    choice = attn.select_backend(attn.AttentionCall(
        device="cpu", dtype=torch.float32, head_dim=D, head_dim_v=D, n_q=1, n_k=lengths[0],
        return_lse=args.compat))
    header = report.run_header("cpu", argv)
    header.update(compat=args.compat, shape={"B": B, "H": H, "Hkv": Hkv, "D": D, "Nq": 1,
                                             "dtype": "float32"},
                  attn_backend=f"{choice.name} ({choice.reason})", warmup=warmup,
                  repeats=repeats, note=args.note)
    rows = []
    with torch.inference_mode():
        for L in lengths:
            g = torch.Generator().manual_seed(L)
            paths, want, heads_first = (compat_paths(B, H, Hkv, D, L, args.pages, g)
                                        if args.compat else attention_paths(B, H, Hkv, D, L, g))
            rows.append({"cache": L, **measure_point(paths, want, heads_first,
                                                     4 * B * H * L * D, warmup, repeats)})
            print(f"L={L}: " + ", ".join(f"{n} {ms:.2f} ms"
                                         for n, ms in rows[-1]["ms"].items()),
                  file=sys.stderr, flush=True)
    report.write_results(args.out, header, rows, markdown(header, rows))
    bad = [(r["cache"], n, e) for r in rows for n, e in r["max_abs_err"].items()
           if not e <= TOLERANCE]
    for L, n, e in bad:
        print(f"ERROR: {n} at L={L} is {e:.1e} from the float64 answer", file=sys.stderr)
    return 1 if bad else 0
