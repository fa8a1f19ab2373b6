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


@pytest.mark.parametrize("causal,packed", [(False, False), (True, False), (True, True)])
def test_saturated_softmax_gradients_triton(causal, packed):
    """The same on triton, dense and varlen kernels (dq, dk were 3e-3..7e-3 over a 2e-6
    budget): the forward keeps each row's log l, and the dQ kernel's Δ pass gives blocks
    holding a saturated row Δ = Σ P·dP. The temperature is a tensor: folded into q, no
    scale on the host shows it."""
    q, k, v = make_inputs(B=2 if packed else 1, H=2, N=17, Nk=17 if packed else 33, D=16,
                          seed=0)
    fn = _packed("triton") if packed else (
        lambda q, k, v, **a: attn.attention(q, k, v, backend="triton", **a))
    # through out alone: with the lse's gradient too, its own noise sets a budget the
    # error stays under either way
    report = compare_to_reference(fn, q, k, v, temperature=torch.full((2,), 1e-4),
                                  check_lse=False, causal=causal)
    assert report.ok, str(report)


def _huge_values(v, rows=slice(None)):
    """``v`` with batch ``rows`` scaled to within 12% of float32's largest value (finite,
    and representable in bfloat16 too)."""
    v = v.clone()
    v[rows] = (v[rows].float().clamp(-1, 1) * 3e38).to(v.dtype)
    return v


def _packed(backend):
    """A (B, H, N, D) call run as B packed sequences through varlen_attention."""
    def fn(q, k, v, return_lse=False, **kw):
        B, H, N = q.shape[:3]
        cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32)
        cu_k = torch.arange(0, (B + 1) * k.shape[2], k.shape[2], dtype=torch.int32)
        pack = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731  (B·N, H, D)
        res = attn.varlen_attention(pack(q), pack(k), pack(v), cu, cu_k, backend=backend,
                                    return_lse=return_lse, **kw)
        out = (res[0] if return_lse else res).unflatten(0, (B, N)).transpose(1, 2)
        return (out, res[1].unflatten(1, (B, N)).transpose(0, 1)) if return_lse else out
    return fn


HUGE_V_CASES = {"plain": dict(), "causal_sinks": dict(causal=True, sinks=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(HUGE_V_CASES))
@pytest.mark.parametrize("backend,packed", [("tiled", False), ("triton", False),
                                            ("triton", True)])
def test_values_near_dtype_max_stay_finite(backend, packed, case, dtype):
    """max|v| = 3e38 (finite in float32 and bfloat16): Σ p·v over the keys passed the
    largest float32 and the output came back inf / NaN, where the reference (normalised P)
    stays finite. Out and lse against the float64 reference on the same values, GQA."""
    kw = dict(HUGE_V_CASES[case])
    q, k, v = make_inputs(B=2, H=4, Hkv=2, N=17, Nk=40 if not packed else 17, D=16,
                          dtype=dtype, seed=4)
    v = _huge_values(v)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 2.0, 4)
    fn = _packed(backend) if packed else (
        lambda q, k, v, **a: attn.attention(q, k, v, backend=backend, **a))
    report = compare_to_reference(fn, q, k, v, grad=False, **kw)
    assert report.ok, str(report)


@pytest.mark.parametrize("backend,packed", [("tiled", False), ("triton", False),
                                            ("triton", True)])
def test_huge_values_of_one_sequence_change_no_other_bit(backend, packed):
    """The offset that keeps huge values finite is each sequence's own: batch row (packed
    sequence) 0 at 3e38 leaves row 1's output bit for bit what it is alone."""
    q, k, v = make_inputs(B=2, H=2, N=17, D=16, seed=5)
    fn = _packed(backend) if packed else (
        lambda q, k, v, **a: attn.attention(q, k, v, backend=backend, **a))
    both = fn(q, k, _huge_values(v, rows=0))
    alone = fn(q[1:], k[1:], v[1:])
    assert both[0].isfinite().all()
    assert torch.equal(both[1:], alone)
