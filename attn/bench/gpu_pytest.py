"""A pytest plugin for ``attn gpu-check``'s correctness stage (``-p attn.bench.gpu_pytest``):
each test's outcome, duration and failure text, appended as it happens to the run's log.txt
(one line) and to the stage's record (one JSON line), so a run cut by its time box still
reports per-file counts and failures.

Under pytest-xdist the workers' reports reach the controller, where
``pytest_runtest_logreport`` fires for every test of every worker: only the controller
writes (a worker also loads the plugin), and a (test, phase) seen twice is written once.
The paths come from ``ATTN_GPU_CHECK_LOG`` and ``ATTN_GPU_CHECK_ROWS``; without them the
plugin does nothing.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

_seen: set[tuple[str, str]] = set()
_is_worker = False
_collected_written = False

# Files whose cases say most per second of compiling run first (the full-size and backend
# checks); the big parametrized suite last. A run cut by its box has then covered the most.
FIRST = ("test_triton_cuda.py", "test_triton.py", "test_compat.py", "test_api.py",
         "test_api_hardening.py", "test_varlen.py", "test_flex.py", "test_masks.py",
         "test_numerics_hardening.py", "test_compile.py", "test_distributed.py")


def _active() -> bool:
    return bool(os.environ.get("ATTN_GPU_CHECK_LOG") or os.environ.get("ATTN_GPU_CHECK_ROWS"))


def pytest_configure(config) -> None:
    global _is_worker
    _is_worker = hasattr(config, "workerinput")  # pytest-xdist sets it on its workers


def _rank(nodeid: str) -> int:
    name = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return FIRST.index(name) if name in FIRST else len(FIRST)


def pytest_collection_modifyitems(items) -> None:
    if _active():  # a stable sort: every xdist worker gets the same order
        items.sort(key=lambda item: _rank(item.nodeid))


def _write_collected(ids: list[str]) -> None:
    """How many tests each file has in this run, so a cut run says how many never ran."""
    global _collected_written
    rows = os.environ.get("ATTN_GPU_CHECK_ROWS")
    if _collected_written or not rows or not ids:
        return
    _collected_written = True
    per_file = Counter(nodeid.split("::")[0] for nodeid in ids)
    with open(rows, "a") as f:
        for file, n in per_file.items():
            f.write(json.dumps({"row": {"stage": "correctness", "kind": "pytest-collected",
                                        "file": file, "count": n}}) + "\n")


def pytest_collection_finish(session) -> None:
    if not _is_worker:  # without xdist; under it the controller collects nothing
        _write_collected([item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown without it
def pytest_xdist_node_collection_finished(node, ids) -> None:
    _write_collected(list(ids))  # every worker collects the same tests: the first says


def outcome_of(report) -> str | None:
    """The test's outcome from one phase's report, or None when the phase decides nothing
    (a passing setup or teardown)."""
    if report.when == "call":
        return report.outcome  # passed | failed | skipped
    if report.skipped:
        return "skipped"  # skipped in setup (a skip marker, a missing fixture's skip)
    if report.failed:
        return "error"  # setup or teardown failed
    return None


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return (lines[0][1:].strip() if lines else text.splitlines()[-1] if text else "")[:300]


def pytest_runtest_logreport(report) -> None:
    log, rows = os.environ.get("ATTN_GPU_CHECK_LOG"), os.environ.get("ATTN_GPU_CHECK_ROWS")
    if _is_worker or not _active():
        return
    outcome = outcome_of(report)
    if outcome is None or (report.nodeid, report.when) in _seen:
        return
    _seen.add((report.nodeid, report.when))
    message = _message(report) if outcome != "passed" else ""
    if log:
        with open(log, "a") as f:
            f.write(f"[correctness] {outcome.upper()} {report.nodeid} "
                    f"({report.duration:.1f} s){': ' + message if message else ''}\n")
            if outcome in ("failed", "error"):
                f.write("".join(f"    {ln}\n" for ln in report.longreprtext.splitlines()[-30:]))
    if rows:
        row = {"stage": "correctness", "kind": "pytest", "nodeid": report.nodeid,
               "file": report.nodeid.split("::")[0], "outcome": outcome,
               "phase": report.when, "duration": round(report.duration, 2),
               "message": message}
        with open(rows, "a") as f:
            f.write(json.dumps({"row": row}) + "\n")
