"""The per-tile steps of the online softmax (forward update, backward dS), each in exactly one
place, and the compiled tiled steps: the same steps compiled by torch.compile on CPU."""

from __future__ import annotations

import os
import types
import warnings
from typing import Callable

import torch
from torch import Tensor

from attn.tiled import cpu

# -- per-tile steps: the online-softmax update and dS, each in exactly one place ------------

# exp2_ sends every element through torch's vector loop, whose scalar tail rounds some values
# differently (docs/design.md, "Base-2 scores"): a multiple of the loop's width for float32
# and float64 on every x86 CPU
_EXP2_VECTOR = 64


def exp2_(x: Tensor) -> Tensor:
    """``x.exp2_()``, each element computed as in the middle of a long contiguous loop, so
    its bits depend on its value alone. A non-contiguous ``x`` runs row by row (each row's
    tail the same wherever the row sits), as torch does; so does a traced call (a branch on
    the length would recompile per sequence length)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not x.is_contiguous():
        return x.exp2_()
    n = x.numel()
    r = n % _EXP2_VECTOR
    if r == 0:
        return x.exp2_()
    flat = x.view(-1)
    if n > r:
        flat[:n - r].exp2_()
    tail = flat.new_zeros(_EXP2_VECTOR)
    tail[:r] = flat[n - r:]
    flat[n - r:] = tail.exp2_()[:r]
    return x


def _fwd_tile(m_i: Tensor, l_i: Tensor, s: Tensor, z: Tensor | None, c: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One key tile of the forward (Triton's ``_fwd_inner`` body, up to the P·V GEMM): the
    new row max, ``p = exp2(s - m_new)``, the rescale ``alpha`` of the old state and the new
    denominator. Returns ``(p, m_new, l_new, alpha)``; the caller does
    ``acc ← alpha·acc + p V``. ``s`` is consumed (overwritten by p), ``l_i`` updated in
    place; ``z`` is the dropout scale (values only); ``c`` the tile's value offset
    (:meth:`_Tile.value_offset`), added to its row max."""
    m_tile = s.amax(dim=-1, keepdim=True)
    if c is not None:
        m_tile.add_(c.expand(-1, m_tile.shape[1], -1))
    m_new = torch.maximum(m_i, m_tile)
    p = exp2_(s.sub_(m_new))
    alpha = exp2_(m_i - m_new)
    l_i = l_i.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
    if z is not None:  # the denominator counts every key, the values only the kept ones
        p.mul_(z)
    return p, m_new, l_i, alpha


def _bwd_tile(s: Tensor, u: Tensor | None, t: Tensor | None, lse_blk: Tensor,
              delta_blk: Tensor, dp: Tensor, z: Tensor | None,
              need_dc: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One tile of the backward (Triton's ``_dkdv_inner`` / ``_dq_inner`` body): recompute
    P from lse, then ``dS = P ∘ (dP − Δ)`` with ``dP = dO Vᵀ`` given (consumed). Returns
    ``(pd, ds, ds_capped, dc_terms)``: P with dropout applied (for dV), dS before and after
    the softcap chain rule (dS feeds a float mask's gradient; the capped one feeds dQ, dK),
    and the softcap gradient's terms."""
    p = exp2_(s.sub_(lse_blk))  # (B·Hkv, G·BM, BN), s and lse in base-2 units
    # -- dropout scales P for dV and dP alike (ᵈ) --
    pd = p
    if z is not None:
        pd = p * z
        dp.mul_(z)
    # -- dS = P ∘ (dP − Δ) --
    ds = dp.sub_(delta_blk).mul_(p)
    return (pd, ds) + _softcap_chain(ds, u, t, need_dc)


def _softcap_chain(ds: Tensor, u: Tensor | None, t: Tensor | None, need_dc: bool
                   ) -> tuple[Tensor, Tensor | None]:
    """dS before the softcap and the softcap gradient's terms (both steps share it)."""
    if t is None:
        return ds, None
    # s = c·tanh(u), u = s_raw/c: ds_raw = ds·(1 − t²); dc = Σ ds·(t − u(1 − t²))
    one_m_t2 = 1.0 - t * t
    dc_terms = ds * (t - u * one_m_t2) if need_dc else None
    return ds * one_m_t2, dc_terms


# -- the compiled tiled steps: the same two steps, compiled (docs/design.md, "The fused path")
# The GEMMs stay eager. Shapes are symbolic (dynamic=True: measured as fast as static ones),
# so lengths, edge tiles and batch sizes never recompile; each combination of dtype, step
# variant and size-1 dims compiles once per process, in a code object of its own.

def _fwd_tile_compiled(m_i: Tensor, l_i: Tensor, s: Tensor, z: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_fwd_tile` without the P·V GEMM, functional (for torch.compile): returns
    ``(p, m_new, l_new, alpha)``; ``acc ← alpha·acc + p V`` stays with the caller."""
    m_new = torch.maximum(m_i, s.amax(dim=-1, keepdim=True))
    p = torch.exp2(s - m_new)
    alpha = torch.exp2(m_i - m_new)
    l_new = l_i * alpha + p.sum(dim=-1, keepdim=True)
    if z is not None:
        p = p * z
    return p, m_new, l_new, alpha


def _bwd_tile_compiled(s: Tensor, dp: Tensor, u: Tensor | None, t: Tensor | None, lse_blk: Tensor,
                    delta_blk: Tensor, z: Tensor | None, need_dc: bool
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`_bwd_tile` after the dP GEMM, functional (for torch.compile)."""
    p = torch.exp2(s - lse_blk)
    pd = p
    if z is not None:
        pd = p * z
        dp = dp * z
    ds = p * (dp - delta_blk)
    return (pd, ds) + _softcap_chain(ds, u, t, need_dc)


_COMPILED: dict[str, Callable] = {}
_COMPILED_FAILED: str | None = None  # why the compiled steps are off, once they failed


def compiled_steps_default() -> bool:
    """Whether the compiled tiled steps are on: ``ATTN_TILED_COMPILE=0|1``, read at each call."""
    flag = os.environ.get("ATTN_TILED_COMPILE", "1" if COMPILED_DEFAULT else "0").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"ATTN_TILED_COMPILE must be 0 or 1, got {flag!r}")
    return flag == "1"


# Chosen by measurement (benchmarks/results/cpu/, README "CPU speed").
COMPILED_DEFAULT = False


def steps_path_reason(device: torch.device | str) -> str:
    """Which tiled path a call on ``device`` will try, for :func:`attn.select_backend`: the
    per-tile steps (eager or compiled) and the GEMM engine."""
    if torch.device(device).type != "cpu":
        return "eager tiled steps (the compiled steps are CPU only)"
    if not compiled_steps_default():
        steps = "eager tiled steps (ATTN_TILED_COMPILE=0)"
    elif _COMPILED_FAILED is not None:
        steps = f"eager tiled steps (the compiled steps failed earlier: {_COMPILED_FAILED})"
    else:
        return "compiled tiled steps (torch.compile, ATTN_TILED_COMPILE=1); GEMMs: torch.bmm"
    if torch.compiler.is_compiling():  # traced into a graph: no worker threads, no timing
        return f"{steps}; GEMMs: torch.bmm (under torch.compile)"
    engine, why = cpu.gemm_engine()
    if engine == "onednn":
        return (f"{steps}; GEMMs: oneDNN, head by head, for large fp32 calls ({why}), "
                f"torch.bmm for the rest")
    return f"{steps}; GEMMs: torch.bmm ({why})"


def _compiled_steps(q: Tensor) -> bool:
    """Whether this call's full-size tiles take the compiled steps."""
    return (q.device.type == "cpu" and _COMPILED_FAILED is None and compiled_steps_default()
            and not torch.compiler.is_compiling())


def _compiled(fn: Callable, key: tuple) -> Callable:
    if key not in _COMPILED:
        # a copy of fn with its own code object: dynamo keeps its graphs per code object
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_COMPILED)}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)
        _COMPILED[key] = torch.compile(copy, dynamic=True, fullgraph=True)
    return _COMPILED[key]


def _compilable(s: Tensor) -> bool:
    """A tile with one row or one column (decoding, N ≡ 1 mod the block) stays eager: it is
    tiny, and a size-1 dim would make dynamo build one more graph."""
    return s.shape[1] > 1 and s.shape[2] > 1


def _run_compiled(fn: Callable, *args):
    """``fn(*args)`` compiled, or None when compiling or running it fails: then the compiled
    path is switched off with one warning and the caller runs the eager step. The compiled
    functions are functional, so a failed call changed nothing."""
    global _COMPILED_FAILED
    if _COMPILED_FAILED is not None:  # failed on an earlier tile of this call
        return None
    # contiguous inputs: a stride that follows N (a row slice of lse) would recompile
    args = tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)
    # what makes dynamo build another graph: tensor or None, dtype, size-1 dims, flags
    key = (fn.__name__,) + tuple(
        (a.dtype, tuple(d == 1 for d in a.shape)) if isinstance(a, Tensor) else a
        for a in args)
    try:
        if key in _COMPILED:
            return _COMPILED[key](*args)
        # first call: dynamo traces here. Without duck shaping, two dims that happen to be
        # equal on this call (BLOCK_M rows and BLOCK_N columns) get their own symbols, so a
        # ragged edge tile later does not fail a "rows == cols" guard and recompile
        from torch.fx.experimental import _config as fx_config
        with fx_config.patch(use_duck_shape=False):
            return _compiled(fn, key)(*args)
    except Exception as exc:  # no C++ compiler, an inductor error: eager is always exact
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        _COMPILED_FAILED = f"{type(exc).__name__}: {first}"
        warnings.warn(f"attn: the compiled tiled steps could not run "
                      f"({_COMPILED_FAILED}); using the eager tiled path for the rest of this "
                      f"process. Set ATTN_TILED_COMPILE=0 to silence this.", RuntimeWarning,
                      stacklevel=3)
        return None

