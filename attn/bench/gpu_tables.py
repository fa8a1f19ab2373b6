"""results.md and the PNGs of ``attn gpu-check``, from its results.json alone (so ``--merge``
draws them again for joined runs). Ratios come first: they are what a person compares."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from attn.bench import plots as sweep_plots
from attn.bench import report
from attn.bench.report import _fmt

PLOTS = ("speed.png", "memory.png", "decode.png")  # gpu_record.FILES' PNGs, in order

TORCH_KERNELS = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex")


def _rows(doc: dict, kind: str) -> list[dict]:
    return [r for r in doc["rows"] if r.get("kind") == kind]


def speed_ratios(rows: list[dict]) -> list[dict]:
    """Per point: ours, the fastest torch kernel that ran there, and best torch ms / ours ms
    (> 1: ours is faster)."""
    mine = "triton" if any(r["backend"] == "triton" for r in rows) else "tiled"  # a dry run
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["status"] == "ok" and r["ms"] is not None:
            key = (r["dtype"], r["D"], r["causal"], r["mode"], r["N"], r["B"], r["H"])
            by_key.setdefault(key, {})[r["backend"]] = r
    out = []
    for key, got in by_key.items():
        torch_ms = {b: got[b]["ms"] for b in TORCH_KERNELS if b in got}
        if mine not in got or not torch_ms:
            continue
        best = min(torch_ms, key=torch_ms.get)
        out.append({"dtype": key[0], "D": key[1], "causal": key[2], "mode": key[3],
                    "N": key[4], "ours": mine, "ms": got[mine]["ms"], "best_torch": best,
                    "best_ms": torch_ms[best], "ratio": torch_ms[best] / got[mine]["ms"]})
    return out


def _stages_table(doc: dict) -> list[str]:
    lines = ["| stage | status | seconds (box) | why / dropped |", "|:--|:--|--:|:--|"]
    for name, e in doc["stages"].items():
        dropped = f"{len(e['dropped'])} point(s) dropped" if e["dropped"] else ""
        why = "; ".join(x for x in (e["why"], dropped) if x)
        run = f" (run {e['run'] + 1})" if "run" in e else ""
        lines.append(f"| {name}{run} | {e['status']} | {e['seconds']} ({e['budget_s']}) | "
                     f"{why.replace('|', '/')} |")
    return lines


def _ratio_section(doc: dict) -> list[str]:
    out = ["## Ratios", ""]
    speed = speed_ratios(_rows(doc, "speed"))
    if speed:
        mine = speed[0]["ours"]
        out += [f"{mine} against the fastest torch kernel at each point (best torch ms / "
                f"{mine} ms; > 1: {mine} is faster)", "",
                "| dtype | D | causal | mode | N | ratio | fastest torch |",
                "|:--|--:|:--|:--|--:|--:|:--|"]
        out += [f"| {r['dtype']} | {r['D']} | {r['causal']} | {r['mode']} | {r['N']} | "
                f"{r['ratio']:.2f} | {r['best_torch']} |" for r in speed]
        out.append(f"\nmedian {statistics.median(r['ratio'] for r in speed):.2f} over "
                   f"{len(speed)} points\n")
    variants = [r for r in _rows(doc, "variant") if r.get("ratio") is not None]
    if variants:
        mine = variants[0]["backend"]
        out += ["Variant cost: time with the variant / plain causal time, same shape; and "
                f"compiled flex on the same variant: flex ms / {mine} ms (> 1: {mine} is "
                "faster)", "",
                f"| variant | ratio to causal | ms | flex ms | flex / {mine} | flex |",
                "|:--|--:|--:|--:|--:|:--|"]
        out += [f"| {r['variant']} | {r['ratio']:.2f} | {_fmt(r['ms'])} | "
                f"{_fmt(r.get('flex_ms'))} | {_fmt(r.get('flex_ratio'), '.2f')} | "
                f"{_flex_cell(r)} |" for r in variants]
        out.append("")
    for kind, what in (("varlen", "packed varlen"), ("decode", "decode")):
        rs = [r for r in _rows(doc, kind) if r.get("ratio_to_sdpa") is not None]
        if rs:
            out.append(f"{what}: SDPA ms / path ms (> 1: faster than SDPA), median over "
                       "shapes: " + ", ".join(
                           f"{p} {statistics.median(r['ratio_to_sdpa'] for r in rs if r['path'] == p):.2f}"
                           for p in dict.fromkeys(r["path"] for r in rs)) + "\n")
    tune = [r for r in _rows(doc, "tune") if r.get("best_over_pick") is not None]
    if tune:
        out += ["Tune: the autotuner's pick ms / the best config's ms (> 1: a config beat "
                "the pick)", "", "| kernel | shape | best config | ratio |", "|:--|:--|:--|--:|"]
        out += [f"| {r['kernel']} | {r['shape']} | {r['config']} | {r['best_over_pick']:.2f} |"
                for r in tune]
        out.append("")
    return out


def _flex_cell(r: dict) -> str:
    if "flex_status" not in r:
        return ""
    if r["flex_status"] == "ok":
        return f"ok, max diff {_fmt(r.get('flex_max_diff'), '.1e')}"
    return f"{r['flex_status']}: {r.get('flex_note', '')}".replace("|", "/")


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _smoke_section(doc: dict) -> list[str]:
    """Per variant: cases within budget and bitwise repeatable, the worst error / budget and
    the shapes run; then every failed case."""
    rs = _rows(doc, "smoke")
    if not rs:
        return []
    ok = sum(r["status"] == "ok" for r in rs)
    out = ["## Smoke", "",
           f"{ok} of {len(rs)} cases within the float64 reference's budget (out, lse and "
           "every gradient) and bitwise repeatable (two calls, forward and backward); one "
           "triton config per launch", "",
           "| variant | ok | worst error / budget | shapes |", "|:--|--:|--:|:--|"]
    for variant in dict.fromkeys(r["variant"] for r in rs):
        mine = [r for r in rs if r["variant"] == variant]
        worst = [r["worst"] for r in mine if r.get("worst") is not None]
        by: dict[str, list[str]] = {}
        for r in mine:
            by.setdefault(f"{_SHORT.get(r['dtype'], r['dtype'])} D={r['D']}", []).append(
                str(r["N"]))
        shapes = "; ".join(f"{k}: N {', '.join(ns)}" for k, ns in by.items())
        out.append(f"| {variant} | {sum(r['status'] == 'ok' for r in mine)}/{len(mine)} | "
                   f"{_fmt(max(worst) if worst else None, '.2f')} | {shapes} |")
    bad = [r for r in rs if r["status"] != "ok"]
    if bad:
        out += ["", "Failed cases:", ""] + [f"- {r['what']}: {r['note']}" for r in bad]
    return out + [""]


def _pytest_section(doc: dict) -> list[str]:
    rs = _rows(doc, "pytest")
    if not rs and not _rows(doc, "pytest-collected"):
        return []
    per_file: dict[str, Counter] = {}
    for r in rs:
        per_file.setdefault(r["file"], Counter())[r["outcome"]] += 1
    collected: Counter = Counter()
    for r in _rows(doc, "pytest-collected"):
        collected[r["file"]] += r["count"]
    out = ["## pytest, per test file", "",
           "| file | passed | failed | error | skipped | not run (cut by the box) |",
           "|:--|--:|--:|--:|--:|--:|"]
    for f in sorted(set(per_file) | set(collected)):
        c = per_file.get(f, Counter())
        not_run = max(collected[f] - c.total(), 0) if f in collected else None
        out.append(f"| {f} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | "
                   f"{_fmt(not_run, 'd')} |")
    bad = [r for r in rs if r["outcome"] in ("failed", "error")]
    if bad:
        out += ["", "Failures (full text in pytest.txt and log.txt):", ""]
        out += [f"- `{r['nodeid']}` ({r['duration']:.1f} s): {r['message']}" for r in bad]
    out.append("")
    return out


def _simple_table(rs: list[dict], cols: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "--|" * len(cols)]
    for r in rs:
        out.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/")
                                     if not isinstance(r.get(c), float)
                                     else _fmt(r[c]) for c in cols) + " |")
    return out + [""]


def markdown(doc: dict) -> str:
    h = doc["header"]
    labels = {"sm_count": "SMs:", "memory_gib": "GiB:", "driver": "driver"}
    gpu = ", ".join(f"{label} {h[key]}" for key, label in labels.items() if h.get(key) is not None)
    out = [f"# attn gpu-check{' (dry run, no GPU)' if h.get('dry_run') else ''}", "",
           f"- device: {h.get('device_name')}{' (' + gpu + ')' if gpu else ''}; torch "
           f"{h.get('torch')}, triton {h.get('triton')}, CUDA {h.get('cuda')}, Python "
           f"{h.get('python')}",
           f"- date: {h.get('date')}; command: `{h.get('command')}`; "
           f"{h.get('elapsed_s', 0)} s of a {h.get('budget_min')} min budget", ""]
    out += _stages_table(doc) + [""]
    out += _ratio_section(doc)
    out += _smoke_section(doc)
    out += _pytest_section(doc)
    checks = _rows(doc, "check")
    if checks:
        # the NaN scan is dozens of points: its count, and the ones that failed
        scan = [r for r in checks if r["check"] == "nan scan"]
        shown = [r for r in checks if r["check"] != "nan scan" or r["status"] != "ok"]
        out += ["## Checks", ""]
        if scan:
            out += [f"NaN scan: {sum(r['status'] == 'ok' for r in scan)} of {len(scan)} "
                    "points finite (out and every gradient)", ""]
        out += _simple_table(shown, ("check", "what", "status", "note"))
    speed = _rows(doc, "speed")
    if speed:
        out += ["## Speed and memory", "", report.markdown_tables(speed)]
    for kind, cols in (("variant", ("variant", "backend", "status", "ms", "ratio", "flex_ms",
                                     "flex_ratio", "flex_status", "flex_note", "note")),
                       ("varlen", ("path", "shape", "status", "ms", "ratio_to_sdpa", "note")),
                       ("decode", ("path", "B", "Nq", "Nk", "status", "ms", "gb_per_s",
                                   "ratio_to_sdpa", "note")),
                       ("tune", ("kernel", "shape", "config", "status", "ms", "pick", "note")),
                       ("cp", ("strategy", "backend", "status", "max_err", "note")),
                       ("env", ("item", "value"))):
        rs = _rows(doc, kind)
        if rs:
            out += [f"## {kind}", ""] + _simple_table(rs, cols)
    dropped = [(n, d) for n, e in doc["stages"].items() for d in e["dropped"]]
    if dropped:
        out += ["## Dropped points", ""] + [f"- {n}: {d}" for n, d in dropped] + [""]
    out += [f"![{p}]({p})" for p in h.get("plots", [])]
    return "\n".join(out) + "\n"


def _plot_decode(rows: list[dict], path: Path, title: str) -> Path | None:
    pts = [r for r in rows if r["status"] == "ok" and r.get("ms") is not None]
    if not pts:
        return None
    plt = sweep_plots._pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (path_name, B, nq) in dict.fromkeys((r["path"], r["B"], r["Nq"]) for r in pts):
        xs = sorted((r["Nk"], r["ms"]) for r in pts
                    if (r["path"], r["B"], r["Nq"]) == (path_name, B, nq))
        ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", ms=3,
                label=f"{path_name} B={B} Nq={nq}")
    ax.set(xscale="log", yscale="log", xlabel="cache length Nk", ylabel="ms per step (median)",
           title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    return sweep_plots.save(fig, path)


def plots(doc: dict, out: Path, kinds: set[str] = frozenset({"speed", "decode"})
          ) -> list[Path]:
    """speed.png and memory.png (the largest D measured) and decode.png: at most three.
    ``kinds``: which to draw (``speed`` for the first two, ``decode``); the rest stay as they
    are on disk."""
    try:
        sweep_plots._pyplot()
    except ImportError:
        return []
    made = []
    speed = [r for r in _rows(doc, "speed") if r["status"] == "ok"] if "speed" in kinds else []
    title = doc["header"].get("device_name")
    if speed:
        D = max(r["D"] for r in speed)
        rs = [r for r in speed if r["D"] == D]
        if any(r.get("ms") for r in rs):
            made.append(sweep_plots.plot_speed(rs, out / "speed.png", doc["header"]))
        if any(r.get("peak_bytes") for r in rs):
            made.append(sweep_plots.plot_memory(rs, out / "memory.png", {"device_name": title}))
    decode = _rows(doc, "decode") if "decode" in kinds else []
    if (png := _plot_decode(decode, out / "decode.png", f"Decode — {title}")) is not None:
        made.append(png)
    return made
