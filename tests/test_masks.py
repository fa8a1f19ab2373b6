"""masks.py's block classification and the launcher spec's global positions, against brute force."""

import itertools

import pytest
import torch

import attn
from attn import masks
from attn.masks import Band, classify_band, classify_documents, classify_predicate, make_band
from attn.spec import LaunchSpec
from attn.testing import make_inputs
from attn.tiled import tiled_attention

BANDS = [Band(), Band(0, None, 0), Band(5, None, 0), Band(-7, None, 0), Band(0, 6, 0),
         Band(3, 4, 9), Band(0, 0, 0), Band(-20, 2, 2), Band(40, None, -3)]


def _dense(band: Band, n_q: int, n_k: int) -> torch.Tensor:
    keep = band.mask(torch.arange(n_q), torch.arange(n_k))
    return torch.ones(n_q, n_k, dtype=torch.bool) if keep is None else keep


def _check_blocks(blocks, keep: torch.Tensor) -> None:
    """Listed tiles cover every visible pair; full tiles are all visible; partial tiles hold
    at least one visible pair; tiles never overlap."""
    covered = torch.zeros_like(keep, dtype=torch.int)
    for m0, m1, row in blocks.query_blocks():
        for n0, n1, full in row:
            tile = keep[m0:m1, n0:n1]
            covered[m0:m1, n0:n1] += 1
            assert tile.any(), f"empty tile listed: q[{m0}:{m1}] k[{n0}:{n1}]"
            assert bool(tile.all()) == full, f"q[{m0}:{m1}] k[{n0}:{n1}] full={full}"
    assert (covered <= 1).all(), "tiles overlap"
    assert not (keep & (covered == 0)).any(), "a visible pair lies in no listed tile"


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("n_q,n_k,bm,bn", [(37, 53, 8, 16), (64, 64, 16, 16), (5, 90, 4, 32),
                                           (90, 5, 32, 4), (1, 1, 16, 16)])
def test_band_classification_matches_the_dense_band(band, n_q, n_k, bm, bn):
    _check_blocks(classify_band(band, n_q, n_k, bm, bn), _dense(band, n_q, n_k))


def test_causal_classification_skips_the_upper_triangle():
    blocks = classify_band(make_band(256, 256, causal=True, window=None), 256, 256, 32, 32)
    c = blocks.counts()
    assert c == {"full": 28, "partial": 8, "empty": 28}  # 8x8 tiles: 28 below, 8 on, 28 above


def test_predicate_and_document_classification():
    g = torch.Generator().manual_seed(0)
    lengths = [0, 7, 1, 30, 19, 3]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    keep = doc[:, None] == doc[None, :]
    for bm, bn in [(8, 8), (4, 16), (16, 4)]:
        _check_blocks(classify_documents(doc, doc, bm, bn), keep)
        _check_blocks(classify_predicate(keep, bm, bn), keep)
    rand = torch.rand(2, 3, 41, 29, generator=g) > 0.97
    union = rand.any(dim=(0, 1))
    blocks = classify_predicate(rand, 8, 8)
    for m0, m1, row in blocks.query_blocks():
        for n0, n1, full in row:  # full only when full for every leading index
            assert union[m0:m1, n0:n1].any()
            assert full == bool(rand[..., m0:m1, n0:n1].all())


def test_tiled_visits_only_the_classified_tiles(monkeypatch):
    import attn.tiled as tiled

    seen = []
    scores = tiled._Tile.scores

    def counting(self, q_blk, m0, m1, n0, n1, full):
        seen.append((m0, n0, full))
        return scores(self, q_blk, m0, m1, n0, n1, full)

    monkeypatch.setattr(tiled._Tile, "scores", counting)
    q, k, v = make_inputs(B=1, H=2, N=200, D=16, seed=0)
    spec = LaunchSpec(qk_scale=0.25, band=make_band(200, 200, causal=True, window=(40, 0)),
                      block_m=32, block_n=32)
    tiled_attention(q, k, v, spec)
    expected = [(m0, n0, full) for m0, _, row in spec.blocks(200, 200, 32, 32).query_blocks()
                for n0, _, full in row]
    assert sorted(seen) == sorted(expected)  # each classified tile once (work items: any order)
    assert len(seen) < (200 // 32 + 1) ** 2 // 2  # the window skips most of the grid


def test_float_masks_of_zero_and_minus_inf_read_as_bool():
    keep = torch.rand(3, 5) > 0.5
    f = torch.zeros(3, 5).masked_fill(~keep, float("-inf"))
    assert torch.equal(masks.as_bool_mask(f), keep)
    assert masks.as_bool_mask(f + 0.5) is None
    assert masks.as_bool_mask(keep) is keep


def test_window_conventions():
    assert masks.module_window(8, causal=True) == (8, 0)
    assert masks.module_window(8, causal=False) == (8, 8)
    assert masks.module_window((3, -1), causal=True) == (3, -1)
    assert masks.hf_sliding_window(4096) == (4095, 0)
    with pytest.raises(TypeError, match="window"):
        masks.window_pair(8)
    with pytest.raises(ValueError, match="sliding_window"):
        masks.hf_sliding_window(0)


# -- global positions: a shard reproduces the unsharded computation --------------------------

def _spec(n_q, n_k, **kw):
    return LaunchSpec(qk_scale=0.3, band=make_band(n_q, n_k, causal=True, window=(25, 0)),
                      dropout_p=0.2, dropout_seed=1234, block_m=16, block_n=16, **kw)


def _launcher(backend: str):
    """(attention launcher, dtype, tolerance): tiled in float64, triton (interpreter) in float32."""
    if backend == "tiled":
        return tiled_attention, torch.float64, 1e-12
    pytest.importorskip("triton")
    from attn.flash_triton import triton_attention

    return triton_attention, torch.float32, 2e-5


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_query_and_key_shards_reproduce_the_whole_dropout_included(backend):
    run, dtype, tol = _launcher(backend)
    B, H, Nq, Nk = 2, 4, 50, 70
    q, k, v = make_inputs(B=B, H=H, Hkv=2, N=Nq, Nk=Nk, D=16, dtype=dtype, seed=3)
    spec = _spec(Nq, Nk)
    out, lse = run(q, k, v, spec)
    # query shards
    parts = [run(q[:, :, a:b], k, v, spec.shard(q_start=a)) for a, b in [(0, 13), (13, 31), (31, 50)]]
    torch.testing.assert_close(torch.cat([o for o, _ in parts], 2), out, rtol=tol, atol=tol)
    # key shards, merged through their lse
    cuts = [(0, 20), (20, 21), (21, 70)]
    parts = [run(q, k[:, :, a:b], v[:, :, a:b], spec.shard(k_start=a)) for a, b in cuts]
    merged, merged_lse = attn.merge_attention([o for o, _ in parts], [l for _, l in parts])
    torch.testing.assert_close(merged, out, rtol=tol, atol=tol)
    torch.testing.assert_close(merged_lse, lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_head_shards_reproduce_the_whole_dropout_included(backend):
    run, dtype, tol = _launcher(backend)
    B, H, N = 2, 4, 40
    q, k, v = make_inputs(B=B, H=H, N=N, D=16, dtype=dtype, seed=4)
    spec = _spec(N, N)
    out, _ = run(q, k, v, spec)
    halves = [run(q[:, h:h + 2], k[:, h:h + 2], v[:, h:h + 2],
                  spec.shard(head_start=h, heads_total=H)) for h in (0, 2)]
    torch.testing.assert_close(torch.cat([o for o, _ in halves], 1), out, rtol=tol, atol=tol)
    # without the global head index the shard draws another mask: the test can fail
    wrong, _ = run(q[:, 2:], k[:, 2:], v[:, 2:], spec)
    assert not torch.allclose(wrong, out[:, 2:])


try:
    import triton
    import triton.language as tl

    from attn import flash_triton
    from attn.flash_triton import _stages

    @triton.jit
    def _stages_kernel(Out, n_own, n_other, offset, left, right, BLOCK_OWN: tl.constexpr,
                       BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK_OWN
        lo, a, b, hi = _stages(start, n_own, n_other, offset, left, right, BLOCK_OWN, BLOCK)
        base = Out + tl.program_id(0) * 4
        tl.store(base, lo)
        tl.store(base + 1, a)
        tl.store(base + 2, b)
        tl.store(base + 3, hi)
except ImportError:
    _stages_kernel = None


def test_triton_stage_split_agrees_with_the_band():
    """The kernels' in-register stage split (masked, full, masked) against masks.Band."""
    if _stages_kernel is None or not flash_triton._INTERPRET:
        pytest.skip("needs triton, in the interpreter")
    stages = _stages_kernel

    big = 1 << 30
    for band, (n_q, n_k), (bm, bn) in itertools.product(
            BANDS, [(37, 53), (64, 64), (5, 90)], [(16, 16), (8, 32)]):
        keep = _dense(band, n_q, n_k)
        nb = -(-n_q // bm)
        out = torch.zeros(nb, 4, dtype=torch.int32)
        stages[(nb,)](out, n_q, n_k, band.offset, big if band.left is None else band.left,
                      big if band.right is None else band.right, BLOCK_OWN=bm, BLOCK=bn)
        for i, (lo, a, b, hi) in enumerate(out.tolist()):
            m0, m1 = i * bm, min((i + 1) * bm, n_q)
            assert lo <= a <= b <= hi
            assert not keep[m0:m1, :lo].any() and not keep[m0:m1, hi:].any()
            for n0 in range(a, b, bn):  # the unmasked middle: every pair inside the band
                assert keep[m0:m1, n0:n0 + bn].all() and n0 + bn <= n_k and m0 + bm <= n_q


# -- recognising "causal + key padding" in an N x N mask -----------------------------------------

def _causal_padding_mask(B: int, n_q: int, n_k: int, lengths: list[int]) -> torch.Tensor:
    causal = _dense(make_band(n_q, n_k, causal=True, window=None), n_q, n_k)
    left_pad = torch.arange(n_k)[None, :] >= (n_k - torch.tensor(lengths))[:, None]  # (B, Nk)
    return causal[None, None] & left_pad[:, None, None, :]  # (B, 1, Nq, Nk)


def test_causal_plus_padding_masks_become_a_band_and_a_vector():
    mask = _causal_padding_mask(3, 40, 40, [40, 25, 3])
    band, padding = masks.simplify_mask(mask, Band())
    assert band == make_band(40, 40, causal=True, window=None)
    assert padding.shape == (3, 1, 1, 40)
    torch.testing.assert_close(padding & _dense(band, 40, 40), mask, rtol=0, atol=0)
    # the float form HF-style code builds with -inf is the same mask
    f = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert masks.simplify_mask(f, Band())[0] == band
    # a mask that is not of that form, or a real bias, is left alone
    noisy = mask.clone()
    noisy[1, 0, 30, 20] = ~noisy[1, 0, 30, 20]
    assert masks.simplify_mask(noisy, Band()) is None
    assert masks.simplify_mask(f.masked_fill(mask, 0.5), Band()) is None
    # no padding at all: just the band
    assert masks.simplify_mask(_causal_padding_mask(2, 9, 9, [9, 9]), Band()) == (
        make_band(9, 9, causal=True, window=None), None)


def test_attention_with_a_recognised_mask_skips_tiles_and_matches(monkeypatch):
    import attn.tiled as tiled

    q, k, v = make_inputs(B=3, H=4, Hkv=2, N=96, D=16, dtype=torch.float64, seed=5)
    mask = _causal_padding_mask(3, 96, 96, [96, 50, 7])
    seen = []
    scores = tiled._Tile.scores

    def counting(self, *args):
        seen.append(args[1:])
        return scores(self, *args)

    monkeypatch.setattr(tiled._Tile, "scores", counting)
    out = attn.attention(q, k, v, attn_mask=mask, backend="tiled", block_m=16, block_n=16)
    n_recognised, seen[:] = len(seen), []
    ref = attn.attention(q, k, v, attn_mask=mask, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the same mask with one extra hole is not recognised: every tile is visited
    odd = mask.clone()
    odd[0, 0, 50, 3] = False
    attn.attention(q, k, v, attn_mask=odd, backend="tiled", block_m=16, block_n=16)
    assert n_recognised == 21 and len(seen) == 36  # 6x6 tiles: the causal half vs all


def test_launchers_take_row_slices_of_out_and_lse():
    """A ring step passes views (rows of the global out and lse) to the backward launchers."""
    pytest.importorskip("triton")
    from attn import flash_triton, tiled

    q, k, v = make_inputs(B=2, H=3, N=40, Nk=30, D=16, seed=8)
    spec = LaunchSpec(qk_scale=0.25)
    for mod in (tiled, flash_triton):
        if mod is flash_triton and not flash_triton._INTERPRET:
            continue
        out, lse = mod._fwd(q, k, v, spec)
        do = torch.randn_like(out)
        rows = slice(10, 30)
        part = mod._bwd(do[:, :, rows], None, q[:, :, rows], k, v, out[:, :, rows],
                        lse[:, :, rows], spec.shard(q_start=0))
        whole = mod._bwd(do[:, :, rows].contiguous(), None, q[:, :, rows].contiguous(), k, v,
                         out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), spec)
        for a, b in zip(part[:3], whole[:3]):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-6)
