"""attn.varlen: packed sequences equal attention run sequence by sequence, forward and
backward, for every variant; tiles between sequences are skipped; converters; bad input."""

from __future__ import annotations

import functools
import re

import pytest
import torch

import attn
import attn.testing
import attn.tiled
from attn import varlen
from attn.varlen import cu_seqlens_from_lengths, varlen_attention


def tiles(monkeypatch, block_m: int, block_n: int) -> None:
    """The tiled backend's calls from attn's entry points get tiles of block_m x block_n
    (varlen_attention has no tile-size argument: the config is bound on
    attn.tiled.tiled_attention, which attn.call.run calls)."""
    config = attn.tiled.TileConfig(block_m=block_m, block_n=block_n)
    monkeypatch.setattr(attn.tiled, "tiled_attention",
                        functools.partial(attn.tiled.tiled_attention, config=config))


@pytest.fixture
def small_tiles(monkeypatch):
    tiles(monkeypatch, 8, 8)


def packed_inputs(lq, lk, H=4, Hkv=2, D=8, Dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = int(sum(lq)), int(sum(lk))
    q = torch.randn(tq, H, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(tk, Hkv, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(tk, Hkv, Dv or D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v, cu_seqlens_from_lengths(torch.tensor(lq)), cu_seqlens_from_lengths(
        torch.tensor(lk))


def random_lengths(n, seed, hi=30):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, hi, (n,), generator=g)
    lengths[0], lengths[1] = 0, 1  # always one empty and one single-token sequence
    return lengths[torch.randperm(n, generator=g)].tolist()


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (4, 2)},
    "causal_window": {"causal": True, "window": (3, -1)},
    "softcap": {"softcap": 1.5, "causal": True},
    "learned": {"softcap": "tensor", "sinks": "tensor", "temperature": "tensor"},
    "scale": {"scale": 0.7},
}


def variant_kwargs(name, H, dtype):
    g = torch.Generator().manual_seed(3)
    kw = dict(VARIANTS[name])
    for key, shape in (("softcap", (H,)), ("sinks", (H,)), ("temperature", (H,))):
        if kw.get(key) == "tensor":
            t = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
            kw[key] = t.to(dtype).requires_grad_()
    return kw


@pytest.mark.parametrize("variant, backend", [(name, "tiled") for name in VARIANTS] + [
    ("causal_window", "reference"), ("learned", "reference")])
def test_equals_attention_per_sequence(variant, backend, small_tiles):
    """Forward, lse and every gradient (q, k, v, learnable variant tensors) of the packed
    call equal the per-sequence calls; lengths random, Nq != Nk per sequence, 0 and 1
    included (a query sequence whose keys are empty gives zeros and lse -inf)."""
    n = 6
    lq, lk = random_lengths(n, seed=1), random_lengths(n, seed=2)
    q, k, v, cu_q, cu_k = packed_inputs(lq, lk)
    kw = variant_kwargs(variant, 4, torch.float64)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True,
                                backend=backend, **kw)
    assert out.shape == (sum(lq), 4, 8) and lse.shape == (4, sum(lq))
    g = torch.Generator().manual_seed(4)
    d_out, d_lse = torch.randn(out.shape, generator=g, dtype=torch.float64), torch.randn(
        lse.shape, generator=g, dtype=torch.float64)
    learn = [q, k, v] + [t for t in kw.values() if isinstance(t, torch.Tensor)]
    loss = (out * d_out).sum() + torch.where(torch.isfinite(lse), lse * d_lse, 0.0).sum()
    grads = torch.autograd.grad(loss, learn)

    # the same, one sequence at a time, through attn.attention
    outs, lses = [], []
    for b in range(n):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        if lq[b] == 0:
            continue
        if lk[b] == 0:  # no key: attn.attention refuses empty k, the answer is zeros / -inf
            sink = kw.get("sinks")
            outs.append(torch.zeros(lq[b], 4, 8, dtype=torch.float64))
            lses.append(torch.full((4, lq[b]), float("-inf"), dtype=torch.float64)
                        if sink is None else sink[:, None].expand(4, lq[b]))
            continue
        o, l_ = attn.attention(*(t.transpose(0, 1)[None] for t in (qs, ks, vs)),
                               return_lse=True, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l_[0])
    out_ref, lse_ref = torch.cat(outs), torch.cat(lses, dim=1)
    loss_ref = (out_ref * d_out).sum() + torch.where(
        torch.isfinite(lse_ref), lse_ref * d_lse, 0.0).sum()
    grads_ref = torch.autograd.grad(loss_ref, learn)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    for name, got, want in zip(["q", "k", "v", *kw], grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("per_seq", [False, True], ids=["slopes_h", "slopes_seq_h"])
@pytest.mark.parametrize("kw", [{}, {"causal": True, "softcap": 1.5}, {"window": (4, 2)}],
                         ids=["plain", "causal_softcap", "window"])
def test_alibi_equals_attention_per_sequence(kw, per_seq, small_tiles):
    """ALiBi in each sequence's own positions (bottom-right per sequence, Nq != Nk) with
    each sequence's slopes: out, lse and dq, dk, dv equal attn.attention per sequence."""
    n = 5
    lq, lk = random_lengths(n, seed=7), random_lengths(n, seed=8)
    q, k, v, cu_q, cu_k = packed_inputs(lq, lk)
    g = torch.Generator().manual_seed(9)
    slopes = torch.rand(n, 4, generator=g) if per_seq else torch.rand(4, generator=g)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, alibi_slopes=slopes, **kw)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    for b in range(n):
        if lq[b] == 0 or lk[b] == 0:
            continue
        qs, ks, vs = (t[cu[b]:cu[b + 1]].transpose(0, 1)[None]
                      for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        o, l_ = attn.attention(qs, ks, vs, return_lse=True,
                               alibi_slopes=slopes[b] if per_seq else slopes, **kw)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], o[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, cu_q[b]:cu_q[b + 1]], l_[0])
        want = torch.autograd.grad((o[0].transpose(0, 1) * d_out[cu_q[b]:cu_q[b + 1]]).sum(),
                                   (qs, ks, vs))
        for name, got, w, cu in zip("qkv", grads, want, (cu_q, cu_k, cu_k)):
            torch.testing.assert_close(got[cu[b]:cu[b + 1]], w[0].transpose(0, 1), msg=name)


def test_alibi_bad_slopes():
    q, k, v, cu, _ = packed_inputs([3, 4], [3, 4])
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(H,\) = \(4,\) or "
                                         r"\(num_seqs, H\) = \(2, 4\), got \(3, 4\)"):
        varlen_attention(q, k, v, cu, cu, alibi_slopes=torch.ones(3, 4))
    with pytest.raises(ValueError, match="no gradient flows"):
        varlen_attention(q, k, v, cu, cu, alibi_slopes=torch.ones(4, requires_grad=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_budget(dtype, small_tiles):
    """In fp32 / bf16 the packed output is within 2x plain PyTorch's error (the reference
    on the same document mask in that dtype) of the float64 answer."""
    lq = random_lengths(5, seed=5)
    q, k, v, cu_q, _ = packed_inputs(lq, lq, dtype=torch.float64, seed=6)
    doc_mask = varlen._DocMask(cu_q, cu_q, sum(lq), sum(lq), attn.masks.make_band(
        0, 0, causal=True, window=None))

    def dense(dt, backend):
        q4, k4, v4 = (t.detach().to(dt).transpose(0, 1)[None] for t in (q, k, v))
        return attn.attention(q4, k4, v4, mask_mod=doc_mask, backend=backend)[0].double()
    exact = dense(torch.float64, "reference")
    plain = (dense(dtype, "reference") - exact).abs().max().item()
    got = varlen_attention(q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype),
                           cu_q, cu_q, causal=True).double().transpose(0, 1)
    err = (got - exact).abs().max().item()
    assert err <= 2 * plain + attn.testing._FLOOR[dtype] * max(1.0, exact.abs().max().item())


def test_dropout_draws_the_padded_batchs_mask(small_tiles):
    """With one seed, packed dropout equals dropout on the padded batch (sequence b as row
    b, positions inside it; lengths 0 and 1 included), forward and backward, and the
    reference backend draws the same mask."""
    lengths = torch.tensor(random_lengths(5, seed=7, hi=20))
    N = int(lengths.max())
    q, k, v, cu, _ = packed_inputs(lengths.tolist(), lengths.tolist(), seed=8)
    mask = torch.arange(N)[None, :] < lengths[:, None]
    g = torch.Generator().manual_seed(9)
    d_out = torch.randn(q.shape, generator=g, dtype=torch.float64)

    def run(packed: bool, backend: str = "auto"):
        torch.manual_seed(0)  # the seed is drawn from torch's generator
        if packed:
            out = varlen_attention(q, k, v, cu, cu, causal=True, dropout_p=0.3,
                                   backend=backend)
        else:
            qp, kp, vp = (varlen.unpack(t, mask).transpose(1, 2) for t in (q, k, v))
            out = attn.attention(qp, kp, vp, causal=True, dropout_p=0.3,
                                 attn_mask=attn.masks.key_padding_mask(lengths, N))
            out = out.transpose(1, 2)[mask]
        return out, torch.autograd.grad((out * d_out).sum(), (q, k, v))
    out, grads = run(True)
    for other, other_grads in (run(False), run(True, "reference")):
        torch.testing.assert_close(out, other, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, other_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.manual_seed(1)
    other_seed = varlen_attention(q, k, v, cu, cu, causal=True, dropout_p=0.3)
    assert (other_seed - out).abs().max() > 0.1  # the mask follows the seed


def test_gradcheck(monkeypatch):
    tiles(monkeypatch, 3, 4)
    q, k, v, cu_q, cu_k = packed_inputs([3, 0, 5, 1], [4, 2, 3, 1], H=2, Hkv=1, D=3)
    sinks = torch.randn(2, dtype=torch.float64).requires_grad_()

    def fn(q, k, v, sinks):
        return varlen_attention(q, k, v, cu_q, cu_k, causal=True, softcap=2.0, sinks=sinks,
                                return_lse=True)
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_tiles_between_sequences_are_skipped(small_tiles, monkeypatch):
    """Eight sequences of two tiles each: only the 8 x 2 x 2 tiles inside a sequence run,
    all on the plain path (no mask work); causal drops the upper tile of each square."""
    tiles, masks = [], []
    step = attn.tiled.attention._fwd_tile
    monkeypatch.setattr(attn.tiled.attention, "_fwd_tile", lambda *a: tiles.append(1) or step(*a))
    keep = attn.tiled._Tile.mask_mod_keep
    monkeypatch.setattr(attn.tiled._Tile, "mask_mod_keep",
                        lambda self, *a: masks.append(1) or keep(self, *a))
    q, k, v, cu, _ = packed_inputs([16] * 8, [16] * 8, H=2, Hkv=2, seed=9)
    varlen_attention(q, k, v, cu, cu, backend="tiled")  # tiled's plan (auto may take fused)
    assert (len(tiles), len(masks)) == (8 * 4, 0)
    tiles.clear()
    varlen_attention(q, k, v, cu, cu, causal=True, backend="tiled")
    assert (len(tiles), len(masks)) == (8 * 3, 8 * 2)  # diagonal tiles are partial


def test_converters():
    lengths = torch.tensor([3, 0, 2, 4])
    cu = cu_seqlens_from_lengths(lengths)
    assert cu.tolist() == [0, 3, 3, 5, 9] and cu.dtype == torch.int32
    assert varlen.document_ids(cu).tolist() == [0, 0, 0, 2, 2, 3, 3, 3, 3]
    assert varlen.position_ids(cu).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert torch.equal(varlen.cu_seqlens_from_document_ids(varlen.document_ids(cu), 4), cu)
    no_empty = cu_seqlens_from_lengths(torch.tensor([3, 2, 4]))
    assert torch.equal(varlen.cu_seqlens_from_position_ids(varlen.position_ids(cu)), no_empty)

    mask = torch.tensor([[True, True, False], [False, False, False], [True, True, True]])
    x = torch.randn(3, 3, 5)
    packed, cu2, max_len = varlen.pack(x, mask)
    assert cu2.tolist() == [0, 2, 2, 5] and max_len == 3 and packed.shape == (5, 5)
    back = varlen.unpack(packed, mask)
    assert torch.equal(back[mask], x[mask]) and bool((back[~mask] == 0).all())


def test_converters_refuse_bad_offsets_and_ids():
    """Bad document ids and offsets raise naming the argument (and showing the offsets)
    instead of returning ids or offsets of some other packing."""
    with pytest.raises(ValueError, match=r"doc must hold ids >= 0, got -1 at position 0"):
        varlen.cu_seqlens_from_document_ids(torch.tensor([-1, -1, 0, 1]))
    with pytest.raises(ValueError, match=r"doc must hold at least one id, got shape \(0,\)"):
        varlen.cu_seqlens_from_document_ids(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match=r"doc holds id 3, num_docs=3"):
        varlen.cu_seqlens_from_document_ids(torch.tensor([0, 1, 3]), 3)
    with pytest.raises(TypeError, match=r"doc must hold integer ids, got torch.float32"):
        varlen.cu_seqlens_from_document_ids(torch.tensor([0.0, 1.0]))
    bad = {
        "must not decrease (a sequence may be empty)": torch.tensor([0, 5, 3, 9]),
        "must start at 0": torch.tensor([2, 5, 9]),
    }
    for fn in (varlen.document_ids, varlen.position_ids):
        for what, cu in bad.items():
            with pytest.raises(ValueError, match=re.escape(
                    f"cu_seqlens {what}, got cu_seqlens = {cu.tolist()}")):
                fn(cu)
        with pytest.raises(ValueError, match=re.escape(
                "cu_seqlens must end at total=8, got cu_seqlens = [0, 3, 9]")):
            fn(torch.tensor([0, 3, 9]), 8)
        with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
            fn(torch.tensor([0.0, 3.0]))


def test_packed_equals_padded_with_key_padding():
    """varlen through pack() equals attention on the right-padded batch with a key mask."""
    lengths = torch.tensor([5, 9, 1])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(3, 9, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    padded = attn.attention(*(t.transpose(1, 2) for t in (q, k, v)),
                            attn_mask=attn.masks.key_padding_mask(lengths, 9), causal=True)
    (pq, cu, m), pk, pv = varlen.pack(q, mask), varlen.pack(k, mask)[0], varlen.pack(v, mask)[0]
    out = varlen.unpack(varlen_attention(pq, pk, pv, cu, cu, m, m, causal=True), mask)
    torch.testing.assert_close(out[mask], padded.transpose(1, 2)[mask])


def test_bad_input():
    q, k, v, cu, _ = packed_inputs([3, 4], [3, 4])
    good = torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        varlen_attention(q, k, v, torch.tensor([1, 3, 7]), good)
    with pytest.raises(ValueError, match="cu_seqlens_k must not decrease"):
        varlen_attention(q, k, v, good, torch.tensor([0, 8, 7]))
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q must end at q.shape[0]=7, got "
                                                   "cu_seqlens_q = [0, 3, 6]")):
        varlen_attention(q, k, v, torch.tensor([0, 3, 6]), good)
    with pytest.raises(ValueError, match="same number of sequences"):
        varlen_attention(q, k, v, good, torch.tensor([0, 3, 3, 7]))
    with pytest.raises(TypeError, match="int32 or int64"):
        varlen_attention(q, k, v, good.float(), good)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is shorter"):
        varlen_attention(q, k, v, good, good, 3, 4)
    with pytest.raises(ValueError, match=r"3 dims \(total, H, D\)"):
        varlen_attention(q[None], k, v, good, good)
    with pytest.raises(ValueError, match="temperature of shape"):
        varlen_attention(q, k, v, good, good, temperature=torch.ones(2, 4))
    with pytest.raises(ValueError, match="heads"):
        varlen_attention(q[:, :3], k, v, good, good)


def test_bad_tensors_are_named_in_the_packed_layout():
    """Errors about q, k, v show the (total, H, D) shapes the caller passed, never the
    (1, H, total, D) view the tiled path runs on."""
    q, k, v, cu, _ = packed_inputs([3, 4], [3, 4])
    cases = [
        ((q, k[..., :6], v), ValueError, r"head dims differ: q \(7, 4, 8\), k \(7, 2, 6\)"),
        ((q, k, v[:6]), ValueError, r"k and v must agree in \(total_k, Hkv\): .*v \(6, 2, 8\)"),
        ((q, k, v[:, :1]), ValueError, r"k and v must agree .*k \(7, 2, 8\), v \(7, 1, 8\)"),
        ((q[:, :3], k, v), ValueError, r"H=3, Hkv=2: q \(7, 3, 8\)"),
        ((q[:0], k, v), ValueError, r"must not be empty: q \(0, 4, 8\)"),
        ((q, k.float(), v), TypeError, r"q, k, v must share a dtype"),
        ((q.int(), k, v), TypeError, r"q must be float16, bfloat16, float32 or float64"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match) as info:
            varlen_attention(*args, cu, cu)
        assert "(1, " not in str(info.value)


# -- the toy GPT trains on packed documents (--pack) ---------------------------------------

def test_packed_gpt_equals_each_document_alone():
    """GPT(x, doc_ids=...) gives every document the logits it gets alone (RoPE is relative,
    so a document's offset inside its row changes nothing), in every layer's attention
    variant (GQA, softcap, sinks, window)."""
    from attn.models import GPT, AttentionConfig, GPTConfig
    torch.manual_seed(0)
    att = AttentionConfig(kv_heads=1, softcap=4.0, sinks=True, window=6, backend="tiled")
    model = GPT(GPTConfig(vocab_size=23, block_size=32, n_layer=2, dim=32,
                          attention=att)).double().eval()
    lengths = [[5, 1, 14, 12], [32]]
    x = torch.randint(0, 23, (2, 32))
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(sum(lengths, []))]).view(2, 32)
    packed, _ = model(x, doc_ids=doc)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            alone, _ = model(x[row:row + 1, start:start + n])
            torch.testing.assert_close(packed[row, start:start + n], alone[0])
            start += n


def test_packed_text_batches():
    from attn.models.data import TextCorpus
    corpus = TextCorpus.load()
    x, y, doc = corpus.packed_batch("train", 3, 128, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == doc.shape == (3, 128)
    flat_doc = doc.flatten()
    assert bool((flat_doc[1:] >= flat_doc[:-1]).all())  # sorted: packed offsets directly
    assert bool((doc[1:, 0] > doc[:-1, -1]).all())  # no document spans two rows
    same = flat_doc[1:] == flat_doc[:-1]
    assert torch.equal(x.flatten()[1:][same], y.flatten()[:-1][same])  # next char, same doc
    assert int(doc.max() - doc.min()) + 1 > 3  # several documents per row on average


# -- the triton backend's own varlen kernels (the interpreter on CPU) -----------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _need_triton():
    pytest.importorskip("triton")
    from attn import flash_triton
    if DEVICE == "cpu" and not flash_triton._INTERPRET:
        pytest.skip("attn.flash_triton was imported without TRITON_INTERPRET=1")


TRITON_VARIANTS = {
    "plain": {},
    "causal_gqa_sinks": {"causal": True, "sinks": "tensor"},
    "window_softcap": {"window": (5, 3), "softcap": "tensor", "temperature": "tensor"},
    "dropout": {"causal": True, "dropout_p": 0.25},
    # per-sequence slopes (constants: "slopes" never requires grad), with a learned softcap
    "alibi_softcap": {"causal": True, "alibi_slopes": "slopes", "softcap": "tensor"},
}


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("variant", list(TRITON_VARIANTS))
def test_triton_varlen_equals_tiled(variant):
    """triton's varlen kernels against the tiled varlen path in fp32: out, lse and every
    gradient within 2x / 3x plain fp32's error of the float64 answer (dropout: the same
    padded-batch mask on both); lengths random with 0 and 1, Nq != Nk per sequence."""
    _need_triton()
    lq, lk = random_lengths(5, seed=11, hi=70), random_lengths(5, seed=12, hi=70)
    q, k, v, cu_q, cu_k = packed_inputs(lq, lk, H=4, Hkv=2, D=16, seed=13)
    kw = {key: (torch.rand(4, generator=torch.Generator().manual_seed(14),
                           dtype=torch.float64) + 0.5 if val == "tensor" else val)
          for key, val in TRITON_VARIANTS[variant].items()}
    if kw.get("alibi_slopes") == "slopes":  # (num_seqs, H), float32 on every run
        kw["alibi_slopes"] = torch.rand(5, 4, generator=torch.Generator().manual_seed(16))
    g = torch.Generator().manual_seed(15)
    d_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    d_lse = torch.randn(4, q.shape[0], generator=g, dtype=torch.float64)

    def run(dtype, backend):
        leaves = [t.detach().to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
        extra = {key: (val.detach().to(DEVICE, dtype).requires_grad_()
                       if isinstance(val, torch.Tensor) and key != "alibi_slopes"
                       else val.to(DEVICE) if isinstance(val, torch.Tensor) else val)
                 for key, val in kw.items()}
        torch.manual_seed(0)
        out, lse = varlen_attention(*leaves, cu_q.to(DEVICE), cu_k.to(DEVICE), max(lq),
                                    max(lk), return_lse=True, backend=backend, **extra)
        lse_term = torch.where(torch.isfinite(lse), lse, 0.0).double() * d_lse.to(DEVICE)
        loss = (out.double() * d_out.to(DEVICE)).sum() + lse_term.sum()
        learn = leaves + [t for t in extra.values() if isinstance(t, torch.Tensor)
                          and t.requires_grad]
        grads = torch.autograd.grad(loss, learn)
        return [out.double().cpu(), lse.double().cpu()] + [x.double().cpu() for x in grads]
    exact = run(torch.float64, "tiled")
    plain = run(torch.float32, "reference")
    got = run(torch.float32, "triton")
    names = ["out", "lse", "dq", "dk", "dv", *(n for n in kw if n != "alibi_slopes")]
    for name, e, p_, t in zip(names, exact, plain, got):
        finite = torch.isfinite(e)
        assert torch.equal(finite, torch.isfinite(t)), name
        err = (t[finite] - e[finite]).abs().max().item() if finite.any() else 0.0
        plain_err = (p_[finite] - e[finite]).abs().max().item() if finite.any() else 0.0
        factor = 2 if name in ("out", "lse") else 3
        scale = max(1.0, e[finite].abs().max().item() if finite.any() else 0.0)
        floor = 2e-6 * scale * (1 if name in ("out", "lse", "dq", "dk", "dv")
                                else sum(lq) ** 0.5)
        assert err <= factor * plain_err + floor, (name, err, plain_err)


@pytest.mark.cuda_if_present
def test_triton_varlen_is_chosen_and_refuses_what_it_cannot():
    call = attn.AttentionCall(device="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64,
                              n_q=512, n_k=512, varlen=True)
    assert attn.select_backend(call).name == "triton"
    with pytest.raises(NotImplementedError, match="varlen"):
        attn.select_backend(call, "sdpa")
    q, k, v, cu, _ = packed_inputs([3, 4], [3, 4])
    if torch.cuda.is_available():  # compiled kernels refuse CPU tensors before their dtype
        q, k, v, cu = (t.detach().cuda() for t in (q, k, v, cu))
    with pytest.raises(NotImplementedError, match="float64"):
        varlen_attention(q, k, v, cu, cu, backend="triton")  # float64: tiled or reference


_AOT_CHILD = r'''
import sys
import torch
from attn.flash_triton import launch as tri
from attn.bench.compile import _Recorder, compile_launch, largest
from attn.masks import make_band
from attn.spec import LaunchSpec, Operands

sink = []
names = ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")
for n in names:
    setattr(tri, n, _Recorder(n, getattr(tri, n), sink))
cu = torch.tensor([0, 300, 300, 1300, 1317], dtype=torch.int32)
T, H, Hkv, D = 1317, 8, 2, 128
q = torch.randn(T, H, D).bfloat16().requires_grad_()
k, v = (torch.randn(T, Hkv, D).bfloat16().requires_grad_() for _ in range(2))
spec = LaunchSpec(D ** -0.5, make_band(0, 0, causal=True, window=(256, 0)), dropout_p=0.1,
                  dropout_seed=1, max_seqlen_q=1000, max_seqlen_k=1000)
ops = Operands(sinks=torch.zeros(H, requires_grad=True),
               softcap=torch.full((H,), 30.0, requires_grad=True), cu_seqlens_q=cu,
               cu_seqlens_k=cu)
out, lse = tri.triton_attention(q, k, v, spec, ops)
(out.float().sum() + lse.sum()).backward()
# the dQ kernel runs twice (its Δ pass, then dQ)
assert sorted(set(l.name for l in sink)) == sorted(names), [l.name for l in sink]
assert all(l.kwargs["VARLEN"] for l in sink)
for launch in sink:
    for arch in (90, 80):
        b = compile_launch(launch, largest(launch.configs(arch=arch)), arch=arch)
        print(launch.name, arch, b.config, b.shared, b.fits, b.tensor_cores, b.error)
        assert b.error is None and b.fits and b.tensor_cores, b
'''


@pytest.mark.slow
def test_triton_varlen_kernels_compile_for_sm90_and_sm80():
    """The interpreter never runs the compiler: build the three varlen kernels (every
    variant flag on, bf16, D=128, the largest pruned config) for sm_90 and sm_80 with
    triton's own compiler, in a child process without TRITON_INTERPRET."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", _AOT_CHILD], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


# -- isolation: one sequence's data never reaches another's output or gradients ------------

ISOLATION_VARIANTS = {
    "plain": {},
    "causal_dropout_alibi_sinks": {"causal": True, "dropout_p": 0.25, "sinks": "tensor",
                                   "alibi_slopes": "tensor"},
}


@pytest.mark.parametrize("variant", list(ISOLATION_VARIANTS))
@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_a_poisoned_sequence_changes_no_other_bit(backend, variant, small_tiles):
    """NaN and inf in one packed sequence's q, in another's k and in a third's v leave every
    other sequence's out, lse and dq, dk, dv bit for bit as they are without the poison,
    dropout and ALiBi included (tiles of 8 here: sequences of 2 to 12 tokens share tiles
    unless the plan cuts them at their boundaries)."""
    lq, lk = [5, 11, 7, 0, 9, 3, 6], [6, 9, 7, 2, 12, 3, 4]
    poisoned = {"q": 1, "k": 2, "v": 4}  # tensor -> sequence
    q, k, v, cu_q, cu_k = packed_inputs(lq, lk, H=4, Hkv=2)
    kw = dict(ISOLATION_VARIANTS[variant])
    if kw.get("sinks") == "tensor":
        kw["sinks"] = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)
    if kw.get("alibi_slopes") == "tensor":
        kw["alibi_slopes"] = torch.linspace(0.1, 0.5, 4)
    g = torch.Generator().manual_seed(11)
    d_out = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    d_lse = torch.randn(4, sum(lq), generator=g, dtype=torch.float64)

    def run(poison: bool):
        qkv = [t.detach().clone() for t in (q, k, v)]
        for x, cu, name in zip(qkv, (cu_q, cu_k, cu_k), "qkv"):
            if poison:
                end = int(cu[poisoned[name] + 1])  # the last rows: every band reaches them
                x[end - 1] = float("nan")
                x[end - 2, 0] = float("inf")
            x.requires_grad_()
        torch.manual_seed(0)  # dropout's seed, the same in both runs
        out, lse = varlen_attention(*qkv, cu_q, cu_k, return_lse=True, backend=backend, **kw)
        return out, lse, torch.autograd.grad((out, lse), qkv, (d_out, d_lse))

    clean, (out, lse, grads) = run(False), run(True)
    keep_q = torch.ones(sum(lq), dtype=torch.bool)
    keep_k = torch.ones(sum(lk), dtype=torch.bool)
    for b in poisoned.values():
        assert not torch.isfinite(out[cu_q[b]:cu_q[b + 1]]).all()  # the poison did land
        keep_q[cu_q[b]:cu_q[b + 1]] = False
        keep_k[cu_k[b]:cu_k[b + 1]] = False
    assert torch.isfinite(out[keep_q]).all()
    assert torch.equal(out[keep_q], clean[0][keep_q])
    assert torch.equal(lse[:, keep_q], clean[1][:, keep_q])
    for name, got, want, keep in zip("qkv", grads, clean[2], (keep_q, keep_k, keep_k)):
        assert torch.equal(got[keep], want[keep]), f"d{name}"
