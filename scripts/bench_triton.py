"""attn's triton kernels against torch's attention on one GPU: ms, TFLOP/s, ratios.

    python scripts/bench_triton.py                       # N = 1k..16k, D = 64, 128, causal both, bf16
    python scripts/bench_triton.py --n 4096 --d 128 --causal true --mode fwd

A preset of ``attn bench speed --device cuda`` (attn.bench does the measuring and writes the
report): triton against torch SDPA with its default choice and with each kernel forced (flash,
efficient, cuDNN), compiled FlexAttention, and a plain 8192² matmul for the device's ceiling,
all in the same process on the same inputs. FLOPs = 4·B·H·Nq·Nk·D forward, halved when
causal, backward 2.5× forward. Batch and heads default to B = 16k / N, H = 2048 / D (a fixed
number of tokens and model width, as in FlashAttention's benchmarks). Writes results.json,
results.md and PNGs under benchmarks/results/triton/<device>/ with the device name, versions,
date and the equivalent ``attn`` command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled

import torch  # noqa: E402

from attn.bench.competitors import COMPETITORS  # noqa: E402
from attn.bench.flops import MODES  # noqa: E402

BACKENDS = ("triton", "sdpa", *COMPETITORS)
MATMUL_N = 8192


def build_parser() -> argparse.ArgumentParser:
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
    return p


def attn_argv(args: argparse.Namespace, device_name: str) -> list[str]:
    """The ``attn bench speed`` command line this script stands for."""
    out = args.out or ROOT / "benchmarks" / "results" / "triton" / \
        device_name.replace(" ", "_").replace("/", "_")
    argv = ["bench", "speed", "--device", "cuda", "--n", *map(str, args.n),
            "--d", *map(str, args.d), "--causal", args.causal, "--mode", args.mode,
            "--dtype", args.dtype, "--backends", *args.backends,
            "--repeats", str(args.repeats), "--warmup", "3", "--matmul-n", str(MATMUL_N),
            "--out", str(out)]
    argv += ["--batch", str(args.batch)] if args.batch else ["--tokens", str(args.tokens)]
    argv += ["--heads", str(args.heads)] if args.heads else ["--width", "2048"]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
    from attn.bench.cli import main as attn_main

    return attn_main(attn_argv(args, torch.cuda.get_device_name()))


if __name__ == "__main__":
    sys.exit(main())
