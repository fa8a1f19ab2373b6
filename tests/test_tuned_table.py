"""The triton autotuner's measured table (issue 39): ``attn gpu-check``'s tune stage records
the best config per launch key, ``attn gpu-check --adopt DIR`` merges those rows into
attn/flash_triton/tuned.json, and a launch whose key is in the table runs that config
without timing any, as long as pruning still keeps it. No GPU needed: the pruning hook is
called as triton's autotuner calls it, with the compute capability given."""

import json

import pytest
import torch

pytest.importorskip("triton")

from attn.bench import gpu_check  # noqa: E402
from attn.flash_triton import tune  # noqa: E402


def _args(dtype=torch.bfloat16, n=4096, d=128, banded=False):
    return {"Q": torch.empty(1, dtype=dtype), "TUNE_N": n, "BLOCK_D": d, "BLOCK_DV": d,
            "MASK_KIND": 0, "BANDED": banded, "VARLEN": False}


@pytest.fixture(autouse=True, scope="module")
def committed_table_untouched():
    """No test here writes the committed table (an early version of adopt did)."""
    before = tune.TUNED.read_bytes()
    yield
    assert tune.TUNED.read_bytes() == before


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table file of this test's own, autotuning on, the table switch unset."""
    path = tmp_path / "tuned.json"
    monkeypatch.setattr(tune, "TUNED", path)
    monkeypatch.setenv("ATTN_TRITON_AUTOTUNE", "1")
    monkeypatch.delenv("ATTN_TRITON_TUNED", raising=False)
    return path


def _read(path):
    if not path.exists():
        return {}
    return {r["key"]: r for r in json.loads(path.read_text())["rows"]}


def _results(folder, rows, device="NVIDIA H200"):
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(
        {"header": {"device_name": device, "date": "2026-11-28"}, "rows": rows}))
    return folder


def _best_row(kind, key, config, ms=1.0, note="best of the sweep"):
    return {"kind": "tune", "kernel": kind, "key": key, "note": note, "ms": ms,
            "pick_ms": 1.2, "status": "ok", "fields": tune.config_fields(config)}


def test_a_tabled_config_runs_without_timing_where_pruning_keeps_it(table, tmp_path):
    configs = tune.gpu_configs("fwd")
    kept = tune.prune_for(configs, _args(), kind="fwd", arch=90)
    assert len(kept) > 1  # without the table: every kept config is timed
    assert tune._prune(configs, _args(), kind="fwd", arch=90) == kept
    choice = kept[-1]
    key = tune.LAST_KEYS["fwd"]  # the key this launch looked up
    assert key == tune.tuned_key("fwd", _args(), 90)
    run = _results(tmp_path / "run", [_best_row("fwd", key, choice),
                                      _best_row("fwd", "other", choice, note="a config")])
    assert gpu_check.run(gpu_check_args(["--adopt", str(run)]), []) == 0
    rows = _read(table)
    assert list(rows) == [key] and rows[key]["device"] == "NVIDIA H200"
    assert tune._prune(configs, _args(), kind="fwd", arch=90) == [choice]
    # another key (causal, another dtype, another arch) still autotunes over what it keeps
    for args, arch in ((_args(banded=True), 90), (_args(torch.float16), 90), (_args(), 80)):
        assert len(tune._prune(configs, args, kind="fwd", arch=arch)) > 1


def test_a_tabled_config_pruning_no_longer_keeps_is_ignored(table, tmp_path):
    configs = tune.gpu_configs("fwd")
    tune._prune(configs, _args(), kind="fwd", arch=90)
    key = tune.LAST_KEYS["fwd"]
    dropped = [c for c in configs if c not in tune.prune_for(configs, _args(), kind="fwd",
                                                             arch=90)]
    gpu_check.adopt_tuned([{"key": key, "config": tune.config_fields(dropped[0])}], table)
    assert len(tune._prune(configs, _args(), kind="fwd", arch=90)) > 1
    # one config per launch (ATTN_TRITON_AUTOTUNE=0) stays the mid-size one, table or not
    gpu_check.adopt_tuned([{"key": key, "config": tune.config_fields(configs[-1])}], table)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTN_TRITON_AUTOTUNE", "0")
        (one,) = tune._prune(configs, _args(), kind="fwd", arch=90)
        assert one == min(tune.prune_for(configs, _args(), kind="fwd", arch=90),
                          key=tune._distance_to_mid)


def test_adopt_refuses_a_row_without_a_config_and_a_folder_without_results(table, tmp_path):
    with pytest.raises(ValueError, match="config"):
        gpu_check.adopt_tuned([{"key": "k", "config": {"BLOCK_M": 64}}], table)
    assert gpu_check.run(gpu_check_args(["--adopt", str(tmp_path / "nothing")]), []) == 2
    assert not table.exists()


def test_the_table_switch_and_the_committed_file(monkeypatch):
    # ATTN_TRITON_TUNED=0 (the tune stage's setting) reads no table; the committed file parses
    path = tune.TUNED
    assert path.is_file()  # installed with the package (pyproject's package data)
    monkeypatch.setenv("ATTN_TRITON_TUNED", "0")
    assert tune.tuned_table() == {}
    monkeypatch.delenv("ATTN_TRITON_TUNED")
    for key, row in tune.tuned_table().items():
        assert key.startswith("sm") and set(row["config"]) == {
            "BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}


def gpu_check_args(argv):
    import argparse

    p = argparse.ArgumentParser()
    gpu_check.add_arguments(p)
    return p.parse_args(argv)


def test_adopt_merges_the_fused_stage_table_too(tmp_path, monkeypatch):
    # the fused-cuda stage writes its table beside the results (the GPU machine's checkout
    # is discarded): --adopt merges it into the committed one by key
    from attn import fused_cuda

    committed = tmp_path / "fused_cuda_table.json"
    committed.write_text(json.dumps({"about": "", "rows": [
        {"key": "old", "exact": True}, {"key": "same", "exact": False}]}))
    monkeypatch.setattr(fused_cuda, "TABLE", committed)
    monkeypatch.setattr(tune, "TUNED", tmp_path / "tuned.json")
    run = _results(tmp_path / "run", [])
    (run / "fused_cuda_table.json").write_text(json.dumps({"about": "", "rows": [
        {"key": "same", "exact": True}, {"key": "new", "exact": True}]}))
    assert gpu_check.run(gpu_check_args(["--adopt", str(run)]), []) == 0
    rows = {r["key"]: r["exact"] for r in json.loads(committed.read_text())["rows"]}
    assert rows == {"old": True, "same": True, "new": True}
