"""The triton backend's own checks: dropout mask, determinism, op registration, backend choice.

Its comparison with the float64 reference (lengths, head dims, variants, edge cases) runs in
the backend-parametrized tests/test_variants.py.

Without a GPU the kernels run in the Triton interpreter on CPU (TRITON_INTERPRET=1, set here
before triton is imported: triton reads it when a kernel is decorated). With a GPU the same
small-size suite runs on CUDA with compiled kernels; full sizes live in test_triton_cuda.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from functools import partial  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402
from attn.api import AttentionCall, select_backend  # noqa: E402
from attn.testing import make_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not flash_triton._INTERPRET:
    pytest.skip("attn.flash_triton was imported before TRITON_INTERPRET=1 was set (by an "
                "earlier module); run this file on its own", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
tri = partial(attn.attention, backend="triton")


def _ids(d):
    return str(d).removeprefix("torch.")


def _inputs(**kw):
    return make_inputs(device=DEVICE, **kw)


@pytest.mark.cuda_if_present
def test_dropout_equals_reference_mask():
    # the kernel regenerates attn.masks.dropout_keep bit for bit: with dropout as the only
    # randomness, triton and the reference agree to float32 rounding for the same seed
    q, k, v = _inputs(B=2, H=3, N=50, Nk=61, D=16, dtype=torch.float32, seed=3)
    outs = []
    for backend in ("triton", "reference"):
        torch.manual_seed(1234)
        outs.append(attn.attention(q, k, v, dropout_p=0.4, causal=True, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.manual_seed(1235)
    other = tri(q, k, v, dropout_p=0.4, causal=True)
    assert not torch.allclose(other, outs[0], atol=1e-3)


@pytest.mark.cuda_if_present
def test_forward_deterministic():
    q, k, v = _inputs(B=1, H=2, N=70, D=32, dtype=torch.bfloat16, seed=4)
    a = tri(q, k, v, causal=True)
    b = tri(q, k, v, causal=True)
    assert torch.equal(a, b)


# -- backend choice and its explanations -------------------------------------------------------------

def _call(**kw):
    base = dict(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64, n_q=128,
                n_k=128)
    return AttentionCall(**{**base, **kw})


def test_auto_picks_triton_on_cuda():
    assert flash_triton.unsupported_reason(_call()) is None
    assert select_backend(_call(), "auto").name == "triton"
    assert select_backend(_call(sinks=True, softcap="learned", dropout=True)).name == "triton"


@pytest.mark.parametrize("kw,words", [
    (dict(dtype=torch.float64), "float64"),
    (dict(head_dim=320, head_dim_v=320), "head dim"),
    (dict(mask="float", mask_grad=True), "attn_mask"),
    (dict(device="mps"), "mps"),
])
def test_unsupported_says_why(kw, words):
    why = flash_triton.unsupported_reason(_call(**kw))
    assert why is not None and words in why
    choice = select_backend(_call(**kw), "auto")
    assert choice.name == "tiled"
    with pytest.raises(NotImplementedError, match="triton"):
        select_backend(_call(**kw), "triton")


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(flash_triton.launch, "_INTERPRET", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA" in flash_triton.unsupported_reason(_call(device="cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "before" in flash_triton.unsupported_reason(_call(device="cpu"))


# -- torch.library registration: fake tensors and torch.compile ------------------------------------

def _spec_args(q, k):
    """A causal spec of scale 0.25 as the custom ops' spec arguments."""
    from attn.masks import Band
    from attn.spec import LaunchSpec

    return flash_triton.launch._op_args(
        LaunchSpec(qk_scale=0.25, band=Band(k.shape[2] - q.shape[2], None, 0)))


def _op_args(q, k, v):
    return (q, k, v, None, None, None, *_spec_args(q, k))


@pytest.mark.cuda_if_present
def test_opcheck_forward_and_backward():
    q, k, v = _inputs(B=1, H=4, Hkv=2, N=20, Nk=30, D=16, Dv=24, seed=0)
    torch.library.opcheck(torch.ops.attn.flash_fwd.default, _op_args(q, k, v))
    out, lse, _, _ = torch.ops.attn.flash_fwd(*_op_args(q, k, v))
    do = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attn.flash_bwd.default,
                          (do, None, q, k, v, out, lse, None, None, None,
                           *_spec_args(q, k), False))
    sinks = torch.randn(q.shape[1], device=DEVICE)
    torch.library.opcheck(torch.ops.attn.flash_bwd.default,
                          (do, None, q, k, v, out, lse, None, sinks, None,
                           *_spec_args(q, k), False))
    alibi = torch.rand(1, q.shape[1], device=DEVICE)  # ALiBi slopes: the last, optional argument
    torch.library.opcheck(torch.ops.attn.flash_fwd.default, (*_op_args(q, k, v), alibi))
    torch.library.opcheck(torch.ops.attn.flash_bwd.default,
                          (do, None, q, k, v, out, lse, None, None, None,
                           *_spec_args(q, k), False, alibi))


@pytest.mark.cuda_if_present
def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 100, 64, dtype=torch.bfloat16, device=DEVICE)
        k = torch.empty(2, 2, 300, 64, dtype=torch.bfloat16, device=DEVICE)
        v = torch.empty(2, 2, 300, 48, dtype=torch.bfloat16, device=DEVICE)
        out, lse, logl, lse2 = torch.ops.attn.flash_fwd(*_op_args(q, k, v))
        assert logl.shape == lse.shape and logl.dtype == torch.float32
        assert lse2.shape == lse.shape and lse2.dtype == torch.float32
        assert out.shape == (2, 8, 100, 48) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32


# -- the spec through the custom ops: every LaunchSpec field arrives ----------------------------

def _spec_values(cls):
    """A spec of ``cls`` per field, each with that one field off its default (by its type),
    and one with all of them off; callables (which no op schema carries) stay None."""
    import dataclasses
    import typing

    from attn.masks import Band
    from attn.spec import ScoreTerms

    hints = typing.get_type_hints(cls)
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        hint = hints[f.name]
        kinds = set(typing.get_args(hint)) or {hint}
        if any(typing.get_origin(a) is not None or a is typing.Callable for a in kinds) \
                or any(getattr(a, "__name__", "") == "Blocks" for a in kinds):
            continue  # a callable or block mask: refused on the ops' path (test below)
        if Band in kinds:
            values[f.name] = Band(3 + i, 2, 1)
        elif ScoreTerms in kinds:  # two terms, one name beyond ASCII (UTF-8 in the ints)
            values[f.name] = ScoreTerms.of(score_bias=0.375 + i, τ_shift=-1.5)
        elif float in kinds:
            values[f.name] = 0.375 + i
        elif int in kinds:
            values[f.name] = 5 + i
        else:
            raise AssertionError(f"give LaunchSpec.{f.name} ({hint}) a test value here")
    base = dict(qk_scale=0.5)
    singles = [cls(**{**base, name: value}) for name, value in values.items()]
    return singles + [cls(**{**base, **values})]


def _specs_the_ops_see(monkeypatch, spec, q, k, v):
    """The spec each custom op (forward, split forward, backward) hands its launcher when
    called with ``launch._op_args(spec)``; the launchers are stubs: nothing runs."""
    from attn.grads import Grads

    launch = flash_triton.launch
    seen = []
    out = lambda: torch.empty(*q.shape[:-1], v.shape[-1])  # noqa: E731
    lse = lambda: torch.empty(q.shape[:-1])  # noqa: E731

    def fwd(q, k, v, spec, ops, want_logl=False):
        seen.append(spec)
        return out(), lse(), lse(), lse()

    def fwd_split(q, k, v, spec, ops, chunk):
        seen.append(spec)
        return out(), lse()

    def bwd(*args, **kw):
        seen.append(args[7])
        return Grads(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None,
                     None)

    monkeypatch.setattr(launch, "_fwd", fwd)
    monkeypatch.setattr(launch, "_fwd_split", fwd_split)
    monkeypatch.setattr(launch, "_bwd", bwd)
    args = launch._op_args(spec)
    o, l, _, _ = torch.ops.attn.flash_fwd(q, k, v, None, None, None, *args)
    torch.ops.attn.flash_fwd_split(q, k, v, None, None, None, *args, None, 64)
    torch.ops.attn.flash_bwd(torch.ones_like(o), None, q, k, v, o, l, None, None, None, *args,
                             False)
    return seen


def test_triton_custom_ops_carry_every_spec_field(monkeypatch):
    from attn.spec import LaunchSpec

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for spec in _spec_values(LaunchSpec):
        assert _specs_the_ops_see(monkeypatch, spec, q, k, v) == [spec] * 3, spec


def test_triton_custom_ops_carry_a_new_spec_field(monkeypatch):
    """A field added to LaunchSpec (here by a subclass, as a new variant would add one)
    arrives with no edit to the ops."""
    import dataclasses

    from attn.spec import LaunchSpec

    @dataclasses.dataclass(frozen=True)
    class BiasSpec(LaunchSpec):
        score_bias: float = 0.0
        bias_heads: int | None = None

    monkeypatch.setattr(flash_triton.launch, "LaunchSpec", BiasSpec)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for spec in _spec_values(BiasSpec)[-3:]:
        assert _specs_the_ops_see(monkeypatch, spec, q, k, v) == [spec] * 3, spec


def test_triton_custom_ops_refuse_what_they_cannot_carry():
    import dataclasses

    from attn.spec import LaunchSpec

    launch = flash_triton.launch
    with pytest.raises(NotImplementedError, match="score_mod"):
        launch._op_args(LaunchSpec(qk_scale=1.0, score_mod=lambda s, b, h, i, j: s))

    @dataclasses.dataclass(frozen=True)
    class TableSpec(LaunchSpec):
        table: tuple = ()

    with pytest.raises(TypeError, match="'table'"):
        launch._op_args(TableSpec(qk_scale=1.0))


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        out = attn.attention(q, k, v, causal=True, sinks=self.sinks, softcap=20.0,
                             backend="triton")  # (B, H, N, C/H)
        return out.transpose(1, 2).reshape(B, N, C)


@pytest.mark.cuda_if_present
def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = _TinyAttention(32, 2).to(DEVICE)
    x = torch.randn(2, 40, 32, device=DEVICE)
    eager = model(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # aot_eager traces through the fake implementations and AOT autograd; inductor would
    # only add codegen around the opaque custom ops
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g)


# -- the toy-variant drill of docs/adding-a-variant.md -----------------------------------------
# A static score variant, score_bias = b added to every unmasked score, put in through its
# places (a term of the spec's ScoreTerms, the reference's keyword, the tiled score step, the
# triton score step), with nothing else patched: the resolver, backend choice, launchers,
# outer kernels, inner loops and custom ops carry it as they are. The public keyword and its
# check (api.py) would build the ScoreTerms this test hands to resolve; the oracle is the
# reference with the same bias as a score_mod. In the interpreter only: there a jit helper's
# globals are read when it runs, so a patched _scores reaches every caller.

_plain_scores = flash_triton.kernels._scores
_plain_score_args = flash_triton.kernels.score_args


def _score_args_with_bias(spec, *, softcap, alibi):
    """score_args with the drill's value and flag appended (its edit in kernels.py)."""
    args = _plain_score_args(spec, softcap=softcap, alibi=alibi)
    bias = spec.terms.get("score_bias", 0.0)
    return dict(SC=args["SC"] + (bias,), SCORE=args["SCORE"] + (bias != 0.0,))


@triton.jit
def _scores_with_bias(qk, om, on, MASK, cap, slope, SC, BAND, MASKED: tl.constexpr,
                      BANDED: tl.constexpr, MASK_KIND: tl.constexpr, SCORE: tl.constexpr):
    """_scores with the drill's stage (its edit in kernels._scores: ``if SCORE[_BIAS]: s = s
    + SC[_BIAS] * _LOG2E``, base-2 scores, before the masks; after them here, where a masked
    -inf stays -inf). Its places are the last of each bundle."""
    s, u, t = _plain_scores(qk, om, on, MASK, cap, slope, SC, BAND, MASKED, BANDED, MASK_KIND,
                            SCORE)
    if SCORE[len(SCORE) - 1]:
        s = s + SC[len(SC) - 1] * 1.4426950408889634
    return s, u, t


def _bias_mod(bias):
    return lambda s, b, h, i, j: s + bias


@pytest.mark.skipif(not flash_triton._INTERPRET, reason="patches jit helpers: interpreter only")
@pytest.mark.parametrize("split", [False, True], ids=["dense", "split_kv"])
def test_triton_toy_variant_drill(monkeypatch, split):
    from attn import call as call_mod
    from attn.masks import Band
    from attn.reference import reference_attention
    from attn.spec import ScoreTerms
    from attn.tiled import tile
    from attn.tiled.tile import LOG2E, _Tile

    plain_tile_scores = _Tile.scores

    def tile_scores(self, *args, **kwargs):  # the stage in attn/tiled/tile.py
        s, u, t = plain_tile_scores(self, *args, **kwargs)
        bias = self.spec.terms.get("score_bias", 0.0)
        return s.add_(bias * LOG2E), u, t  # base-2 units, after the masks

    def reference(*args, score_bias=0.0, **kwargs):  # the keyword in attn/reference.py
        return reference_attention(*args, **{**kwargs, "score_mod": _bias_mod(score_bias)})

    monkeypatch.setattr(tile, "SCORE_TERMS", ("score_bias",))
    monkeypatch.setattr(_Tile, "scores", tile_scores)
    monkeypatch.setattr(flash_triton.kernels, "SCORE_TERMS", ("score_bias",))
    monkeypatch.setattr(flash_triton.kernels, "score_args", _score_args_with_bias)
    monkeypatch.setattr(flash_triton.launch, "score_args", _score_args_with_bias)
    for mod in (flash_triton.kernels, flash_triton.paged):  # paged imports _scores by name
        monkeypatch.setattr(mod, "_scores", _scores_with_bias)
    monkeypatch.setattr(call_mod, "reference_attention", reference)
    if split:
        monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "2")

    bias = 0.5
    torch.manual_seed(0)
    Nq = 3 if split else 17
    q = torch.randn(1, 4, Nq, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 70, 16, dtype=torch.float64)
    v = torch.randn(1, 2, 70, 16, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)  # the bias then moves out, not only lse
    band = Band(70 - Nq, 40, 0)  # causal, a window of 40 keys
    ref = [t.requires_grad_() for t in (q, k, v)]
    out_r, lse_r = reference_attention(*ref, band=band, scale=0.25, sinks=sinks,
                                       score_mod=_bias_mod(bias))
    do = torch.randn_like(out_r)
    grads_r = torch.autograd.grad(out_r, ref, do)
    with torch.no_grad():  # the bias moves the lse by +0.5 where the sink is far
        plain = reference_attention(q, k, v, band=band, scale=0.25, sinks=sinks)[1]
        assert (lse_r - plain).abs().max() > 0.1

    for backend in ("reference", "tiled", "triton"):
        dtype = torch.float32 if backend == "triton" else torch.float64
        xs = [t.detach().to(dtype).requires_grad_(not split) for t in (q, k, v)]
        call, spec, ops = call_mod.resolve(*xs, band=band, scale=0.25, sinks=sinks.to(dtype),
                                           terms=ScoreTerms.of(score_bias=bias))
        assert call.terms == ("score_bias",) and spec.terms.get("score_bias") == bias
        for other in ("sdpa", "fused"):  # torch's kernels have no score step: refused
            with pytest.raises(NotImplementedError, match="score_bias"):
                call_mod.select_backend(call, other)
        assert call_mod.select_backend(call, backend).name == backend
        out, lse = call_mod.run(backend, *xs, spec, ops)
        tol = 2e-5 if backend == "triton" else 1e-10
        torch.testing.assert_close(out.double(), out_r.detach(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), lse_r.detach(), atol=tol, rtol=tol)
        if not split:
            for g, g_r in zip(torch.autograd.grad(out, xs, do.to(dtype)), grads_r):
                torch.testing.assert_close(g.double(), g_r, atol=10 * tol, rtol=10 * tol)


def test_a_score_term_no_backend_applies_is_refused_by_each():
    """A term no score step names: tiled raises before a tile runs, triton and torch's
    kernels are refused by select_backend, the reference by its keyword (TypeError)."""
    from attn import call as call_mod
    from attn.masks import Band
    from attn.spec import ScoreTerms

    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    call, spec, ops = call_mod.resolve(q, k, v, band=Band(), terms=ScoreTerms.of(zeta=1.0))
    with pytest.raises(NotImplementedError, match="zeta"):
        call_mod.run("tiled", q, k, v, spec, ops)
    for backend in ("triton", "sdpa", "fused"):
        with pytest.raises(NotImplementedError, match="zeta"):
            call_mod.select_backend(call, backend)
    with pytest.raises(TypeError, match="zeta"):
        call_mod.run("reference", q, k, v, spec, ops)
