"""Validation, backend choice, the sdpa backend and the torch-compatible drop-in."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import attn
from attn.api import AttentionCall, select_backend
from attn.masks import Band
from attn.testing import assert_close_to_reference, make_inputs


def _qkv(**kw):
    return make_inputs(**{"B": 2, "H": 4, "N": 8, "D": 16, **kw})


# -- validation: bad input raises with the argument and the shapes in the message --------------

@pytest.mark.parametrize("make,kwargs,exc,match", [
    (lambda: (torch.randn(2, 8, 16),) + _qkv()[1:], {}, ValueError, r"q must have 4 dims.*\(2, 8, 16\)"),
    (lambda: (_qkv()[0], torch.randn(3, 4, 8, 16), _qkv()[2]), {}, ValueError, r"batch.*\(3, 4, 8, 16\)"),
    (lambda: (_qkv()[0],) + _qkv(D=8)[1:], {}, ValueError, r"head dims differ.*\(2, 4, 8, 8\)"),
    (lambda: _qkv(Hkv=3), {}, ValueError, r"multiple of kv heads.*H=4, Hkv=3"),
    (lambda: (_qkv()[0], _qkv()[1], _qkv(Nk=9)[2]), {}, ValueError, r"k and v must agree"),
    (lambda: (_qkv()[0].double(),) + _qkv()[1:], {}, TypeError, r"share a dtype.*float64"),
    (lambda: (_qkv()[0].int(),) + _qkv()[1:], {}, TypeError, r"q must be float16.*int32"),
    (lambda: ([1.0],) + _qkv()[1:], {}, TypeError, r"q must be a torch.Tensor"),
    (_qkv, {"temperature": 0.0}, ValueError, r"temperature must be positive"),
    (_qkv, {"temperature": -1.0}, ValueError, r"temperature must be positive"),
    (_qkv, {"temperature": torch.tensor([1.0, 1.0, -2.0, 1.0])}, ValueError, r"temperature must be positive"),
    (_qkv, {"temperature": torch.ones(3)}, ValueError, r"temperature of shape \(3,\) does not broadcast to \(2, 4\)"),
    (_qkv, {"softcap": 0.0}, ValueError, r"softcap must be positive"),
    (_qkv, {"softcap": "big"}, TypeError, r"softcap must be a float"),
    (_qkv, {"attn_mask": torch.ones(8, 9, dtype=torch.bool)}, ValueError, r"attn_mask of shape \(8, 9\) does not broadcast to \(B, H, Nq, Nk\) = \(2, 4, 8, 8\)"),
    (_qkv, {"attn_mask": torch.ones(1, 2, 3, 8, 8, dtype=torch.bool)}, ValueError, r"attn_mask of shape"),
    (_qkv, {"attn_mask": torch.ones(8, 8, dtype=torch.int64)}, TypeError, r"attn_mask must be bool"),
    (_qkv, {"window": 3}, TypeError, r"window must be a pair.*got the int 3: \(3, 0\) for each query and the 3 keys before it.*\(3, 3\)"),
    (_qkv, {"window": (3, -2)}, ValueError, r"window sides must be >= 0, or -1"),
    (_qkv, {"window": (1.5, 2)}, TypeError, r"window must be a pair"),
    (_qkv, {"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(H,\) = \(4,\), got \(3,\)"),
    (_qkv, {"dropout_p": 1.0}, ValueError, r"dropout_p must be a float in \[0, 1\)"),
    (_qkv, {"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(H,\) = \(4,\) or \(B, H\) = \(2, 4\), got \(3,\)"),
    (_qkv, {"alibi_slopes": torch.ones(4, 2)}, ValueError, r"alibi_slopes must have shape .* got \(4, 2\)"),
    (_qkv, {"alibi_slopes": torch.ones(1, 2, 4)}, ValueError, r"alibi_slopes must have shape .* got \(1, 2, 4\)"),
    (_qkv, {"alibi_slopes": torch.ones(4, dtype=torch.int32)}, TypeError, r"alibi_slopes must be floating.*int32"),
    (_qkv, {"alibi_slopes": torch.ones(4, requires_grad=True)}, ValueError, r"alibi_slopes requires grad, but no gradient flows"),
    (_qkv, {"alibi_slopes": [0.5] * 4}, TypeError, r"alibi_slopes must be a torch.Tensor"),
    (_qkv, {"alibi_slopes": torch.ones(4, device="meta")}, ValueError, r"alibi_slopes is on meta"),
    (_qkv, {"backend": "cudnn"}, ValueError, r"backend must be one of"),
    (_qkv, {"causal": 1}, TypeError, r"causal must be a bool"),
    (_qkv, {"is_causal": True}, TypeError, r"unexpected keyword argument 'is_causal': attention\(\) takes causal=True.*attn.scaled_dot_product_attention"),
    (_qkv, {"window_size": (3, 0)}, TypeError, r"unexpected keyword argument 'window_size': attention\(\) takes window=\(left, right\)"),
])
def test_bad_input_raises_naming_argument(make, kwargs, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        attn.attention(q, k, v, **kwargs)


# -- backend choice ----------------------------------------------------------------------------

def _call(**kw):
    base = dict(device="cpu", dtype=torch.float32, head_dim=64, head_dim_v=64, n_q=128, n_k=128)
    return AttentionCall(**{**base, **kw})


def test_auto_on_cpu_takes_fused_or_tiled_and_says_why():
    # auto on CPU used to be tiled always; since the fused backend (torch's CPU kernel per
    # block) it is what attn.choose's committed table prefers for the call's class, among
    # the backends that can compute it: fused or tiled, never another, with the reason
    choice = select_backend(_call())
    assert choice.name in ("fused", "tiled")
    assert "auto" in choice.reason and ("measured" in choice.reason or "default" in choice.reason)
    # a call fused cannot express stays on tiled, and says why
    choice = select_backend(_call(softcap="fixed"))
    assert choice.name == "tiled" and "fused cannot: softcap" in choice.reason


def test_auto_on_cuda_explains_fallback_when_triton_cannot():
    choice = select_backend(_call(device="cuda", dtype=torch.float64))
    assert choice.name in ("tiled", "triton")
    if choice.name == "tiled":
        assert "triton" in choice.reason


@pytest.mark.parametrize("variant,needle", [
    ({"softcap": "fixed"}, "softcap"), ({"sinks": True}, "sinks"),
    ({"return_lse": True}, "return_lse"), ({"alibi": True}, "alibi_slopes"),
])
def test_sdpa_refuses_what_it_cannot_compute(variant, needle):
    with pytest.raises(NotImplementedError, match=needle):
        select_backend(_call(**variant), "sdpa")
    q, k, v = _qkv()
    kwargs = {"softcap": {"softcap": 5.0}, "sinks": {"sinks": torch.zeros(4)},
              "return_lse": {"return_lse": True},
              "alibi_slopes": {"alibi_slopes": torch.ones(4)}}[needle]
    with pytest.raises(NotImplementedError, match=f"{needle}.*tiled"):
        attn.attention(q, k, v, backend="sdpa", **kwargs)


def test_triton_on_cpu_is_refused_with_a_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match="triton"):
        select_backend(_call(), "triton")


# -- the sdpa backend computes the same function where it can ---------------------------------

SDPA_CASES = {
    "plain": {}, "causal": {"causal": True}, "window": {"window": (3, 1)},
    "temperature": {"temperature": 0.5},
    "temperature_tensor": {"temperature": (torch.rand(4) + 0.5).requires_grad_()},
    "bool_mask": {"attn_mask": torch.rand(2, 1, 11, 19) > 0.3},
    "float_mask": {"attn_mask": torch.randn(11, 19)},
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sdpa_backend_matches_reference(case, heads):
    q, k, v = make_inputs(B=2, H=heads[0], Hkv=heads[1], N=11, Nk=19, D=16, seed=3)
    sdpa = partial(attn.attention, backend="sdpa")
    assert_close_to_reference(sdpa, q, k, v, check_lse=False, **SDPA_CASES[case])


# -- attn.scaled_dot_product_attention is torch's, argument for argument ----------------------

@pytest.mark.parametrize("case", ["3d", "4d", "5d", "causal_square", "causal_tall", "causal_wide",
                                  "bool_mask", "float_mask", "gqa", "scale", "causal_and_mask"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sdpa_dropin_matches_torch(case, dtype):
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (2, 4, 13, 16), (2, 4, 13, 16)
    if case == "3d":
        shape_q, shape_kv = (3, 13, 16), (3, 21, 16)
    if case == "5d":
        shape_q, shape_kv = (2, 3, 4, 13, 16), (2, 3, 4, 21, 16)
    if case == "causal_tall":
        shape_kv = (2, 4, 7, 16)
    if case in ("causal_wide", "bool_mask", "float_mask", "causal_and_mask"):
        shape_kv = (2, 4, 21, 16)
    if case == "gqa":
        shape_kv = (2, 2, 13, 16)
    q = torch.randn(shape_q, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_kv, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_kv, generator=g, dtype=dtype, requires_grad=True)
    kw = {}
    if case.startswith("causal"):
        kw["is_causal"] = True
    if case in ("bool_mask", "causal_and_mask"):
        kw["attn_mask"] = torch.rand(2, 1, 13, 21, generator=g) > 0.3
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(13, 21, generator=g, dtype=dtype)
    if case == "gqa":
        kw["enable_gqa"] = True
    if case == "scale":
        kw["scale"] = 0.07
    if case == "causal_and_mask":  # torch's contract refuses both (attn.attention ANDs them)
        with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
            attn.scaled_dot_product_attention(q, k, v, **kw)
        return
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    ours = attn.scaled_dot_product_attention(q, k, v, **kw)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    do = torch.randn_like(ours)
    g_ours = torch.autograd.grad(ours, (q, k, v), do)
    g_theirs = torch.autograd.grad(theirs, (q, k, v), do)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=tol * 10, atol=tol * 10)


def test_sdpa_dropin_requires_enable_gqa():
    q, k, v = make_inputs(B=1, H=4, Hkv=2, N=5, D=8)
    with pytest.raises(ValueError, match="enable_gqa"):
        attn.scaled_dot_product_attention(q, k, v)


def test_top_left_band_is_torch_is_causal():
    band = Band(offset=0, right=0)
    keep = band.mask(torch.arange(3), torch.arange(5))
    assert torch.equal(keep, torch.ones(3, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_backend_functions_take_their_optional_tensors_as_operands_only(backend):
    """The backends' public functions take the optional tensors as one Operands bundle; the
    older keyword form is gone from both (a TypeError)."""
    from attn.spec import LaunchSpec, Operands

    if backend == "tiled":
        from attn.tiled import tiled_attention as fn
    else:
        pytest.importorskip("triton")
        from attn.flash_triton import triton_attention as fn
    # compiled triton kernels take CUDA tensors; without a GPU they run in the interpreter
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q = k = v = torch.randn(1, 2, 4, 8, device=dev)
    sinks = torch.zeros(2, device=dev)
    with pytest.raises(TypeError, match="sinks"):
        fn(q, k, v, LaunchSpec(qk_scale=1.0), sinks=sinks)
    ref = attn.attention(q, k, v, sinks=sinks, backend="reference")
    out, _ = fn(q, k, v, LaunchSpec(qk_scale=8 ** -0.5), Operands(sinks=sinks))
    torch.testing.assert_close(out, ref)
