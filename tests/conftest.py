import os

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. triton reads this when a kernel is
# decorated, i.e. when attn.flash_triton is first imported: set it before any test module can
# import attn, so the collection order of test files cannot matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # one config per triton launch (the largest _prune keeps) instead of compiling and timing
    # ~20 for every new set of variant flags: hours of compiling on a GPU otherwise
    os.environ.setdefault("ATTN_TRITON_AUTOTUNE", "0")


def _use_this_checkouts_models() -> None:
    """Make attn.models this checkout's models/ folder, whatever the install maps it to.

    pyproject installs models/ as attn.models. An editable install maps that name to the
    tree it was installed from, so tests run from a second checkout sharing the environment
    (a git worktree) would import this checkout's attn but the other tree's models, and
    test code other than the code beside them; without any install, attn.models would not
    import at all. Only then is the folder loaded here, under its installed name.
    """
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folder = root / "models"
    spec = importlib.util.find_spec("attn.models")
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == folder:
        return
    import attn

    if Path(attn.__file__).resolve().parent != root / "attn":
        return  # an installed attn from elsewhere: leave the install's pairing alone
    spec = importlib.util.spec_from_file_location(
        "attn.models", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["attn.models"] = module
    spec.loader.exec_module(module)
    attn.models = module


_use_this_checkouts_models()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
