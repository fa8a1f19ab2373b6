"""The ``attn`` command: ``attn report`` (the main job), the ``attn bench`` questions (``attn
bench --help`` lists them), ``attn check`` and ``attn gpu-check``; docs/benchmarks.md,
docs/conformance.md and docs/gpu.md show each in use.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# torch, and every module that imports it, is imported inside the functions that need it:
# `attn --help` and `attn --version` answer from this module alone, in a fraction of the
# second torch takes to import.
if TYPE_CHECKING:
    from attn.bench.sweep import Row, SweepConfig

# the top level, shared by the full parser and the quick one
DESCRIPTION = "Measure attention: correctness, memory and speed by N."
COMMANDS = {
    "report": "check every backend, then sweep memory and speed",
    "bench": "a custom sweep or one of the benchmark questions",
    "check": "run the conformance matrix on your attention function: each case correct, "
             "not supported, wrong (diagnosed) or NaN",
    "gpu-check": "every GPU claim in one run of at most 8 minutes (a correctness smoke, "
                 "speed, memory, variants against flex, decode, tuning), or --dry-run on CPU",
}

# (N values, causal values) per device for the full and the quick report. The quick one is
# sized to finish in about a minute on 2 CPU cores; the full CPU one reaches N = 16384, where
# the reference's N² scores no longer fit and only the O(N) backends run.
_REPORT_N = {("cpu", False): (512, 1024, 2048, 4096, 8192, 16384),
             ("cpu", True): (256, 512, 1024, 2048),
             ("cuda", False): (512, 1024, 2048, 4096, 8192, 16384, 32768),
             ("cuda", True): (512, 1024, 2048, 4096)}


def _top_level() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``attn`` parser with its commands and --version, and each command's parser; alone
    (without their arguments) it answers ``attn``, ``attn --help`` and ``attn --version``."""
    from attn import __version__

    parser = argparse.ArgumentParser(prog="attn", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"attn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    return parser, {name: sub.add_parser(name, help=what) for name, what in COMMANDS.items()}


def _triton_preset(device_name: str) -> dict:
    """``--preset triton`` (its help says what it runs), with an 8192² matmul for the ceiling and
    FlashAttention's fixed 16k tokens and model width 2048 per point."""
    from attn.bench.competitors import COMPETITORS

    folder = device_name.replace(" ", "_").replace("/", "_")
    return dict(device="cuda", n=[1024, 2048, 4096, 8192, 16384], d=[64, 128], causal="both",
                mode="both", dtype=["bfloat16"], backends=["triton", "sdpa", *COMPETITORS],
                tokens=16384, width=2048, repeats=20, warmup=3, matmul_n=8192,
                out=Path.cwd() / "benchmarks" / "results" / "triton" / folder)


# A preset is the defaults of a standing question; every flag given still wins.
PRESETS = {"triton": _triton_preset}


def _add_sweep_args(p: argparse.ArgumentParser, *, report_defaults: bool) -> None:
    from attn.bench.flops import MODES
    from attn.bench.sweep import DTYPES, all_backends

    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for results.json, results.md and the PNGs")
    p.add_argument("--n", type=int, nargs="+", default=None, help="sequence lengths N")
    p.add_argument("--d", type=int, nargs="+", default=[64], help="head dims D")
    p.add_argument("--batch", "-B", type=int, default=None, help="batch B (default 1)")
    p.add_argument("--heads", "-H", type=int, default=None, help="heads H (default 8)")
    p.add_argument("--tokens", type=int, default=None,
                   help="B = tokens // N per point instead of --batch (fixed work per point)")
    p.add_argument("--width", type=int, default=None,
                   help="H = width // D per point instead of --heads")
    p.add_argument("--backends", nargs="+", default=None, choices=all_backends(),
                   help="attn's backends and torch's kernels (sdpa-flash, sdpa-efficient, "
                        "sdpa-cudnn, flex); default: attn's, plus torch's on CUDA")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="side of the square matmul giving the device's TFLOP/s ceiling "
                        "(default 4096 on CUDA, 1024 on CPU)")
    p.add_argument("--causal", choices=("false", "true", "both"), default=None,
                   help="default false (both with --paired)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=tuple(DTYPES))
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (max)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop repeating a point after this many seconds of timed calls")
    p.add_argument("--max-mem-gb", type=float, default=None,
                   help="skip points predicted to need more (default: 60%% of free memory)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run (default: torch's choice)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    if report_defaults:
        p.add_argument("--quick", action="store_true",
                       help="small sizes and few repeats: about 1-2 minutes on 2 CPU cores")
        p.add_argument("--no-checks", action="store_true",
                       help="skip the correctness checks against the reference")
    else:  # users' attention functions measured beside the backends
        p.add_argument("--fn", action="append", default=[], metavar="MODULE:FUNCTION",
                       help="your attention function, measured beside the backends "
                            "(repeatable): mypkg.mod:fn or path/to/file.py:fn. A point where "
                            "it raises is recorded as failed there; the sweep goes on")
        _add_style_args(p, "--fn functions")


def _add_style_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--style`` and ``--layout``: how ``what`` are called (:func:`attn.adapters.adapt`)."""
    from attn.adapters import LAYOUTS, STYLES

    p.add_argument("--style", choices=("auto", *STYLES), default="auto",
                   help=f"how {what} are called: attn (attn.attention's keywords), torch "
                        "(F.scaled_dot_product_attention's), flash (flash_attn_func's), hf (a "
                        "transformers attention interface); default: guessed from each "
                        "signature")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help=f"the layout {what} take q, k, v and give out in (default: the "
                        "style's, bnhd for flash, else bhnd)")


def _functions(args: argparse.Namespace) -> tuple:
    """The ``--fn`` functions, adapted to attn's convention and named as given."""
    from attn.adapters import adapt, load_target

    fns = []
    for spec in getattr(args, "fn", None) or ():
        try:
            fn = adapt(load_target(spec), style=args.style, layout=args.layout, name=spec)
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"attn: --fn {spec}: {exc}") from None
        print(f"attn: --fn {spec}: called in the {fn.style} style ({fn.detected}), "
              f"layout {fn.layout}", file=sys.stderr)
        fns.append(fn)
    return tuple(fns)


def _add_speed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="triton: attn's triton kernels against torch's attention on one GPU "
                        "(N 1k-16k, D 64 and 128, causal both, bf16, B = 16384 // N, "
                        "H = 2048 // D, out benchmarks/results/triton/<GPU>); flags given "
                        "override it")
    p.add_argument("--paired", action="store_true",
                   help="CPU: attn auto, the fused backend, tiled (default, bmm GEMMs, compiled tiled steps) and compiled flex against "
                        "torch SDPA, taking turns round after round; reports the median of the "
                        "in-round ratios (--repeats: rounds, default 9/5/3 by N; --causal "
                        "defaults to both)")
    p.add_argument("--flex-max-n", type=int, default=4096,
                   help="--paired: compiled flex (causal forward) up to this N; its CPU path "
                        "held 24 GB at N=16384 causal")
    p.add_argument("--no-compiled", "--no-fused", dest="no_compiled", action="store_true",
                   help="--paired: leave out the compiled tiled steps (torch.compile; "
                        "--no-fused is its older name)")
    p.add_argument("--busy-core", action="store_true",
                   help="--paired: keep one core busy with a spinning process for the whole "
                        "run (started and stopped here), as on a user's machine")
    p.add_argument("--shape", choices=("square", "decode", "prefill"), default="square",
                   help="--paired: square (B, H, N, N; default), decode (Nq=1 against Nk = "
                        "--n, H=32, Hkv=8, D=128) or prefill (Nq=512 against Nk = --n, "
                        "bottom-right causal, H=32, Hkv=8, D=128); -B/-H/--d override")


def build_parser(preset: dict | None = None) -> argparse.ArgumentParser:
    """The ``attn`` parser; ``preset`` (a :data:`PRESETS` entry's values) replaces the
    defaults of ``attn bench speed``."""
    parser, commands = _top_level()
    _add_sweep_args(commands["report"], report_defaults=True)
    kinds = commands["bench"].add_subparsers(dest="kind", required=True)
    for kind, what in (("memory", "peak bytes above the inputs"), ("speed", "ms and TFLOP/s")):
        _add_sweep_args(kinds.add_parser(kind, help=what), report_defaults=False)
    speed = kinds.choices["speed"]
    _add_speed_args(speed)
    if preset:
        speed.set_defaults(**preset)
    for kind, what in _QUESTIONS.items():
        _question(kind).add_arguments(kinds.add_parser(kind, help=what))
    _add_check_args(commands["check"])
    from attn.bench import gpu_check

    gpu_check.add_arguments(commands["gpu-check"])
    return parser


def _add_check_args(p: argparse.ArgumentParser) -> None:
    from attn.bench.sweep import DTYPES

    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="module:function or path/to/file.py:function (several: one table "
                        "each, and --markdown compares them)")
    _add_style_args(p, "the targets")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                   help="run only these cases (names as in the table)")
    p.add_argument("--quick", action="store_true", help="leave out the N = 1025 cases")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--markdown", type=Path, default=None,
                   help="also write the comparison table (a column per target) to this file")


def run_check(args: argparse.Namespace) -> int:
    """``attn check``: exit 0 when every supported case is correct, 1 otherwise, 2 when a
    target cannot be loaded."""
    import json

    from attn import conformance
    from attn.bench.sweep import DTYPES
    from attn.testing import conformance_cases

    try:
        cases = conformance_cases(args.cases, quick=args.quick)
        results = [conformance.check(t, style=args.style, layout=args.layout,
                                     dtype=DTYPES[args.dtype], device=args.device, cases=cases)
                   for t in args.targets]
    except ValueError as e:
        print(f"attn check: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.as_dict() for r in results] if len(results) > 1
                         else results[0].as_dict(), indent=1))
    else:
        print("\n\n".join(r.table() for r in results))
    if args.markdown is not None:
        args.markdown.write_text(conformance.comparison_markdown(results) + "\n")
    return 0 if all(r.ok for r in results) else 1


# The benchmark questions with a module of their own (attn.bench.<kind, '-' as '_'>), each
# with add_arguments(parser) and run(args, argv), in the order `attn bench --help` lists them.
_QUESTIONS = {
    "compile": "build the Triton kernels for sm_90/sm_80 without a GPU: shared memory, "
               "registers, spills, tensor cores, pipelining",
    "context-parallel": "ring and Ulysses attention over P gloo processes: memory per rank, "
                        "time per step, communication share",
    "auto-table": "fused against tiled per class of call and dtype on this CPU: the measured "
                  "entry backend='auto' reads (attn/auto_table.json)",
    "decode": "one new token against a long KV cache on CPU: attn.attention, or "
              "flash_attn_with_kvcache contiguous and paged (--compat), against torch SDPA",
    "hf": "a transformers Llama on CPU with attn_implementation attn, sdpa and eager: "
          "prefill peak memory and time, decode tokens/s",
    "hf-quant": "greedy-token agreement and logit differences of HF decoders with quantized "
                "KV caches (attn's, quanto's) against fp32; decode step times",
    "kv-accuracy": "the toy GPT's validation loss with its K/V stored in each quantized "
                   "cache format (teacher-forced), and the bytes per token",
    "train-step": "one GPT training step (forward, backward, AdamW) per backend: peak "
                  "memory and time",
}


def _question(kind: str):
    import importlib

    return importlib.import_module(f"attn.bench.{kind.replace('-', '_')}")


def _config(args: argparse.Namespace) -> SweepConfig:
    import torch

    from attn.bench.flops import MODES
    from attn.bench.sweep import CAUSAL, SweepConfig, default_backends

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attn: --device cuda, but torch sees no CUDA device")
    quick = getattr(args, "quick", False)
    kind = torch.device(device).type
    n = tuple(args.n) if args.n else _REPORT_N[(kind, quick)]
    for fixed, per_point in (("batch", "tokens"), ("heads", "width")):
        if getattr(args, fixed) is not None and getattr(args, per_point) is not None:
            raise SystemExit(f"attn: --{fixed} and --{per_point} both set the {fixed}; "
                             "give one")
    return SweepConfig(
        n=n, backends=(*(args.backends or default_backends(device)), *_functions(args)),
        d=tuple(args.d),
        causal=CAUSAL[args.causal or "false"], dtypes=tuple(args.dtype),
        modes=MODES if args.mode == "both" else (args.mode,),
        batch=1 if args.batch is None else args.batch,
        heads=8 if args.heads is None else args.heads, tokens=args.tokens, width=args.width,
        matmul_n=args.matmul_n, device=device,
        measure_memory=args.command == "report" or args.kind == "memory",
        measure_time=args.command == "report" or args.kind == "speed",
        warmup=args.warmup, repeats=args.repeats or (3 if quick else 7),
        min_repeats=1 if quick else 2,
        budget_s=args.budget_s if args.budget_s is not None else (0.5 if quick else 3.0),
        max_bytes=None if args.max_mem_gb is None else int(args.max_mem_gb * 2**30))


def _sweep(cfg: SweepConfig, show_progress: bool, partial: Path, header: dict) -> list[Row]:
    """Run the sweep, printing each point as it finishes (above the progress bar, which
    names the point now running); after each point, rewrite ``partial`` (JSON) so an
    interrupted hour-long sweep still leaves what it measured. The bar is tqdm's, when it is
    installed and wanted and stderr is a terminal (redirected to a file, a bar's redraws
    would interleave with the lines)."""
    from attn.bench import report
    from attn.bench.sweep import plan, run_sweep

    rows = plan(cfg)
    bar = None
    if show_progress and sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            bar = tqdm(total=len(rows), unit="pt", file=sys.stderr, dynamic_ncols=True)
    if bar is not None and rows:
        bar.set_description(rows[0].label())
    done = []
    for r in run_sweep(cfg, rows):
        done.append(r)
        line = f"[{len(done)}/{len(rows)}] {r.line()}"
        if bar is not None:
            bar.write(line, file=sys.stderr)
            if len(done) < len(rows):  # the slow points take minutes: say which one runs
                bar.set_description(rows[len(done)].label(), refresh=False)
            bar.update()
        else:
            print(line, file=sys.stderr, flush=True)
        report.write_json(partial, {**header, "partial": True}, done)
    if bar is not None:
        bar.close()
    return done


def _checks(device: str, backends: tuple[str, ...]) -> list:
    """The correctness checks, their table printed row by row as each one finishes."""
    from attn.bench import report

    print("## Correctness against the float64 reference\n")
    print("\n".join(report.CHECKS_HEAD), flush=True)

    def show(check) -> None:
        if check.status != "skipped":
            print(report.check_row(report.asdict(check)), flush=True)

    checks = report.run_checks(device, backends, on_check=show)
    notes = report.skipped_notes([report.asdict(c) for c in checks])
    print("".join(f"\n{n}" for n in notes) + "\n", flush=True)
    return checks


def run(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from attn.bench import plots, report
    from attn.bench.sweep import finish, measure_matmul_rates

    cfg = _config(args)
    out = args.out or Path("out") / ("report" if args.command == "report" else
                                     f"bench-{args.kind}")
    t0 = time.perf_counter()
    # made before anything runs, so its load average is the other processes', not this run's
    header = report.make_header(cfg, argv)
    print(f"attn {args.command}{' ' + args.kind if args.command == 'bench' else ''}: "
          f"{header['device_name']} ({cfg.device}), torch {torch.__version__}",
          file=sys.stderr)
    warning = report.load_warning(header)
    if warning:
        print(f"attn: warning: {warning}", file=sys.stderr)

    checks = []
    if args.command == "report" and not args.no_checks:
        checks = _checks(cfg.device, cfg.backends)
    rates = measure_matmul_rates(cfg) if cfg.measure_time else {}
    header["matmul_tflops"] = rates
    partial = out / "results.partial.json"
    rows = _sweep(cfg, not args.no_progress, partial, header)
    partial.unlink(missing_ok=True)
    if cfg.measure_time:
        # again after the sweep, keeping the faster: on a shared machine one reading can
        # land in a busy moment, and the ceiling should be the device's, not the moment's
        after = measure_matmul_rates(cfg)
        rates = {k: max(v, after.get(k, 0.0)) for k, v in rates.items()}
    rows = finish(rows, rates)

    header["matmul_tflops"] = rates
    header["elapsed_s"] = round(time.perf_counter() - t0, 1)
    row_dicts = [r.as_dict() for r in rows]
    check_dicts = [report.asdict(c) for c in checks]
    report.write_json(out / "results.json", header, rows, checks)
    pngs = [] if args.no_plots else plots.write_plots(row_dicts, out, header)
    report.write_markdown(out / "results.md", header, row_dicts, check_dicts,
                          [str(p) for p in pngs])

    print()
    print(report.header_text(header))
    if checks:
        print(report.checks_summary(check_dicts) + "\n")
    print(report.markdown_tables(row_dicts))
    if args.command == "report":
        print("## Conclusion\n\n" + "\n".join(report.conclusion(header, row_dicts,
                                                                   check_dicts)) + "\n")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}"
          + "".join(f", {p}" for p in pngs) + f" in {header['elapsed_s']} s")
    failed = [c for c in checks if c.status == "failed"]
    for c in failed:
        print(f"FAILED check: {c.backend} {c.shape} causal={c.causal}\n{c.message}",
              file=sys.stderr)
    for r in rows:
        if r.status in ("error", "failed"):
            print(f"{r.status.upper()} at {r.label()}: {r.note}", file=sys.stderr)
    # a user's function failing at a point is its result, not a failure of this run
    return 1 if failed or any(r.status == "error" for r in rows) else 0


def parse_args(argv: list[str], device_name: str | None = None) -> argparse.Namespace:
    """Parse ``argv``; with ``--preset``, its values are the defaults of ``attn bench speed``
    (``device_name`` names the preset's output folder, default: this machine's GPU)."""
    plain = build_parser().parse_args(argv)
    name = getattr(plain, "preset", None)
    if name is None:
        return plain
    import torch

    from attn.bench import report
    if getattr(plain, "paired", False):
        raise SystemExit("attn: --preset and --paired are two different questions; give one")
    if device_name is None:
        device_name = report.device_name("cuda") if torch.cuda.is_available() else "no GPU"
    args = build_parser(PRESETS[name](device_name)).parse_args(argv)
    # the preset sizes each point by fixed work; a batch or head count given by hand wins
    if plain.batch is not None and plain.tokens is None:
        args.tokens = None
    if plain.heads is not None and plain.width is None:
        args.width = None
    return args


def _triton_missing() -> str | None:
    """Why ``--preset triton`` cannot run here, else None."""
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA device here. The triton kernels and the torch backends they are "
                "compared with (flash, cuDNN, FlexAttention) need a GPU; run this on a CUDA "
                "machine. (The kernels' correctness runs on CPU: "
                "python -m pytest tests/test_triton.py)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'attn[triton]')"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        _top_level()[0].parse_args(argv)  # prints the help, the version or the usage error
    first = build_parser().parse_args(argv)
    if first.command == "bench" and first.kind == "speed" and first.preset == "triton":
        why = _triton_missing()
        if why is not None:
            print(f"attn bench speed --preset triton: {why}", file=sys.stderr)
            return 2
    if first.command == "check":
        return run_check(first)
    if first.command == "gpu-check":
        from attn.bench import gpu_check

        return gpu_check.run(first, argv)
    args = parse_args(argv)
    if getattr(args, "threads", None) is not None:  # every question's --threads
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "bench" and args.kind == "speed" and args.paired:
        if args.fn:
            raise SystemExit("attn: --fn joins the sweep, not --paired; leave one out")
        from attn.bench import paired

        return paired.run(args, argv)
    if args.command == "bench" and args.kind in _QUESTIONS:
        return _question(args.kind).run(args, argv)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
