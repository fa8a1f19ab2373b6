"""Every fast backend against the float64 reference: lengths, head dims, variants, edge cases.

One suite, parametrized by backend: ``tiled`` with small tiles (16 x 32, so awkward sizes
cross many tile edges) and with its default tiles, and ``triton`` (the Triton interpreter on
CPU, compiled kernels on CUDA). A later path joins by adding an entry to ``BACKENDS``.

The default run is a covering set — every variant x {float32, bfloat16} with causal on, the
head layouts cycling over the variants, and non-causal, float64, float16 and MQA on the plain
and the everything-at-once cases (which holds every variant at once); ``-m slow`` runs the
full product (both causal values for every variant, every dtype and head layout).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial

import pytest
import torch

import attn
from attn.testing import assert_close_to_reference, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@dataclass(frozen=True)
class Backend:
    name: str
    kwargs: tuple  # keyword arguments of attn.attention that select it
    dtypes: tuple  # dtypes it computes

    def fn(self):
        return partial(attn.attention, **dict(self.kwargs))

    def skip_unless_available(self) -> None:
        if self.name.startswith("triton"):
            pytest.importorskip("triton")
            from attn import flash_triton

            if DEVICE == "cpu" and not flash_triton._INTERPRET:
                pytest.skip("attn.flash_triton was imported without TRITON_INTERPRET=1")


TILED = Backend("tiled", (("backend", "tiled"), ("block_m", 16), ("block_n", 32)),
                tuple(ALL_DTYPES))
TILED_DEFAULT = Backend("tiled-default", (("backend", "tiled"),), tuple(ALL_DTYPES))
TRITON = Backend("triton", (("backend", "triton"),),
                 (torch.float32, torch.bfloat16, torch.float16))
REFERENCE = Backend("reference", (("backend", "reference"),), tuple(ALL_DTYPES))
# torch's fused CPU kernel per block of attn's plan; 16-row query blocks, so awkward sizes
# cross many blocks and every kind of band piece (full, causal diagonal, masked strip) runs
FUSED = Backend("fused", (("backend", "fused"), ("block_m", 16)), tuple(ALL_DTYPES))
BACKENDS = [TILED, TRITON, FUSED]


def _fused_refuses(variant: str, dtype: torch.dtype, d: int = 32, dv: int = 32) -> bool:
    """What the fused backend's allow-list leaves to tiled (attn.fused.call_reason): score
    transforms, attn's dropout, a float mask's gradient, ALiBi in 16 bits, Dv != D."""
    if variant.startswith("softcap") or variant in ("dropout", "float_mask_grad",
                                                    "alibi_softcap", "everything"):
        return True
    if variant.startswith("alibi") and dtype in (torch.float16, torch.bfloat16):
        return True
    return dv != d


def _ids(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, Backend):
        return x.name
    return None


def _inputs(**kw):
    return make_inputs(device=DEVICE, **kw)


def _cases(backends, dtypes, *axes):
    """The product of backends x dtypes x axes, keeping each backend's own dtypes."""
    return [(b, d, *rest) for b, d, *rest in itertools.product(backends, dtypes, *axes)
            if d in b.dtypes]


# -- lengths and head dims ------------------------------------------------------------------------

LENGTHS = [(1, 1), (17, 17), (97, 97), (128, 128), (17, 97), (97, 17), (1, 128), (128, 1)]


def _length_cases(full: bool):
    # the interpreter is slow: triton's float16 lengths run under -m slow (float16 on plain
    # and everything-at-once stays in the default variant set)
    return [(b, d, c, nq, nk) for b, d, c, (nq, nk) in itertools.product(
        [TILED, TILED_DEFAULT, TRITON, FUSED], ALL_DTYPES, [False, True], LENGTHS)
        if d in b.dtypes and (full or b is not TRITON or d != torch.float16)]


@pytest.mark.cuda_if_present
@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype,causal,nq,nk",
                         [c for c in _length_cases(True) if c not in _length_cases(False)],
                         ids=_ids)
def test_lengths_full(backend, dtype, causal, nq, nk):
    test_lengths(backend, dtype, causal, nq, nk)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend,dtype,causal,nq,nk", _length_cases(False), ids=_ids)
def test_lengths(backend, dtype, causal, nq, nk):
    backend.skip_unless_available()
    q, k, v = _inputs(B=1, H=2, N=nq, Nk=nk, D=32, dtype=dtype, seed=nq * 1000 + nk)
    assert_close_to_reference(backend.fn(), q, k, v, causal=causal)


HEAD_DIMS = [(16, 16), (40, 40), (64, 64), (80, 80), (128, 128), (256, 256), (64, 40)]


def _head_dim_cases(full: bool):
    if full:
        return _cases(BACKENDS, ALL_DTYPES, [False, True], HEAD_DIMS)
    # fp32 and bf16, causal alternating over the dims
    return [(b, d, i % 2 == 1, dims) for b, d, (i, dims) in
            itertools.product(BACKENDS, [torch.float32, torch.bfloat16], enumerate(HEAD_DIMS))]


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend,dtype,causal,dims", _head_dim_cases(False), ids=_ids)
def test_head_dims(backend, dtype, causal, dims):
    backend.skip_unless_available()
    d, dv = dims  # 40 and 80 are not powers of two; Dv != D
    q, k, v = _inputs(B=1, H=1, N=33, Nk=40, D=d, Dv=dv, dtype=dtype, seed=d)
    if backend is FUSED and _fused_refuses("plain", dtype, d, dv):
        with pytest.raises(NotImplementedError, match="fused"):
            backend.fn()(q, k, v, causal=causal)
        return
    assert_close_to_reference(backend.fn(), q, k, v, causal=causal)


@pytest.mark.cuda_if_present
@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype,causal,dims", _head_dim_cases(True), ids=_ids)
def test_head_dims_full(backend, dtype, causal, dims):
    test_head_dims(backend, dtype, causal, dims)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend,dtype,causal", [
    (b, d, c) for b, d, c in itertools.product([TILED_DEFAULT], [torch.float32, torch.bfloat16],
                                               [False, True])], ids=_ids)
def test_long_sequence(backend, dtype, causal):
    q, k, v = _inputs(B=1, H=2, N=1025, D=64, dtype=dtype, seed=3)
    assert_close_to_reference(backend.fn(), q, k, v, causal=causal)


# -- variants ---------------------------------------------------------------------------------------

def alibi_slopes(H: int) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8h/H), h = 1..H (Press et al. 2022), float32."""
    return 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)


def _variant_kwargs(name: str, H: int, nq: int, nk: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(7)

    def dev(t):
        return t.to(DEVICE)

    if name == "plain":
        return {}
    if name == "softcap":
        return {"softcap": 2.0}
    if name == "softcap_learned":
        return {"softcap": dev(torch.tensor(3.0)).requires_grad_()}
    if name == "softcap_per_head":
        return {"softcap": dev(torch.rand(H, generator=g) * 4 + 1).requires_grad_()}
    if name == "sinks":
        return {"sinks": dev(torch.randn(H, generator=g)).requires_grad_()}
    if name == "window":
        return {"window": (7, 3)}
    if name == "window_left":
        return {"window": (12, -1)}
    if name == "temperature":
        return {"temperature": 0.7}
    if name == "temperature_tensor":
        return {"temperature": dev(torch.rand(H, generator=g) + 0.5).requires_grad_()}
    if name == "temperature_bh":
        return {"temperature": dev(torch.rand(2, H, generator=g) + 0.5).requires_grad_()}
    if name == "scale":
        return {"scale": 0.3}
    if name == "bool_mask":
        return {"attn_mask": dev(torch.rand(2, 1, nq, nk, generator=g) > 0.3)}
    if name == "padding_mask":
        m = torch.ones(2, 1, 1, nk, dtype=torch.bool)
        m[1, ..., nk // 2:] = False
        return {"attn_mask": dev(m)}
    if name == "float_mask":
        return {"attn_mask": dev(torch.randn(nq, nk, generator=g).to(dtype))}
    if name == "float_mask_grad":
        return {"attn_mask": dev(torch.randn(H, 1, nk, generator=g).to(dtype)).requires_grad_()}
    if name == "dropout":
        return {"dropout_p": 0.25}
    if name == "alibi":
        return {"alibi_slopes": dev(alibi_slopes(H))}
    if name == "alibi_bh":  # per (batch, head); powers of two, exact in every dtype
        return {"alibi_slopes": dev(2.0 ** -torch.randint(0, 9, (2, H), generator=g).float())}
    if name == "alibi_softcap":  # the bias after the cap: a cap of 2 would clip it
        return {"alibi_slopes": dev(alibi_slopes(H)),
                "softcap": dev(torch.rand(H, generator=g) + 1.5).requires_grad_()}
    if name == "alibi_window":
        return {"alibi_slopes": dev(alibi_slopes(H)), "window": (9, 4)}
    if name == "everything":
        return {"softcap": dev(torch.tensor(4.0)).requires_grad_(),
                "sinks": dev(torch.randn(H, generator=g)).requires_grad_(),
                "window": (20, 5),
                "temperature": dev(torch.rand(H, generator=g) + 0.5).requires_grad_(),
                "attn_mask": dev(torch.rand(nq, nk, generator=g) > 0.2),
                "dropout_p": 0.1}
    raise KeyError(name)


VARIANTS = ["plain", "softcap", "softcap_learned", "softcap_per_head", "sinks", "window",
            "window_left", "temperature", "temperature_tensor", "temperature_bh", "scale",
            "bool_mask", "padding_mask", "float_mask", "float_mask_grad", "dropout", "alibi",
            "alibi_bh", "alibi_softcap", "alibi_window", "everything"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# what a backend refuses (and must say so) instead of computing
REFUSED = {("triton", "float_mask_grad")}


def _variant_cases(full: bool):
    if full:
        return _cases(BACKENDS, ALL_DTYPES, [False, True], VARIANTS, list(HEADS))
    # every variant x {float32, bfloat16}, causal; head layouts cycle over the variants (the
    # interpreter pays per kv head, so triton cycles the grouped ones: its MHA runs in
    # test_gqa_groups and under -m slow)
    layouts = {"triton": ["gqa", "mqa"]}
    cases = []
    for b, d, (i, name) in itertools.product(BACKENDS, [torch.float32, torch.bfloat16],
                                             enumerate(VARIANTS)):
        cycle = layouts.get(b.name, list(HEADS))
        cases.append((b, d, True, name, cycle[i % len(cycle)]))
    # not causal, float64 / float16 and MQA: on the plain and the everything-at-once cases
    for b, name in itertools.product(BACKENDS, ["plain", "everything"]):
        cases += [(b, d, False, name, "gqa") for d in (torch.float32, torch.bfloat16)]
        cases += [(b, d, True, name, "gqa") for d in (torch.float64, torch.float16)
                  if d in b.dtypes]
        cases += [(b, torch.float32, c, name, "mqa") for c in (False, True)]
    return cases


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend,dtype,causal,variant,heads", _variant_cases(False), ids=_ids)
def test_variants(backend, dtype, causal, variant, heads):
    backend.skip_unless_available()
    H, Hkv = HEADS[heads]
    nq, nk = 45, 70
    q, k, v = _inputs(B=2, H=H, Hkv=Hkv, N=nq, Nk=nk, D=32, dtype=dtype, seed=11)
    kwargs = _variant_kwargs(variant, H, nq, nk, dtype)
    if (backend.name, variant) in REFUSED or (backend is FUSED
                                              and _fused_refuses(variant, dtype)):
        with pytest.raises(NotImplementedError, match=backend.name):
            backend.fn()(q, k, v, causal=causal, **kwargs)
        return
    assert_close_to_reference(backend.fn(), q, k, v, causal=causal, **kwargs)


@pytest.mark.cuda_if_present
@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype,causal,variant,heads", _variant_cases(True), ids=_ids)
def test_variants_full(backend, dtype, causal, variant, heads):
    test_variants(backend, dtype, causal, variant, heads)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", BACKENDS, ids=_ids)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa", "mqa", "gqa3"])
def test_gqa_groups(backend, heads):
    backend.skip_unless_available()
    H, Hkv = heads
    q, k, v = _inputs(B=2, H=H, Hkv=Hkv, N=40, Nk=50, D=16, dtype=torch.float32, seed=H * Hkv)
    sinks = torch.randn(H, device=DEVICE).requires_grad_()
    softcap = {} if backend is FUSED else {"softcap": 5.0}  # fused has no score transform
    assert_close_to_reference(backend.fn(), q, k, v, causal=True, sinks=sinks, **softcap)


# -- edge cases ------------------------------------------------------------------------------------

@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", [REFERENCE, TILED, TILED_DEFAULT, TRITON, FUSED], ids=_ids)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(backend, with_sinks):
    backend.skip_unless_available()
    fn = backend.fn()
    q, k, v = (t.requires_grad_() for t in _inputs(B=1, H=2, N=40, Nk=24, D=16, seed=2))
    mask = torch.ones(40, 24, dtype=torch.bool, device=DEVICE)
    mask[30] = False  # row 30 sees nothing through the mask
    sinks = torch.tensor([0.5, -1.0], device=DEVICE).requires_grad_() if with_sinks else None
    # causal bottom-right with Nq > Nk: rows 0..15 see no key either
    out, lse = fn(q, k, v, causal=True, attn_mask=mask, sinks=sinks, return_lse=True)
    dead = torch.zeros(40, dtype=torch.bool, device=DEVICE)
    dead[:16] = True
    dead[30] = True
    n_dead = int(dead.sum())
    assert torch.isfinite(out).all()
    assert (out[:, :, dead] == 0).all()
    expect = (sinks.detach().view(2, 1).expand(2, n_dead) if with_sinks
              else torch.full((2, n_dead), float("-inf"), device=DEVICE))
    assert torch.equal(lse[0][:, dead], expect)
    assert torch.isfinite(lse[:, :, ~dead]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (q, k, v) + ((sinks,) if with_sinks else ()):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, dead] == 0).all()
    assert_close_to_reference(fn, q.detach(), k.detach(), v.detach(), causal=True,
                              attn_mask=mask, sinks=sinks)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend,dtype", _cases([TILED, TILED_DEFAULT, TRITON, FUSED],
                                                  [torch.float32, torch.bfloat16]), ids=_ids)
def test_huge_logits(backend, dtype):
    backend.skip_unless_available()
    # scores of about 1e4: exp overflows anything that does not subtract the running max
    q, k, v = _inputs(B=1, H=2, N=65, D=16, dtype=dtype, seed=9)
    out = backend.fn()(q, k, v, scale=1e4 / 16)
    assert torch.isfinite(out).all()
    assert_close_to_reference(backend.fn(), q, k, v, scale=1e4 / 16, causal=True)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", BACKENDS, ids=_ids)
def test_single_query_single_key(backend):
    backend.skip_unless_available()
    q, k, v = _inputs(B=2, H=3, N=1, D=16, seed=1)
    out, lse = backend.fn()(q, k, v, return_lse=True)
    torch.testing.assert_close(out, v)  # softmax over one key is 1
    torch.testing.assert_close(lse, (q * k).sum(-1) * 16 ** -0.5)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", BACKENDS, ids=_ids)
@pytest.mark.parametrize("temperature", [1e-3, 1e3])
def test_temperature_limits(backend, temperature):
    backend.skip_unless_available()
    q, k, v = _inputs(B=1, H=2, N=17, Nk=23, D=16, dtype=torch.float32, seed=6)
    assert_close_to_reference(backend.fn(), q, k, v, temperature=temperature)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", BACKENDS, ids=_ids)
def test_non_contiguous_inputs(backend):
    backend.skip_unless_available()
    # (B, N, H, D) storage seen as (B, H, N, D), a v whose head dim is strided, and a mask
    # with stride-0 columns
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 37, 4, 32, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 45, 2, 32, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 2, 45, 64, generator=g).to(DEVICE)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    mask = torch.rand(37, 1, generator=g).to(DEVICE).expand(37, 45) > 0.1
    assert_close_to_reference(backend.fn(), q, k, v, causal=True, attn_mask=mask)


# -- ALiBi --------------------------------------------------------------------------------------

def _naive_alibi(q, k, v, slopes, *, causal, softcap=None):
    """ALiBi by explicit loops over (b, h, i), float64: the bias −slope·|i + Nk − Nq − j|
    written out key by key, independent of attn.reference's broadcast form."""
    B, H, Nq, D = q.shape
    Nk, G = k.shape[2], H // k.shape[1]
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=torch.float64)
    for b, h, i in itertools.product(range(B), range(H), range(Nq)):
        slope = float(slopes[b, h] if slopes.dim() == 2 else slopes[h])
        s = []
        for j in range(Nk):
            x = float(q[b, h, i] @ k[b, h // G, j]) / D ** 0.5
            if softcap is not None:
                x = softcap * math.tanh(x / softcap)
            x -= slope * abs(i + Nk - Nq - j)
            s.append(x if not causal or j <= i + Nk - Nq else float("-inf"))
        p = torch.softmax(torch.tensor(s, dtype=torch.float64), 0)
        out[b, h, i] = p @ v[b, h // G].double()
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(3, 5), (5, 3), (4, 4)])
def test_alibi_reference_equals_naive_loops(causal, nq, nk):
    q, k, v = make_inputs(B=2, H=4, Hkv=2, N=nq, Nk=nk, D=8, dtype=torch.float64, seed=nq)
    slopes = torch.tensor([[0.5, 0.25, 1.0, 0.125], [2.0, 0.3, 0.0, 0.7]])
    for sl, cap in ((slopes, None), (slopes[1], 1.5)):
        out = attn.attention(q, k, v, causal=causal, alibi_slopes=sl, softcap=cap,
                             backend="reference")
        want = _naive_alibi(q, k, v, sl, causal=causal, softcap=cap)
        if causal and nq > nk:  # rows above the bottom-right diagonal see nothing: zeros
            want[:, :, :nq - nk] = 0.0
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("backend", BACKENDS, ids=_ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(45, 70), (70, 45)])
def test_alibi_lengths(backend, causal, nq, nk):
    """Nq ≠ Nk both ways: the bias is aligned bottom-right, like the causal band."""
    backend.skip_unless_available()
    q, k, v = _inputs(B=2, H=4, Hkv=2, N=nq, Nk=nk, D=16, dtype=torch.float32, seed=nq)
    assert_close_to_reference(backend.fn(), q, k, v, causal=causal,
                              alibi_slopes=alibi_slopes(4).to(DEVICE))


@pytest.mark.cuda_if_present
def test_alibi_changes_the_output():
    """The check above can fail: the bias moves the output well past any budget."""
    q, k, v = _inputs(B=1, H=4, N=40, D=16, dtype=torch.float32, seed=4)
    plain = attn.attention(q, k, v, backend="tiled")
    with_alibi = attn.attention(q, k, v, alibi_slopes=alibi_slopes(4).to(DEVICE),
                                backend="tiled")
    assert (plain - with_alibi).abs().max() > 0.1


@pytest.mark.cuda_if_present
def test_alibi_tiled_shards_reproduce_the_whole():
    """The tiled launcher measures distances in global positions: query and key shards
    (spec.shard) merged by their lse equal one call."""
    from attn import tiled
    from attn.masks import make_band
    from attn.merge import merge_attention
    from attn.spec import LaunchSpec, Operands

    q, k, v = _inputs(B=2, H=4, Hkv=2, N=37, Nk=50, D=16, dtype=torch.float64, seed=8)
    slopes = alibi_slopes(4).to(DEVICE).expand(2, 4)
    spec = LaunchSpec(qk_scale=0.25, band=make_band(37, 50, causal=True, window=None),
                      block_m=8, block_n=16)
    whole, whole_lse = tiled._fwd(q, k, v, spec, Operands(alibi=slopes))
    rows = []
    for q0, q1 in ((0, 20), (20, 37)):
        parts = [tiled._fwd(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                            spec.shard(q_start=q0, k_start=k0), Operands(alibi=slopes))
                 for k0, k1 in ((0, 30), (30, 50))]
        rows.append(merge_attention(parts[0][0], parts[0][1], parts[1][0], parts[1][1]))
    torch.testing.assert_close(torch.cat([r[0] for r in rows], 2), whole)
    torch.testing.assert_close(torch.cat([r[1] for r in rows], 2), whole_lse)
