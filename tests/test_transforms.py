"""Attention under torch's function transforms (issue 41): torch.func's vmap, grad, vjp, jvp,
jacrev, jacfwd, hessian, forward-mode AD and double backward, on the reference and tiled
backends, in float64 against the reference (itself checked against plain autograd, loops
and finite differences)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import attn
from attn.call import AttentionCall, select_backend
from attn.kvcache import PagedKVCache

F64 = torch.float64
B, H, HKV, NQ, NK, D = 2, 4, 2, 5, 7, 3


def close(a, b, tol=1e-9):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            close(x, y, tol)
        return
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=F64, generator=g)


@pytest.fixture(scope="module")
def qkv():
    return _randn(B, H, NQ, D, seed=1), _randn(B, HKV, NK, D, seed=2), _randn(B, HKV, NK, D + 1,
                                                                           seed=3)


# every variant, with its learnable tensor (if any) named so tangents and gradients reach it
VARIANTS = {
    "plain": ({}, None),
    "causal": ({"causal": True}, None),
    "window": ({"window": (2, 1)}, None),
    "softcap": ({"softcap": 2.0}, None),
    "softcap_learned": ({"softcap": torch.rand(H, dtype=F64) + 1.0}, "softcap"),
    "sinks": ({"sinks": _randn(H, seed=4), "causal": True}, "sinks"),
    "alibi": ({"alibi_slopes": torch.rand(B, H, dtype=F64)}, "alibi_slopes"),
    "float_mask": ({"attn_mask": _randn(B, 1, NQ, NK, seed=5)}, "attn_mask"),
    "bool_mask": ({"attn_mask": _randn(1, 1, NQ, NK, seed=6) > -0.5}, None),
    "temperature": ({"temperature": torch.rand(B, H, dtype=F64) + 0.5}, "temperature"),
    "dropout": ({"dropout_p": 0.3}, None),
    "score_mod": ({"score_mod": lambda s, b, h, i, j: s + 0.1 * (i - j)}, None),
    "mask_mod": ({"mask_mod": lambda b, h, i, j: (i + j) % 3 != 0}, None),
}


def _call(backend, kw, q, k, v, **over):
    kw = {**kw, **over}
    if kw.get("dropout_p"):
        torch.manual_seed(7)  # the same dropout mask on every call
    return attn.attention(q, k, v, backend=backend, return_lse=True, **kw)


def _loss(backend, kw):
    def loss(q, k, v):
        out, lse = _call(backend, kw, q, k, v)
        return (out ** 2).sum() + torch.sin(torch.where(lse.isinf(), 0.0, lse)).sum()
    return loss


# -- 1. functorch: vmap, grad, vjp, jacrev over the entry points ------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_under_transforms_matches_plain_autograd(qkv, name):
    """The oracle first: vmap equals a loop of calls, grad equals autograd.grad."""
    kw, _ = VARIANTS[name]
    q, k, v = qkv
    qs = torch.stack([q, 2 * q, -q])
    batched = vmap(lambda x: _call("reference", kw, x, k, v), randomness="same")(qs)
    looped = [_call("reference", kw, x, k, v) for x in qs]
    close(batched, tuple(torch.stack(t) for t in zip(*looped)))
    g = grad(_loss("reference", kw), argnums=(0, 1, 2))(q, k, v)
    qq, kk, vv = (t.clone().requires_grad_() for t in qkv)
    close(g, torch.autograd.grad(_loss("reference", kw)(qq, kk, vv), (qq, kk, vv)))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tiled_vmap_grad_vjp_match_reference(qkv, name):
    kw, _ = VARIANTS[name]
    q, k, v = qkv
    qs = torch.stack([q, 2 * q, -q])
    res = {}
    for be in ("reference", "tiled"):
        r = [vmap(lambda x: _call(be, kw, x, k, v), randomness="same")(qs),
             vmap(lambda kk: _call(be, kw, q, kk, v), randomness="same")(torch.stack([k, -k])),
             grad(_loss(be, kw), argnums=(0, 1, 2))(q, k, v)]
        out, fn = vjp(lambda a, b, c: _call(be, kw, a, b, c), q, k, v)
        r.append(fn((torch.ones_like(out[0]), torch.zeros_like(out[1]))))
        res[be] = r
    close(res["tiled"], res["reference"])


@pytest.mark.parametrize("name", ["plain", "sinks", "float_mask"])
def test_jacrev_per_sample_grads_and_learnables(qkv, name):
    kw, learn = VARIANTS[name]
    q, k, v = (t[:1, :, :3] for t in qkv)
    kw = {**kw, "attn_mask": kw["attn_mask"][:1, :, :3, :3]} if "attn_mask" in kw else kw
    res = {}
    for be in ("reference", "tiled"):
        f = lambda a: _call(be, kw, a, k, v)[0]  # noqa: E731
        r = [jacrev(f)(q)]
        # per-sample gradients (vmap over grad): each sample alone
        r.append(vmap(grad(lambda a: (_call(be, kw, a[None], k, v)[0] ** 2).sum()))(q[0][None]))
        if learn is not None:
            p = kw[learn]
            r.append(grad(lambda t: (_call(be, kw, q, k, v, **{learn: t})[0] ** 2).sum())(p))
        res[be] = r
    close(res["tiled"], res["reference"])


def test_per_sample_gradients_equal_a_loop(qkv):
    q, k, v = qkv
    f = lambda a, kk, vv: (attn.attention(a[None], kk[None], vv[None], causal=True,  # noqa: E731
                                          backend="tiled") ** 2).sum()
    per = vmap(grad(f, argnums=(0, 1, 2)))(q, k, v)
    for b in range(B):
        close(tuple(g[b] for g in per), grad(f, argnums=(0, 1, 2))(q[b], k[b], v[b]))


def test_vmap_over_batched_masks_and_temperatures(qkv):
    """Mapped masks and temperatures: the data checks read every sample (no host reads of a
    batched tensor), and the answer equals a loop."""
    q, k, v = qkv
    masks = torch.stack([_randn(B, 1, NQ, NK, seed=s) for s in (8, 9)])
    bools = torch.stack([masks[0] > 0, masks[1] > -0.3])
    taus = torch.rand(2, B, H, dtype=F64) + 0.5
    for be in ("reference", "tiled"):
        for kw_of in (lambda m: {"attn_mask": m}, lambda t: {"temperature": t}):
            for stack in ((masks, bools) if kw_of(0).get("attn_mask") is not None else (taus,)):
                got = vmap(lambda x: attn.attention(q, k, v, backend=be, **kw_of(x)))(stack)
                want = torch.stack([attn.attention(q, k, v, backend="reference", **kw_of(x))
                                    for x in stack])
                close(got, want)
    with pytest.raises(ValueError, match="temperature must be positive"):
        vmap(lambda t: attn.attention(q, k, v, temperature=t))(-taus)


def test_entry_points_under_vmap_grad_and_jvp(qkv):
    """The drop-in, varlen, flex and decode (forward only) under the transforms, tiled and
    the default backend against the reference."""
    q, k, v = qkv
    qs = torch.stack([q, -q])
    kk, vv = (t.repeat_interleave(2, dim=1) for t in (k, v[..., :D]))
    for be in ("tiled", "auto"):
        sd = lambda a: attn.scaled_dot_product_attention(a, kk, vv, is_causal=True)  # noqa
        top_left = torch.ones(NQ, NK, dtype=torch.bool).tril()  # the drop-in's is_causal
        ref = lambda a: attn.attention(a, kk, vv, attn_mask=top_left,  # noqa: E731
                                       backend="reference")
        close(vmap(sd)(qs), vmap(ref)(qs))
        close(jvp(sd, (q,), (q,)), jvp(ref, (q,), (q,)))
        cu = torch.tensor([0, 2, 7], dtype=torch.int32)
        pk, pv = _randn(7, H, D, seed=10), _randn(7, H, D, seed=11)
        vl = lambda a, b=be: attn.varlen_attention(a, pk, pv, cu, cu, causal=True, backend=b)
        pq = _randn(7, H, D, seed=12)
        close(vmap(vl)(torch.stack([pq, -pq])),
              vmap(lambda a: vl(a, "reference"))(torch.stack([pq, -pq])))
        close(grad(lambda a: vl(a).sum())(pq), grad(lambda a: vl(a, "reference").sum())(pq))
        close(jvp(vl, (pq,), (pq,)), jvp(lambda a: vl(a, "reference"), (pq,), (pq,)))
        sm = lambda s, b, h, i, j: s - 0.1 * (i - j).abs()  # noqa: E731
        fl = lambda a, b=be: attn.flex_attention(a, kk, vv, score_mod=sm, backend=b)  # noqa
        close(vmap(fl)(qs), vmap(lambda a: fl(a, "reference"))(qs))
        close(jvp(fl, (q,), (q,)), jvp(lambda a: fl(a, "reference"), (q,), (q,)))
    cache = PagedKVCache.allocate(8, 4, HKV, D, max_seqs=B, dtype=F64)
    cache.append(k, v[..., :D])
    with torch.no_grad():
        got = vmap(lambda a: attn.decode(a, cache))(qs[:, :, :, :1])
    want = torch.stack([attn.attention(a[:, :, :1], k, v[..., :D], backend="reference")
                        for a in qs])
    close(got, want)


def test_modules_under_vmap_and_functional_call():
    """nn.MultiHeadAttention: ensembles (vmap over stacked parameters), per-sample gradients
    of the parameters, and a consistency-model-style step (jvp through the module), each
    equal to the reference backend's."""
    torch.manual_seed(0)
    x = _randn(B, 6, 8, seed=13)
    res = {}
    for be in ("reference", "tiled"):
        torch.manual_seed(0)
        mha = attn.nn.MultiHeadAttention(8, heads=4, kv_heads=2, causal=True, sinks=True,
                                         learn_temperature=True, backend=be).double()
        params = {n: p.detach() for n, p in mha.named_parameters()}
        ens = {n: torch.stack([p, 1.1 * p]) for n, p in params.items()}
        r = [vmap(lambda p: functional_call(mha, p, (x,)))(ens)]
        per = vmap(grad(lambda p, xi: (functional_call(mha, p, (xi[None],)) ** 2).sum()),
                   in_dims=(None, 0))(params, x)
        r.append(tuple(per[n] for n in sorted(per)))
        r.append(jvp(lambda xi: mha(xi), (x,), (torch.ones_like(x),)))
        res[be] = r
    close(res["tiled"], res["reference"])


def test_consistency_model_training_step():
    """sCM's step: the loss reads the module's jvp (primal and tangent), and its backward
    reaches the parameters through the tangent too; tiled's parameter gradients equal the
    reference backend's."""
    x, tx = _randn(B, 6, 8, seed=90), _randn(B, 6, 8, seed=91)
    res = {}
    for be in ("reference", "tiled"):
        torch.manual_seed(0)
        mha = attn.nn.MultiHeadAttention(8, heads=4, kv_heads=2, causal=True, sinks=True,
                                         learn_temperature=True, backend=be).double()
        out, tangent = jvp(mha, (x,), (tx,))
        ((tangent ** 2).sum() + (out * torch.cos(out)).sum()).backward()
        res[be] = [p.grad for _, p in sorted(mha.named_parameters())]
    assert all(g is not None for g in res["tiled"])
    close(res["tiled"], res["reference"])


def test_gradcheck_batched_grad_on_the_drop_in():
    """torch's own batched-gradient checks (issue 37: "Batching rule not implemented for
    aten::alias"), with forward-mode and batched forward-mode checks, on the default backend
    and on tiled."""
    q, k, v = (_randn(1, 2, 3, 2, seed=s).requires_grad_() for s in (14, 15, 16))
    assert torch.autograd.gradcheck(
        lambda a, b, c: attn.scaled_dot_product_attention(a, b, c, is_causal=True),
        (q, k, v), check_batched_grad=True, check_forward_ad=True,
        check_batched_forward_grad=True)
    # torch.func.vmap over a vjp of the drop-in (test_transformers.py's CPU SDPA cases)
    out, fn = vjp(lambda a, b, c: attn.scaled_dot_product_attention(a, b, c, is_causal=True),
                  q, k, v)
    cts = torch.stack([torch.ones_like(out), -out.detach()])
    got = vmap(fn)(cts)
    for i in range(2):
        close(tuple(g[i] for g in got), fn(cts[i]))
    assert torch.autograd.gradcheck(
        lambda a, b, c: attn.attention(a, b, c, backend="tiled", return_lse=True),
        (q, k, v), check_batched_grad=True, check_forward_ad=True,
        check_batched_forward_grad=True)


def test_backends_without_rules_say_which_can():
    call = AttentionCall(device="cpu", dtype=F64, head_dim=4, head_dim_v=4, n_q=8, n_k=8,
                         transform="vmap")
    choice = select_backend(call, "auto")
    assert choice.name == "tiled" and "vmap" in choice.reason
    with pytest.raises(NotImplementedError, match="backend='tiled'"):
        select_backend(call, "fused")
    q = _randn(1, 2, 4, 4, seed=17)
    with pytest.raises(NotImplementedError, match="backend='fused'.*tiled"):
        jvp(lambda a: attn.attention(a, a, a, backend="fused"), (q,), (q,))


# -- 2. forward-mode AD: torch.func.jvp and finite differences -------------------------------

@pytest.mark.parametrize("path", ["one_pass", "rule"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_jvp_matches_the_reference(qkv, name, path, monkeypatch):
    """Tangents of out and lse along q, k, v and along the variant's learnable tensor (the
    ALiBi slopes too: forward-mode reads them as any input), tiled against the reference:
    by the one pass that computes primal and tangent together (nothing requires grad), and
    by the autograd.Function's jvp rule after its forward (inputs that require grad)."""
    from attn.tiled import jvp as tiled_jvp

    passes = []
    one_pass = tiled_jvp._one_pass
    monkeypatch.setattr(tiled_jvp, "_one_pass", lambda *a: passes.append(1) or one_pass(*a))
    kw, learn = VARIANTS[name]
    q, k, v = qkv
    if path == "rule":
        q = q.clone().requires_grad_()
    tq, tk, tv = (_randn(*t.shape, seed=20 + i) for i, t in enumerate(qkv))
    res = {}
    for be in ("reference", "tiled"):
        r = [jvp(lambda a, b, c: _call(be, kw, a, b, c), (q, k, v), (tq, tk, tv))]
        if learn is not None:
            p = kw[learn]
            r.append(jvp(lambda t: _call(be, kw, q, k, v, **{learn: t}), (p,),
                         (_randn(*p.shape, seed=30),)))
        res[be] = r
    close(res["tiled"], res["reference"])
    # the one pass takes every variant but score_mod and mask_mod (callables that may read
    # tensors of their own)
    assert bool(passes) == (path == "one_pass" and name not in ("score_mod", "mask_mod"))


def test_jvp_under_forward_ad_and_vmap_of_jvp(qkv):
    """torch.autograd.forward_ad (dual tensors) and vmap over jvp (jacfwd) give the
    reference's."""
    import torch.autograd.forward_ad as fwad
    q, k, v = qkv
    tq = _randn(*q.shape, seed=31)
    res = {}
    for be in ("reference", "tiled"):
        with fwad.dual_level():
            out, lse = _call(be, {"causal": True}, fwad.make_dual(q, tq), k, v)
            res[be] = [fwad.unpack_dual(out).tangent, fwad.unpack_dual(lse).tangent]
    close(res["tiled"], res["reference"])
    q1 = q[:1, :1]
    want = jacfwd(lambda a: _call("reference", {"causal": True}, a, k[:1, :1], v[:1, :1])[0])(q1)
    got = jacfwd(lambda a: _call("tiled", {"causal": True}, a, k[:1, :1], v[:1, :1])[0])(q1)
    close(got, want)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_ad_against_finite_differences(name):
    """gradcheck with check_forward_ad: tiled's jvp against finite differences."""
    kw, learn = VARIANTS[name]
    q, k, v = (_randn(1, 2, 3, 2, seed=40 + i).requires_grad_() for i in range(3))
    kw = {n: (x[:1, :2, :3, :3] if n == "attn_mask" else x[:2] if n in ("sinks", "softcap")
              and torch.is_tensor(x) else x[:1, :2] if n in ("alibi_slopes", "temperature")
              else x) for n, x in kw.items()}
    inputs = [q, k, v]
    if learn == "alibi_slopes":  # constants to autograd (a slope requiring grad raises):
        learn = None             # their tangent is test_jvp_matches_the_reference's
    if learn is not None:
        inputs.append(kw[learn].clone().requires_grad_())

    def f(a, b, c, *p):
        return _call("tiled", kw, a, b, c, **({learn: p[0]} if p else {}))

    assert torch.autograd.gradcheck(f, tuple(inputs), check_forward_ad=True,
                                    check_backward_ad=False, check_undefined_grad=False)


# -- 3. double backward: create_graph=True, hessians, gradgradcheck ---------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_double_backward_matches_the_reference(qkv, name):
    """Gradients taken with create_graph=True, then differentiated again (a gradient
    penalty), with respect to q, k, v and the variant's learnable tensor."""
    kw, learn = VARIANTS[name]
    res = {}
    for be in ("reference", "tiled"):
        xs = [t.clone().requires_grad_() for t in qkv]
        over = {}
        if learn is not None and learn != "alibi_slopes":  # ALiBi's slopes are constants
            over[learn] = kw[learn].clone().requires_grad_()
            xs.append(over[learn])
        out, lse = _call(be, kw, *xs[:3], **over)
        loss = (out ** 2).sum() + torch.sin(torch.where(lse.isinf(), 0.0, lse)).sum()
        g = torch.autograd.grad(loss, xs, create_graph=True)
        penalty = sum((x * torch.cos(x)).sum() for x in g)
        res[be] = (g, torch.autograd.grad(penalty, xs))
    close(res["tiled"], res["reference"])


@pytest.mark.parametrize("name", ["causal", "sinks", "float_mask"])
def test_jvp_over_many_tiles(name):
    """torch.func.jvp past one tile (3 query blocks, 2 key tiles, GQA 4:2): the rule one
    level below functorch's wrappers, its query blocks on the worker pool."""
    n = 300
    kw = {"causal": True}
    extra_p, extra_t = (), ()
    if name == "sinks":
        kw["sinks"] = _randn(4, seed=70)
        extra_p, extra_t = (kw.pop("sinks"),), (_randn(4, seed=71),)
    if name == "float_mask":
        extra_p, extra_t = (_randn(1, 1, n, n, seed=72),), (_randn(1, 1, n, n, seed=73),)
    primals = (_randn(1, 4, n, 8, seed=74), _randn(1, 2, n, 8, seed=75),
               _randn(1, 2, n, 8, seed=76)) + extra_p
    tangents = tuple(_randn(*x.shape, seed=80 + i) for i, x in enumerate(primals[:3])) + extra_t
    res = {}
    for be in ("reference", "tiled"):
        def f(q, k, v, *x, be=be):
            over = {} if not x else {"sinks" if name == "sinks" else "attn_mask": x[0]}
            return _call(be, kw, q, k, v, **over)
        res[be] = jvp(f, primals, tangents)
    close(res["tiled"], res["reference"])


def test_jvp_of_a_long_call():
    """A long call's one pass (tiles sized by the call: 8 query blocks of 128 rows, up to 4
    key tiles each): sinks, a learnable softcap, ALiBi slopes and a float mask, each with a
    tangent, GQA 2:1, against the reference's jvp."""
    n = 1024
    primals = (_randn(1, 2, n, 4, seed=100), _randn(1, 1, n, 4, seed=101),
               _randn(1, 1, n, 4, seed=102), _randn(2, seed=103), torch.rand(2, dtype=F64) + 1,
               torch.rand(1, 2, dtype=F64), _randn(1, 1, n, n, seed=104))
    tangents = tuple(_randn(*x.shape, seed=110 + i) for i, x in enumerate(primals))

    def f(be):
        def call(q, k, v, sinks, cap, slopes, mask):
            return _call(be, {"causal": True}, q, k, v, sinks=sinks, softcap=cap,
                         alibi_slopes=slopes, attn_mask=mask)
        return call

    got = jvp(f("tiled"), primals, tangents)
    close(got, jvp(f("reference"), primals, tangents))


@pytest.mark.parametrize("keep_bytes", [None, 0])
@pytest.mark.parametrize("name", ["causal", "dropout", "float_mask"])
def test_double_backward_over_many_tiles(monkeypatch, name, keep_bytes):
    """Past one tile (3 query blocks of 128 rows, 2 key tiles of 256, GQA 4:2): the query
    blocks as runs on the worker pool, each run's dK/dV partial over its own keys, pass 1's
    tiles kept for pass 2 or (keep_bytes 0) recomputed; against the reference, and the same
    bits on one worker as on two."""
    from attn.tiled import double

    monkeypatch.setattr(double, "_HVP_BLOCKS", (128, 256))
    if keep_bytes is not None:
        monkeypatch.setattr(double, "_KEEP_BYTES", keep_bytes)
    n = 300
    kw = {"causal": True}
    if name == "dropout":
        kw["dropout_p"] = 0.2
    if name == "float_mask":
        kw["attn_mask"] = _randn(1, 1, n, n, seed=61)
    q, k, v = _randn(1, 4, n, 8, seed=60), _randn(1, 2, n, 8, seed=62), _randn(1, 2, n, 8,
                                                                            seed=63)
    res = {}
    before = torch.get_num_threads()
    for be, threads in (("reference", 2), ("tiled", 1), ("tiled", 2)):
        torch.set_num_threads(threads)
        try:
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = _call(be, kw, *xs)
            g = torch.autograd.grad((out ** 2).sum() + lse.sum(), xs, create_graph=True)
            penalty = sum((x * torch.cos(x)).sum() for x in g)
            res[be, threads] = torch.autograd.grad(penalty, xs)
        finally:
            torch.set_num_threads(before)
    close(res["tiled", 2], res["reference", 2])
    for a, b in zip(res["tiled", 1], res["tiled", 2]):
        assert torch.equal(a, b)


def test_a_bool_mask_broadcast_over_rows_past_one_block():
    """A key-padding bool mask (1, 1, 1, Nk) past one query block: tiled's jvp (128-row
    blocks) and double backward (256-row blocks) take its one row for every block, against
    the reference (a slice from the block's first row of that one row was empty)."""
    n = 300
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
    mask[..., 250:] = False
    q, k, v = _randn(1, 2, n, 8, seed=120), _randn(1, 2, n, 8, seed=121), _randn(1, 2, n, 8,
                                                                              seed=122)
    res = {}
    for be in ("reference", "tiled"):
        def f(q_, be=be):
            return _call(be, {"attn_mask": mask}, q_, k, v)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = _call(be, {"attn_mask": mask}, *xs)
        g = torch.autograd.grad((out ** 2).sum() + lse.sum(), xs, create_graph=True)
        second = torch.autograd.grad(sum((x * torch.cos(x)).sum() for x in g), xs)
        res[be] = (jvp(f, (q,), (_randn(*q.shape, seed=123),)), second)
    close(res["tiled"], res["reference"])


@pytest.mark.parametrize("name", ["causal", "sinks", "alibi"])
def test_hessian_and_jacfwd_of_jacrev(qkv, name):
    kw, _ = VARIANTS[name]
    q, k, v = (t[:1, :2, :3, :2] for t in qkv)
    kw = {n: (x[:1, :2] if n == "alibi_slopes" else x[:2] if n == "sinks" else x)
          for n, x in kw.items()}
    res = {}
    for be in ("reference", "tiled"):
        f = lambda a, b, c: (_call(be, kw, a, b, c)[0] ** 3).sum()  # noqa: E731
        res[be] = (hessian(f, argnums=(0, 1, 2))(q, k, v),
                   jacfwd(jacrev(lambda a: _call(be, kw, a, k, v)[0]))(q))
    close(res["tiled"], res["reference"])


@pytest.mark.parametrize("combined", [False, True])
def test_gradgradcheck(combined):
    """gradgradcheck in float64: tiled's double backward against finite differences of its
    backward; causal with batched (vmap) second-order gradients, and every learnable variant
    at once (softcap, sinks, float mask, ALiBi, dropout) with their own second derivatives."""
    q, k, v = (_randn(1, 2, 2, 2, seed=50 + i).requires_grad_() for i in range(3))
    learn = ()
    kw = {"causal": True}
    if combined:
        kw = {"dropout_p": 0.2, "alibi_slopes": torch.rand(1, 2, dtype=F64)}
        learn = (torch.rand(2, dtype=F64) + 1.0, _randn(2, seed=53), _randn(1, 1, 2, 2, seed=54))
        learn = tuple(t.requires_grad_() for t in learn)

    def f(a, b, c, *p):
        over = dict(zip(("softcap", "sinks", "attn_mask"), p))
        return _call("tiled", kw, a, b, c, **over)

    assert torch.autograd.gradgradcheck(f, (q, k, v, *learn), check_batched_grad=not combined)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradgradcheck_every_variant(name):
    """gradgradcheck in float64 for each variant on its own (GQA 2:1, Nq != Nk), with the
    variant's learnable tensor among the inputs where autograd may differentiate it."""
    kw, learn = VARIANTS[name]
    q = _randn(1, 2, 2, 2, seed=55).requires_grad_()
    k, v = (_randn(1, 1, 3, 2, seed=56 + i).requires_grad_() for i in range(2))
    kw = {n: (x[:1, :2, :2, :3] if n == "attn_mask" else x[:2] if n in ("sinks", "softcap")
              and torch.is_tensor(x) else x[:1, :2] if n in ("alibi_slopes", "temperature")
              else x) for n, x in kw.items()}
    inputs = [q, k, v]
    if learn is not None and learn != "alibi_slopes":
        inputs.append(kw.pop(learn).clone().requires_grad_())

    def f(a, b, c, *p):
        return _call("tiled", kw, a, b, c, **({learn: p[0]} if p else {}))

    assert torch.autograd.gradgradcheck(f, tuple(inputs))


def test_a_fused_forward_hands_its_double_backward_to_tiled():
    """DESIGN's pinned decision: a backward asked for its own gradient runs tiled's
    differentiable backward from the saved tensors, whatever ran the forward."""
    q, k, v = (_randn(1, 2, 40, 8, seed=60 + i) for i in range(3))
    sinks = _randn(2, seed=63)
    res = {}
    for be in ("reference", "fused"):
        xs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attn.attention(*xs[:3], causal=True, sinks=xs[3], backend=be)
        g = torch.autograd.grad((out ** 2).sum(), xs, create_graph=True)
        res[be] = (g, torch.autograd.grad(sum(torch.sin(x).sum() for x in g), xs))
    close(res["fused"], res["reference"])


def test_what_the_transform_kernels_do_not_read_says_which_backend_can(qkv):
    q, k, v = qkv
    w = torch.tensor(0.3, dtype=F64, requires_grad=True)
    sm = lambda s, b, h, i, j: s * w  # noqa: E731  (a captured tensor that needs a gradient)
    qq = q.clone().requires_grad_()
    g = torch.autograd.grad(attn.attention(qq, k, v, score_mod=sm, backend="tiled").sum(), qq,
                            create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        torch.autograd.grad(g.sum(), (qq, w))


def test_triton_double_backward_hands_off_to_tiled():
    """A triton forward asked for differentiable gradients (create_graph=True) gets tiled's
    double-differentiable backward from its saved tensors, as fused does; what that cannot
    differentiate (a learnable softcap) raises NotImplementedError naming tiled rather than
    giving gradients that silently have no graph. The kernels run in the interpreter here."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g).requires_grad_() for _ in range(3))
    w = torch.randn(1, 2, 9, 16, generator=g)

    def second_order(backend, **kw):
        out = attn.attention(q, k, v, causal=True, backend=backend, **kw)
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        return torch.autograd.grad((dq * w).sum(), (q, k, v))

    for got, want in zip(second_order("triton"), second_order("tiled")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    cap = torch.tensor(5.0, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backend='tiled'"):
        second_order("triton", softcap=cap)


def test_a_score_term_the_transform_rules_do_not_apply_is_refused(monkeypatch):
    """A term tiled's forward and backward apply (here a toy bias, patched into _Tile) but
    TileScores does not: forward-mode AD and the double backward raise, naming it, instead
    of differentiating a call without it."""
    from attn.spec import LaunchSpec, Operands, ScoreTerms
    from attn.tiled import tile, tiled_attention

    plain_scores = tile._Tile.scores

    def scores(self, *args, **kwargs):
        s, u, t = plain_scores(self, *args, **kwargs)
        return s.add_(self.spec.terms.get("score_bias", 0.0) * tile.LOG2E), u, t

    monkeypatch.setattr(tile, "SCORE_TERMS", ("score_bias",))
    monkeypatch.setattr(tile._Tile, "scores", scores)
    spec = LaunchSpec(qk_scale=0.5, terms=ScoreTerms.of(score_bias=0.5))
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    out = tiled_attention(q, k, v, spec, Operands())[0]  # the plain call runs
    assert out.shape == (1, 2, 8, 4)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="score_bias"):
        torch.func.jvp(lambda *x: tiled_attention(*x, spec, Operands())[0], (q, k, v), tangents)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(tiled_attention(*xs, spec, Operands())[0].sum(), xs,
                                create_graph=True)
    with pytest.raises(NotImplementedError, match="score_bias"):
        torch.autograd.grad(sum(g.square().sum() for g in grads), xs)
