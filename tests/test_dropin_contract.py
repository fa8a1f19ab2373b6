"""attn.scaled_dot_product_attention keeps torch's contract where torch's own tests look:
causal biases, ``attn_mask`` beside ``is_causal``, the errors' classes, torch.export.

torch's test file cannot be fetched in CI; these tests pin each behaviour against torch's own
function (or attn's float64 reference where torch's answer is not the point)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant, causal_lower_right, \
    causal_upper_left

import attn
from attn.call import SdpaInputError, SdpaTypeError
from attn.sdpa import torch_sdpa

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias")

F64 = torch.float64
BIASES = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}
LENGTHS = [(4, 6), (6, 4), (5, 5), (1, 17), (17, 3)]
LEADS = {"2d": (), "3d": (3,), "4d": (2, 3), "5d": (2, 2, 3)}


def _qkv(lead, L, S, seed, E=8, Ev=8, kv_heads=None, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    kv_lead = lead if kv_heads is None else (*lead[:-1], kv_heads)
    q = torch.randn(*lead, L, E, generator=g, dtype=F64)
    k = torch.randn(*kv_lead, S, E, generator=g, dtype=F64)
    v = torch.randn(*kv_lead, S, Ev, generator=g, dtype=F64)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _zero_nan_rows(x):
    # a row no key reaches: attn gives zeros (documented), older torch NaN
    return x.nan_to_num(0.0)


class _Untouchable(CausalBias):
    """A causal bias whose tensor data must never be read: any torch function but SDPA on
    it fails the test (torch's own dispatch sends SDPA to ``_dispatch``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch_sdpa or func is F.scaled_dot_product_attention:
            return cls._dispatch(*args, **(kwargs or {}))
        raise AssertionError(f"the bias was read as a tensor by {func}")


# -- causal biases -----------------------------------------------------------------------------

@pytest.mark.parametrize("L,S", LENGTHS)
@pytest.mark.parametrize("lead", list(LEADS))
@pytest.mark.parametrize("variant", list(BIASES))
def test_causal_bias_matches_torch(variant, lead, L, S):
    q, k, v = _qkv(LEADS[lead], L, S, seed=L * 31 + S)
    bias = BIASES[variant](L, S)
    theirs = _zero_nan_rows(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    ours = attn.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    do = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), do),
                    torch.autograd.grad(theirs, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", list(CausalVariant))
def test_causal_bias_is_a_band_not_a_dense_mask(variant):
    """GQA, and a bias whose tensor data would fail the test if anything read it."""
    q, k, v = _qkv((2, 4), 5, 9, seed=1, kv_heads=2, requires_grad=False)
    bias = _Untouchable(variant, 5, 9)
    keep = torch.ones(5, 9, dtype=torch.bool).tril(0 if variant == CausalVariant.UPPER_LEFT
                                                   else 4)
    ours = attn.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    theirs = torch_sdpa(q, k, v, attn_mask=keep, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", list(BIASES))
def test_causal_bias_with_is_causal_raises_like_torch(variant):
    q, k, v = _qkv((1, 2), 4, 6, seed=2)
    with pytest.raises(ValueError) as theirs:
        F.scaled_dot_product_attention(q, k, v, attn_mask=BIASES[variant](4, 6), is_causal=True)
    with pytest.raises(SdpaInputError, match="CausalBias.*is_causal=True") as ours:
        attn.scaled_dot_product_attention(q, k, v, attn_mask=BIASES[variant](4, 6),
                                          is_causal=True)
    assert isinstance(ours.value, type(theirs.value))


def test_lower_right_bias_of_other_lengths_is_refused():
    q, k, v = _qkv((1, 2), 4, 6, seed=3)
    with pytest.raises(SdpaInputError, match=r"7 x 9.*L = 4, S = 6"):
        attn.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(7, 9))


@pytest.mark.parametrize("L,S", [(4, 6), (6, 4)])
@pytest.mark.parametrize("variant", list(BIASES))
def test_patch_routes_a_bias_from_sdpa_bound_before_it(variant, L, S):
    """torch's function held under another name (bound before the patch) with a causal
    bias: the bias dispatches itself, and under the patch that reaches attn, correctly."""
    early = torch_sdpa  # what `from torch.nn.functional import ...` bound at import
    q, k, v = _qkv((2, 3), L, S, seed=4, requires_grad=False)
    theirs = _zero_nan_rows(early(q, k, v, attn_mask=BIASES[variant](L, S)))
    hook = CausalBias.__dict__["__torch_function__"]
    with attn.patch_sdpa("tiled") as patch:
        ours = early(q, k, v, attn_mask=BIASES[variant](L, S))
        late = F.scaled_dot_product_attention(q, k, v, attn_mask=BIASES[variant](L, S))
    assert patch.calls == 2
    assert CausalBias.__dict__["__torch_function__"] is hook  # restored with the patch
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(late, theirs, rtol=1e-12, atol=1e-12)


def test_attention_refuses_a_causal_bias_it_would_misread():
    q, k, v = _qkv((1, 2), 4, 6, seed=3, requires_grad=False)
    with pytest.raises(TypeError, match="CausalBias.*causal=True"):
        attn.attention(q, k, v, attn_mask=causal_lower_right(4, 6))


# -- attn_mask with is_causal ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_with_is_causal_raises_but_attention_combines_them(kind):
    q, k, v = _qkv((2, 3), 7, 7, seed=5, requires_grad=False)
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(7, 7, generator=g) > 0.3
    if kind == "float":
        mask = torch.zeros(7, 7, dtype=F64).masked_fill(~mask, float("-inf"))
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when "
                                           "is_causal=True") as info:
        attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert isinstance(info.value, SdpaInputError)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    both = mask & causal if kind == "bool" else mask.masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(attn.attention(q, k, v, causal=True, attn_mask=mask),
                               attn.attention(q, k, v, attn_mask=both, backend="reference"))


# -- one error class -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw", ["plain", "is_causal", "bool_mask", "float_mask"])
def test_two_dim_inputs_are_one_sequence_of_one_head(kw):
    """torch takes (L, E) inputs; the drop-in does too: the float64 reference on the
    (1, 1, L, E) view, out and gradients, in the caller's 2-d shape."""
    q, k, v = _qkv((), 5, 7, seed=3, Ev=6)
    g = torch.Generator().manual_seed(4)
    kws = {"plain": {}, "is_causal": {"is_causal": True},
           "bool_mask": {"attn_mask": torch.rand(5, 7, generator=g) > 0.4},
           "float_mask": {"attn_mask": torch.randn(7, generator=g, dtype=F64)}}[kw]
    ours = attn.scaled_dot_product_attention(q, k, v, **kws)
    assert ours.shape == (5, 6)
    top_left = torch.ones(5, 7, dtype=torch.bool).tril()  # is_causal: key j <= query i
    mask = top_left if kw == "is_causal" else kws.get("attn_mask")
    want = attn.attention(q[None, None], k[None, None], v[None, None], backend="reference",
                          attn_mask=mask)[0, 0]
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
    do = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), do),
                    torch.autograd.grad(want, (q, k, v), do)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _bad_calls():
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    m = torch.ones(4, 4, dtype=torch.bool)
    return {  # fault: (arguments, keywords, the argument the message names, a dtype fault)
        "query_1d": ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), {}, "query", False),
        "key_rank": ((q, k[0], v), {}, "key", False),
        "mixed_dtypes": ((q, k.double(), v), {}, "key", True),
        "int_dtype": ((q.long(), k.long(), v.long()), {}, "query", True),
        "not_a_tensor": ((q.tolist(), k, v), {}, "query", True),
        "head_dim": ((q, k[..., :5], v), {}, "key", False),
        "batch": ((q, k[:1], v[:1]), {}, "key", False),
        "heads_without_gqa": ((q, k[:, :1], v[:, :1]), {}, "enable_gqa", False),
        "mask_shape": ((q, k, v), {"attn_mask": m[:3]}, "attn_mask", False),
        "mask_dtype": ((q, k, v), {"attn_mask": m.long()}, "attn_mask", True),
        "dropout": ((q, k, v), {"dropout_p": 1.5}, "dropout_p", False),
    }


@pytest.mark.parametrize("fault", list(_bad_calls()))
def test_dropin_input_errors_are_one_class_that_torch_code_catches(fault):
    args, kw, named, dtype_fault = _bad_calls()[fault]
    with pytest.raises(SdpaInputError) as ours:
        attn.scaled_dot_product_attention(*args, **kw)
    err = ours.value
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    assert isinstance(err, TypeError) == dtype_fault == isinstance(err, SdpaTypeError)
    assert named in str(err), str(err)
    try:
        torch_sdpa(*args, **kw)
    except Exception as theirs:  # what code written for torch catches, ours is too
        assert isinstance(err, type(theirs)), (type(theirs), err)


def test_attention_keeps_its_own_error_classes():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError) as rank:
        attn.attention(q[0], q, q)
    with pytest.raises(TypeError) as dtype:
        attn.attention(q, q.double(), q)
    assert not isinstance(rank.value, RuntimeError)
    assert not isinstance(dtype.value, RuntimeError)


# -- torch.export with a dynamic length --------------------------------------------------------

class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v, mask=None):
        if mask is None:
            return attn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("case", ["causal", "mask_gqa"])
def test_export_with_dynamic_lengths_runs_at_other_lengths(case):
    from torch.export import Dim, export

    n, s = Dim("n", min=2, max=4096), Dim("s", min=2, max=4096)
    g = torch.Generator().manual_seed(7)

    def inputs(L, S):
        hkv = 4 if case == "causal" else 2
        q = torch.randn(2, 4, L, 16, generator=g)
        k, v = (torch.randn(2, hkv, S, 16, generator=g) for _ in range(2))
        mask = torch.rand(L, S, generator=g) > 0.3
        return (q, k, v) if case == "causal" else (q, k, v, mask)

    if case == "causal":  # is_causal's top-left band with one length for queries and keys
        example, shapes, lengths = inputs(24, 24), ({2: n}, {2: n}, {2: n}), [(9, 9), (70, 70)]
    else:
        example = inputs(24, 31)
        shapes, lengths = ({2: n}, {2: s}, {2: s}, {0: n, 1: s}), [(9, 40), (70, 5)]
    program = export(_Sdpa(), example, dynamic_shapes=shapes).module()
    for L, S in lengths:  # compared with torch's function in float64, gradients included
        args = inputs(L, S)
        q, k, v = (t.requires_grad_() for t in args[:3])
        kw = {"is_causal": True} if case == "causal" else {"attn_mask": args[3],
                                                             "enable_gqa": True}
        got = program(*args)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        exact = torch_sdpa(q64, k64, v64, **kw)
        torch.testing.assert_close(got.double(), exact, rtol=2e-5, atol=2e-5)
        do = torch.randn(got.shape, generator=g)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), do),
                        torch.autograd.grad(exact, (q64, k64, v64), do.double())):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


class _WithLse(torch.nn.Module):
    def forward(self, q, k, v):
        return attn.attention(q, k, v, causal=True, return_lse=True)


def test_export_carries_the_lse_and_its_gradient():
    """attn.attention(return_lse=True) exported: the lse at another length, and a loss on
    it reaching q and k through the exported backward."""
    from torch.export import Dim, export

    n = Dim("n", min=2, max=4096)
    g = torch.Generator().manual_seed(8)
    example = tuple(torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    program = export(_WithLse(), example, dynamic_shapes=({2: n},) * 3).module()
    q, k, v = (torch.randn(1, 2, 70, 8, generator=g).requires_grad_() for _ in range(3))
    out, lse = program(q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attn.attention(q64, k64, v64, causal=True, return_lse=True,
                                  backend="reference")
    torch.testing.assert_close(lse.double(), lse64, rtol=2e-5, atol=2e-5)
    w = torch.randn(lse.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out.sum() + (lse * w).sum()), (q, k, v)),
                    torch.autograd.grad((out64.sum() + (lse64 * w.double()).sum()),
                                        (q64, k64, v64))):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_export_ops_take_only_a_spec_they_carry_whole():
    """The export ops rebuild the spec from a few fields: a call setting any other (here a
    score term, dropout, a shard, a score_mod) stays off them instead of losing it."""
    import dataclasses
    import importlib

    from attn.masks import Band
    from attn.spec import LaunchSpec, Operands, ScoreTerms

    tiled_attention = importlib.import_module("attn.tiled.attention")
    plain = LaunchSpec(qk_scale=0.5, band=Band(2, 3, None), softcap=3.0, block_m=32)
    config = tiled_attention.DEFAULT
    assert tiled_attention._exportable(plain, Operands(), config)
    for extra in (dict(terms=ScoreTerms.of(score_bias=1.0)), dict(dropout_p=0.1),
                  dict(q_start=4), dict(score_mod=lambda s, b, h, i, j: s)):
        spec = dataclasses.replace(plain, **extra)
        assert not tiled_attention._exportable(spec, Operands(), config), extra
