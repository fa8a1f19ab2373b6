"""``attn bench speed --paired``: :func:`contenders` against torch SDPA on CPU, taking turns
round after round, as the median of the in-round ratios (docs/benchmarks.md, 'Measured: CPU,
fp32, B=1, H=8, D=64').
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

import attn
from attn.bench import report
from attn.bench.competitors import make_forward
from attn.bench.flops import MODES, attention_flops, matmul_tflops
from attn.bench.sweep import CAUSAL, DTYPES
from attn.sdpa import torch_sdpa
from attn.tiled import cpu, steps_path_reason
from attn.timing import median_ratio, paired

# the environment each tiled variant runs under (set before each of its calls)
TILED_VARIANTS = {
    "tiled": {"ATTN_TILED_COMPILE": "0", "ATTN_TILED_GEMM": "auto"},
    "tiled bmm": {"ATTN_TILED_COMPILE": "0", "ATTN_TILED_GEMM": "bmm"},
    "tiled compiled": {"ATTN_TILED_COMPILE": "1", "ATTN_TILED_GEMM": "auto"},
}
DEFAULT_N = (512, 1024, 2048, 4096, 8192, 16384)


def sdpa_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> dict:
    """torch SDPA's keywords for attn's ``causal`` (bottom-right; SDPA's ``is_causal`` is
    top-left): ``is_causal`` when Nq = Nk, else the same band as a bool mask (Nq = 1 sees
    every key either way); ``enable_gqa`` when k has fewer heads than q."""
    Nq, Nk = q.shape[2], k.shape[2]
    kw: dict = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if causal and Nq == Nk:
        kw["is_causal"] = True
    elif causal and Nq > 1:
        kw["attn_mask"] = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq)
    return kw


def step(fn: Callable[[], torch.Tensor], bwd: bool, env: dict[str, str] | None = None
         ) -> Callable[[], None]:
    """A contender's call: set ``env``, run ``fn``, then the backward of its output's sum
    when ``bwd``."""
    def go() -> None:
        os.environ.update(env or {})
        out = fn()
        if bwd:
            out.sum().backward()
    return go


def contenders(q, k, v, *, causal: bool, bwd: bool, compiled: bool, flex_max_n: int,
               variants: tuple[str, ...] = tuple(TILED_VARIANTS)
               ) -> dict[str, Callable[[], None]]:
    """The calls of one round (each a :func:`step`), SDPA first (:func:`sdpa_kwargs`)."""
    def call(backend):
        return lambda: attn.attention(q, k, v, causal=causal, backend=backend)
    Nq, Nk = q.shape[2], k.shape[2]
    kw = sdpa_kwargs(q, k, causal)
    fns = {"sdpa": step(lambda: torch_sdpa(q, k, v, **kw), bwd)}
    for name in ("auto", "fused"):  # under tiled's defaults, should auto take it
        fns[name] = step(call(name), bwd, TILED_VARIANTS["tiled"])
    same = cpu.gemm_engine()[0] == "bmm"  # then "tiled bmm" is the default path again
    for name, env in TILED_VARIANTS.items():
        if name in variants and (compiled or name != "tiled compiled") \
                and not (same and name == "tiled bmm"):
            fns[name] = step(call("tiled"), bwd, env)
    if not bwd and causal and Nq <= flex_max_n and Nq == Nk and not kw.get("enable_gqa"):
        flex = make_forward("flex", causal, Nq, "cpu")
        fns["flex (compiled)"] = step(lambda: flex(q, k, v), bwd)
    return fns


def measure(fns: dict[str, Callable[[], None]], rounds: int) -> dict:
    """Warm up (compiles, first-touch allocations), pick reps for ~50 ms, run the rounds."""
    slowest = 0.0
    for fn in fns.values():
        fn()
        t0 = time.perf_counter()
        fn()
        slowest = max(slowest, time.perf_counter() - t0)
    reps = max(1, round(0.05 / slowest))
    times = paired(fns, rounds, reps)
    return {"rounds": rounds, "reps": reps,
            "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "p90_ms": {n: _quantile(t, 0.9) * 1e3 for n, t in times.items()},
            "ratio": {n: median_ratio(times, "sdpa", n) for n in fns if n != "sdpa"},
            "ratio_p10": {n: _quantile([b / t for b, t in zip(times["sdpa"], times[n])], 0.1)
                          for n in fns if n != "sdpa"}}


def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile of a few samples (linear between order statistics)."""
    return statistics.quantiles(xs, n=10, method="inclusive")[round(q * 10) - 1] \
        if len(xs) > 1 else xs[0]


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[int | None]:
    """A process spinning on one core (the last this process may use) while the block runs:
    the normal state of a user's machine. Yields the core, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    core = cores[-1]

    def pin() -> None:  # in the child, before it execs
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # spinning before the first measurement
        yield core
    finally:
        proc.kill()
        proc.wait(timeout=10)


def markdown(header: dict, rows: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["ratio"]))
    lines = ["# tiled vs torch SDPA on CPU: paired ratios (sdpa time / backend time)", "",
             *report.machine_lines(header, f"; {header['busy']}"),
             f"- shape: {header['shape']}; each round runs every backend in turn, reps calls "
             "each (~50 ms); the ratio is the median over rounds of the in-round ratio "
             "(> 1: faster than SDPA), with its 10th percentile (the slow tail) in brackets; "
             "ms: medians, and the 90th percentile of tiled's; % mm: the matmul-equivalent "
             "rate (4·B·H·Nq·Nk·D forward over the visited scores, ×3.5 with the backward) "
             "over the best dense matmul rate (torch.mm, oneDNN) in this run: "
             + ", ".join(f"{d} {r * 1e3:.0f} GFLOP/s" for d, r in header["matmul_tflops"].items()),
             "- auto: attn.attention as a user calls it (the backend attn.choose's table "
             "prefers); fused: torch's CPU attention kernel per block of attn's plan",
             f"- tiled: the default ({header['tiled_path']}); tiled bmm: ATTN_TILED_GEMM=bmm "
             "(torch.bmm GEMMs, batched over heads); tiled compiled: ATTN_TILED_COMPILE=1 "
             "(per-tile steps compiled by torch.compile, bmm GEMMs)", "",
             "| shape | N | D | dtype | mode | causal | rounds x reps | sdpa ms | tiled ms (p90) | "
             "% mm sdpa / tiled | " + " | ".join(names) + " |",
             "|:--|--:|--:|:--|:--|:--|--:|--:|--:|--:|" + "--:|" * len(names)]
    for r in rows:
        tiled = (f"{r['ms']['tiled']:.1f} ({r['p90_ms']['tiled']:.1f})" if "tiled" in r["ms"]
                 else "—")
        lines.append(f"| {r['shape']} | {r['N']} | {r['D']} | {r['dtype']} | {r['mode']} | "
                     f"{r['causal']} | {r['rounds']} x {r['reps']} | {r['ms']['sdpa']:.1f} | "
                     f"{tiled} | {_fraction(r, 'sdpa')} / {_fraction(r, 'tiled')} | "
                     + " | ".join(f"{r['ratio'][n]:.2f} ({r['ratio_p10'][n]:.2f})"
                                  if n in r["ratio"] else "—" for n in names) + " |")
    return "\n".join(lines) + "\n"


def _fraction(row: dict, name: str) -> str:
    f = row.get("matmul_fraction", {}).get(name)
    return "—" if f is None else f"{f:.0%}"


# --shape: (query rows, kv heads) against N keys; None: as the command line says
SHAPES = {"square": (None, None), "decode": (1, 8), "prefill": (512, 8)}


def _measure_shape(args, B, H, N, D, dtype, mode, causals) -> list[dict]:
    """One row per causal value: every contender on the same q, k, v."""
    bwd = mode == "fwd+bwd"
    g = torch.Generator().manual_seed(N)
    n_q, h_kv = SHAPES[args.shape]
    n_q, h_kv = n_q or N, h_kv or H
    q = torch.randn(B, H, n_q, D, generator=g, dtype=DTYPES[dtype]).requires_grad_(bwd)
    k, v = (torch.randn(B, h_kv, N, D, generator=g, dtype=DTYPES[dtype]).requires_grad_(bwd)
            for _ in range(2))
    variants = tuple(TILED_VARIANTS) if args.shape == "square" else ("tiled",)
    rows = []
    for causal in causals:
        fns = contenders(q, k, v, causal=causal, bwd=bwd, compiled=not args.no_compiled,
                         flex_max_n=args.flex_max_n, variants=variants)
        shape = args.shape if args.shape == "square" else f"{args.shape} Nq={n_q} Hkv={h_kv}"
        rounds = args.repeats or (9 if N <= 2048 else 5 if N <= 4096 else 3)
        row = {"shape": shape, "N": N, "D": D, "dtype": dtype, "B": B, "H": H, "mode": mode,
               "causal": causal, **measure(fns, rounds)}
        # the matmul-equivalent rate (attn.bench.flops) of each contender, as a fraction of
        # the dense matmul rate measured in this run: the physical ceiling on this machine
        flops = attention_flops(B, H, n_q, N, D, mode=mode) * _visited(n_q, N, causal)
        rate = args.matmul_rates.get(dtype)
        row["matmul_fraction"] = {n: flops / (ms * 1e-3) / 1e12 / rate if rate else None
                                  for n, ms in row["ms"].items()}
        rows.append(row)
        print(N, D, dtype, mode, "causal" if causal else "full",
              " ".join(f"{n}:{r:.2f}" for n, r in rows[-1]["ratio"].items()),
              file=sys.stderr, flush=True)
    return rows


def _visited(n_q: int, n_k: int, causal: bool) -> float:
    """The fraction of the Nq x Nk scores a bottom-right causal call visits (1 without)."""
    if not causal:
        return 1.0
    seen = sum(min(n_k, max(0, i + n_k - n_q + 1)) for i in range(n_q))
    return seen / (n_q * n_k)


def matmul_rates(dtypes: list[str], n: int = 2048) -> dict[str, float]:
    """TFLOP/s of an n x n matmul per dtype, the best of torch.mm and (fp32) oneDNN, at the
    current thread count: the dense rate attention's is compared with."""
    rates = {}
    for name in dtypes:
        rates[name] = matmul_tflops("cpu", DTYPES[name], n)
        if name == "float32" and cpu._LINEAR is not None:
            rates[name] = max(rates[name], matmul_tflops("cpu", DTYPES[name], n, mm=cpu.mm_nt))
    return rates


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.device not in (None, "cpu"):
        raise SystemExit("attn: --paired compares tiled's CPU paths with torch SDPA; it runs "
                         "on CPU only (drop --device)")
    for flag in ("backends", "tokens", "width"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"attn: --paired runs a fixed set of contenders at a fixed B and "
                             f"H; --{flag} does not apply")
    square = args.shape == "square"
    B = 1 if args.batch is None else args.batch
    H = (8 if square else 32) if args.heads is None else args.heads
    if not square and args.d == [64]:  # the default: these shapes are D = 128
        args.d = [128]
    default_causal = "both" if square else "true" if args.shape == "prefill" else "false"
    causals = CAUSAL[args.causal or default_causal]
    modes = MODES if args.mode == "both" else (args.mode,)
    header = report.run_header("cpu", argv)
    header.update(shape=f"{', '.join(args.dtype)}, B={B}, H={H}, D={', '.join(map(str, args.d))}",
                  tiled_path=steps_path_reason("cpu"))
    rows = []
    with mock.patch.dict(os.environ), busy_core(args.busy_core) as core:
        # (the contenders' settings end with the run)
        header["busy"] = ("quiet (no load started)" if core is None
                          else f"one core (CPU {core}) kept busy by a spinning process")
        args.matmul_rates = matmul_rates(args.dtype)
        header["matmul_tflops"] = args.matmul_rates
        for dtype, D, N, mode in itertools.product(args.dtype, args.d, args.n or DEFAULT_N,
                                                   modes):
            rows += _measure_shape(args, B, H, N, D, dtype, mode, causals)
    out = args.out or Path("out") / "bench-speed-paired"
    report.write_results(out, header, rows, markdown(header, rows))
    return 0
