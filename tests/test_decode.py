"""attn.decode against the float64 reference on the same K/V: the tiled backend reading a
paged cache through its block table (ragged lengths, pages of 1 to 3000 positions, pages in
order and shuffled), every variant decode takes, isolation of sequences, the same bits on
1, 2 and 3 workers, and its checks."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import attn
from attn.kvcache import PagedKVCache
from attn.testing import assert_close_to_reference
from attn.tiled import cpu
from test_kvquant import FORMATS

H, HKV, D = 4, 2, 16
# 0 keys, one key, an awkward length, and one past kv_split's 2048-key chunk (two items)
LENGTHS = [0, 1, 97, 2500]

needs_workers = pytest.mark.skipif(not cpu.openmp_threads(),
                                   reason="workers run only under OpenMP intra-op threads")


def paged(lengths, page: int, *, shuffled: bool, starts=None, heads=(H, HKV), seed: int = 0,
          dtype=torch.float32):
    """q (B, H, 1, D) and a cache of random pages holding ``lengths`` keys per sequence, its
    pages shuffled in the storage or in order, two spare pages, every slot filled."""
    g = torch.Generator().manual_seed(seed)
    per_seq = max(1, -(-max(lengths) // page))
    B = len(lengths)
    num_blocks = B * per_seq + 2
    k_pages = torch.randn(num_blocks, page, heads[1], D, generator=g).to(dtype)
    v_pages = torch.randn(num_blocks, page, heads[1], D + 8, generator=g).to(dtype)  # Dv != D
    ids = torch.randperm(num_blocks, generator=g) if shuffled else torch.arange(num_blocks)
    table = ids[:B * per_seq].view(B, per_seq).int()
    cache = PagedKVCache(k_pages, v_pages, table, torch.tensor(lengths), starts=starts)
    return cache, g


def dense_kv(cache: PagedKVCache, s: int):
    """Sequence s's keys and values as (1, Hkv, N_s, D): the oracle's copy (of a quantized
    cache: its dequantized values, checked against the appended ones in test_kvcache.py)."""
    if cache.quant is not None:
        return tuple(t.transpose(0, 1)[None] for t in cache.sequence_kv(s))
    a, z = int(cache.starts[s]), int(cache.lengths[s])
    ids = cache.host_table[s]
    return tuple(p[ids].flatten(0, 1)[a:z].transpose(0, 1)[None].clone()
                 for p in (cache.k_pages, cache.v_pages))


def check_rows(q, cache, out, lse, rows=None, **variant):
    """Each row of ``out``/``lse`` against the float64 reference on its sequence's keys,
    within DESIGN.md's budget (2x plain PyTorch's error in q's dtype plus a floor)."""
    rows = range(q.shape[0]) if rows is None else rows
    for i, s in enumerate(rows):
        k, v = dense_kv(cache, s)
        kw = dict(variant)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].dim() == 2:
            kw["alibi_slopes"] = kw["alibi_slopes"][i:i + 1]
        if k.shape[2] == 0:  # no key: zeros, lse -inf (or the sink)
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            sinks = kw.get("sinks")
            want = (torch.full_like(lse[i], float("-inf")) if sinks is None
                    else sinks.view(-1, 1).expand_as(lse[i]).float())
            assert torch.equal(lse[i], want)
            continue

        def got(*_, return_lse=False, **__):
            return (out[i:i + 1], lse[i:i + 1]) if return_lse else out[i:i + 1]
        assert_close_to_reference(got, q[i:i + 1], k.to(q.dtype), v.to(q.dtype), grad=False,
                                  **kw)


def check_isolated(q, cache: PagedKVCache, **kw):
    """NaN in every slot outside the sequences' own keys (spare pages, before a start, past
    a length) changes no bit; NaN in the last sequence's own pages changes its row only."""
    with torch.no_grad():
        clean = attn.decode(q, cache, return_lse=True, **kw)
    page, last = cache.page_size, cache.batch - 1
    live = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool)
    for s in range(cache.batch):
        for t in range(int(cache.starts[s]), int(cache.lengths[s])):
            live[cache.host_table[s, t // page], t % page] = True
    for pages in (cache.k_pages, cache.v_pages):
        pages[~live] = float("nan")
    with torch.no_grad():
        dirty = attn.decode(q, cache, return_lse=True, **kw)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    for pages in (cache.k_pages, cache.v_pages):
        pages[cache.host_table[last]] = float("nan")
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    assert torch.equal(out[:last], clean[0][:last])
    assert torch.equal(lse[:last], clean[1][:last])
    assert out[last].isnan().all()


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": (50, 0)},
    "softcap+scale": {"softcap": 2.0, "scale": 0.7},
    "alibi": {"causal": True, "alibi_slopes": "per row"},
    "sinks": {"sinks": True},
}


def variant_kwargs(name: str, B: int, g: torch.Generator, variants: dict | None = None
                   ) -> dict:
    """``variants[name]`` (default :data:`VARIANTS`) with its ALiBi slopes and sinks drawn."""
    kw = dict((variants or VARIANTS)[name])
    if kw.get("alibi_slopes") == "per row":
        kw["alibi_slopes"] = torch.rand(B, H, generator=g)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(H, generator=g)
    return kw


@pytest.mark.parametrize("page", [1, 3, 16, 64, 3000])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_decode_matches_the_reference(variant, page):
    cache, g = paged(LENGTHS, page, shuffled=True)
    q = torch.randn(len(LENGTHS), H, 1, D, generator=g)
    kw = variant_kwargs(variant, len(LENGTHS), g)
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    check_rows(q, cache, out, lse, **kw)


@pytest.mark.parametrize("page", [3, 64])
@pytest.mark.parametrize("shuffled", [False, True])
def test_several_queries_starts_and_seq_ids(page, shuffled):
    """Nq = 5 causal (bottom-right per sequence) and windowed, sequences with a left pad,
    and q's rows naming the cache's sequences in another order (one of them twice)."""
    lengths = [2300, 40, 0, 131]
    cache, g = paged(lengths, page, shuffled=shuffled, starts=torch.tensor([3, 40, 0, 7]))
    seq_ids = torch.tensor([3, 0, 1, 3, 2])
    q = torch.randn(5, H, 5, D, generator=g)
    for kw in ({"causal": True}, {"causal": True, "window": (60, 1)}, {"window": (2, 2)}):
        with torch.inference_mode():
            out, lse = attn.decode(q, cache, seq_ids=seq_ids, return_lse=True, **kw)
        check_rows(q, cache, out, lse, rows=seq_ids.tolist(), **kw)


def test_gqa_mqa_and_bf16():
    for heads, dtype in (((8, 1), torch.float32), ((4, 4), torch.float32),
                         ((4, 2), torch.bfloat16)):
        cache, g = paged([300, 2100], 16, shuffled=True, heads=heads, dtype=dtype)
        q = torch.randn(2, heads[0], 2, D, generator=g).to(dtype)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, causal=True, return_lse=True)
        assert out.dtype == dtype
        check_rows(q, cache, out, lse, causal=True)


def test_pages_stored_in_another_dtype_are_read_as_q():
    """bf16 pages, fp32 q: the result is attention on the bf16 values in fp32."""
    cache, g = paged([70, 2049], 16, shuffled=True, dtype=torch.bfloat16)
    q = torch.randn(2, H, 1, D, generator=g)
    with torch.no_grad():
        out, lse = attn.decode(q, cache, causal=True, return_lse=True)
    assert out.dtype == torch.float32
    check_rows(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("shuffled", [False, True])
def test_sequences_are_isolated(page, shuffled):
    """NaN in spare pages, in slots past each sequence's length and before its start, or in
    another sequence's keys, never changes a sequence's output bit."""
    lengths = [2200, 33, 0, 70]
    starts = torch.tensor([5, 0, 0, 2])
    cache, g = paged(lengths, page, shuffled=shuffled, starts=starts)
    q = torch.randn(4, H, 2, D, generator=g)
    # not causal: a key read past a sequence's end would be attended, not masked
    kw = dict(softcap=3.0, sinks=torch.randn(H, generator=g))
    check_isolated(q, cache, **kw)


@needs_workers
@pytest.mark.parametrize("shuffled", [False, True])
def test_same_bits_with_1_2_3_workers(shuffled):
    cache, g = paged([2500, 4100, 97, 3000], 16, shuffled=shuffled)
    q = torch.randn(4, 8, 1, D, generator=g)  # 8 heads: past serial_max_scores, on the pool
    kw = dict(causal=True, alibi_slopes=torch.rand(8, generator=g))
    before = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.no_grad():
                results.append(attn.decode(q, cache, return_lse=True, **kw))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_pages_are_read_in_place_not_gathered(monkeypatch):
    """On CPU no read copies a sequence's keys whole: the cache's copying reads are not
    called, and pages in order are read as views (no index_select at all)."""
    for name in ("sequence_kv", "batch_kv", "packed_kv"):
        monkeypatch.setattr(PagedKVCache, name, lambda *a, **k: pytest.fail("gathered"))
    cache, g = paged([2500, 300], 16, shuffled=False)
    q = torch.randn(2, H, 1, D, generator=g)
    real = torch.Tensor.index_select
    calls = []
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, *a: calls.append(self.shape) or real(self, *a))
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True)
    assert not [s for s in calls if s == cache.k_pages.shape]
    check_rows(q, cache, out, lse)


def test_attn_decode_is_the_entry():
    import attn.decoding as module  # importing the module leaves attn.decode the function
    assert attn.decode is module.decode and "decode" in attn.__all__
    cache, g = paged([5, 9], 3, shuffled=True)
    q = torch.randn(2, H, 1, D, generator=g)
    with torch.no_grad():
        assert torch.equal(attn.decode(q, cache), module.decode(q, cache))


def test_bad_input_names_the_argument():
    cache, g = paged([5, 9], 3, shuffled=True)
    q = torch.randn(2, H, 1, D, generator=g)
    with pytest.raises(TypeError, match=r"cache must be an attn.kvcache.PagedKVCache, got dict"):
        attn.decode(q, {})
    with pytest.raises(ValueError, match=r"B = 2 sequences .* got \(3, 4, 1, 16\)"):
        attn.decode(torch.randn(3, H, 1, D), cache)
    with pytest.raises(ValueError, match=r"seq_ids \[0, 2\] must lie in \[0, 2\)"):
        attn.decode(q, cache, seq_ids=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"seq_ids must be \(B,\) .* got seq_ids \(3,\) and q "
                                         r"\(2, 4, 1, 16\)"):
        attn.decode(q, cache, seq_ids=[0, 1, 1])
    with pytest.raises(TypeError, match=r"seq_ids must be a \(B,\) int32"):
        attn.decode(q, cache, seq_ids=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"q \(B, H, Nq, D\) = \(2, 4, 1, 8\) .* \(8, 3, 2, "
                                         r"16\)"):
        attn.decode(q[..., :8], cache)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape"):
        attn.decode(q, cache, alibi_slopes=torch.rand(3))
    with pytest.raises(ValueError, match=r"forward only"):
        attn.decode(q.requires_grad_(), cache)


# -- quantized caches: attention on the dequantized values ------------------------------------

DQ = 64  # quantized caches: head dims split into groups of 32 (Dv = 96)


def quantized(lengths, page: int, quant: str, *, heads=(H, HKV), seed: int = 0,
              dtype=torch.float32, rounds: int = 3):
    """An allocated cache of format ``FORMATS[quant]`` holding ``lengths`` keys per sequence,
    appended in ``rounds`` interleaved pieces of random sizes (so a sequence's pages are
    consecutive within a piece and not across pieces), fp8 scales per head; and a generator
    for the queries."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv = len(lengths), heads[1]
    pages = sum(-(-n // page) for n in lengths) + 2 * B + 2
    cache = PagedKVCache.allocate(pages, page, Hkv, DQ, head_dim_v=DQ + 32, max_seqs=B,
                                  quant=FORMATS[quant], dtype=dtype,
                                  fp8_scales=(0.02 + 0.01 * torch.arange(Hkv), 0.015))
    cuts = [sorted(torch.randint(0, n + 1, (rounds - 1,), generator=g).tolist()) for n in lengths]
    bounds = [[0, *c, n] for c, n in zip(cuts, lengths)]
    with torch.inference_mode():
        for r in range(rounds):
            for s in range(B):
                m = bounds[s][r + 1] - bounds[s][r]
                if m:
                    cache.append(torch.randn(1, Hkv, m, DQ, generator=g),
                                 torch.randn(1, Hkv, m, DQ + 32, generator=g), seq_ids=[s])
    return cache, g


@functools.lru_cache(maxsize=8)
def shared_quantized(lengths: tuple[int, ...], page: int, quant: str) -> PagedKVCache:
    """:func:`quantized`, built once for the tests that only read it."""
    return quantized(lengths, page, quant)[0]


@pytest.mark.parametrize("quant", list(FORMATS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantized_decode_matches_the_reference_on_dequantized_values(variant, quant):
    lengths = (0, 1, 97, 700)
    cache = shared_quantized(lengths, 16, quant)
    g = torch.Generator().manual_seed(len(variant))
    q = torch.randn(len(lengths), H, 1, DQ, generator=g)
    kw = variant_kwargs(variant, len(lengths), g)
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    check_rows(q, cache, out, lse, **kw)


# each format on two page sizes, each page size with three formats: one key, pages of a few
# keys, pages longer than the 2048-key ranges of the items (cut inside the page)
PAGE_CASES = [(1, "int8"), (1, "fp8"), (1, "int4 kivi"), (3, "int8 g32"), (3, "int4"),
              (3, "int8 recent"), (64, "int8"), (64, "fp8"), (64, "int4 kivi"),
              (3000, "int8 g32"), (3000, "int4"), (3000, "int8 recent")]


@pytest.mark.parametrize("page,quant", PAGE_CASES)
def test_quantized_pages_of_any_size(quant, page):
    cache, g = quantized([2500, 0, 97, 40], page, quant, seed=page)
    q = torch.randn(4, H, 1, DQ, generator=g)
    with torch.no_grad():
        out, lse = attn.decode(q, cache, causal=True, return_lse=True)
    check_rows(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("quant", ["int8", "int4 kivi"])
def test_quantized_chunked_prefill_gqa_and_bf16(quant):
    """Nq = 5 with seq_ids in another order, causal and windowed; GQA / MQA; bf16 q over bf16
    full-precision pages."""
    cache, g = quantized([2300, 40, 0, 131], 16, quant)
    seq_ids = torch.tensor([3, 0, 1, 3, 2])
    q = torch.randn(5, H, 5, DQ, generator=g)
    for kw in ({"causal": True}, {"causal": True, "window": (60, 1)}):
        with torch.inference_mode():
            out, lse = attn.decode(q, cache, seq_ids=seq_ids, return_lse=True, **kw)
        check_rows(q, cache, out, lse, rows=seq_ids.tolist(), **kw)
    for heads, dtype in (((8, 1), torch.float32), ((4, 4), torch.float32),
                         ((4, 2), torch.bfloat16)):
        cache, g = quantized([300, 2100], 16, quant, heads=heads, dtype=dtype)
        q = torch.randn(2, heads[0], 2, DQ, generator=g).to(dtype)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, causal=True, return_lse=True)
        assert out.dtype == dtype
        check_rows(q, cache, out, lse, causal=True)


@pytest.mark.parametrize("quant", ["int8 g32", "int4 kivi", "fp8"])
def test_quantized_cache_on_the_other_devices_strategies(monkeypatch, quant):
    """Where the tiles do not read pages (other devices; emptied here), the keys in use are
    dequantized into the batched (equal lengths) or packed (ragged) copy."""
    monkeypatch.setattr(importlib.import_module("attn.decoding"), "_PAGED_DEVICES", ())
    for lengths in ([300, 300], [300, 2100, 7]):
        cache, g = quantized(lengths, 16, quant)
        q = torch.randn(len(lengths), H, 2, DQ, generator=g)
        kw = dict(causal=True, sinks=torch.randn(H, generator=g))
        with torch.no_grad():
            out, lse = attn.decode(q, cache, return_lse=True, **kw)
        check_rows(q, cache, out, lse, **kw)


def poison_unused(cache: PagedKVCache, code: int | None = None) -> None:
    """NaN in every scale and full-precision slot no sequence of a quantized ``cache`` holds
    (spare pages, slots past a length), and ``code`` (e.g. fp8's NaN byte) in every such
    code slot."""
    page, W = cache.page_size, cache.quant.recent_pages
    coded = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool)
    ring = torch.zeros(cache.batch * W, page, dtype=torch.bool)
    recent_from = cache.recent_from()
    for s in range(cache.batch):
        for t in range(int(cache.lengths[s])):
            at = (cache.host_table[s, t // page], t % page)
            (ring if t // page >= recent_from[s] else coded)[at] = True
    coded, ring = coded.to(cache.k_pages.device), ring.to(cache.k_pages.device)
    if code is not None:
        for codes in (cache.k_pages, cache.v_pages):
            codes[~coded] = code
    for scales in (cache.k_scales, cache.v_scales):
        if scales.dim() == 4 and scales.shape[1] == page:
            scales[~coded] = float("nan")
        elif scales.dim() == 4:  # per channel: a page's one row
            scales[~coded.any(1)] = float("nan")
    for t in (cache.recent_k, cache.recent_v):
        if t is not None:
            t[~ring] = float("nan")


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4 kivi"])
def test_quantized_sequences_are_isolated(quant):
    """NaN in every scale and full-precision slot no sequence uses (spare pages, slots past
    a length) never changes an output bit; NaN in one sequence's scales changes only its
    row."""
    cache, g = quantized([2200, 33, 0, 70], 3, quant)
    q = torch.randn(4, H, 2, DQ, generator=g)
    kw = dict(softcap=3.0, sinks=torch.randn(H, generator=g))
    with torch.no_grad():
        clean = attn.decode(q, cache, return_lse=True, **kw)
    poison_unused(cache)
    recent_from = cache.recent_from()
    with torch.no_grad():
        dirty = attn.decode(q, cache, return_lse=True, **kw)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    if cache.k_scales.dim() == 4:  # sequence 3's own pages: only its row changes
        cache.k_scales[cache.host_table[3, :int(recent_from[3])]] = float("nan")
        with torch.no_grad():
            out, lse = attn.decode(q, cache, return_lse=True, **kw)
        assert torch.equal(out[:3], clean[0][:3]) and torch.equal(lse[:3], clean[1][:3])
        assert out[3].isnan().all()


def test_quantized_decode_is_forward_only():
    cache, g = quantized([5, 40], 16, "int4 kivi")
    q = torch.randn(2, H, 1, DQ, generator=g, requires_grad=True)
    with pytest.raises(ValueError, match=r"a quantized cache is forward only .* torch.no_grad"):
        attn.decode(q, cache)
    cache.recent_k.requires_grad_()
    with pytest.raises(ValueError, match=r"a quantized cache is forward only"):
        attn.decode(q.detach(), cache)
    with torch.no_grad():  # under no_grad both read
        attn.decode(q, cache)


@pytest.mark.parametrize("quant", [None, "int8", "int4 kivi"])
def test_decode_after_freeing_pages_outside_the_window(quant):
    """Pages freed outside the window (16, 0): later steps, with keys appended and every
    query's window inside what was kept, equal the reference on the whole sequences (the
    freed positions filled with zeros, which the window masks); a wider window raises."""
    g = torch.Generator().manual_seed(5)
    page, left, Dq = 4, 16, DQ if quant else D
    kw = dict(quant=FORMATS[quant]) if quant else {}
    cache = PagedKVCache.allocate(64, page, HKV, Dq, max_seqs=3, **kw)
    for s, n in enumerate((90, 5, 41)):
        cache.append(torch.randn(1, HKV, n, Dq, generator=g),
                     torch.randn(1, HKV, n, Dq, generator=g), seq_ids=[s])
    assert cache.free_outside_window((left, 0)) > 0
    window = dict(causal=True, window=(left, 0))
    for n_new in (1, 3):  # a decode step, then a chunk of three queries
        cache.append(torch.randn(3, HKV, n_new, Dq, generator=g),
                     torch.randn(3, HKV, n_new, Dq, generator=g))
        q = torch.randn(3, H, n_new, Dq, generator=g)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, return_lse=True, **window,
                                   sinks=torch.zeros(H))
        for s in range(3):
            k, v = dense_kv(cache, s)
            gone = int(cache.starts[s])
            k, v = (torch.cat([t.new_zeros(1, HKV, gone, Dq), t], 2) for t in (k, v))

            def got(*_, return_lse=False, i=s, **__):
                return (out[i:i + 1], lse[i:i + 1]) if return_lse else out[i:i + 1]
            assert_close_to_reference(got, q[s:s + 1], k, v, grad=False, **window,
                                      sinks=torch.zeros(H))
        cache.free_outside_window((left, 0))
    q = torch.randn(3, H, 1, Dq, generator=g)
    with pytest.raises(ValueError, match=r"window \(17, 0\) with 1 queries reaches key .* "
                                         r"given back by free_outside_window"):
        attn.decode(q, cache, causal=True, window=(17, 0))
    with pytest.raises(ValueError, match=r"window None with 1 queries reaches every key"):
        attn.decode(q, cache, causal=True)


@pytest.mark.parametrize("quant,page", [("int8", 16), ("int8 t recent", 3)])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap+scale", "alibi", "sinks"])
def test_quantized_q_is_exact_for_a_q_that_int8_holds(variant, quant, page):
    """Query rows of integers in [-127, 127] reaching 127 are their own int8 codes (whatever
    scale q is multiplied by first): ``quantized_q`` must then match float64 attention on the
    dequantized keys within the usual budget, pages shuffled, ragged, GQA, recent pages."""
    lengths = [0, 1, 97, 2500]
    cache, g = quantized(lengths, page, quant, seed=page)
    Nq = 3 if variant == "window" else 1
    q = torch.randint(-127, 128, (len(lengths), H, Nq, DQ), generator=g).float()
    q[..., 5] = 127.0
    kw = {"scale": 0.004, **variant_kwargs(variant, len(lengths), g)}
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, quantized_q=True, **kw)
    check_rows(q, cache, out, lse, **kw)


@pytest.mark.parametrize("quant,page", [("int8", 16), ("int8 t recent", 3)])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap+scale", "sinks"])
def test_quantized_q_scores_int8_keys_within_what_rounding_q_moves(variant, quant, page):
    """``quantized_q``: q rounded to int8 per row (step ``max|row| / 127``) moves each score
    ``scale·q·k_j`` by at most ``δ = scale · max|row| / 254 · Σ_d |k_jd|`` (softcap is
    1-Lipschitz; ALiBi, masks and sinks do not move), so each output by at most
    ``(e^{2δ} − 1) · max|v|``: the result must sit within that of float64 attention on the
    dequantized keys (plus fp32 rounding), and it must differ from the unrounded decode's."""
    lengths = [0, 1, 97, 2500]
    cache, g = quantized(lengths, page, quant, seed=page)
    Nq = 3 if variant == "window" else 1
    q = torch.randn(len(lengths), H, Nq, DQ, generator=g)
    kw = variant_kwargs(variant, len(lengths), g)
    with torch.no_grad():
        out = attn.decode(q, cache, quantized_q=True, **kw)
        plain = attn.decode(q, cache, **kw)
    if not (variant == "window" and FORMATS[quant].recent_pages):  # (a window inside the
        assert not torch.equal(out, plain)  # full-precision pages reads no codes)
    scale = kw.get("scale", DQ ** -0.5)
    for s in range(len(lengths)):
        k, v = dense_kv(cache, s)
        want = attn.attention(q[s:s + 1].double(), k.double(), v.double(), backend="reference",
                              **kw)
        if k.shape[2] == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))
            continue
        G = H // HKV
        # (1, H, Nq, 1) max|row| x (1, Hkv, 1, Nk) sum |k| -> the largest move per row
        k1 = k.abs().sum(-1).repeat_interleave(G, dim=1)[:, :, None]
        delta = (scale * q[s:s + 1].abs().amax(-1, keepdim=True).double() / 254
                 * k1.double()).amax(-1)
        bound = (torch.exp(2 * delta) - 1) * v.abs().max().double() + 1e-5
        err = (out[s:s + 1].double() - want).abs().amax(-1)
        assert (err <= bound).all(), (err.max().item(), bound.min().item())


def test_quantized_q_is_refused_where_it_cannot_run(monkeypatch):
    q = torch.randn(2, H, 1, DQ)
    for name in ("int8 g32", "int4", "fp8"):
        cache = shared_quantized((5, 40), 16, name)
        with torch.no_grad(), pytest.raises(ValueError, match=r"quantized_q scores int8 keys "
                                                                r"with one scale per token"):
            attn.decode(q, cache, quantized_q=True)
    plain, _ = paged([5, 40], 16, shuffled=False)
    with torch.no_grad(), pytest.raises(ValueError, match=r"but the cache holds torch.float32"):
        attn.decode(torch.randn(2, H, 1, D), plain, quantized_q=True)
    monkeypatch.setattr(importlib.import_module("attn.decoding"), "_PAGED_DEVICES", ())
    with torch.no_grad(), pytest.raises(ValueError, match=r"quantized_q runs on the tiled read"):
        attn.decode(q, shared_quantized((5, 40), 16, "int8"), quantized_q=True)
