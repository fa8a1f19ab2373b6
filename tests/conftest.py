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


def _is_triton_backend(value) -> bool:
    """A ``backend`` parameter naming triton: the string, or a suite's backend object."""
    name = value if isinstance(value, str) else getattr(value, "name", None)
    return isinstance(name, str) and name.startswith("triton")


def is_cuda_case(item, gpu: bool) -> bool:
    """Whether ``item`` runs on CUDA on a machine where ``gpu`` says whether one is present.

    Always: a ``cuda`` marker. Only with a GPU: a ``cuda_if_present`` marker (the test moves
    its tensors to CUDA when it can), or a ``backend`` parameter naming triton (compiled
    triton takes CUDA tensors only; without a GPU the same case runs in the interpreter on CPU
    and must keep running there). A device parameter decides nothing: the suites name devices
    in parameters only as bad input ("cuda:99" must raise on any machine).
    """
    if item.get_closest_marker("cuda") is not None:
        return True
    if not gpu:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return (item.get_closest_marker("cuda_if_present") is not None
            or _is_triton_backend(params.get("backend")))


def pytest_itemcollected(item):
    # before -m deselects (pytest_collection_modifyitems), so `-m cuda` selects every case
    # marked here, parametrized ones included
    if is_cuda_case(item, torch.cuda.is_available()) and item.get_closest_marker("cuda") is None:
        item.add_marker(pytest.mark.cuda)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
