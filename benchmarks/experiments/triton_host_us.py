"""Experiment (issue 39, "host work per call measured and cut"): the host time of one
``attn.attention(..., backend="triton")`` call with every triton kernel launch stubbed out,
so what is left is attn's own Python: argument checks, the call plan, the custom ops and
their dispatch, the autograd Function, allocating outputs and building launch arguments.

Runs without a GPU (tensors on CPU; the kernels are never launched, so the Triton
interpreter is only imported, never run) and on one (CUDA tensors, the same stubs). Prints
the median µs per call of interleaved rounds for a forward without grad, a forward with
grad, and forward + backward, then a cProfile table of the heaviest functions::

    python benchmarks/experiments/triton_host_us.py            # this machine's CPU
    python benchmarks/experiments/triton_host_us.py --profile 25

Kernel time is not in these numbers: on a GPU they are what each call adds before (and
between) its launches while the GPU may sit idle, the ``c`` of a fit time = c + g·N.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the device checks

import attn  # noqa: E402
from attn.flash_triton import launch, split  # noqa: E402


class _Stub:
    """Stands in for a triton kernel: ``kernel[grid](*args)`` does nothing."""

    best_config = None

    def __init__(self, kernel) -> None:
        self.configs = getattr(kernel, "configs", [])  # what the launchers read of a tuner

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> list[str]:
    """Every triton kernel the launchers call, replaced by :class:`_Stub`."""
    names = []
    for mod in (launch, split):
        for name, obj in list(vars(mod).items()):
            # jit functions, autotuners and (without a GPU) the interpreter's functions
            if type(obj).__module__.startswith("triton.runtime") and hasattr(obj, "run"):
                setattr(mod, name, _Stub(obj))
                names.append(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}")
    return names


def cases(device: str, B: int, H: int, N: int, D: int, dtype) -> dict:
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attn.attention(q, k, v, causal=True, backend="triton")

    def fwd_grad():
        attn.attention(qg, kg, vg, causal=True, backend="triton")

    def fwd_bwd():
        out = attn.attention(qg, kg, vg, causal=True, backend="triton")
        torch.autograd.grad(out, (qg, kg, vg), do)

    return {"fwd (no grad)": fwd, "fwd (grad on)": fwd_grad, "fwd+bwd": fwd_bwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200, help="calls per case per round")
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 2, 16, 16],
                    metavar=("B", "H", "N", "D"))
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="also print the K heaviest functions of each case (cProfile)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stubbed = stub_kernels()
    fns = cases(device, *args.shape, torch.bfloat16)
    for fn in fns.values():  # first calls: imports, caches
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"torch {torch.__version__}, {device}, host CPU {cpu}; {len(stubbed)} kernels "
          f"stubbed; B, H, N, D = {args.shape}, bf16, causal; median of {args.rounds} "
          f"rounds of {args.calls} calls")
    print("| case | µs per call (median) | min |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.0f} | {min(ts):.0f} |")
    if args.profile:
        for name, fn in fns.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            print(f"\n== {name}: cumulative, {args.calls} calls")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
