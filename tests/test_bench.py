"""attn.bench: FLOP formulas, timing, the CPU peak-memory method, the sweep runner, writers,
and a smoke run of ``attn report`` (the main job) so it cannot break silently."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attn
from attn.bench import CPU_ERROR_BYTES, attention_flops, benchmark, peak_bytes
from attn.bench import competitors
from attn.bench import report as report_mod
from attn.bench import sweep as sweep_mod
from attn.bench.cli import main, parse_args
from attn.bench.sweep import SweepConfig, finish, plan, predicted_peak_bytes, run_sweep
from attn.testing import make_inputs

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


# -- FLOPs -------------------------------------------------------------------------------------

def test_flops_formulas():
    B, H, N, D = 2, 3, 128, 64
    fwd = attention_flops(B, H, N, N, D)
    assert fwd == 4 * B * H * N * N * D
    assert attention_flops(B, H, N, N, D, causal=True) == fwd / 2
    assert attention_flops(B, H, N, N, D, mode="fwd+bwd") == fwd * 3.5
    assert attention_flops(B, H, N, N, D, mode="fwd+bwd", causal=True) == fwd * 3.5 / 2
    assert attention_flops(1, 1, 10, 20, 8, Dv=24) == 2 * 10 * 20 * (8 + 24)  # QKᵀ + PV
    with pytest.raises(ValueError, match="mode"):
        attention_flops(B, H, N, N, D, mode="bwd")


# -- timing ------------------------------------------------------------------------------------

def test_benchmark_times_a_known_sleep():
    t = benchmark(lambda: time.sleep(0.02), warmup=1, repeats=3)
    assert t.repeats == 3
    assert 19.0 <= t.median_ms < 60.0  # sleep never returns early; slack for a busy machine
    assert t.min_ms <= t.median_ms


def test_benchmark_budget_stops_early_but_keeps_min_repeats():
    calls = []
    t = benchmark(lambda: (calls.append(1), time.sleep(0.01)), warmup=2, repeats=50,
                  min_repeats=3, budget_s=0.001)
    assert t.repeats == 3 and len(calls) == 2 + 3
    with pytest.raises(ValueError):
        benchmark(lambda: None, repeats=0)


# -- peak memory (CPU method) ------------------------------------------------------------------

def test_peak_bytes_finds_known_64mib_allocation():
    got = peak_bytes(lambda: torch.empty(64 * MiB, dtype=torch.uint8))
    assert abs(got - 64 * MiB) <= CPU_ERROR_BYTES


def test_peak_bytes_is_the_peak_not_the_sum_or_the_end():
    def fn():
        a = torch.ones(16 * MiB, dtype=torch.uint8)  # live: 16
        b = torch.ones(32 * MiB, dtype=torch.uint8)  # live: 48  <- peak
        del a, b
        c = torch.ones(40 * MiB, dtype=torch.uint8)  # live: 40
        return c

    assert abs(peak_bytes(fn) - 48 * MiB) <= CPU_ERROR_BYTES


def test_peak_bytes_ignores_frees_of_older_tensors():
    # the metric is "above what existed before": freeing an input must not hide a later peak
    box = [torch.ones(64 * MiB, dtype=torch.uint8)]

    def fn():
        box.clear()
        return torch.ones(8 * MiB, dtype=torch.uint8)

    assert abs(peak_bytes(fn) - 8 * MiB) <= CPU_ERROR_BYTES


def test_peak_bytes_sees_allocations_inside_aten_kernels():
    x = torch.randn(512, 512)
    # matmul output 1 MiB, allocated by the kernel in C++, not by Python
    assert abs(peak_bytes(lambda: x @ x) - MiB) <= CPU_ERROR_BYTES


def test_reference_memory_is_its_score_tensors():
    # the reference holds s, exp(s - m) and p: about 3 tensors of B·H·N² floats
    B, H, N, D = 1, 4, 512, 32
    q, k, v = make_inputs(B, H, N, D, seed=1)
    scores = B * H * N * N * 4
    got = peak_bytes(lambda: attn.attention(q, k, v, backend="reference"))
    assert 2.9 * scores <= got <= 3.3 * scores, got / scores


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("backend", ["reference", "tiled", "sdpa"])
def test_prediction_bounds_measured_peak(backend, mode):
    # the sweep skips points by this prediction: it must not underestimate
    for N in (256, 1024):
        row = sweep_mod.Row(backend, "cpu", "float32", 1, 4, N, 64, False, mode)
        cfg = SweepConfig(n=(N,), max_bytes=2**40)
        measured = peak_bytes(sweep_mod.make_call(row, cfg))
        predicted = predicted_peak_bytes(backend, mode, 1, 4, N, 64, torch.float32)
        assert measured <= predicted, (N, measured / MiB, predicted / MiB)


# -- the sweep runner --------------------------------------------------------------------------

def _tiny(**kw) -> SweepConfig:
    base = dict(n=(32, 64), backends=("reference", "tiled", "triton", "sdpa"), heads=2, d=(16,),
                warmup=0, repeats=2, min_repeats=1, budget_s=0.05, max_bytes=2**34)
    return SweepConfig(**{**base, **kw})


def test_sweep_runs_every_point_and_fills_every_column(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = _tiny()
    rows = finish(list(run_sweep(cfg)), {"float32": 1.0})
    assert len(rows) == len(plan(cfg)) == 2 * 4 * 2  # N × backends × modes
    by = {(r.backend, r.N, r.mode): r for r in rows}
    for r in rows:
        if r.backend == "triton":
            assert r.status == "skipped" and "CUDA" in r.note and r.ms is None
            continue
        assert r.status == "ok", r.note
        assert r.ms > 0 and r.peak_bytes > 0 and r.repeats >= 1
        assert r.tflops == pytest.approx(r.flops / (r.ms * 1e-3) / 1e12)
        assert r.matmul_fraction == pytest.approx(r.tflops)
        sdpa = by[("sdpa", r.N, r.mode)]
        assert r.ratio_to_sdpa == pytest.approx(sdpa.ms / r.ms)
    assert by[("sdpa", 32, "fwd")].ratio_to_sdpa == 1.0
    # forward+backward keeps gradients: more memory than the forward alone
    assert by[("tiled", 64, "fwd+bwd")].peak_bytes > by[("tiled", 64, "fwd")].peak_bytes


def test_sweep_skips_points_predicted_over_budget():
    # a budget that fits tiled at N=1024 but not the reference's N² scores there
    budget = predicted_peak_bytes("tiled", "fwd", 1, 2, 1024, 16, torch.float32) + MiB
    assert budget < predicted_peak_bytes("reference", "fwd", 1, 2, 1024, 16, torch.float32)
    rows = list(run_sweep(_tiny(n=(32, 1024), backends=("reference", "tiled"), modes=("fwd",),
                                max_bytes=budget)))
    status = {(r.backend, r.N): r.status for r in rows}
    assert status == {("reference", 32): "ok", ("tiled", 32): "ok",
                      ("reference", 1024): "skipped", ("tiled", 1024): "ok"}
    assert "predicted peak" in next(r.note for r in rows if r.status == "skipped")


def test_out_of_memory_skips_the_rest_of_the_series(monkeypatch):
    real = sweep_mod._measure

    def fake(row, cfg):
        if row.backend == "reference" and row.N >= 64:
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate")
        real(row, cfg)

    monkeypatch.setattr(sweep_mod, "_measure", fake)
    rows = list(run_sweep(_tiny(n=(32, 64, 128), backends=("reference", "tiled"),
                                modes=("fwd",))))
    got = {(r.backend, r.N): r.status for r in rows}
    assert got[("reference", 32)] == "ok" and got[("reference", 64)] == "oom"
    assert got[("reference", 128)] == "skipped" and got[("tiled", 128)] == "ok"


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_first_call_costs_stay_out_of_the_peak(monkeypatch, backend):
    # triton's first call autotunes (its timer allocates a 256 MB L2-flush buffer) and flex's
    # compiles: a point's peak is a later call's, not the first one's
    calls = []

    def make_call(row, cfg):
        def fn():
            calls.append(1)
            held = torch.empty((64 if len(calls) == 1 else 1) * MiB, dtype=torch.uint8)
            held.fill_(1)  # touched, so the CPU method sees it
        return fn

    monkeypatch.setattr(sweep_mod, "make_call", make_call)
    row = sweep_mod.Row(backend, "cpu", "bfloat16", 1, 2, 64, 16, False, "fwd")
    sweep_mod._measure(row, _tiny(measure_time=False))
    assert len(calls) == 2 and row.peak_bytes < 8 * MiB, row.peak_bytes / MiB


def test_sweep_config_rejects_unknown_names():
    for bad in (dict(backends=("auto",)), dict(modes=("bwd",)), dict(dtypes=("int8",))):
        with pytest.raises(ValueError):
            SweepConfig(**bad)


# -- writers -----------------------------------------------------------------------------------

def test_json_schema_markdown_and_plots(tmp_path):
    cfg = _tiny(backends=("tiled", "sdpa"))
    rows = finish(list(run_sweep(cfg)), {"float32": 0.5})
    header = report_mod.make_header(cfg, ["bench", "speed"], {"float32": 0.5})
    path = report_mod.write_json(tmp_path / "r.json", header, rows)
    doc = json.loads(path.read_text())
    assert set(doc) >= {"header", "rows"}
    for key in ("torch", "triton", "device_name", "kind", "date", "command"):
        assert key in doc["header"]
    assert doc["header"]["kind"] == "cpu" and doc["header"]["command"] == "attn bench speed"
    for r in doc["rows"]:
        assert set(report_mod.ROW_KEYS) <= set(r)
        assert isinstance(r["peak_bytes"], int) and isinstance(r["ms"], float)

    md = report_mod.markdown_tables(doc["rows"])
    assert "**fwd, non-causal, float32, B=1, H=2, D=16**" in md
    assert md.count("| 64 | tiled |") == 2  # one row per mode

    pytest.importorskip("matplotlib")
    from attn.bench.plots import write_plots

    pngs = write_plots(doc["rows"], tmp_path, doc["header"])
    assert sorted(p.name for p in pngs) == ["memory-float32-d16.png", "speed-float32-d16.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checks_catch_a_wrong_backend(monkeypatch):
    real = attn.api.attention

    def off_by_a_bit(q, k, v, *, backend, **kw):
        out = real(q, k, v, backend=backend, **kw)
        if backend == "tiled":
            out = out * 1.001 if not isinstance(out, tuple) else (out[0] * 1.001, out[1])
        return out

    monkeypatch.setattr(report_mod, "attention", off_by_a_bit)
    checks = report_mod.run_checks("cpu", ("reference", "tiled", "sdpa"))
    status = {(c.backend, c.status) for c in checks}
    assert status == {("tiled", "failed"), ("sdpa", "ok")}
    assert "out" in next(c.message for c in checks if c.status == "failed")


# -- the commands ------------------------------------------------------------------------------

def test_attn_report_smoke(tmp_path):
    """The main job end to end in a fresh process, as a user runs it."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "attn", "report", "--quick", "--n", "32", "64", "--heads", "2",
         "--out", str(out), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, rows, checks = report_mod.load_json(out / "results.json")
    assert header["command"].startswith("attn report --quick")
    assert {c["backend"] for c in checks if c["status"] == "ok"} >= {"tiled", "sdpa"}
    assert all(c["status"] != "failed" for c in checks)
    ok = {(r["backend"], r["N"], r["mode"]) for r in rows if r["status"] == "ok"}
    assert {(b, n, m) for b in ("reference", "tiled", "sdpa") for n in (32, 64)
            for m in ("fwd", "fwd+bwd")} <= ok
    assert (out / "results.md").exists() and "sdpa ms / ms" in proc.stdout
    assert "profiler_start" not in proc.stderr  # the profiler's chatter is filtered
    pytest.importorskip("matplotlib")
    assert (out / "memory-float32-d64.png").exists()


def test_bench_memory_measures_memory_only(tmp_path, capsys):
    rc = main(["bench", "memory", "--n", "32", "--backends", "tiled", "--mode", "fwd",
               "--heads", "2", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    assert rc == 0
    _, rows, _ = report_mod.load_json(tmp_path / "results.json")
    assert rows[0]["peak_bytes"] > 0 and rows[0]["ms"] is None


def test_bench_speed_runs_in_a_fresh_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "attn", "bench", "speed", "--n", "32", "--backends",
         "sdpa", "--mode", "fwd", "--heads", "1", "--out", str(tmp_path), "--no-plots",
         "--no-progress", "--repeats", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, rows, _ = report_mod.load_json(tmp_path / "results.json")
    assert rows[0]["ms"] > 0 and rows[0]["peak_bytes"] is None


# -- torch's kernels as competitors ------------------------------------------------------------

def test_competitor_rows_run_or_say_why_not(tmp_path):
    """On CPU torch has its flash kernel but neither the efficient nor the cuDNN one: the
    first is timed beside sdpa with a ratio, the others are skipped rows with the reason."""
    rc = main(["bench", "speed", "--device", "cpu", "--n", "32", "--d", "16", "--heads", "2",
               "--backends", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn",
               "--mode", "fwd", "--repeats", "1", "--out", str(tmp_path), "--no-plots",
               "--no-progress"])
    assert rc == 0
    _, rows, _ = report_mod.load_json(tmp_path / "results.json")
    by = {r["backend"]: r for r in rows}
    assert by["sdpa-flash"]["status"] == "ok" and by["sdpa-flash"]["ms"] > 0
    assert by["sdpa-flash"]["ratio_to_sdpa"] == pytest.approx(by["sdpa"]["ms"]
                                                              / by["sdpa-flash"]["ms"])
    for name in ("sdpa-efficient", "sdpa-cudnn"):
        assert by[name]["status"] == "skipped" and "CUDA only" in by[name]["note"]
    md = (tmp_path / "results.md").read_text()
    assert "| 32 | sdpa-flash |" in md and "sdpa-cudnn skipped at N=32" in md


def test_sdpa_probe_reports_a_kernel_that_refuses():
    # asked directly (past the CUDA-only shortcut), torch's CPU build refuses the kernel
    why = competitors._probe_sdpa("sdpa-efficient", "cpu", torch.float32, 16, True, "fwd")
    assert why is not None and "EFFICIENT_ATTENTION" in why and "D=16" in why
    assert competitors._probe_sdpa("sdpa-flash", "cpu", torch.float32, 16, True,
                                   "fwd+bwd") is None
    with pytest.raises(ValueError, match="competitor must be one of"):
        competitors.competitor_unsupported("xformers", "cpu", torch.float32, 16, False, "fwd")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_competitor_forwards_compute_attention(causal, monkeypatch):
    """The competitors compute the same attention as attn's reference. FlexAttention runs
    eager here (compiling it on CPU takes tens of seconds; that path is under -m slow)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    q, k, v = make_inputs(1, 2, 40, 16, seed=3)
    want = attn.attention(q, k, v, causal=causal, backend="reference")
    for name in ("sdpa-flash", "flex"):
        got = competitors.make_forward(name, causal, 40, "cpu")(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)


def test_a_competitor_failing_at_run_time_is_skipped_not_an_error(monkeypatch):
    def refuse(name, causal, N, device):
        raise RuntimeError(f"{name} cannot do N={N} on this build")

    monkeypatch.setattr(sweep_mod, "make_forward", refuse)
    rows = list(run_sweep(_tiny(n=(32,), backends=("sdpa-flash", "tiled"), modes=("fwd",))))
    by = {r.backend: r for r in rows}
    assert by["sdpa-flash"].status == "skipped" and "N=32" in by["sdpa-flash"].note
    assert by["tiled"].status == "ok"


def test_flex_backward_is_skipped_off_cuda():
    rows = list(run_sweep(_tiny(n=(32,), backends=("flex",), modes=("fwd+bwd",))))
    assert rows[0].status == "skipped" and "backward" in rows[0].note


@pytest.mark.slow
def test_compiled_flex_runs_in_a_cpu_sweep():
    rows = finish(list(run_sweep(_tiny(n=(32,), backends=("sdpa", "flex"), modes=("fwd",),
                                       causal=(True,)))))
    flex = next(r for r in rows if r.backend == "flex")
    assert flex.status == "ok", flex.note
    assert flex.ms > 0 and flex.ratio_to_sdpa is not None


def test_checks_leave_competitors_to_torch():
    assert report_mod.run_checks("cpu", ("sdpa-flash", "flex")) == []


def test_fixed_work_per_point_sets_batch_and_heads_per_n(tmp_path):
    cfg = _tiny(n=(32, 64, 256), d=(16, 32), tokens=128, width=64, backends=("tiled",),
                modes=("fwd",))
    rows = plan(cfg)
    assert {(r.N, r.D, r.B, r.H) for r in rows} == {
        (n, d, max(1, 128 // n), 64 // d) for n in (32, 64, 256) for d in (16, 32)}
    for r in rows:
        r.ms, r.tflops = 1.0, 1.0
    md = report_mod.markdown_tables([r.as_dict() for r in rows])
    assert "| N | B×H | backend |" in md and "| 64 | 2×4 | tiled |" in md
    assert "**fwd, non-causal, float32, D=16**" in md  # no single B, H in the title


def test_preset_triton_is_attn_bench_speed(monkeypatch):
    """``--preset triton`` fills ``attn bench speed``'s defaults: every competitor, fixed
    tokens and width, the 8192² matmul, CUDA; each flag given by hand still wins."""
    monkeypatch.chdir(REPO)
    a = parse_args(["bench", "speed", "--preset", "triton"], "Some GPU")
    assert (a.command, a.kind, a.device) == ("bench", "speed", "cuda")
    assert set(a.backends) == {"triton", "sdpa", *competitors.COMPETITORS}
    assert (a.tokens, a.width, a.batch, a.heads, a.matmul_n) == (16384, 2048, None, None, 8192)
    assert a.out == REPO / "benchmarks" / "results" / "triton" / "Some_GPU"
    b = parse_args(["bench", "speed", "--preset", "triton", "--n", "4096", "--d", "128",
                    "--causal", "true", "--mode", "fwd", "-B", "2", "-H", "4",
                    "--backends", "triton", "flex"], "x")
    assert (b.n, b.d, b.causal, b.mode, b.batch, b.heads, b.tokens, b.width, b.backends) == (
        [4096], [128], "true", "fwd", 2, 4, None, None, ["triton", "flex"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_preset_triton_without_cuda_exits_2_and_says_why(capsys):
    # in this process: `python -m attn` returning main's status is covered by the fresh-process
    # tests above; a process of its own here cost ~8 CPU-s for one message
    rc = main(["bench", "speed", "--preset", "triton"])
    assert rc == 2 and "no CUDA device" in capsys.readouterr().err


def test_paired_rounds_take_turns_and_ratios_are_per_round(monkeypatch):
    """paired() runs every function reps times per round, in turn; median_ratio() divides
    within a round (a fake clock: each call of a takes 1 s, of b 3 s in round 1, else 2 s)."""
    from attn import timing

    now, calls = [0.0], []

    def fn(name, cost):
        def call():
            calls.append(name)
            now[0] += cost()
        return call
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    b_cost = iter([3.0] * 2 + [2.0] * 4)  # round 1: 2 reps at 3 s, then 2 s
    times = timing.paired({"a": fn("a", lambda: 1.0), "b": fn("b", lambda: next(b_cost))},
                          rounds=3, reps=2)
    assert calls == ["a", "a", "b", "b"] * 3
    assert times == {"a": [1.0, 1.0, 1.0], "b": [3.0, 2.0, 2.0]}
    assert timing.median_ratio(times, "b", "a") == 2.0
    # warm-up rounds: one untimed call each, in turn, before the timed rounds
    calls.clear()
    times = timing.paired({"a": fn("a", lambda: 1.0), "b": fn("b", lambda: 5.0)}, rounds=1,
                          warmup=2)
    assert calls == ["a", "b", "a", "b", "a", "b"] and times == {"a": [1.0], "b": [5.0]}


# -- the benchmark questions -------------------------------------------------------------------

def test_speed_paired_writes_one_row_per_shape_with_positive_ratios(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTN_TILED_GEMM", raising=False)
    rc = main(["bench", "speed", "--paired", "--n", "48", "80", "--d", "16", "--heads", "2",
               "--mode", "fwd", "--causal", "true", "--no-fused", "--flex-max-n", "0",
               "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [(r["N"], r["mode"], r["causal"]) for r in doc["rows"]] == [(48, "fwd", True),
                                                                       (80, "fwd", True)]
    for r in doc["rows"]:
        # "tiled bmm" only where auto took another engine (else it is the same path again);
        # auto's choice is a timing, so either may come out here. attn.attention as a user
        # calls it (auto) and the fused backend are always measured
        assert {"auto", "fused", "tiled"} <= set(r["ratio"])
        assert set(r["ratio"]) <= {"auto", "fused", "tiled", "tiled bmm"}
        assert r["rounds"] == 2
        assert all(math.isfinite(x) and x > 0 for x in [*r["ratio"].values(), *r["ms"].values()])
    assert doc["header"]["command"].startswith("attn bench speed --paired")
    assert "ATTN_TILED_GEMM" not in os.environ  # the contenders' settings do not leak
    assert "| 80 | 16 | float32 | fwd | True |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("compat", [False, True], ids=["attention", "compat"])
def test_decode_matches_float64_sdpa_on_every_path(tmp_path, compat):
    flags = ["--compat", "--pages", "16", "--batch", "2"] if compat else []
    rc = main(["bench", "decode", *flags, "--cache", "40", "97", "--heads", "4", "--kv-heads",
               "2", "--d", "16", "--warmup", "0", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    paths = ({"compat contiguous", "compat paged (page 16)", "sdpa, same cache",
              "sdpa, head-major"} if compat else
             {"attn tiled", "sdpa, same cache", "sdpa, expanded cache"})
    assert [r["cache"] for r in doc["rows"]] == [40, 97]
    for r in doc["rows"]:
        assert set(r["ms"]) == paths and all(t > 0 for t in r["ms"].values())
        assert all(e < 1e-5 for e in r["max_abs_err"].values()), r["max_abs_err"]
        assert r["ratio_to_sdpa"]["sdpa, same cache"] == 1.0


def test_decode_caches_match_float64_on_the_values_each_cache_holds(tmp_path):
    """One decoding step (Nq = 1) and a chunked-prefill chunk (Nq = 5, causal from the end)."""
    rc = main(["bench", "decode", "--caches", "--cache", "40", "97", "--batch", "2", "--heads",
               "4", "--kv-heads", "2", "--d", "32", "--page", "16", "--nq", "1", "5",
               "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [(r["B"], r["Nq"], r["cache"]) for r in doc["rows"]] == [
        (2, 1, 40), (2, 1, 97), (2, 5, 40), (2, 5, 97)]
    formats = ("fp32", "bf16", "int8", "int4", "fp8")
    for r in doc["rows"]:
        layouts, lost = ("contiguous", "paged"), r["err_vs_original"]
        assert set(r["ms"]) == {"sdpa, dense fp32", "sdpa, dense bf16"} | {
            f"attn {f} {layout}" for f in formats for layout in layouts} | {
            f"attn int8 {layout}, int8 q" for layout in layouts}
        assert r["ratio_to_sdpa"]["sdpa, dense fp32"] == 1.0
        for path, err in r["max_abs_err"].items():
            if path != "sdpa, dense bf16" and not path.endswith("int8 q"):
                assert err < 1e-5, (path, err)  # exact on the cache's own values
        # rounding q moves the result, by less than the int4 cache's own rounding does
        assert 1e-6 < r["max_abs_err"]["attn int8 paged, int8 q"] < lost["attn int4 paged"]
        # quantization shows against the original values, and int4 loses more than int8
        assert lost["attn fp32 paged"] < 1e-5 < lost["attn int8 paged"] < lost["attn int4 paged"]
        assert list(r["bytes_per_token"]) == list(formats)
    assert {"step.png", "bytes.png"} <= {p.name for p in tmp_path.iterdir()}
    md = (tmp_path / "results.md").read_text()
    assert "Nq=1, 5, H=4, Hkv=2, D=32" in md and "paged: pages of 16 interleaved" in md
    assert "| 2 | 5 | 97 | attn int8 paged, int8 q |" in md


def test_kv_accuracy_on_the_committed_checkpoint(tmp_path):
    """The issue's accuracy targets hold on a small evaluation of the committed toy GPT:
    int8 within +0.5% of fp32's validation loss, int4 within +3%, bf16 storage within 0.1%."""
    rc = main(["bench", "kv-accuracy", "--batches", "1", "--batch-size", "4",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["cache"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    base = rows.pop("fp32 (no cache)")["loss"]
    assert 0.5 < base < 3.13  # trained: below the text's unigram entropy (3.13 nats)
    assert abs(rows["bf16"]["loss"] / base - 1) < 1e-3
    assert rows["int8 (per token, head)"]["loss"] / base - 1 < 0.005
    assert rows["int4 (groups of 32)"]["loss"] / base - 1 < 0.03
    assert all(math.isfinite(r["loss"]) for r in rows.values())


def test_train_step_losses_agree_across_backends(tmp_path):
    """Every backend trains the same model from the same seed: the step's loss agrees."""
    rc = main(["bench", "train-step", "--lengths", "32", "--backends", "reference", "tiled",
               "--n-layer", "1", "--dim", "16", "--heads", "2", "--repeats", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["N"], r["backend"]) for r in rows] == [(32, "reference"), (32, "tiled")]
    assert all(r["peak_bytes"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)


def test_hf_prefill_logits_match_eager(tmp_path):
    pytest.importorskip("transformers")
    rc = main(["bench", "hf", "--context", "40", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--intermediate", "32", "--vocab", "64", "--repeats", "1",
               "--decode-steps", "1", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["attn", "sdpa", "eager"]
    for r in rows:
        assert r["status"] == "ok" and r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["logits_max_diff_vs_eager"] < 1e-4


# -- users' functions in a sweep (--fn) --------------------------------------------------------

USER_FN = '''
import torch

calls = []


def naive(q, k, v, is_causal=False):
    """torch style, (B, H, N, D); raises at N = 64 to stand for a function that fails."""
    calls.append((q.shape[2], is_causal))
    if q.shape[2] == 64:
        raise RuntimeError("naive: no kernel for N=64")
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v
'''


@pytest.mark.parametrize("kind", ["speed", "memory"])
def test_fn_is_measured_beside_the_backends_and_a_failure_stays_a_row(tmp_path, kind, capsys):
    src = tmp_path / "mine.py"
    src.write_text(USER_FN)
    spec = f"{src}:naive"
    rc = main(["bench", kind, "--fn", spec, "--backends", "sdpa", "--n", "32", "64", "--d",
               "16", "--heads", "2", "--causal", "true", "--mode", "fwd", "--repeats", "1",
               "--out", str(tmp_path / "out"), "--no-plots", "--no-progress"])
    assert rc == 0  # the user's function failing at one point does not fail the run
    assert f"--fn {spec}: called in the torch style" in capsys.readouterr().err
    header, rows, _ = report_mod.load_json(tmp_path / "out" / "results.json")
    by = {(r["backend"], r["N"]): r for r in rows}
    assert by[(spec, 64)]["status"] == "failed"
    assert "RuntimeError: naive: no kernel for N=64" in by[(spec, 64)]["note"]
    ok = by[(spec, 32)]
    assert ok["status"] == "ok"
    if kind == "speed":
        assert ok["ms"] > 0 and ok["ratio_to_sdpa"] == pytest.approx(by[("sdpa", 32)]["ms"]
                                                                     / ok["ms"])
    else:
        assert ok["peak_bytes"] > 0
    assert spec in header["config"]["functions"]
    assert by[("sdpa", 64)]["status"] == "ok"  # the sweep went on past the failure
    md = (tmp_path / "out" / "results.md").read_text()
    assert f"| 64 | {spec} | failed |" in md and f"{spec} failed at N=64" in md


def test_a_function_failing_without_a_message_stays_a_row():
    """An exception with no message (NotImplementedError()) is a row's note, not the end of
    the sweep."""
    def silent(q, k, v, causal=False):
        raise NotImplementedError()

    rows = list(run_sweep(_tiny(n=(32,), backends=("tiled", silent), modes=("fwd",))))
    by = {r.backend: r for r in rows}
    assert by["silent"].status == "skipped" and by["silent"].note == "NotImplementedError: "
    assert by["tiled"].status == "ok"


def test_sweep_config_takes_named_callables_and_calls_them_causal():
    seen = []

    def mine(q, k, v, causal=False):
        seen.append(causal)
        return attn.attention(q, k, v, causal=causal, backend="reference")

    cfg = _tiny(n=(32,), backends=("tiled", mine), causal=(False, True), modes=("fwd",))
    assert cfg.backends == ("tiled", "mine") and cfg.functions == {"mine": mine}
    rows = list(run_sweep(cfg))
    assert [r.status for r in rows] == ["ok"] * 4 and seen.count(True) >= 1
    assert {r.causal for r in rows if r.backend == "mine"} == {False, True}
    assert set(seen) == {False, True}
    for bad, match in (((lambda q, k, v: q),), "needs a name"), ((mine, mine), "twice"):
        with pytest.raises(ValueError, match=match):
            _tiny(backends=bad)
    mine.name = "tiled"  # an adapted function's .name wins over __name__, and must be free
    with pytest.raises(ValueError, match="already taken"):
        _tiny(backends=(mine,))


def test_a_function_that_cannot_express_a_call_is_skipped_there():
    def no_causal(q, k, v, causal=False):
        if causal:
            raise NotImplementedError("no_causal cannot express causal=True")
        return attn.attention(q, k, v, backend="reference")

    rows = list(run_sweep(_tiny(n=(32,), backends=(no_causal,), causal=(False, True),
                                modes=("fwd",))))
    assert [(r.causal, r.status) for r in rows] == [(False, "ok"), (True, "skipped")]
    assert "cannot express causal" in rows[1].note


# -- while it runs -----------------------------------------------------------------------------

def test_report_prints_checks_first_and_each_point_as_it_finishes(tmp_path, capsys,
                                                                    monkeypatch):
    """The check table is out before the sweep starts, and each point's line is out before
    the next point runs."""
    real = sweep_mod.run_sweep
    seen_at_start, lines_before = [], []

    def watched(cfg, rows=None):
        seen_at_start.append(capsys.readouterr())
        err = ""
        for row in real(cfg, rows):
            yield row
            err += capsys.readouterr().err  # what the consumer printed for that row
            lines_before.append(err)

    monkeypatch.setattr(sweep_mod, "run_sweep", watched)
    rc = main(["report", "--quick", "--n", "32", "--d", "16", "--heads", "2", "--backends",
               "tiled", "sdpa", "--mode", "fwd", "--out", str(tmp_path), "--no-plots",
               "--no-progress"])
    assert rc == 0
    at_start = seen_at_start[0].out
    assert "## Correctness against the float64 reference" in at_start
    assert at_start.count("| tiled | B=") == len(report_mod.CHECK_SHAPES)
    assert [f"[{i}/2]" in err for i, err in enumerate(lines_before, 1)] == [True, True]
    assert "[1/2] tiled fwd N=32 D=16 float32:" in lines_before[0]
    end = capsys.readouterr().out
    assert "correctness against the float64 reference (table above): " in end
    assert "| 32 | tiled |" in end


def test_header_warns_of_a_busy_machine_and_says_what_to_do(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(report_mod.os, "getloadavg", lambda: (9.1234, 1.0, 1.0))
    monkeypatch.setattr(report_mod.torch, "get_num_threads", lambda: 2)
    header = report_mod.make_header(_tiny(), ["bench", "memory"])
    assert header["loadavg_1min"] == 9.12
    text = report_mod.header_text(header)
    assert "load 9.12)" in text and "**warning**: the load average is 9.1" in text
    assert "above the 2 cores" in text and "--threads" in text
    # a memory sweep measures no matmul: no empty "square matmul" line
    assert "square matmul" not in text
    assert "square matmul TFLOP/s in this run: float32 0.500" in report_mod.header_text(
        {**header, "matmul_tflops": {"float32": 0.5}})
    main(["bench", "memory", "--n", "32", "--backends", "tiled", "--mode", "fwd", "--heads",
          "2", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    assert "attn: warning: the load average is 9.1" in capsys.readouterr().err

    monkeypatch.setattr(report_mod.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    quiet = report_mod.header_text(report_mod.make_header(_tiny(), ["bench", "memory"]))
    assert "warning" not in quiet and "load 1.50)" in quiet


def _png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR chunk's width


def test_memory_fwd_draws_one_panel_and_no_warning(tmp_path):
    pytest.importorskip("matplotlib")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc = main(["bench", "memory", "--mode", "fwd", "--n", "32", "64", "--d", "16",
                   "--heads", "2", "--backends", "tiled", "sdpa", "--out", str(tmp_path / "f"),
                   "--no-progress"])
        assert rc == 0
        main(["bench", "memory", "--n", "32", "--d", "16", "--heads", "2", "--backends",
              "tiled", "--out", str(tmp_path / "both"), "--no-progress"])
    one, two = (_png_width(tmp_path / d / "memory-float32-d16.png") for d in ("f", "both"))
    assert one < 0.6 * two  # one panel where forward+backward was not measured


# -- the command line itself -------------------------------------------------------------------

def test_quick_parser_lists_every_command_of_the_full_one():
    from attn.bench import cli

    def commands(parser):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {name: sub._choices_actions[i].help for i, name in enumerate(sub.choices)}

    assert commands(cli._top_level()[0]) == commands(cli.build_parser())


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_busy_core_spins_one_pinned_process_for_the_run_and_stops_it(monkeypatch, tmp_path):
    """--busy-core: a process spinning on one core, pinned to it, burning CPU while the
    benchmark runs and gone after; without the flag none is started. The results say which."""
    from attn.bench import paired
    started = []
    popen = subprocess.Popen

    def watched(*a, **kw):
        started.append(popen(*a, **kw))
        return started[-1]
    monkeypatch.setattr(paired.subprocess, "Popen", watched)
    with paired.busy_core(False) as core:
        assert core is None and not started
    with paired.busy_core(True) as core:
        (proc,) = started
        assert proc.poll() is None  # running
        if hasattr(os, "sched_getaffinity"):
            assert os.sched_getaffinity(proc.pid) == {core}
        if Path(f"/proc/{proc.pid}/stat").exists():
            t0 = _cpu_ticks(proc.pid)
            time.sleep(0.3)
            assert _cpu_ticks(proc.pid) > t0  # spinning, not sleeping
    assert proc.returncode is not None  # killed and reaped
    rc = main(["bench", "speed", "--paired", "--busy-core", "--n", "48", "--d", "16",
               "--heads", "2", "--mode", "fwd", "--causal", "true", "--no-fused",
               "--flex-max-n", "0", "--repeats", "2", "--out", str(tmp_path)])
    assert rc == 0 and len(started) == 2 and started[1].returncode is not None
    header = json.loads((tmp_path / "results.json").read_text())["header"]
    assert "kept busy by a spinning process" in header["busy"]


# -- the conclusion ----------------------------------------------------------------------------

def _row(backend, N, mode, ms, peak, *, ms_min=None, causal=False, frac=None):
    """A finished sweep row as results.json holds it, with hand-picked numbers."""
    return {"backend": backend, "device": "cpu", "dtype": "float32", "B": 1, "H": 8, "N": N,
            "D": 64, "causal": causal, "mode": mode, "status": "ok", "note": "", "ms": ms,
            "ms_min": ms if ms_min is None else ms_min, "repeats": 5,
            "flops": attention_flops(1, 8, N, N, 64, causal=causal, mode=mode),
            "tflops": None, "matmul_fraction": frac, "peak_bytes": peak,
            "predicted_bytes": 0, "ratio_to_sdpa": None}


def test_conclusion_compares_each_backend_with_sdpa_at_the_largest_n():
    """Hand-made rows (not measured) whose ratios are known: the conclusion takes the largest
    N both ran, states speed and memory against SDPA, the checks' verdict and what it means;
    a busy machine and noisy points are named."""
    MiB = 2**20
    rows = [_row("tiled", 1024, "fwd+bwd", 100.0, 30 * MiB), _row("sdpa", 1024, "fwd+bwd",
                                                                  80.0, 12 * MiB),
            _row("tiled", 4096, "fwd+bwd", 200.0, 24 * MiB), _row("sdpa", 4096, "fwd+bwd",
                                                                  400.0, 96 * MiB),
            _row("tiled", 4096, "fwd", 90.0, 8 * MiB), _row("sdpa", 4096, "fwd", 60.0,
                                                            4 * MiB),
            {**_row("tiled", 8192, "fwd", None, None), "status": "skipped"}]
    checks = [{"backend": "tiled", "status": "ok"}] * 3
    quiet = {"loadavg_1min": 0.5, "torch_threads": 2}
    lines = report_mod.conclusion(quiet, rows, checks)
    assert len(lines) == 2, lines
    bwd = next(ln for ln in lines if "fwd+bwd" in ln)
    assert bwd.startswith("- **tiled** fwd+bwd, N=4096 float32 D=64: 2.00× SDPA's speed")
    assert "0.25× SDPA's peak memory (24.0 vs 96.0 MiB)" in bwd
    assert "correct (3 of 3 checks" in bwd and "Better than SDPA on this machine" in bwd
    fwd = next(ln for ln in lines if " fwd," in ln)
    assert "0.67× SDPA's speed" in fwd and "2.00× SDPA's peak memory" in fwd
    assert "SDPA is the better choice here; tiled is for what SDPA lacks" in fwd

    failed = report_mod.conclusion(quiet, rows, [*checks[:2], {"backend": "tiled",
                                                               "status": "failed"}])
    assert all("WRONG: 1 of 3 checks" in ln for ln in failed)

    noisy = rows + [_row("sdpa", 256, "fwd", 7.5, 2 * MiB), _row("sdpa", 512, "fwd", 72.0,
                                                                 4 * MiB, ms_min=20.0),
                    _row("sdpa", 128, "fwd", 1.0, MiB, frac=1.14)]
    last = report_mod.conclusion({"loadavg_1min": 3.2, "torch_threads": 2}, noisy, checks)[-1]
    assert last.startswith("- **times not to trust as they are**: the machine was loaded "
                           "(load 3.20 over 2 threads)")
    assert "sdpa fwd N=512 float32: median 72 ms is 3.6× its fastest run" in last
    assert "sdpa fwd N=512 float32: 72 ms, 9.6× N=256's 7.5 ms for 4.0× the FLOPs" in last
    assert "sdpa fwd N=128 float32: 114 % of the matmul rate" in last
    assert not any("trust" in ln for ln in lines)


def test_report_log_has_no_progress_bar_when_not_a_terminal(tmp_path, capsys):
    """Redirected (pytest's capture is not a terminal), the report prints one line per point
    and no tqdm bar, even without --no-progress; it ends with its conclusion."""
    rc = main(["report", "--quick", "--n", "32", "--d", "16", "--heads", "2", "--backends",
               "tiled", "sdpa", "--mode", "fwd", "--out", str(tmp_path), "--no-plots",
               "--no-checks"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "\r" not in captured.err and "pt/s" not in captured.err, captured.err
    assert "[1/2] tiled fwd N=32" in captured.err and "[2/2] sdpa fwd N=32" in captured.err
    tail = captured.out[captured.out.index("## Conclusion"):]
    assert "- **tiled** fwd, N=32 float32 D=16:" in tail and "not checked in this run" in tail
    assert "## Conclusion" in (tmp_path / "results.md").read_text()


def test_auto_table_measures_and_merges_the_cpu_kinds_entry(tmp_path):
    """attn bench auto-table writes its results and merges this CPU kind's entry into the
    table, keeping per cell the run where fused did worse (the busier one)."""
    import attn.bench.auto_table as at
    from attn import choose

    table = tmp_path / "table.json"
    rc = main(["bench", "auto-table", "--classes", "small", "--dtype", "float32", "--rounds",
               "1", "--out", str(tmp_path / "run"), "--write", str(table)])
    assert rc == 0
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    (row,) = doc["rows"]
    assert row["class"] == "small" and set(row["ms"]) == {"sdpa", "fused", "tiled"}
    cell = json.loads(table.read_text())[choose.cpu_kind()]["entries"]["float32"]["small"]
    assert cell["backend"] == ("fused" if cell["ratio"] <= 1.05 else "tiled")
    # a later run where fused did better leaves the cell as it was
    better = dict(row, fused_over_tiled=cell["ratio"] / 10)
    at._merge_into(table, choose.cpu_kind(), "cpu", [better], 1.05, False)
    assert json.loads(table.read_text())[choose.cpu_kind()]["entries"]["float32"]["small"] \
        == cell
