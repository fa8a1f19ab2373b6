"""attn's triton kernels against torch's attention on one GPU: ms, TFLOP/s, ratios.

    python scripts/bench_triton.py                       # N = 1k..16k, D = 64, 128, causal both, bf16
    python scripts/bench_triton.py --n 4096 --d 128 --causal true --mode fwd

Competitors, all measured in the same process on the same inputs: torch SDPA with its default
choice and with each backend forced (flash, efficient, cuDNN), FlexAttention (compiled), and
a plain bf16 matmul for the device's ceiling. FLOPs = 4·B·H·Nq·Nk·D forward, halved when
causal, backward 2.5× forward (so fwd+bwd = 3.5×), from attn.bench.flops. Batch and heads
default to B = 16k / N, H = 2048 / D (a fixed number of tokens and model width, as in
FlashAttention's benchmarks). Writes results.json, results.md and PNGs under
benchmarks/results/triton/<device>/ with the device name, versions, date and this command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

import torch  # noqa: E402

BACKENDS = ("triton", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex")
MODES = ("fwd", "fwd+bwd")


@dataclass
class Row:
    backend: str
    mode: str
    B: int
    H: int
    N: int
    D: int
    causal: bool
    dtype: str
    ms: float | None = None
    tflops: float | None = None
    ratio_to_sdpa: float | None = None  # sdpa (default) ms / this ms
    matmul_fraction: float | None = None  # tflops / the plain matmul's TFLOP/s
    skipped: str | None = None


# -- the competitors: each returns a forward callable taking (q, k, v) ----------------------------

def _sdpa(backend: str | None, causal: bool) -> Callable:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
              "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}.get(backend)

    def fwd(q, k, v):
        if forced is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(forced):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fwd


def _flex(causal: bool, N: int, device: str) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                       B=None, H=None, Q_LEN=N, KV_LEN=N, device=device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def make_forward(backend: str, causal: bool, N: int, device: str = "cuda") -> Callable:
    if backend == "triton":
        import attn
        return lambda q, k, v: attn.attention(q, k, v, causal=causal, backend="triton")
    if backend == "flex":
        return _flex(causal, N, device)
    if backend.startswith("sdpa"):
        return _sdpa(None if backend == "sdpa" else backend, causal)
    raise ValueError(f"unknown backend {backend!r}, expected one of {BACKENDS}")


def make_call(backend: str, mode: str, B: int, H: int, N: int, D: int, causal: bool,
              dtype: torch.dtype, device: str = "cuda") -> Callable[[], object]:
    """One timed unit of work on fresh seeded inputs: the forward, or forward + backward."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, device=device, dtype=dtype)
               .requires_grad_(mode == "fwd+bwd") for _ in range(3))
    forward = make_forward(backend, causal, N, device)
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                return forward(q, k, v)
        return fwd
    do = torch.randn(B, H, N, D, generator=g, device=device, dtype=dtype)

    def fwd_bwd():
        out = forward(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)  # no .grad accumulation to time
    return fwd_bwd


# -- the sweep ---------------------------------------------------------------------------------------

def _measure(row: Row, dtype: torch.dtype, repeats: int) -> None:
    from attn.bench.flops import attention_flops
    from attn.bench.timing import benchmark

    try:
        fn = make_call(row.backend, row.mode, row.B, row.H, row.N, row.D, row.causal, dtype)
        t = benchmark(fn, device="cuda", warmup=3, repeats=repeats)
    except torch.cuda.OutOfMemoryError:
        row.skipped = "out of memory"
    except Exception as exc:  # a backend that cannot run this shape says so in the table
        row.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    else:
        row.ms = t.median_ms
        flops = attention_flops(row.B, row.H, row.N, row.N, row.D, causal=row.causal,
                                mode=row.mode)
        row.tflops = flops / (row.ms * 1e-3) / 1e12
    finally:
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> tuple[list[Row], float]:
    from attn.bench.flops import matmul_tflops

    dtype = getattr(torch, args.dtype)
    matmul = matmul_tflops(device="cuda", dtype=dtype, n=8192)
    print(f"{args.dtype} matmul 8192^3: {matmul:.1f} TFLOP/s", flush=True)
    rows = []
    causals = {"false": (False,), "true": (True,), "both": (False, True)}[args.causal]
    modes = MODES if args.mode == "both" else (args.mode,)
    for D in args.d:
        for N in args.n:
            B = args.batch or max(1, args.tokens // N)
            H = args.heads or max(1, 2048 // D)
            for causal in causals:
                for mode in modes:
                    for backend in args.backends:
                        row = Row(backend, mode, B, H, N, D, causal, args.dtype)
                        _measure(row, dtype, args.repeats)
                        rows.append(row)
                        shown = (f"{row.ms:9.3f} ms {row.tflops:7.1f} TFLOP/s" if row.ms
                                 else f"skipped: {row.skipped}")
                        print(f"D={D:<4}N={N:<6}B={B:<3}H={H:<3}causal={causal!s:<6}"
                              f"{mode:<8}{backend:<15}{shown}", flush=True)
    sdpa = {(r.mode, r.N, r.D, r.causal): r.ms for r in rows if r.backend == "sdpa"}
    for r in rows:
        base = sdpa.get((r.mode, r.N, r.D, r.causal))
        if r.ms and base:
            r.ratio_to_sdpa = base / r.ms
        if r.tflops:
            r.matmul_fraction = r.tflops / matmul
    return rows, matmul


# -- reports ---------------------------------------------------------------------------------------

def _meta(args: argparse.Namespace, matmul: float) -> dict:
    import triton
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv), "dtype": args.dtype,
            "matmul_tflops": matmul,
            "flops": "4·B·H·N²·D forward, /2 causal, ×3.5 forward+backward"}


def _markdown(rows: list[Row], meta: dict) -> str:
    lines = [f"# attn triton vs torch attention — {meta['device']}", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"CUDA {meta['cuda']}, {meta['dtype']}. Command: `{meta['command']}`", "",
             f"Plain matmul: {meta['matmul_tflops']:.1f} TFLOP/s. FLOPs: {meta['flops']}. "
             "`vs sdpa` = sdpa (default) ms / this ms (> 1: faster than sdpa).", "",
             "| D | N | B×H | causal | mode | backend | ms | TFLOP/s | % matmul | vs sdpa |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.ms is None:
            lines.append(f"| {r.D} | {r.N} | {r.B}×{r.H} | {r.causal} | {r.mode} | {r.backend} "
                         f"| — | — | — | {r.skipped} |")
            continue
        ratio = f"{r.ratio_to_sdpa:.2f}×" if r.ratio_to_sdpa else "—"
        lines.append(f"| {r.D} | {r.N} | {r.B}×{r.H} | {r.causal} | {r.mode} | {r.backend} "
                     f"| {r.ms:.3f} | {r.tflops:.1f} | {100 * r.matmul_fraction:.0f}% | {ratio} |")
    return "\n".join(lines) + "\n"


def _plots(rows: list[Row], out: Path, meta: dict) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots (pip install 'attn[dev]')", file=sys.stderr)
        return []
    paths = []
    for D in sorted({r.D for r in rows}):
        for mode in sorted({r.mode for r in rows}):
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
            for ax, causal in zip(axes, (False, True)):
                for backend in BACKENDS:
                    pts = [(r.N, r.tflops) for r in rows if r.D == D and r.mode == mode
                           and r.causal == causal and r.backend == backend and r.tflops]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=backend)
                ax.axhline(meta["matmul_tflops"], color="gray", ls="--", label="matmul")
                ax.set(xscale="log", xlabel="N", title=f"causal={causal}")
                ax.set_xticks(sorted({r.N for r in rows}), labels=[str(n) for n in
                                                                     sorted({r.N for r in rows})])
            axes[0].set_ylabel("TFLOP/s")
            axes[0].legend(fontsize=8)
            fig.suptitle(f"{meta['device']} {meta['dtype']} D={D} {mode}")
            path = out / f"tflops_d{D}_{mode.replace('+', '_')}.png"
            fig.savefig(path, dpi=120, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=("false", "true", "both"), default="both")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--tokens", type=int, default=16384, help="B = tokens // N unless --batch")
    p.add_argument("--batch", "-B", type=int, default=None)
    p.add_argument("--heads", "-H", type=int, default=None, help="default 2048 // D")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None,
                   help="default benchmarks/results/triton/<device name>")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_triton: no CUDA device here. The triton kernels and the torch backends "
              "they are compared with (flash, cuDNN, FlexAttention) need a GPU; run this on "
              "a CUDA machine. (The kernels' correctness runs on CPU: "
              "python -m pytest tests/test_triton.py)", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_triton: triton is not installed (pip install 'attn[triton]')",
              file=sys.stderr)
        return 2

    rows, matmul = run(args)
    meta = _meta(args, matmul)
    name = meta["device"].replace(" ", "_").replace("/", "_")
    out = args.out or ROOT / "benchmarks" / "results" / "triton" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "results.md").write_text(_markdown(rows, meta))
    written = [out / "results.json", out / "results.md", *_plots(rows, out, meta)]
    print("wrote " + ", ".join(str(w.relative_to(ROOT) if w.is_relative_to(ROOT) else w)
                               for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
