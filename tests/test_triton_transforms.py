"""The triton backend under torch's function transforms (issue 41): its forward-mode kernel
(``_attn_jvp``) through ``torch.func.jvp`` and ``torch.autograd.forward_ad`` against the
float64 reference's tangents, its vmap rule, per-sample gradients and ``jacfwd``.

Budget as :mod:`attn.testing`'s: a tangent may be off from the float64 reference's by twice
what plain PyTorch (the reference run in the same dtype on the same inputs) is off, plus the
dtype's rounding floor at the tangent's scale. Without a GPU the kernels run in the Triton
interpreter (TRITON_INTERPRET=1, set before triton is imported), at small sizes.
"""

import pytest
import torch
from torch.autograd import forward_ad as fwad
from torch.func import grad, jacfwd, jvp, vmap

pytest.importorskip("triton")

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402  (tests/conftest.py set TRITON_INTERPRET=1 first)
from attn.call import AttentionCall, select_backend, unsupported_reason  # noqa: E402
from attn.testing import _FLOOR, _max_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not flash_triton._INTERPRET,
    reason="attn.flash_triton was imported before TRITON_INTERPRET=1 was set; run this file "
           "on its own")

F64 = torch.float64
B, H, HKV, NQ, NK, D = 1, 2, 1, 40, 33, 16


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _slopes(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, generator=g).to(DEVICE) + 0.2


# every variant: keywords, the name of its tensor a tangent reaches (None: q, k, v only),
# and that tensor's tangent seed; learnable tensors are made per dtype by _kwargs
CASES = {
    "plain": ({}, None),
    "causal": ({"causal": True}, None),
    "window": ({"window": (9, 3)}, None),
    "softcap": ({"softcap": 3.0, "causal": True}, None),
    "softcap_learned": ({"softcap": "learn"}, "softcap"),
    "alibi": ({"alibi_slopes": "learn", "causal": True}, "alibi_slopes"),
    "float_mask": ({"attn_mask": "learn"}, "attn_mask"),
    "bool_mask": ({"attn_mask": "bool", "causal": True}, None),
    "sinks": ({"sinks": "learn", "window": (12, 0)}, "sinks"),
    "dropout": ({"dropout_p": 0.25, "causal": True}, None),
}


def _learnable(name, dtype):
    if name == "softcap":
        return (_randn(H, seed=40).abs() + 1.5).to(dtype)
    if name == "alibi_slopes":
        return _slopes(41).to(torch.float32)  # slopes stay float32 whatever the inputs
    if name == "attn_mask":
        m = _randn(B, 1, NQ, NK, seed=42, dtype=dtype)
        return m.masked_fill(_randn(1, 1, NQ, NK, seed=43) < -1.2, float("-inf"))
    if name == "sinks":
        return _randn(H, seed=44).to(dtype)
    raise AssertionError(name)


def _kwargs(kw, dtype):
    out = {}
    for key, val in kw.items():
        if val == "learn":
            val = _learnable(key, dtype)
        elif val == "bool":
            val = _randn(B, 1, NQ, NK, seed=45) > -0.8
        out[key] = val
    return out


def _f64(x):
    return x.to(F64) if torch.is_tensor(x) and x.is_floating_point() else x


def _fn(backend, kw, learn):
    """``(q, k, v[, learnable]) -> (out, lse)`` of one call (dropout: the same seed each)."""
    def f(q, k, v, *x):
        kw_ = dict(kw, **({learn: x[0]} if learn else {}))
        if kw_.get("dropout_p"):
            torch.manual_seed(1234)
        return attn.attention(q, k, v, backend=backend, return_lse=True, **kw_)
    return f


def _primals(dtype, learn, kw, *, hkv=HKV, nk=NK):
    q = _randn(B, H, NQ, D, seed=1, dtype=dtype)
    k = _randn(B, hkv, nk, D, seed=2, dtype=dtype)
    v = _randn(B, hkv, nk, D, seed=3, dtype=dtype)
    primals = [q, k, v] + ([kw[learn]] if learn else [])
    tangents = [_randn(*p.shape, seed=10 + i, dtype=p.dtype) for i, p in enumerate(primals)]
    return primals, tangents


def assert_tangents_within_budget(got, exact, plain, dtype, what):
    """``got`` (ȯ, lsė) against the float64 ``exact`` ones: within twice ``plain``'s error
    (the reference in ``dtype``) plus the rounding floor at the tangent's scale."""
    for name, g, e, p in zip(("out tangent", "lse tangent"), got, exact, plain):
        e = e.to(F64)
        err, plain_err = _max_err(g.to(F64), e, name), _max_err(p.to(F64), e, name)
        scale = max(1.0, e[torch.isfinite(e)].abs().max().item())
        budget = 2.0 * plain_err + _FLOOR[dtype] * scale
        assert err <= budget, (f"{what}: {name} off by {err:.3g} > budget {budget:.3g} "
                               f"(plain {dtype}: {plain_err:.3g})")


def _check_jvp(kw, learn, dtype, what, *, hkv=HKV, nk=NK):
    primals, tangents = _primals(dtype, learn, kw, hkv=hkv, nk=nk)
    got = jvp(_fn("triton", kw, learn), tuple(primals), tuple(tangents))
    ref = _fn("reference", {k_: _f64(x) for k_, x in kw.items()}, learn)
    exact = jvp(ref, tuple(map(_f64, primals)), tuple(map(_f64, tangents)))
    plain = jvp(_fn("reference", kw, learn), tuple(primals), tuple(tangents))
    torch.testing.assert_close(got[0][0].to(F64), exact[0][0], atol=0.05, rtol=0.05)
    assert_tangents_within_budget(got[1], exact[1], plain[1], dtype, what)


# every case in float32; in bfloat16 those whose tangent takes another path through the
# kernel's casts (a learnable operand's tangent, the mask's, dropout's scale)
_BF16 = ("plain", "softcap_learned", "alibi", "float_mask", "dropout")


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("name, dtype", [(n, torch.float32) for n in CASES]
                         + [(n, torch.bfloat16) for n in _BF16 if n in CASES],
                         ids=[f"{n}-fp32" for n in CASES]
                         + [f"{n}-bf16" for n in _BF16 if n in CASES])
def test_jvp_matches_the_float64_reference(name, dtype):
    """Tangents of (out, lse) along q, k, v and the variant's learnable tensor (softcap,
    slopes, float mask, sinks): GQA (2 heads on 1), Nq = 40 ≠ Nk = 33, several key tiles."""
    kw, learn = CASES[name]
    _check_jvp(_kwargs(kw, dtype), learn, dtype, f"{name} {dtype}")


@pytest.mark.cuda_if_present
def test_jvp_without_gqa_and_with_one_key_tile():
    _check_jvp({"causal": True}, None, torch.float32, "Hkv = H, Nk = 20", hkv=H, nk=20)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("name", ["softcap_learned", "float_mask"])
def test_forward_ad_matches_the_reference(name):
    """``torch.autograd.forward_ad`` (dual tensors, no functorch) takes the same rule."""
    kw, learn = CASES[name]
    kw = _kwargs(kw, torch.float32)
    primals, tangents = _primals(torch.float32, learn, kw)
    res = {}
    for be in ("triton", "reference"):
        ps = primals if be == "triton" else [_f64(p) for p in primals]
        ts = tangents if be == "triton" else [_f64(t) for t in tangents]
        kw_ = kw if be == "triton" else {k_: _f64(x) for k_, x in kw.items()}
        with fwad.dual_level():
            duals = [fwad.make_dual(p, t) for p, t in zip(ps, ts)]
            out, lse = _fn(be, kw_, learn)(*duals)
            res[be] = (fwad.unpack_dual(out).tangent, fwad.unpack_dual(lse).tangent)
    plain = jvp(_fn("reference", kw, learn), tuple(primals), tuple(tangents))[1]
    assert_tangents_within_budget(res["triton"], res["reference"], plain, torch.float32, name)


@pytest.mark.cuda_if_present
def test_jvp_of_packed_sequences():
    """varlen_attention (the packed launchers, ALiBi slopes per sequence): tangents along q,
    k, v and the slopes, against the reference's packed path."""
    cu = torch.tensor([0, 13, 13, 40], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 9, 20, 33], dtype=torch.int32, device=DEVICE)
    q = _randn(40, H, D, seed=1)
    k, v = _randn(33, HKV, D, seed=2), _randn(33, HKV, D, seed=3)
    slopes = _randn(3, H, seed=4).abs()
    primals = (q, k, v, slopes)
    tangents = tuple(_randn(*p.shape, seed=10 + i) for i, p in enumerate(primals))

    def f(backend):
        def g(q, k, v, al):
            return attn.varlen_attention(q, k, v, cu, cuk, 27, 20, causal=True,
                                         alibi_slopes=al, return_lse=True, backend=backend)
        return g
    got = jvp(f("triton"), primals, tangents)[1]
    exact = jvp(f("reference"), tuple(map(_f64, primals)), tuple(map(_f64, tangents)))[1]
    plain = jvp(f("reference"), primals, tangents)[1]
    assert_tangents_within_budget(got, exact, plain, torch.float32, "packed")


# -- vmap, per-sample gradients, jacfwd ------------------------------------------------------

def _close(a, b, tol=2e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("mapped", ["qkv_mask_slopes", "sinks"])
def test_vmap_equals_the_batched_call(mapped):
    """vmap over X samples equals the calls one by one: q, k, v, a float mask and slopes
    mapped (the rule folds them into B), or the sinks mapped (the rule loops)."""
    X = 3
    qs = _randn(X, 1, H, 24, D, seed=1)
    k, v = _randn(1, HKV, 21, D, seed=2), _randn(1, HKV, 21, D, seed=3)
    if mapped == "sinks":
        extra = {"sinks": _randn(X, H, seed=5)}
        ks, vs = k, v

        def f(q, s):
            return attn.attention(q, k, v, sinks=s, causal=True, backend="triton",
                                  return_lse=True)
        got = vmap(f)(qs, extra["sinks"])
        want = [f(qs[x], extra["sinks"][x]) for x in range(X)]
    else:
        ks, vs = _randn(X, 1, HKV, 21, D, seed=6), _randn(X, 1, HKV, 21, D, seed=7)
        masks = _randn(X, 1, 1, 24, 21, seed=8)
        slopes = _randn(X, 1, H, seed=9).abs()

        def f(q, k, v, m, al):
            return attn.attention(q, k, v, attn_mask=m, alibi_slopes=al, backend="triton",
                                  return_lse=True)
        got = vmap(f)(qs, ks, vs, masks, slopes)
        want = [f(qs[x], ks[x], vs[x], masks[x], slopes[x]) for x in range(X)]
    for i in range(2):
        _close(got[i], torch.stack([w[i] for w in want]))


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("variant", ["sinks", "float_mask"])
def test_per_sample_gradients_equal_a_loop(variant):
    """``vmap(grad(loss))``: each sample's gradients of q, k, v (shared k, v: each sample's
    own share), as a loop of ``torch.autograd.grad`` computes them; the backward op's rule
    loops (sinks: their gradient sums over the batch) or folds into B (a float mask)."""
    X = 2
    qs = _randn(X, 1, H, 24, D, seed=1)
    k, v = _randn(1, HKV, 21, D, seed=2), _randn(1, HKV, 21, D, seed=3)
    kw = ({"sinks": _randn(H, seed=4), "causal": True} if variant == "sinks" else
          {"attn_mask": _randn(1, 1, 24, 21, seed=5)})

    def loss(q, k, v):
        out, lse = attn.attention(q, k, v, backend="triton", return_lse=True, **kw)
        return (out ** 2).sum() + lse.sin().sum()
    got = vmap(grad(loss, argnums=(0, 1, 2)), in_dims=(0, None, None))(qs, k, v)
    for x in range(X):
        leaves = [t.clone().requires_grad_() for t in (qs[x], k, v)]
        want = torch.autograd.grad(loss(*leaves), leaves)
        for g, w in zip(got, want):
            _close(g[x], w)


@pytest.mark.cuda_if_present
def test_jacfwd_equals_the_reference():
    """``jacfwd`` (vmap over jvp: the batched tangents fold into B in the kernel's op) on a
    tiny call."""
    q = _randn(1, 1, 4, 4, seed=1)
    k, v = _randn(1, 1, 6, 4, seed=2), _randn(1, 1, 6, 4, seed=3)

    def f(backend):
        return lambda q: attn.attention(q, k if backend == "triton" else _f64(k),
                                        v if backend == "triton" else _f64(v), causal=True,
                                        backend=backend)
    got = jacfwd(f("triton"))(q)
    exact = jacfwd(f("reference"))(_f64(q))
    _close(got.to(F64), exact, tol=1e-5)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("name", ["sinks", "dropout"])
def test_vmap_of_jvp_over_tangents_that_cannot_fold(name):
    """vmap over jvp's tangents where the op's rule loops (mapped sinks' tangents; dropout,
    whose hash reads the batch index): each sample's tangents are the reference's."""
    kw, learn = CASES[name]
    kw = _kwargs(kw, torch.float32)
    primals, tangents = _primals(torch.float32, learn, kw)
    stacked = [torch.stack([t, -0.5 * t]) for t in tangents]

    def tangent_of(backend, kw_, ps):
        return lambda *ts: jvp(_fn(backend, kw_, learn), tuple(ps), ts)[1]
    got = vmap(tangent_of("triton", kw, primals), randomness="same")(*stacked)
    kw64 = {k_: _f64(x) for k_, x in kw.items()}
    for x in range(2):
        ts = [t[x] for t in stacked]
        exact = tangent_of("reference", kw64, map(_f64, primals))(*map(_f64, ts))
        plain = tangent_of("reference", kw, primals)(*ts)
        assert_tangents_within_budget([g[x] for g in got], exact, plain, torch.float32,
                                      f"{name} sample {x}")


# -- routing ---------------------------------------------------------------------------------

def test_transformed_calls_route_to_triton_on_cuda():
    call = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                         n_q=128, n_k=128, transform="jvp")
    choice = select_backend(call, "auto")
    if choice.name == "triton":  # (triton importable here)
        assert "jvp" in choice.reason and "fused" in choice.reason
    with pytest.raises(NotImplementedError, match="backend='fused'.*jvp"):
        select_backend(call, "fused")
    packed = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                           n_q=128, n_k=128, varlen=True, transform="vmap")
    assert select_backend(packed, "auto").name == "tiled"
    with pytest.raises(NotImplementedError, match="packed sequences under torch.func.vmap"):
        select_backend(packed, "triton")
    decode = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                           n_q=1, n_k=4096, transform="jvp")
    if select_backend(decode, "auto").name == "triton":
        assert "plain kernels" in select_backend(decode, "auto").reason
    # what triton cannot differentiate goes to tiled, the reason saying why
    for transform, extra, why in (("grad+vmap+jvp", {}, "reverse mode over forward mode"),
                                  ("grad+grad", {"softcap": "learned"}, "learnable softcap")):
        c = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                          n_q=128, n_k=128, transform=transform, **extra)
        choice = select_backend(c, "auto")
        assert choice.name == "tiled" and why in choice.reason, choice
    over = AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                         n_q=128, n_k=128, transform="jvp+grad")  # forward over reverse
    assert "reverse mode over" not in (unsupported_reason("triton", over) or "")


@pytest.mark.cuda_if_present
def test_double_backward_of_a_learnable_softcap_names_tiled():
    """What triton still cannot differentiate says which backend can."""
    q, k, v = (_randn(1, 2, 8, D, seed=i).requires_grad_() for i in range(3))
    cap = torch.full((2,), 3.0, device=DEVICE, requires_grad=True)
    out = attn.attention(q, k, v, softcap=cap, backend="triton")
    with pytest.raises(NotImplementedError, match="learnable softcap.*backend='tiled'"):
        torch.autograd.grad(out.sum(), (q, cap), create_graph=True)


@pytest.mark.cuda_if_present
def test_an_infinite_tangent_at_a_masked_key_stays_out():
    """k̇ = inf at the last key, which causal rows but the last never see: their tangents are
    those of k̇ = 0 there (p = 0 times ṡ = inf must add 0, not NaN)."""
    primals, tangents = _primals(torch.float32, None, {})
    tk = tangents[1].clone()
    tk[:, :, -1] = float("inf")
    got = jvp(_fn("triton", {"causal": True}, None), tuple(primals),
              (tangents[0], tk, tangents[2]))[1]
    tk[:, :, -1] = 0.0
    exact = jvp(_fn("reference", {"causal": True}, None), tuple(map(_f64, primals)),
                tuple(map(_f64, (tangents[0], tk, tangents[2]))))[1]
    plain = jvp(_fn("reference", {"causal": True}, None), tuple(primals),
                (tangents[0], tk, tangents[2]))[1]
    unseen = (slice(None), slice(None), slice(0, NQ - 1))  # rows that never see the last key
    assert_tangents_within_budget([t[unseen] for t in got], [t[unseen] for t in exact],
                                  [t[unseen] for t in plain], torch.float32, "inf at a masked key")


@pytest.mark.cuda_if_present
def test_which_backward_runs_under_torch_func():
    """torch.func.grad alone runs triton's own backward (a learnable softcap's gradient
    too); a gradient differentiated again (hessian: forward over reverse, grad of grad)
    hands off to tiled's; reverse over forward (jacrev of jacfwd) says which backend can."""
    q = _randn(1, 2, 6, 8, seed=1)
    k, v = _randn(1, 1, 7, 8, seed=2), _randn(1, 1, 7, 8, seed=3)
    cap = torch.full((2,), 3.0, device=DEVICE)

    def loss(backend):
        k_, v_ = (k, v) if backend == "triton" else (_f64(k), _f64(v))
        return lambda c, x: attn.attention(x, k_, v_, softcap=c, causal=True,
                                           backend=backend).square().sum()
    for argnums in (0, 1):
        got = grad(loss("triton"), argnums=argnums)(cap, q)
        want = grad(loss("reference"), argnums=argnums)(_f64(cap), _f64(q))
        _close(got.to(F64), want)
    fixed = {"triton": lambda x: loss("triton")(3.0, x),
             "reference": lambda x: loss("reference")(3.0, x)}
    got = torch.func.hessian(fixed["triton"])(q[:, :, :1])
    _close(got.to(F64), torch.func.hessian(fixed["reference"])(_f64(q[:, :, :1])), tol=1e-4)
    with pytest.raises(NotImplementedError, match="reverse mode over forward mode.*tiled"):
        torch.func.jacrev(torch.func.jacfwd(fixed["triton"]))(q)
