"""What an install puts on sys.path: attn and attn.models, never a top-level `models`; and
what a wheel carries besides the code (the license, py.typed) and says about itself.

The repository keeps models/ at the top level; pyproject maps it to attn.models
(``package-dir``). These tests read pyproject and run setuptools' own PEP 517 backend on a
copy of the sources, so they check what ``pip install`` and ``pip install -e`` would ship
without installing anything.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_on_disk() -> set[str]:
    """Every package folder the install should carry, under its installed name."""
    found = set()
    for prefix, folder in (("attn", ROOT / "attn"), ("attn.models", ROOT / "models")):
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((prefix, *rel)))
    return found


def test_pyproject_lists_every_package_and_no_top_level_models():
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    missing = _packages_on_disk() - listed
    assert not missing, f"pyproject [tool.setuptools] packages is missing {sorted(missing)}"
    assert not any(p == "models" or p.startswith("models.") for p in listed), listed
    assert tool["package-dir"] == {"attn.models": "models"}


def _build(tmp_path: Path, hook: str) -> Path:
    """Run setuptools.build_meta.<hook> on a copy of the sources; return the wheel."""
    # the build backend pyproject asks for: setuptools >= 77 (PEP 639 license fields)
    setuptools = pytest.importorskip("setuptools")
    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} < 77, the build requirement")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("attn", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path / "dist"
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    res = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return out / res.stdout.strip().splitlines()[-1]


def test_wheel_ships_models_as_attn_models_the_license_and_py_typed(tmp_path):
    with zipfile.ZipFile(_build(tmp_path, "build_wheel")) as whl:
        names = whl.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert whl.read(top_level).decode().split() == ["attn"]
        licenses = [n for n in names if "/licenses/" in n and n.endswith("/LICENSE")]
        assert len(licenses) == 1 and licenses[0].startswith("attn-")
        assert whl.read(licenses[0]) == (ROOT / "LICENSE").read_bytes()
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for mod in ("__init__", "gpt", "cache", "config", "data", "train"):
        assert f"attn/models/{mod}.py" in names
    assert not [n for n in names if n.startswith("models/")]
    assert "attn/py.typed" in names  # PEP 561: type checkers read attn's annotations
    assert "License-Expression: MIT" in meta.splitlines()
    assert "Requires-Dist: torch>=2.11" in meta.splitlines()
    # transformers sizes a continuous-batching CPU cache with psutil (docs/hf.md)
    assert 'Requires-Dist: psutil>=5; extra == "hf"' in meta.splitlines()


def test_license_is_mit_as_declared():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the attn authors" in text
    assert _pyproject()["project"]["license"] == "MIT"


def test_torch_floor_is_the_oldest_torch_ci_runs():
    """pyproject's torch floor is the torch of .ci/run's second environment, not lower: an
    older torch is promised nothing by any test."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_torches = {tuple(map(int, v.split("."))) for v in re.findall(r"torch==([\d.]+)", ci)}
    floors = [d for d in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", d)]
    assert len(floors) == 1, floors
    floor = tuple(map(int, re.fullmatch(r"torch>=([\d.]+)", floors[0]).group(1).split(".")))
    assert floor + (0,) * (3 - len(floor)) == min(ci_torches)


def test_changelog_starts_at_this_version():
    import attn

    version = _pyproject()["project"]["version"]
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == version == attn.__version__


def test_attn_version_is_the_packages():
    proc = subprocess.run([sys.executable, "-m", "attn", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"attn {_pyproject()['project']['version']}"


def test_editable_install_maps_attn_models_to_the_models_folder(tmp_path):
    with zipfile.ZipFile(_build(tmp_path, "build_editable")) as whl:
        finder = next(n for n in whl.namelist() if n.endswith("_finder.py"))
        text = whl.read(finder).decode()
    mapping = ast.literal_eval(re.search(r"^MAPPING[^=]*=\s*(\{.*?\})$", text, re.M).group(1))
    src = tmp_path / "src"
    assert mapping == {"attn": str(src / "attn"), "attn.models": str(src / "models")}


def test_tests_import_this_checkouts_attn_and_models():
    # conftest pairs them even when an editable install maps attn.models to another tree
    import attn
    import attn.models
    import attn.models.gpt

    assert Path(attn.__file__).resolve().parent == ROOT / "attn"
    assert Path(attn.models.__file__).resolve().parent == ROOT / "models"
    assert Path(attn.models.gpt.__file__).resolve().parent == ROOT / "models"
    assert attn.models.GPT is attn.models.gpt.GPT


def test_help_version_and_import_attn_leave_torch_unimported():
    """``attn --help`` and ``--version`` answer without torch (a second or more to import);
    so does ``import attn``, whose public names and submodules still all resolve, and a
    wrong name is an AttributeError."""
    code = ("import sys\nfrom attn.bench.cli import main\n"
            "for argv in (['--version'], ['--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'the command imported torch'\n"
            "import attn, attn.bench\n"
            "assert 'torch' not in sys.modules, 'import attn imported torch'\n"
            "ns = {}\nexec('from attn import *', ns)\n"
            "assert not [n for n in attn.__all__ if n not in ns]\n"
            "assert all(getattr(attn.bench, n) is not None for n in attn.bench.__all__)\n"
            "assert attn.tiled.__name__ == 'attn.tiled' and 'patch_sdpa' in dir(attn)\n"
            "try:\n    attn.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, *usage, last = proc.stdout.strip().splitlines()
    assert version == f"attn {_pyproject()['project']['version']}"
    assert usage[0].startswith("usage: attn") and any("report" in u for u in usage)
    assert last == "module 'attn' has no attribute 'no_such_name'"


def test_scripts_run_from_the_checkout_against_a_non_editable_install(tmp_path):
    """README's path: ``pip install .``, then ``python scripts/train.py`` from the checkout
    (generate.py imports the same way; tests/test_train.py runs it). The wheel is installed
    into a folder of its own (``pip install --target``), outside the editable install the
    suite itself runs on, and comes first on the path: the scripts must import that
    installed attn and its attn.models, not the checkout's source attn/, which has no
    models/ folder."""
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                          "--quiet", "--target", str(site), str(_build(tmp_path, "build_wheel"))],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr[-3000:]
    # python -S: the site-packages folders stay on the path (torch, numpy ...), after the
    # install, but their .pth files are not run, so no editable install's finder can supply
    # attn.models
    others = [p for p in sys.path if p and Path(p).is_dir()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *others]))

    def run(*args: str, cwd: Path = ROOT) -> str:
        res = subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stderr[-3000:]}"
        return res.stdout

    where = run("-c", "import attn, attn.models; print(attn.__file__, attn.models.__file__)",
                cwd=tmp_path)
    assert all(Path(f).is_relative_to(site) for f in where.split()), where
    assert "--task" in run("scripts/train.py", "--help")
    out = tmp_path / "run"
    run("scripts/train.py", "--task", "text", "--steps", "2", "--batch-size", "2",
        "--block-size", "16", "--n-layer", "1", "--dim", "32", "--out", str(out),
        "--no-progress")
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
