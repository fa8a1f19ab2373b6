"""The reference against torch, tiled's own checks (gradcheck, dropout, merge, dtypes, lse).

The backend-parametrized comparison with the reference (lengths, head dims, variants, edge
cases) is tests/test_variants.py."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.testing import assert_close_to_reference, make_inputs

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
tiled = partial(attn.attention, backend="tiled")


def _ids(d):
    return str(d).removeprefix("torch.")


# -- the reference itself, against torch's SDPA where SDPA can say the same thing --------------

@pytest.mark.parametrize("case", ["plain", "causal_square", "bool_mask", "float_mask", "gqa",
                                  "scale", "causal_rect"])
def test_reference_matches_torch_sdpa(case):
    nk = 40 if case == "causal_rect" else 33
    q, k, v = make_inputs(B=2, H=4, Hkv=2 if case == "gqa" else 4, N=33, Nk=nk, D=16,
                          dtype=torch.float64, seed=5)
    kw, tkw = {}, {}
    if case == "causal_square":
        kw, tkw = {"causal": True}, {"is_causal": True}
    if case == "causal_rect":  # ours is bottom-right: torch's explicit lower-right bias
        from torch.nn.attention.bias import causal_lower_right
        kw, tkw = {"causal": True}, {"attn_mask": causal_lower_right(33, nk)}
    if case == "bool_mask":
        m = torch.rand(2, 4, 33, 33, generator=torch.Generator().manual_seed(0)) > 0.4
        kw = tkw = {"attn_mask": m}
    if case == "float_mask":
        m = torch.randn(33, 33, dtype=torch.float64)
        kw = tkw = {"attn_mask": m}
    if case == "scale":
        kw = tkw = {"scale": 0.05}
    ours = attn.attention(q, k, v, backend="reference", **kw)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=case == "gqa", **tkw)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


# -- gradcheck: the hand-written backward against finite differences ---------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_gradcheck_all_variants(causal, heads):
    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (t.requires_grad_() for t in make_inputs(B=1, H=H, Hkv=Hkv, N=7, Nk=9, D=4, Dv=3,
                                                      dtype=torch.float64, seed=1))
    temp = (torch.rand(H, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    sinks = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
    cap = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, H, 7, 9, generator=g, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, temp, sinks, cap, bias):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        out, lse = tiled(q, k, v, causal=causal, temperature=temp, sinks=sinks, softcap=cap,
                         window=(5, 2), attn_mask=bias, dropout_p=0.2, return_lse=True,
                         block_m=4, block_n=3)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v, temp, sinks, cap, bias), eps=1e-6, atol=1e-7)


# -- edge cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [(0, 0), (2, 1), (0, -1)])
def test_window_matches_explicit_mask(window):
    q, k, v = make_inputs(B=1, H=2, N=30, Nk=40, D=8, dtype=torch.float64, seed=4)
    i = torch.arange(30)[:, None]
    j = torch.arange(40)[None, :]
    rel = j - (i + 10)  # bottom-right diagonal offset Nk - Nq
    left, right = window
    allowed = (rel >= -left) & ((rel <= right) if right >= 0 else True)
    ours = attn.attention(q, k, v, window=window, backend="tiled")
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_temperature_limits(backend):
    q, k, v = make_inputs(B=1, H=2, N=17, Nk=23, D=16, dtype=torch.float64, seed=6)
    # τ → 0: attention becomes the argmax key's value
    cold = attn.attention(q, k, v, temperature=1e-3, backend=backend)
    idx = (q @ k.transpose(-1, -2)).argmax(-1)
    argmax_v = torch.gather(v, 2, idx[..., None].expand(-1, -1, -1, 16))
    torch.testing.assert_close(cold, argmax_v, rtol=0, atol=1e-6)
    # τ → ∞: attention becomes the mean of the values
    hot = attn.attention(q, k, v, temperature=1e3, backend=backend)
    torch.testing.assert_close(hot, v.mean(2, keepdim=True).expand_as(hot), rtol=0, atol=5e-3)
    assert_close_to_reference(tiled, q.float(), k.float(), v.float(), temperature=1e-3)
    assert_close_to_reference(tiled, q.float(), k.float(), v.float(), temperature=1e3)


# -- dropout -----------------------------------------------------------------------------------

def test_dropout_reproducible_and_unbiased():
    q, k, v = make_inputs(B=1, H=2, N=32, D=16, seed=0)
    torch.manual_seed(123)
    a = tiled(q, k, v, dropout_p=0.5)
    torch.manual_seed(123)
    b = tiled(q, k, v, dropout_p=0.5)
    c = tiled(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # averaged over many masks, dropout (scaled by 1/(1-p)) leaves the output unchanged
    mean = torch.stack([tiled(q, k, v, dropout_p=0.5) for _ in range(200)]).mean(0)
    exact = tiled(q, k, v)
    assert (mean - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_dropout_keep_rate():
    from attn.masks import dropout_keep
    keep = dropout_keep(42, torch.arange(6), torch.arange(300), torch.arange(500), 0.3)
    rate = keep.float().mean().item()
    assert abs(rate - 0.7) < 0.005
    # no structure along rows or columns
    assert keep.float().mean(-1).std() < 0.05 and keep.float().mean(-2).std() < 0.05


# -- merge -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_ids)
def test_merge_two_halves_equals_full(dtype):
    q, k, v = make_inputs(B=2, H=2, N=24, Nk=50, D=16, dtype=dtype, seed=8)
    mask = torch.ones(24, 50, dtype=torch.bool)
    mask[5, :30] = False  # row 5 sees nothing in the first part
    mask[6] = False  # row 6 sees nothing at all
    full, lse = tiled(q, k, v, attn_mask=mask, return_lse=True)
    a, lse_a = tiled(q, k[:, :, :30], v[:, :, :30], attn_mask=mask[:, :30], return_lse=True)
    b, lse_b = tiled(q, k[:, :, 30:], v[:, :, 30:], attn_mask=mask[:, 30:], return_lse=True)
    out, lse_m = attn.merge_attention(a, lse_a, b, lse_b)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, full, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_m, lse.to(lse_m.dtype), rtol=tol, atol=tol)
    assert (out[:, :, 6] == 0).all() and torch.isinf(lse_m[:, :, 6]).all()


def test_merge_rejects_mismatched_shapes():
    a = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="out_a"):
        attn.merge_attention(a, torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, 5), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="lse"):
        attn.merge_attention(a, torch.zeros(1, 2, 4), a, torch.zeros(1, 2, 3))


# -- layouts, dtypes and the lse output ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_output_dtypes(dtype, backend):
    q, k, v = make_inputs(B=1, H=2, N=9, D=8, dtype=dtype)
    temp = torch.ones(2, requires_grad=True)  # a float32 parameter must not change the output dtype
    out, lse = attn.attention(q, k, v, temperature=temp, return_lse=True, backend=backend)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (1, 2, 9)


def test_gradient_through_lse_only():
    q, k, v = make_inputs(B=1, H=2, N=40, Nk=33, D=8, dtype=torch.float64)
    grads = []
    for backend in ("tiled", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        _, lse = attn.attention(*leaves, causal=True, return_lse=True, backend=backend,
                                block_m=16, block_n=32)
        torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
        grads.append([torch.zeros_like(t) if t.grad is None else t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sdpa_backend_refuses_dropout():
    q, k, v = make_inputs(B=1, H=2, N=9, D=8)
    with pytest.raises(NotImplementedError, match="dropout"):
        attn.attention(q, k, v, dropout_p=0.1, backend="sdpa")
