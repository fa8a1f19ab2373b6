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
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attn
from attn.compat import flash_attn as fa
from attn.compat import install_flash_attn, uninstall_flash_attn
from attn.compat.bert_padding import index_first_axis, pad_input, unpad_input
from attn.compat.flash_attn import FlashAttnError
from attn.compat.rotary import apply_rotary_emb

ROOT = Path(__file__).resolve().parent.parent
HAS_ALIBI = "alibi_slopes" in inspect.signature(attn.attention).parameters
needs_alibi = pytest.mark.skipif(not HAS_ALIBI, reason="attn.attention has no alibi_slopes yet "
                                 "(branch alibi)")
FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2.0 ** -8}


# -- the reference --------------------------------------------------------------------------

def resolve_window(causal, window_size, seqlen_k):
    """flash-attn 2.8.3's rule: sides >= seqlen_k are unbounded, causal sets right = 0, a
    -1 beside a bounded side stands for seqlen_k. Returns (left, right, pure_causal)."""
    left, right = window_size
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

@pytest.fixture(params=["per-row", "batched"])
def kv_path(request, monkeypatch):
    """flash_attn_with_kvcache's two paths: row by row (CPU) and one batched / packed call
    (other devices), both run here on CPU."""
    if request.param == "batched":
        monkeypatch.setattr("attn.compat.flash_attn._PER_ROW_DEVICES", ())
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
    torch.testing.assert_close(out, fa.flash_attn_func(q, kc, vc, causal=True))  # per-row vs batched GEMMs: not bitwise
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
              r"heads in k/v \(2\) must divide .* \(5\).*\(1, 4, 5, 8\)"),
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
