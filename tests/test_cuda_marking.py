"""`-m cuda` selects every CUDA case and only those, checked without a GPU.

pytest collects the suite in a child process, once with ``torch.cuda.is_available`` patched to
say yes (what a GPU machine sees at collection) and once as this machine is. A small plugin
records, for every item, what its code says on its own: whether the test function (or a helper
of its module that it calls) reads the module's ``DEVICE`` switch or ``torch.cuda``, whether a
parameter id names the triton backend, and whether its author marked it ``cuda``. Those facts,
not the conftest rule, decide which items a GPU run must select; the test compares them with
what ``-m cuda`` selected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

_PLUGIN = '''
import json, os, types
import pytest, torch

if os.environ.get("FAKE_GPU") == "1":
    torch.cuda.is_available = lambda: True

_items = {}


def _codes(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _reads_gpu(fn, seen):
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = {n for c in _codes(code) for n in c.co_names}
    if "DEVICE" in names or "cuda" in names:
        return True
    g = fn.__globals__
    return any(_reads_gpu(g[n], seen) for n in names
               if isinstance(g.get(n), types.FunctionType) and g[n].__module__ == fn.__module__)


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py adds its markers
def pytest_itemcollected(item):
    callspec = getattr(item, "callspec", None)
    _items[item.nodeid] = {
        "reads_gpu": _reads_gpu(getattr(item, "obj", None), set()),
        "ids": callspec.id.split("-") if callspec else [],
        "declared_cuda": item.get_closest_marker("cuda") is not None}


def pytest_collection_finish(session):
    selected = {i.nodeid: i.get_closest_marker("skip") is not None for i in session.items}
    with open(os.environ["MARKING_DUMP"], "w") as f:
        json.dump({"items": _items, "selected": selected}, f)
'''

# Cases that read the GPU switch but stay on CPU on a GPU machine, and what decides instead.
TRITON_CASE_ONLY = {  # these move to CUDA for their triton case only
    "tests/test_api.py::test_backend_functions_take_their_optional_tensors_as_operands_only",
    "tests/test_api_hardening.py::test_attention_without_keys_gives_zeros_on_every_backend",
    "tests/test_api_hardening.py::test_attention_without_queries_or_batch_is_empty",
}
ON_CPU = {  # gloo ranks on CPU tensors, triton in the interpreter, GPU or not
    "tests/test_distributed.py::test_matches_unsharded_attention",
    # the fused CUDA path on CPU stand-ins for torch's CUDA ops (the capability patched)
    "tests/test_fused_cuda.py::test_auto_on_cuda_takes_fused_only_with_a_verified_entry",
    "tests/test_fused_cuda.py::test_verification_marks_a_correct_op_exact_and_a_broken_one_not",
}


def _start(tmp_path: Path, fake_gpu: bool, files: list[str]):
    """Collect ``files`` in a child pytest (``-m cuda``), with the GPU faked or not."""
    (tmp_path / "marking_dump_plugin.py").write_text(_PLUGIN)
    dump = tmp_path / f"dump-{fake_gpu}.json"
    env = {**os.environ, "MARKING_DUMP": str(dump), "FAKE_GPU": "1" if fake_gpu else "0",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda",
         "-p", "marking_dump_plugin", "-p", "no:cacheprovider", *files],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, dump


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[bool, dict]:
    """Both collections, run side by side (each is a child process importing the suite)."""
    tmp = tmp_path_factory.mktemp("marking")
    started = {True: _start(tmp, True, ["tests"]),
               False: _start(tmp, False, ["tests/test_variants.py", "tests/test_triton.py",
                                          "tests/test_triton_cuda.py"])}
    got = {}
    for fake, (proc, dump) in started.items():
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        got[fake] = json.loads(dump.read_text())
    return got


def _expected_on_gpu(nodeid: str, facts: dict) -> bool:
    test = nodeid.split("[")[0]
    triton = any(part.startswith("triton") for part in facts["ids"])
    if test in ON_CPU:
        return facts["declared_cuda"]
    if test in TRITON_CASE_ONLY:
        return triton
    return facts["declared_cuda"] or facts["reads_gpu"] or triton


def test_on_a_gpu_machine_minus_m_cuda_selects_every_cuda_case_and_only_those(collected):
    got = collected[True]
    items, selected = got["items"], set(got["selected"])
    expected = {n for n, facts in items.items() if _expected_on_gpu(n, facts)}
    missing = sorted(expected - selected)
    extra = sorted(selected - expected)
    assert not missing, f"{len(missing)} CUDA cases not marked cuda, e.g. {missing[:5]}"
    assert not extra, f"{len(extra)} cases marked cuda that stay on CPU, e.g. {extra[:5]}"
    # the shape of the answer, so an empty collection cannot pass
    for must in ("tests/test_variants.py::test_lengths[triton-", "tests/test_variants.py::"
                 "test_lengths[tiled-", "tests/test_triton.py::test_forward_deterministic",
                 "tests/test_triton_cuda.py::", "tests/test_masks.py::", "tests/test_compat.py::"
                 "test_func_on_cuda"):
        assert any(n.startswith(must) for n in selected), must
    assert not any(n.startswith("tests/test_triton_compile.py") for n in selected)


def test_without_a_gpu_only_declared_cuda_tests_are_selected_and_they_skip(collected):
    got = collected[False]
    items, selected = got["items"], got["selected"]
    declared = {n for n, facts in items.items() if facts["declared_cuda"]}
    assert declared and set(selected) == declared
    assert all(selected.values()), "a cuda case without a GPU must be skipped"
    # the triton cases run in the interpreter here: collected, not marked
    assert any("[triton-" in n for n in items) and not any("[triton-" in n for n in selected)
