"""What a run is: its header (machine, versions, command), the correctness checks against the
reference, and the writers for JSON and markdown.

JSON layout: ``{"header": {...}, "checks": [...], "rows": [...]}``; each row is a
:class:`attn.bench.sweep.Row` (backend, device, dtype, B, H, N, D, causal, mode, ms, tflops,
peak_bytes, ratio_to_sdpa, ...), skipped points included with their reason.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import os
import platform
import shlex
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

import attn
from attn.api import attention, unsupported_reason
from attn.bench.sweep import Row, SweepConfig, attn_backends, describe_function, \
    device_unsupported, square_call
from attn.choose import cpuinfo
from attn.testing import compare_to_reference, make_inputs
from attn.tiled import steps_path_reason
from attn.timing import CPU_ERROR_BYTES

SCHEMA_VERSION = 1
ROW_KEYS = ("backend", "device", "dtype", "B", "H", "N", "D", "causal", "mode", "ms", "tflops",
            "peak_bytes", "ratio_to_sdpa")


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    name = cpuinfo("model name")
    return name if name is not None else platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def load_warning(header: dict) -> str | None:
    """What to do when other processes compete for the cores this run uses: the 1-minute
    load average (taken before the run) above the torch threads it runs on."""
    load, cores = header.get("loadavg_1min"), header.get("torch_threads")
    if load is None or not cores or load <= cores:
        return None
    return (f"the load average is {load:.1f} over the last minute, above the {cores} "
            f"core{'s' if cores != 1 else ''} this run uses: other processes are competing "
            f"for them, so times come out slower and noisier than on a quiet machine. Wait "
            f"until the load drops below {cores}, stop the other jobs, or give --threads the "
            f"number of cores that are free. Ratios to sdpa, measured side by side in this "
            f"run, suffer least.")


def run_header(device: str, argv: list[str], prog: str = "attn") -> dict:
    """What every benchmark question's header starts with: the machine, versions, load, date
    and the command that made the numbers (``prog`` and ``argv``)."""
    return {
        "device": device, "device_name": device_name(device), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "attn": attn.__version__,
        # other processes on the machine slow every path alike; ratios stay meaningful (two
        # decimals say all the 1-minute load average can)
        "loadavg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([prog, *map(shlex.quote, argv)]),
    }


def machine_lines(h: dict, more: str = "") -> list[str]:
    """A question's results.md lines for :func:`run_header`'s machine, versions, date and
    command (``more`` ends the versions line)."""
    return [f"- device: {h['device_name']} ({h['cpu_count']} CPUs, {h['torch_threads']} torch "
            f"threads); load at the start {h['loadavg_1min']:.2f}",
            f"- torch {h['torch']}, python {h['python']}, attn {h['attn']}, {h['date']}{more}",
            f"- command: `{h['command']}`"]


def make_header(cfg: SweepConfig, argv: list[str],
                matmul_tflops: dict[str, float] | None = None) -> dict:
    """Everything needed to trust or reproduce the numbers: versions, device, date, command."""
    is_cuda = torch.device(cfg.device).type == "cuda"
    # the sweep's settings as JSON; a user's function as its description
    config = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    config["functions"] = {name: describe_function(fn) for name, fn in cfg.functions.items()}
    return {
        "schema": SCHEMA_VERSION,
        **run_header(cfg.device, argv),
        "triton": _triton_version(),
        "kind": "gpu" if is_cuda else "cpu",
        "tiled_path": steps_path_reason(cfg.device),  # the tiled path a call takes here
        "memory_method": ("torch.cuda.max_memory_allocated above the inputs" if is_cuda else
                          "torch.profiler CPU allocator events, peak live bytes above the "
                          f"inputs (error <= {CPU_ERROR_BYTES} bytes on a known allocation)"),
        "flops": "4*B*H*Nq*Nk*D forward, /2 causal, x3.5 forward+backward",
        "matmul_tflops": matmul_tflops or {},
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
    }


# -- correctness against the reference ---------------------------------------------------------

# Small awkward shapes (B, H, Hkv, N, D, causal): odd N, a head dim that is not a power of 2,
# grouped-query attention; enough to catch a broken backend in seconds.
CHECK_SHAPES = ((1, 2, 2, 97, 64, False), (2, 4, 2, 130, 40, True), (1, 2, 1, 257, 64, True))


@dataclass
class Check:
    backend: str
    shape: str
    causal: bool
    status: str  # ok | failed | skipped
    worst: float | None = None  # max over tensors of error / budget (<= 1 passes)
    message: str = ""


def run_checks(device: str, backends: tuple[str, ...], dtype: torch.dtype = torch.float32,
               on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Each backend against the float64 reference on :data:`CHECK_SHAPES`, through
    ``attn.testing.compare_to_reference``: outputs, lse and the gradients of q, k, v.
    ``on_check`` is called with each check as soon as it is done (to print it then)."""
    checks = []

    def add(check: Check) -> None:
        checks.append(check)
        if on_check is not None:
            on_check(check)

    for backend in backends:
        # the oracle itself; torch's kernels and users' functions are not attn's to check
        if backend == "reference" or backend not in attn_backends():
            continue
        for B, H, Hkv, N, D, causal in CHECK_SHAPES:
            shape = f"B={B} H={H} Hkv={Hkv} N={N} D={D}"
            why = device_unsupported(backend, device) or unsupported_reason(
                backend, square_call(device, dtype, D, N, causal))
            if why is not None:
                add(Check(backend, shape, causal, "skipped", message=why))
                continue
            lse_ok = unsupported_reason(backend, square_call(device, dtype, D, N, causal,
                                                             return_lse=True)) is None
            q, k, v = make_inputs(B, H, N, D, Hkv=Hkv, dtype=dtype, device=device)
            try:
                rep = compare_to_reference(functools.partial(attention, backend=backend), q, k,
                                           v, causal=causal, check_lse=lse_ok)
            except Exception as exc:  # a crash is a failed check, reported, not a dead report
                add(Check(backend, shape, causal, "failed",
                          message=f"{type(exc).__name__}: {exc}"))
                continue
            bad = [c.name for c in rep.comparisons if not c.ok]
            add(Check(backend, shape, causal, "ok" if rep.ok else "failed", rep.worst,
                      "" if rep.ok else f"over budget: {', '.join(bad)}\n{rep}"))
    return checks


# -- writers -----------------------------------------------------------------------------------

def write_json(path: str | Path, header: dict, rows: list[Row],
               checks: list[Check] | None = None) -> Path:
    """A sweep's results.json: header, checks and rows (NaN or a non-JSON value raises)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"header": header, "checks": [asdict(c) for c in checks or []],
           "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return path


def write_results(out: str | Path, header: dict, rows: list[dict], markdown: str,
                  also: tuple = (), **extra) -> tuple[Path, ...]:
    """A benchmark question's ``results.json`` (header, rows and ``extra``'s keys) and
    ``results.md``; prints the markdown and the files written (``also``: files the question
    wrote itself)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "results.json", out / "results.md", *also
    paths[0].write_text(json.dumps({"header": header, "rows": rows, **extra}, indent=1) + "\n")
    paths[1].write_text(markdown)
    print(markdown)
    print("wrote " + ", ".join(map(str, paths)))
    return paths


def load_json(path: str | Path) -> tuple[dict, list[dict], list[dict]]:
    doc = json.loads(Path(path).read_text())
    return doc["header"], doc["rows"], doc.get("checks", [])


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def _mib(b: int | None) -> str:
    if b is None:
        return "—"
    return f"{b / 2**20:,.1f}" if b < 10 * 2**30 else f"{b / 2**30:,.1f} GiB"


def per_path_lines(rows: list[dict], cells) -> list[str]:
    """Markdown rows, one per (row, path) of a question whose rows time several paths
    (``row["ms"]``: path -> ms): ``cells(row, path, ms)`` gives that line's cells."""
    return ["| " + " | ".join(cells(r, n, ms)) + " |" for r in rows for n, ms in r["ms"].items()]


def markdown_tables(rows: list[dict]) -> str:
    """One table per (dtype, D, causal, mode) of docs/benchmarks.md's columns ('Reading the
    table'); B and H in its title when one value holds for it, else in a column (fixed work per
    point); the points that did not run under it, one line per backend and reason."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["D"], r["causal"], r["mode"]), []).append(r)
    for (dtype, D, causal, mode), rs in groups.items():
        shapes = {(r["B"], r["H"]) for r in rs}
        fixed = len(shapes) == 1
        bh = f"B={rs[0]['B']}, H={rs[0]['H']}, " if fixed else ""
        out.append(f"**{mode}, {'causal' if causal else 'non-causal'}, {dtype}, {bh}D={D}**\n")
        out.append(f"| N |{'' if fixed else ' B×H |'} backend | ms | TFLOP/s | % of matmul | "
                   "peak MiB | sdpa ms / ms |")
        out.append(f"|--:|{'' if fixed else '--:|'}:--|--:|--:|--:|--:|--:|")
        notes: dict[tuple, list[int]] = {}
        for r in sorted(rs, key=lambda r: r["N"]):
            if r["status"] != "ok":
                notes.setdefault((r["backend"], r["status"], r["note"]), []).append(r["N"])
            if r["status"] == "skipped":
                continue
            ms = r["ms"]
            frac = r.get("matmul_fraction")
            shape = "" if fixed else f" {r['B']}×{r['H']} |"
            out.append(f"| {r['N']} |{shape} {r['backend']} | "
                       f"{r['status'] if r['status'] != 'ok' else _fmt(ms, ',.1f' if (ms or 0) >= 10 else '.2f')} | "
                       f"{_fmt(r['tflops'], '.3g')} | "
                       f"{_fmt(None if frac is None else 100 * frac, '.0f')} | "
                       f"{_mib(r['peak_bytes'])} | {_fmt(r['ratio_to_sdpa'], '.2f')} |")
        out.append("")
        for (backend, status, note), ns in notes.items():
            out.append(f"- {backend} {status} at N={', '.join(map(str, ns))}: {note}")
        if notes:
            out.append("")
    return "\n".join(out)


CHECKS_HEAD = ("| backend | shape | causal | result | error / budget |",
               "|:--|:--|:--|:--|--:|")


def check_row(c: dict) -> str:
    return (f"| {c['backend']} | {c['shape']} | {c['causal']} | {c['status']} | "
            f"{_fmt(c['worst'], '.2f')} |")


def skipped_notes(checks: list[dict]) -> list[str]:
    """One line per backend and reason for the skipped checks."""
    skipped = Counter((c["backend"], c["message"]) for c in checks if c["status"] == "skipped")
    return [f"- {b}: {n} check(s) skipped: {m}" for (b, m), n in skipped.items()]


def checks_table(checks: list[dict]) -> str:
    """Checked shapes one per line; a backend skipped for one reason on every shape, once."""
    if not checks:
        return ""
    lines = [*CHECKS_HEAD, *(check_row(c) for c in checks if c["status"] != "skipped")]
    lines += [f"\n{n}" for n in skipped_notes(checks)]
    return "\n".join(lines) + "\n"


def checks_summary(checks: list[dict]) -> str:
    """One line for the end of a run whose check table was printed at its start."""
    counts = Counter(c["status"] for c in checks)
    return ("correctness against the float64 reference (table above): "
            + ", ".join(f"{n} {status}" for status, n in counts.items()))


# -- the conclusion: what the tables say, in a few lines ----------------------------------------

NOISY_SPREAD = 1.5  # a point whose median time is this many times its fastest run is noisy
NOISY_JUMP = 2.0  # time growing this many times faster than the FLOPs from one N to the next


def noisy_points(rows: list[dict]) -> list[str]:
    """Measurements not to trust as they are, one line each (docs/benchmarks.md, 'The
    report', 5.): the busy moments a median, a time's growth or the matmul ceiling shows."""
    found = []
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] != "ok" or r.get("ms") is None:
            continue
        if r.get("ms_min") and r["ms"] > NOISY_SPREAD * r["ms_min"]:
            found.append(f"{_where(r)}: median {_ms(r['ms'])} ms is {r['ms'] / r['ms_min']:.1f}× "
                         f"its fastest run")
        if (r.get("matmul_fraction") or 0) > 1.0:
            found.append(f"{_where(r)}: {100 * r['matmul_fraction']:.0f} % of the matmul rate, "
                         f"above 100 %: the matmul ceiling was read in a busy moment")
        series.setdefault((r["backend"], r["dtype"], r["D"], r["causal"], r["mode"]), []
                          ).append(r)
    for rs in series.values():
        rs.sort(key=lambda r: r["N"])
        for a, b in zip(rs, rs[1:]):
            if a["flops"] and b["flops"] and a["ms"] > 0:
                grew, work = b["ms"] / a["ms"], b["flops"] / a["flops"]
                if grew > NOISY_JUMP * work:
                    found.append(f"{_where(b)}: {_ms(b['ms'])} ms, {grew:.1f}× N={a['N']}'s "
                                 f"{_ms(a['ms'])} ms for {work:.1f}× the FLOPs")
    return found


def _ms(x: float) -> str:
    """Three significant digits, without an exponent for the long points."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _where(r: dict) -> str:
    return (f"{r['backend']} {r['mode']} N={r['N']}{' causal' if r['causal'] else ''} "
            f"{r['dtype']}")


def _checked(backend: str, checks: list[dict]) -> str:
    mine = [c for c in checks if c["backend"] == backend and c["status"] != "skipped"]
    failed = sum(c["status"] == "failed" for c in mine)
    if backend == "reference":
        return "the oracle the others are checked against"
    if not mine:
        return "not checked in this run"
    if failed:
        return f"WRONG: {failed} of {len(mine)} checks against the float64 reference failed"
    return f"correct ({len(mine)} of {len(mine)} checks against the float64 reference)"


def _meaning(backend: str, speed: float, memory: float | None) -> str:
    faster, slower = speed >= 1.05, speed <= 0.95
    if memory is None:
        return ("faster than SDPA here" if faster else "slower than SDPA here" if slower
                else "as fast as SDPA here")
    smaller, larger = memory <= 0.95, memory >= 1.05
    if faster and not larger:
        return "better than SDPA on this machine at this size"
    if slower and larger:
        return (f"slower and larger than SDPA on this machine at this size: for calls SDPA "
                f"can run, SDPA is the better choice here; {backend} is for what SDPA lacks "
                f"(softcap, sinks, lse, attn's masks and windows)")
    if slower and smaller:
        return "slower than SDPA but smaller: worth it where memory limits N"
    if faster and larger:
        return "faster than SDPA but larger: worth it where memory is not the limit"
    return "about even with SDPA at this size" if not larger else "as fast as SDPA but larger"


def conclusion(header: dict, rows: list[dict], checks: list[dict]) -> list[str]:
    """The report's answer as markdown list items (docs/benchmarks.md, 'The report', 5.)."""
    def point(r: dict) -> tuple:  # rows of one point compare with each other
        return r["dtype"], r["B"], r["H"], r["N"], r["D"], r["causal"], r["mode"]

    ok = [r for r in rows if r["status"] == "ok"]
    sdpa = {point(r): r for r in ok if r["backend"] == "sdpa"}
    lines = []
    backends = dict.fromkeys(r["backend"] for r in ok if r["backend"] != "sdpa")
    for backend, mode in itertools.product(backends, dict.fromkeys(r["mode"] for r in ok)):
        pairs = [(r, sdpa[point(r)]) for r in ok
                 if r["backend"] == backend and r["mode"] == mode and point(r) in sdpa]
        pairs = [(r, s) for r, s in pairs if r.get("ms") and s.get("ms")
                 or r.get("peak_bytes") and s.get("peak_bytes")]
        if not pairs:
            continue
        r, s = max(pairs, key=lambda p: (p[0]["N"], not p[0]["causal"]))
        what = []
        speed = s["ms"] / r["ms"] if r.get("ms") and s.get("ms") else None
        memory = (r["peak_bytes"] / s["peak_bytes"] if r.get("peak_bytes")
                  and s.get("peak_bytes") else None)
        if speed is not None:
            what.append(f"{speed:.2f}× SDPA's speed ({_ms(r['ms'])} vs {_ms(s['ms'])} ms)")
        if memory is not None:
            what.append(f"{memory:.2f}× SDPA's peak memory ({_mib(r['peak_bytes'])} vs "
                        f"{_mib(s['peak_bytes'])} MiB)")
        line = (f"- **{backend}** {mode}, N={r['N']}{' causal' if r['causal'] else ''} "
                f"{r['dtype']} D={r['D']}: {', '.join(what)}; {_checked(backend, checks)}")
        if backend != "reference" and speed is not None:
            meaning = _meaning(backend, speed, memory)
            line += f". {meaning[0].upper()}{meaning[1:]}."
        elif backend == "reference":
            line += " (exact, not meant to be fast)."
        lines.append(line)
    if not lines:
        lines.append("- no backend ran beside sdpa at a common point: nothing to compare")
    warning = load_warning(header)
    noisy = noisy_points(rows)
    if warning or noisy:
        lines.append("- **times not to trust as they are**"
                     + (f": the machine was loaded (load {header['loadavg_1min']:.2f} over "
                        f"{header['torch_threads']} threads)" if warning else "")
                     + (f"; {len(noisy)} noisy measurement{'s' if len(noisy) > 1 else ''}: "
                        + "; ".join(noisy[:4]) + (" ..." if len(noisy) > 4 else "")
                        if noisy else "")
                     + ". Re-run on a quiet machine before acting on speed; memory and "
                       "correctness do not depend on load.")
    return lines


def header_text(h: dict) -> str:
    rates = ", ".join(f"{k} {v:.3f}" for k, v in h.get("matmul_tflops", {}).items())
    warning = load_warning(h)
    load = h["loadavg_1min"]
    return (f"- device: {h['device_name']} ({h['device']}, {h['cpu_count']} CPUs, "
            f"{h['torch_threads']} torch threads, load "
            f"{'unknown' if load is None else f'{load:.2f}'})\n"
            + (f"- **warning**: {warning}\n" if warning else "")
            + f"- torch {h['torch']}, triton {h['triton']}, python {h['python']}, {h['date']}\n"
            f"- command: `{h['command']}`\n"
            f"- tiled backend: {h.get('tiled_path', 'not recorded')}\n"
            # a memory-only run measures no matmul: no line rather than an empty one
            + (f"- square matmul TFLOP/s in this run: {rates}\n" if rates else "")
            + f"- memory: {h['memory_method']}\n"
            f"- FLOPs: {h['flops']}\n")


def write_markdown(path: str | Path, header: dict, rows: list[dict],
                   checks: list[dict] | None = None, plots: list[str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = ["# attn report\n", header_text(header),
             "## Conclusion\n", "\n".join(conclusion(header, rows, checks or [])) + "\n"]
    if checks:
        parts += ["## Correctness against the float64 reference\n", checks_table(checks)]
    parts += ["## Memory and speed\n", markdown_tables(rows)]
    for p in plots or []:
        parts.append(f"![{Path(p).stem}]({Path(p).name})\n")
    path.write_text("\n".join(parts))
    return path
