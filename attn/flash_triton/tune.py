"""Autotune configs of the triton kernels, their pruning, and the shared-memory model.

Measured on sm_90 (``attn bench compile``, benchmarks/results/compile-sm90): which tiles x
warps x stages fit the arch's shared memory and which spill registers heavily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton

from attn.flash_triton.kernels import _INTERPRET

def _configs(kind: str) -> list[triton.Config]:
    """BLOCK_M (queries) x BLOCK_N (keys) x warps x stages for one kernel kind."""
    if _INTERPRET:
        # one config, so nothing is benchmarked; the interpreter's cost is per tile, so tiles
        # as large as still give several (and unequal) tiles per row at the test sizes
        bm, bn = (32, 64) if kind == "dkdv" else (64, 32)
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    return gpu_configs(kind)


def gpu_configs(kind: str) -> list[triton.Config]:
    """The configs a GPU launch of ``kind`` chooses from (before ``_prune``)."""
    if kind == "fwd":
        blocks = [(32, 32), (64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]
    elif kind == "dkdv":  # the key block is resident: keep it large, stream small query tiles
        blocks = [(16, 64), (32, 64), (32, 128), (64, 64), (64, 128)]
    else:  # dq, jvp: the query block is resident (jvp's float32 runs 16 x 16, see below)
        blocks = [(64, 16), (64, 32), (128, 32), (64, 64), (128, 64)]
        blocks += [(16, 16)] if kind == "jvp" else []
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn in blocks for w in (4, 8) for s in (2, 3, 4)]


_THIS_DEVICE = object()


def _prune(configs: list[triton.Config], named_args: dict, *, kind: str,
           arch: int | None | object = _THIS_DEVICE, **kwargs) -> list[triton.Config]:
    """The autotuner's pruning hook; ``arch`` (a compute capability) defaults to the
    current device's, and is given explicitly by the ahead-of-time compile checks. A launch
    whose key has a measured best config (:func:`tuned_table`) that pruning keeps runs that
    config without timing any."""
    if arch is _THIS_DEVICE:
        arch = _device_arch()
    args = {**named_args, **kwargs}
    kept = prune_for(configs, args, kind=kind, arch=arch)
    if autotune_off():
        return [min(kept, key=_distance_to_mid)]
    if arch is None:
        return kept
    key = tuned_key(kind, args, arch)
    LAST_KEYS[kind] = key
    # the table's config when pruning keeps it (the rules may have changed since it was measured)
    row = tuned_table().get(key)
    return [c for c in kept if row is not None and config_fields(c) == row["config"]][:1] or kept


# -- the measured table: the best config per launch key, from `attn gpu-check`'s tune stage --

TUNED = Path(__file__).with_name("tuned.json")
# the key each kind's autotuner was last asked to prune for (read by the tune stage, so the
# rows it writes carry the key a launch looks up)
LAST_KEYS: dict[str, str] = {}
_TRITON_MINOR = ".".join(triton.__version__.split(".")[:2])


# The launch arguments the autotuner keys its pick on (besides the tensors' dtypes, which
# triton adds): every argument the pruning rules read, so that no launch reuses a config
# pruned for another (a float mask's tile in shared memory, the heavy scores' spill rules).
AUTOTUNE_KEY = ("TUNE_N", "BLOCK_D", "BLOCK_DV", "BANDED", "VARLEN", "MASK_KIND",
                "HAS_DROPOUT", "SCORE")


def tuned_key(kind: str, args: dict, arch: int) -> str:
    """The table key of a ``kind`` launch with ``args`` on compute capability ``arch``: the
    autotuner's own key (:data:`AUTOTUNE_KEY`, and dQ's Δ pass) with the dtype, the arch and
    triton's major.minor (builds, and so the best config, differ between them)."""
    dtype = str(getattr(args.get("Q"), "dtype", "")).removeprefix("torch.")
    flags = "".join(str(int(bool(f))) for f in args.get("SCORE") or ())
    key = [f"sm{arch}", f"triton{_TRITON_MINOR}", kind, dtype, f"N{args['TUNE_N']}",
           f"D{args['BLOCK_D']}x{args['BLOCK_DV']}", f"banded{int(bool(args.get('BANDED')))}",
           f"varlen{int(bool(args.get('VARLEN')))}", f"mask{int(args.get('MASK_KIND') or 0)}",
           f"dropout{int(bool(args.get('HAS_DROPOUT')))}", f"score{flags or 0}"]
    if "DELTA_PASS" in args:
        key.append(f"delta{int(bool(args['DELTA_PASS']))}")
    return "|".join(key)


def tuned_table() -> dict[str, dict]:
    """key → row of the committed table (``attn gpu-check --adopt`` writes it); empty when
    the file is missing or ``ATTN_TRITON_TUNED=0`` (the tune stage times the autotuner's
    own pick that way). Read at each autotuner miss (a new key: rare, and beside compiling
    its configs the read costs nothing), so an adopted table is seen at once."""
    off = os.environ.get("ATTN_TRITON_TUNED", "1").strip().lower() in ("0", "off", "false", "no")
    if off or not TUNED.exists():
        return {}
    return {row["key"]: row for row in json.loads(TUNED.read_text())["rows"]}


def config_fields(c: triton.Config) -> dict:
    """A config as the table stores it."""
    return {"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": c.kwargs["BLOCK_N"],
            "num_warps": c.num_warps, "num_stages": c.num_stages}


def autotune_off() -> bool:
    """``ATTN_TRITON_AUTOTUNE=0`` (tests/conftest.py sets it on CUDA machines): launch one
    kept config, the one nearest 64 x 64 tiles, 4 warps, 2 stages, instead of compiling and
    timing every kept one per set of variant flags. Not the largest: the shared-memory model
    under-counts some float32 builds (docs/benchmarks.md, "Triton kernels compiled")."""
    return os.environ.get("ATTN_TRITON_AUTOTUNE", "1").strip().lower() in ("0", "off", "false", "no")


def _distance_to_mid(c: triton.Config) -> tuple:
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    return (abs(bm.bit_length() - 7) + abs(bn.bit_length() - 7), c.num_warps != 4,
            abs(c.num_stages - 2))


def _device_arch() -> int | None:
    if _INTERPRET or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


# opt-in shared memory per block by compute capability (sm_86/89 and unknown archs: 99 KiB)
_SMEM_BYTES = {80: 163 * 1024, 87: 163 * 1024, 90: 227 * 1024}


def smem_estimate(kind: str, c: triton.Config, args: dict) -> int:
    """Bytes of shared memory a config needs: the resident tiles, plus one buffer per stage
    of every streamed tile (K/V for fwd and dQ; Q/dO, lse and Δ for dK/dV; the mask tile).
    An upper bound of what triton allocates (checked by tests/test_triton_compile.py against
    the compiler's own figure): sm_90 keeps every stage in shared memory, sm_80 one fewer."""
    bm, bn, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages
    d, dv = args["BLOCK_D"], args["BLOCK_DV"]
    elem = args["Q"].element_size() if hasattr(args.get("Q"), "element_size") else 2
    mask = {0: 0, 1: 1, 2: 4}[args.get("MASK_KIND", 0)] * bm * bn
    if kind == "fwd":
        resident, streamed = bm * d * elem, bn * (d + dv) * elem + mask
    elif kind == "dkdv":
        resident, streamed = bn * (d + dv) * elem, bm * (d + dv) * elem + mask + 8 * bm
    elif kind == "jvp":  # q, q̇ resident; K, K̇, V, V̇ and the mask's tangent streamed
        resident, streamed = 2 * bm * d * elem, 2 * bn * (d + dv) * elem + 2 * mask
    else:  # dq
        resident, streamed = bm * (d + dv) * elem, bn * (d + dv) * elem + mask
    return resident + s * streamed + 1024  # + reduction and layout-conversion scratch


# The pruning rules below keep ptxas under ~1 KiB of spills per thread; the spills each
# one answers: docs/benchmarks.md, "Triton kernels compiled for sm_90".

# dK/dV with dropout, a softcap or an attn_mask holds more per score (the dropout hash, the
# softcap's u and t, the mask tile): tiles up to this BLOCK_M·BLOCK_N·D stay under 1 KiB
_HEAVY_DKDV_MAX_TILE = 32 * 128 * 64

# triton before 3.7 (the GPU image's 3.6) spills more on the heaviest launches
_TRITON_36 = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)


def _spills_heavily(kind: str, c: triton.Config, d: int) -> bool:
    """Configs that ptxas spills more than ~1 KiB of registers per thread for, on sm_90 and
    sm_80 alike (255 registers each): 4 warps holding a 128 x D (>= 128) accumulator in the
    query-resident kernels or a 64 x 128 one in dK/dV, and dK/dV tiles with
    BLOCK_M·BLOCK_N·D past 64·64·128 (at that size, deep pipelines); the slow compile test
    builds every config this keeps."""
    bm, bn, w, s = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
    if kind in ("fwd", "dq", "jvp"):
        return w == 4 and bm * d >= 128 * 128
    tile = bm * bn * d / (64 * 64 * 128)
    return (w == 4 and bn * d >= 64 * 128) or tile > 1 or (tile == 1 and s > (2 if d >= 256 else 3))


# float32 inputs run their dots as exact fp32 FMAs (input_precision "ieee"), not on tensor
# cores, and the product tile then lives in registers: 4 warps spill from D = 128, 8 warps
# stay under ~1.5 KiB up to these BLOCK_M·BLOCK_N·D (past them the smallest 8-warp tile)
_FP32_MAX_TILE = {"fwd": 64 * 32 * 64, "dq": 64 * 16 * 128, "dkdv": 16 * 64 * 128,
                  "jvp": 16 * 16 * 128}


def prune_for(configs: list[triton.Config], args: dict, *, kind: str, arch: int | None
              ) -> list[triton.Config]:
    """The autotune configs worth timing for a ``kind`` ("fwd", "dkdv", "dq", "jvp") launch with
    ``args`` on compute capability ``arch`` (90 for sm_90; None when unknown): drop tiles
    longer than the sequence, configs whose shared memory does not fit the arch, and tiles
    x warps that spill registers heavily (measured: benchmarks/results/compile-sm90).
    float32 keeps 8-warp tiles up to ``_FP32_MAX_TILE``, or where none is that small
    the smallest 8-warp tiles."""
    n, d = args["TUNE_N"], max(args["BLOCK_D"], args["BLOCK_DV"])
    smem = None if arch is None else _SMEM_BYTES.get(arch, 99 * 1024)
    # scores carrying dropout, a softcap (SCORE[0], kernels._SOFTCAP) or an attn_mask
    score = args.get("SCORE") or ()
    heavy = bool(args.get("HAS_DROPOUT") or args.get("MASK_KIND") or (score and score[0]))
    fp32 = getattr(args.get("Q"), "dtype", None) == torch.float32
    # dK/dV's 64 x 128, 8-warp tiles with 2 or 3 stages (wgmma n64 where the kept 32 x 128
    # runs n32): under 1 KiB of spills only as triton 3.6 (the GPU image's) builds them for
    # sm_90 at D = 128, so only dense plain or banded launches there keep them
    wide_dkdv = (kind == "dkdv" and _TRITON_36 and arch == 90 and d == 128 and not heavy
                 and not args.get("VARLEN"))
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if min(bm, bn) > 16 and max(bm, bn) > n:
            continue
        if kind == "fwd" and bm * bn < 64 * 32 and not fp32:
            continue  # 32 x 32 serves float32 only (its 64 x 32 forward spills)
        if smem is not None and smem_estimate(kind, c, args) > smem:
            continue
        wide_tile = wide_dkdv and (bm, bn, c.num_warps) == (64, 128, 8) and c.num_stages <= 3
        if _spills_heavily(kind, c, d) and not wide_tile:
            continue
        if kind == "dkdv" and heavy and (bm * bn * d > _HEAVY_DKDV_MAX_TILE
                                         or c.num_stages > 3):
            continue
        if kind == "jvp" and heavy and d >= 128 and bn > (16 if d >= 256 else 32):
            continue  # the tangent pass's wide key tiles spill
        if _TRITON_36 and heavy and d >= 128 and (
                (kind == "fwd" and bm * bn > 128 * 64) or (kind == "dkdv" and c.num_stages > 2)):
            continue  # triton 3.6 spills more there
        if d >= 256 and (bm * bn > 64 * 64 or c.num_stages > 2):
            continue
        if d >= 128 and bm * bn >= 128 * 128 and c.num_warps < 8:
            continue
        if max(bm, bn) <= 32 and c.num_warps > 4 and not fp32:
            continue
        kept.append(c)
    if fp32:
        small = [c for c in kept if c.num_warps >= 8 and c.kwargs["BLOCK_M"]
                 * c.kwargs["BLOCK_N"] * d <= _FP32_MAX_TILE[kind]]
        if not small:
            wide = [c for c in kept if c.num_warps >= 8] or kept
            least = min((c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in wide), default=0)
            small = [c for c in wide if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] == least]
        kept = small
    return kept or configs[:1]


def pow2(n: int) -> int:
    """``triton.next_power_of_2`` for host code: that one is a constexpr function in newer
    triton, whose call costs more than the arithmetic (several per launch)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code (see :func:`pow2`)."""
    return -(-a // b)


def split_config(block_d: int, block_dv: int, elem: int, rows: int) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps, num_stages of the split-KV kernel (not autotuned: its
    chunks are whole key tiles, so BLOCK_N sets the plan, which must not depend on timing).
    ``rows`` = GQA group x Nq packed into the query block (more rows: several blocks).
    K/V tiles of 16 KiB per stage (bf16 D = 128: 64 keys), so that two stages, the q block
    and a float mask tile fit sm_80's shared memory at every head dim; 8 warps where the
    accumulator would spill with 4 (see ``_spills_heavily``). The interpreter's cost is per
    tile: 32 keys give several tiles per chunk at the test sizes."""
    block_m = max(16, min(64, pow2(rows)))
    width = max(block_d, block_dv)
    block_n = 32 if _INTERPRET else max(16, min(64, (8192 if elem <= 2 else 4096) // width))
    warps = 8 if block_m * width >= 128 * 128 else 4
    return block_m, block_n, warps, 2


def _tune_n(n_q: int, n_k: int) -> int:
    # the autotune key: lengths rounded to a power of two, so varying lengths do not retune
    return pow2(max(n_q, n_k))
