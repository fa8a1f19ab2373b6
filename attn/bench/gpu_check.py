"""``attn gpu-check``: one command that checks every GPU claim of attn in one run of at most
8 minutes and writes a flat folder of at most eight files; docs/gpu.md, "On a GPU machine":
its commands (a run, ``--stages``, ``--merge``, ``--dry-run``), stages, boxes, statuses and
files. Each stage runs in its own process (:mod:`attn.bench.gpu_stages`) under a time box, its
share by :data:`WEIGHTS` of what is left of ``--budget-min``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from attn import fused_cuda
from attn.bench import fused_verify, gpu_record, gpu_stages, gpu_tables, report

# name: MODULE:FUNCTION of the stage's process, in run order (docs/gpu.md: what each runs)
STAGES = {"env": "attn.bench.gpu_stages:env", "smoke": "attn.bench.gpu_smoke:smoke",
          "correctness": "attn.bench.gpu_stages:correctness",
          "fused-cuda": "attn.bench.fused_verify:stage",
          **{name: f"attn.bench.gpu_stages:{name.replace('-', '_')}"
             for name in ("speed", "varlen-decode", "tune", "context-parallel")}}
# the full CUDA pytest (minutes of compiling) takes a run of its own
DEFAULT_STAGES = [s for s in STAGES if s != "correctness"]
# minutes of the default 8-minute run (docs/gpu.md: the shares); correctness, run alone, takes
# what is left after env
WEIGHTS = {"env": 0.3, "smoke": 1.0, "correctness": 5.0, "fused-cuda": 1.2, "speed": 3.5,
           "varlen-decode": 1.0, "tune": 0.6, "context-parallel": 0.4}
TUNE_MIN_S = 60  # below this the tune stage would time one config or none: skip it
GRACE_S = 10  # after its deadline a stage gets this long to end on its own before the kill


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None,
                   help="the run's folder: results.json, results.md, pytest.txt, log.txt, "
                        "up to 3 PNGs (flat; at most 8 files)")
    p.add_argument("--budget-min", type=float, default=8.0,
                   help="minutes for the whole run (default 8); each stage gets a share and "
                        "drops points to fit it")
    p.add_argument("--stages", nargs="+", default=list(DEFAULT_STAGES), metavar="STAGE",
                   help=f"stages to run, among {', '.join(STAGES)} (default: all but "
                        "correctness, the full CUDA pytest, which takes a run of its own)")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: every stage through its real code at tiny sizes (triton in "
                        "the interpreter for correctness, tiled and SDPA for timing); GPU-only "
                        "points recorded as skipped")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR",
                   help="join the folders of earlier runs into --out instead of running")
    p.add_argument("--adopt", type=Path, nargs="+", default=None, metavar="DIR",
                   help="instead of running: merge earlier runs' measured tables into the "
                        "checkout, the tune stage's best configs into "
                        "attn/flash_triton/tuned.json (the autotuner reads it first) and the "
                        "fused-cuda stage's fused_cuda_table.json into "
                        "attn/fused_cuda_table.json (auto reads it); commit them with the "
                        "results")
    p.add_argument("--tests", type=Path, default=Path("tests"),
                   help="the repository's tests folder (default ./tests: run from a checkout)")


def _check_args(args: argparse.Namespace) -> None:
    if args.out is None and not args.adopt:
        raise SystemExit("attn gpu-check: --out is required (the folder for the run's files)")
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"attn gpu-check: --stages: unknown {unknown}; choose among "
                         f"{list(STAGES)}")
    if not args.budget_min > 0:
        raise SystemExit(f"attn gpu-check: --budget-min must be positive, got {args.budget_min}")


def _header(args: argparse.Namespace, argv: list[str]) -> dict:
    return {"device_name": report.device_name("cpu") if args.dry_run else None,
            "torch": torch.__version__, "triton": report._triton_version(),
            "python": platform.python_version(), "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "attn " + shlex.join(argv), "dry_run": args.dry_run,
            "budget_min": args.budget_min, "stages": list(args.stages),
            "cores": os.cpu_count(), "elapsed_s": 0.0, "plots": []}


def _child_env(name: str, dry_run: bool) -> dict:
    """The caller's environment with the interpreter on only in a dry run, and one config per
    launch (right answers, not the fastest) only for correctness and smoke: users autotune."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "ATTN_TRITON_AUTOTUNE")}
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    if name in ("correctness", "smoke"):
        env["ATTN_TRITON_AUTOTUNE"] = "0"
    return env


@functools.cache
def _stage_starter():
    """Stage processes fork from a server that imported torch once (1.5 s a process here)
    and nothing that reads the environment a stage sets or touches CUDA: each stage still
    gets a fresh process and its own CUDA context."""
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    # start it now, before any stage's box opens: its torch import (seconds on a loaded
    # machine) is no stage's time
    multiprocessing.forkserver.ensure_running()
    return context


def _run_stage(name: str, target: str, ctx: gpu_record.StageContext) -> tuple[str, str, dict]:
    """Run one stage in its own process: (status, why, its records)."""
    proc = _stage_starter().Process(
        target=gpu_stages.stage_process, name=f"attn gpu-check {name}",
        args=(target, json.dumps(ctx.__dict__), _child_env(name, ctx.dry_run)))
    proc.start()
    proc.join(timeout=max(ctx.left(), 0) + GRACE_S)
    killed = proc.is_alive()
    if killed:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage and whatever it started
        except ProcessLookupError:  # killed before its setsid: the process alone
            proc.kill()
        proc.join()
    got = gpu_record.read_scratch(ctx.scratch)
    if killed:
        where = f" while running {got['running']}" if got["running"] else ""
        return "out of time", f"cut at its {ctx.budget_s:.0f} s box{where}", got
    if proc.exitcode != 0:
        return "failed", got["error"] or f"its process ended with exit code {proc.exitcode}", got
    if got["info"].get("skipped"):
        return "skipped", got["info"]["skipped"], got
    return "done", "", got


def _say(out: Path, line: str) -> None:
    """A line of the run itself (a stage starting or ending): on stderr and in log.txt."""
    print(f"attn gpu-check: {line}", file=sys.stderr, flush=True)
    with open(out / "log.txt", "a") as f:
        f.write(f"[gpu-check] {line}\n")


def run_stages(args: argparse.Namespace, argv: list[str], stages: dict[str, str] | None = None
               ) -> dict:
    """Run the selected stages in order (``stages``: name → MODULE:FUNCTION, default
    :data:`STAGES`), writing the folder after each; returns results.json's content."""
    stages = STAGES if stages is None else stages
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in gpu_record.FILES:  # a folder reused from an earlier run: start clean
        (out / name).unlink(missing_ok=True)
    t0 = time.time()
    total = args.budget_min * 60
    header = _header(args, argv)
    selected = [s for s in stages if s in args.stages]
    doc = {"schema": gpu_record.SCHEMA, "header": header, "rows": [],
           "stages": {s: gpu_record.stage_entry(
               "skipped", why="the run ended before this stage" if s in selected
               else "not in the default run (name it in --stages)" if s in STAGES and
               s not in DEFAULT_STAGES else "not selected (--stages)") for s in stages}}
    gpu_record.write_results(out, doc)
    _stage_starter()
    env_facts: dict = {}
    with tempfile.TemporaryDirectory(prefix="attn-gpu-check-") as tmp:
        for i, name in enumerate(selected):
            # its share of what is left, by weight among this stage and the ones after it
            box = (max(total - (time.time() - t0), 0) * WEIGHTS.get(name, 1.0)
                   / sum(WEIGHTS.get(s, 1.0) for s in selected[i:]))
            if name == "tune" and box < TUNE_MIN_S and not args.dry_run:
                short = "skipped", f"no budget left ({box:.0f} s < {TUNE_MIN_S} s)"
            else:
                short = ("out of time", "no budget left for it") if box <= 1 else None
            if short is not None:
                doc["stages"][name] = gpu_record.stage_entry(short[0], why=short[1])
                _say(out, f"stage {name}: {short[0]} (no budget left)")
                gpu_record.write_results(out, doc)
                continue
            _say(out, f"stage {name} ({box:.0f} s box)")
            ctx = gpu_record.StageContext(
                name=name, out=str(out.resolve()), scratch=str(Path(tmp) / f"{name}.jsonl"),
                deadline=time.time() + box, dry_run=args.dry_run, cores=os.cpu_count() or 1,
                tests=str(args.tests.resolve()), budget_s=box, env=env_facts)
            # if this process is killed now, the stage reads as what it is: unfinished
            doc["stages"][name] = gpu_record.stage_entry(
                "out of time", why="not finished when the run ended", budget_s=box)
            gpu_record.write_results(out, doc)
            started = time.time()
            status, why, got = _run_stage(name, stages[name], ctx)
            if name == "env":
                env_facts.update(got["info"])
                header.update({k: got["info"][k] for k in ("device_name", "cuda", "driver",
                                                           "sm_count", "memory_gib")
                               if k in got["info"]})
            origin = {k: header.get(k) for k in gpu_record.ROW_ORIGIN}
            doc["rows"] += [{**r, **origin} for r in got["rows"]]
            doc["stages"][name] = gpu_record.stage_entry(
                status, why=why, seconds=time.time() - started, dropped=got["dropped"],
                budget_s=box)
            header["elapsed_s"] = round(time.time() - t0, 1)
            drawn = {r.get("kind") for r in got["rows"]} & {"speed", "decode"}
            if drawn:  # this stage's plots; the earlier ones stay
                gpu_tables.plots(doc, out, drawn)
                header["plots"] = [p for p in gpu_tables.PLOTS if (out / p).is_file()]
            gpu_record.write_results(out, doc)
            _say(out, f"stage {name}: {status}{' (' + why + ')' if why else ''}")
    if header["device_name"] is None:  # env not run: name the device all the same
        header["device_name"] = report.device_name("cuda")
        gpu_record.write_results(out, doc)
    return doc


def failures(doc: dict) -> list[str]:
    """What makes the run's exit code 1: failed stages, failed tests and checks."""
    bad = [f"stage {n}: {e['why']}" for n, e in doc["stages"].items() if e["status"] == "failed"]
    bad += [f"{r.get('nodeid') or r.get('check') or r.get('kind')}: "
            f"{r.get('message') or r.get('what') or r.get('note')}" for r in doc["rows"]
            if r.get("outcome") in ("failed", "error") or
            (r.get("kind") in ("check", "cp") and r.get("status") == "failed")]
    bad += [f"smoke {r['what']}: {r['note']}" for r in doc["rows"]
            if r.get("kind") == "smoke" and r.get("status") == "failed"]
    return bad


TUNED_ABOUT = ("the best triton config per launch key measured by attn gpu-check's tune "
               "stage (attn gpu-check --adopt DIR); the autotuner runs a key's config without "
               "timing when pruning keeps it")


def adopt_tuned(rows: list[dict], path: Path | None = None) -> dict:
    """Merge the tune stage's best-of-sweep rows (``key``, ``config`` as
    :func:`attn.flash_triton.tune.config_fields`, ``ms``, ``pick_ms``, ``device``, ``date``)
    into the table at ``path`` (default the committed one the autotuner reads); returns the
    table written."""
    from attn.flash_triton import tune

    for r in rows:
        missing = {"key", "config"} - r.keys()
        if missing or set(r["config"]) != {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}:
            raise ValueError(f"a tuned row needs key and config (BLOCK_M, BLOCK_N, num_warps, "
                             f"num_stages); got {r!r}")
    return gpu_record.merge_rows(tune.TUNED if path is None else path, rows, TUNED_ABOUT)


def _adopt(folders: list[Path]) -> int:
    """``--adopt``: the "best of the sweep" rows of each folder's results.json (tune stage)
    that name a launch key and a config, merged into the committed tuned table, and each
    folder's fused_cuda_table.json merged into the committed fused table."""
    from attn.flash_triton import tune

    rows, fused_rows = [], []
    for folder in map(Path, folders):
        if not (folder / "results.json").is_file():
            print(f"attn gpu-check: --adopt: no results.json in {folder}", file=sys.stderr)
            return 2
        doc = json.loads((folder / "results.json").read_text())
        header = doc.get("header", {})
        rows += [{"key": r["key"], "config": r["fields"], "ms": r.get("ms"),
                  "pick_ms": r.get("pick_ms"), "shape": r.get("shape"),
                  "device": r.get("device") or header.get("device_name"),
                  "date": header.get("date")} for r in doc.get("rows", [])
                 if r.get("kind") == "tune" and r.get("note") == "best of the sweep"
                 and r.get("key") and r.get("fields")]
        if (folder / "fused_cuda_table.json").is_file():  # the fused-cuda stage's table
            fused_rows += json.loads((folder / "fused_cuda_table.json").read_text())["rows"]
    table = adopt_tuned(rows)
    print(f"adopted {len(rows)} tuned configs into {tune.TUNED} "
          f"({len(table['rows'])} rows in all)")
    if fused_rows:
        merged = fused_verify.write_table(fused_rows)
        print(f"adopted {len(fused_rows)} fused-cuda rows into {fused_cuda.TABLE} "
              f"({len(merged['rows'])} rows in all)")
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> int:
    _check_args(args)
    if args.adopt:
        return _adopt(args.adopt)
    if args.merge:
        try:
            doc = gpu_record.merge_folders(args.merge, args.out, "attn " + shlex.join(argv))
        except ValueError as exc:
            print(f"attn gpu-check: {exc}", file=sys.stderr)
            return 2
        print(f"merged {len(args.merge)} runs into {args.out}: "
              + ", ".join(f"{n} {e['status']}" for n, e in doc["stages"].items()))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("attn gpu-check: torch sees no CUDA device; on a machine without a GPU, "
              "--dry-run runs every stage at tiny sizes", file=sys.stderr)
        return 2
    doc = run_stages(args, argv)
    bad = failures(doc)
    for line in bad:
        print(f"FAILED {line}", file=sys.stderr)
    print(f"wrote {args.out}: " + ", ".join(sorted(p.name for p in args.out.iterdir()
                                                   if not p.name.startswith("."))))
    return 1 if bad else 0
