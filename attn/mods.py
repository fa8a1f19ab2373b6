"""score_mod / mask_mod helpers the core needs: the tensors a mod captures, the block
classification of a mask_mod, and the spec of a call with mods; shared ground below the entry
points (docs/design.md, "The layers"), :mod:`attn.flex` re-exports the public ones.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from attn.masks import EMPTY, FULL, PARTIAL, Blocks, classify_grid
from attn.spec import LaunchSpec

__all__ = ["captured_tensors", "mask_mod_blocks", "mask_mod_kinds", "mod_spec", "reachable_tensors",
           "union_blocks"]

# mask_mod is evaluated on at most this many (b, h, i, j) elements at once while classifying
_CLASSIFY_CHUNK = 1 << 22


# -- the tensors a mod captures -------------------------------------------------------------

def reachable_tensors(fn: Callable) -> tuple[Tensor, ...]:
    """The tensors ``fn`` can read, in the order found: its closure, the globals it names, its
    defaults, a ``functools.partial``'s arguments, a module's parameters and buffers, nested
    callables found there."""
    found: dict[int, Tensor] = {}
    seen: dict[int, object] = {}  # holds what it saw, so a freed temporary's id is not reused

    def visit(obj: object, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen[id(obj)] = obj
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                visit(t, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for x in obj:
                visit(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, depth + 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            names = obj.__code__.co_names
            visit([obj.__globals__[n] for n in names if n in obj.__globals__
                   and not inspect.ismodule(obj.__globals__[n])], depth + 1)
            visit(obj.__defaults__ or (), depth + 1)
            visit(obj.__kwdefaults__ or {}, depth + 1)
        elif callable(obj) and hasattr(type(obj), "__call__") and not isinstance(obj, type):
            visit(getattr(obj, "__dict__", {}), depth + 1)

    visit(fn, 0)
    return tuple(found.values())


def captured_tensors(fn: Callable) -> tuple[Tensor, ...]:
    """The tensors ``fn`` can read that need a gradient (:func:`reachable_tensors`). They
    become explicit inputs of the autograd.Function, which is how their gradients reach
    autograd."""
    return tuple(t for t in reachable_tensors(fn) if t.requires_grad)


# -- block classification of a mask_mod -------------------------------------------------------

def checked_keep(keep: object) -> Tensor:
    """A mask_mod's result, or TypeError where it is not a bool tensor."""
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        what = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {what}")
    return keep


def mask_mod_kinds(mask_mod: Callable, B: int, H: int, n_q: int, n_k: int, block_m: int,
                   block_n: int, device: torch.device | str | None = None
                   ) -> tuple[Tensor, Tensor]:
    """Evaluate ``mask_mod`` over the whole grid, a chunk of tiles at a time, and return
    bool ``(B, H, QB, KB)`` grids ``(visit, full)``: a tile is visited when any pair is
    kept, full when all are. No compile, any length; memory is one chunk."""
    qb, kb = -(-n_q // block_m), -(-n_k // block_n)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    visit = torch.zeros(B, H, qb, kb, dtype=torch.bool, device=device)
    full = torch.zeros(B, H, qb, kb, dtype=torch.bool, device=device)
    # key blocks per chunk, so that B·H·block_m·(keys of the chunk) stays bounded (the
    # bound for a mask that depends on b and h; one that does not costs B·H times less)
    kb_step = max(1, _CLASSIFY_CHUNK // max(1, B * H * block_m * block_n))
    for i in range(qb):
        m0, m1 = i * block_m, min((i + 1) * block_m, n_q)
        q_idx = torch.arange(m0, m1, device=device).view(1, 1, -1, 1)
        for j0 in range(0, kb, kb_step):
            j1 = min(j0 + kb_step, kb)
            n0, n1 = j0 * block_n, min(j1 * block_n, n_k)
            kv_idx = torch.arange(n0, n1, device=device).view(1, 1, 1, -1)
            keep = checked_keep(mask_mod(b, h, q_idx, kv_idx))
            # reduce on the mask's own batch / head extent (1 when it ignores b or h), then
            # broadcast the per-tile answer: no (B, H, BM, keys) copy of a shared mask
            kb_ = keep.shape[-4] if keep.dim() >= 4 else 1
            kh_ = keep.shape[-3] if keep.dim() >= 3 else 1
            keep = torch.broadcast_to(keep, (kb_, kh_, m1 - m0, n1 - n0))
            pad = (j1 - j0) * block_n - (n1 - n0)  # the last key block may be short
            # padded with False: a ragged edge tile is never full, as in torch's
            # create_block_mask (whose kernels rely on it to mask the positions past the end)
            tiles = torch.nn.functional.pad(keep, (0, pad), value=False).view(
                kb_, kh_, m1 - m0, j1 - j0, block_n)
            visit[:, :, i, j0:j1] = tiles.any(dim=4).any(dim=2)
            full[:, :, i, j0:j1] = tiles.all(dim=4).all(dim=2) & (m1 - m0 == block_m)
    return visit, full


def union_blocks(visit: Tensor, full: Tensor, n_q: int, n_k: int, block_m: int,
                 block_n: int) -> Blocks:
    """One tile plan for every (b, h): visited when any (b, h) visits, full when all are."""
    v = visit.reshape(-1, *visit.shape[-2:]).any(dim=0)
    f = full.reshape(-1, *full.shape[-2:]).all(dim=0)
    kinds = torch.where(f, FULL, torch.where(v, PARTIAL, EMPTY)).to(torch.int8).cpu()
    return classify_grid(kinds, n_q, n_k, block_m, block_n)


def mask_mod_blocks(mask_mod: Callable, B: int, H: int, n_q: int, n_k: int, block_m: int,
                    block_n: int, device=None) -> Blocks:
    """:class:`attn.masks.Blocks` of a mask_mod (what ``attention(mask_mod=...)`` visits)."""
    visit, full = mask_mod_kinds(mask_mod, B, H, n_q, n_k, block_m, block_n, device)
    return union_blocks(visit, full, n_q, n_k, block_m, block_n)


# -- the spec of a call with mods -------------------------------------------------------------

def mod_spec(spec: LaunchSpec, q: Tensor, k: Tensor, score_mod, mask_mod, mask_blocks
             ) -> tuple[LaunchSpec, tuple[Tensor, ...]]:
    """The spec of a call with mods, and the tensors the score_mod captures that need a
    gradient. The mask's tile plan is given as Blocks (its tile sizes become the call's),
    as a callable ``(block_m, block_n) -> Blocks``, or made from the mask_mod: the last two
    stay callables in ``spec.mask_blocks``, which the backend calls at its own tile sizes
    (``spec.block_m`` / ``block_n`` where set, else its defaults)."""
    if mask_mod is not None and mask_blocks is None:
        B, H, Nq, _ = q.shape
        mask_blocks = functools.partial(mask_mod_blocks, mask_mod, B, H, Nq, k.shape[2],
                                        device=q.device)
    captured = ()
    if score_mod is not None and torch.is_grad_enabled():
        captured = captured_tensors(score_mod)
    if isinstance(mask_blocks, Blocks):  # the mask's tiles are the tiles (a BlockMask's own size)
        spec = replace(spec, block_m=mask_blocks.block_m, block_n=mask_blocks.block_n)
    spec = replace(spec, score_mod=score_mod, mask_mod=mask_mod, mask_blocks=mask_blocks)
    return spec, captured
