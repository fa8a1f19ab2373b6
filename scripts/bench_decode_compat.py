"""CPU decode through attn.compat's flash_attn_with_kvcache, contiguous and paged, vs torch SDPA.

    python scripts/bench_decode_compat.py --out benchmarks/results/decode_compat_cpu

One decode step: q (B, 1, H, D), one new key/value per sequence appended to a cache of
``--cache`` positions (holding ``--cache - 1`` keys before the step, so the step attends to
the full cache), causal, fp32. Paths timed, each a full step (append + attention):

* ``compat contiguous``: ``flash_attn_with_kvcache`` on a ``(B, L, Hkv, D)`` cache. On CPU
  it runs ``attn.attention`` (tiled backend) once per sequence on a view of that sequence's
  keys: no copy.
* ``compat paged (page P)``: the same cache in pages of P rows behind a shuffled
  ``block_table``. attn's kernels read a dense key tensor, so the step **gathers** each
  sequence's pages in use (``k_cache[block_table[b, :pages_in_use]]``): one copy of the used
  keys and values per step, on top of the attention, done sequence by sequence (blocks of
  ``L·Hkv·D`` floats that the allocator reuses). Only pages holding keys are gathered,
  never the whole pool; a kernel that reads through the page table would remove the copy.
* ``sdpa, cache view``: ``torch.nn.functional.scaled_dot_product_attention`` on the same
  contiguous cache seen as ``(B, Hkv, L, D)`` (a transposed view, as attn gets it), with
  ``enable_gqa=True`` (torch >= 2.5) for H != Hkv: torch's CPU path expands the kv heads
  itself; the same in-place append is timed with it.
* ``sdpa, head-major``: SDPA on keys stored ``(B, Hkv, L, D)`` contiguously (the layout
  SDPA prefers; prepared once, outside the timing), same append. Its best case.

Reported: the median ms of ``--repeats`` timed steps after ``--warmup``, the paths
interleaved repeat by repeat (the machine may be shared), and each path's ratio to
``sdpa, cache view`` (> 1 = slower than SDPA). Decode FLOPs: 4·B·H·L·D per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn  # noqa: E402
from attn.bench.report import device_name  # noqa: E402
from attn.compat import flash_attn as fa  # noqa: E402

LOAD = os.getloadavg()


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cache", type=int, default=4096, help="cache positions per sequence")
    p.add_argument("--pages", type=int, nargs="*", default=[256, 16])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--note", default="", help="a line for the report (e.g. 'check run')")
    p.add_argument("--out", type=Path, help="folder for decode_compat.md / .json")
    args = p.parse_args()

    B, H, Hkv, D, L = args.batch, args.heads, args.kv_heads, args.head_dim, args.cache
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(B, L, Hkv, D, generator=g)
    vc = torch.randn(B, L, Hkv, D, generator=g)
    q = torch.randn(B, 1, H, D, generator=g)
    k_new = torch.randn(B, 1, Hkv, D, generator=g)
    v_new = torch.randn(B, 1, Hkv, D, generator=g)
    end = L - 1  # keys before the step; the new one fills the last slot
    kc_hm, vc_hm = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    pools = {page: paged_copy(kc, vc, page, g) for page in args.pages}

    def compat_contiguous():
        return fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=end,
                                          causal=True)

    def compat_paged(page):
        kp, table, vp = pools[page]
        return lambda: fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=end,
                                                  block_table=table, causal=True)

    def sdpa_view():
        kc[:, end] = k_new[:, 0]
        vc[:, end] = v_new[:, 0]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                             vc.transpose(1, 2), enable_gqa=H != Hkv)
        return out.transpose(1, 2)

    def sdpa_head_major():
        kc_hm[:, :, end] = k_new[:, 0]
        vc_hm[:, :, end] = v_new[:, 0]
        return F.scaled_dot_product_attention(q.transpose(1, 2), kc_hm, vc_hm,
                                              enable_gqa=H != Hkv).transpose(1, 2)

    paths = {"compat contiguous": compat_contiguous}
    paths.update({f"compat paged (page {page})": compat_paged(page) for page in args.pages})
    paths.update({"sdpa, cache view": sdpa_view, "sdpa, head-major": sdpa_head_major})

    # the same answer everywhere before timing anything
    with torch.inference_mode():
        want = sdpa_view()
        for name, fn in paths.items():
            err = (fn() - want).abs().max().item()
            assert err < 1e-4, f"{name} differs from SDPA by {err:.2e}"
        choice = attn.select_backend(attn.AttentionCall(
            device="cpu", dtype=torch.float32, head_dim=D, head_dim_v=D, n_q=1, n_k=L,
            return_lse=True))

        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.warmup):
            for fn in paths.values():
                fn()
        for _ in range(args.repeats):  # interleaved: a load change hits every path
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)

    base = statistics.median(times["sdpa, cache view"])
    flops = 4 * B * H * L * D
    rows = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        rows.append({"path": name, "ms": ms, "gflops": flops / ms / 1e6,
                     "ratio_to_sdpa": ms / base, "times_ms": ts})
    header = {
        "command": shlex.join(["python", "scripts/bench_decode_compat.py", *sys.argv[1:]]),
        "machine": f"{device_name('cpu')} ({platform.machine()}), {os.cpu_count()} cores, "
                   f"{torch.get_num_threads()} torch threads, affinity "
                   f"{sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}",
        "load_before": LOAD,
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "attn": attn.__version__},
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "shape": {"B": B, "H": H, "Hkv": Hkv, "D": D, "cache": L, "dtype": "float32",
                  "new_tokens": 1, "keys_attended": L},
        "attn_backend": f"{choice.name} ({choice.reason})",
        "note": args.note,
    }
    lines = [
        "# Decode through attn.compat's flash_attn_with_kvcache vs torch SDPA (CPU)",
        "",
        f"- command: `{header['command']}`",
        f"- machine: {header['machine']}; load average before the run "
        f"{', '.join(f'{x:.2f}' for x in LOAD)} (1, 5, 15 min)",
        f"- versions: torch {torch.__version__}, Python {platform.python_version()}, "
        f"attn {attn.__version__}; attn backend: {header['attn_backend']}",
        f"- date: {header['date']}",
        f"- step: B={B}, H={H}, Hkv={Hkv}, D={D}, fp32, one new token appended to a cache of "
        f"{L} positions (attends to all {L}), causal; median of {args.repeats} steps after "
        f"{args.warmup} warm-up, paths interleaved",
        "- paged: the pages in use are gathered into a dense tensor every step (a copy of the "
        "used keys and values); SDPA gets GQA through enable_gqa=True",
    ]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += ["", "| path | ms / step | GFLOP/s | time / SDPA (cache view) |", "|---|---|---|---|"]
    lines += [f"| {r['path']} | {r['ms']:.2f} | {r['gflops']:.1f} | {r['ratio_to_sdpa']:.2f}x |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_compat.md").write_text(text)
        (args.out / "decode_compat.json").write_text(
            json.dumps({"header": header, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
