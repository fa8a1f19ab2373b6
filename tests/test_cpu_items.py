"""One parallel region per tiled CPU call (attn.tiled.cpu.run_items, attn.tiled.plan): work
items cover every (chunk, query block) or key range exactly once, whichever thread takes
them; results do not depend on the number of workers; split-KV decoding matches the float64
reference; concurrent callers share the pool safely."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import attn
from attn import tiled
from attn.masks import Band
from attn.testing import assert_close_to_reference, make_inputs
from attn.tiled import cpu, steps
from attn.tiled.gemm import _native_bf16
from attn.tiled.plan import backward_items, backward_runs, forward_items, kv_split

needs_workers = pytest.mark.skipif(not cpu.openmp_threads(),
                                   reason="workers run only under OpenMP intra-op threads")


@pytest.fixture
def threads():
    """Set torch's intra-op thread count inside a test; the old count comes back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_workers
def test_run_items_takes_each_item_once_with_a_slow_worker():
    """One worker is slowed down 20 ms per item: the others take more, none is run twice
    or skipped, and the caller works too."""
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()
    cpu._pool(2)  # the pool the call below uses, made first so its first worker is known
    slow = "attn-cpu_0"

    def item(i: int) -> None:
        name = threading.current_thread().name
        if name.endswith(slow.split("_")[-1]) and name.startswith("attn-cpu"):
            time.sleep(0.02)
        with lock:
            seen.append((i, name))
    cpu.run_items(item, 40, threads=3)
    assert sorted(i for i, _ in seen) == list(range(40))
    assert threading.current_thread().name in {name for _, name in seen}


@needs_workers
def test_run_items_stops_after_an_error_and_raises_it():
    started = []

    def item(i: int) -> None:
        started.append(i)
        if i == 2:
            raise ValueError("item 2 failed")
        time.sleep(0.002)
    with pytest.raises(ValueError, match="item 2 failed"):
        cpu.run_items(item, 200, threads=2)
    assert len(started) < 200  # no new item starts once one has failed


@pytest.mark.parametrize("threads", [0, 1, 2, 3])
def test_fill_passes_zero_and_cast_every_element(threads):
    # the backward's zeros and its gradients' casts, cut into runs over the pool: every
    # element of each pass, whatever the sizes (1, 7, and not a multiple of the runs)
    from attn import workers
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g) * 1e3 for n in (1, 7, 1001)] + [torch.randn(3, 5, 37)]
    dsts = [torch.full(t.shape, float("nan")) for t in srcs]
    casts = [torch.full(t.shape, 7.0, dtype=torch.bfloat16) for t in srcs]
    workers.fill_passes([(d, None) for d in dsts] + list(zip(casts, srcs)), threads=threads)
    for d, c, s in zip(dsts, casts, srcs):
        assert torch.equal(d, torch.zeros_like(s))
        assert torch.equal(c, s.to(torch.bfloat16))


def _plan(H=4, Hkv=2, Nq=100, Nk=120, band=Band(), block=(16, 32), B=2):
    q, k = torch.empty(B, H, Nq, 16), torch.empty(B, Hkv, Nk, 16)
    spec = tiled.LaunchSpec(qk_scale=1.0, band=band, block_m=block[0], block_n=block[1])
    return tiled._plan(q, k, spec), tiled._plan(q, k, spec, backward=True)


@pytest.mark.parametrize("shape", [dict(), dict(band=Band(0, None, 0)),
                                   dict(band=Band(20, 7, 3), Nq=37, Nk=90),
                                   dict(band=Band(0, None, 0), Nq=130, Nk=40), dict(B=1, Hkv=4)],
                         ids=["full", "causal", "window", "nq-gt-nk", "mha"])
def test_items_cover_every_block_once(shape):
    fwd, bwd = _plan(**shape)
    items = forward_items(fwd)
    every = {(c, b) for c in range(len(fwd.chunks)) for b in range(len(fwd.blocks))}
    assert len(items) == len(every) and set(items) == every
    runs = backward_runs(bwd)
    pairs = backward_items(bwd, runs)
    assert sorted(pairs) == [(c, r) for c in range(len(bwd.chunks)) for r in range(len(runs))]
    with_keys = [i for i, b in enumerate(bwd.blocks) if b[2]]
    covered = [i for i0, i1 in runs for i in range(i0, i1) if bwd.blocks[i][2]]
    assert covered == with_keys  # in order, each once
    assert all(i0 < i1 for i0, i1 in runs) and len(runs) <= tiled.DEFAULT.bwd_max_runs
    assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))


@pytest.mark.parametrize("Hkv", [1, 2, 4, 8])
def test_backward_cut_depends_on_the_heads_not_the_batch(Hkv):
    # each batch row and kv-head group is its own chunk, and the runs of query blocks fill
    # what the heads do not give: the same cut for one sequence alone and in a batch of 6,
    # and no dK/dV partial (one run) where there are 4 kv heads or more
    cuts, small = [], []
    for B in (1, 6):
        _, bwd = _plan(H=8, Hkv=Hkv, Nq=600, Nk=600, band=Band(0, None, 0), B=B)
        rows = [[(c.h0, c.h1) for c in bwd.chunks if c.b0 == b] for b in range(B)]
        assert all(c.b1 == c.b0 + 1 for c in bwd.chunks) and all(r == rows[0] for r in rows)
        cuts.append((rows[0], backward_runs(bwd)))
        # a short sequence keeps batched chunks (no head groups): its runs alone fill the
        # items, the same number at any batch size
        _, bwd = _plan(H=8, Hkv=Hkv, Nq=100, Nk=100, band=Band(0, None, 0), B=B)
        assert all(c.h1 - c.h0 == Hkv for c in bwd.chunks)
        small.append(backward_runs(bwd))
    assert cuts[0] == cuts[1] and small[0] == small[1] and len(small[0]) == 4
    groups, runs = cuts[0]
    assert len(groups) == min(Hkv, 4) and len(runs) == -(-4 // min(Hkv, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_bits_do_not_depend_on_the_batch(dtype):
    # long enough for one batch row per backward chunk (TileConfig.bwd_row_min_scores)
    q, k, v = make_inputs(B=4, H=8, Hkv=2, N=520, D=32, dtype=dtype, seed=1)

    def grads(q, k, v):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attn.attention(q, k, v, causal=True, backend="tiled", return_lse=True)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out, lse, q.grad, k.grad, v.grad
    full, alone, mixed = grads(q, k, v), grads(q[2:3], k[2:3], v[2:3]), grads(
        q[[3, 2]], k[[3, 2]], v[[3, 2]])
    for f, a, m in zip(full, alone, mixed):
        assert torch.equal(a[0], f[2]) and torch.equal(m[1], f[2])


@pytest.mark.parametrize("shape", [(5, 2, 1, 300, 32), (3, 2, 2, 17, 40)])
def test_short_sequences_bits_do_not_depend_on_the_batch(shape):
    # below TileConfig.bwd_row_min_scores the backward's chunks hold several batch rows, so a
    # sequence's rows sit at other offsets of each tile than alone: torch's exp2 rounds a
    # contiguous loop's last elements on another path (steps.exp2_), which gave this row
    # other dQ/dK/dV bits alone than in its batch
    B, H, Hkv, N, D = shape
    q, k, v = make_inputs(B=B, H=H, Hkv=Hkv, N=N, D=D, dtype=torch.float32, seed=1)

    def grads(q, k, v):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attn.attention(q, k, v, backend="tiled", return_lse=True)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out, lse, q.grad, k.grad, v.grad
    full, alone = grads(q, k, v), grads(q[2:3], k[2:3], v[2:3])
    for f, a in zip(full, alone):
        assert torch.equal(a[0], f[2])


def test_a_saturated_neighbour_leaves_a_sequences_bits_alone():
    # batch row 0's rows saturate (one key takes each row's weight: Δ comes from the tiles);
    # row 2's do not, and its backward keeps rowsum(dO∘O) whatever shares its chunk
    q, k, v = make_inputs(B=3, H=4, Hkv=2, N=400, D=32, dtype=torch.float32, seed=3)
    q = q.clone()
    q[0] *= 300

    def grads(q, k, v):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = attn.attention(q, k, v, backend="tiled", return_lse=True)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out, lse, q.grad, k.grad, v.grad
    full, alone = grads(q, k, v), grads(q[2:3], k[2:3], v[2:3])
    for f, a in zip(full, alone):
        assert torch.equal(a[0], f[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp2_bits_do_not_depend_on_where_a_value_sits(dtype):
    # every length and offset up to a few vector widths: each element as computed alone
    x = torch.rand(700, generator=torch.Generator().manual_seed(0), dtype=dtype) * 60 - 50
    whole = steps.exp2_(x.clone())
    for n0, n1 in [(0, 1), (3, 20), (5, 69), (64, 700), (1, 699), (17, 700), (600, 613)]:
        assert torch.equal(steps.exp2_(x[n0:n1].clone()), whole[n0:n1])
    torch.testing.assert_close(whole, torch.exp2(x.double()).to(dtype), rtol=2e-7, atol=0)


def test_kv_split_depends_on_the_shapes_alone():
    cfg = tiled.DEFAULT
    assert kv_split(cfg.split_max_q + 1, 1 << 20) is None  # a prefill, not a decode
    assert kv_split(1, cfg.split_min_keys - 1) is None  # too few keys to split
    for n_k in (cfg.split_min_keys, 4096, 5000, 16384, 32768, 1 << 20):
        chunk = kv_split(1, n_k)
        count = -(-n_k // chunk)
        assert chunk >= cfg.split_min_chunk and count <= cfg.split_max_chunks
        assert chunk == cfg.split_min_chunk or -(-n_k // (chunk // 2)) > cfg.split_max_chunks
        assert kv_split(cfg.split_max_q, n_k) == chunk


def _inputs(B=2, H=4, Hkv=2, Nq=100, Nk=120, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, D, generator=g).to(dtype)
                 for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))


def _grads(fn, q, k, v, extra):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    named = {n: (t.clone().requires_grad_(n != "alibi_slopes") if isinstance(t, torch.Tensor)
                 and t.is_floating_point() else t) for n, t in extra.items()}
    out = fn(*leaves, **named)
    w = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
    inputs = leaves + [t for t in named.values()
                       if isinstance(t, torch.Tensor) and t.requires_grad]
    return [out, *torch.autograd.grad((out * w).sum(), inputs)]


CASES = {
    "causal-gqa-sinks-softcap": (dict(), dict(causal=True, sinks=torch.randn(4),
                                              softcap=torch.full((4,), 4.0))),
    "window-float-mask": (dict(), dict(window=(30, 5), attn_mask=torch.randn(2, 1, 100, 120))),
    "float64-alibi": (dict(dtype=torch.float64), dict(alibi_slopes=torch.rand(4), causal=True)),
    "decode-split": (dict(Nq=3, Nk=2500), dict(causal=True, sinks=torch.randn(4),
                                              alibi_slopes=torch.rand(2, 4))),
    "decode-split-mask": (dict(Nq=1, Nk=2100), dict(attn_mask=torch.rand(2, 4, 1, 2100) > 0.2)),
}


@needs_workers
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_same_bits_with_1_2_3_workers(case, threads):
    shape, kw = CASES[case]
    q, k, v = _inputs(**shape)

    def fn(*a, **k2):
        return attn.attention(*a, backend="tiled", block_m=16, block_n=32, **k2)
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(_grads(fn, q, k, v, kw))
    for got in results[1:]:
        for a, b in zip(results[0], got):
            assert torch.equal(a, b)


@needs_workers
def test_same_bits_with_1_2_3_workers_score_mod_dropout_and_varlen(threads):
    q, k, v = _inputs(Nq=96, Nk=96)
    bias = torch.randn(4)

    def score_mod(s, b, h, i, j):
        return s + bias[h] * (i - j).abs() * 0.01

    def flex(*a):
        return attn.flex_attention(*a, score_mod=score_mod, enable_gqa=True, backend="tiled",
                                   kernel_options={"BLOCK_M": 16, "BLOCK_N": 32})

    def dropout(*a):
        torch.manual_seed(5)
        return attn.attention(*a, dropout_p=0.2, causal=True, backend="tiled", block_m=16,
                              block_n=32)
    cu = torch.tensor([0, 40, 90, 192], dtype=torch.int32)

    def varlen(q4, k4, v4):  # three packed sequences of the (2·96, H, D) rows
        qp, kp, vp = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q4, k4, v4))
        return attn.varlen_attention(qp, kp, vp, cu, cu, 102, 102, causal=True,
                                     backend="tiled")
    results = {}
    for n in (1, 2, 3):
        threads(n)
        results[n] = [_grads(f, q, k, v, {}) for f in (flex, dropout, varlen)]
    for n in (2, 3):
        for a, b in zip(sum(results[1], []), sum(results[n], [])):
            assert torch.equal(a, b)


SPLIT = {
    "gqa": dict(),
    "causal-bottom-right": dict(causal=True),
    "window-sinks": dict(window=(700, 0), sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "bool-mask-alibi": dict(attn_mask=torch.rand(2, 1, 3, 2500) > 0.3,
                            alibi_slopes=torch.rand(4)),
    "softcap-temperature": dict(softcap=3.0, temperature=0.5),
}


@pytest.mark.parametrize("case", list(SPLIT), ids=list(SPLIT))
def test_split_kv_decoding_matches_reference(case):
    """A few query rows against 2500 keys: five key ranges merged (the gradients run the
    ordinary backward with Δ from the tiles)."""
    q, k, v = _inputs(Nq=3, Nk=2500, seed=len(case))
    assert kv_split(3, 2500) is not None
    call = attn.AttentionCall(device="cpu", dtype=q.dtype, head_dim=16, head_dim_v=16, n_q=3,
                              n_k=2500)
    assert "split-KV" in attn.select_backend(call, "tiled").reason
    kw = {n: (t.clone().requires_grad_(n == "sinks") if isinstance(t, torch.Tensor) else t)
          for n, t in SPLIT[case].items()}
    assert_close_to_reference(lambda *a, **k2: attn.attention(*a, backend="tiled", **k2),
                              q, k, v, **kw)


@needs_workers
def test_concurrent_callers_share_the_pool(threads):
    """Four threads call attention (forward and backward) at once while torch runs 2
    intra-op threads: each gets what it gets alone, and the pool is the same object after."""
    threads(2)
    inputs = [_inputs(B=1, Nq=200, Nk=200, seed=s) for s in range(4)]

    def fn(*a):
        return attn.attention(*a, causal=True, backend="tiled", block_m=32, block_n=64)
    alone = [_grads(fn, *x, {}) for x in inputs]
    pool = cpu._pool(1)
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            for _ in range(2):
                got[i] = _grads(fn, *inputs[i], {})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    workers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in workers), "a caller hung"
    assert not errors, errors
    for i in range(4):
        for a, b in zip(alone[i], got[i]):
            assert torch.equal(a, b)
    assert cpu._pool(1) is pool


@pytest.mark.skipif(not _native_bf16(),
                    reason="this CPU's oneDNN has no native bf16: tiles are upcast to fp32")
@pytest.mark.parametrize("shape", ["square", "decode"])
def test_bf16_tile_gemms_run_in_bf16(monkeypatch, shape):
    """bf16 inputs: every tile GEMM takes bf16 operands, forward (q·kᵀ, P·V) and backward
    (q·kᵀ, dO·Vᵀ, dV += Pᵀ dO, dK += dSᵀ q, dQ += dS K); torch.bmm is watched, and D = 40,
    Dv = 24, G·BM = 48 and 64-key tiles tell the GEMMs apart by their (M, K, N) sizes.
    ATTN_TILED_BF16_GEMM=0 upcasts every tile, and both are within the error budget, forward
    and gradients (decoding: a split-KV call, forward only)."""
    Nq, Nk = (130, 150) if shape == "square" else (1, 2500)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, Nq, 40, generator=g).bfloat16()
    k = torch.randn(2, 2, Nk, 40, generator=g).bfloat16()
    v = torch.randn(2, 2, Nk, 24, generator=g).bfloat16()
    grad = shape == "square"

    def fn(*a, **kw):
        return attn.attention(*a, backend="tiled", block_m=24, block_n=64, **kw)
    bmm, sizes = torch.bmm, set()

    def watched(a, b, **kw):
        if a.dtype == b.dtype == torch.bfloat16:
            sizes.add((a.shape[-2], a.shape[-1], b.shape[-1]))  # (M, K, N)
        return bmm(a, b, **kw)
    monkeypatch.setattr(torch, "bmm", watched)
    # full tiles (G·BM = 2·24 query rows by 64 keys)
    fwd = {(48, 40, 64), (48, 64, 24)}  # q·kᵀ, P·V
    bwd = {(48, 24, 64), (64, 48, 24), (64, 48, 40), (48, 64, 40)}  # dO·Vᵀ, dV, dK, dQ
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ATTN_TILED_BF16_GEMM", flag)
        sizes.clear()
        q_ = q.clone().requires_grad_(grad)
        outs[flag] = fn(q_, k, v, causal=True)
        if grad:
            outs[flag].sum().backward()
            assert fwd | bwd <= sizes if flag == "1" else not sizes, sorted(sizes)
        else:  # G = 2 query rows against split-KV key ranges of n keys: q·kᵀ, P·V
            ranges = {n for m, kk, n in sizes if (m, kk) == (2, 40)}
            assert not sizes if flag == "0" else (
                ranges and {(2, n, 24) for n in ranges} <= sizes), sorted(sizes)
        assert_close_to_reference(fn, q, k, v, causal=True, sinks=torch.randn(4), grad=grad)
    assert not torch.equal(outs["1"], outs["0"])


def test_split_kv_with_values_near_float32_max_stays_finite():
    """Values of 1e35 over 2500 keys: the P·V sum of a key range overflows float32 unless
    the item looks at its values (it does so when its output comes out non-finite)."""
    q, k, v = _inputs(B=1, Nq=2, Nk=2500, seed=4)
    q = q * 1e-3  # nearly uniform weights: a range's Σ p·v is ~1250 · 3e35 > float32's max
    v = v.abs().clamp(0.5, 1) * 3e35
    out = attn.attention(q, k, v, backend="tiled")
    want = attn.attention(q.double(), k.double(), v.double(), backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4 * 3e35)


def test_chunked_prefill_runs_as_items_in_one_region(monkeypatch):
    """A prefill chunk (96 query rows against 700 cached keys, bottom-right causal, GQA 2:1):
    forward and backward each run as one parallel region of work items (at least one per
    query block; the backward may add one to join its dK/dV partials), not the batched
    op-by-op path, and match the float64 reference."""
    calls = []
    run_items = cpu.run_items

    def watched(fn, n_items, **kw):
        calls.append(n_items)
        return run_items(fn, n_items, **kw)
    monkeypatch.setattr(cpu, "run_items", watched)
    q, k, v = _inputs(Nq=96, Nk=700, seed=5)

    def fn(*a, **kw):
        return attn.attention(*a, backend="tiled", block_m=32, block_n=64, **kw)
    q_ = q.clone().requires_grad_()
    fn(q_, k, v, causal=True).sum().backward()
    # the forward's items, the backward's, and (when the backward split a chunk's query
    # blocks into runs) the join adding their dK/dV partials in run order
    assert len(calls) in (2, 3) and min(calls[:2]) >= 96 // 32, calls
    assert_close_to_reference(fn, q, k, v, causal=True)


def _flushing() -> bool:
    """Whether this thread flushes denormals now (a product whose exact value is one)."""
    return float(torch.tensor(1e-30) * 1e-10) == 0.0


@pytest.mark.parametrize("before", [False, True])
def test_flushed_denormals_gives_each_thread_its_setting_back(before):
    """Items run with denormals flushed on every thread that takes them; afterwards each
    thread (the caller with either setting, the pool's workers) has its own back."""
    from attn import workers
    torch.set_flush_denormal(before)
    try:
        def states(flush: bool) -> dict[int, set[bool]]:
            seen: dict[int, set[bool]] = {}

            def item(i: int) -> None:
                seen.setdefault(threading.get_ident(), set()).add(_flushing())
                time.sleep(0.001)  # so that more than one thread takes items
            workers.run_items(item, 32, threads=2, flush_denormals=flush)
            return seen
        own = states(False)
        assert own[threading.get_ident()] == {before}
        assert set().union(*states(True).values()) == {True}
        assert _flushing() == before
        after = states(False)
        assert all(after[t] == own[t] for t in after if t in own)
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("backend", ["fused", "tiled"])
def test_steep_alibi_with_denormal_probabilities_matches_reference(backend):
    """Slopes of 2 and 8 put many probabilities of each row among float32's denormals,
    which the items flush to zero: out, lse and every gradient stay within the budget."""
    q, k, v = make_inputs(1, 2, 300, 40, dtype=torch.float32, seed=3)
    slopes = torch.tensor([2.0, 8.0])
    assert_close_to_reference(lambda *a, **kw: attn.attention(*a, backend=backend, **kw),
                              q, k, v, causal=True, alibi_slopes=slopes)
