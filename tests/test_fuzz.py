"""Property tests over attn's public entry points (hypothesis).

Each entry point gets two properties:

* valid calls (random shapes, dtypes and variants, tiny sizes): the result equals the
  float64 reference within the error budget of attn.testing, and never holds a NaN
  (finite inputs; a row that sees no key gives zeros, lse -inf, or +inf in compat);
* invalid calls, one argument made invalid at a time (the test id names it): a ValueError
  or TypeError (NotImplementedError for an explicit backend that cannot) whose message names
  that argument as the caller spelled it (``k_cache``, ``query``, ``x``).

The isolation properties at the end (slow) poison one sequence of a packed, paged or
batched call with NaN, inf or huge values and require every other sequence's output and lse
to keep every bit; and a key no query may see must not reach any score.

Every property runs in two profiles: "quick" (the default suite, a few seconds each,
derandomized so CI sees the same cases every run) and "long" (``-m slow``, many more
cases). Backends: reference and tiled (the triton interpreter is too slow to fuzz here).
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any, Callable, NamedTuple
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import AuxRequest

import attn
from attn.api import AttentionCall, BACKENDS
from attn.compat import flash_attn as fa
from attn.masks import Band
from attn.testing import compare_to_reference
from fuzz_oracles import (F64, assert_refused, check_budget, fa_attention, fa_varlen_loop,
                          fa_window, reference, rotate, varlen_loop)

NAN, INF = float("nan"), float("inf")


def run_property(strategy, body: Callable, examples: int) -> None:
    """``body(case)`` for ``examples`` cases drawn from ``strategy``, derandomized."""
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def prop(case):
        body(case)

    prop()


QUICK = pytest.param(False, id="quick")
LONG = pytest.param(True, id="long", marks=pytest.mark.slow)
PROFILES = [QUICK, LONG]


def n_examples(long: bool, quick: int, slow: int | None = None) -> int:
    return (slow or 10 * quick) if long else quick


# -- drawing tensors ---------------------------------------------------------------------------

def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        values = f"={x.tolist()}" if x.numel() <= 6 and x.device.type != "meta" else ""
        return f"T{tuple(x.shape)}:{str(x.dtype)[6:]}{values}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return "[" + ", ".join(describe(t) for t in x) + "]"
    if isinstance(x, Bad):
        return describe(x.value)
    if isinstance(x, Case):
        return repr(x)
    if callable(x):
        return getattr(x, "__name__", type(x).__name__)
    text = repr(x)  # a tensor passed as a nested list can be long
    return text if len(text) <= 80 else text[:77] + "..."


class Case:
    """One drawn call: what it needs, shown compactly when hypothesis reports it (a plain
    class: hypothesis would print a dataclass field by field, tensors in full)."""

    def __init__(self, args: dict, note: str = "") -> None:
        self.__dict__["args"], self.__dict__["note"] = args, note

    def __getattr__(self, name):
        try:
            return self.__dict__["args"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"Case({self.note}{describe(self.args)})"


class Gen:
    """Seeded tensors for one case (the seed is drawn, so hypothesis can shrink it)."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, dtype=F64, amp=1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g, dtype=F64) * amp).to(dtype)

    def rand(self, *shape, lo=0.0, hi=1.0, dtype=F64) -> torch.Tensor:
        return (torch.rand(shape, generator=self.g, dtype=F64) * (hi - lo) + lo).to(dtype)

    def bools(self, *shape, p=0.7) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) < p

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)


seeds = st.integers(0, 2**20)
float_dtypes = st.sampled_from([F64, F64, torch.float32, torch.float32, torch.bfloat16,
                                torch.float16])
backends = st.sampled_from(["tiled", "tiled", "reference"])
tile_sizes = st.sampled_from([None, None, 3, 8, 16])


def maybe(draw, p_true: bool = True) -> bool:
    return draw(st.booleans()) if p_true else False


def lengths(draw, n: int, hi: int, lo: int = 0) -> list[int]:
    return [draw(st.integers(lo, hi)) for _ in range(n)]


def offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def no_nan(name: str, t: torch.Tensor) -> None:
    assert not torch.isnan(t).any(), f"{name} holds NaN from finite inputs"


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the call in ``dtype`` sees it, in float64: the exact answer is the one for
    the inputs the call was given."""
    return t.detach().to(dtype).to(F64) if t.is_floating_point() else t


def rounded_kw(kw: dict, dtype: torch.dtype) -> dict:
    return {n: (rounded(t, dtype) if isinstance(t, torch.Tensor) and n != "alibi_slopes"
                else t) for n, t in kw.items()}


def cast_kw(kw: dict, dtype: torch.dtype) -> dict:
    return {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                and n != "alibi_slopes" else t) for n, t in kw.items()}


# -- invalid calls -----------------------------------------------------------------------------

class Bad(NamedTuple):
    """One invalid call: ``run()`` must raise one of ``errors`` naming ``names`` (default:
    the argument under test); ``value`` is what was made invalid, for the report."""

    run: Callable[[], Any]
    value: Any
    names: tuple[str, ...] = ()
    errors: tuple = (ValueError, TypeError)


def refuse_all(arg: str, bads: dict[str, Bad]) -> None:
    """Every invalid call is refused naming the argument; all failures are reported."""
    failures = []
    for kind, bad in bads.items():
        try:
            assert_refused(bad.run, bad.names or (arg,), bad.errors)
        except AssertionError as exc:
            failures.append(f"  [{kind}] {describe(bad.value)}: {str(exc).splitlines()[0]}")
    assert not failures, (f"{len(failures)} of {len(bads)} invalid {arg!r} calls:\n"
                          + "\n".join(failures))


def run_invalid(base, make_bads: Callable, arg: str, long: bool) -> None:
    """The property for one argument: drawn valid calls, each made invalid in every way
    ``make_bads(draw, case, arg)`` knows (one example tries them all)."""
    @st.composite
    def calls(draw):
        c = draw(base)
        return Case(dict(base=c, bads=make_bads(draw, c, arg)))

    run_property(calls(), lambda c: refuse_all(arg, c.bads), n_examples(long, 3, 30))


def labelled(values: list) -> dict[str, Any]:
    """Invalid values keyed by a short label (the kind shown in a failure)."""
    return {f"{i}:{describe(v)[:40]}": v for i, v in enumerate(values)}


# == attn.attention ============================================================================

@st.composite
def attention_calls(draw, max_n: int = 40) -> Case:
    g = Gen(draw(seeds))
    B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 3))
    nq, nk = draw(st.integers(1, max_n)), draw(st.integers(1, max_n))
    d = draw(st.integers(1, 16))
    dv = draw(st.one_of(st.just(d), st.integers(1, 16)))
    amp = draw(st.sampled_from([1.0, 1.0, 3.0, 10.0]))
    q, k, v = g.randn(B, H, nq, d, amp=amp), g.randn(B, hkv, nk, d), g.randn(B, hkv, nk, dv)
    kw: dict = {}
    if maybe(draw):
        kw["causal"] = True
    if maybe(draw):
        kw["window"] = (draw(st.integers(-1, nk + 1)), draw(st.integers(-1, nk + 1)))
    mask = draw(st.sampled_from([None, None, "bool", "key_padding", "float", "bool_bh"]))
    if mask == "bool":
        kw["attn_mask"] = g.bools(nq, nk)
    elif mask == "bool_bh":
        kw["attn_mask"] = g.bools(B, H, nq, nk, p=0.5)
    elif mask == "key_padding":
        kw["attn_mask"] = g.bools(B, 1, 1, nk, p=0.6)
    elif mask == "float":
        kw["attn_mask"] = g.randn(1, H, nq, nk).masked_fill(~g.bools(1, H, nq, nk), -INF)
    cap = draw(st.sampled_from([None, None, "float", "tensor"]))
    if cap == "float":
        kw["softcap"] = draw(st.floats(0.3, 30.0))
    elif cap == "tensor":
        kw["softcap"] = g.rand(H, lo=0.5, hi=20.0).requires_grad_()
    tau = draw(st.sampled_from([None, None, "float", "H", "BH", "scalar"]))
    if tau == "float":
        kw["temperature"] = draw(st.floats(0.05, 5.0))
    elif tau is not None:
        shape = {"H": (H,), "BH": (B, H), "scalar": ()}[tau]
        kw["temperature"] = g.rand(*shape, lo=0.2, hi=3.0).requires_grad_()
    if maybe(draw):
        kw["sinks"] = g.randn(H).requires_grad_()
    if maybe(draw):
        shape = draw(st.sampled_from([(H,), (B, H)]))
        kw["alibi_slopes"] = g.rand(*shape, lo=0.0, hi=1.0, dtype=torch.float32)
    if maybe(draw):
        kw["scale"] = draw(st.floats(0.01, 2.0))
    if draw(st.integers(0, 4)) == 0:
        kw["dropout_p"] = draw(st.floats(0.0, 0.5))
    backend = draw(backends)
    blocks = (draw(tile_sizes), draw(tile_sizes)) if backend == "tiled" else (None, None)
    dtype = draw(float_dtypes)
    grad = dtype in (F64, torch.float32) and draw(st.booleans())
    return Case(dict(q=q, k=k, v=v, kw=kw, backend=backend, blocks=blocks, dtype=dtype,
                     grad=grad))


def recording(fn: Callable, seen: list) -> Callable:
    """``fn``, keeping what it returns (to check it for NaN after a budget comparison)."""
    def run(*a, **kw):
        res = fn(*a, **kw)
        seen.append(res)
        return res
    return run


def check_attention(c: Case) -> None:
    seen: list = []
    fn = recording(partial(attn.attention, backend=c.backend, block_m=c.blocks[0],
                           block_n=c.blocks[1]), seen)
    q, k, v = (t.to(c.dtype) for t in (c.q, c.k, c.v))
    report = compare_to_reference(fn, q, k, v, grad=c.grad, check_lse=True,
                                  **cast_kw(c.kw, c.dtype))
    out, lse = seen[0]
    no_nan("out", out)
    no_nan("lse", lse)
    assert out.dtype == c.dtype and out.shape == (*c.q.shape[:3], c.v.shape[-1])
    assert report.ok, f"over budget:\n{report}"


@pytest.mark.parametrize("long", PROFILES)
def test_attention_valid_calls_match_the_reference(long):
    run_property(attention_calls(), check_attention, n_examples(long, 40, 400))



def r(*shape, dtype=F64) -> torch.Tensor:
    """Data whose values do not matter (a wrong shape or dtype is the point)."""
    return torch.randn(shape, dtype=F64).to(dtype)


def bad_attention(draw, c: Case, arg: str) -> dict[str, Bad]:
    """attn.attention with ``arg`` of the valid call ``c`` made invalid, every way known."""
    q, k, v = c.q, c.k, c.v
    B, H, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]

    def call(value, q=q, k=k, v=v, names=(), errors=(ValueError, TypeError), **kw):
        full = {"backend": "tiled", **c.kw, **kw}
        return Bad(lambda: attn.attention(q, k, v, **full), value, names, errors)

    if arg == "q":
        return {
            "rank3": call(q[0], q=q[0]), "rank5": call(q[None], q=q[None]),
            "int": call(q.long(), q=q.long()), "list": call("list", q=q.tolist()),
            "dtype": call(q.float(), q=q.float()),
            "head_dim": call("D + 1", q=r(B, H, nq, d + 1)),
            "heads": call("H % Hkv != 0", q=r(B, 3, nq, d), k=r(B, 2, nk, d), v=r(B, 2, nk, dv)),
            "no_heads": call("H = 0", q=q[:, :0]), "device": call("meta", q=q.to("meta"))}
    if arg == "k":
        return {
            "rank3": call(k[0], k=k[0]), "int": call(k.int(), k=k.int()),
            "head_dim": call("D + 2", k=r(B, hkv, nk, d + 2)),
            "batch": call("B + 1", k=r(B + 1, hkv, nk, d)),
            "heads": call("Hkv = H + 1", k=r(B, H + 1, nk, d), v=r(B, H + 1, nk, dv)),
            "length": call("Nk + 1", k=r(B, hkv, nk + 1, d))}
    if arg == "v":
        return {
            "rank5": call(v[None], v=v[None]), "dtype": call(v.float(), v=v.float()),
            "length": call("Nk + 1", v=r(B, hkv, nk + 1, dv)),
            "heads": call("Hkv + 1", v=r(B, hkv + 1, nk, dv)),
            "batch": call("B + 1", v=r(B + 1, hkv, nk, dv))}
    if arg == "attn_mask":
        masks = {"shape": torch.ones(nq + 1, nk, dtype=torch.bool),
                 "int": torch.ones(nq, nk, dtype=torch.int64), "list": [[True] * nk] * nq,
                 "rank5": torch.ones(1, B, H, nq, nk, dtype=torch.bool),
                 "device": torch.ones(nq, nk, dtype=torch.bool, device="meta")}
        return {n: call(m, attn_mask=m) for n, m in masks.items()}
    if arg in ("temperature", "softcap"):
        one_bad = torch.ones(H, dtype=F64)
        one_bad[draw(st.integers(0, H - 1))] = draw(st.sampled_from([NAN, INF, 0.0, -1.0]))
        values = [0.0, -1.0, NAN, INF, "1", torch.zeros(H, dtype=F64),
                  torch.full((H,), -2.0, dtype=F64), torch.full((H,), NAN, dtype=F64),
                  torch.full((H,), INF, dtype=F64), one_bad, torch.ones(H, dtype=torch.int64),
                  torch.ones(H + 1, dtype=F64), torch.ones(3, H + 1, dtype=F64)]
        return {n: call(x, **{arg: x}) for n, x in labelled(values).items()}
    values = {
        "scale": [NAN, INF, -INF, "0.5", True, 1j],
        "window": [3, (-2, 0), (0, -5), (1, 2, 3), ("a", 1), (1.0, 2.0), "1,2"],
        "sinks": [torch.zeros(H + 1, dtype=F64), torch.zeros(H, dtype=torch.int64), [0.0] * H,
                  torch.zeros(1, H, dtype=F64)],
        "alibi_slopes": [torch.ones(H + 1), torch.ones(B + 1, H), torch.ones(H, dtype=torch.int64),
                         torch.ones(H).requires_grad_(), [1.0] * H],
        "dropout_p": [1.0, -0.1, NAN, "0.1", True, 2],
        "causal": [1, "yes", None, torch.tensor(True)],
        "backend": ["foo", "Tiled", None, 3, "cuda"],
        "block_m": [0, -1, 2.5, True, "8"], "block_n": [0, -1, 2.5, True, "8"],
        "score_mod": [3, "relative"],
        "mask_mod": [3, lambda b, h, i, j: (i >= j).float(), lambda b, h, i, j: i - j],
    }
    if arg == "backend_sdpa":  # an explicit backend asked for what it cannot do
        extras = {"softcap": 5.0, "sinks": torch.zeros(H, dtype=F64),
                  "alibi_slopes": torch.ones(H), "return_lse": True}
        return {n: call(x, names=("backend",), errors=(NotImplementedError,), backend="sdpa",
                        **{n: x}) for n, x in extras.items()}
    return {n: call(x, **{arg: x}) for n, x in labelled(values[arg]).items()}


ATTENTION_ARGS = ["q", "k", "v", "attn_mask", "scale", "temperature", "softcap", "window",
                  "sinks", "alibi_slopes", "dropout_p", "causal", "backend", "backend_sdpa",
                  "block_m", "block_n", "score_mod", "mask_mod"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", ATTENTION_ARGS)
def test_attention_invalid_argument_is_named(arg, long):
    run_invalid(attention_calls(max_n=12), bad_attention, arg, long)
# == attn.scaled_dot_product_attention (torch's signature) =====================================

@st.composite
def sdpa_calls(draw, empty: bool = True) -> Case:
    g = Gen(draw(seeds))
    rank = draw(st.sampled_from([3, 4, 4, 5]))
    hkv = draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 3)) if rank >= 4 else 1
    hkv = hkv if rank >= 4 and H % hkv == 0 else H
    lead = {3: (draw(st.integers(1, 2)),), 4: (draw(st.integers(1, 2)), H),
            5: (draw(st.integers(1, 2)), draw(st.integers(1, 2)), H)}[rank]
    kv_lead = lead[:-1] + (hkv,) if rank >= 4 else lead
    L = draw(st.one_of(st.integers(1, 40), st.just(0) if empty else st.just(1)))
    S = draw(st.one_of(st.integers(1, 40), st.just(0) if empty else st.just(1)))
    E, Ev = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    query, key, value = g.randn(*lead, L, E), g.randn(*kv_lead, S, E), g.randn(*kv_lead, S, Ev)
    kw: dict = {}
    mask = draw(st.sampled_from([None, "causal", "bool", "bool_full", "float", "keys"]))
    if mask == "causal":
        kw["is_causal"] = True
    elif mask == "bool":
        kw["attn_mask"] = g.bools(L, S)
    elif mask == "bool_full":
        kw["attn_mask"] = g.bools(*lead, L, S, p=0.5)
    elif mask == "keys":
        kw["attn_mask"] = g.bools(S, p=0.6)
    elif mask == "float":
        kw["attn_mask"] = g.randn(L, S).masked_fill(~g.bools(L, S), -INF)
    if maybe(draw):
        kw["scale"] = draw(st.floats(0.05, 2.0))
    if H != hkv or maybe(draw):
        kw["enable_gqa"] = True
    return Case(dict(query=query, key=key, value=value, kw=kw, backend=draw(backends),
                     dtype=draw(float_dtypes)))


def sdpa_oracle(query, key, value, dtype, attn_mask=None, is_causal=False, scale=None,
                enable_gqa=False):
    """torch's meaning: top-left causal, masks broadcast over the leading dims, rows without
    a key give zeros; attn.attention's reference on a (B, H, L, E) view."""
    L, S = query.shape[-2], key.shape[-2]
    shape = (*query.shape[:-1], value.shape[-1])
    if L == 0 or S == 0:
        return torch.zeros(shape, dtype=dtype)
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool).tril()
    if attn_mask is None or attn_mask.dtype == torch.bool:
        mask = keep if attn_mask is None else keep & attn_mask
    else:
        mask = attn_mask.masked_fill(~keep, -INF)
    mask = mask.expand(*query.shape[:-1], S)

    def to4d(t):
        return t.reshape(-1, 1, *t.shape[-2:]) if t.dim() == 3 else t.reshape(-1, *t.shape[-3:])

    out = reference(to4d(query), to4d(key), to4d(value), dtype, attn_mask=to4d(mask),
                    scale=scale)
    return out.reshape(shape)


def check_sdpa(c: Case) -> None:
    qkv = [rounded(t, c.dtype) for t in (c.query, c.key, c.value)]
    kw = rounded_kw(c.kw, c.dtype)
    got = attn.scaled_dot_product_attention(*(t.to(c.dtype) for t in qkv),
                                            **cast_kw(kw, c.dtype), backend=c.backend)
    no_nan("out", got)
    assert got.dtype == c.dtype
    exact = sdpa_oracle(*qkv, F64, **kw)
    plain = sdpa_oracle(*qkv, c.dtype, **cast_kw(kw, c.dtype))
    check_budget("out", got, exact, plain, c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_sdpa_valid_calls_match_the_reference(long):
    run_property(sdpa_calls(), check_sdpa, n_examples(long, 25))



def bad_sdpa(draw, c: Case, arg: str) -> dict[str, Bad]:
    query, key, value = c.query, c.key, c.value
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]

    def call(val, query=query, key=key, value=value, **kw):
        full = {"backend": "tiled", **c.kw, **kw}
        return Bad(lambda: attn.scaled_dot_product_attention(query, key, value, **full), val)

    if arg == "query":
        return {"rank2": call("2 dims", query=query.reshape(-1, E)),
                "int": call(query.long(), query=query.long()),
                "list": call("list", query=query.tolist()),
                "dtype": call(query.float(), query=query.float()),
                "head_dim": call("E + 1", query=r(*query.shape[:-1], E + 1))}
    if arg == "key":
        return {"rank": call(key[None], key=key[None]), "dtype": call(key.float(), key=key.float()),
                "head_dim": call("E + 2", key=r(*key.shape[:-1], E + 2)),
                "length": call("S + 1", key=r(*key.shape[:-2], S + 1, E)),
                "list": call("list", key=key.tolist())}
    if arg == "value":
        return {"dtype": call(value.float(), value=value.float()),
                "rank": call(value[0], value=value[0]),
                "length": call("S + 1", value=r(*value.shape[:-2], S + 1, value.shape[-1])),
                "int": call(value.long(), value=value.long())}
    if arg == "enable_gqa":  # more query heads than key heads, GQA not asked for
        q4, k4, v4 = ((query, key, value) if query.dim() >= 4 else
                      (query[:, None], key[:, None], value[:, None]))
        q4 = torch.cat([q4, q4], dim=-3)
        return {"False": call(False, query=q4, key=k4, value=v4, enable_gqa=False)}
    if arg == "attn_mask":
        masks = [torch.ones(L + 1, S + 2, dtype=torch.bool), torch.ones(L, S, dtype=torch.int32),
                 [[True]], torch.ones(1, 1, 1, 1, 1, 1, L, S, dtype=torch.bool)]
        return {n: call(m, attn_mask=m, is_causal=False) for n, m in labelled(masks).items()}
    values = {"dropout_p": [1.0, -0.5, NAN, "0"], "scale": [NAN, INF, "1", 1j],
              "backend": ["foo", None, "Reference"]}
    return {n: call(x, **{arg: x}) for n, x in labelled(values[arg]).items()}


SDPA_ARGS = ["query", "key", "value", "attn_mask", "enable_gqa", "dropout_p", "scale",
             "backend"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", SDPA_ARGS)
def test_sdpa_invalid_argument_is_named(arg, long):
    run_invalid(sdpa_calls(empty=False), bad_sdpa, arg, long)
# == attn.varlen_attention (packed sequences) ==================================================

@st.composite
def varlen_calls(draw, empty: bool = True) -> Case:
    g = Gen(draw(seeds))
    n = draw(st.integers(1, 4))
    lo = 0 if empty else 1
    lq = lengths(draw, n, 12, lo)
    lk = lq if maybe(draw) else lengths(draw, n, 12, lo)
    if sum(lq) == 0 or sum(lk) == 0:  # attn refuses empty tensors; one token at least
        lq, lk = [max(1, lq[0])] + lq[1:], [max(1, lk[0])] + lk[1:]
    hkv = draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 3))
    d = draw(st.integers(1, 16))
    dv = draw(st.one_of(st.just(d), st.integers(1, 16)))
    q, k, v = g.randn(sum(lq), H, d), g.randn(sum(lk), hkv, d), g.randn(sum(lk), hkv, dv)
    kw: dict = {}
    if maybe(draw):
        kw["causal"] = True
    if maybe(draw):
        kw["window"] = (draw(st.integers(-1, 13)), draw(st.integers(-1, 13)))
    cap = draw(st.sampled_from([None, "float", "tensor"]))
    if cap == "float":
        kw["softcap"] = draw(st.floats(0.3, 30.0))
    elif cap == "tensor":
        kw["softcap"] = g.rand(H, lo=0.5, hi=20.0)
    tau = draw(st.sampled_from([None, "float", "tensor"]))
    if tau == "float":
        kw["temperature"] = draw(st.floats(0.05, 5.0))
    elif tau == "tensor":
        kw["temperature"] = g.rand(H, lo=0.2, hi=3.0)
    if maybe(draw):
        kw["sinks"] = g.randn(H)
    if maybe(draw):
        kw["scale"] = draw(st.floats(0.01, 2.0))
    if maybe(draw):
        kw["alibi_slopes"] = g.rand(*draw(st.sampled_from([(H,), (n, H)])), dtype=torch.float32)
    cu_q = torch.tensor(offsets(lq), dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    cu_k = torch.tensor(offsets(lk), dtype=cu_q.dtype)
    given = draw(st.sampled_from(["none", "exact", "larger"]))
    maxes = {"none": (None, None), "exact": (max(lq), max(lk)),
             "larger": (max(lq) + 3, max(lk) + 1)}[given]
    return Case(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, maxes=maxes, kw=kw,
                     backend=draw(backends), dtype=draw(float_dtypes)))


def check_varlen(c: Case) -> None:
    qkv = [rounded(t, c.dtype) for t in (c.q, c.k, c.v)]
    kw = rounded_kw(c.kw, c.dtype)
    out, lse = attn.varlen_attention(*(t.to(c.dtype) for t in qkv), c.cu_q, c.cu_k, *c.maxes,
                                     return_lse=True, backend=c.backend, **cast_kw(kw, c.dtype))
    no_nan("out", out)
    no_nan("lse", lse)
    cu_q, cu_k = c.cu_q.tolist(), c.cu_k.tolist()
    exact = varlen_loop(*qkv, cu_q, cu_k, F64, **kw)
    plain = varlen_loop(*qkv, cu_q, cu_k, c.dtype, **kw)
    check_budget("out", out, exact[0], plain[0], c.dtype)
    check_budget("lse", lse, exact[1], plain[1], c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_varlen_valid_calls_match_a_loop_over_sequences(long):
    run_property(varlen_calls(), check_varlen, n_examples(long, 25))



def bad_cu(draw, cu: torch.Tensor, total: int, count: bool) -> dict[str, Any]:
    """Invalid cu_seqlens offsets, given valid ones for ``total`` tokens."""
    start, end, decrease = cu.clone(), cu.clone(), cu.clone()
    start[0] = 1
    end[-1] = total + draw(st.sampled_from([1, -1])) if total > 0 else 1
    if cu.numel() >= 3:
        decrease[1] = decrease[2] + 1
    else:
        decrease = torch.tensor([0, -1], dtype=cu.dtype)
    bad = {"float": cu.float(), "list": cu.tolist(), "rank2": cu[None], "one": cu[:1],
           "start": start, "end": end, "decrease": decrease}
    if count:
        bad["count"] = torch.cat([cu, cu[-1:]])
    return bad


def bad_varlen(draw, c: Case, arg: str) -> dict[str, Bad]:
    q, k, v = c.q, c.k, c.v
    tq, H, d = q.shape
    tk, hkv = k.shape[:2]
    cu = {"cu_seqlens_q": c.cu_q, "cu_seqlens_k": c.cu_k}
    maxes = dict(zip(("max_seqlen_q", "max_seqlen_k"), c.maxes))

    def call(value, q=q, k=k, v=v, cu_seqlens_q=c.cu_q, cu_seqlens_k=c.cu_k, maxes=maxes,
             errors=(ValueError, TypeError), **kw):
        full = {"backend": "tiled", **c.kw, **kw}
        return Bad(lambda: attn.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **maxes,
                                                 **full), value, (), errors)

    if arg in ("q", "k", "v"):
        t = {"q": q, "k": k, "v": v}[arg]
        bad = {"rank4": t[None], "rank2": t[:, 0], "int": t.long(), "list": t.tolist(),
               "dtype": t.float()}
        if arg == "q":
            bad["head_dim"] = r(tq, H, d + 1)
            bad["heads"] = r(tq, 2 * hkv + 1, d)
        elif arg == "k":
            bad["head_dim"] = r(tk, hkv, d + 1)
            bad["length"] = r(tk + 1, hkv, d)
        else:
            bad["length"] = r(tk + 1, hkv, v.shape[2])
            bad["empty_head_dim"] = v[:, :, :0]
        out = {}
        for n, x in bad.items():
            kw = {arg: x}
            if n == "heads":  # and no per-head keyword, whose shape would be wrong first
                kw.update(temperature=1.0, softcap=None, sinks=None, alibi_slopes=None)
                if hkv == 1:  # Hkv = 2 does not divide 3 query heads
                    kw.update(q=r(tq, 3, d), k=torch.cat([k, k], 1), v=torch.cat([v, v], 1))
            out[n] = call(x, **kw)
        return out
    if arg.startswith("cu_seqlens"):
        total = tq if arg == "cu_seqlens_q" else tk
        return {n: call(x, **{arg: x}) for n, x in
                bad_cu(draw, cu[arg], total, arg == "cu_seqlens_k").items()}
    if arg.startswith("max_seqlen"):
        longest = int(cu[arg.replace("max_seqlen", "cu_seqlens")].diff().max())
        other = "max_seqlen_k" if arg == "max_seqlen_q" else "max_seqlen_q"
        # the other one given (exact), so the offsets are trusted as far as the call allows
        given = {other: int(cu[other.replace("max_seqlen", "cu_seqlens")].diff().max())}
        return {n: call(x, maxes={**given, arg: x}) for n, x in
                labelled([longest - 1, float(longest), str(longest)]).items()}
    values = {
        "temperature": [0.0, -1.0, NAN, INF, torch.full((H,), NAN), torch.full((H,), INF),
                        torch.zeros(H), torch.ones(H + 1), torch.ones(2, H)],
        "sinks": [torch.zeros(H + 1), [0.0] * H, torch.zeros(H, dtype=torch.int32)],
        "window": [2, (-3, 1), (1, 2, 3), (0.5, 1)],
        "causal": [1, "true", None],
        "alibi_slopes": [torch.ones(H + 1), torch.ones(c.cu_q.numel(), H),
                         torch.ones(H, dtype=torch.int32)],
        "dropout_p": [1.0, -0.2, NAN],
        "backend": ["foo", None],
    }
    values["softcap"] = values["temperature"]
    out = {n: call(x, **{arg: x}) for n, x in labelled(values[arg]).items()}
    if arg == "backend":
        out["sdpa"] = call("sdpa", backend="sdpa", errors=(NotImplementedError,))
    return out


VARLEN_ARGS = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
               "temperature", "softcap", "sinks", "window", "causal", "alibi_slopes",
               "dropout_p", "backend"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", VARLEN_ARGS)
def test_varlen_invalid_argument_is_named(arg, long):
    run_invalid(varlen_calls(empty=False), bad_varlen, arg, long)
# == attn.flex_attention and attn.create_block_mask ============================================

def _rel_bias(score, b, h, q_idx, kv_idx):
    return score + 0.1 * (q_idx - kv_idx)


def _tanh_cap(score, b, h, q_idx, kv_idx):
    return 4.0 * torch.tanh(score / 4.0)


def _per_batch_head(score, b, h, q_idx, kv_idx):
    return score * (1.0 + 0.5 * b) - 0.3 * h


SCORE_MODS = [None, _rel_bias, _tanh_cap, _per_batch_head]


def _mask_mods(nq: int, nk: int, g: Gen) -> dict:
    doc_q = torch.sort(torch.randint(0, 3, (nq,), generator=g.g)).values
    doc_k = torch.sort(torch.randint(0, 3, (nk,), generator=g.g)).values
    return {
        "causal": lambda b, h, i, j: i >= j,
        "sliding": lambda b, h, i, j: (i - j).abs() <= 3,
        "prefix": lambda b, h, i, j: (j <= 4) | (i >= j),
        "documents": lambda b, h, i, j: doc_q[i] == doc_k[j],
        "per_batch": lambda b, h, i, j: (j + b) % 3 != 0,
        "empty_rows": lambda b, h, i, j: (i % 4 != 1) & (j >= i - 2),
    }


@st.composite
def flex_calls(draw) -> Case:
    g = Gen(draw(seeds))
    B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 3))
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    d = draw(st.integers(1, 16))
    dv = draw(st.one_of(st.just(d), st.integers(1, 16)))
    q, k, v = g.randn(B, H, nq, d), g.randn(B, hkv, nk, d), g.randn(B, hkv, nk, dv)
    mods = _mask_mods(nq, nk, g)
    mask_name = draw(st.sampled_from([None, *mods]))
    mask_mod = None if mask_name is None else mods[mask_name]
    kw: dict = {"score_mod": draw(st.sampled_from(SCORE_MODS))}
    mask_spec = None
    if mask_mod is not None:
        bs = draw(st.sampled_from([4, 8, (4, 8), 16, 128]))
        # B=None broadcasts the mask of batch row 0 (its empty tiles are skipped for every
        # row, as in torch): only for masks that do not depend on b
        mask_spec = dict(B=B if mask_name == "per_batch" else draw(st.sampled_from([None, B])),
                         H=draw(st.sampled_from([None, H])), BLOCK_SIZE=bs)
        if maybe(draw):
            bm = bs if isinstance(bs, int) else bs[0]
            kw["kernel_options"] = {"BLOCK_M": draw(st.sampled_from(
                [x for x in (1, 2, 4, 8, 16) if bm % x == 0]))}
    if H != hkv or maybe(draw):
        kw["enable_gqa"] = True
    if maybe(draw):
        kw["scale"] = draw(st.floats(0.05, 2.0))
    lse = draw(st.sampled_from(["no", "return_lse", "return_aux"]))
    return Case(dict(q=q, k=k, v=v, kw=kw, mask_mod=mask_mod, mask_spec=mask_spec, lse=lse,
                     backend=draw(backends), dtype=draw(float_dtypes)), note=f"{mask_name} ")


def check_flex(c: Case) -> None:
    q, k, v = (t.to(c.dtype) for t in (c.q, c.k, c.v))
    kw = dict(c.kw)
    if c.mask_mod is not None:
        kw["block_mask"] = attn.create_block_mask(c.mask_mod, Q_LEN=q.shape[2],
                                                  KV_LEN=k.shape[2], **c.mask_spec)
    if c.lse == "return_lse":
        out, lse = attn.flex_attention(q, k, v, **kw, return_lse=True, backend=c.backend)
    elif c.lse == "return_aux":
        out, aux = attn.flex_attention(q, k, v, **kw, return_aux=AuxRequest(lse=True),
                                       backend=c.backend)
        lse = aux.lse
    else:
        out, lse = attn.flex_attention(q, k, v, **kw, backend=c.backend), None
    no_nan("out", out)
    ref_kw = dict(score_mod=c.kw["score_mod"], mask_mod=c.mask_mod, scale=c.kw.get("scale"),
                  return_lse=True)
    exact = reference(q, k, v, F64, **ref_kw)
    plain = reference(q, k, v, c.dtype, **ref_kw)
    check_budget("out", out, exact[0], plain[0], c.dtype)
    if lse is not None:
        no_nan("lse", lse)
        check_budget("lse", lse, exact[1], plain[1], c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_flex_valid_calls_match_the_reference(long):
    run_property(flex_calls(), check_flex, n_examples(long, 20))



def bad_flex(draw, c: Case, arg: str) -> dict[str, Bad]:
    """flex_attention's arguments, and create_block_mask's (mask_mod, Q_LEN, KV_LEN, B,
    BLOCK_SIZE, device) through a mask built for the call."""
    q, k, v = c.q, c.k, c.v
    B, H, nq, d = q.shape
    nk = k.shape[2]
    base_kw = {n: x for n, x in c.kw.items() if n != "kernel_options"}
    mask_spec = dict(mask_mod=lambda b, h, i, j: i >= j, B=None, H=None, Q_LEN=nq, KV_LEN=nk,
                     BLOCK_SIZE=8)

    def call(value, query=q, key=k, value_=v, mask=None, **kw):
        def run():
            full = {**base_kw, **kw}
            if mask is not None:
                spec = {**mask_spec, **mask}
                full["block_mask"] = attn.create_block_mask(spec.pop("mask_mod"), **spec)
            return attn.flex_attention(query, key, value_, **full, backend="tiled")
        return Bad(run, value)

    if arg in ("query", "key", "value"):
        t = {"query": q, "key": k, "value": v}[arg]
        name = {"value": "value_"}.get(arg, arg)
        bad = {"rank3": t[0], "int": t.long(), "list": t.tolist(), "dtype": t.float()}
        if arg == "query":
            bad["head_dim"] = r(*t.shape[:3], d + 1)
        else:
            bad["length"] = r(*t.shape[:2], nk + 1, t.shape[3])
        return {n: call(x, **{name: x}) for n, x in bad.items()}
    if arg == "enable_gqa":
        return {"False": call(False, query=torch.cat([q, q], 1), enable_gqa=False)}
    if arg == "block_mask":
        return {"tensor": call("a bool tensor", block_mask=torch.ones(nq, nk, dtype=torch.bool)),
                "callable": call("a mask_mod", block_mask=lambda b, h, i, j: i >= j),
                "lengths": call("Q_LEN + 1", mask={"Q_LEN": nq + 1}),
                "batch": call("B + 1", mask={"B": B + 1})}
    if arg == "kernel_options":
        return {"list": call([("BLOCK_M", 8)], kernel_options=[("BLOCK_M", 8)]),
                "str": call("BLOCK_M=8", kernel_options="BLOCK_M=8"),
                "divide": call({"BLOCK_M": 3}, mask={}, kernel_options={"BLOCK_M": 3})}
    flex_values = {"score_mod": [3, "bias"], "return_aux": [True, "lse", {"lse": True}],
                   "scale": [NAN, INF, "1"]}
    if arg in flex_values:
        return {n: call(x, **{arg: x}) for n, x in labelled(flex_values[arg]).items()}
    mask_values = {"mask_mod": [3, lambda b, h, i, j: (i >= j).int(), lambda b, h, i, j: 1.0],
                   "Q_LEN": [0, -1, 2.0, None], "KV_LEN": [0, -3, "8"], "B": [0, -1, 1.5],
                   "BLOCK_SIZE": [0, (8,), (8, 0), -4, 2.5], "device": ["nope", 3.5, "cuda:x"]}
    return {n: call(x, mask={arg: x}) for n, x in labelled(mask_values[arg]).items()}


FLEX_ARGS = ["query", "key", "value", "enable_gqa", "score_mod", "block_mask",
             "kernel_options", "return_aux", "scale", "mask_mod", "Q_LEN", "KV_LEN", "B",
             "BLOCK_SIZE", "device"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", FLEX_ARGS)
def test_flex_invalid_argument_is_named(arg, long):
    run_invalid(flex_calls(), bad_flex, arg, long)
# == attn.merge_attention ======================================================================

@st.composite
def merge_calls(draw) -> Case:
    """Attention over all keys, cut into P disjoint key sets: partials (out, lse) from attn
    (some rows of a part may see no key; a part may be empty: zeros, lse -inf)."""
    g = Gen(draw(seeds))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    nq, nk, d = draw(st.integers(1, 20)), draw(st.integers(1, 40)), draw(st.integers(1, 16))
    q, k, v = g.randn(B, H, nq, d), g.randn(B, H, nk, d), g.randn(B, H, nk, d)
    kw: dict = {}
    if maybe(draw):
        kw["attn_mask"] = g.bools(B, 1, nq, nk, p=draw(st.sampled_from([0.1, 0.5, 0.9])))
    if maybe(draw):
        kw["softcap"] = draw(st.floats(0.5, 20.0))
    cuts = sorted(draw(st.lists(st.integers(0, nk), min_size=0, max_size=3)))
    return Case(dict(q=q, k=k, v=v, kw=kw, cuts=[0, *cuts, nk], form=draw(
        st.sampled_from(["pair", "list"])), dtype=draw(float_dtypes), backend=draw(backends),
                     inf_lse=draw(st.integers(0, 4)) == 0))


def merge_parts(c: Case, dtype: torch.dtype, backend: str):
    outs, lses = [], []
    for a, b in zip(c.cuts[:-1], c.cuts[1:]):
        B, H, nq = c.q.shape[:3]
        if a == b:  # a part without keys
            outs.append(torch.zeros(B, H, nq, c.v.shape[-1], dtype=dtype))
            lses.append(torch.full((B, H, nq), -INF, dtype=F64 if dtype == F64 else
                                   torch.float32))
            continue
        kw = dict(c.kw)
        if "attn_mask" in kw:
            kw["attn_mask"] = kw["attn_mask"][..., a:b]
        o, l = attn.attention(c.q.to(dtype), c.k[:, :, a:b].to(dtype), c.v[:, :, a:b].to(dtype),
                              return_lse=True, backend=backend, **kw)
        outs.append(o)
        lses.append(l)
    return outs, lses


def check_merge(c: Case) -> None:
    outs, lses = merge_parts(c, c.dtype, c.backend)
    if c.form == "pair" and len(outs) == 2:
        out, lse = attn.merge_attention(outs[0], lses[0], outs[1], lses[1])
    else:
        out, lse = attn.merge_attention(outs, lses)
    no_nan("out", out)
    no_nan("lse", lse)
    assert out.dtype == c.dtype
    qkv = [rounded(t, c.dtype) for t in (c.q, c.k, c.v)]
    exact = reference(*qkv, F64, return_lse=True, **c.kw)
    plain = reference(*qkv, c.dtype, return_lse=True, **c.kw)
    # each partial carries its own rounding, and merging P of them adds P - 1 more
    factor = 2.0 * (len(outs) if c.dtype != F64 else 1)
    check_budget("out", out, exact[0], plain[0], c.dtype, factor)
    check_budget("lse", lse, exact[1], plain[1], c.dtype, factor)
    if c.inf_lse:
        # compat's convention for a row without keys: +inf. Refused, naming the lse, or read
        # as -inf; never NaN
        lses = [torch.where(torch.isneginf(l), INF, l) for l in lses]
        try:
            out2, lse2 = attn.merge_attention(outs, lses)
        except (ValueError, TypeError) as exc:
            assert "lse" in str(exc), f"the error does not name the lse: {exc}"
        else:
            no_nan("out with +inf lse", out2)
            no_nan("lse with +inf lse", lse2)
            assert torch.equal(out2, out)


@pytest.mark.parametrize("long", PROFILES)
def test_merge_valid_calls_match_attention_over_all_keys(long):
    run_property(merge_calls(), check_merge, n_examples(long, 20))



@st.composite
def merge_partials(draw) -> Case:
    g = Gen(draw(seeds))
    B, H, nq, dv = (draw(st.integers(1, 3)) for _ in range(4))
    dtype = draw(st.sampled_from([F64, torch.float32, torch.bfloat16]))
    return Case(dict(outs=[g.randn(B, H, nq, dv, dtype=dtype) for _ in range(2)],
                     lses=[g.randn(B, H, nq, dtype=torch.float32) for _ in range(2)]))


def bad_merge(draw, c: Case, arg: str) -> dict[str, Bad]:
    """Two partials, one of them made invalid; the pair form must name ``out_a`` ...
    ``lse_b``, the list form ``outs[i]`` / ``lses[i]`` (``outs`` / ``lses`` for the list)."""
    listed = arg in ("outs", "lses")
    is_out = arg.startswith("out")
    i = draw(st.integers(0, 1)) if listed else int(arg.endswith("_b"))
    B, H, nq, dv = c.outs[0].shape

    def call(value, outs=None, lses=None, names=()):
        outs, lses = outs or list(c.outs), lses or list(c.lses)
        if value is not None:
            (outs if is_out else lses)[i] = value
        if listed:
            run = lambda: attn.merge_attention(outs, lses)
        else:
            run = lambda: attn.merge_attention(outs[0], lses[0], outs[1], lses[1])
        return Bad(run, value, names or ((f"{arg}[{i}]", arg) if listed else ()))

    t = (c.outs if is_out else c.lses)[i]
    bads = {"type": call(t.tolist() if is_out else 0.0), "dtype": call(t.long()),
            "device": call(t.to("meta"))}
    if is_out:
        # partials of different shapes (each consistent with its own lse)
        lses = list(c.lses)
        lses[i] = r(B, H, nq + 1, dtype=torch.float32)
        bads["shape"] = call(r(B, H, nq + 1, dv), lses=lses)
        bads["zero_d"] = call(torch.tensor(1.0), lses=[torch.tensor(0.0)] * 2,
                              outs=[torch.tensor(1.0)] * 2,  # every out 0-d: any one named
                              names=("outs[0]", "outs[1]", "outs") if listed else ("out_a",
                                                                                   "out_b"))
    else:
        bads["shape"] = call(r(B, H, nq + 1, dtype=torch.float32))
        bads["zero_d"] = call(torch.tensor(0.0))
    if listed:
        more = (list(c.outs) + [c.outs[0]], None) if is_out else (None, list(c.lses[:1]))
        bads["count"] = Bad(lambda: attn.merge_attention(more[0] or c.outs, more[1] or c.lses),
                            "one too many outs" if is_out else "one lse too few", (arg,))
    return bads


MERGE_ARGS = ["out_a", "out_b", "lse_a", "lse_b", "outs", "lses"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", MERGE_ARGS)
def test_merge_invalid_argument_is_named(arg, long):
    run_invalid(merge_partials(), bad_merge, arg, long)
# == attn.MultiHeadAttention, QKNorm, RotaryEmbedding ==========================================

@st.composite
def mha_calls(draw, odd_inputs: bool = True) -> Case:
    heads = draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
    D = draw(st.sampled_from([2, 4, 8]))
    opts = dict(heads=heads, kv_heads=kv_heads, causal=draw(st.booleans()),
                rope=draw(st.booleans()), bias=draw(st.booleans()),
                qk_norm=draw(st.sampled_from([None, "l2", "rms", "layer"])),
                sinks=draw(st.booleans()))
    if opts["qk_norm"] is not None:
        opts["qk_norm_position"] = draw(st.sampled_from(["before", "after"]))
    if maybe(draw):
        opts["window"] = draw(st.sampled_from([2, 5, (3, 1), (-1, 2)]))
    if maybe(draw):
        opts["temperature"] = draw(st.floats(0.2, 4.0))
        opts["learn_temperature"] = draw(st.booleans())
    if maybe(draw):
        opts["softcap"] = draw(st.floats(1.0, 20.0))
        opts["learn_softcap"] = draw(st.booleans())
    B, N = draw(st.integers(1, 2)), draw(st.integers(1, 20))
    shape = (B, N)
    if odd_inputs:
        shape = draw(st.sampled_from([(B, N), (B, N), (B, N), (N,), (B, 0)]))
    return Case(dict(dim=heads * D, opts=opts, shape=shape, seed=draw(seeds),
                     backend=draw(backends),
                     dtype=draw(st.sampled_from([F64, torch.float32, torch.bfloat16]))))


def mha_module(c: Case, dtype: torch.dtype, backend: str, via: torch.dtype | None = None
               ) -> attn.MultiHeadAttention:
    """The case's module in ``dtype`` (its parameters first rounded to ``via``)."""
    torch.manual_seed(c.seed)
    m = attn.MultiHeadAttention(c.dim, **c.opts, backend=backend)
    with torch.no_grad():  # non-trivial sinks and gains, so they matter
        for name, p in m.named_parameters():
            if "weight" in name and p.dim() == 1 or name == "sinks":
                p.add_(torch.randn(p.shape) * 0.3)
    return m.to(via or dtype).to(dtype).eval()


def check_mha(c: Case) -> None:
    x = rounded(Gen(c.seed).randn(*c.shape, c.dim), c.dtype)
    got = mha_module(c, c.dtype, c.backend)(x.to(c.dtype))
    assert got.shape == x.shape and got.dtype == c.dtype
    no_nan("out", got)
    batched = x if x.dim() == 3 else x[None]  # torch's MHA: (N, C) is one unbatched sequence
    if batched.shape[1] == 0:
        return
    with torch.no_grad():
        exact = mha_module(c, F64, "reference", via=c.dtype)(batched)
        plain = mha_module(c, c.dtype, "reference")(batched.to(c.dtype))
    if x.dim() == 2:
        exact, plain = exact[0], plain[0]
    check_budget("out", got, exact, plain, c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_mha_valid_calls_match_the_reference(long):
    run_property(mha_calls(), check_mha, n_examples(long, 15))



def bad_mha(draw, c: Case, arg: str) -> dict[str, Bad]:
    """MultiHeadAttention's constructor and input, QKNormConfig's eps, and the head dim of
    RotaryEmbedding's x and of QKNorm's q."""
    dim, opts = c.dim, c.opts
    D = dim // opts["heads"]
    x = Gen(c.seed).randn(*c.shape, dim, dtype=torch.float32)
    wrong = D + 2 * draw(st.integers(1, 3))

    def call(value, x=x, **changes):
        o = {**opts, **changes}
        return Bad(lambda: attn.MultiHeadAttention(dim, **o)(x), value)

    if arg == "x":
        return {"rank4": call(x[None], x=x[None]), "narrow": call("C - 1", x=x[..., :-1]),
                "wide": call("2C", x=torch.cat([x, x], -1)), "int": call(x.long(), x=x.long()),
                "dtype": call(x.double(), x=x.double()), "list": call("list", x=x.tolist())}
    if arg == "eps":
        def config(kind, eps):
            return Bad(lambda: attn.QKNormConfig(kind, eps=eps), eps)
        return {n: config(draw(st.sampled_from(["l2", "rms", "layer"])), e)
                for n, e in labelled([0.0, -1e-6, NAN]).items()}
    if arg == "rope_x":  # RotaryEmbedding(head_dim)(x) with x's head dim another
        x4 = r(2, 3, 5, wrong)
        return {"head_dim": Bad(lambda: attn.RotaryEmbedding(D)(x4), x4, ("x",))}
    if arg == "qk_norm_q":
        qn, kn = r(1, 2, 3, wrong), r(1, 2, 3, D)
        return {kind: Bad(lambda kind=kind: attn.QKNorm(kind, D)(qn, kn), qn, ("q",))
                for kind in ("rms", "layer")}
    values = {"heads": [0, -2, dim + 1, 2.0], "kv_heads": [0, -1, opts["heads"] + 1],
              "temperature": [0.0, -1.0, NAN, INF], "softcap": [0.0, -1.0, NAN, INF],
              "window": [-2, (-3, 0), (1, 2, 3), "2"], "dropout": [1.0, -0.1, NAN],
              "backend": ["foo", None], "qk_norm": ["l1", "RMS", 3]}
    extra = {"heads": {"kv_heads": None}}.get(arg, {})
    bads = {n: call(x_, **{arg: x_}, **extra) for n, x_ in labelled(values[arg]).items()}
    if arg in ("temperature", "softcap"):  # the learned form starts from the same value
        learn = {"temperature": "learn_temperature", "softcap": "learn_softcap"}[arg]
        bads.update({f"learned {n}": call(x_, **{arg: x_, learn: True})
                     for n, x_ in labelled(values[arg]).items()})
    return bads


MHA_ARGS = ["x", "heads", "kv_heads", "temperature", "softcap", "window", "dropout", "backend",
            "qk_norm", "eps", "rope_x", "qk_norm_q"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", MHA_ARGS)
def test_mha_invalid_argument_is_named(arg, long):
    run_invalid(mha_calls(odd_inputs=False), bad_mha, arg, long)
# == attn.compat.flash_attn: flash_attn_func, *_qkvpacked_func, *_kvpacked_func ================

def window_forms(draw, left: int, right: int, plain: bool = False):
    """A window_size pair as code written for flash-attn passes it: tuple, list, a
    2-element tensor (flash-attn's own tests), numpy ints (``plain``: a tuple)."""
    form = "tuple" if plain else draw(st.sampled_from(["tuple", "tuple", "list", "tensor",
                                                         "numpy"]))
    return {"tuple": (left, right), "list": [left, right],
            "tensor": torch.tensor([left, right]),
            "numpy": (np.int64(left), np.int64(right))}[form]


@st.composite
def fa_calls(draw, plain: bool = False,
             packings=("func", "func", "qkvpacked", "kvpacked")) -> Case:
    """flash-attn calls (``plain``: window_size as a tuple, for the invalid-argument bases)."""
    g = Gen(draw(seeds))
    packing = draw(st.sampled_from(packings))
    B, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 3)) if packing != "qkvpacked" else hkv
    nq, nk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    if packing == "qkvpacked":
        nk = nq
    d = draw(st.integers(1, 16))
    q, k, v = g.randn(B, nq, H, d), g.randn(B, nk, hkv, d), g.randn(B, nk, hkv, d)
    kw: dict = {"causal": draw(st.booleans())}
    if maybe(draw):
        kw["window_size"] = window_forms(draw, draw(st.integers(-1, nk + 2)),
                                         draw(st.integers(-1, nk + 2)), plain)
    if maybe(draw):
        kw["softcap"] = draw(st.sampled_from([0.0, -1.0, 0.5, 5.0, 30.0]))
    if maybe(draw):
        kw["alibi_slopes"] = g.rand(*draw(st.sampled_from([(H,), (B, H)])),
                                    dtype=torch.float32)
    if maybe(draw):
        kw["softmax_scale"] = draw(st.floats(0.05, 2.0))
    return Case(dict(q=q, k=k, v=v, kw=kw, packing=packing, dtype=draw(float_dtypes)),
                note=f"{packing} ")


def run_fa(c: Case, q, k, v, **kw):
    if c.packing == "qkvpacked":
        return fa.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw)
    if c.packing == "kvpacked":
        return fa.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw)
    return fa.flash_attn_func(q, k, v, **kw)


def check_fa(c: Case) -> None:
    qkv = [rounded(t, c.dtype) for t in (c.q, c.k, c.v)]
    out, lse, _ = run_fa(c, *(t.to(c.dtype) for t in qkv), **c.kw, return_attn_probs=True)
    no_nan("out", out)
    no_nan("softmax_lse", lse)
    kw = {n: x for n, x in c.kw.items()}
    if "window_size" in kw:
        kw["window_size"] = tuple(int(w) for w in kw["window_size"])
    exact = fa_attention(*qkv, F64, **kw)
    plain = fa_attention(*qkv, c.dtype, **kw)
    check_budget("out", out, exact[0], plain[0], c.dtype)
    check_budget("softmax_lse", lse, exact[1], plain[1], c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_fa_func_valid_calls_match_the_reference(long):
    run_property(fa_calls(), check_fa, n_examples(long, 25))



def bad_fa(draw, c: Case, arg: str) -> dict[str, Bad]:
    q, k, v = c.q, c.k, c.v
    B, nq, H, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]

    def call(value, q=q, k=k, v=v, **kw):
        full = {**c.kw, **kw}
        return Bad(lambda: fa.flash_attn_func(q, k, v, **full), value)

    if arg in ("q", "k", "v"):
        t = {"q": q, "k": k, "v": v}[arg]
        bad = {"rank3": t[0], "rank5": t[None], "list": t.tolist(), "int": t.long(),
               "dtype": t.float()}
        if arg != "v":  # v's head dim may differ from q's (a superset of flash-attn)
            bad["head_dim"] = r(*t.shape[:3], d + 1)
        out = {n: call(x, **{arg: x}) for n, x in bad.items()}
        if arg == "k":
            out["heads"] = call("Hkv = H + 1", k=r(B, nk, H + 1, d), v=r(B, nk, H + 1, d))
        return out
    if arg == "qkv":
        return {n: Bad(lambda x=x: fa.flash_attn_qkvpacked_func(x, **c.kw), x) for n, x in {
            "rank4": r(B, nq, H, d), "two": r(B, nq, 2, H, d),
            "list": r(B, nq, 3, H, d).tolist()}.items()}
    if arg == "kv":
        return {n: Bad(lambda x=x: fa.flash_attn_kvpacked_func(q, x, **c.kw), x) for n, x in {
            "rank4": r(B, nk, hkv, d), "three": r(B, nk, 3, hkv, d), "list": [k, v]}.items()}
    values = {"window_size": [(1,), (1, 2, 3), "1,2", (1.5, 2), 4, torch.tensor([1, 2, 3]),
                              (None, 0)],
              "softcap": ["5", [5.0], NAN, torch.tensor([1.0, 2.0])],
              "alibi_slopes": [torch.ones(H + 1), torch.ones(B + 1, H), [0.5] * H,
                               torch.ones(H, dtype=torch.int64)],
              "dropout_p": [1.0, -0.5, NAN], "softmax_scale": [NAN, INF, "0.5"]}
    return {n: call(x, **{arg: x}) for n, x in labelled(values[arg]).items()}


FA_ARGS = ["q", "k", "v", "qkv", "kv", "window_size", "softcap", "alibi_slopes", "dropout_p",
           "softmax_scale"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", FA_ARGS)
def test_fa_func_invalid_argument_is_named(arg, long):
    run_invalid(fa_calls(plain=True, packings=("func",)), bad_fa, arg, long)
# == attn.compat.flash_attn: flash_attn_varlen_func (packed, padded, paged) ===================

def paged_cache(g: Gen, lens: list[int], page: int, hkv: int, d: int, spare_pages: int,
                spare_slots: int):
    """A shuffled paged cache (num_blocks, page, Hkv, D) of random data and a block_table
    (B, pages per sequence): sequence b's t-th key lives at
    ``cache[table[b, t // page], t % page]``."""
    n = len(lens)
    per_seq = max(1, -(-max(lens) // page)) + spare_slots
    num_blocks = n * per_seq + spare_pages
    table = g.perm(num_blocks)[:n * per_seq].view(n, per_seq).to(torch.int32)
    return g.randn(num_blocks, page, hkv, d), g.randn(num_blocks, page, hkv, d), table


def gather_pages(cache: torch.Tensor, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The packed keys (sum(lens), Hkv, D) a block_table points at, in order."""
    page = cache.shape[1]
    return torch.cat([cache[table[b, t // page], t % page][None] for b, n in enumerate(lens)
                      for t in range(n)] or [cache[:0, 0]])


@st.composite
def fa_varlen_calls(draw, plain: bool = False,
                    packings=("func", "func", "paged", "paged", "qkvpacked", "kvpacked")) -> Case:
    g = Gen(draw(seeds))
    packing = draw(st.sampled_from(packings))
    n = draw(st.integers(1, 4))
    lq = lengths(draw, n, 12)
    lk = lq if packing == "qkvpacked" or maybe(draw) else lengths(draw, n, 12)
    if sum(lq) == 0 or sum(lk) == 0:
        lq, lk = [max(1, lq[0])] + lq[1:], [max(1, lk[0])] + lk[1:]
    hkv = draw(st.integers(1, 2))
    H = hkv if packing == "qkvpacked" else hkv * draw(st.integers(1, 3))
    d = draw(st.integers(1, 16))
    pad_q = draw(st.integers(0, 3))  # a padded buffer: rows past cu_seqlens_q[-1]
    pad_k = pad_q if packing == "qkvpacked" else draw(st.integers(0, 3))
    q = g.randn(sum(lq) + pad_q, H, d)
    args = dict(q=q, cu_q=torch.tensor(offsets(lq), dtype=torch.int32),
                cu_k=torch.tensor(offsets(lk), dtype=torch.int32), lq=lq, lk=lk,
                packing=packing, dtype=draw(float_dtypes))
    if packing == "paged":
        args["k"], args["v"], args["block_table"] = paged_cache(
            g, lk, draw(st.integers(1, 8)), hkv, d, draw(st.integers(0, 3)),
            draw(st.integers(0, 1)))
    else:
        args["k"], args["v"] = g.randn(sum(lk) + pad_k, hkv, d), g.randn(sum(lk) + pad_k, hkv, d)
    if packing == "qkvpacked":
        args["cu_k"] = args["cu_q"]
    kw: dict = {"causal": draw(st.booleans())}
    if maybe(draw):
        kw["window_size"] = window_forms(draw, draw(st.integers(-1, 14)),
                                         draw(st.integers(-1, 14)), plain)
    if maybe(draw):
        kw["softcap"] = draw(st.sampled_from([0.0, 0.5, 5.0]))
    if maybe(draw):
        kw["alibi_slopes"] = g.rand(*draw(st.sampled_from([(H,), (n, H)])), dtype=torch.float32)
    if maybe(draw):
        kw["softmax_scale"] = draw(st.floats(0.05, 2.0))
    extra = draw(st.sampled_from([0, 0, 1, 5]))
    args["maxes"] = (max(lq) + extra, max(lk) + extra) if packing != "qkvpacked" else \
        (max(lq) + extra,) * 2
    args["kw"] = kw
    return Case(args, note=f"{packing} ")


def run_fa_varlen(c: Case, q, k, v, **kw):
    max_q, max_k = c.maxes
    if c.packing == "qkvpacked":
        return fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), c.cu_q, max_q,
                                                   **kw)
    if c.packing == "kvpacked":
        return fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), c.cu_q, c.cu_k,
                                                  max_q, max_k, **kw)
    table = {"block_table": c.block_table} if c.packing == "paged" else {}
    return fa.flash_attn_varlen_func(q, k, v, c.cu_q, c.cu_k, max_q, max_k, **kw, **table)


def check_fa_varlen(c: Case) -> None:
    q, k, v = (rounded(t, c.dtype) for t in (c.q, c.k, c.v))
    out, lse, _ = run_fa_varlen(c, *(t.to(c.dtype) for t in (q, k, v)), **c.kw,
                                return_attn_probs=True)
    no_nan("out", out)
    no_nan("softmax_lse", lse)
    if c.packing == "paged":
        k, v = gather_pages(k, c.block_table, c.lk), gather_pages(v, c.block_table, c.lk)
    kw = dict(c.kw)
    if "window_size" in kw:
        kw["window_size"] = tuple(int(w) for w in kw["window_size"])
    cu_q, cu_k = offsets(c.lq), offsets(c.lk)
    exact = fa_varlen_loop(q, k, v, cu_q, cu_k, F64, seqlen_k=c.maxes[1], **kw)
    plain = fa_varlen_loop(q, k, v, cu_q, cu_k, c.dtype, seqlen_k=c.maxes[1], **kw)
    check_budget("out", out, exact[0], plain[0], c.dtype)
    check_budget("softmax_lse", lse, exact[1], plain[1], c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_fa_varlen_valid_calls_match_a_loop_over_sequences(long):
    run_property(fa_varlen_calls(), check_fa_varlen, n_examples(long, 25))



def bad_fa_varlen(draw, c: Case, arg: str) -> dict[str, Bad]:
    """flash_attn_varlen_func, contiguous or paged (block_table), one argument made
    invalid."""
    q, k, v = c.q, c.k, c.v
    H, d = q.shape[1:]
    table = c.args.get("block_table")

    def call(value, q=q, k=k, v=v, cu_seqlens_q=c.cu_q, cu_seqlens_k=c.cu_k, table=table,
             **kw):
        full = {**c.kw, **kw}
        if table is not None:
            full["block_table"] = table
        return Bad(lambda: fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                     *c.maxes, **full), value)

    if arg == "q":
        return {n: call(x, q=x) for n, x in {
            "rank4": q[None], "list": q.tolist(), "dtype": q.float(),
            "head_dim": r(*q.shape[:2], d + 1)}.items()}
    if arg == "k":  # k and v changed alike: k is the argument named first
        bad = {"rank": k[0] if table is not None else k[None], "int": k.long(),
               "head_dim": r(*k.shape[:-1], d + 1)}
        return {n: call(x, k=x, v=x.to(F64) if n != "int" else v) for n, x in bad.items()}
    if arg.startswith("cu_seqlens"):
        t = c.cu_q if arg == "cu_seqlens_q" else c.cu_k
        start, past, decrease = t.clone(), t.clone(), t.clone()
        start[0] = 1
        past[-1] = 10**6  # beyond the tokens there are (or the pages' capacity)
        if t.numel() >= 3:
            decrease[1] = decrease[2] + 1
        else:
            decrease = torch.tensor([0, -1], dtype=t.dtype)
        bad = {"float": t.float(), "list": t.tolist(), "rank2": t[None], "start": start,
               "past": past, "decrease": decrease}
        if arg == "cu_seqlens_k":
            bad["count"] = torch.cat([t, t[-1:]])
        return {n: call(x, **{arg: x}) for n, x in bad.items()}
    if arg == "block_table":
        if table is None:
            return {}
        # a slot the call reads (a page of a sequence's keys): refused whatever the rule for
        # slots no sequence uses
        page, num_blocks = k.shape[1], k.shape[0]
        b = draw(st.sampled_from([b for b, n in enumerate(c.lk) if n > 0]))
        j = draw(st.integers(0, -(-c.lk[b] // page) - 1))
        negative, beyond = table.clone(), table.clone()
        negative[b, j] = -draw(st.integers(1, num_blocks))
        beyond[b, j] = num_blocks + draw(st.integers(0, 3))
        return {n: call(x, table=x) for n, x in {
            "negative": negative, "out_of_range": beyond, "rows": torch.cat([table, table]),
            "float": table.float(), "rank3": table[None], "list": table.tolist()}.items()}
    values = {"window_size": [(1,), "1,2", (0.5, 1), 3],
              "softcap": ["5", NAN, torch.ones(2)],
              "alibi_slopes": [torch.ones(H + 1), torch.ones(9, H)]}
    return {n: call(x, **{arg: x}) for n, x in labelled(values[arg]).items()}


FA_VARLEN_ARGS = ["q", "k", "cu_seqlens_q", "cu_seqlens_k", "block_table", "window_size",
                  "softcap", "alibi_slopes"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", FA_VARLEN_ARGS)
def test_fa_varlen_invalid_argument_is_named(arg, long):
    packings = ("paged",) if arg == "block_table" else ("func", "paged")
    run_invalid(fa_varlen_calls(plain=True, packings=packings), bad_fa_varlen, arg, long)


# == attn.compat.flash_attn: flash_attn_with_kvcache (contiguous and paged) ====================

@st.composite
def kvcache_calls(draw, plain: bool = False) -> Case:
    g = Gen(draw(seeds))
    B, nq = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    hkv = draw(st.integers(1, 2))
    H = hkv * draw(st.integers(1, 2))
    d = 2 * draw(st.integers(1, 8))
    n_new = draw(st.sampled_from([0, 0, 1, 2, 3]))
    paged = maybe(draw)
    a: dict = dict(q=g.randn(B, nq, H, d), paged=paged, n_new=n_new, dtype=draw(float_dtypes),
                   per_row=draw(st.booleans()))
    if paged:
        page = draw(st.integers(1, 8))
        per_seq = draw(st.integers(max(1, -(-n_new // page)), 4))
        capacity = page * per_seq
        num_blocks = B * per_seq + draw(st.integers(0, 3))
        a["block_table"] = g.perm(num_blocks)[:B * per_seq].view(B, per_seq).to(torch.int32)
        rows = num_blocks
    else:
        capacity = draw(st.integers(max(1, n_new), 24))
        rows = B + draw(st.integers(0, 2))
        page = capacity
        if maybe(draw):
            a["cache_batch_idx"] = g.perm(rows)[:B].to(torch.int32)
    a["k_cache"], a["v_cache"] = g.randn(rows, page, hkv, d), g.randn(rows, page, hkv, d)
    a["capacity"] = capacity
    if n_new or maybe(draw):
        ends = [draw(st.integers(0, capacity - n_new)) for _ in range(B)]
        same = maybe(draw)
        if same:
            ends = [ends[0]] * B
        a["cache_seqlens"] = (ends[0] if same and maybe(draw)
                              else torch.tensor(ends, dtype=torch.int32))
        if not paged and maybe(draw):
            a["cache_leftpad"] = torch.tensor([draw(st.integers(0, e)) for e in ends],
                                              dtype=torch.int32)
    if n_new:
        a["k"], a["v"] = g.randn(B, n_new, hkv, d), g.randn(B, n_new, hkv, d)
        if maybe(draw):
            rd = 2 * draw(st.integers(1, d // 2))
            # flash-attn asks for >= capacity rows; queries past the new keys turn further
            seqlen_ro = capacity + nq + draw(st.integers(0, 3))
            angle = torch.arange(seqlen_ro, dtype=F64)[:, None] * g.rand(1, rd // 2, hi=0.5)
            a["rotary_cos"], a["rotary_sin"] = angle.cos(), angle.sin()
            a["rotary_interleaved"] = draw(st.booleans())
    kw: dict = {"causal": draw(st.booleans())}
    if maybe(draw):
        kw["window_size"] = window_forms(draw, draw(st.integers(-1, capacity + 1)),
                                         draw(st.integers(-1, capacity + 1)), plain)
    if maybe(draw):
        kw["softcap"] = draw(st.sampled_from([0.0, 0.5, 5.0]))
    if maybe(draw):
        kw["alibi_slopes"] = g.rand(*draw(st.sampled_from([(H,), (B, H)])), dtype=torch.float32)
    if maybe(draw):
        kw["softmax_scale"] = draw(st.floats(0.05, 2.0))
    a["kw"] = kw
    return Case(a, note=f"{'paged' if paged else 'contiguous'} ")


KV_TENSORS = ("k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin")
KV_OPTIONS = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
              "rotary_interleaved")


def run_kvcache(c: Case, dtype: torch.dtype, **changes):
    """flash_attn_with_kvcache on copies of the case's caches in ``dtype`` (the call writes
    into them); returns (out, lse, k_cache, v_cache). ``changes`` replace arguments."""
    args = {n: c.args[n] for n in KV_TENSORS + KV_OPTIONS if n in c.args}
    for n in KV_TENSORS:
        if n in args:
            args[n] = args[n].to(dtype).clone()
    q = changes.pop("q", c.q.to(dtype))
    args.update(changes)
    per_row = ("cpu",) if c.per_row else ()
    with mock.patch.object(importlib.import_module("attn.decoding"), "_PAGED_DEVICES", per_row):
        out, lse = fa.flash_attn_with_kvcache(q, **args, **c.kw, return_softmax_lse=True)
    return out, lse, args["k_cache"], args["v_cache"]


def kv_ends(c: Case) -> list[int]:
    """Each row's cache_seqlens (the whole cache when not given)."""
    seqlens = c.args.get("cache_seqlens", c.capacity)
    return [int(seqlens)] * c.q.shape[0] if isinstance(seqlens, int) else seqlens.tolist()


def some_row_has_keys(c: Case) -> bool:
    """(A batch where no row has a key is the valid-call property's business.)"""
    starts = c.args["cache_leftpad"].tolist() if "cache_leftpad" in c.args else [0] * len(c.q)
    return any(e + c.n_new > s for e, s in zip(kv_ends(c), starts))


def kvcache_oracle(c: Case, dtype: torch.dtype):
    """What flash-attn computes: the new keys (rotated at cache_seqlens + t) written into a
    copy of the cache, then each row's queries (rotated at cache_seqlens, + t when causal or
    local) over its keys [cache_leftpad, cache_seqlens + Nnew), bottom-right, the window
    rule's seqlen_k being the cache's capacity. Returns (out, lse, k_cache, v_cache)."""
    q, B, n_new = rounded(c.q, c.dtype), c.q.shape[0], c.n_new
    kc, vc = rounded(c.k_cache, c.dtype), rounded(c.v_cache, c.dtype)
    ends = kv_ends(c)
    starts = c.args["cache_leftpad"].tolist() if "cache_leftpad" in c.args else [0] * B
    rows = c.args["cache_batch_idx"].tolist() if "cache_batch_idx" in c.args else list(range(B))
    table = c.args.get("block_table")
    page = kc.shape[1]
    kw = dict(c.kw)
    if "window_size" in kw:
        kw["window_size"] = tuple(int(w) for w in kw["window_size"])
    k_new, v_new = (rounded(c.args[n], c.dtype) if n in c.args else None for n in "kv")
    if "rotary_cos" in c.args:
        left, right, _ = fa_window(kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                   c.capacity)
        advance = kw.get("causal", False) or left >= 0 or right >= 0
        nq = q.shape[1]
        e = torch.tensor(ends)[:, None]
        q_pos = e + (torch.arange(nq)[None] if advance else 0 * torch.arange(nq)[None])
        k_pos = e + torch.arange(n_new)[None]
        cos, sin = rounded(c.rotary_cos, c.dtype), rounded(c.rotary_sin, c.dtype)
        inter = c.args["rotary_interleaved"]
        q, k_new = rotate(q, cos, sin, q_pos, inter), rotate(k_new, cos, sin, k_pos, inter)

    def slot(b, t):  # (cache row, position in it) of row b's logical position t
        return (int(table[b, t // page]), t % page) if table is not None else (rows[b], t)

    for b in range(B):
        for t in range(n_new):
            kc[slot(b, ends[b] + t)] = k_new[b, t].to(dtype).to(F64)
            vc[slot(b, ends[b] + t)] = v_new[b, t].to(dtype).to(F64)
    H, dv = q.shape[2], vc.shape[-1]
    out = torch.zeros(B, q.shape[1], H, dv, dtype=dtype)
    lse = torch.full((B, H, q.shape[1]), INF, dtype=F64 if dtype == F64 else torch.float32)
    for b in range(B):
        keys = range(starts[b], ends[b] + n_new)
        if len(keys) == 0:
            continue
        kk = torch.stack([kc[slot(b, t)] for t in keys])[None]  # (1, Nk, Hkv, D)
        vv = torch.stack([vc[slot(b, t)] for t in keys])[None]
        slopes = kw.get("alibi_slopes")
        extra = {} if slopes is None else {"alibi_slopes": slopes if slopes.dim() == 1
                                           else slopes[b:b + 1]}
        o, l = fa_attention(q[b:b + 1], kk, vv, dtype, seqlen_k=c.capacity, **extra,
                            **{n: x for n, x in kw.items() if n != "alibi_slopes"})
        out[b], lse[b] = o[0], l[0]
    return out, lse, kc, vc


def check_kvcache(c: Case) -> None:
    out, lse, kc, vc = run_kvcache(c, c.dtype)
    no_nan("out", out)
    no_nan("softmax_lse", lse)
    exact = kvcache_oracle(c, F64)
    plain = kvcache_oracle(c, c.dtype)
    for name, got, ex, pl in zip(("out", "softmax_lse", "k_cache", "v_cache"),
                                 (out, lse, kc, vc), exact, plain):
        check_budget(name, got, ex, pl, c.dtype)


@pytest.mark.parametrize("long", PROFILES)
def test_kvcache_valid_calls_match_the_reference(long):
    run_property(kvcache_calls(), check_kvcache, n_examples(long, 25))


def bad_kvcache(draw, c: Case, arg: str) -> dict[str, Bad]:
    B, nq, H, d = c.q.shape
    capacity, paged = c.capacity, c.paged
    k_cache = c.k_cache

    def call(value, **changes):
        return Bad(lambda: run_kvcache(c, F64, **changes), value)

    if arg == "q":
        return {n: call(x, q=x) for n, x in {"rank3": c.q[0], "list": c.q.tolist(),
                                             "head_dim": r(B, nq, H, d + 2)}.items()}
    if arg == "k_cache":
        bad = {"rank3": k_cache[0], "head_dim": r(*k_cache.shape[:3], d + 2),
               "list": k_cache.tolist(), "heads": r(*k_cache.shape[:2], H + 1, d)}
        return {n: call(x, k_cache=x, **({"v_cache": r(*x.shape)} if n in ("head_dim", "heads")
                                         else {})) for n, x in bad.items()}
    if arg == "v_cache":
        return {n: call(x, v_cache=x) for n, x in {
            "rank3": c.v_cache[0], "rows": r(k_cache.shape[0] + 1, *k_cache.shape[1:]),
            "list": c.v_cache.tolist()}.items()}
    if arg in ("k", "v"):
        if c.n_new == 0:
            return {}
        t = c.args[arg]
        other = "v" if arg == "k" else "k"
        bad = {"rank3": t[0], "heads": r(B, c.n_new, H + 1, d),
               "batch": r(B + 1, c.n_new, *t.shape[2:])}
        out = {n: call(x, **{arg: x}) for n, x in bad.items()}
        out["alone"] = call(f"{other}=None", **{other: None})  # the one given without the other
        if arg == "k":
            out["alone"] = Bad(out["alone"].run, "v=None", ("v", "k"))
        return out
    if arg == "cache_seqlens":
        full = c.capacity - c.n_new + 1
        return {n: call(x, cache_seqlens=x) for n, x in {
            "float": torch.zeros(B), "shape": torch.zeros(B + 1, dtype=torch.int32),
            "too_long": torch.full((B,), full, dtype=torch.int32),
            "negative": torch.full((B,), -1, dtype=torch.int32), "str": "3"}.items()}
    if arg == "cache_leftpad":
        if paged or "cache_seqlens" not in c.args:
            return {}
        ends = c.cache_seqlens
        ends = torch.full((B,), ends) if isinstance(ends, int) else ends
        return {n: call(x, cache_leftpad=x) for n, x in {
            "past_seqlens": (ends + 1).to(torch.int32), "negative": torch.full((B,), -1,
                                                                               dtype=torch.int32),
            "float": torch.zeros(B)}.items()}
    if arg == "cache_batch_idx":
        if paged:
            return {"with_block_table": call("with block_table",
                                             cache_batch_idx=torch.arange(B, dtype=torch.int32))}
        rows = k_cache.shape[0]
        return {n: call(x, cache_batch_idx=x) for n, x in {
            "out_of_range": torch.full((B,), rows, dtype=torch.int32),
            "negative": torch.full((B,), -1, dtype=torch.int32),
            "shape": torch.zeros(B + 1, dtype=torch.int32)}.items()}
    if arg == "block_table":
        if not paged:
            return {}
        table, num_blocks = c.block_table, k_cache.shape[0]
        page = k_cache.shape[1]
        ends = kv_ends(c)
        # a slot the call reads or writes: refused whatever the rule for unused slots
        used = [(b, j) for b in range(B) for j in range(-(-(ends[b] + c.n_new) // page))]
        if not used:
            return {}
        b, j = draw(st.sampled_from(used))
        negative, beyond = table.clone(), table.clone()
        negative[b, j] = -draw(st.integers(1, num_blocks))
        beyond[b, j] = num_blocks + draw(st.integers(0, 3))
        return {n: call(x, block_table=x) for n, x in {
            "negative": negative, "out_of_range": beyond, "rows": torch.cat([table, table]),
            "float": table.float()}.items()}
    if arg == "rotary_cos":
        if c.n_new == 0:
            return {"without_k": call("without k", k=None, v=None, cache_seqlens=0,
                                      rotary_cos=torch.ones(capacity, 1),
                                      rotary_sin=torch.zeros(capacity, 1))}
        # a table without a row for the last new key's position (flash-attn 2 also wants a
        # row per cache slot; compat refuses only a table the call's positions overrun)
        n = max(kv_ends(c)) + c.n_new - 1
        short = torch.ones(n, 1, dtype=F64), torch.zeros(n, 1, dtype=F64)
        return {"short": call(f"{n} rows for positions up to {n}", rotary_cos=short[0],
                              rotary_sin=short[1]),
                "head_dim": call("rd > D", rotary_cos=torch.ones(capacity, d),
                                 rotary_sin=torch.zeros(capacity, d))}
    values = {"window_size": [(1,), "1,2", (0.5, 1), 3],
              "softcap": ["5", NAN, torch.ones(2)],
              "alibi_slopes": [torch.ones(H + 1), torch.ones(B + 1, H)]}
    return {n: Bad(lambda x=x: run_kvcache(Case({**c.args, "kw": {**c.kw, arg: x}}), F64), x)
            for n, x in labelled(values[arg]).items()}


KVCACHE_ARGS = ["q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "cache_leftpad",
                "cache_batch_idx", "block_table", "rotary_cos", "window_size", "softcap",
                "alibi_slopes"]


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", KVCACHE_ARGS)
def test_kvcache_invalid_argument_is_named(arg, long):
    base = kvcache_calls(plain=True)
    if arg in ("k", "v"):
        base = base.filter(lambda c: c.n_new > 0)
    elif arg in ("block_table", "cache_leftpad"):
        base = base.filter(lambda c: c.paged == (arg == "block_table"))
    run_invalid(base, bad_kvcache, arg, long)


# == attn.select_backend =======================================================================

@st.composite
def backend_calls(draw) -> Case:
    left, right = (draw(st.sampled_from([None, 0, 3])) for _ in range(2))
    call = AttentionCall(
        device=draw(st.sampled_from(["cpu", "cuda", "meta"])),
        dtype=draw(st.sampled_from([F64, torch.float32, torch.float16, torch.bfloat16])),
        head_dim=draw(st.integers(1, 512)), head_dim_v=draw(st.integers(1, 512)),
        n_q=draw(st.integers(1, 5000)), n_k=draw(st.integers(1, 5000)),
        band=Band(draw(st.integers(-5, 5)), left, right),
        mask=draw(st.sampled_from([None, "bool", "float"])), mask_grad=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, "fixed", "learned"])), sinks=draw(st.booleans()),
        temperature_tensor=draw(st.booleans()), dropout=draw(st.booleans()),
        return_lse=draw(st.booleans()), score_mod=draw(st.booleans()),
        mask_mod=draw(st.booleans()), varlen=draw(st.booleans()), alibi=draw(st.booleans()))
    return Case(dict(call=call, requested=draw(st.sampled_from(BACKENDS))))


def check_select(c: Case) -> None:
    try:
        choice = attn.select_backend(c.call, c.requested)
    except NotImplementedError as exc:
        assert c.requested not in ("auto", "reference", "tiled"), \
            f"{c.requested!r} refused a call: {exc}"
        assert repr(c.requested) in str(exc) and "backend" in str(exc), str(exc)
        return
    assert choice.name in BACKENDS[1:] and isinstance(choice.reason, str) and choice.reason
    if c.requested != "auto":
        assert choice.name == c.requested
    elif c.call.device != "cuda":
        # off CUDA auto takes fused (what torch's CPU kernel expresses, where attn.choose's
        # measured table prefers it) or tiled (everything else): fused only where it can
        assert choice.name in ("fused", "tiled"), choice
        if choice.name == "fused":
            assert attn.api.unsupported_reason("fused", c.call) is None, choice
    assert attn.select_backend(c.call, c.requested) == choice  # pure


@pytest.mark.parametrize("long", PROFILES)
def test_select_backend_answers_every_call(long):
    run_property(backend_calls(), check_select, n_examples(long, 30))


def bad_select(draw, c: Case, arg: str) -> dict[str, Bad]:
    if arg == "call":
        return {n: Bad(lambda x=x: attn.select_backend(x, c.requested), x)
                for n, x in labelled(["tiled", None, {"device": "cpu"}, 3]).items()}
    # select_backend's parameter is `requested`; its messages say `backend`
    return {n: Bad(lambda x=x: attn.select_backend(c.call, x), x, ("requested", "backend"))
            for n, x in labelled(["foo", None, 3, "Tiled", ""]).items()}


@pytest.mark.parametrize("long", PROFILES)
@pytest.mark.parametrize("arg", ["call", "requested"])
def test_select_backend_invalid_argument_is_named(arg, long):
    run_invalid(backend_calls(), bad_select, arg, long)


# == isolation: one sequence's data never changes another's output bit (slow) ==================

POISONS = [NAN, INF, -INF, 1e30, -1e30, 3e38, 65504.0]


def poisoned(draw, t: torch.Tensor, index, value: float | None = None) -> torch.Tensor:
    """A copy of ``t`` with ``t[index]`` poisoned: all of it, one row, or one element."""
    t = t.clone()
    value = draw(st.sampled_from(POISONS)) if value is None else value
    region = t[index]
    if region.numel() == 0:
        return t
    extent = draw(st.sampled_from(["all", "row", "element"]))
    if extent == "all":
        region.fill_(value)
    else:
        flat = region.reshape(region.shape[0], -1) if region.dim() else region.reshape(1, 1)
        row = draw(st.integers(0, flat.shape[0] - 1))
        if extent == "row":
            flat[row] = value
        else:
            flat[row, draw(st.integers(0, flat.shape[1] - 1))] = value
        region = flat.reshape(region.shape)
    t[index] = region
    return t


def assert_same_bits(name: str, clean: torch.Tensor, dirty: torch.Tensor, where: str) -> None:
    assert torch.equal(clean, dirty) or (
        torch.equal(torch.isnan(clean), torch.isnan(dirty))
        and torch.equal(clean.nan_to_num(0.0, 1.0, -1.0), dirty.nan_to_num(0.0, 1.0, -1.0))), (
        f"{name} of {where} changed: {int((clean != dirty).sum())} entries differ "
        f"(NaN now: {int(torch.isnan(dirty).sum())})")


def seq_of(cu: list[int], total: int) -> torch.Tensor:
    """The sequence of each of ``total`` packed rows (-1 past the last offset)."""
    doc = torch.full((total,), -1)
    for b in range(len(cu) - 1):
        doc[cu[b]:cu[b + 1]] = b
    return doc


# -- packed sequences: attn.varlen_attention and compat's varlen (paged included) --

@st.composite
def packed_poisonings(draw) -> Case:
    if maybe(draw):
        c = draw(varlen_calls())
        entry, lq, lk = "attn", c.cu_q.diff().tolist(), c.cu_k.diff().tolist()
    else:
        c = draw(fa_varlen_calls(plain=True))
        entry, lq, lk = "compat", c.lq, c.lk
    cu_q, cu_k = offsets(lq), offsets(lk)
    which = draw(st.sampled_from(["q", "k", "v"]))
    t = {"q": c.q, "k": c.k, "v": c.v}[which]
    paged = entry == "compat" and c.packing == "paged"
    cu = cu_q if which == "q" else cu_k
    owners = [b for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]
    targets = owners + (["tail"] if t.shape[0] > cu[-1] or paged else [])
    target = draw(st.sampled_from(targets))
    if paged and which != "q":  # a sequence's pages (their unused tails too), or spare ones
        page = t.shape[1]
        table = c.block_table
        used = {int(p) for b, n in enumerate(lk) for p in table[b, :-(-n // page)]}
        if target == "tail":
            spare = sorted(set(range(t.shape[0])) - used)
            tails = [(int(table[b, (n - 1) // page]), n % page) for b, n in enumerate(lk)
                     if n % page]
            choice = draw(st.sampled_from(["pages"] * bool(spare) + ["tails"] * bool(tails)
                                          or ["none"]))
            index = (torch.tensor(spare) if choice == "pages" else
                     (draw(st.sampled_from(tails))[0], slice(draw(st.sampled_from(tails))[1], None))
                     if choice == "tails" else torch.tensor([], dtype=torch.long))
        else:
            index = table[target, :max(1, -(-lk[target] // page))].long()
    else:
        index = slice(cu[-1], None) if target == "tail" else slice(cu[target], cu[target + 1])
    dirty = poisoned(draw, t, index)
    return Case(dict(case=c, entry=entry, which=which, dirty=dirty, target=target,
                     cu_q=cu_q), note=f"{entry} {which} of {target} ")


def run_packed(p: Case, **tensors):
    c = p.case
    q, k, v = (tensors.get(n, getattr(c, n)).to(c.dtype) for n in "qkv")
    if p.entry == "attn":
        return attn.varlen_attention(q, k, v, c.cu_q, c.cu_k, *c.maxes, return_lse=True,
                                     backend=c.backend, **cast_kw(c.kw, c.dtype))
    out, lse, _ = run_fa_varlen(c, q, k, v, **c.kw, return_attn_probs=True)
    return out, lse


def check_packed_isolation(p: Case) -> None:
    clean = run_packed(p)
    dirty = run_packed(p, **{p.which: p.dirty})
    doc = seq_of(p.cu_q, p.case.q.shape[0])
    keep = doc != p.target if p.target != "tail" or p.which == "q" else torch.ones_like(doc,
                                                                                    dtype=bool)
    if p.which == "q" and p.target == "tail":
        keep = doc >= 0
    where = f"the sequences other than {p.target}"
    assert_same_bits("out", clean[0][keep], dirty[0][keep], where)
    assert_same_bits("lse", clean[1][:, keep], dirty[1][:, keep], where)


@pytest.mark.slow
def test_packed_sequences_are_isolated():
    run_property(packed_poisonings(), check_packed_isolation, 300)


# -- KV cache: flash_attn_with_kvcache, contiguous and paged --

@st.composite
def kvcache_poisonings(draw) -> Case:
    c = draw(kvcache_calls(plain=True).filter(some_row_has_keys))
    B = c.q.shape[0]
    ends = kv_ends(c)
    starts = c.args["cache_leftpad"].tolist() if "cache_leftpad" in c.args else [0] * B
    rows = (c.args["cache_batch_idx"].tolist() if "cache_batch_idx" in c.args
            else list(range(B)))
    page = c.k_cache.shape[1]
    choices = ["q", "cache"] + (["new"] if c.n_new else [])
    what = draw(st.sampled_from(choices))
    b = draw(st.integers(0, B - 1))
    which = draw(st.sampled_from(["k", "v"]))
    if what == "q":
        name, t, index = "q", c.q, (b,)
    elif what == "new":
        name, t, index = which, c.args[which], (b,)
    else:  # row b's keys, the slots no row reads, or cache rows / pages no row uses
        name, t = f"{which}_cache", c.args[f"{which}_cache"]
        region = draw(st.sampled_from(["own", "unused"]))
        if region == "own":
            if "block_table" in c.args:
                index = (c.block_table[b, :max(1, -(-(ends[b] + c.n_new) // page))].long(),)
            else:
                index = (rows[b], slice(starts[b], ends[b] + c.n_new))
        else:
            mask = torch.ones(t.shape[:2], dtype=torch.bool)
            for bb in range(B):
                for pos in range(starts[bb], ends[bb] + c.n_new):
                    if "block_table" in c.args:
                        mask[int(c.block_table[bb, pos // page]), pos % page] = False
                    else:
                        mask[rows[bb], pos] = False
            index = (mask,)
            b = None
    dirty = poisoned(draw, t, index)
    return Case(dict(case=c, name=name, dirty=dirty, b=b), note=f"{name} of row {b} ")


def check_kvcache_isolation(p: Case) -> None:
    c = p.case
    clean = run_kvcache(c, c.dtype)[:2]
    changes = {p.name: p.dirty.to(c.dtype)}
    if p.name.endswith("_cache"):
        changes[p.name] = changes[p.name].clone()
    dirty = run_kvcache(c, c.dtype, **changes)[:2]
    keep = torch.arange(c.q.shape[0]) != (-1 if p.b is None else p.b)
    where = "every row" if p.b is None else f"the rows other than {p.b}"
    assert_same_bits("out", clean[0][keep], dirty[0][keep], where)
    assert_same_bits("softmax_lse", clean[1][keep], dirty[1][keep], where)


@pytest.mark.slow
def test_kvcache_rows_and_pages_are_isolated():
    run_property(kvcache_poisonings(), check_kvcache_isolation, 1000)


# -- batched calls: one batch row poisoned --

@st.composite
def batch_poisonings(draw) -> Case:
    entry = draw(st.sampled_from(["attention", "sdpa", "flex", "fa"]))
    if entry == "attention":
        c = draw(attention_calls(max_n=24))
        tensors, axis = {"q": c.q, "k": c.k, "v": c.v}, 0
    elif entry == "sdpa":
        c = draw(sdpa_calls(empty=False))
        tensors, axis = {"query": c.query, "key": c.key, "value": c.value}, 0
    elif entry == "flex":
        c = draw(flex_calls())
        tensors, axis = {"q": c.q, "k": c.k, "v": c.v}, 0
    else:
        c = draw(fa_calls(plain=True, packings=("func",)))
        tensors, axis = {"q": c.q, "k": c.k, "v": c.v}, 0
    name = draw(st.sampled_from(list(tensors)))
    B = tensors[name].shape[axis]
    b = draw(st.integers(0, B - 1))
    return Case(dict(case=c, entry=entry, name=name, b=b,
                     dirty=poisoned(draw, tensors[name], (b,))), note=f"{entry} {name}[{b}] ")


def run_batched(p: Case, **changes):
    c = p.case
    torch.manual_seed(0)  # the same dropout mask in both runs
    if p.entry == "attention":
        q, k, v = (changes.get(n, getattr(c, n)).to(c.dtype) for n in "qkv")
        return attn.attention(q, k, v, backend=c.backend, block_m=c.blocks[0],
                              block_n=c.blocks[1], return_lse=True, **cast_kw(c.kw, c.dtype))
    if p.entry == "sdpa":
        q, k, v = (changes.get(n, getattr(c, n)).to(c.dtype) for n in ("query", "key", "value"))
        return attn.scaled_dot_product_attention(q, k, v, backend=c.backend,
                                                 **cast_kw(c.kw, c.dtype)), None
    if p.entry == "flex":
        q, k, v = (changes.get(n, getattr(c, n)).to(c.dtype) for n in "qkv")
        kw = dict(c.kw)
        if c.mask_mod is not None:
            kw["block_mask"] = attn.create_block_mask(c.mask_mod, Q_LEN=q.shape[2],
                                                      KV_LEN=k.shape[2], **c.mask_spec)
        return attn.flex_attention(q, k, v, **kw, return_lse=True, backend=c.backend)
    q, k, v = (changes.get(n, getattr(c, n)).to(c.dtype) for n in "qkv")
    out, lse, _ = fa.flash_attn_func(q, k, v, **c.kw, return_attn_probs=True)
    return out, lse


def check_batch_isolation(p: Case) -> None:
    clean = run_batched(p)
    dirty = run_batched(p, **{p.name: p.dirty})
    B = clean[0].shape[0]
    keep = torch.arange(B) != p.b
    if p.entry == "sdpa" and p.case.query.dim() == 5:  # the first of two leading dims
        keep = torch.arange(B) != p.b
    where = f"the batch rows other than {p.b}"
    assert_same_bits("out", clean[0][keep], dirty[0][keep], where)
    if clean[1] is not None:
        assert_same_bits("lse", clean[1][keep], dirty[1][keep], where)


@pytest.mark.slow
def test_batch_rows_are_isolated():
    run_property(batch_poisonings(), check_batch_isolation, 300)


# -- a masked key never reaches the score of a query that may not see it --

@st.composite
def masked_key_poisonings(draw) -> Case:
    """attn.attention or flex_attention calls with some keys poisoned: their k with
    anything, their v with huge values finite in the call's dtype (a NaN or inf value may
    reach the output through 0·NaN, as in torch; documented). Every query that sees none
    of them (causal, window, bool or -inf float mask, mask_mod) keeps every bit."""
    entry = draw(st.sampled_from(["attention", "attention", "flex"]))
    if entry == "attention":
        c = draw(attention_calls(max_n=24))
        B, H, nq, _ = c.q.shape
        nk = c.k.shape[2]
        band = attn.masks.make_band(nq, nk, causal=c.kw.get("causal", False),
                                    window=c.kw.get("window"))
        keep = band.mask(torch.arange(nq), torch.arange(nk))
        keep = torch.ones(nq, nk, dtype=torch.bool) if keep is None else keep
        keep = keep.expand(B, H, nq, nk)
        mask = c.kw.get("attn_mask")
        if mask is not None:
            keep = keep & (mask if mask.dtype == torch.bool else mask != -INF)
    else:
        c = draw(flex_calls().filter(lambda c: c.mask_mod is not None))
        B, H, nq, _ = c.q.shape
        nk = c.k.shape[2]
        idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
               torch.arange(nq).view(1, 1, nq, 1), torch.arange(nk).view(1, 1, 1, nk))
        keep = torch.broadcast_to(c.mask_mod(*idx), (B, H, nq, nk))
    hkv = c.k.shape[1]
    g = Gen(draw(seeds))
    poison = g.bools(B, hkv, nk, p=draw(st.sampled_from([0.1, 0.3, 0.7])))  # keys poisoned
    k, v = c.k.clone(), c.v.clone()
    value = draw(st.sampled_from(POISONS))
    k[poison] = value
    finite = [x for x in (1e30, -1e30, 3e38, 65504.0, -65504.0)
              if torch.isfinite(torch.tensor(x).to(c.dtype))]
    huge_values = maybe(draw)
    if huge_values:
        v[poison] = draw(st.sampled_from(finite))
    # (B, Hkv, Nk) -> (B, H, Nq, Nk): a query row sees a poisoned key of its kv head
    poison_h = poison.repeat_interleave(H // hkv, dim=1)[:, :, None, :]
    clean_rows = ~(keep & poison_h).any(-1)  # (B, H, Nq)
    return Case(dict(case=c, entry=entry, k=k, v=v, rows=clean_rows, huge_values=huge_values),
                note=f"{entry} {int(poison.sum())} keys = {value}, "
                     f"{int(clean_rows.sum())} rows see none ")


def check_masked_keys(p: Case) -> None:
    wrapper = Case(dict(case=p.case, entry=p.entry))
    clean = run_batched(wrapper)
    dirty = run_batched(wrapper, k=p.k, v=p.v)
    rows = p.rows
    where = "the queries that see no poisoned key"
    if p.huge_values:
        # a value near the dtype's largest in a tile shifts that tile's exponent offset (the
        # accumulator's overflow guard), so the tile's other rows may move by rounding: within
        # one sequence, as a masked value's 0·NaN may (DESIGN.md); never across sequences
        for name, i in (("out", 0), ("lse", 1)):
            a, b = clean[i][rows].double(), dirty[i][rows].double()
            eps = torch.finfo(clean[i].dtype).eps
            assert torch.equal(a.isnan(), b.isnan()), f"{name} of {where}: NaN appeared"
            err = (a - b).nan_to_num(0.0).abs().max().item() if a.numel() else 0.0
            scale = a.nan_to_num(0.0).abs().max().item() if a.numel() else 0.0
            assert err <= 4 * eps * max(1.0, scale), f"{name} of {where} moved by {err:g}"
        return
    assert_same_bits("out", clean[0][rows], dirty[0][rows], where)
    assert_same_bits("lse", clean[1][rows], dirty[1][rows], where)


@pytest.mark.slow
def test_masked_keys_never_reach_a_score():
    run_property(masked_key_poisonings(), check_masked_keys, 300)
