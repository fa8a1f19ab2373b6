"""``attn gpu-check`` rehearsed without a GPU: the dry run's files and fields, a stage that
raises or overruns its box, ``--merge``, and the pytest plugin that logs each test."""

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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    proc = subprocess.run([sys.executable, "-m", "attn", "gpu-check", "--dry-run", "--out",
                           str(out), "--budget-min", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_dry_run_writes_the_flat_files_every_stage_reports(dry_run):
    out, doc = dry_run
    files = list(out.iterdir())
    assert all(f.is_file() for f in files)  # flat: nothing to bring back from subfolders
    names = {f.name for f in files}
    assert len(names) <= 8 and names <= set(gpu_record.FILES)
    assert {"results.json", "results.md", "pytest.txt", "log.txt"} <= names
    assert all(f.stat().st_size < 16 * 2**20 for f in files)
    assert 1 <= len([n for n in names if n.endswith(".png")]) <= 3
    h = doc["header"]
    assert h["dry_run"] is True and h["command"].startswith("attn gpu-check --dry-run")
    for key in ("device_name", "torch", "triton", "python", "date"):
        assert h[key], key
    assert set(doc["stages"]) == set(gpu_check.STAGES)
    for name, entry in doc["stages"].items():
        assert entry["status"] == "done", (name, entry)
    for row in doc["rows"]:  # every row names its run
        assert all(row.get(k) == h[k] for k in gpu_record.ROW_ORIGIN), row
    log = (out / "log.txt").read_text()
    for name in gpu_check.STAGES:
        assert f"[{name}] " in log, name
    assert "PASSED tests/test_triton.py::test_forward_deterministic" in log
    assert "1 passed" in (out / "pytest.txt").read_text()


def test_dry_run_rows_record_what_ran_and_why_the_rest_did_not(dry_run):
    _, doc = dry_run
    rows = doc["rows"]

    def kind(k):
        return [r for r in rows if r["kind"] == k]

    assert [r["outcome"] for r in kind("pytest")] == ["passed"]
    assert [(r["file"], r["count"]) for r in kind("pytest-collected")] == [
        ("tests/test_triton.py", 1)]
    det = [r for r in kind("check") if r["check"] == "determinism"]
    assert len(det) == 2 and all(r["status"] == "ok" for r in det)
    scanned = {r["what"].split()[0] for r in kind("check") if r["check"] == "nan scan"}
    assert scanned == {"plain", "causal", "softcap", "sinks", "window", "gqa", "alibi",
                       "dropout", "float_mask", "bool_mask", "temperature"}
    speed = kind("speed")
    assert {r["backend"] for r in speed if r["status"] == "ok"} >= {"tiled", "sdpa"}
    assert all("CUDA only" in r["note"] for r in speed if r["backend"] == "sdpa-cudnn")
    decode = kind("decode")
    assert all(r["status"] == "skipped" and r["note"] for r in decode
               if "triton" in r["path"])
    assert any(r["status"] == "ok" and r["path"] == "sdpa" for r in decode)
    assert kind("tune") and all(r["status"] == "skipped" for r in kind("tune"))
    assert {r["strategy"] for r in kind("cp") if r["status"] == "ok"} == {"ring", "ulysses"}
    dropped = doc["stages"]["speed"]["dropped"]
    assert any("triton" in d for d in dropped)


def test_results_md_puts_ratios_first_and_they_follow_from_the_rows(dry_run):
    out, doc = dry_run
    md = (out / "results.md").read_text()
    assert md.index("## Ratios") < md.index("## pytest") < md.index("## Speed and memory")
    ms = {}
    for r in doc["rows"]:
        if r["kind"] == "speed" and r["status"] == "ok":
            ms.setdefault((r["D"], r["causal"], r["mode"], r["N"]), {})[r["backend"]] = r["ms"]
    D, causal, mode, N = key = sorted(ms)[0]
    torch_best = min(t for b, t in ms[key].items() if b != "tiled")
    want = f"| bfloat16 | {D} | {causal} | {mode} | {N} | {torch_best / ms[key]['tiled']:.2f} |"
    assert want in md


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

def test_merge_joins_runs_rows_logs_and_stages(dry_run, failing_run, tmp_path):
    (a, doc_a), (b, doc_b) = dry_run, failing_run
    out = tmp_path / "merged"
    assert main(["gpu-check", "--merge", str(a), str(b), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["rows"]) == len(doc_a["rows"]) + len(doc_b["rows"])
    assert {r["command"] for r in doc["rows"]} == {doc_a["header"]["command"],
                                                   doc_b["header"]["command"]}
    assert set(doc["stages"]) == set(doc_a["stages"]) | set(doc_b["stages"])
    assert doc["stages"]["boom"]["status"] == "failed"
    log = (out / "log.txt").read_text()
    assert "[env] " in log and "RuntimeError: on purpose" in log
    assert (out / "speed.png").is_file() and (out / "results.md").is_file()


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


def test_help_readme_and_docs_agree_on_the_runs():
    """`attn --help`, the module, README and docs/gpu.md say the same: two runs of 7 minutes,
    the default --budget-min."""
    from attn.bench.cli import COMMANDS

    root = Path(__file__).resolve().parent.parent
    assert "at most two runs of 7 minutes" in COMMANDS["gpu-check"]
    assert "at most two runs\nof 7 minutes" in gpu_check.__doc__
    assert "in two runs of 7 minutes" in (root / "README.md").read_text()
    assert "two runs of at most 7 minutes each" in (root / "docs" / "gpu.md").read_text()
    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    assert p.parse_args([]).budget_min == 7.0
