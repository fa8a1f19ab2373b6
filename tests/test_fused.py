"""The fused backend (attn.fused): torch's fused CPU kernel called per piece of attn's plan.

Its variants run against the float64 reference in tests/test_variants.py (FUSED); here: the
band's pieces against the band itself, the kernel calls a plan makes, packed sequences and
split-KV decoding, isolation of poisoned neighbours, bits across worker counts and batch
compositions, the allow-list and the schema check.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import pytest
import torch

import attn
from attn import fused
from attn.masks import Band
from attn.spec import LaunchSpec
from attn.testing import assert_close_to_reference, make_inputs
from attn.tiled import cpu

needs_workers = pytest.mark.skipif(not cpu.openmp_threads(),
                                   reason="worker threads need OpenMP intra-op threads")


# -- the plan ----------------------------------------------------------------------------------

def _covered(band: Band, m0: int, m1: int, n_k: int) -> torch.Tensor:
    """What the pieces of rows [m0, m1) let each row see, as a bool (rows, n_k) grid."""
    seen = torch.zeros(m1 - m0, n_k, dtype=torch.int)
    rows = torch.arange(m0, m1)
    for p in fused.pieces(band, m0, m1, n_k):
        assert p.n0 < p.n1, p
        cols = torch.arange(p.n0, p.n1)
        if p.masked:
            keep = band.mask(rows, cols)
        elif p.causal:  # torch's top-left causal on the piece
            keep = cols[None, :] - p.n0 <= (rows - m0)[:, None]
        else:
            keep = torch.ones(len(rows), len(cols), dtype=torch.bool)
        seen[:, p.n0:p.n1] += keep.int()
    return seen


BANDS = [Band(), Band(0, None, 0), Band(5, None, 0), Band(-7, None, 0), Band(0, 3, 0),
         Band(2, 9, 4), Band(-3, None, 6), Band(4, 0, None), Band(0, 40, 0), Band(-60, None, 0)]


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_pieces_cover_the_band_exactly_once(band):
    # every (row, key) the band allows is seen by exactly one piece, nothing else is, for
    # blocks at every offset: the merge over pieces is then attention over the band
    n_k = 37
    for m0, m1 in [(0, 8), (3, 11), (13, 29), (30, 45), (0, 45)]:
        seen = _covered(band, m0, m1, n_k)
        want = band.mask(torch.arange(m0, m1), torch.arange(n_k))
        want = torch.ones_like(seen, dtype=torch.bool) if want is None else want
        assert torch.equal(seen, want.int()), (band, m0, m1)


def test_causal_pieces_need_no_mask():
    # causal, either alignment: the keys every row sees and torch's top-left diagonal, so
    # no mask is ever built; a window's left edge is the only masked strip
    for off in (0, 100, 1000):
        for m0 in range(0, 1024, 256):
            ps = fused.pieces(Band(off, None, 0), m0, m0 + 256, 1024 + off)
            assert not any(p.masked for p in ps) and ps[-1].causal
    ps = fused.pieces(Band(0, 300, 0), 512, 768, 1024)
    assert [p.masked for p in ps] == [True, False, False] and ps[-1].causal


def _counting(monkeypatch):
    calls = []
    real = fused._cpu_ops()

    def fwd(q, k, v, p, causal, *, attn_mask=None, scale=None):
        calls.append(("fwd", q.shape[2], k.shape[2], causal, attn_mask is not None,
                      q.shape[1], q.shape[0]))
        return real.fwd(q, k, v, p, causal, attn_mask=attn_mask, scale=scale)

    def bwd(*args, attn_mask=None, scale=None):
        calls.append(("bwd", args[1].shape[2], args[2].shape[2], args[7], attn_mask is not None,
                      args[1].shape[1], args[1].shape[0]))
        return real.bwd(*args, attn_mask=attn_mask, scale=scale)
    monkeypatch.setattr(fused, "_cpu_ops", lambda: fused._CpuOps(fwd, bwd))
    return calls


def test_causal_plan_skips_empty_blocks_and_masks_nothing(monkeypatch):
    calls = _counting(monkeypatch)
    q, k, v = (t.requires_grad_() for t in make_inputs(B=2, H=4, Hkv=2, N=512, D=16, seed=1))
    out = attn.attention(q, k, v, causal=True, backend="fused", block_m=128)
    out.sum().backward()
    fwd = [c for c in calls if c[0] == "fwd"]
    # per batch row (its two kv heads in one call, all 4 query heads: small blocks): block 0
    # is its diagonal alone, blocks 1-3 a full piece and a diagonal; no piece above the
    # diagonal is ever called, none gets a mask
    assert len(fwd) == 2 * (1 + 2 * 3) and all(c[5] == 4 for c in calls)
    assert not any(c[4] for c in calls)
    assert sorted(c[2] for c in fwd if c[3]) == [128] * 8  # diagonals: 128 keys each
    assert sum(c[1] * c[2] for c in fwd if not c[3]) == 2 * 128 * (128 + 256 + 384)
    assert len([c for c in calls if c[0] == "bwd"]) == len(fwd)


def test_items_group_kv_heads_only_while_small(monkeypatch):
    # one kv head per item once a block's scores per head reach item_max_scores / G: the
    # group size follows the sequence's lengths and the heads, never the batch
    calls = _counting(monkeypatch)
    config = dataclasses.replace(fused.DEFAULT, item_max_scores=1 << 19)
    for B, N, heads in [(1, 256, 8), (3, 256, 8), (1, 512, 4), (1, 1024, 2)]:
        calls.clear()
        q, k, v = make_inputs(B=B, H=8, Hkv=4, N=N, D=16, seed=3)
        call, spec, ops = attn.api.resolve(q, k, v, band=Band())
        got = fused.fused_attention(q, k, v, spec, ops, config=config)[0]
        torch.testing.assert_close(got, attn.attention(q, k, v, backend="reference"))
        assert {c[5] for c in calls} == {heads}, (B, N)


def test_window_masks_only_its_left_strip(monkeypatch):
    calls = _counting(monkeypatch)
    q, k, v = make_inputs(B=1, H=2, N=1024, D=16, seed=2)
    attn.attention(q, k, v, window=(300, 0), backend="fused", block_m=256)
    masked = [c for c in calls if c[4]]
    # both heads in each call (small blocks): block 0 has no strip (its keys start at 0),
    # block 1's is cut at key 0 (keys [0, 211)), blocks 2-3 have 255 keys each
    assert sorted(c[2] for c in masked) == [211] + [255] * 2
    assert sum(not c[4] for c in calls) == 1 + 2 * 3 and all(c[5] == 2 for c in calls)


# -- against the reference: what test_variants does not reach -------------------------------------

@pytest.mark.parametrize("dtype,variant", [
    (d, v) for d, v in itertools.product([torch.float32, torch.bfloat16],
                                         ["causal", "window", "alibi", "sinks"])
    if not (v == "alibi" and d == torch.bfloat16)])  # 16-bit ALiBi: tiled's (the allow-list)
def test_packed_sequences_match_the_reference(dtype, variant):
    lengths_q, lengths_k = [5, 40, 1, 23], [9, 40, 30, 23]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lengths_k)), dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    H, Hkv, D = 4, 2, 16
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=torch.float64)
               for n, h in ((cu_q[-1], H), (cu_k[-1], Hkv), (cu_k[-1], Hkv)))
    kw = {"causal": True}
    if variant == "window":
        kw = {"causal": True, "window": (6, 0)}
    if variant == "alibi":
        kw["alibi_slopes"] = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    if variant == "sinks":
        kw["sinks"] = torch.randn(H, generator=g).requires_grad_()

    def run(backend, dt):
        qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        extra = dict(kw)
        if "sinks" in extra:
            extra["sinks"] = kw["sinks"].detach().clone().requires_grad_()
        out, lse = attn.varlen_attention(qq, kk, vv, cu_q, cu_k, backend=backend,
                                         return_lse=True, **extra)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dt)
        wl = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5))
        (out.float() * w.float()).sum().add((torch.where(torch.isfinite(lse), lse, 0) * wl)
                                            .sum()).backward()
        grads = [qq.grad, kk.grad, vv.grad] + ([extra["sinks"].grad] if "sinks" in extra else [])
        return [out, lse] + grads

    exact = run("reference", torch.float64)
    plain = run("reference", dtype)
    got = run("fused", dtype)
    floor = 1e-6 if dtype == torch.float32 else 2e-3
    for name, e, p, f in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], exact, plain, got):
        err = (f.double() - e.double()).nan_to_num(posinf=0, neginf=0).abs().max().item()
        ref = (p.double() - e.double()).nan_to_num(posinf=0, neginf=0).abs().max().item()
        assert err <= 3 * ref + floor, (name, err, ref)
    assert torch.equal(torch.isinf(got[1]), torch.isinf(exact[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decoding_matches_reference(dtype):
    config = fused.FusedConfig(split_min_keys=64, split_min_chunk=48, split_max_chunks=4)
    assert fused.kv_split(3, 300, config) == 96  # 48 doubled until at most 4 ranges
    q, k, v = make_inputs(B=2, H=8, Hkv=2, N=3, Nk=300, D=32, dtype=dtype, seed=5)
    sinks = torch.randn(8)

    def fn(q, k, v, **kw):
        call, spec, ops = attn.api.resolve(q, k, v, band=Band(297, None, 0),
                                           sinks=kw.get("sinks"), return_lse=True)
        return fused.fused_attention(q, k, v, spec, ops, config=config)
    assert_close_to_reference(fn, q, k, v, causal=True, sinks=sinks, grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,causal", [(1, False), (1, True), (3, True)])
def test_gqa_decoding_reads_each_kv_head_once(monkeypatch, dtype, n_q, causal):
    # decoding (at most split_max_q rows): every piece no row's diagonal cuts is one op call
    # per kv head with its G = 4 query heads as 4 x n_q rows, so the op reads each key once
    # per kv head; bottom-right causal leaves 1 row all keys, 3 rows a causal diagonal of 3
    # keys (called per query head, as before); 9000 keys: 3 ranges, each kv head its items
    calls = _counting(monkeypatch)
    q, k, v = make_inputs(B=2, H=8, Hkv=2, N=n_q, Nk=9000, D=32, dtype=dtype, seed=11)
    sinks = torch.randn(8)
    assert_close_to_reference(
        lambda q, k, v, **kw: attn.attention(q, k, v, backend="fused", **kw), q, k, v,
        causal=causal, sinks=sinks, check_lse=True, grad=False)
    calls.clear()
    attn.attention(q, k, v, causal=causal, backend="fused")
    folded = [c for c in calls if not c[3]]
    diagonal = [c for c in calls if c[3]]
    assert folded and all(c[1] == 4 * n_q and c[5] == 1 for c in folded)
    # each batch row: its 2 kv heads x 3 key ranges (the pool has 6 items, not 3)
    diag = 3 if n_q == 3 else 0  # the diagonal's keys
    assert len(folded) == 2 * 2 * 3 and sum(c[2] for c in folded) == 2 * 2 * (9000 - diag)
    assert len(diagonal) == (2 * 2 if diag else 0)
    assert all(c[1:3] == (3, 3) and c[5] == 4 for c in diagonal)


def test_gqa_folding_is_off_past_decoding_and_on_cuda():
    assert fused.folds(16, 4) and not fused.folds(17, 4) and not fused.folds(1, 1)
    assert not fused.folds(1, 4, fused.CUDA)


# -- isolation and bits --------------------------------------------------------------------------

def test_poisoned_batch_rows_and_packed_neighbours_change_nothing():
    # no band and no mask, so NaN keys do not send the call to tiled (nothing hides them)
    q, k, v = make_inputs(B=3, H=4, Hkv=2, N=70, D=16, seed=6)
    clean = attn.attention(q, k, v, backend="fused", block_m=32)
    for t in (q, k, v):
        t[1] = float("nan")
    poisoned = attn.attention(q, k, v, backend="fused", block_m=32)
    assert torch.isnan(poisoned[1]).all()
    assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[2], clean[2])
    # packed: sequence 1's NaN keys and values never reach sequences 0 and 2
    cu = torch.tensor([0, 30, 50, 90], dtype=torch.int32)
    qp, kp, vp = (torch.randn(90, 4, 16, generator=torch.Generator().manual_seed(i))
                  for i in range(3))
    ref = attn.varlen_attention(qp, kp, vp, cu, cu, backend="fused")
    kp[30:50], vp[30:50] = float("nan"), float("nan")
    got = attn.varlen_attention(qp, kp, vp, cu, cu, backend="fused")
    keep = torch.cat([torch.arange(0, 30), torch.arange(50, 90)])
    assert torch.isnan(got[30:50]).all() and torch.equal(got[keep], ref[keep])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("case", ["causal", "bottom_right_blocks", "window", "bool_mask",
                                  "alibi"])
def test_a_hidden_non_finite_key_reaches_no_other_row(case, bad):
    # a key hidden from the rows checked: the last key (causal: every row but the last;
    # a bool mask: every row), or the first (a window: rows 51 on). On calls of full and
    # causal pieces the op's causal flag keeps it out; masked ones (a window's strips, a
    # mask, ALiBi's diagonals) go to tiled
    nq, nk, kw, key, rows = 40, 40, dict(causal=True), 39, slice(0, 39)
    if case == "bottom_right_blocks":
        nq, nk, kw, key, rows = 300, 700, dict(causal=True, block_m=64), 699, slice(0, 299)
    if case == "window":
        nq, nk, kw, key, rows = 300, 300, dict(window=(50, 0)), 0, slice(51, 300)
    if case == "alibi":
        kw = dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25]))
    if case == "bool_mask":
        kw, rows = dict(attn_mask=torch.arange(nk) < nk - 1), slice(0, 40)
    q, k, v = make_inputs(B=1, H=2, N=nq, Nk=nk, D=16, seed=7)
    k[0, :, key] = bad
    out = attn.attention(q, k, v, backend="fused", **kw)
    assert torch.isfinite(out[:, :, rows]).all()
    want = attn.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out[:, :, rows], want[:, :, rows].float())


def _window_by_row(b, h, q_idx, kv_idx):
    # a window that widens with the batch row: a row run apart must still see its own
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 10 + 5 * b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("layout", ["batch", "packed", "bool_mask", "mask_mod"])
def test_a_hidden_non_finite_key_leaves_the_other_sequences_bits(layout, bad):
    # key 0 of sequence 1 is hidden from its late rows (a window, a bool mask's band, a
    # mask_mod's window of 15 in batch row 1), so torch's op cannot compute sequence 1:
    # it runs on tiled, forward and backward; the other sequences keep fused's bits, out and
    # every gradient, as in the clean call, and sequence 1's late rows are the reference's of
    # the clean call (the key they do not see changed only)
    B, H, N, D = 3, 2, 60, 16
    g = torch.Generator().manual_seed(12)
    if layout == "packed":
        cu = torch.tensor([0, 30, 90, 120], dtype=torch.int32)
        q, k, v, do = (torch.randn(120, H, D, generator=g) for _ in range(4))

        def call(q, k, v, backend="fused"):
            return attn.varlen_attention(q, k, v, cu, cu, window=(20, 0), backend=backend)
        bad_key, others, late = (30,), torch.cat([torch.arange(0, 30), torch.arange(90, 120)]), 51
    else:
        q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
        kw = dict(window=(20, 0))
        if layout == "bool_mask":  # one op call over the batch rows (float32, a user mask)
            i = torch.arange(N)
            kw = dict(attn_mask=(i[None] <= i[:, None]) & (i[:, None] - i[None] <= 20))
        if layout == "mask_mod":
            kw = dict(mask_mod=_window_by_row)

        def call(q, k, v, backend="fused"):
            return attn.attention(q, k, v, backend=backend, **kw)
        bad_key, others, late = (1, slice(None), 0), [0, 2], 21 if layout != "mask_mod" else 16
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    clean = call(*leaves)
    clean_grads = torch.autograd.grad(clean, leaves, do)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = call(*leaves, backend="reference")
    want_dq = torch.autograd.grad(want, leaves[0], do.double())[0]
    k[bad_key] = bad
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = call(*leaves)
    grads = torch.autograd.grad(got, leaves, do)
    seq = ((slice(1, 2), slice(None), slice(late, None)) if layout != "packed"
           else slice(late, 90))
    assert torch.equal(got[others], clean[others])
    for g_, c in zip(grads, clean_grads):
        assert torch.equal(g_[others], c[others])
    assert torch.isfinite(got[seq]).all()
    torch.testing.assert_close(got[seq], want[seq].float())
    torch.testing.assert_close(grads[0][seq], want_dq[seq].float())  # its late rows' dq


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_the_same_key_padding_in_every_row(B, causal):
    # every row keeps keys [0, 33) of 40: the padding is a cut of the keys, the same in each
    # row, so the call looks like one op call over the batch; it must not read keys 33-39
    q, k, v = make_inputs(B=B, H=2, N=40, Nk=40, D=16, seed=9)
    mask = (torch.arange(40) < 33).view(1, 1, 1, 40).expand(B, 1, 1, 40)
    assert_close_to_reference(functools.partial(attn.attention, backend="fused"), q, k, v,
                              attn_mask=mask, causal=causal)


@pytest.mark.parametrize("kw", [dict(window=(3, 0)), dict(causal=True)])
def test_packed_sequences_with_a_hidden_non_finite_key(kw):
    # packed: a sequence never reads another's keys; inside one (12 queries, 8 keys: rows
    # 0-3 see none), a key the band hides from some of its rows sends the call to tiled's
    # document mask: no NaN beyond the rows that see it, the reference's values elsewhere
    cu_q, cu_k = torch.tensor([0, 12, 20]), torch.tensor([0, 8, 22])
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, 2, 16, generator=g) for n in (20, 22, 22))
    key, seen = (0, range(4, 8)) if "window" in kw else (7, [11])
    k[key] = float("nan")
    out = attn.varlen_attention(q, k, v, cu_q, cu_k, backend="fused", **kw)
    want = attn.varlen_attention(q, k, v, cu_q, cu_k, backend="reference", **kw)
    rows = [r for r in range(20) if r not in seen]
    assert torch.isfinite(out[rows]).all() and torch.isnan(out[list(seen)]).all()
    torch.testing.assert_close(out[rows], want[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_sequences_without_rows_or_keys(dtype):
    # empty sequences (no queries, no keys, or neither) between real ones: no items, no
    # op call, and every other sequence exact, gradients included (a sequence with no
    # query rows once divided by its zero blocks)
    cu_q, cu_k = torch.tensor([0, 0, 9, 9, 40, 40]), torch.tensor([0, 5, 5, 17, 50, 50])
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(n, 4, 16, generator=g, dtype=dtype).requires_grad_()
               for n in (40, 50, 50))
    do = torch.randn(40, 4, 16, generator=g, dtype=dtype)
    res = []
    for backend in ("fused", "reference"):
        out = attn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend)
        res.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    for got, want in zip(*res):
        torch.testing.assert_close(got, want.to(dtype), **tol)


def _grads(q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attn.attention(q, k, v, backend="fused", return_lse=True, **kw)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out, lse, q.grad, k.grad, v.grad


WHOLE = dict(B=3, H=4, Hkv=2, N=200, D=16)  # small: one op call for the batch (fp32/fp64)


@needs_workers
@pytest.mark.parametrize("dtype,shape,kw", [
    (torch.float32, dict(B=3, H=4, Hkv=1, N=300, D=32), dict(causal=True, window=(100, 0),
                                                             block_m=32)),  # backward runs
    (torch.bfloat16, dict(B=3, H=4, Hkv=1, N=300, D=32), dict(causal=True, window=(100, 0),
                                                              block_m=32)),
    (torch.float32, WHOLE, dict(causal=True)),
    (torch.float64, WHOLE, dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
    # torch's backward op over a whole batch gave other bits on 1 and 2 threads here
    (torch.float32, dict(B=4, H=6, Hkv=6, N=160, D=40), dict(causal=True)),
    # fewer than 32 query rows: the op's threads' scratch buffers align apart, and its bits
    # with them (one op call over the batch gave other bits on 2 threads here)
    (torch.float64, dict(B=5, H=2, Hkv=1, N=17, D=32), {}),
    (torch.float32, dict(B=5, H=2, Hkv=2, N=17, D=8), dict(causal=True)),
    # 33 rows: one op call each way, its threads' buffers aligned alike (a torch whose
    # buffers are cut otherwise fails here)
    (torch.float64, dict(B=5, H=2, Hkv=1, N=33, D=8), {}),
    # GQA decoding: each kv head's query heads as rows of one op call, items per kv head
    # and key range (9000 keys: 3 ranges)
    (torch.float32, dict(B=3, H=8, Hkv=2, N=1, Nk=9000, D=32), {}),
    (torch.bfloat16, dict(B=3, H=8, Hkv=2, N=2, Nk=9000, D=32), dict(causal=True)),
    # a user mask: the forward and the backward are one op call each over the batch
    (torch.float32, dict(B=3, H=4, Hkv=2, N=300, D=16),
     dict(attn_mask=torch.rand(1, 1, 300, 300, generator=torch.Generator().manual_seed(5))
          > 0.3)),
    # a whole backward cut into op calls by batch rows (2 for the batch, 1 for a row alone)
    # and by kv heads (6 calls, 4 alone), a mask per head: D=40 gave other bits on
    # torch's kernel's threads (Intel Xeon, MKL), so each call runs on one thread
    (torch.float32, dict(B=8, H=8, Hkv=4, N=200, D=40), dict(causal=True)),
    (torch.float32, dict(B=3, H=8, Hkv=4, N=1024, D=40),
     dict(attn_mask=torch.rand(1, 8, 1024, 1024, generator=torch.Generator().manual_seed(6))
          > 0.3)),
])
def test_bits_do_not_depend_on_threads_or_batch(dtype, shape, kw):
    q, k, v = make_inputs(**shape, dtype=dtype, seed=8)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_grads(q, k, v, **kw))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    # batch row 1 alone, and among other rows in another order: the same bits
    alone = _grads(q[1:2], k[1:2], v[1:2], **kw)
    for a, b in zip(alone, runs[0]):
        assert torch.equal(a[0], b[1])
    mixed = _grads(q[[2, 1]], k[[2, 1]], v[[2, 1]], **kw)
    for a, b in zip(mixed, runs[0]):
        assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_small_dense_call_is_one_op_call_each_way(monkeypatch, dtype):
    # float32/float64 calls of one unmasked piece per sequence: torch's kernel runs the
    # whole batch's forward at once and its backward at once (it computes each row and head
    # alone there, see the bits test); against the reference, with the lse's gradient (two
    # more columns) and sinks
    calls = _counting(monkeypatch)
    q, k, v = make_inputs(**WHOLE, dtype=dtype, seed=9)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype).requires_grad_()
    fn = functools.partial(attn.attention, backend="fused")
    assert_close_to_reference(fn, q, k, v, causal=True, sinks=sinks)
    fwd = [c for c in calls if c[0] == "fwd"]
    assert fwd and all(c[1:3] + c[5:] == (200, 200, 4, 3) for c in fwd)
    bwd = [c for c in calls if c[0] == "bwd"]
    assert len(bwd) == len(fwd) and all(c[1:3] + c[5:] == (200, 200, 4, 3) for c in bwd)
    calls.clear()
    attn.attention(q, k, v, backend="fused", window=(20, 0))  # masked pieces: per sequence
    assert len(calls) == 3 and all(c[4] and c[6] == 1 for c in calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["bool", "float per head", "bool causal GQA"])
def test_a_masked_float_call_is_one_op_call_each_way(monkeypatch, dtype, kind):
    # float32/float64 with a user mask: one op call over the batch each way, the whole mask
    # read as SDPA reads it, whatever the size (its items would run beside OpenMP's spinning
    # team); rows the mask (and the band) hide whole come back out 0, lse -inf, and get no
    # gradient; against the reference, gradients included
    calls = _counting(monkeypatch)
    H, Hkv = (4, 2) if "GQA" in kind else (4, 4)
    q, k, v = make_inputs(B=2, H=H, Hkv=Hkv, N=600, D=16, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1 if "bool" in kind else H, 600, 600, generator=g) > 0.3
    keep[1, :, 7] = False  # a row that sees no key
    keep[0, :, 450] = False
    mask = keep if "bool" in kind else torch.zeros(keep.shape, dtype=dtype).masked_fill(
        ~keep, float("-inf")) + torch.randn(keep.shape, generator=g, dtype=dtype)
    causal = "causal" in kind
    fn = functools.partial(attn.attention, backend="fused")
    assert_close_to_reference(fn, q, k, v, attn_mask=mask, causal=causal)
    calls.clear()
    out, lse = fn(q, k, v, attn_mask=mask, causal=causal, return_lse=True)
    assert [c[:1] + c[4:] for c in calls] == [("fwd", True, H, 2)]
    seen = keep & (torch.ones(600, 600, dtype=torch.bool).tril() if causal else True)
    empty = ~seen.any(-1).expand(2, H, 600)  # rows 7 and 450 of their batch rows, and more
    assert bool(empty[1, :, 7].all() and empty[0, :, 450].all())
    assert torch.equal(lse == float("-inf"), empty) and bool(torch.isfinite(lse[~empty]).all())
    assert not out[empty].any()
    calls.clear()
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    fn(qg, kg, vg, attn_mask=mask, causal=causal).sum().backward()
    fwd, bwd = ([c for c in calls if c[0] == way] for way in ("fwd", "bwd"))
    assert [c[:1] + c[4:] for c in fwd] == [("fwd", True, H, 2)]
    # the backward: _whole_bwd_parts' op calls (one thread each), every row and head once
    assert bwd and all(c[4] for c in bwd) and sum(c[5] * c[6] for c in bwd) == 2 * H
    assert not qg.grad[empty].any()


@pytest.mark.parametrize("band", [{}, {"causal": True}, {"causal": True, "window": (40, 0)}],
                         ids=["plain", "causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_a_user_mask_hides_and_a_seen_row_of_lse_zero(monkeypatch, dtype, band):
    # q = 0 makes every score 0, so a row that sees exactly one key has lse 0 (float32:
    # exactly), as torch's CPU op gives a row that sees none: the first keeps its key's
    # value, the second gets out 0 and lse -inf. float32 without a window is the one op
    # call; the others run pieces of 16 rows and 24 keys (rows that see no key of one piece
    # but keys of another, merged)
    config = dataclasses.replace(fused.DEFAULT, mask_min_block_m=16, mask_max_block_m=16,
                                 mask_block_n=24, masked_block_m=16, masked_block_n=24)
    monkeypatch.setitem(fused.fused_attention.__kwdefaults__, "config", config)
    q, k, v = make_inputs(B=2, H=2, N=64, D=16, dtype=dtype, seed=5)
    q = torch.zeros_like(q)
    keep = torch.rand(2, 1, 64, 64, generator=torch.Generator().manual_seed(4)) > 0.3
    keep[:, :, :, 0] = True  # the other rows see a key (causal too; the window's by the draw)
    keep[0, :, 20] = False  # no key
    keep[0, :, 30] = False
    keep[0, :, 30, 3] = True  # one key: lse 0
    keep[1, :, 40] = False
    keep[1, :, 40, 35] = True  # one key, in a later piece: none of the first
    keep[1, :, 50] = False  # no key
    fn = functools.partial(attn.attention, backend="fused")
    kw = dict(attn_mask=keep, **band)
    assert_close_to_reference(fn, q, k, v, **kw)
    out, lse = fn(q, k, v, return_lse=True, **kw)
    empty = {(0, 20), (1, 50)}
    for b, row in empty:
        assert not out[b, :, row].any() and bool((lse[b, :, row] == float("-inf")).all())
    one = [(0, 30, 3), (1, 40, 35)]
    for b, row, key in one:
        assert float(lse[b, :, row].abs().max()) <= (0 if dtype == torch.float32 else 1e-3)
        torch.testing.assert_close(out[b, :, row], v[b, :, key], rtol=0, atol=0)
    seen = torch.ones(2, 2, 64, dtype=torch.bool)
    for b, row in empty:
        seen[b, :, row] = False
    assert bool(torch.isfinite(lse[seen]).all())


# -- what it expresses ---------------------------------------------------------------------------

def test_every_launchspec_field_has_a_fused_decision():
    # a new LaunchSpec field makes every call inexpressible on fused until it is decided
    missing = {f.name for f in dataclasses.fields(LaunchSpec)} - set(fused.SPEC_DECISIONS)
    assert not missing, f"decide in attn.fused.SPEC_DECISIONS: {sorted(missing)}"

    @dataclasses.dataclass(frozen=True)
    class Wider(LaunchSpec):
        score_bias: float = 0.0
    why = fused.spec_reason(Wider(qk_scale=1.0), attn.spec.Operands())
    assert why is not None and "score_bias" in why and "no fused decision" in why


@pytest.mark.parametrize("kwargs,needle", [
    ({"softcap": 5.0}, "softcap"), ({"dropout_p": 0.1}, "dropout"),
    ({"score_mod": lambda s, b, h, i, j: s * 2}, "score_mod"),
])
def test_explicit_fused_refuses_what_it_cannot_compute(kwargs, needle):
    q, k, v = make_inputs(B=1, H=2, N=17, D=16, seed=9)
    with pytest.raises(NotImplementedError, match=f"backend='fused'.*{needle}.*tiled"):
        attn.attention(q, k, v, backend="fused", **kwargs)
    # auto computes it elsewhere, and says why not fused
    call, _, _ = attn.api.resolve(q, k, v, band=Band(), **{
        n: x for n, x in kwargs.items() if n != "score_mod"}, score_mod=kwargs.get("score_mod"))
    choice = attn.select_backend(call)
    assert choice.name == "tiled" and needle in choice.reason


def test_a_schema_mismatch_turns_fused_off_with_one_warning(monkeypatch):
    assert not isinstance(fused._cpu_ops(), str), fused._cpu_ops()  # this torch's schemas fit
    fused._cpu_ops.cache_clear()
    name = next(iter(fused._CPU_SCHEMAS))
    monkeypatch.setitem(fused._CPU_SCHEMAS, name, fused._CPU_SCHEMAS[name] + " (another)")
    try:
        with pytest.warns(RuntimeWarning, match="fused backend is off"):
            why = fused.ops_reason("cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not per call
            assert fused.ops_reason("cpu") == why
        q, k, v = make_inputs(B=1, H=2, N=17, D=16, seed=10)
        call, _, _ = attn.api.resolve(q, k, v, band=Band())
        choice = attn.select_backend(call)
        assert choice.name == "tiled" and "another schema" in choice.reason
        with pytest.raises(NotImplementedError, match="another schema"):
            attn.attention(q, k, v, backend="fused")
    finally:
        monkeypatch.undo()
        fused._cpu_ops.cache_clear()
    assert not isinstance(fused._cpu_ops(), str)


# -- auto's table ----------------------------------------------------------------------------------

def test_auto_reads_the_committed_table_per_cpu_kind_dtype_and_class(monkeypatch, tmp_path):
    from attn import choose
    table = {"testkind": {"cpu": "a test CPU", "entries": {
        "float32": {"dense": {"backend": "tiled", "ratio": 1.3},
                    "decode": {"backend": "fused", "ratio": 0.8}}}}}
    path = tmp_path / "table.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setattr(choose, "cpu_kind", lambda: "testkind")
    monkeypatch.setattr(choose, "load_table", lambda: table)

    def choice(**kw):
        base = dict(device="cpu", dtype=torch.float32, head_dim=64, head_dim_v=64, n_q=512,
                    n_k=512)
        return attn.select_backend(attn.AttentionCall(**{**base, **kw}))
    dense, decode = choice(), choice(n_q=1, n_k=16384)
    assert dense.name == "tiled" and "measured on testkind (a test CPU)" in dense.reason
    assert decode.name == "fused" and "decode float32 fused/tiled time 0.80" in decode.reason
    # a cell the table lacks: the documented fallback, and the reason says so
    train = choice(grad=True)
    assert train.name == choose.FALLBACK["train"] and "no measured entry" in train.reason
    bf16 = choice(dtype=torch.bfloat16, n_q=1, n_k=16384)
    assert bf16.name == choose.FALLBACK["decode"] and "default" in bf16.reason
    # what fused cannot compute never takes it, whatever the table says
    assert choice(n_q=1, n_k=16384, softcap="fixed").name == "tiled"
    # a mask is its own class, unless it is key padding (a cut of the keys: dense)
    assert "masked float32" in choice(mask="bool").reason
    assert "dense float32" in choice(mask="bool", mask_padding=True).reason


@pytest.mark.parametrize("n_q,n_k,grad,masked,cls", [
    (1, 16384, False, False, "decode"), (16, 200, False, False, "decode"),
    (17, 4096, False, False, "chunk"), (128, 1024, False, False, "chunk"),
    (129, 4096, False, False, "dense"), (128, 1023, False, False, "dense"),
    (64, 4096, True, False, "train"), (64, 4096, False, True, "masked"),
    (64, 256, False, False, "small"), (2048, 2048, False, False, "dense"),
    (31, 31, True, False, "tiny"), (32, 32, True, False, "small"), (20, 100, False, True, "tiny"),
    (12, 12, True, False, "tiny")])
def test_call_classes(n_q, n_k, grad, masked, cls):
    # a chunked prefill (a few query rows, many keys) is its own class: the dense square
    # call the table measures says little about it (fused 0.6x tiled at 32 x 2048 here)
    assert attn.choose.call_class(n_q, n_k, grad, masked) == cls


def test_small_calls_fused_would_cut_per_sequence_take_tiled(monkeypatch):
    # the table's tiny and small cells measure one op call over the batch: a small call
    # fused would run as items per sequence (a window, ALiBi, bottom-right causal, packed,
    # key padding) takes tiled whatever the cell says; a large one keeps the cell's choice
    from attn import choose
    table = {"testkind": {"cpu": "a test CPU", "entries": {"float32": {
        c: {"backend": "fused", "ratio": 0.5} for c in ("tiny", "small", "train")}}}}
    monkeypatch.setattr(choose, "cpu_kind", lambda: "testkind")
    monkeypatch.setattr(choose, "load_table", lambda: table)

    def choice(**kw):
        base = dict(device="cpu", dtype=torch.float32, head_dim=16, head_dim_v=16, n_q=12,
                    n_k=12, grad=True, band=Band(0, None, 0))
        return attn.select_backend(attn.AttentionCall(**{**base, **kw}))
    assert choice().name == "fused" and choice(n_q=64, n_k=64).name == "fused"
    assert choice(band=Band()).name == "fused"
    for kw in (dict(band=Band(0, 1, 0)), dict(alibi=True), dict(varlen=True),
               dict(n_q=8, band=Band(4, None, 0)), dict(mask="bool", mask_padding=True),
               dict(n_q=64, n_k=64, band=Band(0, 8, 0))):
        got = choice(**kw)
        assert got.name == "tiled" and "items per sequence" in got.reason, (kw, got)
    assert choice(n_q=512, n_k=512, band=Band(0, 8, 0)).name == "fused"  # train: no such rule


def test_tiny_calls_are_those_below_fuseds_threaded_one_op_call():
    # below this many query rows fused's one op call runs on the caller's thread alone (the
    # op's threads' buffers align apart): the table's tiny class
    assert attn.choose.SMALL_MIN_Q == fused._WHOLE_CALL_MIN_ROWS


def test_the_committed_table_is_well_formed():
    from attn import choose
    table = choose.load_table()
    for kind, entry in table.items():
        assert isinstance(entry["cpu"], str) and entry["cpu"], kind
        for dtype, cells in entry["entries"].items():
            assert isinstance(getattr(torch, dtype), torch.dtype)
            for cls, cell in cells.items():
                assert cls in choose.CLASSES and cell["backend"] in ("fused", "tiled")
                assert cell["ratio"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_padding_is_a_cut_of_the_keys(dtype, monkeypatch):
    # right padding, left padding and a row with no key, as a (B, 1, 1, Nk) bool mask: each
    # row's keys are cut to its run (no piece builds a mask), against the reference
    q, k, v = make_inputs(B=3, H=4, Hkv=2, N=90, Nk=100, D=16, dtype=dtype, seed=12)
    mask = torch.zeros(3, 1, 1, 100, dtype=torch.bool)
    mask[0, ..., :70] = True
    mask[1, ..., 25:] = True
    assert fused.key_spans(mask, 3, 100) == [(0, 70), (25, 100), (0, 0)]
    assert fused.key_spans(mask | (torch.arange(100) == 90), 3, 100) is None  # two runs
    calls = _counting(monkeypatch)
    fn = functools.partial(attn.attention, backend="fused", block_m=32)
    for kw in ({}, {"causal": True}, {"causal": True, "window": (20, 0)}):
        calls.clear()
        assert_close_to_reference(fn, q, k, v, attn_mask=mask, **kw)
        if not kw:  # the padding alone builds no mask (the band's own cuts may)
            assert calls and not any(c[4] for c in calls)
    out, lse = attn.attention(q, k, v, attn_mask=mask, backend="fused", return_lse=True)
    assert (out[2] == 0).all() and torch.isinf(lse[2]).all()
    # the same padding for every row given as a 1-d (Nk,) or 2-d (1, Nk) mask
    for shared in (mask[0, 0, 0], mask[1, 0]):
        assert_close_to_reference(fn, q, k, v, attn_mask=shared, causal=True)


@pytest.mark.parametrize("H, N", [(4, 300), (1, 320)])
def test_alibi_bias_reused_only_within_its_launch_and_heads(H, N):
    """A thread reuses the bias of a causal diagonal for the next piece of the same launch,
    slopes row and heads (64-row blocks, one kv head per item here): each head keeps its
    own slopes, and slopes changed in place between two calls are read again (one head,
    whole blocks: the second call's first piece has the first call's last shape)."""
    config = dataclasses.replace(fused.DEFAULT, item_max_scores=0, alibi_block_m=64)
    q, k, v = make_inputs(B=1, H=H, Hkv=H, N=N, D=16, seed=5)
    slopes = 2.0 ** -torch.tensor([1.0, 2.0, 3.0, 4.0][:H])
    for _ in range(2):
        call, spec, ops = attn.api.resolve(q, k, v, band=Band(0, None, 0), alibi_slopes=slopes)
        got = fused.fused_attention(q, k, v, spec, ops, config=config)[0]
        want = attn.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="reference")
        torch.testing.assert_close(got, want)
        slopes.mul_(2.0)  # the next call's slopes, in the same storage


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_in_float64_keeps_float64s_precision(causal):
    # ALiBi's bias on the diagonal squares (and its terms off them) in float64 for a float64
    # call: built from float32 slopes it was 1e-7 off the reference (the budget is ~1e-12);
    # 300 rows in blocks of 64: left, right and diagonal pieces, and G = 4 query heads a kv head
    q, k, v = make_inputs(B=2, H=8, Hkv=2, N=300, D=32, dtype=torch.float64, seed=5)
    slopes = torch.rand(8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_close_to_reference(functools.partial(attn.attention, backend="fused", block_m=64), q,
                              k, v, causal=causal, alibi_slopes=slopes)
