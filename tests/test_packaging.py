"""What an install puts on sys.path: attn and attn.models, never a top-level `models`.

The repository keeps models/ at the top level; pyproject maps it to attn.models
(``package-dir``). These tests read pyproject and run setuptools' own PEP 517 backend on a
copy of the sources, so they check what ``pip install`` and ``pip install -e`` would ship
without installing anything.
"""

from __future__ import annotations

import ast
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
    # the build backend pyproject asks for: setuptools >= 68, with `wheel` before 70.1
    setuptools = pytest.importorskip("setuptools")
    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (68, 0):
        pytest.skip(f"setuptools {setuptools.__version__} < 68, the build requirement")
    if version < (70, 1):
        pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
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


def test_wheel_ships_models_as_attn_models(tmp_path):
    with zipfile.ZipFile(_build(tmp_path, "build_wheel")) as whl:
        names = whl.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert whl.read(top_level).decode().split() == ["attn"]
    for mod in ("__init__", "gpt", "cache", "config", "data", "train"):
        assert f"attn/models/{mod}.py" in names
    assert not [n for n in names if n.startswith("models/")]


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
