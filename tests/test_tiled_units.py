"""The tiled backend's unit path on CPU (:mod:`attn.tiled.cpu`): a call cut into units (one batch
row, one KV head with its query group) whose tile GEMMs run 2-D through oneDNN, in order or
on worker threads. Here the thresholds are lowered so small calls take it, with small tiles
so one call has full tiles, ragged edges and several units; every variant is compared with
the float64 reference like the batched path is."""

from __future__ import annotations

import threading

import pytest
import torch

import attn
from attn import AttentionCall, select_backend, tiled
from attn.tiled import cpu
from attn.testing import assert_close_to_reference

pytestmark = pytest.mark.skipif(cpu._LINEAR is None, reason="this torch build has no oneDNN")


def _inputs(B=2, H=4, Hkv=2, Nq=45, Nk=70, D=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype)
    return q, k, v


@pytest.fixture(params=["in-order", "workers"])
def units(request, monkeypatch):
    """The unit path forced on small calls (tiles of 16 rows x 32 keys); ``workers`` also
    sends every call's items to the worker threads (``in-order``: on the caller). Yields
    (engine, threads, chunks) per call. The launchers plan every call with this config (the
    spy passes it in place of the default)."""
    monkeypatch.setenv("ATTN_TILED_GEMM", "onednn")
    workers = request.param == "workers"
    config = tiled.TileConfig(unit_rows=16, unit_block_n=32, unit_min_rows=1, unit_min_keys=1,
                              unit_max_partial=1.0, serial_max_scores=0 if workers else 1 << 62)
    plans = []
    real = tiled._plan

    def spy(q, k, spec, v=None, _config=None, *, backward=False):
        plan = real(q, k, spec, v, config, backward=backward)
        plans.append((plan.engine, plan.threads, len(plan.chunks)))
        return plan
    monkeypatch.setattr(tiled.attention, "_plan", spy)
    yield plans
    assert plans, "no call planned"
    assert all(p[0] == "onednn" and p[1] == (None if workers else 1) for p in plans), plans


def _tiled(q, k, v, **kw):
    return attn.attention(q, k, v, backend="tiled", **kw)


CASES = {
    "plain": dict(),
    "causal-gqa": dict(causal=True),
    "window-sinks": dict(window=(9, 4), sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "softcap-learned": dict(softcap=torch.full((4,), 3.0), causal=True),
    "softcap-fixed-bool-mask": dict(softcap=5.0, attn_mask=torch.rand(45, 70) > 0.3),
    "float-mask-per-batch-head": dict(attn_mask=torch.randn(2, 4, 45, 70)),
    "float-mask-per-batch": dict(attn_mask=torch.randn(2, 1, 45, 70), window=(20, 5)),
    "alibi-per-batch": dict(alibi_slopes=torch.rand(2, 4), causal=True),
    "alibi-sinks-temperature": dict(alibi_slopes=torch.rand(4), temperature=0.7,
                                    sinks=torch.tensor([0.1, 0.2, -0.3, 1.0])),
}
GRAD = {"sinks", "softcap", "attn_mask"}  # tensors whose gradient is checked too


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_units_match_reference(units, case):
    kw = {n: (t.clone().requires_grad_(n in GRAD and t.is_floating_point())
              if isinstance(t, torch.Tensor) else t) for n, t in CASES[case].items()}
    q, k, v = _inputs(seed=len(case))
    assert_close_to_reference(_tiled, q, k, v, **kw)
    assert units[-1][2] == 4  # B x Hkv units


@pytest.mark.parametrize("shape", [dict(H=4, Hkv=4, Nq=1, Nk=33), dict(H=6, Hkv=1, Nq=70,
                                                                         Nk=45, D=40)],
                         ids=["one-query-mha", "mqa-nq-gt-nk"])
def test_units_awkward_shapes(units, shape):
    q, k, v = _inputs(seed=3, **shape)
    assert_close_to_reference(_tiled, q, k, v, causal=True)
    assert_close_to_reference(_tiled, q, k, v)


def test_units_bfloat16(units):
    q, k, v = _inputs(seed=5, dtype=torch.bfloat16)
    assert_close_to_reference(_tiled, q, k, v, causal=True)


def test_units_dropout_equals_batched(units, monkeypatch):
    """Dropout hashes global (batch, head, i, j): units draw the batched path's mask (which
    the variant suite tests against the reference)."""
    q, k, v = (t.requires_grad_() for t in _inputs(seed=4))
    results = []
    for engine in ("onednn", "bmm"):
        monkeypatch.setenv("ATTN_TILED_GEMM", engine)
        torch.manual_seed(7)
        out = _tiled(q, k, v, dropout_p=0.3, causal=True)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    units[:] = units[:1]  # the bmm call is the comparison, not the path under test
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_units_under_inference_mode_and_no_grad(units):
    q, k, v = _inputs(seed=6)
    want = _tiled(q, k, v, causal=True)
    with torch.inference_mode():
        got = _tiled(q, k, v, causal=True)
    assert got.is_inference()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    q.requires_grad_()
    with torch.no_grad():
        got = _tiled(q, k, v, causal=True)
    assert not got.requires_grad


@pytest.mark.parametrize("shapes", [((5, 7), (3, 7)), ((1, 7), (3, 7)), ((5, 1), (1, 1)),
                                    ((4, 6), (1, 6))], ids=str)
def test_mm_nt_any_layout(shapes):
    """oneDNN's product equals torch's for transposed, sliced and size-1 operands (the op
    itself misreads a transposed weight: the wrapper must hand it row-major memory)."""
    g = torch.Generator().manual_seed(1)
    (m, kk), (n, _) = shapes
    for x in (torch.randn(m, kk, generator=g), torch.randn(kk, m, generator=g).t(),
              torch.randn(m, 2 * kk, generator=g)[:, ::2]):
        for w in (torch.randn(n, kk, generator=g), torch.randn(kk, n, generator=g).t(),
                  torch.randn(n + 2, kk, generator=g)[1:-1]):
            torch.testing.assert_close(cpu.mm_nt(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_worker_threads_run_one_intra_op_thread_each(monkeypatch):
    """Every thread that runs items, the caller included, runs them with one intra-op
    thread and the caller's grad mode; the caller has its own count back afterwards."""
    if not cpu.openmp_threads():
        pytest.skip("workers are only used with OpenMP intra-op threads")
    before = torch.get_num_threads()
    seen = []
    lock = threading.Lock()

    def job(i):
        with lock:
            seen.append((threading.current_thread().name, torch.get_num_threads(),
                         torch.is_grad_enabled()))
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            cpu.run_items(job, 6)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 6
    caller = threading.current_thread().name
    assert all((name.startswith("attn-cpu") or name == caller) and n == 1 and not grad
               for name, n, grad in seen), seen


def test_worker_exception_reaches_the_caller():
    if not cpu.openmp_threads():
        pytest.skip("workers are only used with OpenMP intra-op threads")

    def job(i):
        if i == 3:
            raise ValueError("unit 3 failed")
    with pytest.raises(ValueError, match="unit 3 failed"):
        cpu.run_items(job, 5, threads=2)


def test_engine_switch_and_reason(monkeypatch):
    monkeypatch.setenv("ATTN_TILED_GEMM", "bmm")
    assert cpu.gemm_engine() == ("bmm", "ATTN_TILED_GEMM=bmm")
    monkeypatch.setenv("ATTN_TILED_GEMM", "fast")
    with pytest.raises(ValueError, match="ATTN_TILED_GEMM"):
        cpu.gemm_engine()
    monkeypatch.setenv("ATTN_TILED_GEMM", "onednn")
    call = AttentionCall(device="cpu", dtype=torch.float32, head_dim=64, head_dim_v=64,
                         n_q=4096, n_k=4096)
    assert "oneDNN" in select_backend(call, "tiled").reason
    monkeypatch.setattr(cpu, "_LINEAR", None)  # a build without oneDNN: bmm, and says so
    assert cpu.gemm_engine()[0] == "bmm"
    assert "no oneDNN" in select_backend(call, "tiled").reason


def test_auto_keeps_bmm_where_onednn_is_not_faster(monkeypatch):
    """auto measures once: an oneDNN that is no faster than bmm is not taken."""
    monkeypatch.setenv("ATTN_TILED_GEMM", "auto")
    monkeypatch.setattr(cpu, "_RESOLVED", None)
    real = cpu.mm_nt

    def slow(x, w):  # three products for one: never 1.3x faster than bmm
        real(x, w), real(x, w)
        return real(x, w)
    monkeypatch.setattr(cpu, "mm_nt", slow)
    engine, why = cpu.gemm_engine()
    assert engine == "bmm" and "auto" in why
    q, k, v = _inputs(B=1, H=2, Hkv=2, Nq=600, Nk=600, D=8)
    assert tiled._plan(q, k, tiled.LaunchSpec(qk_scale=1.0)).engine == "bmm"


def test_plan_rules(monkeypatch):
    """Large calls take units; decoding, float64, programmable masks and mostly-partial
    bands stay batched; only tiny calls run their items in order on the caller."""
    monkeypatch.setenv("ATTN_TILED_GEMM", "onednn")
    spec = tiled.LaunchSpec(qk_scale=1.0)
    cfg = tiled.TileConfig()  # the defaults

    def plan(spec=spec, Nq=1024, Nk=1024, H=8, Hkv=8, dtype=torch.float32):
        q = torch.empty(1, H, Nq, 64, dtype=dtype)
        return tiled._plan(q, torch.empty(1, Hkv, Nk, 64, dtype=dtype), spec)
    p = plan()
    assert p.engine == "onednn" and len(p.chunks) == 8 and p.threads is None
    assert (p.spec.block_m, p.spec.block_n) == (cfg.unit_rows, cfg.unit_block_n)
    assert plan(Nq=8, Nk=8).threads == 1  # 8 heads x 64 scores: in order on the caller
    assert plan(Nq=8192, Nk=8192).spec.block_m == cfg.unit_rows_full  # no band: taller tiles
    assert plan(Nq=4096, Nk=4096).spec.block_m == cfg.unit_rows
    assert plan(H=8, Hkv=2).spec.block_m == cfg.unit_rows // 4  # G·BM rows per tile
    assert plan(H=8, Hkv=2, Nq=2048, Nk=2048).spec.block_m == cfg.unit_rows_full // 4
    assert plan(Nq=1, Nk=32768, H=32, Hkv=8).engine == "bmm"  # decoding
    assert plan(dtype=torch.float64).engine == "bmm"
    causal = tiled.LaunchSpec(qk_scale=1.0, band=attn.masks.Band(0, None, 0))
    assert plan(causal).engine == "bmm"  # N = 1024: 2 of 3 tiles partial
    assert plan(causal, Nq=2048, Nk=2048).engine == "onednn"  # 4 of 10
    assert plan(causal, Nq=8192, Nk=8192).spec.block_m == cfg.unit_rows
    flex = tiled.LaunchSpec(qk_scale=1.0, score_mod=lambda s, b, h, i, j: s)
    assert plan(flex).engine == "bmm"


def test_head_first_view_of_a_cache_runs_per_batch_row(monkeypatch):
    """k, v seen head-first from a (B, N, Hkv, D) cache have no (B·Hkv, N, D) view: where
    each row does enough work (``row_min_products``) the batched path runs batch row by batch
    row (a view each) instead of copying the whole cache; rows of little work (a toy model's
    12-token sequences) stay in one chunk, which copies its K/V, rather than paying a Python
    step per row. Same result either way."""
    monkeypatch.setenv("ATTN_TILED_GEMM", "bmm")
    q, k, v = _inputs(B=3, seed=8)
    k_cache, v_cache = (x.transpose(1, 2).contiguous() for x in (k, v))  # (B, N, Hkv, D)
    k_view, v_view = (x.transpose(1, 2) for x in (k_cache, v_cache))
    spec = tiled.LaunchSpec(qk_scale=1.0)
    H, Nq, Nk, D = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    big_rows = tiled.TileConfig(row_min_products=H * Nq * Nk * D)  # each row just enough
    plan = tiled._plan(q, k_view, spec, v_view, config=big_rows)
    assert [(c.b0, c.b1) for c in plan.chunks] == [(0, 1), (1, 2), (2, 3)]
    small_rows = tiled.TileConfig(row_min_products=H * Nq * Nk * D + 1)
    assert len(tiled._plan(q, k_view, spec, v_view, config=small_rows).chunks) == 1
    assert len(tiled._plan(q, k_view, spec, v_view).chunks) == 1  # 50 400 < 2^22 products
    assert len(tiled._plan(q, k, spec).chunks) == 1
    causal = tiled.LaunchSpec(qk_scale=D ** -0.5, band=attn.masks.Band(Nk - Nq, None, 0))
    want, want_lse = _tiled(q, k, v, causal=True, return_lse=True)
    for config in (big_rows, small_rows):
        out, lse = tiled.tiled_attention(q, k_view, v_view, causal, config=config)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_units_huge_logits_and_extreme_temperature(units):
    """Scores of about 1e4: the backward recomputes P from the forward's lse with the tile
    GEMM in the other orientation (keys-major), which must not move P at that scale."""
    q, k, v = _inputs(B=1, H=2, Hkv=2, Nq=65, Nk=65, D=16, seed=9)
    out = _tiled(q, k, v, scale=1e4 / 16)
    assert torch.isfinite(out).all()
    assert_close_to_reference(_tiled, q, k, v, scale=1e4 / 16, causal=True)
    assert_close_to_reference(_tiled, q, k, v, scale=1e4 / 16)
    assert_close_to_reference(_tiled, q, k, v, temperature=1e-3)
