"""merge_attention: pairs and lists of partials over disjoint key sets equal attention over all."""

import pytest
import torch

import attn
from attn.testing import make_inputs


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    edges = torch.linspace(0, n, parts + 1).round().long().tolist()
    return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_list_of_partials_equals_full_attention(parts, causal):
    q, k, v = make_inputs(B=2, H=4, N=33, Nk=71, D=16, Hkv=2, dtype=torch.float64, seed=parts)
    Nq, Nk = q.shape[2], k.shape[2]
    full, lse_full = attn.attention(q, k, v, causal=causal, return_lse=True, backend="reference")
    outs, lses = [], []
    for n0, n1 in _chunks(Nk, parts):
        # the chunk's keys keep their global column: mask what causal hides from each row
        j = torch.arange(n0, n1)
        i = torch.arange(Nq)[:, None]
        mask = (j[None, :] <= i + Nk - Nq) if causal else torch.ones(Nq, n1 - n0, dtype=torch.bool)
        o, lse = attn.attention(q, k[:, :, n0:n1], v[:, :, n0:n1], attn_mask=mask,
                                return_lse=True, backend="reference")
        outs.append(o)
        lses.append(lse)
    out, lse = attn.merge_attention(outs, lses)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_full, rtol=1e-12, atol=1e-12)
    assert lse.dtype == torch.float64


def test_pair_form_equals_list_form():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 5, 8, generator=g)
    la, lb = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    o1, l1 = attn.merge_attention(a, la, b, lb)
    o2, l2 = attn.merge_attention([a, b], [la, lb])
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)


def test_rows_that_saw_nothing_stay_finite():
    out = torch.randn(1, 2, 4, 8)
    lse = torch.randn(1, 2, 4)
    lse_none = torch.full((1, 2, 4), float("-inf"))
    # -inf in one part: the others pass through unchanged
    o, l = attn.merge_attention([out, torch.zeros_like(out), out * 0], [lse, lse_none, lse_none])
    torch.testing.assert_close(o, out)
    torch.testing.assert_close(l, lse)
    # -inf everywhere: zeros and -inf, never NaN
    o, l = attn.merge_attention([torch.zeros_like(out)] * 3, [lse_none] * 3)
    assert torch.equal(o, torch.zeros_like(out))
    assert torch.isneginf(l).all()


def test_low_precision_partials_round_once():
    # 8 bf16 partials: merged in float32 and cast once, the error is that of one bf16
    # rounding of the exact result; merging pairwise through bf16 rounds seven times
    g = torch.Generator().manual_seed(1)
    outs64 = [torch.randn(4, 8, 64, 32, generator=g, dtype=torch.float64) for _ in range(8)]
    lses = [torch.randn(4, 8, 64, generator=g, dtype=torch.float64) for _ in range(8)]
    outs = [o.to(torch.bfloat16) for o in outs64]
    exact, _ = attn.merge_attention([o.double() for o in outs], lses)
    merged, _ = attn.merge_attention(outs, [lse.float() for lse in lses])
    one_rounding = (exact.to(torch.bfloat16).double() - exact).abs().max()
    assert (merged.double() - exact).abs().max() <= one_rounding * 1.01 + 1e-6
    o, lse = outs[0], lses[0].float()
    for o_p, lse_p in zip(outs[1:], lses[1:]):
        o, lse = attn.merge_attention(o, lse, o_p, lse_p.float())
    assert (o.double() - exact).abs().max() > (merged.double() - exact).abs().max()


def test_bad_input_names_the_argument():
    a = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="lse_a"):
        attn.merge_attention(a, torch.zeros(1, 2, 4), a, torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"outs\[1\]"):
        attn.merge_attention([a, torch.zeros(1, 2, 3, 5)], [torch.zeros(1, 2, 3)] * 2)
    with pytest.raises(ValueError, match="as many lses"):
        attn.merge_attention([a, a], [torch.zeros(1, 2, 3)])
    with pytest.raises(TypeError, match="arguments"):
        attn.merge_attention(a, a, a)
    with pytest.raises(TypeError, match=r"lses\[0\]"):
        attn.merge_attention([a], [None])
