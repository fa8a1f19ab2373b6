"""``attn bench auto-table``: measure fused against tiled for each class of call and dtype on
this CPU, and write the entry ``backend="auto"`` reads (:mod:`attn.choose`; docs/design.md,
"Choosing a backend": the classes and how they are timed). The entry keeps the median of the
in-round ratios fused time / tiled time and prefers fused where it is at most ``--margin``
slower (it is torch's kernel: same error as SDPA, less Python). Run it quiet and with
``--busy-core``: ``--write`` keeps, per cell, the run where fused did worse.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import attn
from attn import choose
from attn.bench import report
from attn.bench.paired import busy_core, sdpa_kwargs, step
from attn.sdpa import torch_sdpa
from attn.timing import median_ratio, paired

# class: (B, H, Hkv, Nq, Nk, D, causal, masked, backward)
SHAPES = {
    "decode": (1, 32, 8, 1, 16384, 128, False, False, False),
    "chunk": (1, 32, 8, 64, 4096, 128, True, False, False),  # a chunked prefill's step
    "tiny": (64, 4, 4, 12, 12, 16, True, False, True),  # the toy GPT's recall training step
    "small": (32, 4, 4, 64, 64, 16, True, False, True),  # a toy model's training step
    "dense": (1, 8, 8, 2048, 2048, 64, True, False, False),
    "train": (2, 8, 8, 1024, 1024, 64, True, False, True),
    "masked": (1, 8, 8, 1024, 1024, 64, False, True, False),  # a random bool mask
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "float16"],
                   choices=("float32", "bfloat16", "float16", "float64"))
    p.add_argument("--classes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per point")
    p.add_argument("--margin", type=float, default=1.05,
                   help="fused is preferred while its time is at most this times tiled's")
    p.add_argument("--busy-core", action="store_true",
                   help="keep one core busy with a spinning process for the run")
    p.add_argument("--out", type=Path, default=Path("out") / "auto-table",
                   help="folder for this run's results (results.json, results.md)")
    p.add_argument("--write", type=Path, default=None, metavar="TABLE",
                   help="also merge this CPU kind's entry into TABLE (attn/auto_table.json "
                        "in a checkout), keeping for each cell the run where fused did worse")


def measure(cls: str, dtype: str, rounds: int) -> dict:
    B, H, Hkv, Nq, Nk, D, causal, masked, backward = SHAPES[cls]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(getattr(torch, dtype))
               .requires_grad_(backward) for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
    # an arbitrary bool mask (key padding alone is a cut of the keys: dense)
    mask = torch.rand(B, 1, Nq, Nk, generator=g) > 0.2 if masked else None
    kw = {"attn_mask": mask, **sdpa_kwargs(q, k, causal)}  # a causal band replaces the mask
    sdpa = step(lambda: torch_sdpa(q, k, v, **kw), backward)
    ours = {name: step(lambda name=name: attn.attention(q, k, v, causal=causal,
                                                        attn_mask=mask, backend=name),
                       backward) for name in ("fused", "tiled")}
    # half the rounds fused right after SDPA, half tiled: the one timed right after an
    # OpenMP op shares a core with OpenMP's spinning team for a few ms (docs/benchmarks.md),
    # which a fixed order would charge to one backend only
    times = {n: [] for n in ("sdpa", "fused", "tiled")}
    for order, n in ((("fused", "tiled"), -(-rounds // 2)), (("tiled", "fused"), rounds // 2)):
        got = paired({"sdpa": sdpa, **{o: ours[o] for o in order}}, n, warmup=1)
        for name, t in got.items():
            times[name] += t
    return {"class": cls, "dtype": dtype, "shape": list(SHAPES[cls]),
            "ms": {n: 1e3 * sorted(t)[len(t) // 2] for n, t in times.items()},
            "fused_over_tiled": median_ratio(times, "fused", "tiled"),
            "sdpa_over_fused": median_ratio(times, "sdpa", "fused"),
            "sdpa_over_tiled": median_ratio(times, "sdpa", "tiled")}


def _merge_into(table_path: Path, kind: str, cpu: str, rows: list[dict], margin: float,
                busy: bool) -> None:
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    entry = table.setdefault(kind, {"cpu": cpu, "entries": {}})
    entry["cpu"] = cpu
    for r in rows:
        cell = entry["entries"].setdefault(r["dtype"], {}).get(r["class"])
        ratio = r["fused_over_tiled"]  # or the earlier run's, where fused did worse there
        ratio = ratio if cell is None else max(ratio, cell["ratio"])
        entry["entries"][r["dtype"]][r["class"]] = {
            "backend": "fused" if ratio <= margin else "tiled", "ratio": round(ratio, 3),
            **({"busy": True} if busy or (cell or {}).get("busy") else {})}
    table_path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def markdown(header: dict, rows: list[dict]) -> str:
    lines = [f"# attn bench auto-table: {header['kind']} ({header['device_name']})", "",
             *report.machine_lines(header, f"; {header['busy']}"), "",
             "| class | dtype | sdpa ms | fused ms | tiled ms | fused/tiled time | "
             "SDPA/fused | SDPA/tiled |", "|:--|:--|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['class']} | {r['dtype']} | {ms['sdpa']:.1f} | {ms['fused']:.1f} | "
                     f"{ms['tiled']:.1f} | {r['fused_over_tiled']:.2f} | "
                     f"{r['sdpa_over_fused']:.2f} | {r['sdpa_over_tiled']:.2f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, argv: list[str]) -> int:
    header = report.run_header("cpu", argv)
    header["kind"] = choose.cpu_kind()
    rows = []
    with busy_core(args.busy_core) as core:
        header["busy"] = ("quiet (no load started)" if core is None
                          else f"one core (CPU {core}) kept busy by a spinning process")
        for dtype in args.dtype:
            for cls in args.classes:
                rows.append(measure(cls, dtype, args.rounds))
                r = rows[-1]
                print(f"{cls:7s} {dtype:9s} fused/tiled time {r['fused_over_tiled']:.2f}  "
                      f"SDPA/fused {r['sdpa_over_fused']:.2f}  SDPA/tiled "
                      f"{r['sdpa_over_tiled']:.2f}", flush=True)
    report.write_results(args.out, header, rows, markdown(header, rows))
    if args.write is not None:
        _merge_into(args.write, header["kind"], header["device_name"], rows, args.margin,
                    args.busy_core)
        print(f"merged the {header['kind']} entry into {args.write}")
    return 0
