"""CPU execution for the tiled backend: which GEMM engine runs the tiles (``ATTN_TILED_GEMM=
auto|onednn|bmm``: torch's ``bmm``, or oneDNN's kernels through
``torch.ops.mkldnn._linear_pointwise`` on the plan's units; docs/design.md, "Engines"), and
the worker pool that runs a call's items (:mod:`attn.workers`, importable from here).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable

import torch
from torch import Tensor

from attn.timing import median_ratio, paired
from attn.workers import (_pool, openmp_threads, run_items, scratch,  # noqa: F401
                          single_thread, workers_for_call)

ENGINES = ("auto", "onednn", "bmm")
# auto takes oneDNN when it runs the calibration GEMMs at least this much faster than bmm
ONEDNN_MIN_SPEEDUP = 1.3


def engine_setting() -> str:
    """``ATTN_TILED_GEMM``: auto (default), onednn or bmm."""
    flag = os.environ.get("ATTN_TILED_GEMM", "auto").strip().lower()
    if flag not in ENGINES:
        raise ValueError(f"ATTN_TILED_GEMM must be one of {', '.join(ENGINES)}, got {flag!r}")
    return flag


def _linear_op() -> Callable | None:
    """oneDNN's fp32 linear (``x @ w.T``), or None where this torch build has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def _row_major(x: Tensor) -> Tensor:
    return x if x.stride() == (x.shape[1], 1) else x.clone(memory_format=torch.contiguous_format)


def mm_nt(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` for 2-D fp32 ``x (M, K)``, ``w (N, K)`` through oneDNN. ``x`` goes in
    row-major (a strided input ran at a third of the speed); ``w`` row-major or
    column-major (``wᵀ`` contiguous: oneDNN packs the weight either way, measured as fast),
    anything else copied. Size-1 dims get plain strides too."""
    if w.stride() != (1, w.shape[0]):
        w = _row_major(w)
    return _LINEAR(_row_major(x), w, None, "none", [], "")


_LINEAR = _linear_op()
_LOCK = threading.Lock()
_RESOLVED: tuple[str, str] | None = None  # auto's (engine, why), measured once


def gemm_engine() -> tuple[str, str]:
    """``(engine, why)``: ``"onednn"`` or ``"bmm"``, and a line saying why."""
    setting = engine_setting()
    if setting == "bmm":
        return "bmm", "ATTN_TILED_GEMM=bmm"
    if _LINEAR is None:
        return "bmm", "this torch build has no oneDNN"
    if setting == "onednn":
        return "onednn", "ATTN_TILED_GEMM=onednn"
    global _RESOLVED
    if _RESOLVED is None:
        with _LOCK:
            if _RESOLVED is None:
                _RESOLVED = _calibrate()
    return _RESOLVED


def _calibrate() -> tuple[str, str]:
    """Time oneDNN against bmm on the unit path's tile GEMMs (256 x 512 scores, D = 64),
    one thread each, interleaved; check oneDNN's product while at it."""
    def run() -> tuple[str, str]:
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(256, 64, generator=g), torch.randn(512, 64, generator=g)
        p, vt = torch.randn(256, 512, generator=g), torch.randn(64, 512, generator=g)
        if not torch.allclose(mm_nt(q, k), q @ k.t(), rtol=1e-4, atol=1e-3):
            return "bmm", "oneDNN's fp32 product disagreed with torch.mm (reduced precision?)"
        fns = {"onednn": lambda: (mm_nt(q, k), mm_nt(p, vt)),
               "bmm": lambda: (torch.mm(q, k.t()), torch.mm(p, vt.t()))}
        paired(fns, rounds=1, reps=4)  # warm-up: oneDNN builds its kernels
        speedup = median_ratio(paired(fns, rounds=6, reps=4), "bmm", "onednn")
        if speedup >= ONEDNN_MIN_SPEEDUP:
            return "onednn", f"auto: oneDNN ran tile GEMMs {speedup:.1f}x as fast as bmm"
        return "bmm", f"auto: oneDNN ran tile GEMMs {speedup:.2f}x as fast as bmm (not enough)"
    try:
        if openmp_threads():
            return _pool(1).submit(run).result()  # one intra-op thread, as items run
        return run()
    except Exception as exc:  # a build whose oneDNN op refuses these shapes: keep bmm
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(f"attn: oneDNN GEMMs could not run ({type(exc).__name__}: {first}); the "
                      f"tiled backend uses torch.bmm", RuntimeWarning, stacklevel=4)
        return "bmm", f"oneDNN failed: {type(exc).__name__}"


