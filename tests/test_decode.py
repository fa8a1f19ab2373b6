"""attn.decode against the float64 reference on the same K/V: the tiled backend reading a
paged cache through its block table (ragged lengths, pages of 1 to 3000 positions, pages in
order and shuffled), every variant decode takes, isolation of sequences, the same bits on
1, 2 and 3 workers, and its checks."""

from __future__ import annotations

import pytest
import torch

import attn
from attn.kvcache import PagedKVCache
from attn.testing import assert_close_to_reference
from attn.tiled import cpu

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
    """Sequence s's keys and values as (1, Hkv, N_s, D): the oracle's copy."""
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


VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window": (50, 0)},
    "softcap+scale": {"softcap": 2.0, "scale": 0.7},
    "alibi": {"causal": True, "alibi_slopes": "per row"},
    "sinks": {"sinks": True},
}


def variant_kwargs(name: str, B: int, g: torch.Generator) -> dict:
    kw = dict(VARIANTS[name])
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
    with torch.no_grad():
        clean = attn.decode(q, cache, return_lse=True, **kw)
    live = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool)
    for s in range(4):
        for t in range(int(starts[s]), lengths[s]):
            live[cache.host_table[s, t // page], t % page] = True
    for pages in (cache.k_pages, cache.v_pages):
        pages[~live] = float("nan")
    with torch.no_grad():
        dirty = attn.decode(q, cache, return_lse=True, **kw)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    # sequence 3's own keys poisoned: only its row changes
    for pages in (cache.k_pages, cache.v_pages):
        pages[cache.host_table[3]] = float("nan")
    with torch.no_grad():
        out, lse = attn.decode(q, cache, return_lse=True, **kw)
    assert torch.equal(out[:3], clean[0][:3]) and torch.equal(lse[:3], clean[1][:3])
    assert out[3].isnan().all()


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
    import attn.decode as module  # binds the package's name to the module: still callable
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
