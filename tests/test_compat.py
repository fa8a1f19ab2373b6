"""attn.compat.flash_attn against an independent float64 flash-attn reference (issue 15).

``fa_reference`` below is written from flash-attn 2.8.3's documentation, in its own
``(B, N, H, D)`` layout, scores materialized; it shares no code with attn. Budgets follow
attn.testing: the tested function's error against float64 is at most 2x (outputs, lse) or
3x (gradients) the error of the same reference run in the tested dtype, plus a rounding floor.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import attn
from attn.compat import flash_attn as fa
from attn.compat import install_flash_attn, uninstall_flash_attn
from attn.compat.bert_padding import index_first_axis, pad_input, unpad_input
from attn.compat.flash_attn import FlashAttnError
from attn.compat.rotary import apply_rotary_emb
from fuzz_oracles import fa_window

ROOT = Path(__file__).resolve().parent.parent
HAS_ALIBI = "alibi_slopes" in inspect.signature(attn.attention).parameters
needs_alibi = pytest.mark.skipif(not HAS_ALIBI, reason="attn.attention has no alibi_slopes yet "
                                 "(branch alibi)")
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2.0 ** -11,
         torch.bfloat16: 2.0 ** -8}  # half the unit roundoff step of each half precision


# -- the reference --------------------------------------------------------------------------

# flash-attn 2.8.3's rule for (causal, window_size): one copy, in the fuzz oracles
resolve_window = fa_window


def fa_reference(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, seqlen_k=None, dtype=torch.float64):
    """out (B, Nq, H, Dv) and lse (B, H, Nq) with flash-attn's conventions, in ``dtype``."""
    q, k, v = (t.detach().to(dtype) for t in (q, k, v))
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq).view(-1, 1)
    j = torch.arange(Nk).view(1, -1)
    diag = j - (i + Nk - Nq)  # 0 on the bottom-right diagonal
    left, right, pure = resolve_window(causal, window_size, Nk if seqlen_k is None else seqlen_k)
    keep = torch.ones(Nq, Nk, dtype=torch.bool)
    if left >= 0:
        keep &= diag >= -left
    if right >= 0:
        keep &= diag <= right
    slope = None
    if alibi_slopes is not None:
        slope = alibi_slopes.to(dtype).reshape(-1, H, 1, 1)  # (1|B, H, 1, 1)
        s = s - slope * diag.abs().to(dtype)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Nq); -inf where a row sees nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    empty = torch.isneginf(lse)
    if slope is not None and pure:
        lse = lse + slope[..., 0] * (torch.arange(Nq) + Nk - Nq).to(dtype)
    lse = torch.where(empty, float("inf"), lse)
    return out, lse


def budget_check(name, got, exact, plain, factor, dtype):
    got, exact, plain = (t.detach().to(torch.float64) for t in (got, exact, plain))
    inf = torch.isinf(exact)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], exact[inf]), \
        f"{name}: infinite entries differ"
    got, exact, plain = got[~inf], exact[~inf], plain[~inf]
    if exact.numel() == 0:
        return
    err = (got - exact).abs().max().item()
    plain_err = (plain - exact).abs().max().item()
    floor = FLOOR[dtype] * max(1.0, exact.abs().max().item())
    assert err <= factor * plain_err + floor, \
        f"{name}: error {err:.3e} > {factor} x plain {plain_err:.3e} + {floor:.1e}"


def compare(fn, ref, inputs, dtype, grad=True):
    """Run ``fn(*inputs)`` → (out, lse) and ``ref(*inputs, dtype=...)`` in float64 and in
    ``dtype``; check out, lse and the gradients of every input from a random upstream."""
    leaves = [t.detach().to(dtype).requires_grad_(grad) for t in inputs]
    out, lse = fn(*leaves)
    exact_leaves = [t.detach().to(torch.float64).requires_grad_(grad) for t in inputs]
    plain_leaves = [t.detach().to(dtype).requires_grad_(grad) for t in inputs]
    exact = ref(*exact_leaves, dtype=torch.float64)
    plain = ref(*plain_leaves, dtype=dtype)
    budget_check("out", out, exact[0], plain[0], 2, dtype)
    budget_check("lse", lse, exact[1], plain[1], 2, dtype)
    if not grad:
        return
    g = torch.randn(exact[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * g).sum(), leaves)
    want = torch.autograd.grad((exact[0] * g).sum(), exact_leaves)
    plain_g = torch.autograd.grad((plain[0].double() * g).sum(), plain_leaves)
    for n, a, b, c in zip("qkv", got, want, plain_g):
        budget_check("d" + n, a, b, c, 3, dtype)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def differentiable_reference(seqlen_k=None, **kw):
    """fa_reference's output kept differentiable in q, k, v (its lse comes detached)."""
    def ref(q, k, v, dtype):
        B, Nq, H, D = q.shape
        Nk, Hkv = k.shape[1], k.shape[2]
        qq = q.to(dtype)
        kk, vv = (t.to(dtype).repeat_interleave(H // Hkv, 2) for t in (k, v))
        scale = kw.get("softmax_scale") or D ** -0.5
        s = torch.einsum("bihd,bjhd->bhij", qq, kk) * scale
        cap = kw.get("softcap", 0.0)
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        i = torch.arange(Nq).view(-1, 1)
        j = torch.arange(Nk).view(1, -1)
        diag = j - (i + Nk - Nq)
        left, right, _ = resolve_window(kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                        Nk if seqlen_k is None else seqlen_k)
        keep = torch.ones(Nq, Nk, dtype=torch.bool)
        if left >= 0:
            keep &= diag >= -left
        if right >= 0:
            keep &= diag <= right
        if kw.get("alibi_slopes") is not None:
            s = s - kw["alibi_slopes"].to(dtype).reshape(-1, H, 1, 1) * diag.abs().to(dtype)
        s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        p = p / torch.where(l > 0, l, 1.0)
        out = torch.einsum("bhij,bjhd->bihd", p, vv)
        _, lse = fa_reference(q, k, v, dtype=dtype, seqlen_k=seqlen_k, **kw)
        return out, lse
    return ref


# -- flash_attn_func and the packed variants ---------------------------------------------------

CASES = [  # (Nq, Nk, H, Hkv, D, causal, window, softcap, alibi)
    (17, 17, 4, 4, 16, False, (-1, -1), 0.0, None),
    (17, 17, 4, 2, 16, True, (-1, -1), 0.0, None),
    (5, 23, 4, 1, 40, True, (-1, -1), 0.0, None),
    (23, 7, 4, 2, 16, True, (-1, -1), 0.0, None),  # rows with no key
    (19, 31, 2, 2, 24, False, (3, 2), 0.0, None),
    (31, 13, 2, 1, 16, False, (4, -1), 0.0, None),  # -1 -> seqlen_k, Nq > Nk + 1
    (17, 17, 4, 2, 16, True, (5, -1), 5.0, None),
    (13, 21, 4, 2, 16, False, (-1, -1), 0.0, "h"),
    (21, 13, 4, 2, 16, True, (-1, -1), 0.0, "bh"),  # pure causal: the lse shift
    (17, 25, 4, 4, 16, True, (6, -1), 3.0, "h"),  # causal + left window: no shift
]


def _slopes(kind, B, H):
    if kind is None:
        return None
    shape = (H,) if kind == "h" else (B, H)
    return (torch.rand(shape, generator=torch.Generator().manual_seed(3)) + 0.1).float()


@pytest.mark.parametrize("Nq, Nk, H, Hkv, D, causal, window, softcap, alibi", CASES)
def test_func_matches_reference(Nq, Nk, H, Hkv, D, causal, window, softcap, alibi):
    if alibi is not None and not HAS_ALIBI:
        pytest.skip("attn.attention has no alibi_slopes yet (branch alibi)")
    B = 2
    slopes = _slopes(alibi, B, H)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)

    def fn(q, k, v):
        out, lse, S = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        assert S.numel() == 0 and lse.shape == (B, H, Nq) and lse.dtype == torch.float32
        return out, lse
    inputs = (randn(B, Nq, H, D, seed=0), randn(B, Nk, Hkv, D, seed=1),
              randn(B, Nk, Hkv, D, seed=2))
    compare(fn, differentiable_reference(**kw), inputs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_func_dtypes(dtype):
    kw = dict(causal=True, softmax_scale=0.3)

    def fn(q, k, v):
        out, lse, _ = fa.flash_attn_func(q, k, v, 0.0, 0.3, True, return_attn_probs=True)
        assert out.dtype == dtype
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        return out, lse
    inputs = (randn(1, 33, 2, 16), randn(1, 40, 2, 16, seed=1), randn(1, 40, 2, 16, seed=2))
    compare(fn, differentiable_reference(**kw), inputs, dtype)


def test_window_minus_one_stands_for_seqlen_k():
    # Nq = 9 > Nk + 1 = 4: with window (0, -1) the right side is seqlen_k = 3, so query 0
    # (diagonal at key -6) sees keys up to -6 + 3 = -3: none; query 5 sees keys 0..2
    q, k, v = randn(1, 9, 1, 8), randn(1, 3, 1, 8, seed=1), randn(1, 3, 1, 8, seed=2)
    out, lse, _ = fa.flash_attn_func(q, k, v, window_size=(0, -1), return_attn_probs=True)
    seen = torch.isfinite(lse[0, 0])
    # query i sees key j iff j in [i - 6, i - 3]: rows 0..2 see nothing
    assert seen.tolist() == [False, False, False, True, True, True, True, True, True]
    assert out[0, :3].abs().max() == 0
    # a side >= seqlen_k is unbounded: (0, 3) behaves as (0, -1), (0, 100) too
    for w in ((0, 3), (0, 100)):
        out2 = fa.flash_attn_func(q, k, v, window_size=w)
        torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_rows_without_keys_give_zero_and_plus_inf():
    q, k, v = randn(2, 6, 2, 8), randn(2, 2, 2, 8, seed=1), randn(2, 2, 2, 8, seed=2)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # bottom-right causal, Nq=6, Nk=2: rows 0..3 see nothing
    assert torch.isposinf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()
    assert out[:, :4].abs().max() == 0 and not out.isnan().any()


@needs_alibi
def test_causal_alibi_lse_is_shifted():
    B, Nq, Nk, H = 2, 7, 12, 3
    q, k, v = randn(B, Nq, H, 16), randn(B, Nk, H, 16, seed=1), randn(B, Nk, H, 16, seed=2)
    slopes = _slopes("bh", B, H)
    _, lse_causal, _ = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                          return_attn_probs=True)
    # the same keys through an explicit window (right 0, left >= Nk): the |dist| form
    _, lse_dist = attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 causal=True, alibi_slopes=slopes, return_lse=True)
    shift = slopes[..., None] * (torch.arange(Nq) + Nk - Nq)
    torch.testing.assert_close(lse_causal, lse_dist + shift)
    # a left side >= seqlen_k is unbounded, so still pure causal: shifted
    _, lse_wide, _ = fa.flash_attn_func(q, k, v, causal=True, window_size=(Nk + 3, -1),
                                        alibi_slopes=slopes, return_attn_probs=True)
    torch.testing.assert_close(lse_wide, lse_causal)
    # a finite left window is "local", not pure causal: no shift
    _, lse_local, _ = fa.flash_attn_func(q, k, v, causal=True, window_size=(Nk - 1, -1),
                                         alibi_slopes=slopes, return_attn_probs=True)
    torch.testing.assert_close(lse_local, lse_dist)


def test_packed_variants_give_gradients_to_the_packed_tensor():
    B, N, H, D = 2, 19, 4, 16
    qkv = randn(B, N, 3, H, D).float().requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(5, 0), softcap=4.0)
    g = randn(*out.shape, seed=5).float()
    (out * g).sum().backward()
    q, k, v = (t.detach().requires_grad_() for t in qkv.detach().unbind(2))
    ref = fa.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=4.0)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))

    qq = randn(B, 7, H, D).float().requires_grad_()
    kv = randn(B, N, 2, 2, D, seed=1).float().requires_grad_()
    kw = dict(causal=True)

    def fn(q, k, v):
        kv_ = torch.stack([k, v], 2)
        out, lse, _ = fa.flash_attn_kvpacked_func(q, kv_, return_attn_probs=True, **kw)
        return out, lse
    compare(fn, differentiable_reference(**kw), (qq, *kv.unbind(2)), torch.float32)


def test_dropout_is_attns_reproducible_mask():
    q, k, v = randn(2, 17, 4, 16).float(), randn(2, 17, 2, 16, seed=1).float(), \
        randn(2, 17, 2, 16, seed=2).float()
    torch.manual_seed(7)
    out, lse, S = fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True,
                                     return_attn_probs=True)
    assert S.numel() == 0
    torch.manual_seed(7)
    want = attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                          dropout_p=0.3).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.manual_seed(8)
    assert not torch.equal(fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True), out)
    # packed: the padded batch's mask, the same as attn.varlen_attention's
    cu = torch.tensor([0, 9, 17], dtype=torch.int32)
    qp, kp, vp = q[0], k[0], v[0]
    torch.manual_seed(3)
    got = fa.flash_attn_varlen_func(qp, kp, vp, cu, cu, 9, 9, dropout_p=0.25)
    torch.manual_seed(3)
    torch.testing.assert_close(got, attn.varlen_attention(qp, kp, vp, cu, cu, dropout_p=0.25),
                               rtol=0, atol=0)


# -- varlen ------------------------------------------------------------------------------------

def varlen_reference(cu_q, cu_k, max_k, **kw):
    """Per sequence through the dense reference, concatenated; lse (H, total_q)."""
    def ref(q, k, v, dtype):
        outs, lses = [], []
        for b in range(len(cu_q) - 1):
            qb = q[cu_q[b]:cu_q[b + 1]][None]
            kb, vb = k[cu_k[b]:cu_k[b + 1]][None], v[cu_k[b]:cu_k[b + 1]][None]
            slopes = kw.get("alibi_slopes")
            kwb = dict(kw, alibi_slopes=None if slopes is None else
                       (slopes if slopes.dim() == 1 else slopes[b]))
            if kb.shape[1] == 0:
                outs.append(torch.zeros(qb.shape[1], q.shape[1], v.shape[2], dtype=dtype))
                lses.append(torch.full((q.shape[1], qb.shape[1]), float("inf"), dtype=dtype))
                continue
            o, l = differentiable_reference(**kwb, seqlen_k=max_k)(qb, kb, vb, dtype)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)
    return ref


VARLEN_CASES = [  # (lengths_q, lengths_k, H, Hkv, causal, window, softcap, alibi)
    ([5, 17, 1, 9], [5, 17, 1, 9], 4, 2, True, (-1, -1), 0.0, None),
    ([3, 12, 7], [9, 4, 7], 2, 1, True, (-1, -1), 0.0, None),  # Nq > Nk and Nq < Nk
    ([6, 0, 11], [8, 5, 11], 4, 4, False, (2, 3), 2.0, None),  # an empty query sequence
    ([4, 6], [0, 9], 2, 2, False, (-1, -1), 0.0, None),  # a sequence with no key
    ([7, 13], [11, 13], 4, 2, True, (-1, -1), 0.0, "bh"),
    ([7, 13], [11, 13], 4, 2, False, (3, 1), 0.0, "h"),
]


@pytest.mark.parametrize("lq, lk, H, Hkv, causal, window, softcap, alibi", VARLEN_CASES)
def test_varlen_matches_reference(lq, lk, H, Hkv, causal, window, softcap, alibi):
    if alibi is not None and not HAS_ALIBI:
        pytest.skip("attn.varlen_attention has no alibi_slopes yet (branch alibi)")
    D = 16
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    slopes = _slopes(alibi, len(lq), H)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    max_k = max(lk)

    def fn(q, k, v):
        out, lse, S = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max_k,
                                                return_attn_probs=True, **kw)
        assert S.numel() == 0 and lse.shape == (H, sum(lq))
        return out, lse
    inputs = (randn(sum(lq), H, D), randn(sum(lk), Hkv, D, seed=1),
              randn(sum(lk), Hkv, D, seed=2))
    compare(fn, varlen_reference(cu_q.tolist(), cu_k.tolist(), max_k, **kw), inputs,
            torch.float32)


def test_varlen_packed_variants_and_padded_buffers():
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    H, D = 2, 8
    qkv = randn(23, 3, H, D).float().requires_grad_()  # 3 tokens of padding at the end
    out, lse, _ = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 8, causal=True,
                                                      return_attn_probs=True)
    assert out.shape == (23, H, D) and out[20:].abs().max() == 0
    assert torch.isposinf(lse[:, 20:]).all()
    q, k, v = (t.detach()[:20] for t in qkv.unbind(1))
    torch.testing.assert_close(out[:20], fa.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8,
                                                                    causal=True))
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and qkv.grad[:20].abs().sum() > 0
    assert qkv.grad[20:].abs().max() == 0

    qq = randn(20, 4, D).float().requires_grad_()
    kv = randn(20, 2, H, D, seed=1).float().requires_grad_()
    got = fa.flash_attn_varlen_kvpacked_func(qq, kv, cu, cu, 8, 8, causal=True)
    want = fa.flash_attn_varlen_func(qq, kv[:, 0], kv[:, 1], cu, cu, 8, 8, causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert kv.grad.abs().sum() > 0


def _paged(k: torch.Tensor, cu_k: list[int], page: int, pages_per_seq: int, seed: int = 0):
    """Scatter packed keys (total, Hkv, D) into a shuffled paged cache."""
    B = len(cu_k) - 1
    num_blocks = B * pages_per_seq + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = perm[:B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    cache = torch.randn(num_blocks, page, *k.shape[1:], dtype=k.dtype)  # garbage elsewhere
    for b in range(B):
        for t in range(cu_k[b + 1] - cu_k[b]):
            cache[table[b, t // page], t % page] = k[cu_k[b] + t]
    return cache, table


@pytest.mark.parametrize("page", [1, 16, 5])
def test_varlen_paged_block_table(page):
    lq, lk = [3, 1, 4], [9, 20, 14]
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 29, 43], dtype=torch.int32)
    q, k, v = randn(8, 4, 16).float(), randn(43, 2, 16, seed=1).float(), \
        randn(43, 2, 16, seed=2).float()
    pages = -(-20 // page)
    kc, table = _paged(k, cu_k.tolist(), page, pages)
    vc, _ = _paged(v, cu_k.tolist(), page, pages)
    got = fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 4, 20, causal=True,
                                    block_table=table)
    want = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 20, causal=True)
    torch.testing.assert_close(got, want)


# -- the KV cache ------------------------------------------------------------------------------

@pytest.fixture(params=["paged", "batched"])
def kv_path(request, monkeypatch):
    """flash_attn_with_kvcache's two paths: pages read by the tiled items (CPU) and one
    batched / packed call (other devices), both run here on CPU."""
    if request.param == "batched":
        monkeypatch.setattr(importlib.import_module("attn.decoding"), "_PAGED_DEVICES", ())
    return request.param


def rotary_reference(x, cos, sin, positions, interleaved):
    """RoPE as complex multiplication: pairs (2i, 2i+1) or (i, i + rd/2) times e^{iθ}."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].double()
    c = cos.double()[positions][:, :, None]  # (B, N, 1, rd/2)
    s = sin.double()[positions][:, :, None]
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * torch.complex(c, s)
        rot = torch.stack([z.real, z.imag], -1).flatten(-2)
    else:
        z = torch.complex(xr[..., :rd // 2], xr[..., rd // 2:]) * torch.complex(c, s)
        rot = torch.cat([z.real, z.imag], -1)
    return torch.cat([rot, x[..., rd:].double()], -1)


def cos_sin(n, rd, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def kvcache_reference(q, k_cache, v_cache, k, v, *, cache_seqlens, cache_batch_idx=None,
                      cache_leftpad=None, rotary=None, interleaved=True, causal=False,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Row by row: the updated cache (float64) and out / lse from the dense reference."""
    B, Nq, H, _ = q.shape
    cap = k_cache.shape[1]
    rows = list(range(B)) if cache_batch_idx is None else cache_batch_idx.tolist()
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    seqlens = cache_seqlens.tolist() if torch.is_tensor(cache_seqlens) else [cache_seqlens] * B
    lp = [0] * B if cache_leftpad is None else cache_leftpad.tolist()
    Nnew = 0 if k is None else k.shape[1]
    left, right, _ = resolve_window(causal, window_size, cap)
    local = (left >= 0 or right >= 0) and not (left < 0 and right == 0) or causal
    outs, lses = [], []
    for b in range(B):
        L = seqlens[b]
        qb = q[b:b + 1].double()
        if k is not None:
            kb = k[b:b + 1].double()
            if rotary is not None:
                pos_k = torch.arange(L, L + Nnew)[None]
                kb = rotary_reference(kb, *rotary, pos_k, interleaved)
                pos_q = (torch.arange(L, L + Nq) if local else torch.full((Nq,), L))[None]
                qb = rotary_reference(qb, *rotary, pos_q, interleaved)
            kc[rows[b], L:L + Nnew] = kb[0]
            vc[rows[b], L:L + Nnew] = v[b].double()
        keys = slice(lp[b], L + Nnew)
        slopes = None if alibi_slopes is None else (
            alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        o, l = fa_reference(qb, kc[rows[b], keys][None], vc[rows[b], keys][None], causal=causal,
                            window_size=window_size, softcap=softcap, alibi_slopes=slopes,
                            seqlen_k=cap)
        outs.append(o)
        lses.append(l)
    return kc, vc, torch.cat(outs), torch.cat(lses)


KV_CASES = [  # (seqlens, Nq, Nnew, H, Hkv, D, rd, interleaved, causal, window, leftpad, idx)
    (5, 1, 1, 4, 2, 16, None, True, True, (-1, -1), None, None),
    ([3, 9, 0], 1, 1, 4, 2, 16, 16, True, True, (-1, -1), None, None),
    ([3, 9, 4], 4, 4, 4, 1, 16, 6, False, True, (-1, -1), None, None),
    ([3, 9, 4], 3, 3, 2, 2, 16, 8, True, False, (-1, -1), None, None),  # q at cache_seqlens
    ([6, 10, 12], 2, 2, 4, 2, 16, 10, False, True, (4, -1), [2, 0, 5], None),
    ([6, 10, 12], 2, 0, 4, 2, 16, None, True, False, (3, 2), None, [2, 0, 1]),
    ([8, 8, 8], 3, 3, 4, 2, 16, 4, True, True, (-1, -1), None, [1, 2, 0]),
]


@pytest.mark.parametrize("seqlens, Nq, Nnew, H, Hkv, D, rd, inter, causal, window, leftpad, idx",
                         KV_CASES)
def test_kvcache_matches_reference_and_updates_in_place(kv_path, seqlens, Nq, Nnew, H, Hkv, D, rd, inter,
                                                        causal, window, leftpad, idx):
    B, cap = 3, 24
    q = randn(B, Nq, H, D).float()
    k_cache = randn(B, cap, Hkv, D, seed=1).float()
    v_cache = randn(B, cap, Hkv, D, seed=2).float()
    k = randn(B, Nnew, Hkv, D, seed=3).float() if Nnew else None
    v = randn(B, Nnew, Hkv, D, seed=4).float() if Nnew else None
    seqlens_t = seqlens if isinstance(seqlens, int) else torch.tensor(seqlens, dtype=torch.int32)
    idx_t = None if idx is None else torch.tensor(idx, dtype=torch.int32)
    lp_t = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    rotary = None if rd is None else cos_sin(cap, rd)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    kc_want, vc_want, out_want, lse_want = kvcache_reference(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens_t, cache_batch_idx=idx_t,
        cache_leftpad=lp_t, rotary=rotary, interleaved=inter, causal=causal,
        window_size=window)
    ptr = k_cache.data_ptr()
    with torch.inference_mode():
        out, lse = fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, *(rotary or (None, None)), cache_seqlens=seqlens_t,
            cache_batch_idx=idx_t, cache_leftpad=lp_t, causal=causal, window_size=window,
            rotary_interleaved=inter, num_splits=3, return_softmax_lse=True)
    assert k_cache.data_ptr() == ptr and out.shape == (B, Nq, H, D) and lse.shape == (B, H, Nq)
    # in place: exactly the new slots changed, to the (rotated) new keys
    torch.testing.assert_close(k_cache.double(), kc_want, rtol=0, atol=1e-6)
    torch.testing.assert_close(v_cache.double(), vc_want, rtol=0, atol=0)
    changed = (k_cache != before_k).any(-1).any(-1) | (v_cache != before_v).any(-1).any(-1)
    expect = torch.zeros_like(changed)
    L = [seqlens] * B if isinstance(seqlens, int) else seqlens
    for b in range(B):
        expect[b if idx is None else idx[b], L[b]:L[b] + Nnew] = True
    assert torch.equal(changed, expect)
    inf = torch.isinf(lse_want)
    assert torch.equal(torch.isposinf(lse), inf)
    torch.testing.assert_close(out.double(), out_want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double()[~inf], lse_want[~inf], rtol=0, atol=2e-5)


@needs_alibi
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_alibi_and_softcap(kv_path, causal):
    B, H, cap = 2, 4, 20
    q = randn(B, 2, H, 16).float()
    kc, vc = randn(B, cap, 2, 16, seed=1).float(), randn(B, cap, 2, 16, seed=2).float()
    k, v = randn(B, 2, 2, 16, seed=3).float(), randn(B, 2, 2, 16, seed=4).float()
    seqlens = torch.tensor([4, 11], dtype=torch.int32)
    slopes = _slopes("bh", B, H)
    _, _, out_want, lse_want = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                 causal=causal, softcap=3.0,
                                                 alibi_slopes=slopes)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                                          softcap=3.0, alibi_slopes=slopes,
                                          return_softmax_lse=True)
    torch.testing.assert_close(out.double(), out_want, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), lse_want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("page", [1, 16, 7])  # 7 does not divide the cache length 40
def test_kvcache_paged_matches_contiguous(kv_path, page):
    B, H, Hkv, D, cap = 3, 4, 2, 16, 40
    pages = -(-cap // page)
    q = randn(B, 2, H, D).float()
    k, v = randn(B, 2, Hkv, D, seed=3).float(), randn(B, 2, Hkv, D, seed=4).float()
    kc, vc = randn(B, cap, Hkv, D, seed=1).float(), randn(B, cap, Hkv, D, seed=2).float()
    flat = lambda c: c.reshape(B * cap, Hkv, D)  # noqa: E731
    cu = list(range(0, B * cap + 1, cap))
    kp, table = _paged(flat(kc), cu, page, pages, seed=page)
    vp, _ = _paged(flat(vc), cu, page, pages, seed=page)
    seqlens = torch.tensor([5, 38, 17], dtype=torch.int32)
    rotary = cos_sin(pages * page, 8)
    for paged in (False, True):
        kw = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True,
                  rotary_cos=rotary[0], rotary_sin=rotary[1])
        if paged:
            out_p, lse_p = fa.flash_attn_with_kvcache(q, kp, vp, k, v, block_table=table, **kw)
        else:
            out_c, lse_c = fa.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    torch.testing.assert_close(out_p, out_c)
    torch.testing.assert_close(lse_p, lse_c)
    for b in range(B):  # the paged cache holds the contiguous one's rows, page by page
        for t in range(cap):
            blk, off = table[b, t // page], t % page
            assert torch.equal(kp[blk, off], kc[b, t]) and torch.equal(vp[blk, off], vc[b, t])
    # uniform lengths read only the pages in use
    out_u = fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=13, block_table=table)
    torch.testing.assert_close(out_u, fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=13))


def test_kvcache_whole_cache_and_empty_rows(kv_path):
    q, kc, vc = randn(2, 3, 4, 16).float(), randn(2, 9, 2, 16, seed=1).float(), \
        randn(2, 9, 2, 16, seed=2).float()
    out = fa.flash_attn_with_kvcache(q, kc, vc, causal=True)  # cache_seqlens=None: all 9 keys
    torch.testing.assert_close(out, fa.flash_attn_func(q, kc, vc, causal=True))  # paged items vs batched GEMMs: not bitwise
    seqlens = torch.tensor([0, 5], dtype=torch.int32)  # row 0 has no key
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                          return_softmax_lse=True)
    assert out[0].abs().max() == 0 and torch.isposinf(lse[0]).all()
    torch.testing.assert_close(out[1:], fa.flash_attn_func(q[1:], kc[1:, :5], vc[1:, :5]))


# -- errors ------------------------------------------------------------------------------------

def _e(*shape):
    return torch.zeros(*shape)


I32 = dict(dtype=torch.int32)
ERRORS = {
    "q rank (func)": (lambda: fa.flash_attn_func(_e(2, 4, 8), _e(2, 4, 2, 8), _e(2, 4, 2, 8)),
                      r"q must have 4 dims .*\(2, 4, 8\)"),
    "q rank (varlen)": (lambda: fa.flash_attn_varlen_func(
        _e(2, 4, 4, 8), _e(4, 2, 8), _e(4, 2, 8), torch.tensor([0, 4], **I32),
        torch.tensor([0, 4], **I32), 4, 4), r"q must have 3 dims .*\(2, 4, 4, 8\)"),
    "q rank (kvcache)": (lambda: fa.flash_attn_with_kvcache(_e(4, 4, 8), _e(1, 8, 2, 8),
                                                            _e(1, 8, 2, 8)), r"q must have 4"),
    "heads": (lambda: fa.flash_attn_func(_e(1, 4, 5, 8), _e(1, 4, 2, 8), _e(1, 4, 2, 8)),
              r"heads in k and v \(2\) must divide .* \(5\).*\(1, 4, 5, 8\)"),
    "heads (kvcache)": (lambda: fa.flash_attn_with_kvcache(_e(1, 1, 3, 8), _e(1, 8, 2, 8),
                                                           _e(1, 8, 2, 8)), r"must divide"),
    "head dims": (lambda: fa.flash_attn_func(_e(1, 4, 2, 8), _e(1, 4, 2, 16), _e(1, 4, 2, 16)),
                  r"head dims differ \(8 vs 16\).*\(1, 4, 2, 16\)"),
    "head dims (varlen)": (lambda: fa.flash_attn_varlen_func(
        _e(4, 2, 8), _e(4, 2, 4), _e(4, 2, 4), torch.tensor([0, 4], **I32),
        torch.tensor([0, 4], **I32), 4, 4), r"head dims differ"),
    "cu_seqlens decreasing": (lambda: fa.flash_attn_varlen_func(
        _e(6, 2, 8), _e(6, 2, 8), _e(6, 2, 8), torch.tensor([0, 4, 2, 6], **I32),
        torch.tensor([0, 2, 4, 6], **I32), 4, 4), r"cu_seqlens_q must not decrease.*\[0, 4, 2"),
    "cu_seqlens past the end": (lambda: fa.flash_attn_varlen_func(
        _e(6, 2, 8), _e(6, 2, 8), _e(6, 2, 8), torch.tensor([0, 2, 6], **I32),
        torch.tensor([0, 2, 7], **I32), 4, 5), r"cu_seqlens_k\[-1\] = 7 .* 6 tokens"),
    "cache too small": (lambda: fa.flash_attn_with_kvcache(
        _e(2, 2, 2, 8), _e(2, 8, 2, 8), _e(2, 8, 2, 8), _e(2, 2, 2, 8), _e(2, 2, 2, 8),
        cache_seqlens=torch.tensor([3, 7], **I32)), r"holds 8 positions.*\[3, 7\] \+ 2 new"),
    "paged cache too small": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(4, 3, 2, 8), _e(4, 3, 2, 8), _e(1, 1, 2, 8), _e(1, 1, 2, 8),
        cache_seqlens=6, block_table=torch.tensor([[0, 1]], **I32)), r"holds 6 positions"),
    "block_table + cache_batch_idx": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(4, 16, 2, 8), _e(4, 16, 2, 8), cache_seqlens=3,
        block_table=torch.tensor([[0, 1]], **I32), cache_batch_idx=torch.tensor([0], **I32)),
        r"does not support cache_batch_idx"),
    "block_table + cache_leftpad": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(4, 16, 2, 8), _e(4, 16, 2, 8), cache_seqlens=3,
        block_table=torch.tensor([[0, 1]], **I32), cache_leftpad=torch.tensor([1], **I32)),
        r"does not support cache_leftpad"),
    "k without v": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(1, 8, 2, 8), _e(1, 8, 2, 8), _e(1, 1, 2, 8), cache_seqlens=2),
        r"k and v must be given together"),
    "k without cache_seqlens": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(1, 8, 2, 8), _e(1, 8, 2, 8), _e(1, 1, 2, 8), _e(1, 1, 2, 8)),
        r"pass cache_seqlens"),
    "rotary without k": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(1, 8, 2, 8), _e(1, 8, 2, 8), rotary_cos=_e(8, 2),
        rotary_sin=_e(8, 2), cache_seqlens=2), r"rotate the new keys: pass k and v"),
    "rotary too short": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(1, 8, 2, 8), _e(1, 8, 2, 8), _e(1, 1, 2, 8), _e(1, 1, 2, 8),
        rotary_cos=_e(3, 2), rotary_sin=_e(3, 2), cache_seqlens=4), r"have 3 rows.*up to 4"),
    "rotary dim": (lambda: fa.flash_attn_with_kvcache(
        _e(1, 1, 2, 8), _e(1, 8, 2, 8), _e(1, 8, 2, 8), _e(1, 1, 2, 8), _e(1, 1, 2, 8),
        rotary_cos=_e(8, 5), rotary_sin=_e(8, 5), cache_seqlens=4), r"rotary_dim <= headdim 8"),
    "alibi shape": (lambda: fa.flash_attn_func(_e(1, 4, 2, 8), _e(1, 4, 2, 8), _e(1, 4, 2, 8),
                                               alibi_slopes=torch.zeros(3)),
                    r"alibi_slopes must have shape .*\(2,\).*\(3,\)"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_name_the_argument_and_shapes(case):
    call, match = ERRORS[case]
    with pytest.raises(FlashAttnError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    with pytest.raises(RuntimeError):  # how flash-attn code catches it
        call()


def test_signatures_are_flash_attn_2_8_3s():
    common = ["dropout_p=0.0", "softmax_scale=None", "causal=False", "window_size=(-1, -1)",
              "softcap=0.0", "alibi_slopes=None", "deterministic=False",
              "return_attn_probs=False"]
    want = {
        "flash_attn_func": ["q", "k", "v", *common],
        "flash_attn_qkvpacked_func": ["qkv", *common],
        "flash_attn_kvpacked_func": ["q", "kv", *common],
        "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                   "max_seqlen_q", "max_seqlen_k", *common, "block_table=None"],
        "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", *common],
        "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                            "max_seqlen_q", "max_seqlen_k", *common],
        "flash_attn_with_kvcache": [
            "q", "k_cache", "v_cache", "k=None", "v=None", "rotary_cos=None", "rotary_sin=None",
            "cache_seqlens=None", "cache_batch_idx=None", "cache_leftpad=None",
            "block_table=None", "softmax_scale=None", "causal=False", "window_size=(-1, -1)",
            "softcap=0.0", "rotary_interleaved=True", "alibi_slopes=None", "num_splits=0",
            "return_softmax_lse=False"],
    }
    for name, params in want.items():
        sig = inspect.signature(getattr(fa, name)).parameters.values()
        got = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in sig]
        assert got == params, name
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig), name


# -- bert_padding and rotary -------------------------------------------------------------------

def test_bert_padding_round_trip():
    x = randn(3, 5, 2, 4).float().requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    packed, indices, cu, max_len, used = unpad_input(x, mask)
    assert packed.shape == (9, 2, 4) and cu.tolist() == [0, 2, 7, 9] and max_len == 5
    assert cu.dtype == torch.int32 and used.tolist() == [2, 5, 2]
    assert torch.equal(packed, x.detach()[mask.bool()])
    back = pad_input(packed, indices, 3, 5)
    assert torch.equal(back, x.detach() * mask[..., None, None])
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].float().expand_as(x))
    unused = torch.tensor([[0, 0, 1, 0, 0], [0] * 5, [0] * 5])
    packed, _, cu, _, used = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 3, 8, 10] and used.tolist() == [2, 5, 2]
    assert torch.equal(index_first_axis(x.detach().flatten(0, 1), indices[:2]),
                       x.detach()[0, :2])


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rotary_emb(interleaved):
    x = randn(2, 5, 3, 16).float()
    cos, sin = cos_sin(12, 6)
    offs = torch.tensor([0, 4], dtype=torch.int32)
    got = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offs)
    pos = offs.long()[:, None] + torch.arange(5)
    torch.testing.assert_close(got.double(), rotary_reference(x, cos, sin, pos, interleaved))
    # packed: positions inside each sequence, plus the offset
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    packed = apply_rotary_emb(x.flatten(0, 1), cos, sin, interleaved, seqlen_offsets=offs,
                              cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(packed, got.flatten(0, 1))
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, interleaved, inplace=True, seqlen_offsets=offs) is y
    torch.testing.assert_close(y, got)


# -- hardening (issue 21): page ids, isolation, integer-likes, empty batches, caller's names --

def _paged_batch(page=4, seqlens=(5, 11, 0), Hkv=2, D=16, seed=0):
    """q (B, 2, 4, D), new k / v (B, 1, Hkv, D), a paged k / v cache of random pages holding
    ``seqlens`` keys per row (shuffled page table, two spare pages) and cache_seqlens."""
    B = len(seqlens)
    pages = -(-(max(seqlens) + 1) // page)
    q = randn(B, 2, 2 * Hkv, D, seed=seed).float()
    k, v = randn(B, 1, Hkv, D, seed=seed + 1).float(), randn(B, 1, Hkv, D, seed=seed + 2).float()
    flat = randn(B * pages * page, Hkv, D, seed=seed + 3).float()
    cu = list(range(0, B * pages * page + 1, pages * page))
    kc, table = _paged(flat, cu, page, pages, seed=seed)
    vc, _ = _paged(randn(*flat.shape, seed=seed + 4).float(), cu, page, pages, seed=seed)
    return q, k, v, kc, vc, table, torch.tensor(seqlens, dtype=torch.int32)


BAD_IDS = [((0, 0), -1), ((1, 2), -3), ((2, 1), "num_blocks"), ((0, 2), 10 ** 6)]  # (0, 2): unused


@pytest.mark.parametrize("where, bad", BAD_IDS)
@pytest.mark.parametrize("fn", ["kvcache", "varlen"])
def test_block_table_ids_are_checked_before_any_read_or_write(fn, where, bad):
    """A negative page id wrapped around to another sequence's page (a silent write when k /
    v are appended); a too large one gave a raw IndexError."""
    q, k, v, kc, vc, table, seqlens = _paged_batch()
    bad = kc.shape[0] if bad == "num_blocks" else bad
    table[where] = bad
    before = kc.clone(), vc.clone()
    if fn == "kvcache":
        call = lambda: fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,  # noqa: E731
                                                  block_table=table, causal=True)
    else:
        lk = seqlens.long() + 1
        cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lk.cumsum(0)]).int()
        cu_q = torch.arange(0, 2 * len(seqlens) + 1, 2, dtype=torch.int32)
        call = lambda: fa.flash_attn_varlen_func(q.flatten(0, 1), kc, vc, cu_q, cu_k, 2,  # noqa: E731
                                                 int(lk.max()), causal=True, block_table=table)
    with pytest.raises(FlashAttnError, match=rf"block_table\[{where[0]}, {where[1]}\] = {bad}\b"
                       rf".*\[0, {kc.shape[0]}\)"):
        call()
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])  # nothing written


POISONS = [float("nan"), float("inf")]


def _own_slots(kc, table, seqlens, b, region):
    """(num_blocks, page) bool: the slots a poisoning leaves alone for row b. "unused":
    every slot some row uses (the tails past cache_seqlens and the spare pages get poisoned);
    "others": row b's own keys only (the other rows' pages get poisoned too)."""
    page = kc.shape[1]
    keep = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for r in (range(len(seqlens)) if region == "unused" else [b]):
        for t in range(int(seqlens[r])):
            keep[table[r, t // page], t % page] = True
    return keep


@pytest.mark.parametrize("region", ["unused", "others"])
@pytest.mark.parametrize("poison", POISONS)
def test_paged_kvcache_reads_only_each_rows_own_keys(kv_path, poison, region):
    """Row b's output does not change by a bit when cache slots outside its own keys hold
    NaN / inf / huge values: the unused tail of each last page and the spare pages, or also
    the other rows' pages (in use by them); k / v appended on both runs. ("others" on the
    batched path relies on attn.varlen_attention isolating packed sequences' values.)"""
    q, k, v, kc, vc, table, seqlens = _paged_batch()
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True, return_softmax_lse=True)
    clean, clean_lse = fa.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    for b in range(len(seqlens)):
        keep = _own_slots(kc, table, seqlens, b, region)
        kp, vp = (c.masked_fill(~keep[..., None, None], poison) for c in (kc, vc))
        out, lse = fa.flash_attn_with_kvcache(q, kp, vp, k, v, **kw)
        assert torch.equal(out[b], clean[b]) and torch.equal(lse[b], clean_lse[b]), b
        assert torch.isfinite(out[b]).all()


@pytest.mark.parametrize("region", ["unused", "others"])
@pytest.mark.parametrize("poison", POISONS)
def test_paged_varlen_reads_only_each_sequences_own_keys(poison, region):
    """flash_attn_varlen_func(block_table=...): the same isolation as the KV cache ("others"
    relies on attn.varlen_attention isolating packed sequences' values)."""
    q, _, _, kc, vc, table, seqlens = _paged_batch(page=3, seqlens=(7, 2, 9))
    B = len(seqlens)
    q = q.flatten(0, 1)  # (B·2, H, D)
    cu_q = torch.arange(0, 2 * B + 1, 2, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), seqlens.cumsum(0).int()])
    args = (cu_q, cu_k, 2, int(seqlens.max()))
    clean = fa.flash_attn_varlen_func(q, kc, vc, *args, causal=True, block_table=table)
    for b in range(B):
        keep = _own_slots(kc, table, seqlens, b, region)
        kp, vp = (c.masked_fill(~keep[..., None, None], poison) for c in (kc, vc))
        out = fa.flash_attn_varlen_func(q, kp, vp, *args, causal=True, block_table=table)
        rows = slice(2 * b, 2 * b + 2)
        assert torch.equal(out[rows], clean[rows]) and torch.isfinite(out[rows]).all(), b


@pytest.mark.parametrize("packing", ["separate", "kvpacked", "qkvpacked"])
@pytest.mark.parametrize("poison", POISONS)
def test_varlen_poison_in_one_sequence_stays_there(packing, poison):
    """NaN / inf / huge keys and values of one packed sequence leave every other sequence's
    output bit for bit (compat passes packed sequences to attn.varlen_attention)."""
    lengths = [5, 9, 4]
    cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    qkv = randn(18, 3, 2, 16).float()

    def run(x):
        if packing == "qkvpacked":
            return fa.flash_attn_varlen_qkvpacked_func(x, cu, 9, causal=True)
        if packing == "kvpacked":
            return fa.flash_attn_varlen_kvpacked_func(x[:, 0], x[:, 1:], cu, cu, 9, 9,
                                                      causal=True)
        return fa.flash_attn_varlen_func(*x.unbind(1), cu, cu, 9, 9, causal=True)
    clean = run(qkv)
    for b in range(len(lengths)):
        poisoned = qkv.clone()
        poisoned[cu[b]:cu[b + 1], 1:] = poison  # sequence b's k and v
        out = run(poisoned)
        others = torch.ones(18, dtype=torch.bool)
        others[cu[b]:cu[b + 1]] = False
        assert torch.equal(out[others], clean[others]), b
        assert torch.isfinite(out[others]).all(), b


@pytest.mark.parametrize("poison", POISONS)
def test_kvcache_rows_are_isolated(kv_path, poison):
    """A contiguous cache with ragged rows: row b's output ignores every other row and its
    own slots past cache_seqlens + new."""
    B, cap = 3, 12
    q = randn(B, 2, 4, 16).float()
    kc, vc = randn(B, cap, 2, 16, seed=1).float(), randn(B, cap, 2, 16, seed=2).float()
    k, v = randn(B, 1, 2, 16, seed=3).float(), randn(B, 1, 2, 16, seed=4).float()
    seqlens = torch.tensor([3, 10, 6], dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, causal=True)
    clean = fa.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    for b in range(B):
        own = torch.zeros(B, cap, dtype=torch.bool)
        own[b, :int(seqlens[b])] = True
        kp, vp = (c.masked_fill(~own[..., None, None], poison) for c in (kc, vc))
        out = fa.flash_attn_with_kvcache(q, kp, vp, k, v, **kw)
        assert torch.equal(out[b], clean[b]) and torch.isfinite(out[b]).all(), b


WINDOWS = {  # flash-attn's tests pass torch.randint(0, seqlen_k, (2,))
    "tensor": lambda l, r: torch.tensor([l, r]),
    "int32 tensor": lambda l, r: torch.tensor([l, r], dtype=torch.int32),
    "numpy ints": lambda l, r: (np.int64(l), np.int32(r)),
    "numpy array": lambda l, r: np.array([l, r]),
    "0-d and 1-element tensors": lambda l, r: [torch.tensor(l), torch.tensor([r])],
}


@pytest.mark.parametrize("form", list(WINDOWS))
def test_window_size_takes_integer_likes(form):
    window = WINDOWS[form](3, 1)
    inputs = (randn(2, 9, 4, 16), randn(2, 13, 2, 16, seed=1), randn(2, 13, 2, 16, seed=2))

    def fn(q, k, v):
        out, lse, _ = fa.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
        return out, lse
    compare(fn, differentiable_reference(window_size=(3, 1)), inputs, torch.float32, grad=False)


def test_window_size_tensor_in_varlen_and_kvcache():
    """Every function that takes a window reads it the same way (flash-attn's tests' form)."""
    window = torch.tensor([3, 1])
    q, k, v = randn(2, 9, 4, 16).float(), randn(2, 13, 2, 16, seed=1).float(), \
        randn(2, 13, 2, 16, seed=2).float()
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (9, 13))
    got = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                    cu_k, 9, 13, window_size=window)
    want, _ = fa_reference(q, k, v, window_size=(3, 1))
    torch.testing.assert_close(got.double(), want.flatten(0, 1), rtol=0, atol=2e-5)
    seqlens = torch.tensor([13, 7], dtype=torch.int32)
    got = fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, window_size=window)
    _, _, want, _ = kvcache_reference(q, k, v, None, None, cache_seqlens=seqlens,
                                      window_size=(3, 1))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("window", [(1.5, 2), (True, 0), torch.tensor([1.0, 2.0]),
                                    torch.tensor([1, 2, 3]), (1,), "(1, 2)", np.array([[1, 2]])])
def test_window_size_refuses_non_integers(window):
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(FlashAttnError, match="window_size must be a pair of ints"):
        fa.flash_attn_func(x, x, x, window_size=window)


@pytest.mark.parametrize("offsets", [
    torch.tensor([0, 5], dtype=torch.int32), torch.tensor([3, 0]), torch.tensor(2), 4,
    np.int64(1)])
def test_apply_rotary_emb_offsets(offsets):
    """seqlen_offsets as flash-attn takes it: an int, or a (batch_size,) int tensor."""
    x = randn(2, 5, 3, 16).float()
    cos, sin = cos_sin(10, 8)
    got = apply_rotary_emb(x, cos, sin, True, seqlen_offsets=offsets)
    pos = torch.as_tensor(offsets).long().expand(2)[:, None] + torch.arange(5)
    torch.testing.assert_close(got.double(), rotary_reference(x, cos, sin, pos, True))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    packed = apply_rotary_emb(x.flatten(0, 1), cos, sin, True, seqlen_offsets=offsets,
                              cu_seqlens=cu, max_seqlen=5)
    torch.testing.assert_close(packed.double(), rotary_reference(x, cos, sin, pos, True)
                               .flatten(0, 1))


def test_kvcache_rotary_window_minus_one_zero_is_causal(kv_path):
    """In flash-attn 2.8.3 window_size=(-1, 0) is the causal kernel, causal=True or not, so
    q's rotary positions advance row by row in both."""
    B, Nq, cap = 2, 3, 16
    q = randn(B, Nq, 4, 16).float()
    kc, vc = randn(B, cap, 2, 16, seed=1).float(), randn(B, cap, 2, 16, seed=2).float()
    k, v = randn(B, Nq, 2, 16, seed=3).float(), randn(B, Nq, 2, 16, seed=4).float()
    seqlens = torch.tensor([2, 9], dtype=torch.int32)
    rotary = cos_sin(cap, 8)
    _, _, want, _ = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, rotary=rotary,
                                      causal=True)
    for causal in (False, True):
        out = fa.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, *rotary,
                                         cache_seqlens=seqlens, causal=causal,
                                         window_size=(-1, 0))
        torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, 0)),
                                            (False, (2, 1))])
def test_kvcache_rotary_table_must_cover_qs_positions(causal, window):
    """q rows sit at cache_seqlens + i under a causal or local kernel: a table long enough
    for the one new key but not for q's last row is refused."""
    q = torch.zeros(1, 3, 2, 8)
    kc = torch.zeros(1, 8, 2, 8)
    new = torch.zeros(1, 1, 2, 8)
    cos = torch.zeros(5, 2)  # rows 0..4: the new key at 4 fits, q's rows 4..6 do not
    with pytest.raises(FlashAttnError, match=r"have 5 rows; q needs positions from 4 up to 6"):
        fa.flash_attn_with_kvcache(q, kc, kc.clone(), new, new, cos, cos, cache_seqlens=4,
                                   causal=causal, window_size=window)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_all_rows_empty(kv_path, paged):
    """Every cache_seqlens 0 (no new key): zeros and lse +inf, as one empty row among others."""
    B, H, cap = 2, 4, 8
    q = randn(B, 3, H, 16).float()
    kc, vc = randn(B, cap, 2, 16, seed=1).float(), randn(B, cap, 2, 16, seed=2).float()
    kw = dict(block_table=torch.arange(B * 2, dtype=torch.int32).view(B, 2)) if paged else {}
    if paged:
        kc, vc = kc.view(B * 2, cap // 2, 2, 16), vc.view(B * 2, cap // 2, 2, 16)
    for seqlens in (0, torch.zeros(B, dtype=torch.int32)):
        out, lse = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                              return_softmax_lse=True, **kw)
        assert out.shape == (B, 3, H, 16) and out.dtype == q.dtype and lse.shape == (B, H, 3)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


_x = torch.zeros
_cu = torch.tensor([0, 4], dtype=torch.int32)
_I = dict(dtype=torch.int32)
# each call passes a wrong shape or dtype; the message names the argument as the caller
# passed it (its name, and its shape in the caller's layout), never attn's internal q/k/v
CALLER_NAMES = {
    "func batch": (lambda: fa.flash_attn_func(_x(2, 4, 2, 8), _x(3, 4, 2, 8), _x(3, 4, 2, 8)),
                   r"\bk \(3, 4, 2, 8\)"),
    "func dtypes": (lambda: fa.flash_attn_func(_x(1, 4, 2, 8), _x(1, 4, 2, 8).double(),
                                               _x(1, 4, 2, 8).double()), r"q, k and v must share"),
    "func empty": (lambda: fa.flash_attn_func(_x(1, 0, 2, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8)),
                   r"\bq \(1, 0, 2, 8\)"),
    "qkvpacked dtype": (lambda: fa.flash_attn_qkvpacked_func(_x(1, 4, 3, 2, 8, dtype=torch.int64)),
                        r"^qkv must be float"),
    "qkvpacked empty": (lambda: fa.flash_attn_qkvpacked_func(_x(1, 0, 3, 2, 8)),
                        r"\bqkv \(1, 0, 3, 2, 8\)"),
    "kvpacked batch": (lambda: fa.flash_attn_kvpacked_func(_x(2, 4, 2, 8), _x(3, 4, 2, 2, 8)),
                       r"\bkv \(3, 4, 2, 2, 8\)"),
    "kvpacked heads": (lambda: fa.flash_attn_kvpacked_func(_x(1, 4, 3, 8), _x(1, 4, 2, 2, 8)),
                       r"heads in kv \(2\).*\bkv \(1, 4, 2, 2, 8\)"),
    "kvpacked dtype": (lambda: fa.flash_attn_kvpacked_func(_x(1, 4, 2, 8),
                                                           _x(1, 4, 2, 2, 8).double()),
                       r"q and kv must share a dtype"),
    "varlen dtypes": (lambda: fa.flash_attn_varlen_func(
        _x(4, 2, 8), _x(4, 2, 8).double(), _x(4, 2, 8).double(), _cu, _cu, 4, 4),
        r"q, k and v must share"),
    "varlen qkvpacked dtype": (lambda: fa.flash_attn_varlen_qkvpacked_func(
        _x(4, 3, 2, 8, **_I), _cu, 4), r"^qkv must be float"),
    "varlen kvpacked head dim": (lambda: fa.flash_attn_varlen_kvpacked_func(
        _x(4, 2, 8), _x(4, 2, 2, 4), _cu, _cu, 4, 4), r"q and kv head dims.*\bkv \(4, 2, 2, 4\)"),
    "varlen max_seqlen type": (lambda: fa.flash_attn_varlen_qkvpacked_func(
        _x(4, 3, 2, 8), _cu, "4"), r"^max_seqlen must be an int"),
    "paged varlen dtype": (lambda: fa.flash_attn_varlen_func(
        _x(4, 2, 8), _x(3, 4, 2, 8).double(), _x(3, 4, 2, 8).double(), _cu, _cu, 4, 4,
        block_table=torch.tensor([[0]], **_I)), r"q, k and v must share"),
    "kvcache dtype": (lambda: fa.flash_attn_with_kvcache(
        _x(1, 1, 2, 8), _x(1, 8, 2, 8).double(), _x(1, 8, 2, 8).double(), cache_seqlens=3),
        r"q, k_cache and v_cache must share"),
    "kvcache head dim": (lambda: fa.flash_attn_with_kvcache(
        _x(1, 1, 2, 8), _x(1, 8, 2, 4), _x(1, 8, 2, 4), cache_seqlens=3),
        r"q and k_cache head dims.*\bk_cache \(1, 8, 2, 4\)"),
    "kvcache empty q": (lambda: fa.flash_attn_with_kvcache(
        _x(1, 0, 2, 8), _x(1, 8, 2, 8), _x(1, 8, 2, 8), cache_seqlens=3), r"\bq \(1, 0, 2, 8\)"),
    "kvcache paged heads": (lambda: fa.flash_attn_with_kvcache(
        _x(1, 1, 3, 8), _x(4, 4, 2, 8), _x(4, 4, 2, 8), cache_seqlens=3,
        block_table=torch.tensor([[0, 1]], **_I)), r"heads in k_cache and v_cache \(2\)"),
    "kvcache new k dtype": (lambda: fa.flash_attn_with_kvcache(
        _x(1, 1, 2, 8), _x(1, 8, 2, 8), _x(1, 8, 2, 8), _x(1, 1, 2, 8, **_I),
        _x(1, 1, 2, 8, **_I), cache_seqlens=3), r"^k must be float"),
    "softcap type": (lambda: fa.flash_attn_func(_x(1, 4, 2, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8),
                                                softcap="30"), r"^softcap must be a float"),
    "softcap tensor": (lambda: fa.flash_attn_varlen_func(
        _x(4, 2, 8), _x(4, 2, 8), _x(4, 2, 8), _cu, _cu, 4, 4, softcap=torch.tensor(30.0)),
        r"^softcap must be a float"),
    "softcap nan": (lambda: fa.flash_attn_func(_x(1, 4, 2, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8),
                                               softcap=float("nan")), r"^softcap must not be NaN"),
    "softmax_scale type": (lambda: fa.flash_attn_func(
        _x(1, 4, 2, 8), _x(1, 4, 2, 8), _x(1, 4, 2, 8), softmax_scale="0.1"),
        r"^softmax_scale must be a float"),
    "rotary cos shape": (lambda: apply_rotary_emb(_x(1, 4, 2, 8), _x(8, 2, 1), _x(8, 2)),
                         r"^cos and sin must both be.*\(8, 2, 1\)"),
    "rotary seqlen_offsets shape": (lambda: apply_rotary_emb(
        _x(2, 4, 2, 8), _x(8, 2), _x(8, 2), seqlen_offsets=torch.tensor([1, 2, 3])),
        r"^seqlen_offsets must be .*\(2,\).*\(3,\)"),
    "rotary seqlen_offsets type": (lambda: apply_rotary_emb(
        _x(2, 4, 2, 8), _x(8, 2), _x(8, 2), seqlen_offsets=1.5), r"^seqlen_offsets must be"),
    "rotary cu_seqlens": (lambda: apply_rotary_emb(_x(4, 2, 8), _x(8, 2), _x(8, 2),
                                                   cu_seqlens=torch.tensor([0, 5], **_I),
                                                   max_seqlen=5), r"^cu_seqlens must .*\[0, 5\]"),
    "rotary table": (lambda: apply_rotary_emb(_x(1, 4, 2, 8), _x(3, 2), _x(3, 2)),
                     r"^cos/sin have 3 rows; x needs positions from 0 up to 3"),
    "unpad_input mask shape": (lambda: unpad_input(_x(2, 4, 8), torch.ones(2, 5)),
                               r"^attention_mask must be .*\(2, 4\).*\(2, 5\)"),
    "unpad_input mask rank": (lambda: unpad_input(_x(2, 4, 8), torch.ones(8)),
                              r"^attention_mask must be .*\(8,\)"),
    "unpad_input unused_mask": (lambda: unpad_input(_x(2, 4, 8), torch.ones(2, 4),
                                                    torch.zeros(4, 2)), r"^unused_mask must be"),
    "pad_input indices": (lambda: pad_input(_x(3, 8), torch.tensor([0, 1, 9]), 2, 4),
                          r"^indices must lie in \[0, 8\).* 9"),
    "pad_input negative index": (lambda: pad_input(_x(3, 8), torch.tensor([0, -1, 2]), 2, 4),
                                 r"^indices must lie in \[0, 8\).*-1"),
    "pad_input count": (lambda: pad_input(_x(3, 8), torch.tensor([0, 1]), 2, 4),
                        r"^indices \(2,\) must hold one position per row of hidden_states"),
    "index_first_axis": (lambda: index_first_axis(_x(3, 8), torch.tensor([0, 5])),
                         r"^indices must lie in \[0, 3\)"),
}


@pytest.mark.parametrize("case", list(CALLER_NAMES))
def test_errors_name_the_callers_arguments(case):
    call, match = CALLER_NAMES[case]
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert re.search(match, str(info.value)), f"{type(info.value).__name__}: {info.value}"
    if isinstance(info.value, ValueError):
        assert isinstance(info.value, FlashAttnError)  # ValueError and flash-attn's RuntimeError


# -- install_flash_attn ------------------------------------------------------------------------

@pytest.fixture
def clean_modules():
    saved = {n: m for n, m in sys.modules.items()
             if n == "flash_attn" or n.startswith("flash_attn.")}
    yield
    uninstall_flash_attn()
    for n in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[n]
    sys.modules.update(saved)


def test_install_registers_the_modules(clean_modules):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed here")
    assert install_flash_attn() is True
    assert install_flash_attn() is True  # idempotent
    import flash_attn
    from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: F401
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input  # noqa: F401
    from flash_attn.flash_attn_interface import flash_attn_varlen_func
    from flash_attn.layers.rotary import apply_rotary_emb  # noqa: F401, F811

    assert flash_attn.__version__ == "2.8.3"
    spec = importlib.util.find_spec("flash_attn")
    assert spec is not None and spec.name == "flash_attn" and spec.submodule_search_locations == []
    assert importlib.util.find_spec("flash_attn.layers.rotary").name == "flash_attn.layers.rotary"
    assert flash_attn_varlen_func is fa.flash_attn_varlen_func
    assert flash_attn.flash_attn_interface.flash_attn_func is fa.flash_attn_func
    assert uninstall_flash_attn() is True
    assert "flash_attn" not in sys.modules and uninstall_flash_attn() is False


def test_install_leaves_a_real_flash_attn_alone(clean_modules, tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = 'real'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for n in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        del sys.modules[n]
    assert install_flash_attn() is False
    import flash_attn
    assert flash_attn.__version__ == "real"
    assert install_flash_attn(force=True) is True
    assert sys.modules["flash_attn"].__version__ == "2.8.3"
    assert uninstall_flash_attn() is True
    assert sys.modules["flash_attn"].__version__ == "real"  # put back


MODEL = '''
"""A tiny GQA transformer written only against flash_attn (prefill + decode), checked
against the same weights run through torch SDPA over the whole sequence at every step."""
import sys
import torch
import torch.nn.functional as F
from flash_attn import flash_attn_with_kvcache
from flash_attn.layers.rotary import apply_rotary_emb

V, C, H, HKV, HD, LAYERS, CAP = 50, 32, 4, 2, 8, 2, 32
g = torch.Generator().manual_seed(0)
W = [{n: torch.randn(*s, generator=g) * 0.3 for n, s in
      (("q", (C, H * HD)), ("k", (C, HKV * HD)), ("v", (C, HKV * HD)), ("o", (H * HD, C)))}
     for _ in range(LAYERS)]
EMB = torch.randn(V, C, generator=g)
inv = 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD)
ang = torch.arange(CAP).float()[:, None] * inv
COS, SIN = ang.cos(), ang.sin()


def fa_forward(tokens, caches, start, block_table=None):
    B, T = tokens.shape
    x = EMB[tokens]
    for w, (kc, vc) in zip(W, caches):
        q = (x @ w["q"]).view(B, T, H, HD)
        k = (x @ w["k"]).view(B, T, HKV, HD)
        v = (x @ w["v"]).view(B, T, HKV, HD)
        o = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=COS, rotary_sin=SIN,
                                    cache_seqlens=start, block_table=block_table,
                                    causal=True, rotary_interleaved=False)
        x = x + o.reshape(B, T, H * HD) @ w["o"]
    return x @ EMB.T


def sdpa_forward(tokens):
    B, T = tokens.shape
    x = EMB[tokens]
    for w in W:
        q = (x @ w["q"]).view(B, T, H, HD)
        k = (x @ w["k"]).view(B, T, HKV, HD)
        q, k = (apply_rotary_emb(t, COS, SIN, interleaved=False) for t in (q, k))
        v = (x @ w["v"]).view(B, T, HKV, HD)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))  # GQA for SDPA
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + o.transpose(1, 2).reshape(B, T, H * HD) @ w["o"]
    return x @ EMB.T


def generate(paged, steps):
    B, P = 2, 6
    tokens = torch.randint(0, V, (B, P), generator=torch.Generator().manual_seed(1))
    if paged:
        page = 5
        n = -(-CAP // page)
        table = torch.randperm(B * n, generator=torch.Generator().manual_seed(2))
        table = table.view(B, n).to(torch.int32)
        caches = [(torch.zeros(B * n, page, HKV, HD), torch.zeros(B * n, page, HKV, HD))
                  for _ in W]
    else:
        table = None
        caches = [(torch.zeros(B, CAP, HKV, HD), torch.zeros(B, CAP, HKV, HD)) for _ in W]
    with torch.inference_mode():
        logits = fa_forward(tokens, caches, 0, table)[:, -1]
        for step in range(steps):
            want = sdpa_forward(tokens)[:, -1]
            assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4), (step, logits - want)
            nxt = logits.argmax(-1, keepdim=True)
            lengths = torch.full((B,), tokens.shape[1], dtype=torch.int32)
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = fa_forward(nxt, caches, lengths, table)[:, -1]
    return tokens


steps = int(sys.argv[1])
a, b = generate(False, steps), generate(True, steps)
assert torch.equal(a, b)
print("decoded", a.tolist(), "argv", sys.argv[1:])
'''


def test_model_on_flash_attn_runs_under_python_m_attn_compat(tmp_path):
    script = tmp_path / "decode.py"
    script.write_text(MODEL)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-m", "attn.compat", str(script), "5"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "decoded" in res.stdout and "argv ['5']" in res.stdout


def test_model_in_process_with_sys_modules_restored(clean_modules):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed here")
    assert install_flash_attn()
    namespace = {"__name__": "model"}
    code = MODEL.replace("steps = int(sys.argv[1])", "steps = 2")
    exec(compile(code, "model", "exec"), namespace)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_func_on_cuda(dtype):
    kw = dict(causal=True, window_size=(40, -1), softcap=0.0)

    def fn(q, k, v):
        out, lse, _ = fa.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), return_attn_probs=True,
                                         **kw)
        return out.cpu(), lse.cpu()
    inputs = (randn(2, 97, 4, 64), randn(2, 128, 2, 64, seed=1), randn(2, 128, 2, 64, seed=2))
    compare(fn, differentiable_reference(**kw), inputs, dtype)
