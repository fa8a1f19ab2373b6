"""attn.flex: score_mod / mask_mod / block masks on the tiled backend, against the float64
reference (mods materialized densely), torch's own eager flex_attention, and gradcheck."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, and_masks, or_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

import attn
import attn.tiled
from attn.testing import assert_close_to_reference, make_inputs

NEG_INF = float("-inf")


def tiled(q, k, v, **kw):
    return attn.attention(q, k, v, **kw, backend="tiled")


@pytest.fixture
def small_tiles():
    """The tiled backend with tiles of 16 x 16, so that short sequences cross many tiles
    (empty, partial, full)."""
    return functools.partial(tiled, block_m=16, block_n=16)


# -- attention-gym's examples, as (score_mod, mask_mod) makers over captured tensors --------

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(w):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= w
    return mask


def prefix_lm(prefix_lengths):  # (B,): a bidirectional prefix per batch row, causal after
    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix_lengths[b]
    return or_masks(prefix, causal)


def document(doc_ids):  # (N,) sorted ids: causal inside each document
    def same_doc(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return and_masks(same_doc, causal)


def dilated(w, step):  # every step-th key within a window of w
    def mask(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d.abs() <= w) & (d % step == 0)
    return mask


def alibi(slopes):  # (H,) learnable
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


def tanh_softcap(cap):
    # the cap as a 0-d tensor: torch 2.15's flex_attention traces a captured Python float as a
    # SymFloat and then refuses it (attn's flex takes either)
    cap = torch.tensor(float(cap))

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


def relative_bias(table, n_k):  # (H, Nq + Nk - 1) learnable, indexed by q - kv
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + n_k - 1]
    return score_mod


def gym_case(name: str, B: int, H: int, Nq: int, Nk: int, dtype=torch.float64,
             grad: bool = True) -> tuple[dict, list[torch.Tensor]]:
    """The keywords of one attention-gym example and the learnable tensors it captures."""
    g = torch.Generator().manual_seed(7)
    if name == "causal":
        return {"mask_mod": causal}, []
    if name == "sliding_window":
        return {"mask_mod": sliding_window(9)}, []
    if name == "prefix_lm":
        return {"mask_mod": prefix_lm(torch.tensor([5, 23])[:B])}, []
    if name == "document":
        doc = torch.sort(torch.randint(0, 4, (max(Nq, Nk),), generator=g)).values
        return {"mask_mod": document(doc)}, []
    if name == "dilated":
        return {"mask_mod": dilated(20, 3)}, []
    if name == "alibi":
        slopes = (2.0 ** -torch.arange(1, H + 1, dtype=dtype)).requires_grad_(grad)
        return {"score_mod": alibi(slopes), "mask_mod": causal}, [slopes]
    if name == "softcap":
        return {"score_mod": tanh_softcap(2.0)}, []
    if name == "relative_bias":
        table = torch.randn(H, Nq + Nk - 1, generator=g, dtype=dtype).requires_grad_(grad)
        return {"score_mod": relative_bias(table, Nk)}, [table]
    raise KeyError(name)


GYM = ["causal", "sliding_window", "prefix_lm", "document", "dilated", "alibi", "softcap",
       "relative_bias"]


@pytest.mark.parametrize("name", GYM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gym_examples_match_reference(name, dtype, small_tiles):
    q, k, v = make_inputs(B=2, H=4, N=97, Nk=83, D=16, Hkv=2, dtype=dtype, seed=1)
    kw, _ = gym_case(name, 2, 4, 97, 83, dtype=torch.float32, grad=False)
    assert_close_to_reference(small_tiles, q, k, v, **kw)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document", "dilated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gym_masks_on_the_fused_backend(name, dtype):
    # torch's fused kernel per piece: the mask's empty tiles skipped, its full ones run
    # without a mask, its partial ones with the mask_mod evaluated there (16 x 16 tiles)
    q, k, v = make_inputs(B=2, H=4, N=97, Nk=83, D=16, Hkv=2, dtype=dtype, seed=1)
    kw, _ = gym_case(name, 2, 4, 97, 83, dtype=torch.float32, grad=False)
    fused = functools.partial(attn.attention, backend="fused", block_m=16, block_n=16)
    assert_close_to_reference(fused, q, k, v, **kw)
    # a torch BlockMask too: its own tiles
    bm = attn.create_block_mask(kw["mask_mod"], 2, 1, 97, 83, BLOCK_SIZE=32)
    assert_close_to_reference(lambda q, k, v, mask_mod, **a: attn.flex_attention(
        q, k, v, block_mask=bm, enable_gqa=True, backend="fused", return_lse=True), q, k, v,
        mask_mod=kw["mask_mod"])  # the reference applies the mask_mod; fused, the BlockMask


@pytest.mark.parametrize("name", ["alibi", "relative_bias"])
def test_captured_gradients_match_reference_and_repeat_bit_for_bit(name, small_tiles):
    """The captured table's gradient is within budget of the float64 one (3x plain fp32's
    error + a floor) and identical across runs (no atomics: tiles summed in a fixed order)."""
    q, k, v = make_inputs(B=2, H=4, N=61, Nk=70, D=16, dtype=torch.float32, seed=2)
    d_out = torch.randn(2, 4, 61, 16, generator=torch.Generator().manual_seed(3))

    def table_grad(backend, dtype):
        kw, (table,) = gym_case(name, 2, 4, 61, 70, dtype=dtype)
        out = attn.attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw, backend=backend,
                             block_m=16, block_n=16)
        (grad,) = torch.autograd.grad((out * d_out.to(dtype)).sum(), table)
        return grad.double()

    exact = table_grad("reference", torch.float64)
    plain = (table_grad("reference", torch.float32) - exact).abs().max().item()
    first = table_grad("tiled", torch.float32)
    err = (first - exact).abs().max().item()
    assert err <= 3 * plain + 1e-5 * max(1.0, exact.abs().max().item()), (err, plain)
    assert torch.equal(first, table_grad("tiled", torch.float32))


def test_gradcheck_mods_and_captured_tensors():
    """gradcheck (float64, finite differences) of q, k, v and both captured tensors through
    score_mod + mask_mod + softcap + sinks + GQA, tiles of 4 x 3 (empty, partial, full)."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Nq, Nk, D = 1, 2, 1, 9, 11, 3
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64).requires_grad_()
               for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    slopes = torch.rand(H, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(H, Nq + Nk - 1, generator=g, dtype=torch.float64).requires_grad_()
    sinks = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, slopes, table, sinks):
        def score_mod(s, b, h, qi, ki):
            return s + slopes[h] * (ki - qi) + table[h, qi - ki + Nk - 1]
        out, lse = attn.attention(q, k, v, score_mod=score_mod, mask_mod=dilated(6, 2),
                                  softcap=3.0, sinks=sinks, return_lse=True, backend="tiled",
                                  block_m=4, block_n=3)
        return out, lse
    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, table, sinks))


def test_order_of_operations(small_tiles):
    """scale/temperature → score_mod → softcap → masks (keywords AND mask_mod) → sinks, written
    out densely here; the reverse order of score_mod and softcap gives another answer."""
    q, k, v = make_inputs(B=1, H=2, N=40, Nk=50, D=8, dtype=torch.float64, seed=4)
    mask = torch.rand(40, 50, generator=torch.Generator().manual_seed(5)) > 0.2
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)

    def score_mod(s, b, h, qi, ki):
        return 3.0 * s + 0.25 * (h + 1)  # (h + 1) is an int tensor: 0.25 is exact in fp32
    kw = dict(scale=0.5, temperature=2.0, softcap=4.0, causal=True, window=(30, 0),
              attn_mask=mask, sinks=sinks, score_mod=score_mod, mask_mod=dilated(25, 2))
    out = small_tiles(q, k, v, **kw)

    s = q @ k.transpose(-1, -2) * 0.5 / 2.0
    s = 3.0 * s + 0.25 * torch.arange(1, 3, dtype=torch.float64).view(1, 2, 1, 1)
    s = 4.0 * torch.tanh(s / 4.0)
    i, j = torch.arange(40).view(-1, 1), torch.arange(50).view(1, -1)
    rel = j - (i + 10)
    keep = (rel <= 0) & (rel >= -30) & mask & dilated(25, 2)(0, 0, i, j)
    s = s.masked_fill(~keep, NEG_INF)
    e = torch.exp(s)
    expected = (e / (e.sum(-1, keepdim=True) + sinks.exp().view(1, 2, 1, 1))) @ v
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)

    def swapped(s, b, h, qi, ki):  # softcap inside, then the mod: not what attention does
        return score_mod(4.0 * torch.tanh(s / 4.0), b, h, qi, ki)
    other = small_tiles(q, k, v, **{**kw, "softcap": None, "score_mod": swapped})
    assert (other - expected).abs().max() > 1e-3


# -- torch's own flex_attention, eager on CPU (forward) -------------------------------------

@pytest.mark.parametrize("name", GYM)
def test_matches_torch_flex_attention_eager(name):
    B, H, N, D = 2, 4, 200, 16
    q, k, v = make_inputs(B=B, H=H, N=N, D=D, dtype=torch.float32, seed=6)
    kw, _ = gym_case(name, B, H, N, N, dtype=torch.float32, grad=False)
    block_mask = None
    if "mask_mod" in kw:
        block_mask = torch_create_block_mask(kw["mask_mod"], B, H, N, N, device="cpu",
                                             BLOCK_SIZE=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex is unfused
        want, want_aux = torch_flex_attention(q, k, v, score_mod=kw.get("score_mod"),
                                              block_mask=block_mask,
                                              return_aux=AuxRequest(lse=True))
    got, got_lse = attn.flex_attention(q, k, v, score_mod=kw.get("score_mod"),
                                       block_mask=block_mask, return_lse=True)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    finite = torch.isfinite(want_aux.lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    torch.testing.assert_close(got_lse[finite], want_aux.lse[finite], rtol=2e-5, atol=2e-5)


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= torch.tensor([4, 30, 70])[h]


@pytest.mark.parametrize("N,M,H,mask", [(256, 256, None, "document"), (200, 200, None, "document"),
                                        (200, 173, 3, "per_head_window")])
def test_create_block_mask_is_torchs(N, M, H, mask):
    """attn.create_block_mask returns torch's BlockMask with torch's classification (ragged
    edge tiles partial, per-head masks per head), and torch's flex_attention accepts it."""
    mask_mod = document(torch.arange(max(N, M)) // 50) if mask == "document" else per_head_window
    ours = attn.create_block_mask(mask_mod, 2, H, N, M, BLOCK_SIZE=64)
    theirs = torch_create_block_mask(mask_mod, 2, H, N, M, device="cpu", BLOCK_SIZE=64)
    assert isinstance(ours, BlockMask)
    assert ours.shape == theirs.shape and ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # every block visited
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    q, k, v = make_inputs(B=2, H=H or 2, N=N, Nk=M, D=8, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = torch_flex_attention(q, k, v, block_mask=ours)
    torch.testing.assert_close(attn.flex_attention(q, k, v, block_mask=theirs), want,
                               rtol=2e-5, atol=2e-5)


def test_flex_attention_keywords():
    """gqa, scale, return_aux, kernel_options (tile sizes), and the backward on CPU."""
    q, k, v = make_inputs(B=1, H=4, Hkv=2, N=96, D=8, dtype=torch.float64, seed=9)
    bm = attn.create_block_mask(causal, None, None, 96, 96, BLOCK_SIZE=32)
    q.requires_grad_()
    out, aux = attn.flex_attention(q, k, v, block_mask=bm, scale=0.3, enable_gqa=True,
                                   kernel_options={"BLOCK_M": 16, "BLOCK_N": 8, "other": 1},
                                   return_aux=AuxRequest(lse=True))
    ref, ref_lse = attn.attention(q, k, v, causal=True, scale=0.3, return_lse=True,
                                  backend="reference")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(aux.lse, ref_lse)
    (dq,) = torch.autograd.grad(out.sum(), q)
    (ref_dq,) = torch.autograd.grad(ref.sum(), q)
    torch.testing.assert_close(dq, ref_dq)


# -- tiles: empty ones are skipped, the mask_mod runs only in partial ones ------------------

def test_document_mask_skips_empty_tiles(monkeypatch):
    counts = {"tiles": 0, "mask": 0}
    step = attn.tiled.attention._fwd_tile

    def counting_step(*a):
        counts["tiles"] += 1
        return step(*a)
    monkeypatch.setattr(attn.tiled.attention, "_fwd_tile", counting_step)
    n_docs, bs = 8, 32
    N = n_docs * bs
    doc = torch.arange(N) // bs

    def same_doc(b, h, q_idx, kv_idx):
        counts["mask"] += q_idx.numel() > 1  # a tile, not the one-element type probe
        return doc[q_idx] == doc[kv_idx]
    block_mask = attn.create_block_mask(same_doc, None, None, N, N, BLOCK_SIZE=bs)
    counts["mask"] = 0
    q, k, v = make_inputs(B=1, H=2, N=N, D=8, seed=10)
    attn.flex_attention(q, k, v, block_mask=block_mask, backend="tiled")  # tiled's tiles
    assert counts == {"tiles": n_docs, "mask": 0}  # the diagonal only, all full

    # shifted documents: every diagonal tile straddles a boundary and evaluates the mask
    doc = (torch.arange(N) + bs // 2) // bs
    block_mask = attn.create_block_mask(same_doc, None, None, N, N, BLOCK_SIZE=bs)
    counts.update(tiles=0, mask=0)
    attn.flex_attention(q, k, v, block_mask=block_mask, backend="tiled")
    visited = int((block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).sum())
    assert counts["tiles"] == visited < (N // bs) ** 2
    assert counts["mask"] == int(block_mask.kv_num_blocks.sum()) > 0


def test_attention_mask_mod_classifies_its_own_tiles(small_tiles, monkeypatch):
    """attention(mask_mod=...) without a block mask evaluates the mask per tile to plan
    the tiles: a causal mask_mod visits what causal=True visits."""
    seen = []
    step = attn.tiled.attention._fwd_tile
    monkeypatch.setattr(attn.tiled.attention, "_fwd_tile", lambda *a: seen.append(1) or step(*a))
    q, k, v = make_inputs(B=1, H=1, N=64, D=8, seed=11)
    out = small_tiles(q, k, v, mask_mod=causal)
    n_mod, seen[:] = len(seen), []
    ref = small_tiles(q, k, v, causal=True)
    assert n_mod == len(seen) == 10  # 4 query blocks of 16: 1 + 2 + 3 + 4 tiles
    torch.testing.assert_close(out, ref)


def test_fully_masked_rows_give_zeros_and_finite_grads(small_tiles):
    q, k, v = make_inputs(B=1, H=2, N=40, D=8, dtype=torch.float64, seed=12)
    q.requires_grad_()

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx < 20) & (kv_idx <= q_idx)
    out, lse = small_tiles(q, k, v, mask_mod=mask_mod, score_mod=tanh_softcap(2.0),
                           return_lse=True)
    assert torch.equal(out[:, :, 20:], torch.zeros_like(out[:, :, 20:]))
    assert torch.isinf(lse[:, :, 20:]).all() and torch.isfinite(lse[:, :, :20]).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(dq).all() and torch.equal(dq[:, :, 20:], torch.zeros_like(dq[:, :, 20:]))


# -- choices and bad input ------------------------------------------------------------------

def test_backend_choice_with_mods():
    call = attn.AttentionCall(device="cuda", dtype=torch.float16, head_dim=64, head_dim_v=64,
                              n_q=128, n_k=128, score_mod=True)
    choice = attn.select_backend(call)
    assert choice.name == "tiled" and "score_mod" in choice.reason
    with pytest.raises(NotImplementedError, match="score_mod"):
        attn.select_backend(call, "triton")
    q, k, v = make_inputs(B=1, H=1, N=8, D=8)
    with pytest.raises(NotImplementedError, match="mask_mod"):
        attn.attention(q, k, v, mask_mod=causal, backend="sdpa")


def test_bad_input():
    q, k, v = make_inputs(B=1, H=2, N=64, D=8)
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        attn.attention(q, k, v, mask_mod=lambda b, h, i, j: (i >= j).float())
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        attn.create_block_mask(lambda b, h, i, j: i - j, None, None, 64, 64)
    with pytest.raises(ValueError, match="score_mod returned shape"):
        attn.attention(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :1, :1, None])
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attn.flex_attention(q, k, v, score_mod=3)
    bm = attn.create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="Q_LEN=64, KV_LEN=64.*Nq=32"):
        attn.flex_attention(q[:, :, :32], k, v, block_mask=bm)
    with pytest.raises(ValueError, match="must divide"):
        attn.flex_attention(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 24})
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        attn.create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=0)
    with pytest.raises(ValueError, match="enable_gqa"):
        attn.flex_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(TypeError, match="BlockMask"):
        attn.flex_attention(q, k, v, block_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        big = attn.create_block_mask(causal, 3, None, 64, 64, BLOCK_SIZE=32)
        attn.flex_attention(q, k, v, block_mask=big)


@pytest.mark.cuda_if_present
def test_create_block_mask_device_follows_captured_tensors():
    doc = torch.zeros(32, dtype=torch.long)
    bm = attn.create_block_mask(document(doc), None, None, 32, 32, BLOCK_SIZE=16)
    assert bm.kv_num_blocks.device == doc.device
    if torch.cuda.is_available():  # a device given wins over the captured tensors'

        bm = attn.create_block_mask(causal, None, None, 32, 32, device="cuda", BLOCK_SIZE=16)
        assert bm.kv_num_blocks.is_cuda


_GLOBAL_DOC = torch.tensor([0] * 20 + [1] * 12)


def _doc_mask_reading_a_global(b, h, q_idx, kv_idx):
    return _GLOBAL_DOC[q_idx] == _GLOBAL_DOC[kv_idx]


def test_create_block_mask_device_follows_tensors_read_through_globals_and_defaults():
    """The device comes from any tensor the mask_mod reads (a global, a default argument,
    a partial's keyword), as for the tensors whose gradient a mod carries; the default device
    (here meta, where nothing can be read) is only the fallback."""
    def with_default(b, h, q_idx, kv_idx, doc=_GLOBAL_DOC):
        return doc[q_idx] == doc[kv_idx]

    def with_keyword(b, h, q_idx, kv_idx, *, doc):
        return doc[q_idx] == doc[kv_idx]

    doc = _GLOBAL_DOC  # the same mask, its tensor held in a closure

    def in_closure(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    want = attn.create_block_mask(in_closure, None, None, 32, 32, BLOCK_SIZE=16)
    for mod in (_doc_mask_reading_a_global, with_default,
                functools.partial(with_keyword, doc=_GLOBAL_DOC)):
        torch.set_default_device("meta")
        try:
            bm = attn.create_block_mask(mod, None, None, 32, 32, BLOCK_SIZE=16)
        finally:
            torch.set_default_device(None)
        assert bm.kv_num_blocks.device == _GLOBAL_DOC.device
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(bm, name), getattr(want, name)), name


@pytest.mark.slow
@pytest.mark.parametrize("name", GYM)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Nq,Nk,D", [(1, 17, 16), (17, 1, 40), (128, 97, 64), (1025, 1025, 80)])
def test_gym_examples_wide(name, dtype, Nq, Nk, D):
    """The default tiles (256 x 256) over awkward lengths, every dtype, q/k/v gradients."""
    q, k, v = make_inputs(B=2, H=4, N=Nq, Nk=Nk, D=D, Hkv=1, dtype=dtype, seed=13)
    kw, _ = gym_case(name, 2, 4, Nq, Nk, dtype=torch.float32, grad=False)
    assert_close_to_reference(tiled, q, k, v, **kw)


def test_kernel_options_set_the_tiles_without_a_block_mask(monkeypatch):
    seen = []
    step = attn.tiled.attention._fwd_tile
    monkeypatch.setattr(attn.tiled.attention, "_fwd_tile", lambda *a: seen.append(1) or step(*a))
    q, k, v = make_inputs(B=1, H=2, N=64, D=8, dtype=torch.float64, seed=14)
    out = attn.flex_attention(q, k, v, score_mod=tanh_softcap(2.0),
                              kernel_options={"BLOCK_M": 32, "BLOCK_N": 16})
    assert len(seen) == 2 * 4
    torch.testing.assert_close(out, attn.attention(q, k, v, score_mod=tanh_softcap(2.0),
                                                   backend="reference"))
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        attn.flex_attention(q, k, v, kernel_options={"BLOCK_M": 0})


_BIAS_A = torch.tensor([0.25, -0.5, 1.0, 0.75], dtype=torch.float64, requires_grad=True)
_BIAS_B = torch.tensor([-1.0, 0.5, 0.125, 2.0], dtype=torch.float64, requires_grad=True)


def _bias_a():
    return _BIAS_A


def _bias_b():
    return _BIAS_B


def _score_mod_through_two_global_helpers(score, b, h, q_idx, kv_idx):
    return score + _bias_a()[kv_idx] + _bias_b()[kv_idx]


def test_a_score_mod_reading_tensors_through_two_global_helpers_gets_both_gradients():
    """Each helper's globals are walked as a temporary list; the walker must not take a freed
    list's id, reused by the next helper's list, for one it has seen (it found _BIAS_A only, and
    tiled gave _BIAS_B no gradient)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    grads = {}
    for backend in ("reference", "tiled"):
        _BIAS_A.grad = _BIAS_B.grad = None
        out = attn.attention(q, k, v, score_mod=_score_mod_through_two_global_helpers,
                             backend=backend)
        out.square().sum().backward()
        assert _BIAS_A.grad is not None and _BIAS_B.grad is not None, backend
        grads[backend] = (_BIAS_A.grad.clone(), _BIAS_B.grad.clone())
    for want, got in zip(grads["reference"], grads["tiled"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
