"""Oracles and the error budget for tests/test_fuzz.py.

Every oracle is attn's float64 reference (``attn.attention(..., backend="reference")``) seen
through the entry point's own conventions: packed sequences as a loop over sequences,
flash-attn's (B, N, H, D) layout, window rule and +inf lse as transposes and an explicit
mask, a KV cache as the keys it holds after the append. Run in the tested dtype instead of
float64, the same oracle is "plain PyTorch", whose own error sets the budget.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

import attn
from attn.testing import _FLOOR

F64 = torch.float64


# -- errors ----------------------------------------------------------------------------------

def names(message: str, name: str) -> bool:
    """Whether ``message`` names ``name`` as a word (``k`` is not found in ``k_cache``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message) is not None


def assert_refused(run, name: str | tuple[str, ...], errors=(ValueError, TypeError)) -> None:
    """``run()`` raises one of ``errors`` whose message names the argument ``name`` (or one
    of several spellings of it)."""
    wanted = (name,) if isinstance(name, str) else name
    try:
        run()
    except errors as exc:
        assert any(names(str(exc), n) for n in wanted), (
            f"{type(exc).__name__} does not name the invalid argument {wanted[0]!r}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any other error is the finding
        raise AssertionError(f"invalid {wanted[0]!r}: expected {[e.__name__ for e in errors]} "
                             f"naming it, got {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError(f"invalid {wanted[0]!r} was accepted")


# -- the budget ------------------------------------------------------------------------------

def check_budget(name: str, got: Tensor, exact: Tensor, plain: Tensor, dtype: torch.dtype,
                 factor: float = 2.0) -> None:
    """attn.testing's rule: ``|got - exact| <= factor · |plain - exact| + floor``, the floor a
    few ulps of ``dtype`` at max(1, largest |exact|). Infinite entries (an lse of a row with
    no key) must be equal; a NaN anywhere fails."""
    assert tuple(got.shape) == tuple(exact.shape), \
        f"{name}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    got, exact, plain = (t.detach().to(F64) for t in (got, exact, plain))
    nans = int(torch.isnan(got).sum())
    assert nans == 0, f"{name}: NaN in {nans} of {got.numel()} entries (the reference has none)"
    inf = torch.isinf(exact)
    bad = torch.isinf(got) != inf
    assert not bad.any() and torch.equal(got[inf], exact[inf]), \
        f"{name}: infinite entries differ, got {got[inf | torch.isinf(got)].tolist()[:8]} " \
        f"where the reference has {exact[inf | torch.isinf(got)].tolist()[:8]}"
    got, exact, plain = got[~inf], exact[~inf], plain[~inf]
    if exact.numel() == 0:
        return
    err = (got - exact).abs().max().item()
    plain_err = (plain - exact).abs().max().item() if torch.isfinite(plain).all() else 0.0
    floor = _FLOOR[dtype] * max(1.0, exact.abs().max().item())
    assert err <= factor * plain_err + floor, (
        f"{name}: error {err:.3e} > {factor} x plain {plain_err:.3e} + floor {floor:.1e}")


def reference(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype, **kw):
    """attn.attention's reference backend with every tensor argument cast to ``dtype``
    (alibi slopes stay float32 at most, as attn wants them)."""
    cast = {n: (t.detach().to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                and n != "alibi_slopes" else t) for n, t in kw.items()}
    return attn.attention(q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype),
                          backend="reference", **cast)


# -- packed sequences ------------------------------------------------------------------------

def varlen_loop(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int],
                dtype: torch.dtype, alibi_slopes: Tensor | None = None, **kw
                ) -> tuple[Tensor, Tensor]:
    """attn.varlen_attention's meaning: out (total_q, H, Dv) and lse (H, total_q) from one
    attn.attention call per sequence (sequence b as a batch of one, bottom-right aligned).
    A sequence without keys: zeros, lse -inf (or its sink)."""
    total_q, H, _ = q.shape
    acc = F64 if dtype == F64 else torch.float32
    out = torch.zeros(total_q, H, v.shape[-1], dtype=dtype)
    lse = torch.full((H, total_q), float("-inf"), dtype=acc)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            if kw.get("sinks") is not None:
                lse[:, q0:q1] = kw["sinks"].detach().to(acc)[:, None]
            continue
        extra = {}
        if alibi_slopes is not None:
            extra["alibi_slopes"] = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        # (L, H, D) -> (1, H, L, D)
        o, l = reference(*(t[s0:s1].transpose(0, 1)[None] for t, s0, s1 in
                           ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                         dtype, return_lse=True, **extra, **kw)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = l[0]
    return out, lse


# -- flash-attn's conventions ----------------------------------------------------------------

def fa_window(causal: bool, window_size, seqlen_k: int) -> tuple[int, int, bool]:
    """flash-attn 2.8.3's resolution of (causal, window_size): sides >= seqlen_k are
    unbounded, causal sets right = 0, a -1 beside a bounded side stands for seqlen_k.
    Returns (left, right, pure_causal), -1 = unbounded."""
    left, right = (int(w) for w in window_size)
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if causal:
        right = 0
    pure = left < 0 and right == 0
    if left < 0 <= right:
        left = seqlen_k
    if right < 0 <= left:
        right = seqlen_k
    return left, right, pure


def fa_attention(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype, *, causal=False,
                 window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None,
                 seqlen_k: int | None = None) -> tuple[Tensor, Tensor]:
    """flash-attn's meaning of q (B, Nq, H, D), k, v (B, Nk, Hkv, D): out (B, Nq, H, Dv),
    lse (B, H, Nq) with +inf on rows without a key, and under pure-causal ALiBi the lse of
    flash-attn's ``+slope·j`` form. attn.attention on transposed tensors and an explicit
    mask."""
    B, Nq, H, _ = q.shape
    Nk = k.shape[1]
    left, right, pure = fa_window(causal, window_size, Nk if seqlen_k is None else seqlen_k)
    diag = torch.arange(Nk)[None, :] - (torch.arange(Nq)[:, None] + Nk - Nq)
    keep = torch.ones(Nq, Nk, dtype=torch.bool)
    if left >= 0:
        keep &= diag >= -left
    if right >= 0:
        keep &= diag <= right
    kw = {"attn_mask": keep, "scale": softmax_scale}
    if softcap > 0:
        kw["softcap"] = float(softcap)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    out, lse = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dtype,
                         return_lse=True, **kw)
    empty = torch.isneginf(lse)
    if alibi_slopes is not None and pure:
        row = (torch.arange(Nq) + Nk - Nq).to(lse.dtype)
        lse = lse + alibi_slopes.to(lse.dtype).reshape(-1, H, 1) * row
    lse = torch.where(empty, float("inf"), lse)
    return out.transpose(1, 2), lse


def fa_varlen_loop(q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int],
                   dtype: torch.dtype, *, alibi_slopes=None, **kw) -> tuple[Tensor, Tensor]:
    """flash_attn_varlen_func's meaning: out (total_q, H, Dv), lse (H, total_q); rows past
    cu_q[-1] (a padded buffer) and sequences without keys give zeros, lse +inf."""
    total_q, H, _ = q.shape
    acc = F64 if dtype == F64 else torch.float32
    out = torch.zeros(total_q, H, v.shape[-1], dtype=dtype)
    lse = torch.full((H, total_q), float("inf"), dtype=acc)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        slopes = None if alibi_slopes is None else (
            alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1])
        o, l = fa_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dtype,
                            alibi_slopes=slopes, **kw)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool
           ) -> Tensor:
    """RoPE as flash-attn applies it: x (B, N, H, D) turned at positions (B, N), the first
    ``2 · cos.shape[1]`` features, pairs (2i, 2i + 1) or (i, i + rd/2); in float64."""
    x = x.to(F64)
    rd = 2 * cos.shape[1]
    c = cos.to(F64)[positions].unsqueeze(2)  # (B, N, 1, rd/2)
    s = sin.to(F64)[positions].unsqueeze(2)
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot, x[..., rd:]], dim=-1)
