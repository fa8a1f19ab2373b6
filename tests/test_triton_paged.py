"""The triton kernel that reads a paged KV cache through its block table
(``attn.flash_triton.paged_attention``, what ``attn.decode`` runs on CUDA), against the
float64 reference on each sequence's keys gathered densely (the oracle's own copy).

Without a GPU the kernel runs in the Triton interpreter on CPU tensors: the fixture
``triton_reads`` routes ``attn.decode`` on this machine's device to the kernel (on CPU the
tiled backend would otherwise read the pages), forces split-KV to 2 chunks so that the longest
rows (150 keys) give two chunks of several 32-key tiles (the second empty for short rows),
and records every launch so that no case passes on another path. Pages of 1, 3 and 16
positions with 32-key tiles: tiles straddle pages, and pages straddle chunks.

Quantized caches (every format of :mod:`attn.kvquant`, KIVI's per-channel keys, recent
full-precision pages) are read by the same kernel, which dequantizes each tile after its
load: the oracle is the float64 reference on the cache's dequantized values
(``sequence_kv``), so the check is exact up to DESIGN.md's budget and the quantization error
itself is not part of it.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

import attn  # noqa: E402
from attn import flash_triton  # noqa: E402  (in interpreter mode on CPU: tests/conftest.py)
from attn.flash_triton import launch  # noqa: E402
from attn import kvquant  # noqa: E402
from attn.kvcache import KVQuant, PagedKVCache  # noqa: E402
from test_decode import D, H, check_rows, paged, poison_unused  # noqa: E402
from test_kvquant import FORMATS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not flash_triton._INTERPRET,
                                reason="the triton kernels need CUDA or the interpreter "
                                       "(TRITON_INTERPRET=1 before attn is imported)")
decode_module = importlib.import_module("attn.decoding")
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


# -- quantized caches: codes and scales dequantized inside the kernel -------------------------

# int4 with groups of 16 and Dv = 48: dims padded to the tile (BLOCK_DV 64) in packed bytes
QFORMATS = {**FORMATS, "int4 g16": KVQuant("int4", group=16)}
QD = 32  # head dims small for the interpreter; Dv = 64 (48 for "int4 g16")


def quantized_cache(lengths, page, quant, *, heads=(H, 2), dtype=torch.float32, seed=0):
    """An allocated cache of ``QFORMATS[quant]`` on DEVICE holding ``lengths`` keys per
    sequence, its pages handed out in a random order (as a long-running cache's free list
    would: shuffled tables) but page 0 kept spare (the kernel reads a masked key's page id as
    0: a load that ignored its mask would read there), the sequences appended piece by piece
    in turn; and a generator."""
    g = torch.Generator().manual_seed(seed)
    fmt, Hkv = QFORMATS[quant], heads[1]
    Dv = 48 if quant == "int4 g16" else 64
    num_blocks = sum(-(-n // page) for n in lengths) + 4
    cache = PagedKVCache.allocate(num_blocks, page, Hkv, QD, head_dim_v=Dv,
                                  max_seqs=len(lengths), quant=fmt, dtype=dtype, device=DEVICE,
                                  fp8_scales=(0.02 + 0.01 * torch.arange(Hkv), 0.015))
    cache._pages.free = [0] + (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # popped
    done = [0] * len(lengths)
    with torch.inference_mode():
        while done != list(lengths):
            for s, n in enumerate(lengths):
                m = min(n - done[s], int(torch.randint(1, 40, (), generator=g)))
                if m:
                    k = torch.randn(1, Hkv, m, QD, generator=g)
                    v = torch.randn(1, Hkv, m, Dv, generator=g)
                    cache.append(k.to(DEVICE), v.to(DEVICE), seq_ids=[s])
                    done[s] += m
    return cache, g


# (format, variant, page, (H, Hkv), dtype): every format; per-token, per-group, per-channel
# and per-head scales; recent pages with a tile straddling codes and ring (150 keys: the
# ring starts at key 144 with pages of 3 or 16); GQA, MQA and MHA in the three dtypes
QCASES = [("int8", "plain", 3, (H, 2), torch.float32),
          ("int8 g32", "causal", 16, (H, 1), torch.bfloat16),
          ("int4", "softcap+scale", 1, (H, H), torch.float16),
          ("fp8", "sinks", 3, (H, 2), torch.float32),
          ("int4 kivi", "window", 3, (H, 2), torch.float32),
          ("int8 recent", "alibi", 16, (H, 2), torch.float16),
          ("int4 g16", "everything", 16, (H, 1), torch.bfloat16)]


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("quant,name,page,heads,dtype", QCASES,
                         ids=[f"{c[0]}-{c[1]}-page{c[2]}" for c in QCASES])
def test_quantized_matches_reference_on_dequantized_values(quant, name, page, heads, dtype,
                                                           triton_reads):
    cache, g = quantized_cache(LENGTHS, page, quant, heads=heads, dtype=dtype, seed=page)
    q = torch.randn(len(LENGTHS), heads[0], 1, QD, generator=g).to(dtype).to(DEVICE)
    kw = variant(name, len(LENGTHS), g)
    out, lse = run(q, cache, **kw)
    assert out.dtype == dtype and out.shape[-1] == cache.head_dim_v
    check_rows(q, cache, out, lse, **kw)  # the oracle reads sequence_kv: dequantized
    assert triton_reads == [2]


@pytest.mark.cuda_if_present
def test_quantized_prefill_rows_and_seq_ids(triton_reads):
    """Five queries per head, rows naming the sequences out of order (one twice), KIVI keys
    with a recent window: each row's recent ring is its own."""
    cache, g = quantized_cache([150, 45, 0, 131], 3, "int4 kivi", seed=5)
    seq_ids = [3, 0, 1, 3, 2]
    q = torch.randn(5, H, 5, QD, generator=g).to(DEVICE)
    kw = {"causal": True, "window": (70, 1)}
    with torch.no_grad():
        out, lse = attn.decode(q, cache, seq_ids=torch.tensor(seq_ids), return_lse=True, **kw)
    check_rows(q, cache, out, lse, rows=seq_ids, **kw)
    assert triton_reads == [2]


@pytest.mark.cuda_if_present
@pytest.mark.parametrize("quant", ["fp8", "int4 kivi"])
def test_quantized_foreign_slots_never_reach_a_row(quant, triton_reads, monkeypatch):
    """NaN in every code, scale and recent slot no sequence holds (fp8's NaN byte 0x7f for
    codes) never changes an output bit; NaN in one sequence's scales or codes changes its
    row only. Nothing is dequantized outside the kernel."""
    monkeypatch.setattr(kvquant, "dequantize", lambda *a, **k: pytest.fail("dequantized"))
    cache, g = quantized_cache([150, 33, 0, 70], 3, quant, seed=7)
    q = torch.randn(4, H, 2, QD, generator=g).to(DEVICE)
    kw = dict(softcap=3.0, sinks=torch.randn(H, generator=g).to(DEVICE))
    clean = run(q, cache, **kw)
    poison_unused(cache, 0x7F if quant == "fp8" else None)  # int codes have no NaN
    dirty = run(q, cache, **kw)
    assert all(torch.equal(a, b) for a, b in zip(clean, dirty))
    own = cache.host_table[3, :int(cache.recent_from()[3])].to(DEVICE)  # its coded pages
    if quant == "fp8":
        cache.k_pages[own] = 0x7F
    else:
        cache.k_scales[own] = float("nan")
    out, lse = run(q, cache, **kw)
    assert torch.equal(out[:3], clean[0][:3]) and torch.equal(lse[:3], clean[1][:3])
    assert out[3].isnan().all()
    assert len(triton_reads) == 3


def test_read_plan_sends_quantized_caches_to_the_kernel(monkeypatch):
    monkeypatch.setattr(decode_module, "_PAGED_DEVICES", ())
    monkeypatch.setattr(decode_module, "_TRITON_PAGED_DEVICES", ("cpu",))
    q = torch.zeros(2, H, 1, QD)
    cache = PagedKVCache.allocate(4, 3, 2, QD, max_seqs=2, quant=QFORMATS["int4 kivi"])
    plan, why = decode_module.read_plan(q, cache)
    assert plan == "triton" and "dequantizing int4 codes" in why, why
    wide = PagedKVCache.allocate(4, 3, 2, QD, max_seqs=2, quant=QFORMATS["int4 kivi"],
                                 dtype=torch.float64)
    plan, why = decode_module.read_plan(q, wide)
    assert plan == "copy" and "recent pages stored in torch.float64" in why, why
    # without a recent window only codes are read: their storage dtype does not matter
    codes_only = PagedKVCache.allocate(4, 3, 2, QD, max_seqs=2, quant="int8",
                                       dtype=torch.float64)
    assert decode_module.read_plan(q, codes_only)[0] == "triton"


@pytest.mark.cuda_if_present
def test_a_rows_bits_do_not_depend_on_its_batch(triton_reads, monkeypatch):
    # DESIGN's batch invariance: each row's key chunks come from its own length, so a row
    # read alone and beside longer or shorter rows gives the same bits (out and lse)
    monkeypatch.setenv("ATTN_TRITON_SPLIT_KV", "3")
    cache, q, _ = cache_and_q([150, 400, 40, 0], 3, seed=5)
    out, lse = run(q, cache, causal=True)
    for b in range(4):
        starts = None if cache.starts is None else cache.starts[b:b + 1]
        alone = PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table[b:b + 1],
                             cache.lengths[b:b + 1], starts=starts)
        out_b, lse_b = run(q[b:b + 1], alone, causal=True)
        assert torch.equal(out_b, out[b:b + 1]) and torch.equal(lse_b, lse[b:b + 1]), b
    assert triton_reads[0] == 3  # the batch's grid: the most chunks a row has
