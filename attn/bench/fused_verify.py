"""Verify the fused backend's CUDA ops against the float64 reference, and write the table
``auto`` reads (``attn/fused_cuda_table.json``, see :mod:`attn.fused_cuda`; docs/gpu.md).

Each op runs :data:`CASES` with every piece on it (:func:`attn.fused_cuda.force_op`). The
fused backend calls torch's op once per (sequence, kv head, piece) where triton launches one
kernel, so an exact row is also timed against triton (``speedup_vs_triton``; ``auto`` takes
the op only where it is at least 1, :func:`attn.fused_cuda.verified_op`).
"""

from __future__ import annotations

import time
import traceback
from functools import partial
from pathlib import Path

import torch

from attn import fused_cuda
from attn.api import attention
from attn.bench import gpu_record, report
from attn.testing import compare_to_reference
from attn.timing import median_ratio, paired

SPEED_SHAPE = (4, 16, 4, 2048, 2048)  # B, H, Hkv, Nq, Nk: causal, fwd+bwd

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (64, 128)

# name: (B, H, Hkv, Nq, Nk), keywords (sinks / attn_mask: True, filled in per call)
CASES = {
    "plain_gqa": ((2, 8, 2, 300, 300), {}),
    "causal_bottom_right": ((1, 4, 4, 200, 333), {"causal": True}),
    "window": ((1, 4, 2, 300, 300), {"causal": True, "window": (64, 0)}),
    "sinks_lse": ((1, 4, 2, 129, 129), {"causal": True, "sinks": True}),
    "bool_mask_hidden_row": ((1, 4, 2, 96, 160), {"attn_mask": True}),
}


def _inputs(shape, D, dtype, device, seed):
    B, H, Hkv, Nq, Nk = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(device, dtype)
               for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
    return q, k, v, g


def verify_one(op: str, dtype: torch.dtype, head_dim: int, device: str = "cuda", *,
               speed: bool = True) -> dict:
    """One table row: the op's key, whether every case is within budget, the worst
    error / budget ratio per case, the first error raised, and (``speed``, exact rows) the
    speedup over triton."""
    dev = torch.device(device)
    row = {"key": fused_cuda._key(op, dtype, head_dim, dev), "op": op,
           "dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim,
           "torch": torch.__version__, "device": report.device_name(device),
           "date": time.strftime("%Y-%m-%d"), "cases": {}, "exact": True, "error": None}
    with fused_cuda.force_op(op):
        for i, (name, (shape, kw)) in enumerate(CASES.items()):
            if kw.get("attn_mask") and not fused_cuda.can_run(op, dtype, head_dim, True):
                continue
            q, k, v, g = _inputs(shape, head_dim, dtype, device, seed=i)
            kw = dict(kw)
            if kw.get("sinks"):
                kw["sinks"] = torch.randn(shape[1], generator=g).to(device).requires_grad_()
            if kw.get("attn_mask"):
                keep = torch.rand(shape[0], shape[1], shape[3], shape[4], generator=g) > 0.3
                keep[:, :, 7] = False  # a row that sees no key: zeros, lse -inf
                kw["attn_mask"] = keep.to(device)
            try:
                rep = compare_to_reference(partial(attention, backend="fused"), q, k, v,
                                           check_lse=True, **kw)
            except Exception as exc:  # recorded: the op is not verified for this row
                row["exact"] = False
                row["error"] = row["error"] or f"{name}: {type(exc).__name__}: {exc}"[:500]
                row["cases"][name] = None
                row["traceback"] = traceback.format_exc(limit=4)[-2000:]
                continue
            row["cases"][name] = round(rep.worst, 4)
            row["exact"] = row["exact"] and rep.ok
        if row["exact"] and speed:
            row["speedup_vs_triton"] = _speedup(dtype, head_dim, device)
    return row


def _speedup(dtype: torch.dtype, head_dim: int, device: str) -> float | None:
    """Median over interleaved rounds of triton's time / fused's on :data:`SPEED_SHAPE`
    (the op forced by the caller), or None off CUDA or where triton cannot run the call."""
    if torch.device(device).type != "cuda":
        return None
    q, k, v, _ = _inputs(SPEED_SHAPE, head_dim, dtype, device, seed=99)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step(backend):
        def run():
            out = attention(q, k, v, causal=True, backend=backend)
            out.backward(torch.ones_like(out))
        return run

    fns = {"triton": step("triton"), "fused": step("fused")}
    try:
        for fn in fns.values():  # warm up (and compile triton's kernels)
            fn()
            fn()
    except (NotImplementedError, ImportError, RuntimeError):
        return None
    times = paired(fns, rounds=5, device=device)
    return round(median_ratio(times, "triton", "fused"), 3)


def _keys(ops, dtypes, head_dims):
    """(op, dtype, head dim) for every op, dtype and head dim the op takes, in that order."""
    return [(op, dtype, d) for op in ops for dtype in dtypes for d in head_dims
            if fused_cuda.can_run(op, dtype, d, False)]


def _describe(row: dict) -> str:
    return (f"{row['key']}: {'exact' if row['exact'] else 'NOT exact'} "
            f"{row['cases']}{' ' + row['error'] if row['error'] else ''}")


def verify(device: str = "cuda", ops=fused_cuda.OPS, dtypes=DTYPES, head_dims=HEAD_DIMS,
           log=print, speed: bool = True) -> list[dict]:
    """Every (op, dtype, head dim) the op takes, each :func:`verify_one`."""
    rows = []
    for op, dtype, d in _keys(ops, dtypes, head_dims):
        rows.append(verify_one(op, dtype, d, device, speed=speed))
        log(_describe(rows[-1]))
    return rows


ABOUT = ("torch's fused CUDA ops verified exact by attn gpu-check's fused stage "
         "(attn/bench/fused_verify.py); auto takes the fused backend on CUDA only for a row "
         "here with exact = true")


def write_table(rows: list[dict], path: Path | str | None = None) -> dict:
    """Merge ``rows`` into the table at ``path`` (default the committed one, ``auto``'s) by
    key (:func:`attn.bench.gpu_record.merge_rows`)."""
    return gpu_record.merge_rows(fused_cuda.TABLE if path is None else path, rows, ABOUT)


SPEED_MIN_S = 20  # a speed row below this much box left would be cut mid-way: dropped


def stage(ctx) -> None:
    """``attn gpu-check``'s fused stage (docs/gpu.md): :func:`verify_one` for every (op, dtype,
    head dim), then each exact row's speed (bf16 and D = 128 first: triton autotunes once per
    pair, every op reuses it). A dry run verifies one op and writes only beside the results."""
    if ctx.dry_run and not torch.cuda.is_available():
        ctx.dropped("fused CUDA verification", "no GPU: the dry run only rehearses it")
        return
    device = "cuda"
    ops, dtypes, dims = ((("efficient",), (torch.bfloat16,), (64,)) if ctx.dry_run
                         else (fused_cuda.OPS, DTYPES, HEAD_DIMS))
    paths = [Path(ctx.out) / "fused_cuda_table.json"] + ([] if ctx.dry_run
                                                           else [fused_cuda.TABLE])
    rows: list[dict] = []

    def save() -> None:
        for path in paths:
            write_table(rows, path)

    for op, dtype, d in _keys(ops, dtypes, dims):
        what = f"fused {op} {str(dtype).removeprefix('torch.')} D={d}"
        if ctx.left() < 5:
            ctx.dropped(what, "the stage's box ran out")
            continue
        ctx.running(what)
        row = verify_one(op, dtype, d, device, speed=False)
        ctx.log(_describe(row))
        ctx.row(backend="fused", op=op, dtype=row["dtype"], D=d, exact=row["exact"],
                cases=row["cases"], error=row["error"])
        rows.append(row)
        save()
    order = {str(t).removeprefix("torch."): i for i, t in enumerate(DTYPES)}
    for row in sorted((r for r in rows if r["exact"]),
                      key=lambda r: (order[r["dtype"]], -r["head_dim"])):
        what = f"fused {row['op']} {row['dtype']} D={row['head_dim']} speed"
        if ctx.left() < SPEED_MIN_S:
            ctx.dropped(what, "the stage's box ran out (the row stays without a speed)")
            continue
        ctx.running(what)
        with fused_cuda.force_op(row["op"]):
            row["speedup_vs_triton"] = _speedup(getattr(torch, row["dtype"]),
                                                row["head_dim"], device)
        ctx.log(f"{row['key']}: {row['speedup_vs_triton']}x triton's speed")
        ctx.row(kind="fused-speed", backend="fused", op=row["op"], dtype=row["dtype"],
                D=row["head_dim"], speedup_vs_triton=row["speedup_vs_triton"])
        save()
