"""``attn gpu-check`` rehearsed without a GPU: the default run's files and fields (the smoke,
the variants against flex), the full pytest stage on its own, a stage that raises or overruns
its box, ``--merge``, and the pytest plugin that logs each test."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from attn.bench import gpu_check, gpu_pytest, gpu_record
from attn.bench.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _dry(out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "attn", "gpu-check", "--dry-run", "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The default run (no --stages), rehearsed."""
    out = tmp_path_factory.mktemp("gpu-dry")
    return out, _dry(out, "--budget-min", "3")


@pytest.fixture(scope="module")
def correctness_run(tmp_path_factory):
    """The full CUDA pytest stage, which the default run leaves out, on its own."""
    out = tmp_path_factory.mktemp("gpu-dry-tests")
    return out, _dry(out, "--stages", "correctness", "--budget-min", "2")


def _kind(doc: dict, k: str) -> list[dict]:
    return [r for r in doc["rows"] if r["kind"] == k]


def test_dry_run_writes_the_flat_files_every_stage_reports(dry_run):
    out, doc = dry_run
    files = list(out.iterdir())
    assert all(f.is_file() for f in files)  # flat: nothing to bring back from subfolders
    names = {f.name for f in files}
    assert len(names) <= 8 and names <= set(gpu_record.FILES)
    assert {"results.json", "results.md", "log.txt"} <= names
    assert all(f.stat().st_size < 16 * 2**20 for f in files)
    assert 1 <= len([n for n in names if n.endswith(".png")]) <= 3
    h = doc["header"]
    assert h["dry_run"] is True and h["command"].startswith("attn gpu-check --dry-run")
    for key in ("device_name", "torch", "triton", "python", "date"):
        assert h[key], key
    assert h["budget_min"] == 3 and h["stages"] == gpu_check.DEFAULT_STAGES
    assert set(doc["stages"]) == set(gpu_check.STAGES)
    for name in gpu_check.DEFAULT_STAGES:
        assert doc["stages"][name]["status"] == "done", (name, doc["stages"][name])
    assert doc["stages"]["correctness"]["status"] == "skipped"
    assert "not in the default run" in doc["stages"]["correctness"]["why"]
    for row in doc["rows"]:  # every row names its run
        assert all(row.get(k) == h[k] for k in gpu_record.ROW_ORIGIN), row
    log = (out / "log.txt").read_text()
    for name in gpu_check.DEFAULT_STAGES:
        assert f"[{name}] " in log, name
    assert "[correctness] " not in log and not (out / "pytest.txt").exists()


def test_the_default_run_is_every_stage_but_the_full_pytest_in_8_minutes():
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    args = p.parse_args([])
    assert args.stages == gpu_check.DEFAULT_STAGES and args.budget_min == 8.0
    assert "correctness" in gpu_check.STAGES and "correctness" not in args.stages
    # DESIGN's order: env, the smoke and the fused verification, speed, decode, tuning
    assert args.stages == ["env", "smoke", "fused-cuda", "speed", "varlen-decode", "tune",
                           "context-parallel"]
    shares = {s: gpu_check.WEIGHTS[s] / sum(gpu_check.WEIGHTS[x] for x in args.stages) * 8
              for s in args.stages}  # minutes of the 8 when each stage uses its whole box
    assert max(shares, key=shares.get) == "speed"
    assert 0.8 <= shares["smoke"] <= 1.2 and 1.0 <= shares["fused-cuda"] <= 1.4
    assert shares["tune"] * 60 < gpu_check.TUNE_MIN_S  # tune runs on time the others left


def test_dry_run_rows_record_what_ran_and_why_the_rest_did_not(dry_run):
    _, doc = dry_run
    speed = _kind(doc, "speed")
    assert {r["backend"] for r in speed if r["status"] == "ok"} >= {"tiled", "sdpa"}
    assert all("CUDA only" in r["note"] for r in speed if r["backend"] == "sdpa-cudnn")
    decode = _kind(doc, "decode")
    assert all(r["status"] == "skipped" and r["note"] for r in decode
               if "triton" in r["path"])
    assert any(r["status"] == "ok" and r["path"] == "sdpa" for r in decode)
    assert _kind(doc, "tune") and all(r["status"] == "skipped" for r in _kind(doc, "tune"))
    assert {r["strategy"] for r in _kind(doc, "cp") if r["status"] == "ok"} == {"ring",
                                                                              "ulysses"}
    dropped = doc["stages"]["speed"]["dropped"]
    assert any("triton" in d for d in dropped)


def test_dry_run_smoke_checks_triton_against_the_reference(dry_run):
    _, doc = dry_run
    smoke = _kind(doc, "smoke")
    from attn.bench import gpu_smoke

    assert [r["variant"] for r in smoke] == list(gpu_smoke.DRY_VARIANTS)
    for r in smoke:
        assert r["status"] == "ok" and r["repeatable"] is True, r
        assert r["backend"] == "triton" and 0 < r["worst"] <= 1, r
        assert (r["dtype"], r["D"], r["N"]) == ("float32", 16, 17)
    assert doc["stages"]["smoke"]["seconds"] < 40  # a few seconds of interpreter per case
    assert any("variants" in d for d in doc["stages"]["smoke"]["dropped"])


def test_dry_run_times_variants_and_says_why_flex_did_not_run(dry_run):
    _, doc = dry_run
    variants = {r["variant"]: r for r in _kind(doc, "variant")}
    from attn.bench.gpu_stages import FLEX_COMPARED, VARIANT_COSTS

    assert list(variants) == list(VARIANT_COSTS)
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["ratio"] > 0
               for r in variants.values())
    for name in FLEX_COMPARED:
        r = variants[name]
        assert r["flex_status"] == "skipped" and r.get("flex_ms") is None, r
        assert ("no sinks argument" if name == "sinks" else "GPU only") in r["flex_note"]
    assert all("flex_status" not in r for n, r in variants.items() if n not in FLEX_COMPARED)


def test_results_md_puts_ratios_first_and_they_follow_from_the_rows(dry_run):
    out, doc = dry_run
    md = (out / "results.md").read_text()
    assert md.index("## Ratios") < md.index("## Smoke") < md.index("## Speed and memory")
    ms = {}
    for r in doc["rows"]:
        if r["kind"] == "speed" and r["status"] == "ok":
            ms.setdefault((r["D"], r["causal"], r["mode"], r["N"]), {})[r["backend"]] = r["ms"]
    D, causal, mode, N = key = sorted(ms)[0]
    torch_best = min(t for b, t in ms[key].items() if b != "tiled")
    want = f"| bfloat16 | {D} | {causal} | {mode} | {N} | {torch_best / ms[key]['tiled']:.2f} |"
    assert want in md
    assert "4 of 4 cases within the float64 reference's budget" in md
    assert "| sinks | 1/1 |" in md
    softcap = next(r for r in doc["rows"] if r.get("variant") == "softcap"
                   and r["kind"] == "variant")
    assert f"| softcap | {softcap['ratio']:.2f} | " in md and "no sinks argument" in md


def test_the_correctness_stage_runs_on_its_own(correctness_run):
    out, doc = correctness_run
    assert doc["stages"]["correctness"]["status"] == "done", doc["stages"]["correctness"]
    assert all(e["status"] == "skipped" for n, e in doc["stages"].items()
               if n != "correctness")
    assert [r["outcome"] for r in _kind(doc, "pytest")] == ["passed"]
    assert [(r["file"], r["count"]) for r in _kind(doc, "pytest-collected")] == [
        ("tests/test_triton.py", 1)]
    det = [r for r in _kind(doc, "check") if r["check"] == "determinism"]
    assert len(det) == 2 and all(r["status"] == "ok" for r in det)
    scanned = {r["what"].split()[0] for r in _kind(doc, "check") if r["check"] == "nan scan"}
    assert scanned == {"plain", "causal", "softcap", "sinks", "window", "gqa", "alibi",
                       "dropout", "float_mask", "bool_mask", "temperature"}
    assert "PASSED tests/test_triton.py::test_forward_deterministic" in (
        out / "log.txt").read_text()
    assert "1 passed" in (out / "pytest.txt").read_text()
    md = (out / "results.md").read_text()
    assert md.index("## pytest") < md.index("## Checks")


# -- the smoke's failures are rows, and flex's variants are attn's --------------------------

def test_a_wrong_or_crashing_smoke_case_is_a_failed_row_not_an_error(tmp_path, monkeypatch):
    """Triton stood in by tiled (no interpreter here), then broken: sinks' output off by
    0.1%, dropout raising, varlen's last bit changing from call to call."""
    import time

    import attn
    from attn.bench import gpu_smoke

    real, real_varlen, calls = attn.attention, attn.varlen_attention, []

    def attention(q, k, v, backend=None, **kw):
        if kw.get("dropout_p"):
            raise RuntimeError("broken on purpose")
        out, lse = real(q, k, v, backend="tiled", **kw)
        return (out * 1.001 if kw.get("sinks") is not None else out), lse

    def varlen_attention(*args, backend=None, **kw):
        calls.append(1)
        out, lse = real_varlen(*args, backend="tiled", **kw)
        return out + len(calls) * 1e-7, lse  # within budget, never the same bits twice

    monkeypatch.setattr(attn, "attention", attention)
    monkeypatch.setattr(attn, "varlen_attention", varlen_attention)
    ctx = gpu_record.StageContext(name="smoke", out=str(tmp_path), scratch=str(tmp_path / "s"),
                                  deadline=time.time() + 120, dry_run=True, cores=1, tests="")
    gpu_smoke.smoke(ctx)  # raises nothing
    rows = {r["variant"]: r for r in gpu_record.read_scratch(ctx.scratch)["rows"]}
    assert list(rows) == list(gpu_smoke.DRY_VARIANTS)
    assert rows["causal"]["status"] == "ok" and rows["causal"]["repeatable"] is True
    assert rows["sinks"]["status"] == "failed" and rows["sinks"]["worst"] > 1
    assert "over budget: out" in rows["sinks"]["note"] and rows["sinks"]["repeatable"]
    assert rows["dropout"]["status"] == "failed"
    assert rows["dropout"]["note"] == "RuntimeError: broken on purpose"
    assert rows["varlen"]["status"] == "failed" and rows["varlen"]["worst"] <= 1
    assert "not bitwise repeatable: out" in rows["varlen"]["note"]
    bad = gpu_check.failures({"stages": {}, "rows": list(rows.values())})
    assert len(bad) == 3 and bad[0].startswith("smoke sinks float32 D=16 N=17: over budget")


@pytest.mark.parametrize("variant", ["softcap", "window", "alibi", "causal"])
def test_flex_variant_computes_attns_variant(variant):
    """The score_mod and block mask timed against ours compute attn's variant (flex run
    eagerly here), and the variant changes the output, so a dropped part would show."""
    import warnings

    import torch

    import attn
    from attn.bench.competitors import flex_variant
    from attn.bench.gpu_stages import _variant_kwargs
    from attn.testing import make_inputs

    H, N = 4, 64
    q, k, v = make_inputs(B=1, H=H, N=N, D=16, dtype=torch.float64, logit_scale=8.0)
    kw = _variant_kwargs(variant, H, N, "cpu")
    kw.update({"softcap": 2.0} if variant == "softcap" else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's "eager mode is for debugging"
        got = flex_variant(kw, N, "cpu", compile=False)(q, k, v)
    want = attn.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    plain = attn.attention(q, k, v, backend="reference",
                           causal=variant != "causal")  # without what the variant adds
    assert (plain - want).abs().max() > 1e-3


def test_flex_variant_names_what_flex_cannot_express():
    import torch

    from attn.bench.competitors import flex_variant

    assert "no sinks argument" in flex_variant({"causal": True, "sinks": torch.zeros(4)}, 64,
                                               "cpu")
    assert "no dropout" in flex_variant({"dropout_p": 0.1}, 64, "cpu")
    assert "temperature" in flex_variant({"temperature": 0.5}, 64, "cpu")


# -- a stage that fails, one that overruns, and the next still runs ------------------------------

_HELPERS = '''
import time

def boom(ctx):
    ctx.row(kind="check", check="boom", what="before the error", status="ok", note="")
    raise RuntimeError("on purpose")

def slow(ctx):
    ctx.row(kind="check", check="slow", what="finished before the box", status="ok", note="")
    ctx.running("the endless point")
    time.sleep(120)

def after(ctx):
    ctx.row(kind="check", check="after", what="ran", status="ok", note="")
'''


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-fail")
    (tmp / "gpu_check_helpers.py").write_text(_HELPERS)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(tmp))  # stage processes fork with this process's sys.path
    # boxes of about 24, 19 and 38 s (the fork server starts before the first box opens): a
    # stage process took up to 9 s to import attn and start on a 2-core machine running 3 busy
    # loops, and the slow stage's 120 s sleep overruns its box by far
    mp.setattr(gpu_check, "WEIGHTS", {"boom": 1.0, "slow": 0.5, "after": 1.0})
    mp.setattr(gpu_check, "GRACE_S", 0.5)
    stages = {n: f"gpu_check_helpers:{n}" for n in ("boom", "slow", "after")}
    args = argparse.Namespace(out=tmp / "run", budget_min=1.0, stages=list(stages),
                              dry_run=True, tests=ROOT / "tests")
    try:
        doc = gpu_check.run_stages(args, ["gpu-check", "--out", "run"], stages)
    finally:
        mp.undo()
    return tmp / "run", doc


def test_a_stage_that_raises_is_failed_and_the_next_still_runs(failing_run):
    out, doc = failing_run
    on_disk = json.loads((out / "results.json").read_text())
    for d in (doc, on_disk):
        assert d["stages"]["boom"]["status"] == "failed"
        assert "RuntimeError: on purpose" in d["stages"]["boom"]["why"]
        assert d["stages"]["after"]["status"] == "done"
        assert {r["check"] for r in d["rows"]} == {"boom", "slow", "after"}
    assert "RuntimeError: on purpose" in (out / "log.txt").read_text()
    assert gpu_check.failures(doc) and any("boom" in f for f in gpu_check.failures(doc))


def test_a_stage_past_its_box_is_cut_and_keeps_its_finished_points(failing_run):
    _, doc = failing_run
    slow = doc["stages"]["slow"]
    assert slow["status"] == "out of time"
    assert "the endless point" in slow["why"]
    assert slow["seconds"] < slow["budget_s"] + 10  # cut at its box, not after the sleep
    assert [r["what"] for r in doc["rows"] if r["check"] == "slow"] == ["finished before the box"]


# -- merge ---------------------------------------------------------------------------------------

def test_merge_joins_runs_rows_logs_and_stages(dry_run, correctness_run, failing_run,
                                              tmp_path):
    runs = (dry_run, correctness_run, failing_run)
    out = tmp_path / "merged"
    assert main(["gpu-check", "--merge", *(str(r[0]) for r in runs), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == sum(len(d["rows"]) for _, d in runs)
    assert {r["command"] for r in doc["rows"]} == {d["header"]["command"] for _, d in runs}
    assert set(doc["stages"]) == set().union(*(d["stages"] for _, d in runs))
    assert doc["stages"]["boom"]["status"] == "failed"
    # the default run and the correctness run joined: every stage done
    assert all(doc["stages"][s]["status"] == "done" for s in gpu_check.STAGES)
    assert doc["stages"]["correctness"]["run"] == 1
    log = (out / "log.txt").read_text()
    assert "[env] " in log and "RuntimeError: on purpose" in log and "[correctness] " in log
    assert (out / "speed.png").is_file() and (out / "results.md").is_file()
    assert (out / "pytest.txt").is_file()


def test_merge_keeps_the_run_that_got_furthest_with_each_stage():
    def doc(command, **stages):
        return {"schema": 1, "header": {"command": command}, "rows": [],
                "stages": {n: gpu_record.stage_entry(s) for n, s in stages.items()}}

    merged = gpu_record.merge([doc("a", speed="out of time", tune="done", env="done"),
                               doc("b", speed="done", tune="skipped", env="done")], "m")
    got = {n: (e["status"], e["run"]) for n, e in merged["stages"].items()}
    assert got == {"speed": ("done", 1), "tune": ("done", 0), "env": ("done", 1)}


def test_bad_arguments_say_which(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--stages: unknown"):
        main(["gpu-check", "--dry-run", "--out", str(tmp_path), "--stages", "env", "nope"])
    with pytest.raises(SystemExit, match="--out is required"):
        main(["gpu-check", "--dry-run"])
    assert main(["gpu-check", "--merge", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "has no results.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="status must be one of"):
        gpu_record.stage_entry("fine")


# -- the pytest plugin ---------------------------------------------------------------------------

def _report(nodeid, when, outcome, text=""):
    return SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=0.25,
                           passed=outcome == "passed", failed=outcome == "failed",
                           skipped=outcome == "skipped", longrepr=None, longreprtext=text)


def test_plugin_writes_each_outcome_once_and_only_on_the_controller(tmp_path, monkeypatch):
    log, rows = tmp_path / "log.txt", tmp_path / "rows.jsonl"
    monkeypatch.setenv("ATTN_GPU_CHECK_LOG", str(log))
    monkeypatch.setenv("ATTN_GPU_CHECK_ROWS", str(rows))
    monkeypatch.setattr(gpu_pytest, "_seen", set())
    monkeypatch.setattr(gpu_pytest, "_is_worker", False)
    fail = _report("tests/test_x.py::test_b", "call", "failed", "def test_b():\nE   assert 1 == 2")
    for rep in (_report("tests/test_x.py::test_a", "setup", "passed"),
                _report("tests/test_x.py::test_a", "call", "passed"), fail, fail,  # xdist twice
                _report("tests/test_y.py::test_c", "setup", "failed", "E   fixture broke")):
        gpu_pytest.pytest_runtest_logreport(rep)
    got = [json.loads(line)["row"] for line in rows.read_text().splitlines()]
    assert [(r["nodeid"], r["outcome"]) for r in got] == [
        ("tests/test_x.py::test_a", "passed"), ("tests/test_x.py::test_b", "failed"),
        ("tests/test_y.py::test_c", "error")]
    assert got[1]["message"] == "assert 1 == 2" and got[1]["file"] == "tests/test_x.py"
    assert "FAILED tests/test_x.py::test_b (0.2 s): assert 1 == 2" in log.read_text()
    monkeypatch.setattr(gpu_pytest, "_is_worker", True)  # a worker leaves it to the controller
    gpu_pytest.pytest_runtest_logreport(_report("tests/test_z.py::test_d", "call", "passed"))
    assert len(rows.read_text().splitlines()) == 3


def test_plugin_runs_the_full_size_files_first_when_active(monkeypatch):
    ids = ["tests/test_variants.py::test_a", "tests/test_triton_cuda.py::test_b",
           "tests/test_other.py::test_c", "tests/test_triton.py::test_d",
           "tests/test_variants.py::test_e"]
    items = [SimpleNamespace(nodeid=n) for n in ids]
    monkeypatch.delenv("ATTN_GPU_CHECK_LOG", raising=False)
    monkeypatch.delenv("ATTN_GPU_CHECK_ROWS", raising=False)
    gpu_pytest.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ids  # outside gpu-check it changes nothing
    monkeypatch.setenv("ATTN_GPU_CHECK_LOG", "log.txt")
    gpu_pytest.pytest_collection_modifyitems(items)
    assert [i.nodeid.split("::")[1] for i in items] == ["test_b", "test_d", "test_a", "test_c",
                                                       "test_e"]


def test_help_readme_and_docs_agree_on_the_run():
    """`attn --help`, the module, README and docs/gpu.md say the same: one run of at most 8
    minutes, the default --budget-min."""
    from attn.bench.cli import COMMANDS

    root = Path(__file__).resolve().parent.parent
    assert "in one run of at most 8 minutes" in COMMANDS["gpu-check"]
    assert "in one run of at most\n8 minutes" in gpu_check.__doc__
    assert "in one run of at most 8 minutes" in (root / "README.md").read_text()
    gpu_md = (root / "docs" / "gpu.md").read_text()
    assert "one run of at most 8 minutes" in gpu_md and "7 minutes" not in gpu_md
    for stage in gpu_check.STAGES:
        assert f"| `{stage}` |" in gpu_md, stage
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    assert p.parse_args([]).budget_min == 8.0
