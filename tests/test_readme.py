"""Every Python block of the documentation (README.md, docs/*.md, models/README.md) runs as
written, in the order a reader runs it: one fresh interpreter per page, the page's blocks one
after another in one namespace (a block may use what an earlier one defined); and every
relative link in it points at a file (and heading) that exists.

Conventions for authors:
- ```python and ```py blocks both run here (so keep them small: seconds on a 2-core CPU);
- a block that cannot run here says why in its info string, ```py needs=REASON, REASON one of
  ``gpu``, ``processes`` or ``hub`` (a GPU, several processes, downloaded weights); the tag is
  checked: an unknown reason, or a block that shows no sign of needing it, fails;
- a page whose run stops only at a missing optional extra (``transformers``, ``triton``,
  ``psutil``: ModuleNotFoundError for that top-level module) is skipped from there, not failed.
"""

from __future__ import annotations

import json
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
TIMEOUT_S = 60  # per block: each should take seconds; this only stops a hung page
OPTIONAL = ("transformers", "triton", "psutil")  # the hf and triton extras
# why a block may stay unrun, and what in its code shows that it needs that
NEEDS = {"gpu": re.compile(r"cuda|triton"),
         "processes": re.compile(r"torch\.distributed|torchrun|init_process_group|spawn"),
         "hub": re.compile(r"from_pretrained")}
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


def needs(info: str) -> str | None:
    """The reason a Python block's info string gives for not running it (``py needs=gpu``),
    or None when it runs. ValueError for a tag outside :data:`NEEDS`."""
    tags = dict(part.partition("=")[::2] for part in info.split()[1:])
    reason = tags.pop("needs", None)
    if tags or (reason is not None and reason not in NEEDS):
        raise ValueError(f"info string {info!r}: the only tag is needs=REASON, REASON one of "
                         f"{sorted(NEEDS)}")
    return reason


def python_blocks(pages: list[Path] | None = None, *, tagged: bool = False
                  ) -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, code) for every Python block of ``pages`` that runs
    (``tagged``: those that say why they do not)."""
    return [(name_of(page), line, code) for page in (pages or DOCS)
            for line, info, code in fenced_blocks(page.read_text())
            if info.split()[:1] in (["python"], ["py"]) and (needs(info) is not None) == tagged]


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


def test_needs_tags_are_checked():
    assert needs("py") is None and needs("python") is None and needs("py needs=gpu") == "gpu"
    for bad in ("py needs=time", "py skip=gpu", "python needs=gpu extra=1"):
        with pytest.raises(ValueError, match="the only tag is needs=REASON"):
            needs(bad)
    text = "```py needs=hub\nm = AutoModel.from_pretrained(p)\n```\n```py\nx = 1\n```\n"
    page = ROOT / "tests" / "_page.md"
    try:
        page.write_text(text)
        assert python_blocks([page], tagged=True) == [("tests/_page.md", 1, "m = AutoModel."
                                                       "from_pretrained(p)\n")]
        assert python_blocks([page]) == [("tests/_page.md", 4, "x = 1\n")]
    finally:
        page.unlink()


@pytest.mark.parametrize("page, line, code", python_blocks(tagged=True),
                         ids=[f"{p}:line{n}" for p, n, _ in python_blocks(tagged=True)])
def test_a_block_left_unrun_shows_what_it_needs(page, line, code):
    """``needs=gpu`` on a block that never names CUDA or triton, say, is a stale excuse."""
    info = next(i for n, i, _ in fenced_blocks((ROOT / page).read_text()) if n == line)
    reason = needs(info)
    assert NEEDS[reason].search(code), (f"{page}:{line} says needs={reason}, but nothing in it "
                                        f"needs that: let it run (plain ```py)")


# one interpreter per page: each block compiled with the page's name and its own line numbers
# (so a traceback points into the page), run in one namespace, after a marker naming it
DRIVER = """import json, sys
page, blocks = json.loads(sys.stdin.read())
ns = {"__name__": "__main__"}
for line, code in blocks:
    print(f"@@ {page} block at line {line}", file=sys.stderr, flush=True)
    exec(compile("\\n" * line + code, page, "exec"), ns)
"""

PAGES = sorted({page for page, _, _ in python_blocks()}, key=[name_of(p) for p in DOCS].index)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_in_reading_order(page, tmp_path):
    blocks = [(line, code) for p, line, code in python_blocks() if p == page]
    env = dict(os.environ)
    # import the attn of this checkout, whatever the working directory
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    limit = TIMEOUT_S * len(blocks)
    try:
        res = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([page, blocks]),
                             cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{page}: its {len(blocks)} blocks ran past {limit} s")
    if res.returncode != 0:
        at = re.findall(r"^@@ (.*)$", res.stderr, re.M)
        where = at[-1] if at else f"{page}, before its first block"
        missing = missing_extra(res.stderr)
        if missing is not None:
            pytest.skip(f"{where} needs {missing}, an optional extra (the page stops there)")
        pytest.fail(f"{where} failed (exit {res.returncode}):\n--- stderr ---\n"
                    f"{res.stderr[-4000:]}")


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
