"""attn.decode inside torch.compile(fullgraph=True): the traced call hands the cache's tensors
to the opaque op attn::paged_decode, whose real implementation (the eager decode, at run
time) checks the data and reads the pages. Each compiled result equals the eager one bit for
bit and the float64 reference within DESIGN.md's budget; a decode loop whose lengths grow
compiles once; bad data still raises attn's ValueError, from the op."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attn import decode  # the function (its module is attn.decoding)
from attn.kvcache import PagedKVCache
from test_decode import D, H, HKV, check_rows, paged, quantized


def _step(q, cache, seq_ids, kw):
    return decode(q, cache, seq_ids=seq_ids, return_lse=True, **kw)


# one compiled function for every case (each new set of constants is one more graph);
# aot_eager traces through AOTAutograd like inductor does, without its code generation
_compiled_step = torch.compile(_step, fullgraph=True, backend="aot_eager")


def _case(name: str):
    """(q, cache, seq_ids, kw) of one variant."""
    g = torch.Generator().manual_seed(len(name))
    if name == "plain":
        cache, g = paged([0, 1, 97, 2500], 16, shuffled=True)
        return torch.randn(4, H, 1, D, generator=g), cache, None, {}
    if name == "causal+window, Nq 5, seq_ids":
        cache, g = paged([2300, 40, 0, 131], 3, shuffled=True,
                         starts=torch.tensor([3, 40, 0, 7]))
        return (torch.randn(5, H, 5, D, generator=g), cache, torch.tensor([3, 0, 1, 3, 2]),
                {"causal": True, "window": (60, 1)})
    if name == "mqa":
        cache, g = paged([300, 5], 16, shuffled=False, heads=(8, 1))
        return torch.randn(2, 8, 1, D, generator=g), cache, None, {"causal": True}
    if name == "sinks+alibi+softcap":
        cache, g = paged([97, 0, 700], 16, shuffled=True)
        kw = {"sinks": torch.randn(H, generator=g), "alibi_slopes": torch.rand(3, H, generator=g),
              "softcap": 2.0, "scale": 0.7, "causal": True}
        return torch.randn(3, H, 1, D, generator=g), cache, None, kw
    if name == "int8, quantized_q":  # integer rows reaching 127: their own int8 codes
        cache, g = quantized([0, 97, 700], 16, "int8")
        q = torch.randint(-127, 128, (3, H, 1, cache.head_dim), generator=g).float()
        q[..., 0] = 127.0
        return q, cache, None, {"causal": True, "scale": 0.004, "quantized_q": True}
    cache, g = quantized([0, 97, 700], 16, name)  # "int8", "int4 kivi"
    return (torch.randn(3, H, 1, cache.head_dim, generator=g), cache, None,
            {"causal": True, "window": (300, 0)})


CASES = ["plain", "causal+window, Nq 5, seq_ids", "mqa", "sinks+alibi+softcap", "int8",
         "int4 kivi", "int8, quantized_q"]


@pytest.mark.parametrize("name", CASES)
def test_compiled_decode_equals_eager_and_the_reference(name):
    q, cache, seq_ids, kw = _case(name)
    with torch.inference_mode():
        out, lse = _compiled_step(q, cache, seq_ids, kw)
        want = _step(q, cache, seq_ids, kw)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    rows = None if seq_ids is None else seq_ids.tolist()
    kw.pop("quantized_q", None)
    check_rows(q, cache, out, lse, rows=rows, **kw)


def test_growing_lengths_compile_once():
    """A decode loop under the default backend (inductor): lengths grow past page ends,
    pages are handed out and given back (free_outside_window moves starts) between steps.
    The cache's host lists are never read by the traced code and its tensors keep their
    shapes, so steps do not recompile. One recompile is allowed: a dynamo tensor guard
    includes the dispatch keys, and ``starts``, made outside inference mode, becomes an
    inference tensor when free_outside_window first replaces it inside."""
    torch._dynamo.reset()
    step = torch.compile(_step, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache.allocate(64, 4, HKV, D, max_seqs=3)
    kw = {"causal": True, "window": (9, 0)}
    seq_ids = torch.tensor([2, 0, 1])
    before, graphs = counters["stats"]["unique_graphs"], []
    with torch.inference_mode():
        for s, n in enumerate([13, 3, 30]):
            cache.append(torch.randn(1, HKV, n, D, generator=g),
                         torch.randn(1, HKV, n, D, generator=g), seq_ids=[s])
        for i in range(6):  # a step: the new token's keys appended, its query attends
            cache.append(torch.randn(3, HKV, 1, D, generator=g),
                         torch.randn(3, HKV, 1, D, generator=g))
            q = torch.randn(3, H, 1, D, generator=g)
            out, lse = step(q, cache, seq_ids, kw)
            want = _step(q, cache, seq_ids, kw)
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
            check_rows(q, cache, out, lse, rows=seq_ids.tolist(), **kw)
            graphs.append(counters["stats"]["unique_graphs"] - before)
            if i == 2:
                assert cache.free_outside_window(kw["window"]) > 0
    # steps 1, 2 (a page handed out) and 4, 5 (after pages given back) compile nothing
    assert graphs[0] == graphs[2] == 1 and graphs[3] == graphs[5] <= 2, graphs


def test_bad_data_under_compile_raises_from_the_op():
    """Checks that need the data run when the graph runs, in the op, with eager's message:
    a sequence id outside the cache, a window reaching keys given back."""
    cache, g = paged([5, 9], 3, shuffled=True)
    q = torch.randn(2, H, 1, D, generator=g)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"seq_ids \[0, 2\] must lie in \[0, 2\)"):
            _compiled_step(q, cache, torch.tensor([0, 2]), {})
        owned = PagedKVCache.allocate(16, 4, HKV, D, max_seqs=2)
        owned.append(*(torch.randn(2, HKV, 20, D, generator=g) for _ in range(2)))
        assert owned.free_outside_window((5, 0)) > 0
        with pytest.raises(ValueError, match=r"given back by free_outside_window"):
            _compiled_step(q, owned, None, {"causal": True, "window": (12, 0)})
