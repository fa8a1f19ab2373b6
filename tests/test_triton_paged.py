"""The triton kernel that reads a paged KV cache through its block table
(``attn.flash_triton.paged_attention``, what ``attn.decode`` runs on CUDA), against the
float64 reference on each sequence's keys gathered densely (the oracle's own copy).

Without a GPU the kernel runs in the Triton interpreter on CPU tensors: the fixture
``triton_reads`` routes ``attn.decode`` on this machine's device to the kernel (on CPU the
tiled backend would otherwise read the pages), forces split-KV to 2 chunks so that the longest
rows (150 keys) give two chunks of several 32-key tiles (the second empty for short rows),
and records every launch so that no case passes on another path. Pages of 1, 3 and 16
positions with 32-key tiles: tiles straddle pages, and pages straddle chunks.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402  (in interpreter mode on CPU: tests/conftest.py)
from attn.flash_triton import launch  # noqa: E402
from attn.kvcache import PagedKVCache  # noqa: E402
from test_decode import D, H, check_rows, paged  # noqa: E402  (the cache and the oracle)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not flash_triton._INTERPRET,
                                reason="the triton kernels need CUDA or the interpreter "
                                       "(TRITON_INTERPRET=1 before attn is imported)")
decode_module = importlib.import_module("attn.decode")
# the lengths of most cases: no key, one key, a short row and one that fills three chunks
LENGTHS = [0, 1, 40, 150]


@pytest.fixture
def triton_reads(monkeypatch):
    """attn.decode on this machine's device reads through the triton kernel; split-KV forced
    to 2 chunks; the number of chunks of every launch recorded."""
    monkeypatch.setattr(decode_module, "_PAGED_DEVICES", ())
    monkeypatch.setattr(decode_module, "_TRITON_PAGED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "2")
    seen = []
    real = launch._attn_fwd_paged

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid[1])
            return real[grid]

    monkeypatch.setattr(launch, "_attn_fwd_paged", Spy())
    return seen


def on_device(cache: PagedKVCache) -> PagedKVCache:
    """The same cache with its pages and block table on DEVICE."""
    return PagedKVCache(cache.k_pages.to(DEVICE), cache.v_pages.to(DEVICE),
                        cache.block_table.to(DEVICE), cache.lengths, starts=cache.starts)


def cache_and_q(lengths, page, *, Nq=1, heads=(H, 2), dtype=torch.float32, starts=None,
                seed=0, q_dtype=None):
    cache, g = paged(lengths, page, shuffled=True, heads=heads, dtype=dtype, starts=starts,
                     seed=seed)
    q = torch.randn(len(lengths), heads[0], Nq, D, generator=g).to(q_dtype or dtype)
    return on_device(cache), q.to(DEVICE), g


def variant(name: str, B: int, g: torch.Generator) -> dict:
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)
    kw = {"plain": {}, "causal": {"causal": True}, "window": {"window": (50, 0)},
          "softcap+scale": {"softcap": 2.0, "scale": 0.7},
          "sinks": {"sinks": torch.randn(H, generator=g)},
          "alibi": {"causal": True, "alibi_slopes": torch.rand(B, H, generator=g)},
          "everything": {"causal": True, "window": (60, 0), "softcap": 3.0, "scale": 0.4,
                         "alibi_slopes": slopes, "sinks": torch.zeros(H)}}[name]
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def run(q, cache, **kw):
    with torch.no_grad():
        return attn.decode(q, cache, return_lse=True, **kw)


# (page, (H, Hkv), dtype): GQA, MQA and plain MHA in the three dtypes
SHAPES = [(1, (H, 2), torch.bfloat16), (3, (H, 1), torch.float32), (16, (H, H), torch.float16)]
NAMES = ["plain", "causal", "window", "softcap+scale", "sinks", "alibi", "everything"]
# each variant on one of the three shapes, rotating, and all of them together on all three
CASES = [(name, SHAPES[j % 3]) for i, name in enumerate(NAMES)
         for j in ((i, i + 1, i + 2) if name == "everything" else (i,))]


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("name,shape", CASES,
                         ids=[f"{n}-page{s[0]}-H{s[1][0]}kv{s[1][1]}" for n, s in CASES])
def test_matches_reference(name, shape, triton_reads):
    page, heads, dtype = shape
    cache, q, g = cache_and_q(LENGTHS, page, heads=heads, dtype=dtype, seed=len(name))
    kw = variant(name, len(LENGTHS), g)
    out, lse = run(q, cache, **kw)
    assert out.dtype == dtype and out.device.type == DEVICE
    check_rows(q, cache, out, lse, **kw)
    assert triton_reads == [2]  # the longest row in two chunks of 96 keys


@pytest.mark.cuda_if_present
def test_starts_seq_ids_and_prefill_rows(triton_reads):
    """Sequences with a left pad, q's rows naming the cache's sequences out of order (one
    twice), 5 queries per head; then 36: the GQA group's 72 rows in two blocks, the first
    across both heads, each visiting the tiles its own queries' band needs (one chunk)."""
    lengths, starts = [150, 45, 0, 131], torch.tensor([7, 40, 0, 2])
    cache, _, g = cache_and_q(lengths, 16, starts=starts)
    kw = {"causal": True, "window": (20, 1)}
    for seq_ids, Nq in (([3, 0, 1, 3, 2], 5), ([3, 0], 36)):
        q = torch.randn(len(seq_ids), H, Nq, D, generator=g).to(DEVICE)
        with torch.no_grad():
            out, lse = attn.decode(q, cache, seq_ids=torch.tensor(seq_ids).to(DEVICE),
                                   return_lse=True, **kw)
        check_rows(q, cache, out, lse, rows=seq_ids, **kw)
    assert triton_reads == [2, 1]


@pytest.mark.cuda_if_present
def test_rows_that_see_no_key_give_zeros_and_the_sink(triton_reads):
    """No key at all (length 0, or every length 0) or none inside the causal band (4
    queries against 2 keys: the first two see nothing): zeros, lse -inf or the sink."""
    for lengths, sinks in (([0, 2, 150], None), ([0, 2, 150], torch.linspace(-2, 2, H)),
                           ([0, 0], torch.linspace(-2, 2, H))):
        cache, q, g = cache_and_q(lengths, 3, Nq=4)
        sinks = None if sinks is None else sinks.to(DEVICE)
        out, lse = run(q, cache, causal=True, sinks=sinks)
        check_rows(q, cache, out, lse, causal=True, sinks=sinks)
        want = float("-inf") if sinks is None else sinks.view(H, 1).expand(H, 2)
        assert not out.isnan().any()
        if len(lengths) == 3:
            assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
            assert torch.equal(lse[1, :, :2], torch.full_like(lse[1, :, :2], 0) + want)


def live_slots(cache: PagedKVCache):
    """(num_blocks, page_size) bool: the slots some sequence holds, ``[starts, lengths)``."""
    page = cache.page_size
    pos = torch.arange(cache.capacity)
    live = torch.zeros(cache.k_pages.shape[:2], dtype=torch.bool)
    for table, a, z in zip(cache.host_table, cache.starts.tolist(), cache.lengths.tolist()):
        held = pos[a:z]
        live[table[held // page], held % page] = True
    return live.to(cache.k_pages.device)


@pytest.mark.cuda_if_present
def test_foreign_slots_never_reach_a_row(triton_reads):
    """NaN in spare pages, in slots past each sequence's length and before its start, and
    then in another sequence's keys and values, never changes a row's output bit; NaN keys
    inside a row's own pages but outside its window change nothing either."""
    lengths, starts, page = [150, 33, 0, 70], torch.tensor([5, 0, 0, 2]), 3
    cache, q, g = cache_and_q(lengths, page, starts=starts)
    # not causal: a slot read past a row's end would be attended, not masked
    kw = dict(softcap=3.0, sinks=torch.randn(H, generator=g).to(DEVICE))
    clean = run(q, cache, **kw)
    dead = ~live_slots(cache)
    cache.k_pages[dead] = float("nan")
    cache.v_pages[dead] = float("nan")
    assert all(torch.equal(a, b) for a, b in zip(clean, run(q, cache, **kw)))
    seq3 = cache.host_table[3].to(DEVICE)  # its keys poisoned: its row only changes
    saved = cache.k_pages[seq3].clone(), cache.v_pages[seq3].clone()
    cache.k_pages[seq3] = float("nan")
    cache.v_pages[seq3] = float("nan")
    out, lse = run(q, cache, **kw)
    assert torch.equal(out[:3], clean[0][:3]) and torch.equal(lse[:3], clean[1][:3])
    assert out[3].isnan().all()
    cache.k_pages[seq3], cache.v_pages[seq3] = saved
    # causal, window (10, 0): sequence 0's queries see its keys 133..144; NaN keys 120..132
    # share their tile with those, inside its own pages, and are masked
    near = run(q, cache, causal=True, window=(10, 0))
    t = int(starts[0]) + torch.arange(120, 133)
    cache.k_pages[cache.host_table[0, t // page].to(DEVICE), (t % page).to(DEVICE)] = float("nan")
    assert all(torch.equal(a, b) for a, b in zip(near, run(q, cache, causal=True,
                                                           window=(10, 0))))
    assert len(triton_reads) == 5


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("pages,q_dtype", [(torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16)])
def test_pages_in_another_dtype_are_read_as_q(pages, q_dtype, triton_reads):
    """The pages are converted tile by tile after the load: the result is attention on the
    stored values in q's dtype."""
    cache, q, g = cache_and_q(LENGTHS, 16, dtype=pages, q_dtype=q_dtype)
    out, lse = run(q, cache, causal=True)
    assert out.dtype == q_dtype
    check_rows(q, cache, out, lse, causal=True)
    assert triton_reads == [2]


@pytest.mark.cuda_if_present
def test_values_near_the_float32_limit_stay_finite(triton_reads):
    """|v| = 1e37 and equal scores over 150 keys: sum(p·v) would pass float32's largest
    value; each tile's value offset keeps it finite and exact."""
    cache, q, g = cache_and_q([150, 40], 3)
    # one value per (kv head, dim), the same for every key: no cancellation in the sum
    cache.v_pages.copy_(torch.sign(torch.randn(2, D + 8, generator=g)).to(DEVICE) * 1e37)
    out = run(q.zero_(), cache)[0]
    for b, n in enumerate((150, 40)):  # equal scores: the mean of the row's values
        ids = cache.host_table[b].to(DEVICE)
        want = cache.v_pages[ids].flatten(0, 1)[:n].double().mean(0)  # (Hkv, Dv)
        got = out[b, :, 0].double().view(2, H // 2, -1)
        assert torch.isfinite(got).all()
        assert (got - want[:, None]).abs().max() <= 1e-5 * 1e37


@pytest.mark.cuda_if_present
def test_the_kernel_reads_the_pages_in_place(monkeypatch, triton_reads):
    """No copy of the keys: the cache's gathering reads are never called."""
    for name in ("sequence_kv", "batch_kv", "packed_kv", "select"):
        monkeypatch.setattr(PagedKVCache, name, lambda *a, **k: pytest.fail("gathered"))
    cache, q, _ = cache_and_q(LENGTHS, 16)
    out, lse = run(q, cache)
    check_rows(q, cache, out, lse)
    assert triton_reads == [2]
    with pytest.raises(ValueError, match="forward only"):
        attn.decode(q.requires_grad_(), cache)


def test_read_plan_names_the_kernel_and_why_not(monkeypatch):
    cache, g = paged([5, 9], 3, shuffled=True)
    q = torch.randn(2, H, 1, D, generator=g)
    plan, why = decode_module.read_plan(q, cache)  # CPU: the tiled backend's items
    assert plan == "tiled" and "attn.tiled.paged_attention" in why
    monkeypatch.setattr(decode_module, "_PAGED_DEVICES", ())
    monkeypatch.setattr(decode_module, "_TRITON_PAGED_DEVICES", ("cpu",))
    plan, why = decode_module.read_plan(q, cache)
    assert plan == "triton" and "attn.flash_triton.paged_attention" in why
    for pages, q_dtype, words in ((torch.int8, torch.float32, "pages stored in torch.int8"),
                                  (torch.float32, torch.float64, "dtype torch.float64")):
        other = PagedKVCache(cache.k_pages.to(pages), cache.v_pages.to(pages),
                             cache.block_table, cache.lengths)
        plan, why = decode_module.read_plan(q.to(q_dtype), other)
        assert plan == "copy" and words in why, why
    monkeypatch.setattr(decode_module, "_TRITON_PAGED_DEVICES", ("cuda",))
    assert decode_module.read_plan(q, cache)[0] == "copy"


def test_the_kernel_is_exported():
    assert flash_triton.paged_attention is launch.paged_attention
    assert "paged_attention" in flash_triton.__all__
