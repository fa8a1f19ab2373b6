"""attn.kvcache.PagedKVCache against a plain-tensor oracle: appends, reads, and its checks."""

from __future__ import annotations

import pytest
import torch

from attn import kvquant
from attn.kvcache import KVQuant, PagedKVCache
from attn.kvcache import read as kv_read
from attn.kvcache.pages import PageAllocator
from attn.kvcache.quantized import QuantizedPages
from test_kvquant import FORMATS

HKV, D = 2, 4


def paged(lengths: list[int], page: int, pages_per_seq: int, spare: int = 2, seed: int = 0):
    """A cache of random pages under a shuffled block table (``spare`` pages no sequence
    uses), and the oracle: each sequence's positions as a dense ``(B, Hkv, capacity, D)``."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    num_blocks = B * pages_per_seq + spare
    k_pages = torch.randn(num_blocks, page, HKV, D, generator=g)
    v_pages = torch.randn(num_blocks, page, HKV, D + 1, generator=g)  # Dv != D
    table = torch.randperm(num_blocks, generator=g)[:B * pages_per_seq].view(B, -1).int()
    # (B, pages, page, Hkv, D) -> (B, Hkv, capacity, D)
    dense = [p[table.long()].flatten(1, 2).transpose(1, 2).clone() for p in (k_pages, v_pages)]
    cache = PagedKVCache(k_pages, v_pages, table, torch.tensor(lengths, dtype=torch.int32))
    return cache, dense


def assert_reads(cache: PagedKVCache, dense: list[torch.Tensor]) -> None:
    """Every read returns the oracle's keys [starts, lengths) of each sequence."""
    want = [[d[b, :, int(cache.starts[b]):int(cache.lengths[b])].transpose(0, 1) for d in dense]
            for b in range(cache.batch)]  # (N_b, Hkv, D)
    for b in range(cache.batch):
        for got, w in zip(cache.sequence_kv(b), want[b]):
            assert torch.equal(got, w)
    k, v, cu = cache.packed_kv()
    assert cu.tolist() == [0, *(cache.lengths - cache.starts).cumsum(0).tolist()]
    assert torch.equal(k, torch.cat([w[0] for w in want]))
    assert torch.equal(v, torch.cat([w[1] for w in want]))


@pytest.mark.parametrize("page", [1, 3, 8])
def test_append_writes_each_sequence_at_its_length(page):
    cache, dense = paged([0, 5, 11], page, pages_per_seq=-(-16 // page))
    before = cache.k_pages.clone(), cache.v_pages.clone()
    g = torch.Generator().manual_seed(1)
    for n in (2, 1):
        k, v = torch.randn(3, HKV, n, D, generator=g), torch.randn(3, HKV, n, D + 1, generator=g)
        ends = cache.lengths.clone()
        cache.append(k, v)
        for b, e in enumerate(ends.tolist()):
            dense[0][b, :, e:e + n], dense[1][b, :, e:e + n] = k[b], v[b]
        assert cache.lengths.tolist() == (ends + n).tolist()
        assert_reads(cache, dense)
    # nothing but the appended slots changed: spare pages and every other slot kept their bits
    written = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool)
    for b, (start, stop) in enumerate(zip([0, 5, 11], cache.lengths.tolist())):
        for t in range(start, stop):
            written[cache.block_table[b, t // page], t % page] = True
    for pages, old in zip((cache.k_pages, cache.v_pages), before):
        assert torch.equal(pages[~written], old[~written])


def test_reads_start_at_starts_and_stop_at_lengths():
    cache, dense = paged([7, 9, 7], page=4, pages_per_seq=3)
    # rows 0 and 1 span two pages; row 2's keys [5, 7) lie inside its second page
    cache = PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache.lengths,
                         starts=torch.tensor([2, 5, 5]))
    for t in range(7, 12):  # row 0's slots past its length may hold anything
        cache.k_pages[cache.block_table[0, t // 4], t % 4] = float("nan")
    assert_reads(cache, dense)


@pytest.mark.parametrize("consecutive", [True, False])
def test_batch_kv_is_a_view_of_consecutive_pages(consecutive):
    B, L = 3, 6
    k_pages, v_pages = torch.randn(B + 1, L, HKV, D), torch.randn(B + 1, L, HKV, D)
    rows = torch.tensor([1, 2, 3]) if consecutive else torch.tensor([3, 0, 2])
    cache = PagedKVCache(k_pages, v_pages, rows.view(B, 1), 4, starts=1)
    assert cache.batch_is_view == consecutive
    k, v = cache.batch_kv()
    assert torch.equal(k, k_pages[rows, 1:4].transpose(1, 2))
    assert torch.equal(v, v_pages[rows, 1:4].transpose(1, 2))
    shares = k.untyped_storage().data_ptr() == k_pages.untyped_storage().data_ptr()
    assert shares == consecutive


@pytest.mark.parametrize("bad", [-1, 7, 100])
def test_page_ids_are_checked_naming_the_callers_argument(bad):
    cache, _ = paged([3, 2], page=2, pages_per_seq=2, spare=3)  # 7 pages
    table = cache.block_table.clone()
    table[1, 1] = bad  # an unused slot (row 1 holds 2 keys: its first page only)
    with pytest.raises(ValueError, match=rf"^block_table\[1, 1\] = {bad} .*\(7, 2, 2, 4\).*"
                                         rf"\[0, 7\)"):
        PagedKVCache(cache.k_pages, cache.v_pages, table, cache.lengths)
    with pytest.raises(ValueError, match=rf"^page_ids\[1, 1\] = {bad} is not a page of kc "):
        PagedKVCache(cache.k_pages, cache.v_pages, table, cache.lengths,
                     names={"block_table": "page_ids", "k_pages": "kc"})


def test_lengths_are_checked_and_a_full_cache_refuses_before_writing():
    cache, _ = paged([3, 6], page=3, pages_per_seq=2)  # capacity 6
    k_pages, v_pages, table = cache.k_pages, cache.v_pages, cache.block_table
    with pytest.raises(ValueError, match=r"holds 6 positions per sequence; seqlens \[3, 7\] "
                                         r"do not fit \(k_pages \(6, 3, 2, 4\), block_table"):
        PagedKVCache(k_pages, v_pages, table, torch.tensor([3, 7]), names={"lengths": "seqlens"})
    with pytest.raises(ValueError, match=r"lengths \[-1, 2\] must not be negative"):
        PagedKVCache(k_pages, v_pages, table, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"lengths must be \(sequences,\) = \(2,\) .* got "
                                         r"torch.int64 \(3,\)"):
        PagedKVCache(k_pages, v_pages, table, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"starts \[4, 0\] must lie in \[0, lengths\] = \[3, 6"):
        PagedKVCache(k_pages, v_pages, table, cache.lengths, starts=torch.tensor([4, 0]))
    with pytest.raises(TypeError, match=r"block_table must be int32 \(or int64\)"):
        PagedKVCache(k_pages, v_pages, table.float(), cache.lengths)
    before = k_pages.clone()
    with pytest.raises(ValueError, match=r"\[3, 6\] \+ 1 new tokens do not fit"):
        cache.append(torch.ones(2, HKV, 1, D), torch.ones(2, HKV, 1, D + 1))
    assert torch.equal(k_pages, before) and cache.lengths.tolist() == [3, 6]


# -- a cache that owns its pages: allocate, append, fork, free --------------------------------

def decode_matches(cache: PagedKVCache, dense: dict[int, list[torch.Tensor]], q: torch.Tensor):
    """attn.decode of every sequence in ``dense`` (its oracle keys and values, (Hkv, N, ·))
    against the float64 reference on those keys."""
    import attn
    from attn.testing import assert_close_to_reference
    rows = sorted(dense)
    with torch.inference_mode():
        out, lse = attn.decode(q[rows], cache, seq_ids=rows, causal=True, return_lse=True)
    for i, s in enumerate(rows):
        k, v = (t[None] for t in dense[s])

        def got(*_, return_lse=False, **__):
            return (out[i:i + 1], lse[i:i + 1]) if return_lse else out[i:i + 1]
        assert_close_to_reference(got, q[s:s + 1], k, v, grad=False, causal=True)


def grow(cache, dense, s, n, g):
    k, v = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D + 1, generator=g)
    cache.append(k, v, seq_ids=[s])
    old = dense.get(s, [torch.zeros(HKV, 0, D), torch.zeros(HKV, 0, D + 1)])
    dense[s] = [torch.cat([old[0], k[0]], 1), torch.cat([old[1], v[0]], 1)]


@pytest.mark.parametrize("page", [1, 3, 16])
def test_fork_shares_full_pages_and_copies_the_last_partial_one(page):
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache.allocate(64, page, HKV, D, head_dim_v=D + 1, max_seqs=4,
                                  max_pages=-(-40 // page))
    q = torch.randn(4, 2 * HKV, 1, D, generator=g)
    dense: dict[int, list[torch.Tensor]] = {}
    grow(cache, dense, 0, 17, g)
    used = 64 - cache.free_pages
    assert used == -(-17 // page)
    assert cache.fork(0) == 1  # the first empty sequence
    dense[1] = [t.clone() for t in dense[0]]
    assert 64 - cache.free_pages == used + (17 % page != 0)  # only the partial page copied
    shared = cache.host_table[0, :17 // page]
    assert torch.equal(cache.host_table[1, :17 // page], shared)
    grow(cache, dense, 0, 5, g)  # the two now diverge, neither writing the other's keys
    grow(cache, dense, 1, 9, g)
    decode_matches(cache, dense, q)
    cache.free(0)  # pages shared with sequence 1 stay
    del dense[0]
    assert cache.lengths[0] == 0
    assert 64 - cache.free_pages == -(-26 // page)
    decode_matches(cache, dense, q)
    grow(cache, dense, 0, 30, g)  # freed pages are handed out again
    decode_matches(cache, dense, q)
    cache.free([0, 1])
    assert cache.free_pages == 64


def test_running_out_of_pages_is_refused_before_writing():
    cache = PagedKVCache.allocate(5, 2, HKV, D, max_seqs=3)
    cache.append(torch.ones(1, HKV, 7, D), torch.ones(1, HKV, 7, D), seq_ids=[0])  # 4 pages

    def state():
        return (cache.k_pages.clone(), cache.lengths.clone(), cache.host_table.clone(),
                cache.free_pages)
    before = state()
    new = torch.full((2, HKV, 3, D), 2.0)
    with pytest.raises(ValueError, match=r"out of pages: appending 3 tokens to sequences "
                                         r"\[0, 1\] needs 3 more pages of 2 positions, 1 of 5 "
                                         r"are free"):
        cache.append(new, new, seq_ids=[0, 1])
    after = state()
    assert all(torch.equal(x, y) for x, y in zip(before[:3], after[:3]))
    assert before[3] == after[3]
    cache.append(torch.ones(1, HKV, 1, D), torch.ones(1, HKV, 1, D), seq_ids=1)  # the last
    before = state()
    with pytest.raises(ValueError, match=r"out of pages: forking sequence 0 needs 1 more"):
        cache.fork(0)
    after = state()
    assert all(torch.equal(x, y) for x, y in zip(before[:3], after[:3]))
    assert cache.free_pages == 0 and cache.lengths.tolist() == [7, 1, 0]


def test_append_is_in_place_under_inference_mode_and_casts_to_the_storage_dtype():
    cache = PagedKVCache.allocate(8, 4, HKV, D, max_seqs=2, dtype=torch.bfloat16)
    ptr = cache.k_pages.data_ptr()
    k = torch.randn(2, HKV, 6, D)
    with torch.inference_mode():
        cache.append(k, k)
    cache.append(k[:, :, :1], k[:, :, :1])  # and outside it, after
    assert cache.k_pages.data_ptr() == ptr and cache.k_pages.dtype == torch.bfloat16
    got = cache.k_pages[cache.host_table[1, :2]].flatten(0, 1)[:6].transpose(0, 1)
    assert torch.equal(got, k[1].bfloat16())
    assert cache.lengths.tolist() == [7, 7]


def test_allocate_free_and_fork_check_their_arguments():
    cache = PagedKVCache.allocate(8, 4, HKV, D, max_seqs=3)
    cache.append(torch.ones(1, HKV, 5, D), torch.ones(1, HKV, 5, D), seq_ids=[0])
    with pytest.raises(ValueError, match=r"dst 0 must be an empty sequence other than src 0"):
        cache.fork(0, 0)
    with pytest.raises(ValueError, match=r"seq_ids \[3\] must be distinct sequences of \[0, 3\)"):
        cache.free(3)
    with pytest.raises(ValueError, match=r"seq_ids \[1, 1\] must be distinct"):
        cache.append(torch.ones(2, HKV, 1, D), torch.ones(2, HKV, 1, D), seq_ids=[1, 1])
    with pytest.raises(ValueError, match=r"page_size must be a positive int, got 0"):
        PagedKVCache.allocate(8, 0, HKV, D, max_seqs=1)
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype"):
        PagedKVCache.allocate(8, 4, HKV, D, max_seqs=1, dtype=torch.int8)
    borrowed, _ = paged([3, 2], page=2, pages_per_seq=2)
    with pytest.raises(ValueError, match=r"fork needs a cache that owns its pages"):
        borrowed.fork(0, 1)
    with pytest.raises(ValueError, match=r"free needs a cache that owns its pages"):
        borrowed.free(0)


# -- quantized pages -----------------------------------------------------------------------------

QD = 64  # quantized: head dims split into groups of 32 (values: QD + 32)


def expected_values(quant: KVQuant, x: torch.Tensor, page: int, recent_from: int, *,
                    keys: bool, fp8_scale=None) -> torch.Tensor:
    """What a sequence's cache must hold for its appended values ``x (N, Hkv, D)``: each
    token quantized and dequantized by attn.kvquant (tested against the formulas), keys per
    channel page by page, and the full-precision pages (from ``recent_from``) as they are."""
    n = x.shape[0]
    want = x.clone()
    coded = min(n, recent_from * page)
    xs = x[:coded]
    if quant.kind == "fp8_e4m3":
        deq = kvquant.dequantize(kvquant.quantize_fp8(xs, fp8_scale), fp8_scale.view(1, -1, 1),
                                 quant.kind)
    elif keys and quant.k_per_channel:
        # (pages·page, Hkv, D) -> (pages, page, Hkv, D): whole pages, scaled per channel
        pages = xs.view(-1, page, *xs.shape[1:])
        deq = kvquant.dequantize(*kvquant.quantize_channels(pages, quant.kind), quant.kind)
        deq = deq.flatten(0, 1)
    else:
        deq = kvquant.dequantize(*kvquant.quantize(xs, quant.kind, quant.group), quant.kind)
    want[:coded] = deq
    return want


def fill_quantized(name: str, lengths: list[int], page: int, *, seed: int = 0, spare: int = 4):
    """An allocated quantized cache filled in interleaved pieces, and the appended values per
    sequence (the oracle), ``(N, Hkv, D)``."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    num = sum(-(-n // page) for n in lengths) + spare
    cache = PagedKVCache.allocate(num, page, HKV, QD, head_dim_v=QD + 32, max_seqs=B + 1,
                                  quant=FORMATS[name], fp8_scales=(torch.tensor([0.02, 0.03]),
                                                                   0.01))
    sent = [[torch.zeros(0, HKV, QD), torch.zeros(0, HKV, QD + 32)] for _ in lengths]
    done = [0] * B
    for piece in (0.3, 0.5, 1.0):
        for s, n in enumerate(lengths):
            m = int(n * piece) - done[s]
            if m:
                k, v = torch.randn(1, HKV, m, QD, generator=g), torch.randn(1, HKV, m, QD + 32,
                                                                          generator=g)
                cache.append(k, v, seq_ids=[s])
                sent[s] = [torch.cat([sent[s][0], k[0].transpose(0, 1)]),
                           torch.cat([sent[s][1], v[0].transpose(0, 1)])]
                done[s] += m
    return cache, sent


def assert_holds(cache: PagedKVCache, name: str, s: int, sent) -> None:
    page, quant = cache.page_size, FORMATS[name]
    f = int(cache.recent_from()[s])
    got = cache.sequence_kv(s)
    for x, g_, keys, scale in ((sent[0], got[0], True, cache.k_scales),
                               (sent[1], got[1], False, cache.v_scales)):
        assert torch.equal(g_, expected_values(quant, x, page, f, keys=keys, fp8_scale=scale))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("page", [1, 5, 16])
def test_a_quantized_cache_holds_each_tokens_codes(name, page):
    """Every token of every sequence reads back as its own quantized value, whatever the
    interleaving of appends; the recent pages in full precision, the older ones quantized as
    they left the window (keys per channel over their whole page)."""
    cache, sent = fill_quantized(name, [0, 1, 37, 101], page)
    W = FORMATS[name].recent_pages
    for s in range(4):
        n = int(cache.lengths[s])
        assert int(cache.recent_from()[s]) == max(0, -(-n // page) - W)
        assert_holds(cache, name, s, sent[s])
    held = cache.k_pages.shape[0] - cache.free_pages
    assert held == sum(max(0, -(-n // page) - W) for n in (0, 1, 37, 101))


@pytest.mark.parametrize("name", ["int8 g32", "fp8", "int4 kivi"])
def test_quantized_fork_and_free(name):
    page = 4
    cache, sent = fill_quantized(name, [0, 23, 10], page)
    total, W = cache.k_pages.shape[0], FORMATS[name].recent_pages
    used = total - cache.free_pages
    assert cache.fork(1, 0) == 0
    # full coded pages shared; the partial page copied (no window) or the ring (with one)
    assert total - cache.free_pages == used + (0 if W else 1)
    sent[0] = [t.clone() for t in sent[1]]
    assert_holds(cache, name, 0, sent[0])
    g = torch.Generator().manual_seed(3)
    for s, m in ((0, 9), (1, 2)):  # the two diverge, neither writing the other's tokens
        k, v = torch.randn(1, HKV, m, QD, generator=g), torch.randn(1, HKV, m, QD + 32,
                                                                  generator=g)
        cache.append(k, v, seq_ids=[s])
        sent[s] = [torch.cat([sent[s][0], k[0].transpose(0, 1)]),
                   torch.cat([sent[s][1], v[0].transpose(0, 1)])]
    for s in range(3):
        assert_holds(cache, name, s, sent[s])
    cache.free(1)
    assert_holds(cache, name, 0, sent[0])
    cache.free([0, 2])
    assert cache.free_pages == total


def test_a_quantized_append_with_non_finite_values_writes_nothing():
    for name in ("int8", "fp8", "int4 kivi"):
        cache, sent = fill_quantized(name, [7, 3], 4)
        state = [t.clone() for t in (cache.k_pages, cache.k_scales, cache.host_table)]
        free = cache.free_pages
        k = torch.ones(2, HKV, 9, QD)
        k[1, 0, 8, 3] = float("inf")
        with pytest.raises(ValueError, match=r"k .* holds non-finite values"):
            cache.append(k, torch.ones(2, HKV, 9, QD + 32), seq_ids=[0, 1])
        assert all(torch.equal(a, b) for a, b in zip(
            state, (cache.k_pages, cache.k_scales, cache.host_table)))
        assert cache.free_pages == free and cache.lengths.tolist() == [7, 3, 0]


def test_quantized_allocate_checks_its_arguments():
    with pytest.raises(ValueError, match=r"int4 groups of 32 must divide head_dim_v = 40"):
        PagedKVCache.allocate(4, 4, HKV, 64, head_dim_v=40, max_seqs=1, quant="int4")
    with pytest.raises(TypeError, match=r"quant must be an attn.kvquant.KVQuant"):
        PagedKVCache.allocate(4, 4, HKV, 64, max_seqs=1, quant=8)
    with pytest.raises(ValueError, match=r"fp8_scales\[0\] must be a float or an \(Hkv,\) = "
                                         r"\(2,\) tensor, got \(3,\)"):
        PagedKVCache.allocate(4, 4, HKV, 64, max_seqs=1, quant="fp8_e4m3",
                              fp8_scales=(torch.ones(3), 1.0))
    with pytest.raises(ValueError, match=r"fp8_scales\[1\] \[0.0, 0.0\] must be positive"):
        PagedKVCache.allocate(4, 4, HKV, 64, max_seqs=1, quant="fp8_e4m3",
                              fp8_scales=(1.0, 0.0))


def test_bytes_per_token_of_a_cache():
    plain = PagedKVCache.allocate(4, 16, 8, 128, max_seqs=1)
    assert plain.bytes_per_token() == 8 * 2 * 128 * 4
    bf16 = PagedKVCache.allocate(4, 16, 8, 128, max_seqs=1, dtype=torch.bfloat16)
    assert bf16.bytes_per_token() == 8 * 2 * 128 * 2
    for quant in FORMATS.values():
        cache = PagedKVCache.allocate(4, 16, 8, 128, max_seqs=1, quant=quant)
        assert cache.bytes_per_token() == kvquant.bytes_per_token(quant, 8, 128, page_size=16)
        # what the storage holds per position: codes and per-token scales, per-page scales
        # spread over a page's positions
        per_page = sum(t[0].numel() * t.element_size() for t in (
            cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales) if t.dim() == 4)
        assert cache.bytes_per_token() == per_page / 16


# -- pages outside every sliding window -------------------------------------------------------

@pytest.mark.parametrize("name", [None, "int8", "int4 kivi"])
def test_free_outside_window_returns_pages_no_query_can_see(name):
    """Page 4, window (9, 0). Sequence 0 grows to 50 keys after sequence 2 forked it at 30;
    sequence 1 holds 6. Queries still to come see keys >= length - 9: sequence 0 gives back
    its pages before key 41 (table slots 0..9), sequence 2 those before key 21 (slots 0..4),
    so the pages both shared (slots 0..4) go, and those only sequence 2 still sees (slots 5,
    6) stay. Without a full-precision window that is 3 pages of sequence 0's own (slots 7..9)
    and 5 shared; with two recent pages (KIVI) sequence 0's coded slots 6..9 and the same 5
    shared, the recent pages being each sequence's own ring."""
    page = 4
    g = torch.Generator().manual_seed(0)
    kw = dict(quant=FORMATS[name]) if name else {}
    D_ = QD if name else D
    cache = PagedKVCache.allocate(40, page, HKV, D_, max_seqs=3, **kw)

    def grow(s, n):
        cache.append(torch.randn(1, HKV, n, D_, generator=g),
                     torch.randn(1, HKV, n, D_, generator=g), seq_ids=[s])
    grow(0, 30)
    grow(1, 6)
    assert cache.fork(0, 2) == 2
    grow(0, 20)
    held = 40 - cache.free_pages
    W = FORMATS[name].recent_pages if name else 0
    assert held == (16 if W == 0 else 11)
    returned = cache.free_outside_window((9, 0))
    assert returned == (8 if W == 0 else 9)
    assert 40 - cache.free_pages == held - returned
    assert cache.starts.tolist() == [40, 0, 20]
    assert cache.free_outside_window((9, 0)) == 0  # nothing more to give back
    cache.free([0, 1, 2])
    assert cache.free_pages == 40
    with pytest.raises(ValueError, match=r"an unbounded left \(-1\) keeps every key"):
        cache.free_outside_window((-1, 0))
    with pytest.raises(TypeError, match=r"window must be a pair of ints"):
        cache.free_outside_window(9)
    borrowed, _ = paged([3, 2], page=2, pages_per_seq=2)
    with pytest.raises(ValueError, match=r"free_outside_window needs a cache that owns"):
        borrowed.free_outside_window((2, 0))


def test_a_quantized_append_past_fp16_scales_writes_nothing():
    """int8 scales of |values| past 127 · 65504 do not fit fp16: refused before any page is
    taken, also when the values sat in the full-precision window and are quantized now."""
    cache, _ = fill_quantized("int8 recent", [3], 4, spare=3)
    free, table = cache.free_pages, cache.host_table.clone()
    k = torch.full((1, HKV, 6, QD), 1e7)
    with pytest.raises(ValueError, match=r"k \(pages\): \|values\| up to 1e\+07 need int8 "
                                         r"scales past fp16's 65504"):
        cache.append(k, torch.ones(1, HKV, 6, QD + 32), seq_ids=[0])
    assert cache.free_pages == free and torch.equal(cache.host_table, table)
    assert cache.lengths.tolist() == [3, 0]


def test_decoding_a_freed_sequence_raises() -> None:
    """A freed sequence holds no key: decoding it raises and names it, where it used to
    return zeros; appended to again, it decodes to the float64 reference over its new keys.
    A sequence never written to stays a row without keys (zeros), as ragged batches use."""
    import attn

    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache.allocate(8, 4, HKV, D, max_seqs=3, max_pages=2)
    kv = [torch.randn(1, HKV, 5, D, generator=g) for _ in range(4)]
    q = torch.randn(1, 2 * HKV, 1, D, generator=g)
    with torch.no_grad():
        cache.append(kv[0], kv[1], seq_ids=[1])
        cache.free(1)
        with pytest.raises(ValueError, match=r"sequences \[1\] of the cache were freed"):
            attn.decode(q.expand(3, -1, -1, -1), cache)
        with pytest.raises(ValueError, match=r"sequences \[1\] .* hold no keys"):
            attn.decode(q, cache, seq_ids=[1])
        assert not attn.decode(q, cache, seq_ids=[2]).any()  # never written: zeros
        cache.append(kv[2], kv[3], seq_ids=[1])
        got = attn.decode(q, cache, seq_ids=[1])
    want = attn.attention(q.double(), kv[2].double(), kv[3].double(), backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_repr_shows_sizes_lengths_and_free_pages() -> None:
    cache = PagedKVCache.allocate(8, 4, HKV, D, max_seqs=3, max_pages=2)
    cache.append(torch.zeros(1, HKV, 5, D), torch.zeros(1, HKV, 5, D), seq_ids=[0])
    assert repr(cache) == ("PagedKVCache(batch=3, page_size=4, heads_kv=2, head_dim=4, "
                           "dtype=float32, device=cpu, capacity=8, lengths=[5, 0, 0], "
                           "free_pages=6 of 8)")
    over = PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table[:1], 5)
    assert "pages=8 (the caller's block table)" in repr(over)


# -- the parts on their own: allocator, quantized writer, dense reads --


def test_page_allocator_counts_references_and_refuses_before_taking() -> None:
    alloc = PageAllocator(5, rows=3)
    assert alloc.take(2, "a", 4) == [0, 1] and alloc.free_pages == 3  # in increasing order
    with pytest.raises(ValueError, match=r"out of pages: b needs 4 more pages of 4 positions, "
                                         r"3 of 5 are free"):
        alloc.take(4, "b", 4)
    assert alloc.free_pages == 3 and alloc.refs == [1, 1, 0, 0, 0]  # nothing taken
    alloc.share([1])  # a fork holds page 1 too
    alloc.release([0, 1])
    assert alloc.refs == [0, 1, 0, 0, 0] and alloc.take(1, "c", 4) == [0]  # 1 is still held
    alloc.release([1])
    assert sorted(alloc.free) == [1, 2, 3, 4]
    # row 0 holds 2 pages of 4: 5 more tokens at length 6 need ceil(11 / 4) - 2 = 1 page
    alloc.held = [2, 0, 3]
    assert alloc.needed([0, 1], [6, 0], 5, 4) == [1, 2]
    # a window reaching 5 keys back from length 11 keeps keys from 6: page 0 only is before
    # it for row 0; row 2 (start 9) drops pages [0, 2)
    alloc.first = [0, 0, 1]
    assert alloc.outside_window([0, 0, 9], [11, 0, 12], 5, 4) == [(0, 1), (2, 2)]
    assert alloc.empty_row([11, 0, 12], but=0) == 1 and alloc.empty_row([1, 1, 1], 0) is None


@pytest.mark.parametrize("name", ["int8", "int8 g32", "int4", "fp8"])
def test_quantized_pages_write_and_read_back_within_a_step(name):
    """Tokens quantized, written into code pages and read back dequantized: each value
    within half a quantization step of the token (fp8: its relative rounding), against
    kvquant's own step, not the writer's output."""
    quant = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    Dq, code = 64, torch.int8 if quant.kind == "int8" else torch.uint8
    pages = tuple(torch.zeros(3, 4, HKV, quant.code_dim(Dq), dtype=code) for _ in range(2))
    qp = QuantizedPages.empty(quant, pages[0], 2, (Dq, Dq), torch.float32, (0.02, 0.02))
    x = [torch.randn(5, HKV, Dq, generator=g) for _ in range(2)]
    blk, off = torch.tensor([2, 2, 0, 0, 1]), torch.tensor([0, 3, 1, 2, 0])
    qp.write(pages, blk, off, qp.quantize(*x))
    got = qp.values_at(pages, blk, off, torch.zeros(5, dtype=torch.bool))
    for y, want in zip(got, x):
        if quant.kind == "fp8_e4m3":
            bound = 2 ** -4 * want.abs() + 0.02 * 2 ** -9  # e4m3: 3 mantissa bits
        else:
            levels = 127 if quant.kind == "int8" else 7
            group = want.unflatten(-1, (-1, quant.group_of(Dq))).abs().amax(-1, keepdim=True)
            bound = (group / levels * 0.51 + 1e-6).expand(-1, -1, -1, quant.group_of(Dq))
            bound = bound.flatten(-2)
        assert bool(((y - want).abs() <= bound).all()), name


def test_reads_on_their_own_view_consecutive_pages_and_copy_others():
    cache, dense = paged([6, 6], page=8, pages_per_seq=1, spare=2)
    for rows, is_view in (([1, 2], True), ([2, 1], False)):
        over = PagedKVCache(cache.k_pages, cache.v_pages, torch.tensor(rows).view(2, 1), 6)
        assert kv_read.view_page(over) == (1 if is_view else None)
        k, v = kv_read.batch_kv(over)
        assert (k.data_ptr() == over.k_pages[1].data_ptr()) == is_view  # a view, or a copy
        assert torch.equal(k, over.k_pages[rows, :6].transpose(1, 2))
        assert torch.equal(v, over.v_pages[rows, :6].transpose(1, 2))
    k, v, cu = kv_read.packed_kv(cache)
    assert cu.tolist() == [0, 6, 12]
    assert torch.equal(k, dense[0][:, :, :6].transpose(1, 2).flatten(0, 1))
