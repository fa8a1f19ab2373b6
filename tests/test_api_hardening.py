"""Hardening of the public entry points (issue 21): values validated as well as types, empty
inputs answered as torch answers them, clear errors naming the caller's own arguments.

The context-parallel functions run at world size 1 in this process, on a gloo group over an
in-memory store (no sockets, no child processes), created and destroyed per test.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attn
from attn.api import AttentionCall, select_backend
from attn.testing import assert_close_to_reference, compare_to_reference, make_inputs


@pytest.fixture
def world1():
    """A one-rank gloo group in this process; torn down whatever the test does."""
    if dist.is_initialized():  # another test's group: not ours to reuse or destroy
        pytest.fail("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- item 5: tensor temperature / softcap values ----------------------------------------------

def _entry(name: str):
    """(function, q, k, v) of an entry point that takes temperature and softcap."""
    if name == "varlen_attention":
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in make_inputs(B=1, H=2, N=6, D=8))
        cu = torch.tensor([0, 2, 6], dtype=torch.int32)
        return partial(attn.varlen_attention, cu_seqlens_q=cu, cu_seqlens_k=cu), q, k, v
    q, k, v = make_inputs(B=1, H=2, N=6, D=8)
    if name == "attention":
        return attn.attention, q, k, v
    import attn.distributed as cp
    return getattr(cp, name), q, k, v


@pytest.mark.parametrize("entry", ["attention", "varlen_attention", "ring_attention",
                                   "ulysses_attention"])
@pytest.mark.parametrize("arg", ["temperature", "softcap"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])  # 0, < 0: test_api
def test_tensor_temperature_and_softcap_must_be_positive_and_finite(entry, arg, bad, request):
    if entry in ("ring_attention", "ulysses_attention"):
        request.getfixturevalue("world1")
    fn, q, k, v = _entry(entry)
    value = torch.tensor([1.0, bad])  # one bad head among good ones
    with pytest.raises(ValueError, match=rf"{arg} must be positive and finite.*{bad}"):
        fn(q, k, v, **{arg: value})


def test_value_check_runs_once_per_call_not_per_tile(monkeypatch):
    """The value check reads the whole tensor once per call (it costs a host sync)."""
    from attn import call

    seen = []
    real = call._positive

    def counted(name, x, *a, **kw):
        seen.append(name)
        return real(name, x, *a, **kw)

    monkeypatch.setattr(call, "_positive", counted)
    q, k, v = make_inputs(B=1, H=2, N=40, D=8)
    attn.attention(q, k, v, temperature=torch.tensor([0.5, 2.0]), softcap=torch.tensor([5.0, 9.0]),
                   block_m=8, block_n=8, backend="tiled")
    assert seen == ["temperature", "softcap"]


# -- item 11: empty inputs, and sdpa's causal path at scale 0 ---------------------------------

@pytest.mark.parametrize("L,S", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("lead", [(2,), (2, 3, 2)], ids=["3d", "5d"])
@pytest.mark.parametrize("mask,is_causal", [(None, False), (None, True), ("bool", False),
                                             ("float", False)])
def test_dropin_empty_lengths_match_torch(L, S, lead, mask, is_causal):
    """L = 0: an empty output; S = 0: zeros (torch's answer), and torch's gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*lead, L, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*lead, S, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*lead, S, 6, generator=g, dtype=torch.float64, requires_grad=True)
    m = {None: None, "bool": torch.ones(L, S, dtype=torch.bool),
         "float": torch.zeros(L, S, dtype=torch.float64)}[mask]
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal)
    ours = attn.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=is_causal)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    do = torch.randn(theirs.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), do),
                    torch.autograd.grad(theirs, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _no_key_oracle(q, k1, v1, **kw):
    """The float64 reference with one key that every row is forbidden to see: what a row
    that sees no key must give (zeros, lse = -inf or the sink)."""
    mask = torch.zeros(q.shape[2], 1, dtype=torch.bool)
    return attn.attention(q.double(), k1.double(), v1.double(), attn_mask=mask,
                          return_lse=True, backend="reference", **kw)


def _device(backend: str) -> str:
    """Where ``backend`` runs in this process: triton on the GPU when there is one (compiled
    kernels take no CPU tensors), else on CPU (the interpreter); the others on CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend,variant", [
    (b, var) for b in ("reference", "tiled", "triton", "sdpa")
    for var in ("plain", "causal", "sinks", "temperature")
    if not (b == "sdpa" and var == "sinks")])  # sdpa refuses sinks (test_api)
def test_attention_without_keys_gives_zeros_on_every_backend(backend, variant):
    dev = _device(backend)
    q, k1, v1 = make_inputs(B=2, H=4, Hkv=2, N=5, Nk=1, D=8, Dv=6, seed=1, device=dev)
    q.requires_grad_()
    k, v = (t[:, :, :0].clone().requires_grad_() for t in (k1, v1))  # Nk = 0
    kw = {"causal": {"causal": True},
          "sinks": {"sinks": torch.randn(4, dtype=torch.float32, device=dev).requires_grad_()},
          "temperature": {"temperature": (torch.rand(4, device=dev) + 0.5).requires_grad_()},
          "plain": {}}[variant]
    want_lse = backend != "sdpa"
    res = attn.attention(q, k, v, backend=backend, return_lse=want_lse, **kw)
    out, lse = res if want_lse else (res, None)
    exact_out, exact_lse = _no_key_oracle(q.detach().cpu(), k1.cpu(), v1.cpu(), **{
        n: (t.detach().double().cpu() if isinstance(t, torch.Tensor) else t)
        for n, t in kw.items()})
    assert out.shape == (2, 4, 5, 6) and out.dtype == q.dtype
    torch.testing.assert_close(out.double().cpu(), exact_out, rtol=0, atol=0)
    if lse is not None:
        assert lse.dtype == torch.float32
        torch.testing.assert_close(lse.double().cpu(), exact_lse, rtol=0, atol=0)
    # gradients: zeros for q, empty for k and v, and the sinks' through the lse alone
    loss = out.sum() + (lse.where(lse.isfinite(), 0).sum() if lse is not None else 0)
    leaves = [q, k, v] + [t for t in kw.values() if isinstance(t, torch.Tensor)]
    grads = torch.autograd.grad(loss, leaves)
    assert torch.equal(grads[0], torch.zeros_like(q))
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    if variant == "temperature":
        assert torch.equal(grads[3], torch.zeros(4, device=dev))
    if variant == "sinks":  # lse = sink on every row: d(sum lse)/d sink_h = B * Nq
        assert torch.equal(grads[3], torch.full((4,), 2.0 * 5, device=dev))


@pytest.mark.parametrize("backend", ["reference", "tiled", "triton", "sdpa"])
def test_attention_without_queries_or_batch_is_empty(backend):
    q, k, v = make_inputs(B=2, H=4, N=5, Nk=7, D=8, Dv=6, device=_device(backend))
    for qq, kk, vv in ((q[:, :, :0], k, v), (q[:0], k[:0], v[:0])):
        qq, kk, vv = (t.clone().requires_grad_() for t in (qq, kk, vv))
        out = attn.attention(qq, kk, vv, causal=True, backend=backend)
        assert out.shape == (qq.shape[0], 4, qq.shape[2], 6)
        grads = torch.autograd.grad(out.sum(), (qq, kk, vv))
        for t, gr in zip((qq, kk, vv), grads):
            assert torch.equal(gr, torch.zeros_like(t))


@pytest.mark.parametrize("entry", ["attention", "dropin"])
@pytest.mark.parametrize("which", ["heads", "head_dim"])
def test_zero_heads_or_head_dim_raise(entry, which):
    """Batch and lengths may be empty (data); heads and head dims may not (configuration)."""
    shape = (2, 0, 5, 8) if which == "heads" else (2, 4, 5, 0)
    q = k = v = torch.zeros(shape)
    if entry == "attention":
        names, call = ("q", "k"), attn.attention
    else:
        names, call = ("query", "key"), attn.scaled_dot_product_attention
    match = rf"{names[0]}.*{'head' if which == 'heads' else 'head dim'}.*\(2, " \
            rf"{shape[1]}, 5, {shape[3]}\)"
    with pytest.raises(ValueError, match=match):
        call(q, k, v)


def _dropin_sdpa(q, k, v, causal=False, scale=None):
    # top-left is_causal is attn's bottom-right causal on a square
    return attn.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             backend="sdpa")


@pytest.mark.parametrize("scale", [0.0, -0.5])
@pytest.mark.parametrize("fn", [partial(attn.attention, backend="sdpa"), _dropin_sdpa],
                         ids=["attention", "dropin"])
def test_sdpa_backend_causal_with_zero_or_negative_scale(scale, fn):
    """torch's is_causal path gives NaN for scale <= 0: the sdpa backend must not."""
    q, k, v = make_inputs(B=1, H=2, N=9, D=8, dtype=torch.float32, seed=2)
    assert_close_to_reference(fn, q, k, v, check_lse=False, causal=True, scale=scale)


# -- item 13: merge_attention's inputs -------------------------------------------------------

def _partials(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(2, 3, 5, 4, generator=g).to(dtype) for _ in range(2)]
    lse = [torch.randn(2, 3, 5, generator=g) for _ in range(2)]
    return out, lse


@pytest.mark.parametrize("bad,exc,match", [
    ("out_device", ValueError, r"outs\[1\] is on meta.*outs\[0\] on cpu"),
    ("lse_device", ValueError, r"lses\[1\] is on meta.*outs\[0\] on cpu"),
    ("out_int", TypeError, r"outs\[1\] must be floating.*int64"),
    ("lse_int", TypeError, r"lses\[0\] must be floating.*int64"),
    ("out_0d", ValueError, r"outs\[0\] must have at least 1 dim.*\(\)"),
    ("lse_posinf", ValueError, r"lses\[1\] has \+inf.*-inf"),
])
def test_merge_refuses_bad_partials(bad, exc, match):
    outs, lses = _partials()
    if bad == "out_device":
        outs[1] = outs[1].to("meta")
    elif bad == "lse_device":
        lses[1] = lses[1].to("meta")
    elif bad == "out_int":
        outs[1] = outs[1].long()
    elif bad == "lse_int":
        lses[0] = lses[0].long()
    elif bad == "out_0d":
        outs, lses = [torch.tensor(1.0), torch.tensor(2.0)], [torch.tensor(0.0)] * 2
    elif bad == "lse_posinf":
        lses[1][0, 0, 0] = float("inf")  # flash-attn's (compat's) empty-row convention
    with pytest.raises(exc, match=match):
        attn.merge_attention(outs, lses)


def test_merge_pair_form_names_its_arguments():
    outs, lses = _partials()
    with pytest.raises(ValueError, match=r"lse_b has \+inf"):
        attn.merge_attention(outs[0], lses[0], outs[1], torch.full_like(lses[1], float("inf")))


# -- item 17: argument types of the helpers -------------------------------------------------

def test_compare_to_reference_needs_a_callable():
    q, k, v = make_inputs(B=1, H=1, N=4, D=8)
    with pytest.raises(TypeError, match=r"fn must be callable.*str"):
        compare_to_reference("attn.attention", q, k, v)


def test_select_backend_needs_an_attention_call():
    with pytest.raises(TypeError, match=r"call must be an AttentionCall.*str"):
        select_backend("tiled")
    call = AttentionCall(device="cpu", dtype=torch.float32, head_dim=8, head_dim_v=8, n_q=4,
                         n_k=4)
    with pytest.raises(TypeError, match=r"backend must be a str.*list"):
        select_backend(call, ["tiled"])


@pytest.mark.parametrize("n,world_size,exc,match", [
    (8, 0, ValueError, r"world_size must be a positive int, got 0"),
    (8, -2, ValueError, r"world_size must be a positive int, got -2"),
    (8, 2.0, TypeError, r"world_size must be a positive int, got 2.0"),
    (-1, 2, ValueError, r"n must be a non-negative int, got -1"),
])
def test_shard_ranges_refuses_bad_sizes(n, world_size, exc, match):
    import attn.distributed as cp

    with pytest.raises(exc, match=match):
        cp.shard_ranges(n, world_size)


@pytest.mark.parametrize("device,exc", [("gpu0", ValueError), (3.5, TypeError),
                                        ("cuda:99", ValueError)])
def test_create_block_mask_bad_device_names_it(device, exc):
    with pytest.raises(exc, match=rf"device.*{device}"):
        attn.create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8, device=device)


# -- item 18: errors name the caller's arguments ---------------------------------------------

def _bad_call(entry: str, fault: str):
    """A call of ``entry`` whose second (key) argument is wrong in the way ``fault`` says."""
    q, k, v = make_inputs(B=1, H=2, N=6, D=8)
    if fault == "dtype":
        k = k.long()
    elif fault == "head_dim":
        k = k[..., :4]
    elif fault == "device":
        k = k.to("meta")
    elif fault == "not_tensor":
        k = k.tolist()
    elif fault == "length":
        v = v[:, :, :3]
    if entry == "dropin":
        return lambda: attn.scaled_dot_product_attention(q, k, v)
    if entry == "flex":
        return lambda: attn.flex_attention(q, k, v)
    import attn.distributed as cp
    return lambda: getattr(cp, entry)(q, k, v)


_NAMES = {"dropin": ("query", "key", "value"), "flex": ("query", "key", "value"),
          "ring_attention": ("q", "k", "v"), "ulysses_attention": ("q", "k", "v")}


@pytest.mark.parametrize("entry", list(_NAMES))
@pytest.mark.parametrize("fault", ["dtype", "head_dim", "device", "not_tensor", "length"])
def test_errors_name_the_callers_arguments(entry, fault, request):
    if entry in ("ring_attention", "ulysses_attention"):
        request.getfixturevalue("world1")
    nq, nk, nv = _NAMES[entry]
    with pytest.raises((ValueError, TypeError)) as info:
        _bad_call(entry, fault)()
    msg = str(info.value)
    named = {"length": nv}.get(fault, nk)
    assert f"{named} " in msg or f"{named}," in msg, msg
    if entry in ("dropin", "flex"):  # attn's internal names must not leak
        for internal in ("q", "k", "v"):
            assert f" {internal} (" not in msg and not msg.startswith(f"{internal} "), msg


def test_dropin_messages_show_the_callers_shapes():
    q = torch.zeros(2, 3, 4, 5, 8)
    k = v = torch.zeros(3, 2, 4, 5, 8)  # the same 6 rows once flattened: refused, not mixed up
    with pytest.raises(ValueError, match=r"query.*\(2, 3, 4, 5, 8\).*key.*\(3, 2, 4, 5, 8\)"):
        attn.scaled_dot_product_attention(q, k, v)
    q, k, v = (torch.zeros(3, 5, 8),) * 3
    with pytest.raises(ValueError, match=r"attn_mask is on meta, query on cpu"):
        attn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 5, device="meta"))


def test_dropin_mask_must_broadcast_to_the_scores_not_grow_them():
    """A mask that broadcasts with the scores only by growing a size-1 dim is refused naming
    attn_mask, on 5-d inputs as on 4-d ones (it reached a raw expand error before)."""
    q = torch.randn(1, 1, 1, 1, 2)
    for x in (q, q[0]):
        with pytest.raises(ValueError, match="attn_mask of shape"):
            attn.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(2, 3, dtype=torch.bool))
    q = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64)
    m = torch.rand(3, 1, 5, 5) > 0.2
    torch.testing.assert_close(attn.scaled_dot_product_attention(q, q, q, attn_mask=m),
                               F.scaled_dot_product_attention(q, q, q, attn_mask=m))
