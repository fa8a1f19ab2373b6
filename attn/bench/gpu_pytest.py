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

_seen: set[tuple[str, str]] = set()
_is_worker = False


def pytest_configure(config) -> None:
    global _is_worker
    _is_worker = hasattr(config, "workerinput")  # pytest-xdist sets it on its workers


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
    if _is_worker or not (log or rows):
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
