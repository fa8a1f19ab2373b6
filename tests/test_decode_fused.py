"""attn.decode on the fused read (attn.fused.paged_attention) where auto's table prefers
fused: against the float64 reference (ragged lengths, starts > 0, GQA, causal and windows,
sinks, ALiBi, fp32 and bf16), pages read as views of consecutive ids and never gathered
whole, the same bits wherever the pages lie, isolation, and when read_plan keeps tiled."""

from __future__ import annotations

import importlib

import pytest
import torch

import attn
from attn import choose, fused
from attn.kvcache import KVQuant, PagedKVCache
from test_decode import check_isolated, check_rows, variant_kwargs

decode_module = importlib.import_module("attn.decoding")

H, HKV, D = 4, 2, 16
# no key, one key, an awkward length, and past fused's split_min_keys (8192: ranges of 4096)
LENGTHS = [0, 1, 97, 9000]
STARTS = [0, 0, 5, 301]


def table_of(backend: str) -> dict:
    """An auto table whose every class and dtype prefers ``backend``."""
    cells = {c: {"backend": backend, "ratio": 0.5} for c in choose.CLASSES}
    dtypes = ("float32", "bfloat16", "float16", "float64")
    return {"testkind": {"cpu": "a test CPU", "entries": {d: cells for d in dtypes}}}


@pytest.fixture
def prefers(monkeypatch):
    """``prefers("fused")``: auto's table (as select_backend reads it) prefers that backend."""
    def set_to(backend: str) -> None:
        monkeypatch.setattr(choose, "cpu_kind", lambda: "testkind")
        monkeypatch.setattr(choose, "load_table", lambda: table_of(backend))
    return set_to


@pytest.fixture
def fused_reads(monkeypatch, prefers):
    """Fused preferred; the list of fused.paged_attention's calls (each its q's shape)."""
    prefers("fused")
    real, calls = fused.paged_attention, []
    monkeypatch.setattr(fused, "paged_attention",
                        lambda q, *a, **k: calls.append(tuple(q.shape)) or real(q, *a, **k))
    return calls


def layout_ids(n: int, layout: str, g: torch.Generator) -> torch.Tensor:
    """Page ids in the storage: "in order", "shuffled", or "runs" (runs of 3 consecutive
    ids, the runs in reverse order: spans that are views, but not one span)."""
    if layout == "in order":
        return torch.arange(n)
    if layout == "shuffled":
        return torch.randperm(n, generator=g)
    return torch.arange(n).view(-1, 1).flip(0)[:, 0] if n < 3 else torch.cat(
        [torch.arange(a, min(a + 3, n)) for a in reversed(range(0, n, 3))])


def cache_of(lengths, page: int, layout: str, *, starts=STARTS, heads=(H, HKV), seed=0,
             dtype=torch.float32):
    """q's generator and a cache of random pages (Dv = D: torch's op needs them equal)
    holding ``lengths`` per sequence from ``starts``, its pages laid out by ``layout``,
    two spare pages."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(1, -(-max(lengths) // page))
    B = len(lengths)
    num_blocks = B * per_seq + 2
    k_pages, v_pages = (torch.randn(num_blocks, page, heads[1], D, generator=g).to(dtype)
                        for _ in range(2))
    table = layout_ids(num_blocks, layout, g)[:B * per_seq].view(B, per_seq).int()
    cache = PagedKVCache(k_pages, v_pages, table, torch.tensor(lengths),
                         starts=torch.tensor(starts[:B]))
    return cache, g


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": (50, 0)},
    "alibi": {"causal": True, "alibi_slopes": "per row"},
    "sinks": {"sinks": True, "window": (3000, 2)},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("nq", [1, 5])
def test_fused_read_matches_the_reference(fused_reads, variant, nq):
    cache, g = cache_of(LENGTHS, 16, "shuffled")
    q = torch.randn(len(LENGTHS), H, nq, D, generator=g)
    kw = variant_kwargs(variant, len(LENGTHS), g, VARIANTS)
    assert decode_module.read_plan(q, cache, **kw)[0] == "fused"
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    assert fused_reads == [tuple(q.shape)]
    check_rows(q, cache, out, lse, **kw)


@pytest.mark.parametrize("heads", [(8, 2), (4, 1)])
def test_bf16_gqa_mqa_and_seq_ids(fused_reads, heads):
    """bf16 pages and q, GQA 4:1 and MQA, Nq = 3 causal and windowed, q's rows naming the
    cache's sequences in another order (one twice)."""
    cache, g = cache_of([2300, 40, 0, 131], 64, "runs", starts=[3, 40, 0, 7], heads=heads,
                        dtype=torch.bfloat16)
    seq_ids = torch.tensor([3, 0, 1, 3, 2])
    q = torch.randn(5, heads[0], 3, D, generator=g).to(torch.bfloat16)
    for kw in ({"causal": True}, {"causal": True, "window": (60, 1)},
               {"sinks": torch.randn(heads[0], generator=g)}):
        with torch.inference_mode():
            out, lse = attn.decode(q, cache, seq_ids=seq_ids, return_lse=True, **kw)
        assert out.dtype == torch.bfloat16
        check_rows(q, cache, out, lse, rows=seq_ids.tolist(), **kw)
    assert len(fused_reads) == 3


def test_pages_are_views_and_copies_stay_within_a_range(fused_reads, monkeypatch):
    """In order, every range is one view of the storage; in runs, a range of several spans
    copies its own pages only (at most one range's keys), never a sequence nor the cache."""
    for name in ("sequence_kv", "batch_kv", "packed_kv"):
        monkeypatch.setattr(PagedKVCache, name, lambda *a, **k: pytest.fail("gathered"))
    real, spans = fused.page_span, []

    def page_span(storage, row, a, z):
        keys, view = real(storage, row, a, z)
        spans.append((z - a, view, keys.data_ptr() - storage.data_ptr() if view else None))
        return keys, view
    monkeypatch.setattr(fused, "page_span", page_span)
    for layout in ("in order", "runs"):
        spans.clear()
        cache, g = cache_of(LENGTHS, 16, layout)
        q = torch.randn(len(LENGTHS), H, 1, D, generator=g)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, return_lse=True)
        check_rows(q, cache, out, lse)
        # k and v of: one key, 92 keys, 9000 - 301 keys in ranges cut at 4096 and 8192
        assert sorted(n for n, _, _ in spans) == sorted(2 * [1, 92, 4096 - 301, 4096, 808])
        if layout == "in order":
            assert all(view for _, view, _ in spans)
        else:
            assert not all(view for _, view, _ in spans)
            assert max(n for n, _, _ in spans) <= 4096 < int(cache.lengths.max())
    spans.clear()  # a window: each row reads the 51 keys it reaches, no other range
    with torch.no_grad():
        out, lse = attn.decode(q, cache, window=(50, 0), return_lse=True)
    check_rows(q, cache, out, lse, window=(50, 0))
    assert sorted(n for n, _, _ in spans) == sorted(2 * [1, 51, 51])


def test_the_op_gets_keys_packed_past_decoding(fused_reads, monkeypatch):
    """A view of pages interleaves the kv heads per key: chunked prefill (more query rows
    than decoding's 16) hands torch's op each head's rows packed, since it rereads them more
    slowly than a copy costs; decoding hands it the view itself (it reads each key once)."""
    ops, strides = fused._cpu_ops(), []

    def fwd(q, k, v, *a, **kw):
        strides.append((k.shape[2], k.stride(2), v.stride(2)))
        return ops.fwd(q, k, v, *a, **kw)
    monkeypatch.setattr(fused, "_cpu_ops", lambda: ops._replace(fwd=fwd))
    # every sequence from position 0: 20 rows against 400 keys are a chunk (against fewer
    # than 160 they would be a tiny call, which auto sends to tiled where fused cuts it per
    # sequence, as a bottom-right diagonal does)
    cache, g = cache_of([0, 1, 97, 400], 16, "in order", starts=(0, 0, 0, 0))
    for nq, stride in ((20, D), (1, HKV * D)):
        strides.clear()
        q = torch.randn(4, H, nq, D, generator=g)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, causal=True, return_lse=True)
        check_rows(q, cache, out, lse, causal=True)
        long = [st for n, *st in strides if n > 1]  # one key lies as it is
        assert len(long) >= 2 and all(st == [stride, stride] for st in long)


def test_same_bits_wherever_the_pages_lie(fused_reads):
    """The same sequences in pages in order, in runs and shuffled: identical bits (the cut
    depends on the lengths, not on the spans)."""
    results = []
    for layout in ("in order", "runs", "shuffled"):
        cache, _ = cache_of(LENGTHS, 16, "in order", seed=3)
        ids = layout_ids(cache.k_pages.shape[0], layout, torch.Generator().manual_seed(4))
        k, v = torch.empty_like(cache.k_pages), torch.empty_like(cache.v_pages)
        k[ids], v[ids] = cache.k_pages.clone(), cache.v_pages.clone()  # page i moves to ids[i]
        moved = PagedKVCache(k, v, ids[cache.host_table].int(), cache.lengths,
                             starts=cache.starts)
        q = torch.randn(len(LENGTHS), H, 2, D, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            results.append(attn.decode(q, moved, causal=True, return_lse=True,
                                       sinks=torch.ones(H)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["runs", "shuffled"])
def test_sequences_are_isolated(fused_reads, layout):
    """NaN in spare pages, in slots before a sequence's start or past its length, or in
    another sequence's pages, changes no bit of a sequence's output."""
    lengths, starts, page = [2200, 33, 0, 70], [5, 0, 0, 2], 16
    cache, g = cache_of(lengths, page, layout, starts=starts)
    q = torch.randn(4, H, 2, D, generator=g)
    check_isolated(q, cache, sinks=torch.randn(H, generator=g))  # not causal: all read
    assert len(fused_reads) == 3


def test_a_masked_nan_key_sends_its_row_to_tiled(fused_reads, monkeypatch):
    """Chunked prefill with a window: a NaN key that the window hides from some query rows
    (torch's op would add the mask to its NaN score) reaches none of them, as on tiled, and
    only its own sequence leaves the fused read: the other's bits do not move."""
    tiled_rows = []
    real = decode_module.tiled.paged_attention
    monkeypatch.setattr(decode_module.tiled, "paged_attention",
                        lambda q, *a, **k: tiled_rows.append(q.shape[0]) or real(q, *a, **k))
    cache, g = cache_of([200, 300], 16, "runs", starts=[0, 0])
    q = torch.randn(2, H, 8, D, generator=g)
    kw = dict(causal=True, window=(4, 0))
    with torch.no_grad():
        clean = attn.decode(q, cache, return_lse=True, **kw)
    assert not tiled_rows
    slot = 300 - 8 - 4  # row 0's first key: rows 1..7 do not see it
    # the key only: a masked value's NaN may reach a row through 0·NaN (DESIGN.md)
    cache.k_pages[cache.host_table[1, slot // 16], slot % 16] = float("nan")
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    assert tiled_rows == [1]  # sequence 1 alone
    assert torch.equal(out[0], clean[0][0]) and torch.equal(lse[0], clean[1][0])
    assert out[1, :, 0].isnan().all()
    torch.testing.assert_close(out[1, :, 1:], clean[0][1, :, 1:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[1, :, 1:], clean[1][1, :, 1:], rtol=1e-5, atol=1e-6)


def test_read_plan_keeps_tiled_where_fused_cannot_or_is_not_preferred(prefers):
    cache, g = cache_of([40, 7], 16, "shuffled", starts=[0, 0])
    q = torch.randn(2, H, 1, D, generator=g)
    prefers("fused")
    plan, why = decode_module.read_plan(q, cache, sinks=torch.zeros(H), return_lse=True)
    assert plan == "fused" and "attn.fused.paged_attention" in why
    plan, why = decode_module.read_plan(q, cache, softcap=2.0)
    assert plan == "tiled" and "softcap" in why
    plan, why = decode_module.read_plan(q.bfloat16(), cache, alibi_slopes=torch.rand(H))
    assert plan == "tiled" and "alibi_slopes in a 16-bit dtype" in why
    quantized = PagedKVCache.allocate(8, 16, HKV, D, max_seqs=2, quant=KVQuant("int8"))
    quantized.append(torch.randn(2, HKV, 20, D), torch.randn(2, HKV, 20, D))
    plan, why = decode_module.read_plan(q, quantized)
    assert plan == "tiled" and "int8 quantized cache" in why
    with torch.no_grad():  # and it reads there: within the quantization's reach of fp32
        out = attn.decode(q, quantized)
    assert out.shape == (2, H, 1, D) and out.isfinite().all()
    prefers("tiled")  # the table's choice, named in the reason
    plan, why = decode_module.read_plan(q, cache)
    assert plan == "tiled" and "measured on testkind (a test CPU): decode float32" in why
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True)
    check_rows(q, cache, out, lse)


def test_explicit_fused_paged_attention_refuses_what_it_cannot_read():
    from attn.masks import make_band
    from attn.spec import LaunchSpec, Operands, PageTable
    cache, g = cache_of([40], 16, "in order", starts=[0])
    q = torch.randn(1, H, 1, D, generator=g)
    pages = PageTable(cache.host_table, cache.starts, cache.lengths)
    spec = LaunchSpec(qk_scale=D ** -0.5, band=make_band(1, 0, causal=False, window=None))
    with pytest.raises(NotImplementedError, match="softcap"):
        fused.paged_attention(q, cache.k_pages, cache.v_pages,
                              LaunchSpec(qk_scale=1.0, band=spec.band, softcap=2.0),
                              Operands(pages=pages))
    with pytest.raises(ValueError, match="ops.pages"):
        fused.paged_attention(q, cache.k_pages, cache.v_pages, spec, Operands())
    with pytest.raises(ValueError, match="forward only"):
        fused.paged_attention(q.requires_grad_(), cache.k_pages, cache.v_pages, spec,
                              Operands(pages=pages))
