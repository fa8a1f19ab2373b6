"""Numerics at the edges: non-finite keys outside the mask, saturated softmax rows, huge values.

Every check is against the float64 reference with the project's budget (attn.testing), on
tiny shapes so the triton interpreter stays fast.
"""

import pytest
import torch

import attn
from attn.testing import compare_to_reference, make_inputs

BACKENDS = ["reference", "tiled", "triton"]


def _poisoned(backend, poison):
    """attention on ``k + poison`` (NaN / inf where poisoned, 0 elsewhere): the gradient
    reaches k unchanged, so a NaN dk at a poisoned key shows."""
    def fn(q, k, v, return_lse=False, **kw):
        return attn.attention(q, k + poison, v, backend=backend, return_lse=return_lse, **kw)
    return fn


def _keys_masked_for_every_row(Nq, Nk):
    # (name, attention kwargs, poisoned key indices): keys that no query may see
    keep = torch.ones(1, 1, 1, Nk, dtype=torch.bool)
    keep[..., [1, 4]] = False
    general = torch.rand(1, 1, Nq, Nk, generator=torch.Generator().manual_seed(3)) < 0.7
    general[..., [2, 5]] = False
    general[..., -1] = True
    return [
        ("window", dict(causal=True, window=(6, 0)), [0, 3]),  # keys < Nk - Nq - 6
        ("padding", dict(attn_mask=keep), [1, 4]),
        ("bool_mask", dict(attn_mask=general), [2, 5]),
        ("mask_mod", dict(mask_mod=lambda b, h, i, j: j % 5 != 2), [2, 7]),
        # a float bias whose -inf entries mask (DESIGN.md, Masks): those keys stay out too
        ("float_mask", dict(attn_mask=torch.randn(1, 2, Nq, Nk, generator=torch.Generator()
                                                  .manual_seed(4)).index_fill(
            -1, torch.tensor([0, 6]), float("-inf"))), [0, 6]),
    ]


CASES = [c[0] for c in _keys_masked_for_every_row(12, 24)]


# triton: no mask_mod; its band path runs in the causal test below
@pytest.mark.parametrize("backend,case", [(b, c) for b in BACKENDS for c in CASES
                                          if not (b == "triton" and c in ("mask_mod", "window"))])
def test_masked_nonfinite_key_changes_nothing(backend, case):
    """A NaN / inf key that every row's mask excludes: out, lse and dq, dk, dv equal the
    float64 reference on the same inputs with those keys finite (dk there 0, not NaN).
    """
    Nq, Nk = 12, 24
    _, kwargs, keys = next(c for c in _keys_masked_for_every_row(Nq, Nk) if c[0] == case)
    q, k, v = make_inputs(B=1, H=2, N=Nq, Nk=Nk, D=16, seed=1)
    poison = torch.zeros_like(k)
    poison[:, :, keys[0]] = float("nan")
    poison[:, :, keys[1]] = float("inf")
    poison[:, 1, keys[1], 0] = float("-inf")
    report = compare_to_reference(_poisoned(backend, poison), q, k, v, **kwargs)
    assert report.ok, str(report)
    assert {c.name for c in report.comparisons} >= {"out", "lse", "dq", "dk", "dv"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_key_outside_causal_stays_out_of_earlier_rows(backend):
    """Causal: a NaN key reaches the rows that see it and no other (out and lse)."""
    N, j = 20, 13
    q, k, v = make_inputs(B=1, H=2, N=N, D=16, seed=2)
    bad = k.clone()
    bad[:, :, j] = float("nan")
    out, lse = attn.attention(q, bad, v, causal=True, backend=backend, return_lse=True)
    exact, exact_lse = attn.attention(q.double(), k.double(), v.double(), causal=True,
                                      backend="reference", return_lse=True)
    plain, plain_lse = attn.attention(q, k, v, causal=True, backend="reference",
                                      return_lse=True)
    assert out[:, :, j:].isnan().all()  # the rows that see it
    for got, ex, pl in ((out, exact, plain), (lse, exact_lse, plain_lse)):
        err = (got[:, :, :j].double() - ex[:, :, :j]).abs().max().item()
        plain_err = (pl[:, :, :j].double() - ex[:, :, :j]).abs().max().item()
        assert err <= 2 * plain_err + 2e-6 * max(1.0, ex[:, :, :j].abs().max().item())


@pytest.mark.parametrize("check_lse", [False, True])
def test_saturated_softmax_gradients_tiled(check_lse):
    """A tiny temperature makes every row one-hot: the exact dq, dk are ~0 and plain fp32
    gets ~0 too; Δ = rowsum(dO∘O) alone left dq, dk at 1e-3..1e-2 (Δ and dP round apart,
    times scale·K)."""
    q, k, v = make_inputs(B=1, H=2, N=17, Nk=33, D=16, seed=0)

    def fn(q, k, v, **kw):
        return attn.attention(q, k, v, backend="tiled", **kw)
    report = compare_to_reference(fn, q, k, v, temperature=1e-4, check_lse=check_lse)
    assert report.ok, str(report)
