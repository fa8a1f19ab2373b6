"""Every ```python block of the documentation (README.md, docs/*.md, models/README.md) runs
as written, each in a fresh interpreter, and every relative link in it points at a file (and
heading) that exists.

Conventions for authors:
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
# the pages whose blocks run: a new page under docs/ joins without being listed here
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "models" / "README.md"]
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
        raise ValueError(f"the fence opened at line {open_at} is never closed")
    return blocks


def missing_extra(stderr: str) -> str | None:
    """The optional module a failed block lacked, or None if it failed for another reason."""
    # the last ModuleNotFoundError is the one that ended the block
    missing = re.findall(r"^ModuleNotFoundError: No module named '([\w.]+)'$", stderr, re.M)
    if missing and missing[-1].split(".")[0] in OPTIONAL:
        return missing[-1]
    return None


def name_of(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(pages: list[Path] | None = None) -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, code) for every ```python block of ``pages``."""
    return [(name_of(page), line, code) for page in (pages or DOCS)
            for line, info, code in fenced_blocks(page.read_text()) if info == "python"]


# -- links ------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")


def prose_lines(text: str, strip_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks, inline code spans removed unless told."""
    inside = {n for start, _, code in fenced_blocks(text)
              for n in range(start, start + code.count("\n") + 2)}
    return [(n, CODE_SPAN.sub("", line) if strip_code else line)
            for n, line in enumerate(text.splitlines(), 1) if n not in inside]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation (backticks too) dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    found, count = set(), {}
    for _, line in prose_lines(text, strip_code=False):
        m = re.match(r"#{1,6}\s+(.*)$", line)
        if m:
            base = slug(m.group(1))
            n = count.get(base, 0)
            count[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    text = page.read_text()
    bad = []
    for n, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{name_of(page)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                bad.append(f"{name_of(page)}:{n}: {target} (no such heading)")
    return bad


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


def test_links_and_anchors():
    text = ("# A `b`: c\n## A `b`: c\n```md\n# not a heading\n```\n"
            "see [x](#a-b-c) and `[y](nowhere)`\n")
    assert anchors(text) == {"a-b-c", "a-b-c-1"}
    assert [line for _, line in prose_lines(text)][-1] == "see [x](#a-b-c) and "


def test_readme_has_runnable_blocks():
    # the blocks below are the newcomer's path (use, the drop-in, testing kit): if the parser
    # or the fences change so that none is found, the README would go untested
    assert len(python_blocks([README])) >= 3
    assert {page for page, _, _ in python_blocks()} >= {"README.md", "models/README.md"}


@pytest.mark.parametrize("page", DOCS, ids=name_of)
def test_relative_links_resolve(page):
    assert not broken_links(page)


@pytest.mark.parametrize("page, line, code", python_blocks(),
                         ids=[f"{page}:line{line}" for page, line, _ in python_blocks()])
def test_readme_block_runs(page, line, code, tmp_path):
    env = dict(os.environ)
    # import the attn of this checkout, whatever the working directory
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{page} block at line {line} ran past {TIMEOUT_S} s:\n{code}")
    if res.returncode != 0:
        missing = missing_extra(res.stderr)
        if missing is not None:
            pytest.skip(f"{page} block at line {line} needs {missing}, an optional extra")
        pytest.fail(f"{page} block at line {line} failed (exit {res.returncode}):\n"
                     f"{code}\n--- stderr ---\n{res.stderr[-4000:]}")


def test_readmes_own_attention_passes_attn_check():
    """The function README offers as the model of "your attention" passes ``attn check``'s
    quick matrix, not only the one case (Nq = Nk) its block checks: bottom-right causal with
    Nq != Nk both ways, GQA, rows without keys."""
    import ast

    from attn.conformance import check
    from attn.testing import conformance_cases

    code = next(c for _, _, c in python_blocks([README]) if "def my_attention(" in c)
    tree = ast.parse(code)
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom,
                                                        ast.FunctionDef))]
    ns: dict = {}
    exec(compile(tree, "README.md", "exec"), ns)
    result = check(ns["my_attention"], cases=conformance_cases(quick=True), name="README")
    assert result.ok, result.table()
    assert "attn check my_attn.py:my_attention" in README.read_text()
