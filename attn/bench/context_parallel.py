"""``attn bench context-parallel``: ring and Ulysses attention over P gloo processes on CPU.

For each world size P (a fresh group on 127.0.0.1, one torch thread per rank), strategy, N
and mode, every rank measures its shard's peak memory and the time of one call (a row keeps
the max over ranks and the share spent waiting on communication); then float32 against
float64 ``attn.attention`` per P (``errors``), which must not grow with P.
docs/benchmarks.md ("Context parallelism") has the numbers.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue as queue_mod
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attn
import attn.distributed as cp
from attn.bench import report
from attn.bench.plots import _pyplot, save
from attn.timing import CPU_ERROR_BYTES, peak_bytes

STRATEGIES = ("ring", "ulysses")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--n", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    p.add_argument("--heads", "-H", type=int, default=4)
    p.add_argument("--d", type=int, default=16, help="head dim D")
    p.add_argument("--batch", "-B", type=int, default=1)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=("fwd", "fwd+bwd"))
    p.add_argument("--repeat", type=int, default=2, help="timed runs per point (median)")
    p.add_argument("--error-n", type=int, default=1024, help="N of the error-against-P check")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/context_parallel_cpu"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per world size")


# -- one rank -------------------------------------------------------------------------------------

def _call(strategy: str):
    return cp.ring_attention if strategy == "ring" else cp.ulysses_attention


def _point(cfg: dict, strategy: str, N: int, mode: str, rank: int, P: int) -> dict:
    B, H, D, layout = cfg["batch"], cfg["heads"], cfg["d"], cfg["layout"]
    row = dict(strategy=strategy, P=P, N=N, mode=mode, B=B, H=H, D=D, layout=layout,
               causal=cfg["causal"], status="ok", note="")
    if strategy == "ulysses" and H % P:
        return {**row, "status": "skipped", "note": f"H={H} does not divide over P={P}"}
    g = torch.Generator().manual_seed(0)
    n_l = sum(b - a for a, b in cp.shard_ranges(N, P, layout)[rank])  # this rank's rows
    bwd = mode == "fwd+bwd"
    q, k, v = (torch.randn(B, H, n_l, D, generator=g).requires_grad_(bwd) for _ in range(3))
    do = torch.randn(B, H, n_l, D, generator=g) if bwd else None
    fn = _call(strategy)

    def run():
        out = fn(q, k, v, causal=cfg["causal"], layout=layout)
        if bwd:
            out.backward(do)
            q.grad = k.grad = v.grad = None

    dist.barrier()
    peak = peak_bytes(run)  # also the warm-up of the timed runs
    times, comm = [], []
    for _ in range(cfg["repeat"]):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        # the call's wait on communication (ulysses': its forward and backward all-to-alls)
        comm.append(cp.last_ulysses_stats.comm_wait_s if strategy == "ulysses"
                    else cp.last_ring_stats.comm_wait_s
                    + (cp.last_ring_backward_stats.comm_wait_s if bwd else 0.0))
    t = sorted(times)[len(times) // 2]
    c = sorted(comm)[len(comm) // 2]
    # the slowest rank sets the pace; memory: every rank's, and the max
    gathered = [None] * P
    dist.all_gather_object(gathered, (peak, t, c), group=None)
    peaks = [x[0] for x in gathered]
    slow = max(range(P), key=lambda r: gathered[r][1])
    ms = gathered[slow][1] * 1e3
    return {**row, "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
            "input_bytes_per_rank": 3 * B * H * n_l * D * 4 + (B * H * n_l * D * 4 if bwd else 0),
            "ms": ms, "ms_per_step": ms / P if strategy == "ring" else ms,
            "comm_share": gathered[slow][2] / gathered[slow][1]}


def _errors(cfg: dict, rank: int, P: int) -> list[dict]:
    """float32 sharded attention against float64 attn.attention, fwd and bwd, per strategy."""
    N, H, D, layout = cfg["error_n"], cfg["heads"], cfg["d"], cfg["layout"]
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(1, H, N, D, generator=g, dtype=torch.float64) for _ in range(3)]
    do = torch.randn(1, H, N, D, generator=g, dtype=torch.float64)
    exact = [t.clone().requires_grad_() for t in full]
    out64 = attn.attention(*exact, causal=cfg["causal"])
    out64.backward(do)
    rows = []
    for strategy in cfg["strategies"]:
        if strategy == "ulysses" and H % P:
            continue
        leaves = [t.float().requires_grad_() for t in full]
        shards = [cp.shard_sequence(t, layout) for t in leaves]
        out = cp.gather_sequence(_call(strategy)(*shards, causal=cfg["causal"], layout=layout),
                                 layout)
        out.backward(do.float())  # the same loss on every rank: shard's backward gathers
        err = {"out": (out.double() - out64).abs().max().item()}
        for name, a, b in zip(("dq", "dk", "dv"), leaves, exact):
            err[name] = (a.grad.double() - b.grad).abs().max().item()
        rows.append(dict(strategy=strategy, P=P, N=N, dtype="float32", **err))
    return rows


def _worker(rank: int, P: int, port: int, cfg: dict, out_q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=P, timeout=timedelta(seconds=cfg["timeout"]))
    try:
        for strategy, N, mode in itertools.product(cfg["strategies"], cfg["n"], cfg["modes"]):
            try:
                row = _point(cfg, strategy, N, mode, rank, P)
            except Exception as exc:  # recorded in the results; the sweep goes on
                row = dict(strategy=strategy, P=P, N=N, mode=mode, status="error",
                           note=f"{type(exc).__name__}: {exc}")
            if rank == 0:
                out_q.put(("row", row))
                print(f"  P={P} {strategy} N={N} {mode}: "
                      + (f"{row['ms']:.0f} ms, peak {row['peak_bytes'] / 2**20:.1f} MiB/rank, "
                         f"comm {100 * row['comm_share']:.0f}%"
                         if row["status"] == "ok" else row["status"] + " " + row["note"]),
                      flush=True)
        errs = _errors(cfg, rank, P)
        if rank == 0:
            for e in errs:
                out_q.put(("error", e))
    finally:
        if rank == 0:
            out_q.put(("done", None))
        dist.destroy_process_group()


# -- the parent -----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(P: int, cfg: dict) -> tuple[list[dict], list[dict]]:
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, P, port, cfg, out_q)) for r in range(P)]
    for p in procs:
        p.start()
    rows, errors = [], []
    deadline = time.monotonic() + cfg["timeout"]
    try:
        while True:
            try:
                kind, item = out_q.get(timeout=5.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"P={P}: no result within {cfg['timeout']} s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"P={P}: a process died ({[p.exitcode for p in procs]})")
                continue
            if kind == "done":
                break
            (rows if kind == "row" else errors).append(item)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return rows, errors


def markdown(header: dict, rows: list[dict], errors: list[dict]) -> str:
    lines = ["# Context parallelism on CPU (gloo)", "",
             f"{header['date']}, {header['device_name']} ({header['cpu_count']} cores), torch "
             f"{header['torch']}; {header['backend']}. Load average (1 min): "
             f"{header['loadavg_1min_start']:.2f} at the start, {header['loadavg_1min_end']:.2f} "
             f"at the end: times are those of a shared machine, memory is not affected.", "",
             f"Command: `{header['command']}`", "",
             f"Memory: {header['memory_method']}.", f"Time: {header['time_method']}.", "",
             "| strategy | mode | N | P | peak MiB / rank | × (N/P) ref | ms | ms / step | "
             "comm wait |", "|---|---|---|---|---|---|---|---|---|"]
    ok = [r for r in rows if r["status"] == "ok"]
    for r in sorted(ok, key=lambda r: (r["strategy"], r["mode"], r["N"], r["P"])):
        base = [b for b in ok if b["strategy"] == r["strategy"] and b["mode"] == r["mode"]
                and b["N"] == r["N"] and b["P"] == min(x["P"] for x in ok)]
        ratio = ""
        if base:  # measured / (P=1 figure scaled by 1/P): 1.0 means exactly ∝ N/P
            ratio = f"{r['peak_bytes'] / (base[0]['peak_bytes'] * base[0]['P'] / r['P']):.2f}"
        lines.append(f"| {r['strategy']} | {r['mode']} | {r['N']} | {r['P']} | "
                     f"{r['peak_bytes'] / 2**20:.2f} | {ratio} | {r['ms']:.0f} | "
                     f"{r['ms_per_step']:.0f} | {100 * r['comm_share']:.0f}% |")
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        lines += ["", "Not measured:"] + [f"- {r['strategy']} P={r['P']} N={r['N']} "
                                          f"{r['mode']}: {r['status']} {r['note']}"
                                          for r in skipped]
    lines += ["", f"## Error against P (float32 vs float64 `attn.attention`, N = "
              f"{errors[0]['N'] if errors else '?'}, max abs)", "",
              "| strategy | P | out | dq | dk | dv |", "|---|---|---|---|---|---|"]
    for e in sorted(errors, key=lambda e: (e["strategy"], e["P"])):
        lines.append(f"| {e['strategy']} | {e['P']} | {e['out']:.2e} | {e['dq']:.2e} | "
                     f"{e['dk']:.2e} | {e['dv']:.2e} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    modes = sorted({r["mode"] for r in ok}, key=len)
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes), 8), squeeze=False)
    for j, mode in enumerate(modes):
        for strategy, ls in (("ring", "-"), ("ulysses", "--")):
            for P in sorted({r["P"] for r in ok}):
                pts = sorted((r["N"], r["peak_bytes"], r["ms"]) for r in ok
                             if r["mode"] == mode and r["strategy"] == strategy and r["P"] == P)
                if not pts:
                    continue
                ns = [p[0] for p in pts]
                label = f"{strategy} P={P}"
                axes[0][j].plot(ns, [p[1] / 2**20 for p in pts], ls, marker="o", label=label)
                axes[1][j].plot(ns, [p[2] for p in pts], ls, marker="o", label=label)
        ylabels = ("peak MiB per rank (above inputs)", "ms per call (slowest rank)")
        for ax, ylabel, title in zip(axes[:, j], ylabels, ("memory", "time")):
            ax.set_xscale("log", base=2)
            ax.set(yscale="log", xlabel="sequence length N", ylabel=ylabel,
                   title=f"{title}, {mode}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    return save(fig, path)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = dict(n=list(args.n), strategies=list(args.strategies), layout=args.layout,
               heads=args.heads, d=args.d, batch=args.batch, causal=not args.no_causal,
               modes=list(args.modes), repeat=args.repeat, error_n=args.error_n,
               timeout=args.timeout)
    load_start = os.getloadavg()[0]
    rows, errors = [], []
    for P in args.world_sizes:
        print(f"world size {P}", flush=True)
        r, e = _run_world(P, cfg)
        rows += r
        errors += e
    header = {
        **report.run_header("cpu", argv),
        "backend": "gloo on 127.0.0.1, one process per rank, torch threads per rank: 1",
        "loadavg_1min_start": load_start, "loadavg_1min_end": os.getloadavg()[0],
        "memory_method": ("per rank: torch.profiler CPU allocator events, peak live bytes "
                          f"above the inputs (error <= {CPU_ERROR_BYTES} bytes on a known "
                          "allocation); the max over ranks"),
        "time_method": "wall time of one call, median of --repeat runs after a warm-up, the "
                       "slowest rank; ms_per_step = ms / P for the ring",
        "config": dict(cfg),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(rows, args.out / "context_parallel.png")
    report.write_results(args.out, header, rows, markdown(header, rows, errors), also=(png,),
                         errors=errors)
    return 1 if any(r["status"] == "error" for r in rows) else 0

