"""Every ```python block of README.md runs as written, each in a fresh interpreter.

Conventions for README authors:
- ```python blocks run here (so keep them small: seconds on a 2-core CPU);
- ```py blocks are shown, not run: for code that needs a GPU, several processes, or files a
  reader has but the test does not;
- a ```python block whose only failure is a missing optional extra (``transformers``,
  ``triton``: ModuleNotFoundError for that top-level module) is skipped, not failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 60  # each block should take seconds; this only stops a hung one
OPTIONAL = ("transformers", "triton")  # the hf and triton extras
FENCE = re.compile(r"^(`{3,})([^`]*)$")


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, code) for every fenced block."""
    blocks, open_at, info, body, ticks = [], None, "", [], ""
    for lineno, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.rstrip())
        if open_at is None:
            if m:
                open_at, ticks, info, body = lineno, m.group(1), m.group(2).strip(), []
        elif m and m.group(1) == ticks and not m.group(2).strip():
            blocks.append((open_at, info, "\n".join(body) + "\n"))
            open_at = None
        else:
            body.append(line)
    if open_at is not None:
        raise ValueError(f"README.md: the fence opened at line {open_at} is never closed")
    return blocks


def missing_extra(stderr: str) -> str | None:
    """The optional module a failed block lacked, or None if it failed for another reason."""
    # the last ModuleNotFoundError is the one that ended the block
    missing = re.findall(r"^ModuleNotFoundError: No module named '([\w.]+)'$", stderr, re.M)
    if missing and missing[-1].split(".")[0] in OPTIONAL:
        return missing[-1]
    return None


def python_blocks() -> list[tuple[int, str]]:
    return [(line, code) for line, info, code in fenced_blocks(README.read_text())
            if info == "python"]


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n```py\ny\n```\n````md\n```python\nz\n```\n````\n"
    assert fenced_blocks(text) == [(2, "python", "x = 1\n"), (5, "py", "y\n"),
                                   (8, "md", "```python\nz\n```\n")]
    with pytest.raises(ValueError, match="line 2"):
        fenced_blocks("a\n```python\nx = 1\n")


def test_only_a_missing_extra_skips():
    tb = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named '{}'\n"
    assert missing_extra(tb.format("transformers")) == "transformers"
    assert missing_extra(tb.format("triton.language")) == "triton.language"
    assert missing_extra(tb.format("attn.models")) is None  # a broken install fails
    assert missing_extra("NameError: name 'torch' is not defined\n") is None


def test_readme_has_runnable_blocks():
    # the blocks below are the newcomer's path (use, testing kit, modules): if the parser or
    # the fences change so that none is found, the README would go untested
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize("line, code", python_blocks(),
                         ids=[f"line{line}" for line, _ in python_blocks()])
def test_readme_block_runs(line, code, tmp_path):
    env = dict(os.environ)
    # import the attn of this checkout, whatever the working directory
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README.md block at line {line} ran past {TIMEOUT_S} s:\n{code}")
    if res.returncode != 0:
        missing = missing_extra(res.stderr)
        if missing is not None:
            pytest.skip(f"README.md block at line {line} needs {missing}, an optional extra")
        pytest.fail(f"README.md block at line {line} failed (exit {res.returncode}):\n"
                     f"{code}\n--- stderr ---\n{res.stderr[-4000:]}")
