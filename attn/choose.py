"""What ``backend="auto"`` prefers on a CPU, read from the committed table of measurements
``auto_table.json`` beside this module (``attn bench auto-table`` writes it; docs/design.md,
"Choosing a backend"). Kinds of CPU are told apart by the instruction sets that decide
attention's speed there: ``amx`` (AMX tiles: bf16 GEMMs ~8x fp32's), ``avx512-bf16`` (native
bf16 dot products, e.g. Zen 4), ``avx512`` (AVX-512 without bf16, e.g. Cascade Lake),
``avx2``, ``other``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("auto_table.json")
CLASSES = ("decode", "chunk", "tiny", "small", "dense", "train", "masked")
# Where the table has no entry for this kind of CPU: torch's kernel (fused) for what it
# expresses, except decoding, where tiled's split-KV read the keys faster on every CPU
# measured so far, and small calls, whose many tiny per-sequence kernel calls cost more in
# Python than tiled's batched tiles (docs/benchmarks.md).
FALLBACK = {"decode": "tiled", "chunk": "tiled", "tiny": "tiled", "small": "tiled",
            "dense": "fused", "train": "fused", "masked": "fused"}
SMALL_SCORES = 1 << 14  # query x key pairs per sequence and head up to which a call is small
# query rows below which a small call is tiny: fused's one op call over the batch runs on the
# caller's thread alone there, never on torch's threads (attn.fused._WHOLE_CALL_MIN_ROWS)
SMALL_MIN_Q = 32
CHUNK_MAX_Q = 128  # query rows per head up to which a call against 8x as many keys is a chunk


def cpuinfo(key: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line starting with ``key`` (None off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_kind() -> str:
    """This machine's kind of CPU (``ATTN_CPU_KIND`` overrides it, for tests and to try
    another kind's entries)."""
    forced = os.environ.get("ATTN_CPU_KIND")
    if forced:
        return forced
    flags = set((cpuinfo("flags") or "").split())
    for flag, kind in (("amx_bf16", "amx"), ("avx512_bf16", "avx512-bf16"),
                       ("avx512f", "avx512"), ("avx2", "avx2")):  # the first flag found
        if flag in flags:
            return kind
    cap = torch.backends.cpu.get_cpu_capability().lower()  # non-Linux: torch's own view
    return {"avx512": "avx512", "avx2": "avx2"}.get(cap, "other")


def call_class(n_q: int, n_k: int, grad: bool, masked: bool) -> str:
    """A call's class for the table: ``decode`` (at most 16 query rows per head, no
    gradient), ``chunk`` (a chunked prefill: at most :data:`CHUNK_MAX_Q` query rows against
    at least 8x as many keys, no gradient), ``small`` (at most :data:`SMALL_SCORES` query x
    key pairs; ``tiny`` with fewer than :data:`SMALL_MIN_Q` query rows), ``train`` (a
    gradient will be asked), ``masked`` (a user mask other than key padding, which the fused
    backend takes as a cut of the keys), else ``dense``."""
    if n_q <= 16 and not grad:
        return "decode"
    if n_q <= CHUNK_MAX_Q and n_k >= 8 * n_q and not grad and not masked:
        return "chunk"
    if n_q * n_k <= SMALL_SCORES:
        return "tiny" if n_q < SMALL_MIN_Q else "small"
    if grad:
        return "train"
    return "masked" if masked else "dense"


@functools.cache
def load_table(path: str = str(TABLE_PATH)) -> dict:
    """The committed table: ``{kind: {"cpu": model, "entries": {dtype: {class: {"backend":
    name, "ratio": fused time / tiled time}}}}}``; empty when the file is missing."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def preferred(kind: str, dtype: torch.dtype, cls: str) -> tuple[str, str]:
    """``(backend, why)``: the table's choice between fused and tiled for a call of this
    class and dtype on this kind of CPU, or :data:`FALLBACK`'s where it has none."""
    name = str(dtype).removeprefix("torch.")
    entry = load_table().get(kind, {}).get("entries", {}).get(name, {}).get(cls)
    if entry is None:
        return FALLBACK[cls], f"no measured entry for {cls} {name} on {kind} CPUs (default)"
    return entry["backend"], (f"measured on {kind} ({load_table()[kind].get('cpu', '?')}): "
                              f"{cls} {name} fused/tiled time {entry['ratio']:.2f}")
